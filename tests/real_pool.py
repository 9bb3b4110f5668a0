"""A shared pool's traffic through real servers: what the forward engine's isolation tests
(tests/backends/test_isolation_llama.py) and benchmark (benchmarks/bench_isolation_llama.py) both run.

One or more apsd daemons (replicas sharing a real Redis when there are several) forward to real
servers with the shipped defaults. Traffic, all streamed chat completions, times to first token taken
by the client (from sending to the first content chunk):

* ``busy``: three streams kept going, leaving one of four slots free: beside them the steady tenant's
  time to first token is the *floor*, the best any gateway can give;
* ``flood``: :data:`FLOOD_STREAMS` long streams of the same bid kept going, within its contract;
* ``steady``: one short request every :data:`STEADY_GAP_S`;
* ``newcomers``: tenants that had sent nothing, each arriving with one short request, one after another;
* ``turns``: two tenants on a one-slot server, each sending its next request once it has its answer.

Every stream reads the same document (:data:`PROMPT`); a short request adds its tenant's own
:func:`question` to it.

While it runs, the server is asked every :data:`SLOTS_POLL_S` how many requests it runs (llama.cpp's
``/slots``, vLLM's ``vllm:num_requests_running``): the most it ran at once.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import numpy as np
import trio

from apsd.core.config import ServiceClassConfig, StateConfig, StoreConfig, TenantConfig
from apsd.core.hookspecs import hookimpl
from tests.helpers import forwarding_config, start_daemon, wait_until

STEADY_GAP_S = 1.0
SHORT_TOKENS = 8
FLOOD_STREAMS = 16
FLOOD_TOKENS = 400
BUSY_STREAMS = 3
SLOTS_POLL_S = 0.02
#: The document every stream reads: a prompt of several hundred tokens (its prefill a visible part of a
#: first token's time when not cached).
PROMPT = "Summarize the following schedule in one line. " + " ".join(f"slot {i} runs job {i * 7 % 13}."
                                                                     for i in range(40))
NEWCOMERS = tuple(f"new{i:02d}" for i in range(40))
TENANTS = {name: TenantConfig(rate=1e9, burst=10**12)
           for name in ("steady", "flood", "busy", "a", "b", *NEWCOMERS)}


def question(tenant: str, number: int) -> str:
    """The prompt of ``tenant``'s short request ``number``: :data:`PROMPT`, the document every tenant
    shares (its prefix is cached), then a few characters of its own, new each time, which the server
    reads before the first token, beside the floor's steady tenant as beside the flood. (Byte-identical
    prompts would make a tiny random model's answers identical too, which no pool of real tenants sends:
    llama.cpp then keeps a newcomer's state over that of the stream it paused, whose answer begins with
    the same text.)"""
    return f"{PROMPT} ({tenant} {number})"


async def first_token_ms(client: httpx.AsyncClient, tenant: str, model: str, max_tokens: int, prompt: str = PROMPT,
                         on_chunk: Callable[[], None] | None = None, temperature: float | None = None,
                         routes: list[str] | None = None, service_class: str | None = None) -> tuple[float, str]:
    """Stream one chat completion as ``tenant``; (ms to its first content chunk, its whole text). Its
    ``X-Apsd-Route`` header is added to ``routes``."""
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": prompt}],
                            "max_tokens": max_tokens, "stream": True}
    if temperature is not None:
        body["temperature"] = temperature
    started = time.perf_counter()
    first, parts = None, []
    headers = {"X-Apsd-Tenant": tenant, **({"X-Apsd-Class": service_class} if service_class else {})}
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        if response.status_code == 503 and service_class:   # (deadline_unmeetable: the class's refusal)
            await response.aread()
            return math.inf, ""
        assert response.status_code == 200, await response.aread()
        if routes is not None:
            routes.append(response.headers.get("x-apsd-route", ""))
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            content = _content(line)
            if content:
                parts.append(content)
                if on_chunk is not None:
                    on_chunk()
                if first is None:
                    first = time.perf_counter()
    assert first is not None
    return (first - started) * 1000, "".join(parts)


def _content(line: str) -> str:
    import json
    chunk = json.loads(line[6:])
    return "".join((c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or [])


async def warm_up(url: str, model: str, slots: int) -> None:
    """Send ``slots`` requests at once straight to the server: a llama.cpp slot's first request is slow
    (it sets the slot up), which would land on whichever request first finds that slot free."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client, trio.open_nursery() as nursery:
        for _ in range(slots):
            nursery.start_soon(first_token_ms, client, "-", model, 4)


