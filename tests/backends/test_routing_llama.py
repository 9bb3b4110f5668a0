"""Cache-aware routing through real llama.cpp servers: a small run of benchmarks/bench_routing_llama.py.

Two llama-servers with the tiny model, 4 slots each and no host-memory prompt cache (``--cache-ram 0``), so
each server's prompt cache is its 4 slots. Eight conversations with system prompts of their own, six at a
time, four turns each, through an ``apsd`` process under ``least-loaded`` and then (fresh servers, cold
caches) under ``prefix``. The hit rate is the servers' own count: llama.cpp's ``timings.cache_n`` and
``prompt_n`` in the last chunk of each stream, which must agree with their /metrics counters. Under
``prefix`` each conversation stays on the server that holds it (4 a server fit); under ``least-loaded`` its
turns go wherever fewer requests run, so the servers evict each other's conversations. No timed assertions.
"""

from __future__ import annotations

import httpx
import pytest

from benchmarks.bench_routing_llama import (
    ALIAS,
    FRESH_CONNECTIONS,
    SERVER_ARGS,
    SLOT_CTX,
    PolicyResult,
    Workload,
    run_policy,
    stream_turn,
    system_prompt,
)
from tests.llama_server import (  # noqa: F401  (fixtures)
    llama_server_binary,
    open_llama_server,
    tiny_model,
)

SMALL = Workload(servers=2, slots=4, conversations=8, turns=4, in_flight=6, system_words=300, think_s=0.5,
                 deadline_s=60.0)


async def test_the_servers_count_a_repeated_prompt_as_cached(llama_server_binary, tiny_model, tmp_path):
    """What the hit rate is made of: the same conversation twice on one server, then its next turn. The
    second answer's ``cache_n`` covers the whole prompt but its last token; the next turn's covers at least
    the first prompt; ``cache_n + prompt_n`` is always the prompt's tokens."""
    async with open_llama_server(tiny_model, alias=ALIAS, binary=llama_server_binary, parallel=1,
                                 ctx=SLOT_CTX, extra_args=SERVER_ARGS, log_dir=tmp_path) as server, \
            httpx.AsyncClient(base_url=server.url, timeout=60, limits=FRESH_CONNECTIONS) as client:
        messages = [{"role": "system", "content": system_prompt(0, 300)}, {"role": "user", "content": "hello"}]
        _, answer, first, usage, _ = await stream_turn(client, messages, 4)
        assert first["cache_n"] == 0 and first["prompt_n"] == usage["prompt_tokens"] > 500
        _, _, again, usage, _ = await stream_turn(client, messages, 4)
        assert again["cache_n"] == usage["prompt_tokens"] - 1 and again["prompt_n"] == 1
        longer = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "and then?"}]
        _, _, turn, usage, _ = await stream_turn(client, longer, 4)
        assert turn["cache_n"] >= first["prompt_n"] and turn["cache_n"] + turn["prompt_n"] == usage["prompt_tokens"]


async def test_prefix_routing_raises_the_servers_cache_hit_rate(llama_server_binary, tiny_model, tmp_path):
    results: dict[str, PolicyResult] = {}
    for policy in ("least-loaded", "prefix"):
        logs = tmp_path / policy
        logs.mkdir()
        results[policy] = r = await run_policy(policy, SMALL, tiny_model, llama_server_binary, logs)
        moved, later = r.moved()
        print(f"{policy}: hit rate {r.hit_rate:.1%} (/metrics {r.metrics_hit_rate:.1%}), split "
              f"{r.split(SMALL.max_tokens)}, later turns moved {moved}/{later}, reasons {dict(r.reasons())}")
        assert not r.errors
        assert len(r.records) == SMALL.requests
        # the servers' two counts agree: the per-response timings are the servers' own
        assert r.hit_rate == pytest.approx(r.metrics_hit_rate, abs=1e-9)
        assert sum(r.split(SMALL.max_tokens)) == SMALL.requests
        assert all(rec.route.startswith("s") for rec in r.records)   # X-Apsd-Route on every answer
    assert results["prefix"].reasons()["cache_match"] > 0
    assert results["prefix"].hit_rate > results["least-loaded"].hit_rate
