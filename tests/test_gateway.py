"""apsd in front of real llama.cpp servers (``llama-server``, a tiny model written by the tests):
forwarding, two backends, a backend killed under load, settlement against the backend's usage, and
priority order while the backends are saturated. Real HTTP both ways, real processes."""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx
import pytest
import trio

from apsd.config import ServerConfig, TenantConfig, parse_config

from .helpers import start_daemon
from .llama_server import (  # noqa: F401  (fixtures)
    SLOW_MODEL,
    llama_server,
    llama_server_binary,
    open_llama_server,
    slow_model,
    tiny_model,
)

#: Buckets that hold far more than the tests use and do not refill during a test: what is missing from
#: one at the end is exactly what its requests were charged.
TENANTS = {"t": TenantConfig(rate=1e-6, burst=10**9), "u": TenantConfig(rate=1e-6, burst=10**9)}


def gateway_config(servers, *, preset="aps", max_concurrency=4, **forward):
    settings = {"health_interval_s": 0.2, "metrics_interval_s": 0.1, **forward}
    config = parse_config({"policy": {"preset": preset},
                           "backends": [{"url": s.url, "name": f"b{i}", "max_concurrency": max_concurrency}
                                        for i, s in enumerate(servers)],
                           "forward": settings}, "<test>")
    return attrs.evolve(config, server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=2.0), tenants=TENANTS)


async def wait_until(predicate, limit_s=10.0, step_s=0.05):
    with trio.fail_after(limit_s):
        while not predicate():
            await trio.sleep(step_s)


def backends_up(daemon, n):
    return lambda: sum(b.healthy for b in daemon.pipeline.engines[0].backends) == n


def infer(tenant="t", tokens=8, bid=5, prompt="Hello there, how are you?"):
    return {"tenant_id": tenant, "prompt": prompt, "tokens_requested": tokens, "priority_bid": bid}


async def test_infer_is_forwarded_and_settled_against_the_backends_usage(nursery, llama_server):
    running = await start_daemon(nursery, gateway_config([llama_server]))
    await wait_until(backends_up(running.daemon, 1))
    async with running.client as client:
        answer = (await client.post("/infer", json=infer(tokens=9))).json()
        assert answer["tokens_generated"] == 9            # the tiny model never stops early
        assert answer["engine_id"] == 0 and answer["ttft_ms"] > 0
        status = (await client.get("/tenants/t/status")).json()
        # the tenant's counters and bucket follow the backend's usage, not apsd's estimate
        assert status["generated_tokens"] == 9 and status["prompt_tokens"] == answer["prompt_tokens"]
        bucket = running.daemon.pipeline.admission.buckets["t"]
        assert bucket.level(running.daemon.pipeline.clock.now()) == pytest.approx(
            10**9 - answer["prompt_tokens"] - 9, abs=1)
        text = (await client.get("/metrics")).text
        assert 'apsd_backend_up{backend="b0"} 1.0' in text
        assert 'apsd_backend_tokens_total{backend="b0",phase="completion"} 9.0' in text
    running.daemon.request_shutdown()


async def test_two_backends_share_the_load_and_one_killed_mid_load_loses_nothing(nursery, llama_server_binary,
                                                                                  slow_model, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path / "a",
                                 parallel=2) as a, \
            open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path / "b",
                              parallel=2) as b:
        running = await start_daemon(nursery, gateway_config([a, b], max_concurrency=2, max_retries=3))
        await wait_until(backends_up(running.daemon, 2))
        answers: list[httpx.Response] = []
        async with running.client as client, trio.open_nursery() as load:
            async def one(i: int) -> None:
                answers.append(await client.post("/infer", json=infer(tokens=40, bid=1 + i % 10)))

            for i in range(24):
                load.start_soon(one, i)
            engine = running.daemon.pipeline.engines[0]
            await wait_until(lambda: all(backend.requests >= 2 for backend in engine.backends))
            a.process.kill()                      # a backend dies with requests in flight
        assert len(answers) == 24
        statuses = sorted(r.status_code for r in answers)
        completed = [r.json() for r in answers if r.status_code == 200]
        failed = [r.json() for r in answers if r.status_code != 200]
        # requests in flight on the killed backend after their first token fail (502); the rest,
        # queued or not started yet, are retried on the other one
        assert all(f["error"] in ("backend_failed", "backend_timeout") for f in failed), statuses
        assert len(completed) >= 24 - 2 and all(c["tokens_generated"] == 40 for c in completed)
        b0, b1 = running.daemon.pipeline.statistics().backends
        assert not b0.healthy and b1.healthy and b0.failures >= 1 and b1.requests >= 12
        counts = running.daemon.pipeline.statistics().books.requests
        assert counts.completed + counts.failed == 24 and counts.conservation_ok
        running.daemon.request_shutdown()


async def test_while_the_backend_is_saturated_the_queue_keeps_apsds_priority_order(nursery, llama_server_binary,
                                                                                    slow_model, tmp_path):
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path,
                                 parallel=1) as server:
        running = await start_daemon(nursery, gateway_config([server], preset="static", max_concurrency=1))
        await wait_until(backends_up(running.daemon, 1))
        finished: list[int] = []
        async with running.client as client, trio.open_nursery() as load:
            async def one(bid: int, tokens: int) -> None:
                response = await client.post("/infer", json=infer(tokens=tokens, bid=bid))
                assert response.status_code == 200
                finished.append(bid)

            load.start_soon(one, 5, 60)          # occupies the only slot for a while
            await wait_until(lambda: running.daemon.pipeline.engines[0].backends[0].in_flight == 1)
            for _ in range(4):
                load.start_soon(one, 1, 4)       # low bids queue in apsd, in arrival order...
            await wait_until(lambda: running.daemon.pipeline.scheduler.queue_depth == 4)
            load.start_soon(one, 10, 4)          # ...and a late high bid goes first
            await wait_until(lambda: running.daemon.pipeline.scheduler.queue_depth == 5)
        assert finished == [5, 10, 1, 1, 1, 1]
        running.daemon.request_shutdown()
