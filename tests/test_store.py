"""Replicas sharing tenants' buckets and fair share through a real ``redis-server`` (issue 15).

Every daemon here is a real apsd on 127.0.0.1:0, spoken to over HTTP; they share one Redis started
by the test on a free port. Wall-clock tests (Redis times the buckets in wall seconds): each is
bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
from collections.abc import AsyncIterator

import httpx
import pytest
import trio

from apsd.config import ConfigError, parse_config

from .helpers import LiveDaemon, make_config, start_daemon
from .redis_server import open_redis_server


def store_config(url: str, tenants: dict, *, on_unavailable: str = "local", policy: str = "fair", **extra):
    return make_config({"store": {"kind": "redis", "url": url, "on_unavailable": on_unavailable},
                        "policy": {"preset": policy}, "tenants": tenants, "server": {"port": 0}, **extra})


@contextlib.asynccontextmanager
async def replicas(config, count: int) -> AsyncIterator[list[LiveDaemon]]:
    async with trio.open_nursery() as nursery:
        running = [await start_daemon(nursery, config) for _ in range(count)]
        try:
            yield running
        finally:
            for daemon in running:
                await daemon.client.aclose()
            nursery.cancel_scope.cancel()


PROMPT = "x" * 16  # 4 tokens at 4 characters per token


def infer(tenant: str, tokens: int) -> dict:
    return {"tenant_id": tenant, "prompt": PROMPT, "tokens_requested": tokens, "priority_bid": 5}


def test_a_shared_store_needs_wall_time_and_a_url():
    with pytest.raises(ConfigError, match=r"store.url: required"):
        parse_config({"store": {"kind": "redis"}})
    with pytest.raises(ConfigError, match=r"gpu.time_scale: .* must be 1 with \[store\] kind = \"redis\""):
        parse_config({"store": {"kind": "redis", "url": "redis://127.0.0.1:1/0"}, "gpu": {"time_scale": 0.5}})
    with pytest.raises(ConfigError, match=r"store.on_unavailable: must be \"local\" or \"refuse\""):
        parse_config({"store": {"kind": "redis", "url": "redis://127.0.0.1:1/0", "on_unavailable": "maybe"}})


async def test_three_replicas_admit_one_tenants_rate_between_them():
    """One tenant sent through three replicas, round robin, at twice its rate for 30 s: what they admit
    together stays within burst + rate * T (+5%), and above 0.9 * rate * T."""
    rate, burst, seconds = 200.0, 400, 30.0
    cost = 4 + 6
    async with open_redis_server() as redis:
        config = store_config(redis.url, {"t": {"rate": rate, "burst": burst}})
        async with replicas(config, 3) as daemons:
            outcomes: collections.Counter[int] = collections.Counter()
            clients = itertools.cycle(daemons)

            async def one(daemon: LiveDaemon) -> None:
                response = await daemon.client.post("/infer", json=infer("t", 6))
                outcomes[response.status_code] += 1

            with trio.fail_after(seconds + 30):
                async with trio.open_nursery() as senders:
                    start = trio.current_time()
                    sent = 0
                    while trio.current_time() - start < seconds:
                        senders.start_soon(one, next(clients))
                        sent += 1
                        await trio.sleep_until(start + sent * cost / (2 * rate))
    admitted = outcomes[200] * cost
    print(f"admitted {admitted} tokens in {seconds:g} s: rate * T = {rate * seconds:g}, burst + rate * T = "
          f"{burst + rate * seconds:g}; outcomes {dict(outcomes)}")
    assert set(outcomes) <= {200, 429}, outcomes
    assert admitted <= (burst + rate * seconds) * 1.05, outcomes
    assert admitted >= 0.9 * rate * seconds, outcomes
