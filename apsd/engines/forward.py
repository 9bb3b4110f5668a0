"""The ``forward`` engine: relays requests to real OpenAI-compatible servers (``[[backends]]``).

One engine routes to every backend. It asks the scheduler for work sized to the free slots of
its usable backends, per model (``Capacity.slots_per_model``): a backend is usable while healthy,
not saturated (:mod:`apsd.engines.backends`) and below its ``max_concurrency``. So requests wait
in apsd's queue, in its policy's order, rather than in a backend's FIFO.

Each dispatched request goes to the least-loaded usable backend serving its model (a request
without a model, from ``POST /infer``, to any), in a task of its own:

* The client's OpenAI body is sent as it came (parameters apsd does not interpret pass through
  untouched), with ``max_tokens`` set to what admission reserved when the client gave none. A
  stream always asks the backend for usage (``stream_options.include_usage``); the usage chunk
  is relayed only if the client asked for it.
* Tokens reach the client's stream as they arrive, one chunk at a time, waiting while the
  client's buffer is full (backpressure reaches the backend through TCP).
* The end settles against the backend's usage: ``prompt_tokens`` and ``tokens_generated`` become
  the backend's figures, and admission gives back or takes the difference with what it reserved.
* A client that leaves cancels the request at once: the upstream request is closed (freeing the
  backend's slot), and it is billed for the tokens that had arrived.
* A backend that fails before the first token (unreachable, timed out, 5xx or 429) is marked
  down if it looks so, and the request goes back to the queue in its place, to be dispatched to
  another backend, at most ``[forward] max_retries`` times; then 502 ``backend_failed``. After the
  first token, a failure ends the stream with an error and the request counts as failed. A 4xx
  is the request's own fault: its status and message are relayed.

Health (``[forward] health_interval_s``) and metrics (``metrics_interval_s``) are read by one task
per backend; a down backend takes no work and comes back by itself. A backend without configured
``models`` serves what its ``/v1/models`` lists, read when it first becomes healthy.

Cost: per token (``cost_per_1m_*_tokens_usd``) and/or per GPU-hour (a request pays its duration x
the backend's hourly price x ``gpus`` / ``max_concurrency``).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import attrs
import trio

from ..clock import ModelClock
from ..config import Config, ForwardConfig
from ..ledger import Ledger
from ..models import Capacity, Completion, Dispatch, InferenceRequest, Refusal
from ..streams import TokenChunk
from .backends import Backend, BackendClient, BackendError, BackendStatistics
from .base import UNBOUNDED, Demand, EngineStatistics, completion

__all__ = ["ForwardEngine"]

log = logging.getLogger("apsd.engines.forward")


@attrs.define(eq=False)
class ForwardEngine:
    """See the module docstring."""

    engine_id: int
    backends: list[Backend]
    client: BackendClient
    ledger: Ledger
    clock: ModelClock
    settings: ForwardConfig
    #: Puts a request that failed before its first token back in the queue (the scheduler's).
    requeue: Callable[[InferenceRequest, str], None]
    kind: str = attrs.field(default="forward", init=False)
    _running: dict[InferenceRequest, trio.CancelScope] = attrs.field(factory=dict, init=False)
    #: The backends a requeued request already failed on.
    _tried: dict[InferenceRequest, set[str]] = attrs.field(factory=dict, init=False)
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    _demands: trio.MemorySendChannel[Demand] | None = attrs.field(default=None, init=False)
    _asked: bool = attrs.field(default=False, init=False)
    #: The last answer was empty: no asking until capacity changes.
    _blocked: bool = attrs.field(default=False, init=False)
    #: The scope of the engine's wait for an answer: cancelled when it should look at its room again.
    _wait_scope: trio.CancelScope | None = attrs.field(default=None, init=False)
    _dispatches: int = attrs.field(default=0, init=False)
    _tokens: int = attrs.field(default=0, init=False)
    _busy_s: float = attrs.field(default=0.0, init=False)
    _cost_usd: float = attrs.field(default=0.0, init=False)

    # -- the seam --------------------------------------------------------------------------------
    def refuse(self, request: InferenceRequest) -> Refusal | None:
        return None  # (a backend says what it cannot take; a 4xx is relayed)

    def models(self) -> list[str]:
        names: dict[str, None] = {}
        for backend in self.backends:
            for name in backend.models:
                names.setdefault(name, None)
        return list(names)

    def free(self) -> Capacity:
        now = self.clock.now()
        slots: dict[str, int] = {}
        total = 0
        for backend in self.backends:
            free = backend.free(now, self.settings)
            total += free
            for name in backend.models:
                slots[name] = slots.get(name, 0) + free
        return Capacity(sequences=total, kv_tokens=UNBOUNDED, reserve_output=False, slots_per_model=slots)

    def cancel(self, request: InferenceRequest) -> bool:
        scope = self._running.get(request)
        if scope is None:
            return False
        scope.cancel()
        return True

    def reconfigure(self, config: Config) -> list[str]:
        return []  # ([[backends]] and [forward] need a restart: Pipeline.reconfigure says so)

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            engine_id=self.engine_id, kind=self.kind, running=len(self._running), waiting=0, kv_tokens_used=0,
            kv_tokens_capacity=0, busy_s=self._busy_s, cost_usd=self._cost_usd, dispatches=self._dispatches,
            tokens_generated=self._tokens, preemptions=0)

    def backend_statistics(self) -> tuple[BackendStatistics, ...]:
        now = self.clock.now()
        return tuple(backend.statistics(now, self.settings) for backend in self.backends)

    def _changed_now(self) -> None:
        """Capacity may have grown (a request ended, a backend came back): the engine may ask again."""
        self._blocked = False
        if self._wait_scope is not None and not self._asked:
            self._wait_scope.cancel()

    # -- the loop --------------------------------------------------------------------------------
    async def serve(self, demands: trio.MemorySendChannel[Demand],
                    answers: trio.MemoryReceiveChannel[Dispatch]) -> None:
        """Watch the backends, ask for work while they have room, start a task per request."""
        try:
            async with demands, answers, trio.open_nursery() as nursery:
                self._nursery, self._demands = nursery, demands
                for backend in self.backends:
                    nursery.start_soon(self._watch, backend)
                try:
                    await self._run(answers)
                except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self.client.aclose()

    async def _run(self, answers: trio.MemoryReceiveChannel[Dispatch]) -> None:
        while True:
            self._ask()
            with trio.CancelScope() as self._wait_scope:   # an answer, or more room (_changed_now)
                self._take(await answers.receive())
            self._wait_scope = None

    def _ask(self) -> None:
        if self._asked or self._blocked:
            return
        free = self.free()
        if free.sequences > 0:
            assert self._demands is not None
            self._asked = True
            self._demands.send_nowait(Demand(self))

    def _take(self, dispatch: Dispatch) -> None:
        self._asked = False
        if not dispatch.requests:
            # the next request in queue order fits none of the free slots (its model's backends are
            # full): ask again only once something changed, or this would spin
            self._blocked = True
            return
        self._dispatches += 1
        assert self._nursery is not None
        previous: trio.Event | None = None   # requests are sent in dispatch (queue) order
        for request in dispatch.requests:
            if request.answered:
                continue
            backend = self._pick(request)
            if backend is None:  # (it went down or filled up since the cut: back in line, no retry spent)
                self.requeue(request, "no backend could take it any more")
                request.retries -= 1
                continue
            backend.in_flight += 1
            scope = trio.CancelScope()
            self._running[request] = scope
            sent = trio.Event()
            self._nursery.start_soon(self._forward, request, backend, scope, previous, sent)
            previous = sent

    def _pick(self, request: InferenceRequest) -> Backend | None:
        """The least-loaded usable backend serving the request's model, one it has not failed on
        first (a retry goes elsewhere when it can)."""
        now = self.clock.now()
        tried = self._tried.get(request, ())
        usable = [b for b in self.backends if b.free(now, self.settings) > 0
                  and (request.model is None or request.model in b.models)]
        return min(usable, key=lambda b: (b.name in tried, b.in_flight / b.config.max_concurrency, b.in_flight),
                   default=None)

    # -- one request -------------------------------------------------------------------------------
    def _body(self, request: InferenceRequest, backend: Backend) -> tuple[str, dict, bool]:
        """The API, the body to send, and whether the client asked for usage in its stream."""
        if request.payload is not None and request.api is not None:
            api, body = request.api, copy.deepcopy(request.payload)
        else:  # POST /infer: a plain completion of its prompt
            api, body = "completions", {"prompt": request.prompt}
        body["model"] = request.model or backend.models[0]
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = request.tokens_requested
        wants_usage = False
        if request.stream is not None:
            options = body.get("stream_options")
            wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            body["stream"] = True
            body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        else:
            body["stream"] = False
            body.pop("stream_options", None)
        return api, body, wants_usage

    async def _forward(self, request: InferenceRequest, backend: Backend, scope: trio.CancelScope,
                       after: trio.Event | None, sent: trio.Event) -> None:
        """Send ``request`` (once the one dispatched before it was sent: a backend's own queue then
        receives a dispatch in apsd's order) and see it to its end."""
        start = self.clock.now()
        backend.requests += 1
        api, body, wants_usage = self._body(request, backend)
        stream = request.stream

        held: list[dict] = []

        async def on_chunk(chunk: dict) -> None:
            tokens = chunk.pop("apsd_tokens", None)   # (the simulated client says how many it sent)
            text = _chunk_text(chunk)
            if tokens is None:
                tokens = 1 if text else 0
            now = self.clock.now()
            if tokens and request.started_at is None:
                self.ledger.started(request, now)
            request.tokens_generated += tokens
            if stream is not None:
                if chunk.get("usage") is not None and not wants_usage:
                    chunk = {k: v for k, v in chunk.items() if k != "usage"}
                    if not chunk.get("choices"):
                        return  # (a usage-only chunk the client did not ask for)
                if request.started_at is None:
                    held.append(chunk)  # (a role chunk: held until a token comes, so a retry elsewhere
                    return              # cannot send the client a second one)
                for early in held:
                    await stream.push(TokenChunk(tokens=0, at=now, data=early))
                held.clear()
                await stream.push(TokenChunk(tokens=tokens, text=text, at=now, data=chunk))

        outcome: Completion | Refusal | None = None
        requeue: str | None = None
        try:
            with scope:
                try:
                    if after is not None:
                        await after.wait()
                    sent.set()
                    answer = await self.client.complete(backend, api, body, on_chunk)
                except BackendError as error:
                    outcome, requeue = self._failed(request, backend, error)
                except Exception as exc:  # a bug or a surprise: the request must still be answered
                    log.exception("forwarding request %s to backend %s failed", request.request_id, backend.name)
                    outcome = Refusal(502, "backend_failed", f"forwarding to backend {backend.name} failed: "
                                      f"{type(exc).__name__}", kind="failed")
                else:
                    outcome = self._completed(request, backend, answer, start)
            if scope.cancelled_caught:   # its client left: billed for what arrived
                outcome = Refusal(499, "client_disconnected", "the client disconnected while the request was running",
                                  kind="cancelled")
        finally:
            sent.set()
            backend.in_flight -= 1
            del self._running[request]
            self._account(request, backend, start)
            if requeue is not None and not request.answered:
                self._tried.setdefault(request, set()).add(backend.name)
                self.requeue(request, requeue)
            else:
                self._tried.pop(request, None)
                if outcome is not None:
                    self.ledger.finish(request, outcome)
            self._changed_now()

    def _completed(self, request: InferenceRequest, backend: Backend, answer, start: float) -> Completion:
        now = self.clock.now()
        if answer.prompt_tokens is not None:
            request.prompt_tokens = int(answer.prompt_tokens)
        if answer.completion_tokens is not None:
            request.tokens_generated = int(answer.completion_tokens)
        if request.started_at is None:  # not streamed: its first token is seen with its last
            self.ledger.started(request, now)
        request.cost_usd = self._cost(request, backend, now - start)
        return completion(request, engine_id=self.engine_id, end=now, response=answer.response)

    def _failed(self, request: InferenceRequest, backend: Backend,
                error: BackendError) -> tuple[Refusal | None, str | None]:
        """The answer, or (before the first token, a failure another backend may not have, retries
        left) the reason to put it back in the queue."""
        backend.failures += 1
        if error.unhealthy and backend.healthy:
            backend.healthy = False
            log.warning("backend %s marked down: %s", backend.name, error.message)
            self._changed_now()
        started = request.started_at is not None
        if error.retryable and not started and request.retries < self.settings.max_retries:
            backend.retries += 1
            log.info("request %s failed on backend %s before its first token; back in the queue (%s)",
                     request.request_id, backend.name, error.message)
            return None, error.message
        return Refusal(error.status if not started else 502, error.code, error.message, kind="failed"), None

    def _cost(self, request: InferenceRequest, backend: Backend, duration: float) -> float:
        c = backend.config
        per_token = (request.prompt_tokens * c.cost_per_1m_prompt_tokens_usd
                     + request.tokens_generated * c.cost_per_1m_output_tokens_usd) / 1e6
        per_time = duration * c.cost_per_gpu_hour_usd * c.gpus / 3600.0 / c.max_concurrency
        return per_token + per_time

    def _account(self, request: InferenceRequest, backend: Backend, start: float) -> None:
        duration = self.clock.now() - start
        cost = self._cost(request, backend, duration)
        request.cost_usd = cost
        backend.cost_usd += cost
        backend.prompt_tokens += request.prompt_tokens if request.started_at is not None else 0
        backend.completion_tokens += request.tokens_generated
        self._tokens += request.tokens_generated
        self._busy_s += duration / backend.config.max_concurrency
        self._cost_usd += cost
        self.ledger.engine_ran(duration / backend.config.max_concurrency, cost)

    # -- watching the backends ---------------------------------------------------------------------
    async def _watch(self, backend: Backend) -> None:
        """Health every ``health_interval_s``, metrics every ``metrics_interval_s``; forever."""
        settings = self.settings
        next_health = next_metrics = self.clock.now()
        while True:
            now = self.clock.now()
            if now >= next_health:
                next_health = now + settings.health_interval_s
                await self._check_health(backend)
            reads_metrics = backend.healthy and backend.has_metrics is not False
            if reads_metrics and self.clock.now() >= next_metrics:
                next_metrics = self.clock.now() + settings.metrics_interval_s
                await self._read_metrics(backend)
            await self.clock.sleep_until(min(next_health, next_metrics) if reads_metrics else next_health)

    async def _check_health(self, backend: Backend) -> None:
        healthy = await self.client.check_health(backend)
        if healthy and not backend.models:
            try:
                backend.models = tuple(await self.client.list_models(backend))
            except BackendError as error:
                log.warning("backend %s: cannot list its models: %s", backend.name, error.message)
                healthy = False
        if healthy != backend.healthy:
            backend.healthy = healthy
            log.warning("backend %s is %s", backend.name, "up" if healthy else "down")
            self._changed_now()

    async def _read_metrics(self, backend: Backend) -> None:
        try:
            load = await self.client.read_load(backend)
        except BackendError:
            return  # (stale metrics make it saturated; the health check decides whether it is down)
        was = backend.saturated(self.clock.now(), self.settings)
        if load is None:
            if backend.has_metrics is None:
                log.info("backend %s exports no known load metrics: max_concurrency alone bounds it", backend.name)
            backend.has_metrics = False
        else:
            backend.has_metrics, backend.load, backend.load_at = True, load, self.clock.now()
        if was and not backend.saturated(self.clock.now(), self.settings):
            self._changed_now()


def _chunk_text(chunk: dict) -> str:
    """The text a stream chunk adds (chat ``delta.content`` or completion ``text``)."""
    text = []
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
            text.append(delta["content"])
        elif isinstance(choice.get("text"), str):
            text.append(choice["text"])
    return "".join(text)