@attrs.define
class SlotWatch:
    """The most requests the server ran at once, read every :data:`SLOTS_POLL_S`: a llama.cpp server's
    ``/slots``, a vLLM server's ``vllm:num_requests_running`` (``server``)."""

    url: str
    server: str = "llama.cpp"
    most: int = 0
    reads: int = 0

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as client:
            while True:
                try:
                    self.most = max(self.most, await self._running(client))
                    self.reads += 1
                except httpx.RemoteProtocolError:   # (a kept-alive connection the server closed: the next read)
                    pass
                await trio.sleep(SLOTS_POLL_S)

    async def _running(self, client: httpx.AsyncClient) -> int:
        if self.server == "vllm":
            text = (await client.get("/metrics")).text
            return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
                       if line.startswith("vllm:num_requests_running"))
        return sum(bool(s.get("is_processing")) for s in (await client.get("/slots")).json())


class Dispatches:
    """A plugin: each request's wait in apsd's queue (ms) by tenant, and its preemptions."""

    def __init__(self) -> None:
        self.waits: dict[str, list[float]] = {}

    @hookimpl
    def request_dispatched(self, request: Any, now: float, **_: Any) -> None:
        if request.started_at is None and request.preemptions == 0:
            self.waits.setdefault(request.tenant_id, []).append((now - request.arrival) * 1000)


@attrs.define
class Pool:
    """Daemons forwarding to one server, with clients to each and a watch on the server's slots."""

    server_url: str
    model: str
    daemons: list[Any]
    clients: list[httpx.AsyncClient]
    slots: SlotWatch
    dispatches: list[Dispatches]

    @property
    def engines(self) -> list[Any]:
        return [d.daemon.pipeline.engines[0] for d in self.daemons]


@asynccontextmanager
async def open_pool(server_url: str, model: str, *, slots: int = 4, replicas: int = 1, redis_url: str = "",
                    preset: str | None = None, classes: dict[str, ServiceClassConfig] | None = None,
                    server: str = "llama.cpp", backend: dict[str, Any] | None = None) -> AsyncIterator[Pool]:
    """``replicas`` daemons in front of the ``server`` (its kind: ``llama.cpp`` or ``vllm``), sharing
    ``redis_url`` when more than one, the shipped defaults but for the backend's ``max_concurrency`` (its
    ``-np`` or ``--max-num-seqs``), more ``[[backends]]`` keys (``backend``) and ``classes`` (every tenant may
    use each), ready once they see it healthy."""
    config = forwarding_config([server_url], TENANTS, preset=preset, max_concurrency=slots, backend=backend,
                               first_token_timeout_s=120.0, health_timeout_s=30.0)   # (a busy 2-core machine)
    config = attrs.evolve(config, state=StateConfig(kind="off"))   # (nothing of these runs is kept)
    if classes:
        config = attrs.evolve(config, classes=classes, tenants={
            name: attrs.evolve(tenant, classes=tuple(classes)) for name, tenant in config.tenants.items()})
    if redis_url:
        config = attrs.evolve(config, store=StoreConfig(kind="redis", url=redis_url))
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with trio.open_nursery() as nursery:
        daemons, clients, dispatches = [], [], []
        for _ in range(replicas):
            recorder = Dispatches()
            running = await start_daemon(nursery, config, plugins=(recorder,))
            await wait_until(lambda running=running: running.daemon.pipeline.engines[0].backends[0].healthy)
            daemons.append(running)
            dispatches.append(recorder)
            clients.append(httpx.AsyncClient(base_url=running.url, timeout=300, limits=limits))
        watch = SlotWatch(server_url, server)
        nursery.start_soon(watch.run)
        try:
            yield Pool(server_url, model, daemons, clients, watch, dispatches)
        finally:
            for client in clients:
                await client.aclose()
            nursery.cancel_scope.cancel()


