"""Backends: the OpenAI-compatible servers the ``forward`` engine relays to, and the clients that talk to them.

Ownership: the forward engine owns one :class:`Backend` per ``[[backends]]`` entry (its live
state: health, load, requests in flight, statistics) and one :class:`BackendClient`, through
which every exchange with a server goes. Two clients implement the same protocol:

* :class:`HttpBackendClient` — real servers over HTTP (httpx; streams parsed with httpx-sse).
* :class:`SimulatedBackendClient` — servers simulated in model time, so the forwarding logic
  (routing, retries, saturation, cancellation) runs in virtual time with the daemon's own code.

Saturation: a backend that exports Prometheus metrics (vLLM's ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``, llama.cpp's ``llamacpp:requests_deferred``) is saturated while
``[forward] max_waiting`` requests wait in its own queue or ``max_kv_usage`` of its KV cache is in
use, and while its last reading is older than ``metrics_max_age_s``: the queue, and with it the
priority and fairness decisions, then stays in apsd instead of the backend's FIFO.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import attrs
import httpx
import trio
from httpx_sse import EventSource
from prometheus_client.parser import text_string_to_metric_families

from ..clock import ModelClock
from ..config import BackendConfig, ForwardConfig

__all__ = [
    "Backend",
    "BackendAnswer",
    "BackendClient",
    "BackendError",
    "BackendLoad",
    "BackendStatistics",
    "HttpBackendClient",
    "SimulatedBackendClient",
    "SimulatedServer",
    "parse_load",
]

log = logging.getLogger("apsd.engines.forward")


class BackendError(Exception):
    """A backend did not answer a request as it should.

    ``status`` and ``code`` are what apsd answers the client; ``retryable``: another backend
    may well succeed (unreachable, timed out, 5xx, 429); ``unhealthy``: this backend looks
    down (mark it so until its health check passes).
    """

    def __init__(self, status: int, code: str, message: str, *, retryable: bool, unhealthy: bool = False) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.retryable, self.unhealthy = retryable, unhealthy


@attrs.frozen
class BackendLoad:
    """A backend's own view of its load, from its metrics (None: it does not export that figure)."""

    waiting: float | None
    running: float | None
    kv_usage: float | None


@attrs.frozen
class BackendAnswer:
    """How a forwarded request ended: the backend's usage, and its JSON answer if not streamed."""

    prompt_tokens: int | None
    completion_tokens: int | None
    response: dict | None = None


#: Called with each stream chunk (the backend's JSON object) as it arrives.
OnChunk = Callable[[dict], Awaitable[None]]

#: Names of the metrics that give a backend's load, in order of preference.
_WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred", "sglang:num_queue_reqs")
_RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing", "sglang:num_running_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")


