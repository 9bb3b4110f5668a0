"""Backends: the OpenAI-compatible servers the ``forward`` engine relays to, and the clients that talk to them.

Besides the OpenAI API, a backend may serve Anthropic's Messages API (``/v1/messages``: llama.cpp and
vLLM do): whether it does is asked of it when it first becomes healthy (:meth:`BackendClient.serves_messages`).
Anthropic's usage counts the prompt as ``input_tokens`` plus the cache's ``cache_read_input_tokens`` and
``cache_creation_input_tokens`` (llama.cpp reports the tokens it found in its prefix cache as cache
reads; vLLM reports them all as input), and a stream carries it in ``message_start`` and ``message_delta``.

Ownership: the forward engine owns one :class:`Backend` per ``[[backends]]`` entry (its live
state: health, load, requests in flight, statistics) and one :class:`BackendClient`, through
which every exchange with a server goes. Two clients implement the same protocol:

* :class:`HttpBackendClient` — real servers over HTTP (requests and their streams on the pooled
  connections of :mod:`apsd.engines.upstream`; health, models and metrics through httpx).
* :class:`SimulatedBackendClient` — servers simulated in model time, so the forwarding logic
  (routing, retries, saturation, cancellation) runs in virtual time with the daemon's own code.

Saturation: a backend that exports Prometheus metrics (vLLM's ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc``, llama.cpp's ``llamacpp:requests_deferred``) is saturated while
``[forward] max_waiting`` requests wait in its own queue or ``max_kv_usage`` of its KV cache is in
use: the queue, and with it the priority and fairness decisions, then stays in apsd instead of the
backend's FIFO. A reading older than ``metrics_max_age_s`` is not trusted either way: until a fresh one
comes, ``max_concurrency`` alone bounds the backend, as for one that exports no metrics (a server busy on
every core can take seconds to answer ``/metrics``; holding requests back meanwhile would leave its free
slots idle while they wait).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import reprlib
from collections.abc import Callable
from typing import Any, Protocol

import attrs
import httpx
import orjson
import trio
from prometheus_client.parser import text_string_to_metric_families

from apsd.core.clock import ModelClock
from apsd.core.config import BackendConfig, ForwardConfig
from apsd.core.engine import BackendStatistics
from apsd.engines.upstream import SseSplitter, UpstreamError, UpstreamPool

__all__ = [
    "Backend",
    "BackendAnswer",
    "BackendChunk",
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
    response: dict[str, Any] | None = None
    #: Prompt tokens the backend found in its prefix cache, as it says (:func:`cached_tokens`).
    cached_tokens: int = 0
    #: ``response`` as the backend sent it, relayed to the client byte for byte.
    raw: bytes | None = None


@attrs.define
class BackendChunk:
    """One chunk of a backend's stream, as it arrives (not to be changed: mutable only because a
    frozen class costs more to make, once per streamed chunk)."""

    #: The chunk's JSON object, as the server sent it.
    data: dict[str, Any]
    #: Output tokens it carries, when the client knows (a simulated server does); None: one if it
    #: has text, as an OpenAI-compatible server sends a token per chunk.
    tokens: int | None = None
    #: The event's data as the server sent it, relayed to the client as it is (None: the client
    #: serialises ``data``).
    raw: bytes | None = None


#: Called with each stream chunk as it arrives; it never waits (a plain call: it runs once per relayed chunk).
OnChunk = Callable[[BackendChunk], None]

#: Names of the metrics that give a backend's load, in order of preference.
_WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred", "sglang:num_queue_reqs")
_RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing", "sglang:num_running_reqs")
_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_LOAD_METRICS = frozenset(_WAITING + _RUNNING + _KV_USAGE)
_LOAD_PREFIXES = tuple(sorted({name.split(":")[0] + ":" for name in _LOAD_METRICS}))


def parse_load(text: str) -> BackendLoad | None:
    """The load a Prometheus text exposition reports (values summed over label sets); None when it
    has none of the known metrics.

    Only the samples of those metrics are parsed: the rest of a server's exposition (vLLM's is some
    80 kB, histograms mostly) would cost the event loop tens of milliseconds a reading in
    prometheus_client's parser."""
    samples = "".join(line + "\n" for line in text.splitlines()
                      if line.startswith(_LOAD_PREFIXES) and _metric_name(line) in _LOAD_METRICS)
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(samples):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)

    def first(names: tuple[str, ...]) -> float | None:
        return next((values[n] for n in names if n in values), None)

    load = BackendLoad(waiting=first(_WAITING), running=first(_RUNNING), kv_usage=first(_KV_USAGE))
    return None if load == BackendLoad(None, None, None) else load


def _metric_name(sample_line: str) -> str:
    """The metric name a Prometheus sample line begins with (up to its labels or its value)."""
    end = len(sample_line)
    for stop in ("{", " "):
        at = sample_line.find(stop)
        if 0 <= at < end:
            end = at
    return sample_line[:end]