@attrs.define
class Streams:
    """Streams of one tenant kept going in the background: their tokens, counted as they arrive."""

    tokens: int = 0

    def count(self) -> None:
        self.tokens += 1


async def keep_streams(client: httpx.AsyncClient, tenant: str, model: str, n: int, max_tokens: int,
                       streams: Streams, nursery: trio.Nursery) -> None:
    async def one() -> None:
        while True:
            await first_token_ms(client, tenant, model, max_tokens, on_chunk=streams.count)

    for _ in range(n):
        nursery.start_soon(one)


async def steady_requests(client: httpx.AsyncClient, model: str, count: int, tenant: str = "steady",
                          busy: list[float] | None = None) -> list[float]:
    """``count`` short requests of ``tenant``, one every :data:`STEADY_GAP_S`: their times to first token
    (and each one's whole time in seconds, into ``busy``)."""
    ttfts = []
    for number in range(count):
        ttfts.append(await _timed(client, tenant, number, model, busy))
        await trio.sleep(STEADY_GAP_S)
    return ttfts


async def _timed(client: httpx.AsyncClient, tenant: str, number: int, model: str, busy: list[float] | None) -> float:
    """Short request ``number`` of ``tenant``: its time to first token (ms); its whole time (s) goes into
    ``busy``."""
    start = time.perf_counter()
    ttft = (await first_token_ms(client, tenant, model, SHORT_TOKENS, prompt=question(tenant, number)))[0]
    if busy is not None:
        busy.append(time.perf_counter() - start)
    return ttft


@attrs.frozen
class Beside:
    """What a tenant saw beside a background tenant, and what the background tenant did meanwhile."""

    ttfts_ms: list[float]
    background_tokens_per_s: float
    #: The most requests the server ran at once.
    server_most: int
    #: The share of the server's slot-seconds the foreground's requests held (their whole times over the
    #: window's slot-seconds): what the background could not have had under any gateway.
    foreground_share: float = 0.0

    @property
    def p99(self) -> float:
        return float(np.percentile(self.ttfts_ms, 99))


async def beside(pool: Pool, *, background: str, streams: int, max_tokens: int, count: int,
                 foreground: Callable[[httpx.AsyncClient, list[float]], Any] | None = None,
                 background_replica: int = 0, foreground_replica: int = -1, settle_s: float = 3.0,
                 slots: int = 4) -> Beside:
    """Keep ``streams`` streams of ``background`` going (through replica ``background_replica``), let them
    fill the slots for ``settle_s``, then run ``foreground`` (default: ``count`` steady requests) through
    replica ``foreground_replica``."""
    counted = Streams()
    async with trio.open_nursery() as nursery:
        await keep_streams(pool.clients[background_replica], background, pool.model, streams, max_tokens, counted,
                           nursery)
        await trio.sleep(settle_s)
        start, before = time.perf_counter(), counted.tokens
        client = pool.clients[foreground_replica]
        busy: list[float] = []
        ttfts = await (foreground(client, busy) if foreground is not None
                       else steady_requests(client, pool.model, count, busy=busy))
        elapsed = time.perf_counter() - start
        rate = (counted.tokens - before) / elapsed
        nursery.cancel_scope.cancel()
    return Beside(ttfts, rate, pool.slots.most, sum(busy) / (elapsed * slots))