def parse_load(text: str) -> BackendLoad | None:
    """The load a Prometheus text exposition reports (values summed over label sets); None when it
    has none of the known metrics."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)

    def first(names: tuple[str, ...]) -> float | None:
        return next((values[n] for n in names if n in values), None)

    load = BackendLoad(waiting=first(_WAITING), running=first(_RUNNING), kv_usage=first(_KV_USAGE))
    return None if load == BackendLoad(None, None, None) else load


@attrs.frozen
class BackendStatistics:
    """One backend, as of now, for ``/metrics``."""

    name: str
    url: str
    models: tuple[str, ...]
    healthy: bool
    saturated: bool
    in_flight: int
    max_concurrency: int
    requests: int
    failures: int
    retries: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    waiting: float | None
    kv_usage: float | None


@attrs.define(eq=False)
class Backend:
    """One server's live state (the forward engine's to update)."""

    config: BackendConfig
    #: The models it serves (configured, or discovered from its /v1/models).
    models: tuple[str, ...] = ()
    #: Down until its first health check passes.
    healthy: bool = False
    load: BackendLoad | None = None
    #: Model time of the last metrics reading, and whether it exports metrics at all (None: not known yet).
    load_at: float | None = None
    has_metrics: bool | None = None
    in_flight: int = 0
    requests: int = 0
    failures: int = 0
    retries: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.models = self.models or self.config.models

    @property
    def name(self) -> str:
        return self.config.label

    def api_key(self) -> str:
        """The key to send it (``api_key_env`` read now, so a restart picks up a rotated one)."""
        if self.config.api_key_env:
            return os.environ.get(self.config.api_key_env, "")
        return self.config.api_key

    def saturated(self, now: float, settings: ForwardConfig) -> bool:
        """Whether it should take no more work now (see the module docstring)."""
        if not self.has_metrics:
            return False  # (no metrics: max_concurrency alone bounds it)
        if self.load is None or self.load_at is None or now - self.load_at > settings.metrics_max_age_s:
            return True
        load = self.load
        return (load.waiting is not None and load.waiting >= settings.max_waiting) or \
            (load.kv_usage is not None and load.kv_usage >= settings.max_kv_usage)

    def free(self, now: float, settings: ForwardConfig) -> int:
        """Requests it can take now: 0 while down or saturated."""
        if not self.healthy or not self.models or self.saturated(now, settings):
            return 0
        return max(0, self.config.max_concurrency - self.in_flight)

    def statistics(self, now: float, settings: ForwardConfig) -> BackendStatistics:
        load = self.load
        return BackendStatistics(
            name=self.name, url=self.config.url, models=self.models, healthy=self.healthy,
            saturated=self.saturated(now, settings), in_flight=self.in_flight,
            max_concurrency=self.config.max_concurrency, requests=self.requests, failures=self.failures,
            retries=self.retries, prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
            cost_usd=self.cost_usd, waiting=load.waiting if load else None, kv_usage=load.kv_usage if load else None)


class BackendClient(Protocol):
    """Every exchange with a backend (real or simulated)."""

    async def list_models(self, backend: Backend) -> list[str]:
        """The model ids its ``/v1/models`` lists; raises BackendError."""

    async def check_health(self, backend: Backend) -> bool:
        """Whether it answers its health check now (never raises)."""

    async def read_load(self, backend: Backend) -> BackendLoad | None:
        """Its load from its metrics; None when it exports none; raises BackendError when unreachable."""

    async def complete(self, backend: Backend, api: str, body: dict, on_chunk: OnChunk) -> BackendAnswer:
        """Send one request (``body`` for ``/v1/<api>``). Streamed (``body["stream"]``): ``on_chunk`` is
        awaited with each chunk; the answer carries the usage of the last one. Raises BackendError."""

    async def aclose(self) -> None: ...


# -- real servers over HTTP ---------------------------------------------------------------------------

_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


class HttpBackendClient:
    """Real servers, through one pooled httpx client; timeouts from ``[forward]``."""

    def __init__(self, settings: ForwardConfig) -> None:
        self.settings = settings
        timeout = httpx.Timeout(connect=settings.connect_timeout_s, read=None, write=settings.connect_timeout_s,
                                pool=settings.connect_timeout_s)
        self._client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                              max_keepalive_connections=256))

    async def aclose(self) -> None:
        await self._client.aclose()

    @staticmethod
    def _headers(backend: Backend) -> dict[str, str]:
        key = backend.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _get(self, backend: Backend, path: str) -> httpx.Response:
        try:
            with trio.fail_after(self.settings.first_token_timeout_s):
                return await self._client.get(backend.config.url.rstrip("/") + path, headers=self._headers(backend))
        except (httpx.HTTPError, trio.TooSlowError) as exc:
            raise BackendError(502, "backend_unreachable", f"backend {backend.name}: {_describe(exc)}",
                               retryable=True, unhealthy=True) from None

    async def list_models(self, backend: Backend) -> list[str]:
        response = await self._get(backend, "/v1/models")
        try:
            response.raise_for_status()
            return [str(model["id"]) for model in response.json()["data"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            raise BackendError(502, "backend_failed", f"backend {backend.name}: /v1/models: {_describe(exc)}",
                               retryable=True) from None

    async def check_health(self, backend: Backend) -> bool:
        try:
            response = await self._get(backend, "/health")
            if response.status_code == 404:  # (no /health: an OpenAI server without it)
                response = await self._get(backend, "/v1/models")
        except BackendError:
            return False
        return response.status_code == 200

    async def read_load(self, backend: Backend) -> BackendLoad | None:
        response = await self._get(backend, "/metrics")
        if response.status_code != 200:
            return None
        try:
            return parse_load(response.text)
        except ValueError:
            return None

    async def complete(self, backend: Backend, api: str, body: dict, on_chunk: OnChunk) -> BackendAnswer:
        url = backend.config.url.rstrip("/") + _PATHS[api]
        settings = self.settings
        started = False
        try:
            if not body.get("stream"):
                with trio.fail_after(settings.first_token_timeout_s):
                    response = await self._client.post(url, json=body, headers=self._headers(backend))
                _raise_for_status(backend, response.status_code, response.text)
                data = response.json()
                usage = data.get("usage") or {}
                return BackendAnswer(usage.get("prompt_tokens"), usage.get("completion_tokens"), data)
            usage: dict = {}
            async with self._client.stream("POST", url, json=body, headers=self._headers(backend)) as response:
                if response.status_code != 200:
                    await response.aread()
                    _raise_for_status(backend, response.status_code, response.text)
                # one scope for the whole stream, its deadline moved on at each chunk (cheaper than
                # a fail_after per chunk)
                with trio.CancelScope(deadline=trio.current_time() + settings.first_token_timeout_s) as silence:
                    async for event in EventSource(response).aiter_sse():
                        if event.data.strip() == "[DONE]":
                            break
                        chunk = json.loads(event.data)
                        if not isinstance(chunk, dict):
                            raise ValueError("a stream chunk is not a JSON object")
                        if "error" in chunk:
                            raise BackendError(502, "backend_failed", f"backend {backend.name}: "
                                               f"{_error_message(chunk)}", retryable=not started)
                        usage = chunk.get("usage") or usage
                        started = True
                        await on_chunk(chunk)
                        silence.deadline = trio.current_time() + settings.read_timeout_s
                if silence.cancelled_caught:
                    raise trio.TooSlowError
            return BackendAnswer(usage.get("prompt_tokens"), usage.get("completion_tokens"))
        except trio.TooSlowError:
            what = "between two tokens" if started else "before the first token"
            raise BackendError(504, "backend_timeout", f"backend {backend.name} was silent {what} for longer "
                               "than [forward] " + ("read_timeout_s" if started else "first_token_timeout_s"),
                               retryable=not started, unhealthy=not started) from None
        except httpx.HTTPError as exc:
            raise BackendError(502, "backend_failed", f"backend {backend.name}: {_describe(exc)}",
                               retryable=not started, unhealthy=not started) from None
        except ValueError as exc:  # (malformed JSON from the backend)
            raise BackendError(502, "backend_failed", f"backend {backend.name} answered malformed JSON: {exc}",
                               retryable=not started) from None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_message(data: Any) -> str:
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or data)


def _raise_for_status(backend: Backend, status: int, text: str) -> None:
    """A backend's error answer: 5xx and 429 may succeed elsewhere; any other 4xx is the request's
    fault and is relayed to the client with the backend's status and message."""
    if status == 200:
        return
    try:
        message = _error_message(json.loads(text))
    except ValueError:
        message = text[:300]
    if status >= 500 or status == 429:
        raise BackendError(502, "backend_failed", f"backend {backend.name} answered {status}: {message}",
                           retryable=True)
    raise BackendError(status, "backend_rejected", f"backend {backend.name} refused the request: {message}",
                       retryable=False)