@attrs.define(eq=False)
class Backend:
    """One server's live state (the forward engine's to update)."""

    config: BackendConfig
    #: The models it serves (configured, or discovered from its /v1/models).
    models: tuple[str, ...] = ()
    #: Down until its first health check passes.
    healthy: bool = False
    #: It went down after being up (its recovery is logged as loudly as its outage was).
    was_down: bool = False
    load: BackendLoad | None = None
    #: Model time of the last metrics reading, and whether it exports metrics at all (None: not known yet).
    load_at: float | None = None
    has_metrics: bool | None = None
    #: How it counts a prompt's tokens: "llama.cpp" (``/apply-template`` + ``/tokenize``), "vllm"
    #: (``/tokenize`` with the messages), "" it cannot; None: not asked yet.
    tokenizer: str | None = None
    #: What kind of server it is (``[[backends]] server``, or found out when it is first healthy:
    #: ``llama.cpp``, ``vllm``, ``sglang``, ``openai``); None: not known yet.
    server: str | None = None
    #: Whether it serves Anthropic's ``/v1/messages`` (asked when it is first healthy); None: not known yet.
    messages: bool | None = None
    in_flight: int = 0
    #: Model time of the last chunk a request of it received (None: none yet): a server streaming to
    #: clients is alive, whatever its health check answered.
    streamed_at: float | None = None
    #: Its last health check failed while it streamed (logged once until one passes).
    health_failing: bool = False
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
        if not self.has_metrics or not self.metrics_fresh(now, settings):
            return False  # (no metrics, or none to trust: max_concurrency alone bounds it)
        load = self.load
        assert load is not None
        return (load.waiting is not None and load.waiting >= settings.max_waiting) or \
            (load.kv_usage is not None and load.kv_usage >= settings.max_kv_usage)

    def metrics_fresh(self, now: float, settings: ForwardConfig) -> bool:
        """Whether its last load reading is younger than ``metrics_max_age_s``."""
        return self.load is not None and self.load_at is not None and now - self.load_at < settings.metrics_max_age_s

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

    async def check_health(self, backend: Backend) -> str | None:
        """None when it passes its health check now, else why it does not (for the log). Never raises."""

    async def read_load(self, backend: Backend) -> BackendLoad | None:
        """Its load from its metrics; None when it exports none; raises BackendError when unreachable."""

    async def complete(self, backend: Backend, api: str, body: dict[str, Any], on_chunk: OnChunk,
                       request_id: str = "", traceparent: str = "") -> BackendAnswer:
        """Send one request (``body`` for ``/v1/<api>``, with ``X-Request-Id: request_id`` and, when the
        request is traced, ``traceparent``: the attempt's span, :mod:`apsd.core.tracing`). Streamed
        (``body["stream"]``): ``on_chunk`` is called with each chunk; the answer carries the usage of
        the last one, checked (:class:`UsageBounds`). Raises BackendError, and nothing else for
        anything the backend sends."""

    async def count_prompt_tokens(self, backend: Backend, api: str, body: dict[str, Any]) -> int | None:
        """The backend's own count of the prompt of ``body`` (chat: as its template renders it), or
        None when it cannot say (no such endpoint, or no answer within ``health_timeout_s``). Never
        raises. Used to charge a request that ended without the backend's usage."""

    async def server_kind(self, backend: Backend) -> str:
        """What kind of server it is: ``llama.cpp``, ``vllm``, ``sglang``, or ``openai`` (none of those,
        or it cannot say). Never raises."""

    async def serves_messages(self, backend: Backend) -> bool | None:
        """Whether it serves Anthropic's Messages API (``POST /v1/messages``); None when it could not
        be asked now (no answer within ``health_timeout_s``: asked again at the next health check).
        Never raises."""

    async def count_output_tokens(self, backend: Backend, model: str | None, text: str) -> int | None:
        """The backend's own count of the tokens of ``text``, output it generated (no special tokens
        added), or None when it cannot say (as :meth:`count_prompt_tokens`). Never raises. Used to
        charge a stream that ended without the backend's usage: its chunks do not say how many
        tokens each carries."""

    async def aclose(self) -> None: ...


# -- real servers over HTTP ---------------------------------------------------------------------------

_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions",
          "embeddings": "/v1/embeddings", "responses": "/v1/responses", "messages": "/v1/messages"}
#: The names of an API's usage figures: (prompt, output).
_USAGE_KEYS = {"responses": ("input_tokens", "output_tokens"), "messages": ("input_tokens", "output_tokens")}
#: What Anthropic's usage counts beside ``input_tokens`` as prompt tokens.
_CACHE_KEYS = ("cache_read_input_tokens", "cache_creation_input_tokens")
#: The fields of an Anthropic request that its ``/v1/messages/count_tokens`` reads.
_COUNTED_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking")
_COMPLETION_USAGE = ("prompt_tokens", "completion_tokens")
#: The Responses API's last stream events, which carry the response and its usage.
_RESPONSE_ENDS = ("response.completed", "response.incomplete", "response.failed")


#: How often, at most, a stream's silence deadline is moved on (see HttpBackendClient.complete).
DEADLINE_STEP_S = 1.0
#: How long the rest of a stream's body (after ``[DONE]``) is waited for, so its connection can be
#: reused; past that the connection is closed.
DRAIN_S = 0.5


