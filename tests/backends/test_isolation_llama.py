"""Isolation through a real llama.cpp server (4 slots, a model streaming tens of tokens a second):
a steady tenant beside a same-bid tenant holding 20 streams, on the shipped defaults (`fair`,
isolation on). Real HTTP both ways, real processes. benchmarks/bench_isolation_llama.py measures the
same for fifo, aps, fair and vtc against the goal (twice alone plus one prefill): times are the
machine's, so this test checks what isolation does, not how fast the machine does it. (Without
isolation the steady tenant waits for a flood request to end: tests/unit/test_forward.py shows it in
virtual time, the benchmark through this server.)"""

from __future__ import annotations

from tests.llama_server import (  # noqa: F401  (fixtures)
    llama_server_binary,
    slow_llama_server,
    slow_model,
)
from tests.real_isolation import steady_beside_flood


async def test_a_steady_tenant_beside_a_flood_gets_a_free_slot_at_once(slow_llama_server):
    """The flood never takes the slot held for the steady tenant, so each steady request is sent to the
    server at once (a flood request takes tens of seconds: waiting for one would show)."""
    measured = await steady_beside_flood(slow_llama_server.url, "slow", "fair", steady_requests=8)
    print(f"steady p99 alone {measured.alone_p99:.0f} ms, beside the flood "
          f"{measured.flooded_p99:.0f} ms; flood {measured.flood_tokens_per_s:.0f} tokens/s")
    assert measured.flood_most_running == 3
    assert measured.flood_tokens_per_s > 0
    assert len(measured.flooded_queue_ms) == 8 and max(measured.flooded_queue_ms) < 1000
