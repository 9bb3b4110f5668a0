"""A steady tenant beside a flooding one through a real llama.cpp server: what the forward engine's
isolation test (tests/backends/test_isolation_llama.py) and benchmark (benchmarks/bench_isolation_llama.py)
both measure.

The steady tenant streams one chat completion every ``STEADY_GAP_S``; the flood keeps
``FLOOD_STREAMS`` streams of the same bid going (each a long generation, the next sent when one
ends), within its bucket. Times to first token are the client's: from sending to the first content
chunk.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import numpy as np
import trio

from apsd.core.config import TenantConfig
from apsd.core.hookspecs import hookimpl

from tests.helpers import forwarding_config, start_daemon, wait_until

STEADY_GAP_S = 1.0
STEADY_MAX_TOKENS = 8
FLOOD_STREAMS = 20
FLOOD_MAX_TOKENS = 400
#: The steady tenant's prompt: a few hundred tokens, so its prefill is a visible part of its TTFT.
PROMPT = "Summarize the following schedule in one line. " + " ".join(f"slot {i} runs job {i * 7 % 13}."
                                                                     for i in range(40))
TENANTS = {"steady": TenantConfig(rate=1e9, burst=10**12), "flood": TenantConfig(rate=1e9, burst=10**12)}


@attrs.frozen
class Measured:
    alone_ms: list[float]
    flooded_ms: list[float]
    #: The flood's streamed tokens per second while the steady tenant ran beside it.
    flood_tokens_per_s: float
    #: The most requests the flood had on the server at once while the steady tenant was active.
    flood_most_running: int
    #: The steady tenant's waits in apsd's queue beside the flood (ms), in order.
    flooded_queue_ms: list[float] = attrs.field(factory=list)

    @property
    def alone_p99(self) -> float:
        return float(np.percentile(self.alone_ms, 99))

    @property
    def flooded_p99(self) -> float:
        return float(np.percentile(self.flooded_ms, 99))


async def first_token_ms(client: httpx.AsyncClient, tenant: str, model: str, max_tokens: int,
                         prompt: str = PROMPT, on_chunk: Callable[[], None] | None = None) -> tuple[float, int]:
    """Stream one chat completion as ``tenant``; (ms to its first content chunk, content chunks)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True}
    started = time.perf_counter()
    first, chunks = None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"X-Apsd-Tenant": tenant}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content"' in line:
                chunks += 1
                if on_chunk is not None:
                    on_chunk()
                if first is None:
                    first = time.perf_counter()
    assert first is not None
    return (first - started) * 1000, chunks


async def prefill_ms(url: str, model: str, samples: int = 5) -> float:
    """The server's own median time to the first token of the steady prompt, alone (its prefill)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        times = [(await first_token_ms(client, "-", model, 1))[0] for _ in range(samples)]
    return float(np.median(times))


async def warm_up(url: str, model: str, slots: int) -> None:
    """Send ``slots`` requests at once straight to the server: a llama.cpp slot's first request is slow
    (it sets the slot up), which would land on whichever request first finds that slot free."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client, trio.open_nursery() as nursery:
        for _ in range(slots):
            nursery.start_soon(first_token_ms, client, "-", model, 4)


async def steady_beside_flood(server_url: str, model: str, preset: str, *, steady_requests: int,
                              plugins: tuple[Any, ...] = (), slots: int = 4, isolation: bool = True) -> Measured:
    """Run a daemon forwarding to the server (``slots`` slots) under ``preset``: the steady tenant
    alone, then beside the flood (every slot of the server warmed up first)."""
    await warm_up(server_url, model, slots)
    config = forwarding_config([server_url], TENANTS, preset=preset, max_concurrency=slots,
                               first_token_timeout_s=120.0)
    config = attrs.evolve(config, engine=attrs.evolve(config.engine, isolation=isolation))
    waits = QueueWaits()
    async with trio.open_nursery() as nursery:
        running = await start_daemon(nursery, config, plugins=(*plugins, waits))
        engine = running.daemon.pipeline.engines[0]
        await wait_until(lambda: engine.backends[0].healthy)
        limits = httpx.Limits(max_connections=FLOOD_STREAMS + 8, max_keepalive_connections=FLOOD_STREAMS + 8)
        async with httpx.AsyncClient(base_url=running.url, timeout=300, limits=limits) as client:
            async def steady_run() -> list[float]:
                ttfts = []
                for _ in range(steady_requests):
                    ttfts.append((await first_token_ms(client, "steady", model, STEADY_MAX_TOKENS))[0])
                    await trio.sleep(STEADY_GAP_S)
                return ttfts

            alone = await steady_run()
            waits.ms.clear()
            flood_tokens = 0
            most = 0

            def count() -> None:
                nonlocal flood_tokens
                flood_tokens += 1

            async def flood_stream() -> None:
                while True:
                    await first_token_ms(client, "flood", model, FLOOD_MAX_TOKENS, on_chunk=count)

            async def watch() -> None:
                nonlocal most
                while True:
                    most = max(most, engine._per_tenant["flood"])
                    await trio.sleep(0.01)

            async with trio.open_nursery() as flood:
                for _ in range(FLOOD_STREAMS):
                    flood.start_soon(flood_stream)
                await trio.sleep(3.0)  # the flood fills every slot first
                flood.start_soon(watch)
                started, before = time.perf_counter(), flood_tokens
                flooded = await steady_run()
                flood_rate = (flood_tokens - before) / (time.perf_counter() - started)
                flood.cancel_scope.cancel()
        nursery.cancel_scope.cancel()
    return Measured(alone, flooded, flood_rate, most, list(waits.ms))


class QueueWaits:
    """A plugin: the steady tenant's waits in apsd's queue, in ms."""

    def __init__(self) -> None:
        self.ms: list[float] = []

    @hookimpl
    def request_dispatched(self, request: Any, now: float, **_: Any) -> None:
        if request.tenant_id == "steady":
            self.ms.append((now - request.arrival) * 1000)