class HttpBackendClient:
    """Real servers: requests through an :class:`~apsd.engines.upstream.UpstreamPool` (HTTP/1.1
    keep-alive), the small endpoints (health, models, metrics, tokenize) through httpx; timeouts from
    ``[forward]``."""

    def __init__(self, settings: ForwardConfig) -> None:
        self.settings = settings
        timeout = httpx.Timeout(connect=settings.connect_timeout_s, read=None, write=settings.connect_timeout_s,
                                pool=settings.connect_timeout_s)
        # (trust_env=False: like the requests themselves, the health checks go to the backend directly,
        # whatever HTTP_PROXY says)
        self._client = httpx.AsyncClient(timeout=timeout, trust_env=False)
        self._pool = UpstreamPool(connect_timeout_s=settings.connect_timeout_s)

    @property
    def connections_opened(self) -> int:
        """Upstream connections opened for requests so far (keep-alive reuses the rest)."""
        return self._pool.opened

    async def aclose(self) -> None:
        await self._pool.aclose()
        await self._client.aclose()

    @staticmethod
    def _headers(backend: Backend) -> dict[str, str]:
        key = backend.api_key()
        return {"Authorization": f"Bearer {key}"} if key else {}

    async def _get(self, backend: Backend, path: str) -> httpx.Response:
        """A GET of one of its small endpoints (health, models, metrics), answered within
        ``health_timeout_s``: a stalled server (stopped, hung) is found out in seconds, not minutes.
        Asked once more at once on a fresh connection when the server closed a kept-alive one as it was
        reused (it closes those idle for a few seconds; the GET never reached it): that is not a server
        down."""
        url = backend.config.url.rstrip("/") + path
        try:
            with trio.fail_after(self.settings.health_timeout_s):
                try:
                    return await self._client.get(url, headers=self._headers(backend))
                except httpx.RemoteProtocolError:
                    return await self._client.get(url, headers=self._headers(backend))
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

    async def check_health(self, backend: Backend) -> str | None:
        path = "/health"
        try:
            response = await self._get(backend, path)
            if response.status_code == 404:  # (no /health: an OpenAI server without it)
                path = "/v1/models"
                response = await self._get(backend, path)
        except BackendError as error:
            return error.message
        if response.status_code != 200:
            return f"its {path} answered {response.status_code}: {response.text[:200]}"
        return None

    async def server_kind(self, backend: Backend) -> str:
        probes = (("/props", "llama.cpp", "default_generation_settings"),
                  ("/get_server_info", "sglang", "tokenizer_path"), ("/version", "vllm", "version"))
        for path, kind, key in probes:
            try:
                response = await self._get(backend, path)
                if response.status_code == 200 and key in response.json():
                    return kind
            except (BackendError, ValueError, TypeError):
                continue
        return "openai"

    async def serves_messages(self, backend: Backend) -> bool | None:
        """Asked with a body that is not a request (``{}``): a server that routes ``/v1/messages``
        refuses the body (llama.cpp 500, vLLM 400); one that does not answers 404 or 405. Nothing is
        generated either way."""
        url = backend.config.url.rstrip("/") + _PATHS["messages"]
        try:
            with trio.fail_after(self.settings.health_timeout_s):
                response = await self._client.post(url, json={}, headers=self._headers(backend))
        except (httpx.HTTPError, trio.TooSlowError):
            return None
        return response.status_code not in (404, 405, 501)

    async def read_load(self, backend: Backend) -> BackendLoad | None:
        response = await self._get(backend, "/metrics")
        if response.status_code != 200:
            return None
        try:
            return parse_load(response.text)
        except ValueError:
            return None

    async def _tokenizer(self, backend: Backend, base: str, headers: dict[str, str]) -> str | None:
        """How ``backend`` counts tokens (``backend.tokenizer``), found out on first use: "llama.cpp"
        when its ``/tokenize`` takes llama.cpp's body, asked with an empty text (a server logs the
        bodies it refuses, and a user's text has no place in its log); None: try vLLM's."""
        if backend.tokenizer is None:
            probe = await self._client.post(base + "/tokenize", headers=headers,
                                            json={"content": "", "add_special": False})
            if probe.status_code == 200 and isinstance(probe.json().get("tokens"), list):
                backend.tokenizer = "llama.cpp"
        return backend.tokenizer

    async def count_prompt_tokens(self, backend: Backend, api: str, body: dict[str, Any]) -> int | None:
        base = backend.config.url.rstrip("/")
        headers = self._headers(backend)
        model = body.get("model")
        chat = api == "chat.completions"
        prompt = body.get("prompt") if not chat else None
        if api == "messages":
            return await self._count_message_tokens(backend, body)
        try:
            with trio.fail_after(self.settings.health_timeout_s):
                kind = await self._tokenizer(backend, base, headers)
                if kind == "llama.cpp":
                    if chat:   # its template renders the conversation as it will run it
                        rendered = await self._client.post(base + "/apply-template", json=body, headers=headers)
                        prompt = rendered.json().get("prompt") if rendered.status_code == 200 else None
                    if isinstance(prompt, str):
                        answer = await self._client.post(base + "/tokenize", headers=headers,
                                                          json={"content": prompt, "add_special": True})
                        tokens = answer.json().get("tokens") if answer.status_code == 200 else None
                        if isinstance(tokens, list):
                            return len(tokens)
                    return None
                if kind in (None, "vllm"):
                    ask = {"model": model, "messages": body.get("messages")} if chat else \
                        {"model": model, "prompt": body.get("prompt")}
                    return await self._vllm_count(backend, base, headers, ask)
                return None
        except (httpx.HTTPError, trio.TooSlowError, ValueError, AttributeError, RecursionError):
            return None

    async def _count_message_tokens(self, backend: Backend, body: dict[str, Any]) -> int | None:
        """An Anthropic request's prompt tokens, by its ``/v1/messages/count_tokens``."""
        ask = {key: body[key] for key in _COUNTED_FIELDS if key in body}
        try:
            with trio.fail_after(self.settings.health_timeout_s):
                answer = await self._client.post(backend.config.url.rstrip("/") + "/v1/messages/count_tokens",
                                                 json=ask, headers=self._headers(backend))
                count = answer.json().get("input_tokens") if answer.status_code == 200 else None
        except (httpx.HTTPError, trio.TooSlowError, ValueError, AttributeError, RecursionError):
            return None
        if isinstance(count, int) and not isinstance(count, bool) and 0 <= count <= MAX_REPORTED_TOKENS:
            return count
        return None

    async def count_output_tokens(self, backend: Backend, model: str | None, text: str) -> int | None:
        base = backend.config.url.rstrip("/")
        headers = self._headers(backend)
        try:
            with trio.fail_after(self.settings.health_timeout_s):
                kind = await self._tokenizer(backend, base, headers)
                if kind == "llama.cpp":
                    answer = await self._client.post(base + "/tokenize", headers=headers,
                                                      json={"content": text, "add_special": False, "with_pieces": True})
                    tokens = answer.json().get("tokens") if answer.status_code == 200 else None
                    return _llama_output_count(tokens, text) if isinstance(tokens, list) else None
                if kind in (None, "vllm"):
                    return await self._vllm_count(backend, base, headers,
                                                  {"model": model, "prompt": text, "add_special_tokens": False})
                return None
        except (httpx.HTTPError, trio.TooSlowError, ValueError, AttributeError, RecursionError):
            return None

    async def _vllm_count(self, backend: Backend, base: str, headers: dict[str, str],
                          ask: dict[str, Any]) -> int | None:
        """vLLM's ``/tokenize`` count of ``ask``; a backend that answers it otherwise counts nothing from
        now on (``backend.tokenizer`` becomes "")."""
        answer = await self._client.post(base + "/tokenize", json=ask, headers=headers)
        count = answer.json().get("count") if answer.status_code == 200 else None
        if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
            backend.tokenizer = "vllm"
            return count
        backend.tokenizer = backend.tokenizer or ""
        return None

    async def complete(self, backend: Backend, api: str, body: dict[str, Any], on_chunk: OnChunk,
                       request_id: str = "", traceparent: str = "") -> BackendAnswer:
        url = backend.config.url.rstrip("/") + _PATHS[api]
        messages = api == "messages"
        settings = self.settings
        content = _dumps(body)
        headers = [("Content-Type", "application/json"), *self._headers(backend).items()]
        if request_id:
            headers.append(("X-Request-Id", request_id))
        if traceparent:
            headers.append(("traceparent", traceparent))
        bounds = UsageBounds.of(api, body, content)
        started = False
        try:
            if not body.get("stream"):
                with trio.fail_after(settings.first_token_timeout_s):
                    async with self._pool.request("POST", url, content, headers) as response:
                        answer = await response.read()
                _raise_for_status(backend, response.status, answer)
                data = _json_object(answer)
                prompt, completion = bounds.check(backend, data.get("usage"))
                return BackendAnswer(prompt, completion, data, cached_tokens(data.get("usage"), data.get("timings"),
                                                                             prompt), raw=bytes(answer))
            usage: Any = None
            timings: Any = None
            # One scope for the whole exchange: until the first token (headers included: llama.cpp
            # sends them with its first token) within first_token_timeout_s, then no silence longer
            # than read_timeout_s. Its deadline moves at most once per DEADLINE_STEP_S (moving it
            # at every chunk cost more than the rest of the relay): a silence is found out between
            # read_timeout_s and read_timeout_s + DEADLINE_STEP_S.
            splitter = SseSplitter()
            done = False
            moved = -math.inf
            with trio.CancelScope(deadline=trio.current_time() + settings.first_token_timeout_s) as silence:
                async with self._pool.request("POST", url, content, headers) as response:
                    if response.status != 200:
                        _raise_for_status(backend, response.status, await response.read())
                    async for block in response.iter_bytes():
                        for event in splitter.feed(block):
                            if event.strip() == b"[DONE]":
                                done = True
                                break
                            chunk = _json_object(event)
                            if not isinstance(chunk.get("choices") or [], list):
                                raise MalformedAnswer("a stream chunk's choices are not a list")
                            if "error" in chunk:
                                raise BackendError(502, "backend_failed", f"backend {backend.name}: "
                                                   f"{_error_message(chunk)}", retryable=not started)
                            if messages:   # (its usage: message_start's, updated by message_delta's)
                                kind = chunk.get("type")
                                if kind == "message_start":
                                    message = chunk.get("message")
                                    usage = _merged(usage, message.get("usage") if isinstance(message, dict)
                                                    else message)
                                elif kind == "message_delta":
                                    usage = _merged(usage, chunk.get("usage"))
                                elif kind == "message_stop":
                                    done = True   # (the last event: the connection may be kept)
                            elif chunk.get("usage") is not None:
                                usage, timings = chunk["usage"], chunk.get("timings", timings)
                            elif chunk.get("type") in _RESPONSE_ENDS and isinstance(chunk.get("response"), dict):
                                usage = chunk["response"].get("usage")
                            started = True
                            # (relayed as sent, but for an event whose JSON spans several data lines)
                            on_chunk(BackendChunk(chunk, raw=event if b"\n" not in event else None))
                            if done:
                                break
                        now = trio.current_time()
                        if now - moved >= DEADLINE_STEP_S and started:
                            silence.deadline, moved = now + settings.read_timeout_s + DEADLINE_STEP_S, now
                        if done:   # (the rest, the body's end, usually came with it: the connection is kept)
                            with trio.move_on_after(DRAIN_S):
                                async for _ in response.iter_bytes():
                                    pass
                            break
            if silence.cancelled_caught:
                raise trio.TooSlowError
            prompt, completion = bounds.check(backend, usage)
            return BackendAnswer(prompt, completion, cached_tokens=cached_tokens(usage, timings, prompt))
        except trio.TooSlowError:
            what = "between two tokens" if started else "before the first token"
            raise BackendError(504, "backend_timeout", f"backend {backend.name} was silent {what} for longer "
                               "than [forward] " + ("read_timeout_s" if started else "first_token_timeout_s"),
                               retryable=not started, unhealthy=not started) from None
        except UpstreamError as exc:
            raise BackendError(502, "backend_failed", f"backend {backend.name}: {exc}",
                               retryable=not started, unhealthy=not started) from None
        except MalformedAnswer as exc:   # (not retried: the backend did the work and answered it wrong)
            raise BackendError(502, "backend_failed", f"backend {backend.name} answered malformed JSON: {exc}",
                               retryable=False, unhealthy=True) from None