# -- servers simulated in model time ------------------------------------------------------------------

@attrs.define(eq=False)
class SimulatedServer:
    """A backend simulated in model time: at most ``slots`` requests run at once (the rest wait in its
    own FIFO, reported as ``waiting``); a request's first token comes ``ttft_s`` after it starts, then
    one every ``tpot_s``. ``down`` makes it unreachable; ``fail_next`` fails that many requests
    before their first token; ``fail_after_tokens`` breaks streams after that many tokens."""

    models: tuple[str, ...] = ("sim",)
    slots: int = 4
    ttft_s: float = 0.05
    tpot_s: float = 0.01
    down: bool = False
    fail_next: int = 0
    fail_after_tokens: int | None = None
    with_metrics: bool = True
    running: int = 0
    waiting: int = 0
    started: list[str] = attrs.field(factory=list)
    _free: trio.Semaphore | None = None

    def semaphore(self) -> trio.Semaphore:
        if self._free is None:
            self._free = trio.Semaphore(self.slots)
        return self._free


@attrs.define(eq=False)
class SimulatedBackendClient:
    """:class:`SimulatedServer` s by backend name; streams deliver tokens in chunks of ``chunk_tokens``
    (so a simulation's cost grows with chunks, not tokens)."""

    clock: ModelClock
    servers: dict[str, SimulatedServer]
    chunk_tokens: int = 8

    async def aclose(self) -> None:
        pass

    def _server(self, backend: Backend) -> SimulatedServer:
        server = self.servers[backend.name]
        if server.down:
            raise BackendError(502, "backend_unreachable", f"backend {backend.name}: connection refused",
                               retryable=True, unhealthy=True)
        return server

    async def list_models(self, backend: Backend) -> list[str]:
        await trio.lowlevel.checkpoint()
        return list(self._server(backend).models)

    async def check_health(self, backend: Backend) -> bool:
        await trio.lowlevel.checkpoint()
        return not self.servers[backend.name].down

    async def read_load(self, backend: Backend) -> BackendLoad | None:
        await trio.lowlevel.checkpoint()
        server = self._server(backend)
        return BackendLoad(server.waiting, server.running, None) if server.with_metrics else None

    async def complete(self, backend: Backend, api: str, body: dict, on_chunk: OnChunk) -> BackendAnswer:
        server = self._server(backend)
        if server.fail_next > 0:
            server.fail_next -= 1
            await trio.lowlevel.checkpoint()
            raise BackendError(502, "backend_failed", f"backend {backend.name} answered 503", retryable=True)
        prompt = body.get("prompt") or body.get("messages") or ""
        prompt_tokens = max(1, len(json.dumps(prompt)) // 4)
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        server.waiting += 1
        try:
            await server.semaphore().acquire()
        finally:
            server.waiting -= 1
        server.running += 1
        server.started.append(str(body.get("user") or ""))
        try:
            await self.clock.sleep(server.ttft_s)
            if not body.get("stream"):
                await self.clock.sleep(server.tpot_s * (tokens - 1))
                text = " tok" * tokens
                key = "message" if api == "chat.completions" else "text"
                choice = {"index": 0, "finish_reason": "length",
                          key: {"role": "assistant", "content": text} if key == "message" else text}
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                         "total_tokens": prompt_tokens + tokens}
                return BackendAnswer(prompt_tokens, tokens, {"object": "chat.completion", "choices": [choice],
                                                             "usage": usage, "model": body.get("model")})
            sent = 0
            while sent < tokens:
                n = 1 if sent == 0 else min(self.chunk_tokens, tokens - sent)
                if server.fail_after_tokens is not None and sent + n > server.fail_after_tokens:
                    raise BackendError(502, "backend_failed", f"backend {backend.name}: the stream broke",
                                       retryable=False)
                if sent:
                    await self.clock.sleep(server.tpot_s * n)
                sent += n
                await on_chunk(_simulated_chunk(api, n))
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
            await on_chunk({"object": "chat.completion.chunk", "choices": [], "usage": usage})
            return BackendAnswer(prompt_tokens, tokens)
        finally:
            server.running -= 1
            server.semaphore().release()


def _simulated_chunk(api: str, tokens: int) -> dict:
    text = " tok" * tokens
    if api == "chat.completions":
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}],
                "apsd_tokens": tokens}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}], "apsd_tokens": tokens}