async def alone_rate(pool: Pool, tenant: str, streams: int, max_tokens: int, window_s: float,
                     settle_s: float = 3.0) -> float:
    """``tenant``'s streamed tokens per second with ``streams`` streams and nobody else."""
    counted = Streams()
    async with trio.open_nursery() as nursery:
        await keep_streams(pool.clients[0], tenant, pool.model, streams, max_tokens, counted, nursery)
        await trio.sleep(settle_s)
        before = counted.tokens
        await trio.sleep(window_s)
        rate = (counted.tokens - before) / window_s
        nursery.cancel_scope.cancel()
    return rate


def newcomers(model: str, count: int, gap_s: float) -> Callable[[httpx.AsyncClient, list[float]], Any]:
    """A foreground of ``count`` tenants that had sent nothing, one every ``gap_s``, each with one short
    request; their times to first token."""
    async def run(client: httpx.AsyncClient, busy: list[float]) -> list[float]:
        ttfts = []
        for tenant in NEWCOMERS[:count]:
            ttfts.append(await _timed(client, tenant, 0, model, busy))
            await trio.sleep(gap_s)
        return ttfts
    return run


async def take_turns(pool: Pool, rounds: int, max_tokens: int) -> list[tuple[str, float, float]]:
    """Tenants ``a`` and ``b`` each send ``rounds`` requests, the next once the last is answered (``b``
    starting half a request later): per request (tenant, its time to first token in ms, the whole
    request's time in ms)."""
    done: list[tuple[str, float, float]] = []

    async def tenant(name: str, delay: float) -> None:
        await trio.sleep(delay)
        for _ in range(rounds):
            start = time.perf_counter()
            ttft, _ = await first_token_ms(pool.clients[0], name, pool.model, max_tokens)
            done.append((name, ttft, (time.perf_counter() - start) * 1000))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tenant, "a", 0.0)
        nursery.start_soon(tenant, "b", 0.2)
    return done


@attrs.frozen
class ClassMix:
    """Two tenants' mix of a tight and a loose class at a multiple of what the server serves."""

    #: (class, time to first token in ms, or infinity when refused) of each request.
    results: list[tuple[str, float]]
    #: Per class: (met, missed, refused) as apsd counts them.
    counts: dict[str, tuple[int, int, int]]

    def attainment(self, name: str) -> float:
        met, missed, refused = self.counts[name]
        return met / max(1, met + missed + refused)


async def class_mix(pool: Pool, *, rate_per_s: float, duration_s: float, tight_share: float = 0.2,
                    max_tokens: int = 32, seed: int = 1) -> ClassMix:
    """Tenants ``a`` and ``b`` each send chat streams at ``rate_per_s`` / 2 (Poisson arrivals) for
    ``duration_s``: a ``tight_share`` of them in the class ``tight``, the rest in ``loose``."""
    rng = random.Random(seed)
    results: list[tuple[str, float]] = []

    async def one(tenant: str, name: str) -> None:
        ttft, _ = await first_token_ms(pool.clients[0], tenant, pool.model, max_tokens, service_class=name)
        results.append((name, ttft))

    async with trio.open_nursery() as nursery:
        end = trio.current_time() + duration_s
        while trio.current_time() < end:
            nursery.start_soon(one, rng.choice("ab"), "tight" if rng.random() < tight_share else "loose")
            await trio.sleep(rng.expovariate(rate_per_s))
    figures = pool.daemons[0].daemon.pipeline.class_statistics()
    return ClassMix(results, {f.name: (f.met, f.missed, f.refused) for f in figures})


def queue_waits(pool: Pool, tenant_prefix: str) -> list[float]:
    """Waits in apsd's queue (ms) of the tenants whose names start with ``tenant_prefix``, every replica."""
    return [w for d in pool.dispatches for t, waits in d.waits.items() if t.startswith(tenant_prefix) for w in waits]


def p99(values: Sequence[float]) -> float:
    return float(np.percentile(values, 99))