def _dumps(body: dict[str, Any]) -> bytes:
    """``body`` as JSON (orjson; the standard library for what it refuses: an integer past 64 bits)."""
    try:
        return orjson.dumps(body)
    except (orjson.JSONEncodeError, TypeError):
        return json.dumps(body).encode()


class MalformedAnswer(ValueError):
    """A backend's answer is not the JSON object it should be."""


def _json_object(text: str | bytes) -> dict[str, Any]:
    """A backend's JSON answer or stream chunk, which must be one object (MalformedAnswer otherwise:
    not JSON, ``NaN``/``Infinity`` or a number too large to be finite, which apsd would otherwise
    relay to clients that cannot read them, a lone surrogate, nested deeper than 1,024 levels, or
    not an object). orjson is that strict by itself, and several times faster than the standard
    library here, where every streamed chunk is read."""
    try:
        data = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise MalformedAnswer(str(exc)[:200] or type(exc).__name__) from None
    if not isinstance(data, dict):
        raise MalformedAnswer(f"expected a JSON object, got {type(data).__name__}")
    return data


#: Most tokens a backend may report for any prompt or output: beyond every context window there is.
MAX_REPORTED_TOKENS = 10_000_000
#: Tokens a prompt may have beyond one per byte of its request body (chat templates add a few per
#: message, far fewer than the JSON syntax around each message takes) ...
_TEMPLATE_TOKENS = 1_024
#: ... and per image, audio or file part (whose tokens its bytes do not bound: a URL is short).
_MEDIA_PART_TOKENS = 16_384
_MEDIA_PARTS = re.compile(rb'"type"\s*:\s*"(?:image_url|input_image|input_audio|file|input_file|image|audio)"')


