"""Isolation through a real llama.cpp server (4 slots, a model streaming tens of tokens a second):
a steady tenant beside a same-bid tenant holding 20 streams, on the shipped defaults (`fair`,
isolation on). Real HTTP both ways, real processes; benchmarks/bench_isolation_llama.py measures
the same for fifo, aps, fair and vtc."""

from __future__ import annotations

from tests.llama_server import (  # noqa: F401  (fixtures)
    llama_server_binary,
    slow_llama_server,
    slow_model,
)
from tests.real_isolation import prefill_ms, steady_beside_flood


async def test_a_steady_tenant_beside_a_flood_gets_a_slot_and_its_first_token_near_its_time_alone(slow_llama_server):
    """The flood never holds the slot kept for the steady tenant, and the steady tenant's p99 time to
    first token stays within twice its time alone plus one prefill of its prompt on the server."""
    prefill = await prefill_ms(slow_llama_server.url, "slow")
    measured = await steady_beside_flood(slow_llama_server.url, "slow", "fair", steady_requests=10)
    print(f"prefill {prefill:.0f} ms; steady p99 alone {measured.alone_p99:.0f} ms, beside the flood "
          f"{measured.flooded_p99:.0f} ms; flood {measured.flood_tokens_per_s:.0f} tokens/s")
    assert measured.flood_most_running == 3
    assert measured.flood_tokens_per_s > 0
    assert measured.flooded_p99 <= 2 * measured.alone_p99 + prefill