@attrs.frozen
class UsageBounds:
    """What a backend may truthfully report as one request's usage. Every figure of its ``usage``
    is untrusted: a count that is not a whole number, is negative, or passes its bound fails the
    request (:meth:`check`), the backend is suspected (marked down until its health check passes),
    and the tenant is charged only what was seen to arrive.

    A prompt has at most one token per byte of the request's body (every tokenizer in use encodes
    a byte in at most one token), plus a chat template's few, plus a bounded number per media part.
    The output has at most the ``max_tokens`` apsd sent (or :data:`MAX_REPORTED_TOKENS`). An Anthropic
    usage's prompt is its ``input_tokens`` and cache figures together, each and their sum so bounded.
    """

    prompt: int
    completion: int
    #: The names of the two figures in this API's usage.
    keys: tuple[str, str] = _COMPLETION_USAGE
    #: Figures counted in the prompt beside ``keys[0]`` (Anthropic's cache reads and writes).
    also_prompt: tuple[str, ...] = ()

    @classmethod
    def of(cls, api: str, body: dict[str, Any], content: bytes) -> UsageBounds:
        limit = body.get("max_output_tokens" if api == "responses" else "max_tokens")
        completion = limit if isinstance(limit, int) and not isinstance(limit, bool) else MAX_REPORTED_TOKENS
        if api == "embeddings":
            completion = 0
        media = len(_MEDIA_PARTS.findall(content)) if b'"type"' in content else 0
        prompt = min(MAX_REPORTED_TOKENS, len(content) + _TEMPLATE_TOKENS + media * _MEDIA_PART_TOKENS)
        return cls(prompt=prompt, completion=min(completion, MAX_REPORTED_TOKENS),
                   keys=_USAGE_KEYS.get(api, _COMPLETION_USAGE), also_prompt=_CACHE_KEYS if api == "messages" else ())

    def check(self, backend: Backend, usage: Any) -> tuple[int | None, int | None]:
        """``(prompt tokens, output tokens)`` of a backend's ``usage`` (None where absent);
        BackendError when a figure is not a believable count."""
        if usage is None:
            return None, None
        if not isinstance(usage, dict):
            raise _invalid_usage(backend, f"usage is {_shown(usage)}, not an object")
        prompt = _count(backend, usage, self.keys[0], self.prompt)
        for key in self.also_prompt:
            more = _count(backend, usage, key, self.prompt)
            if more is not None:
                prompt = (prompt or 0) + more
        if prompt is not None and prompt > self.prompt:
            raise _invalid_usage(backend, f"its prompt figures add up to {prompt}, more than the {self.prompt} the "
                                 "request's body can hold")
        return prompt, _count(backend, usage, self.keys[1], self.completion)


def cached_tokens(usage: Any, timings: Any, prompt_tokens: int | None) -> int:
    """The prompt tokens a backend says it found in its prefix cache: OpenAI's (and vLLM's)
    ``usage.prompt_tokens_details.cached_tokens`` (the Responses API's ``input_tokens_details``),
    Anthropic's ``usage.cache_read_input_tokens``, else llama.cpp's ``timings.cache_n``; 0 when it says
    nothing believable (the figure only spares the tenant a discount, so a bad one is ignored rather
    than failing the request)."""
    value: Any = None
    if isinstance(usage, dict):
        for name in ("prompt_tokens_details", "input_tokens_details"):
            details = usage.get(name)
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                value = details["cached_tokens"]
                break
        else:
            value = usage.get("cache_read_input_tokens")
    if value is None and isinstance(timings, dict):
        value = timings.get("cache_n")
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or prompt_tokens is None:
        return 0
    return min(value, prompt_tokens)


def _count(backend: Backend, usage: dict[str, Any], key: str, bound: int) -> int | None:
    value = usage.get(key)
    if value is None:
        return None
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= bound:
        raise _invalid_usage(backend, f"usage.{key} is {_shown(value)}, not a whole number of tokens from 0 to {bound}")
    return value


def _merged(usage: Any, more: Any) -> Any:
    """An Anthropic stream's usage so far (``usage``) updated by an event's (``more``): a later figure
    replaces an earlier one (``message_delta`` counts are cumulative). Anything but an object is kept
    as it is, for :meth:`UsageBounds.check` to refuse."""
    if more is None:
        return usage
    if isinstance(more, dict) and (usage is None or isinstance(usage, dict)):
        return {**(usage or {}), **more}
    return more if not isinstance(more, dict) else usage


def _shown(value: Any) -> str:
    """A backend's value for a message: short, whatever it is (reprlib bounds depth and length)."""
    if isinstance(value, int) and not -10**18 < value < 10**18:
        return "an integer of more than 18 digits"
    return reprlib.repr(value)


def _invalid_usage(backend: Backend, what: str) -> BackendError:
    return BackendError(502, "backend_invalid_usage", f"backend {backend.name} reported an impossible usage ({what}); "
                        "the request is failed and the backend suspected", retryable=False, unhealthy=True)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error_message(data: Any) -> str:
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error or data)


def _raise_for_status(backend: Backend, status: int, text: str | bytes) -> None:
    """A backend's error answer: 5xx and 429 may succeed elsewhere; any other 4xx is the request's
    fault and is relayed to the client with the backend's status and message."""
    if status == 200:
        return
    try:
        message = _error_message(json.loads(text))
    except (ValueError, RecursionError):
        message = (text.decode("utf-8", "replace") if isinstance(text, bytes) else text)[:300]
    if status >= 500 or status == 429:
        raise BackendError(502, "backend_failed", f"backend {backend.name} answered {status}: {message}",
                           retryable=True)
    raise BackendError(status, "backend_rejected", f"backend {backend.name} refused the request: {message}",
                       retryable=False)


def _llama_output_count(tokens: list[Any], text: str) -> int:
    """llama.cpp's count of ``text`` from its ``/tokenize`` answer with pieces: a SentencePiece
    tokenizer puts a space before the text (its ``add_space_prefix``), which the model did not generate
    when it came as a token of its own (a first piece that is that space alone); one merged into the
    first word is kept."""
    pieces = [t["piece"] for t in tokens if isinstance(t, dict) and isinstance(t.get("piece"), str)]
    if (len(pieces) > 1 and len(pieces) == len(tokens) and pieces[0] == " "
            and "".join(pieces) == " " + text):
        return len(tokens) - 1
    return len(tokens)


# -- servers simulated in model time ------------------------------------------------------------------

@attrs.define(eq=False)
class SimulatedServer:
    """A backend simulated in model time: at most ``slots`` requests run at once (the rest wait in its
    own FIFO, reported as ``waiting``); a request's first token comes ``ttft_s`` after it starts, then
    one every ``tpot_s``. ``down`` makes it unreachable; ``stalled`` makes it accept connections and
    answer nothing (a stopped process: its health check times out after ``stall_s``, requests hang);
    ``fail_next`` fails that many requests before their first token; ``fail_after_tokens`` breaks
    streams after that many tokens. ``bodies`` records every request body it received.

    Its output is checkable: token ``i`` of an answer reads `` t<i>``. A request that continues an
    answer (a chat or Anthropic message whose last message is the assistant's, continued as ``server``
    does it: by itself for ``llama.cpp``, with ``continue_final_message`` for ``vllm``, chat only; a text
    completion whose prompt ends with such tokens) resumes the count after the tokens it was given, and
    a continuation whose text is not exactly tokens ``0`` to ``k - 1`` is counted in
    ``bad_continuations``. Like llama.cpp, a ``llama.cpp`` server repeats a final assistant message's
    text (the prefill) in its first chunk, or at the start of a whole answer; a chat stream starts with a
    role chunk. It serves Anthropic's ``/v1/messages`` unless ``messages`` is False: its events as
    llama.cpp sends them (``message_start`` with the input tokens, ``content_block_start``, a ``ping``,
    ``content_block_delta`` s, ``content_block_stop``, ``message_delta`` with the output tokens,
    ``message_stop``).

    ``says_chunk_tokens = False`` makes its stream chunks leave their tokens unsaid, as a real server's
    do (its tokenizer then counts one token per `` t<i>``)."""

    models: tuple[str, ...] = ("sim",)
    slots: int = 4
    ttft_s: float = 0.05
    tpot_s: float = 0.01
    down: bool = False
    fail_next: int = 0
    fail_after_tokens: int | None = None
    with_metrics: bool = True
    stalled: bool = False
    stall_s: float = 5.0
    #: How long its ``/metrics`` takes to answer (a server busy on every core).
    metrics_delay_s: float = 0.0
    server: str = "llama.cpp"
    #: Whether it serves Anthropic's ``/v1/messages`` (a request there is refused 404 otherwise).
    messages: bool = True
    says_chunk_tokens: bool = True
    bodies: list[dict[str, Any]] = attrs.field(factory=list[Any])
    bad_continuations: int = 0
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

    async def check_health(self, backend: Backend) -> str | None:
        await trio.lowlevel.checkpoint()
        server = self.servers[backend.name]
        if server.stalled and not server.down:
            await self.clock.sleep(server.stall_s)   # (the client's health timeout)
            return "no answer within health_timeout_s"
        return "it is down" if server.down else None

    async def _stall(self, server: SimulatedServer) -> None:
        """A stalled server answers nothing: wait while it stays stalled."""
        while server.stalled:
            await self.clock.sleep(0.05)

    async def read_load(self, backend: Backend) -> BackendLoad | None:
        await trio.lowlevel.checkpoint()
        server = self._server(backend)
        if server.metrics_delay_s:
            await self.clock.sleep(server.metrics_delay_s)
        return BackendLoad(server.waiting, server.running, None) if server.with_metrics else None

    async def count_prompt_tokens(self, backend: Backend, api: str, body: dict[str, Any]) -> int | None:
        await trio.lowlevel.checkpoint()
        return None if self.servers[backend.name].down else _simulated_prompt_tokens(body)

    async def server_kind(self, backend: Backend) -> str:
        await trio.lowlevel.checkpoint()
        return self.servers[backend.name].server

    async def serves_messages(self, backend: Backend) -> bool | None:
        await trio.lowlevel.checkpoint()
        return self.servers[backend.name].messages

    async def count_output_tokens(self, backend: Backend, model: str | None, text: str) -> int | None:
        await trio.lowlevel.checkpoint()
        return None if self.servers[backend.name].down else len(_SIMULATED_TOKEN.findall(text))

    async def complete(self, backend: Backend, api: str, body: dict[str, Any], on_chunk: OnChunk,
                       request_id: str = "", traceparent: str = "") -> BackendAnswer:
        server = self._server(backend)
        server.bodies.append(body)
        await self._stall(server)
        if api == "messages" and not server.messages:
            await trio.lowlevel.checkpoint()
            raise BackendError(404, "backend_rejected", f"backend {backend.name} refused the request: File Not Found",
                               retryable=False)
        if server.fail_next > 0:
            server.fail_next -= 1
            await trio.lowlevel.checkpoint()
            raise BackendError(502, "backend_failed", f"backend {backend.name} answered 503", retryable=True)
        prompt_tokens = _simulated_prompt_tokens(body)
        tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        echo, first = _continued_from(server, api, body)
        server.waiting += 1
        try:
            await server.semaphore().acquire()
        finally:
            server.waiting -= 1
        server.running += 1
        server.started.append(str(body.get("user") or ""))
        try:
            await self.clock.sleep(server.ttft_s)
            await self._stall(server)
            if not body.get("stream"):
                await self.clock.sleep(server.tpot_s * (tokens - 1))
                text = echo + _simulated_text(first, tokens)
                if api == "messages":
                    usage = {"input_tokens": prompt_tokens, "output_tokens": tokens}
                    return BackendAnswer(prompt_tokens, tokens, {
                        "id": f"msg_sim{len(server.bodies)}", "type": "message", "role": "assistant",
                        "content": [{"type": "text", "text": text}], "model": body.get("model"),
                        "stop_reason": "max_tokens", "stop_sequence": None, "usage": usage})
                key = "message" if api == "chat.completions" else "text"
                choice = {"index": 0, "finish_reason": "length",
                          key: {"role": "assistant", "content": text} if key == "message" else text}
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens,
                         "total_tokens": prompt_tokens + tokens}
                return BackendAnswer(prompt_tokens, tokens, {"object": "chat.completion", "choices": [choice],
                                                             "usage": usage, "model": body.get("model")})
            sent = 0
            if api == "chat.completions":   # (a role chunk first, as servers send)
                on_chunk(BackendChunk({"object": "chat.completion.chunk", "choices": [
                    {"index": 0, "delta": {"role": "assistant", "content": None}}]}, tokens=0))
            elif api == "messages":
                for event in _message_start(f"msg_sim{len(server.bodies)}", body.get("model"), prompt_tokens):
                    on_chunk(BackendChunk(event, tokens=0))
            while sent < tokens:
                n = 1 if sent == 0 else min(self.chunk_tokens, tokens - sent)
                if server.fail_after_tokens is not None and sent + n > server.fail_after_tokens:
                    raise BackendError(502, "backend_failed", f"backend {backend.name}: the stream broke",
                                       retryable=False)
                if sent:
                    await self.clock.sleep(server.tpot_s * n)
                # (llama.cpp echoes the prefill with its first token)
                chunk = _simulated_chunk(api, first + sent, n, echo if not sent else "")
                on_chunk(BackendChunk(chunk, tokens=n if server.says_chunk_tokens else None))
                sent += n
            if api == "messages":
                for event in _message_end(tokens):
                    on_chunk(BackendChunk(event, tokens=0))
                return BackendAnswer(prompt_tokens, tokens)
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens}
            on_chunk(BackendChunk({"object": "chat.completion.chunk", "choices": [], "usage": usage}, tokens=0))
            return BackendAnswer(prompt_tokens, tokens)
        finally:
            server.running -= 1
            server.semaphore().release()


def _simulated_prompt_tokens(body: dict[str, Any]) -> int:
    """A simulated server's tokenizer: a token per 4 bytes of the prompt's JSON (an Anthropic request's
    ``system`` with its messages)."""
    prompt = body.get("prompt") or body.get("messages") or ""
    if body.get("system"):
        prompt = [body["system"], prompt]
    return max(1, len(json.dumps(prompt).encode()) // 4)


def _simulated_text(first: int, tokens: int) -> str:
    """Tokens ``first`` to ``first + tokens - 1`` of a simulated answer."""
    return "".join(f" t{i}" for i in range(first, first + tokens))


_SIMULATED_TOKENS = re.compile(r"(?: t\d+)+$")
#: One token of a simulated answer (its tokenizer's count).
_SIMULATED_TOKEN = re.compile(r" t\d+")


def _continued_from(server: SimulatedServer, api: str, body: dict[str, Any]) -> tuple[str, int]:
    """(the prefill a ``llama.cpp`` server echoes first, "" for none; the token a simulated answer starts
    from): after the run of its tokens that ends the text a continuation gives (a final assistant
    message, continued as ``server`` does it; a text completion's prompt), 0 for a new answer. A run that
    is not tokens ``0`` to ``k - 1`` is a bad continuation."""
    echo = ""
    if api in ("chat.completions", "messages"):
        messages = body.get("messages") or []
        last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
        continued = server.server == "llama.cpp" or (api == "chat.completions" and body.get("continue_final_message"))
        if last.get("role") != "assistant" or not continued:
            return "", 0
        content = last.get("content")
        text = content if isinstance(content, str) else "".join(
            part.get("text", "") for part in content if isinstance(part, dict)) if isinstance(content, list) else ""
        echo = text if server.server == "llama.cpp" else ""
    elif api == "completions" and isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        return "", 0
    match = _SIMULATED_TOKENS.search(text)
    if match is None:
        return echo, 0
    count = match.group(0).count(" t")
    if match.group(0) != _simulated_text(0, count):
        server.bad_continuations += 1
    return echo, count


def _simulated_chunk(api: str, first: int, tokens: int, echo: str = "") -> dict[str, Any]:
    text = echo + _simulated_text(first, tokens)
    if api == "chat.completions":
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    if api == "messages":
        return {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def _message_start(message_id: str, model: Any, prompt_tokens: int) -> list[dict[str, Any]]:
    """The events that open an Anthropic stream, as llama.cpp sends them (and a ping)."""
    return [{"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "content": [], "model": model,
                "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "ping"}]


def _message_end(tokens: int) -> list[dict[str, Any]]:
    """The events that close an Anthropic stream of ``tokens`` output tokens that reached its limit."""
    return [{"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
             "usage": {"output_tokens": tokens}},
            {"type": "message_stop"}]
