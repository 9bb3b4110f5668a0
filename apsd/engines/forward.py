"""The ``forward`` engine: relays requests to real OpenAI-compatible servers (``[[backends]]``).

One engine routes to every backend. It asks the scheduler for work sized to the free slots of
its usable backends, per model (``Capacity.slots_per_model``): a backend is usable while healthy,
not saturated (:mod:`apsd.engines.backends`) and below its ``max_concurrency``. So requests wait
in apsd's queue, in its policy's order, rather than in a backend's FIFO.

Each dispatched request goes to a backend serving its model (a request without a model, from
``POST /infer``, to any) that the routing policy chooses (``[routing] policy``,
:mod:`apsd.core.routing`: by default the one holding the longest part of its conversation in its
prefix cache, unless load is out of balance), in a task of its own. The policy sees every healthy
backend serving the model, with its load and whether it has room; one the request already failed on
is left out while another remains. Where it went and why is stamped on the request
(``request.route``: the ``X-Apsd-Route`` header) and counted (:meth:`ForwardEngine.route_decisions`).

* The client's OpenAI body is sent as it came (parameters apsd does not interpret pass through
  untouched), its output limit set to what admission reserved under every name the client gave
  it by (``max_tokens``, llama.cpp's ``n_predict``, ``max_new_tokens``); a client that gave none
  gets none (``open_ended``: the backend decides, the tenant pays what ran). A stream always asks
  the backend for usage (``stream_options.include_usage``); the usage chunk is relayed only if
  the client asked for it.
* Tokens reach the client's stream as they arrive, never waiting for the client: the backend's
  slot is freed at the backend's pace, a slow reader only delays itself, and the request is
  charged what the backend generated (what waits for a slow reader is bounded by its output limit,
  and a reader that takes nothing for ``[server] send_timeout_s`` is dropped).
* The end settles against the backend's usage: ``prompt_tokens`` and ``tokens_generated`` become
  the backend's figures, and admission gives back or takes the difference with what it reserved.
  Usage is untrusted: a figure that is not a believable count fails the request and the backend
  is suspected (:class:`~apsd.engines.backends.UsageBounds`).
* A client that leaves cancels the request at once: the upstream request is closed (freeing the
  backend's slot), and it is billed for the tokens that had arrived.
* A backend that fails before the first token (unreachable, timed out, 5xx or 429) is marked
  down if it looks so, and the request goes back to the queue in its place, to be dispatched to
  another backend, at most ``[forward] max_retries`` times; then 502 ``backend_failed``. After the
  first token, a failure ends the stream with an error and the request is charged what arrived.
  A 4xx is the request's own fault: its status and message are relayed.
* Every exchange is bounded in time: connecting (``connect_timeout_s``), the first token, headers
  included (``first_token_timeout_s``; the whole answer when not streamed), each later chunk
  (``read_timeout_s``), and the health checks (``health_timeout_s``). A backend marked down hands
  back the requests it holds that have no token yet (they go to another backend without spending
  a retry). While no healthy backend serves a model, new requests for it get 503 ``no_backend`` at
  once; those already queued get it once it has been so for ``no_backend_wait_s``.
* An unexpected error while forwarding fails that request only (logged with its id).

Isolation (``[engine] isolation``, on by default): a backend's slots are this engine's capacity,
and a backlogged tenant must not hold them all while another waits, for a llama.cpp server cannot
preempt a request it has started. A tenant is *active* while it has requests here or had one in
the last ``[forward] tenant_active_s``; it is *below its share* while its requests here times the
active tenants (itself included) are fewer than the slots of the healthy backends. One free slot is
held for each active tenant below its share: a tenant may take every free slot but those
(``Capacity.tenant_room``), and the fair-share queues let the others' requests pass the head to
reach them. So a tenant that comes back finds a slot waiting, and one that floods alone has every
slot. Where a backend can preempt (vLLM with ``--scheduling-policy priority``), its ``priority``
setting sends each request a priority (:meth:`ForwardEngine.priority_for`): tenants below their
share first, then by bid, so the backend itself lets them in ahead of what it already runs.

Health (``[forward] health_interval_s``) and metrics (``metrics_interval_s``) are read by one task
per backend; a down backend takes no work and comes back by itself. A backend without configured
``models`` serves what its ``/v1/models`` lists, read when it first becomes healthy.

Cost: per token (``cost_per_1m_*_tokens_usd``) and/or per GPU-hour (a request pays its duration x
the backend's hourly price x ``gpus`` / ``max_concurrency``).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Awaitable, Callable

import attrs
import trio

from apsd.core.clock import ModelClock
from apsd.core.config import MAX_BID, Config, ForwardConfig
from apsd.core.ledger import Ledger
from apsd.core.models import ALL_APIS, LENGTH_ALIASES, Capacity, Completion, Dispatch, InferenceRequest, Refusal
from apsd.core.routing import RoutingPolicy, Target
from apsd.core.streams import TokenChunk
from apsd.engines.backends import (Backend, BackendAnswer, BackendChunk, BackendClient, BackendError, BackendStatistics,
                                   OnChunk)
from apsd.core.engine import UNBOUNDED, Demand, EngineStatistics, completion

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
    #: Where each request goes (``[routing] policy``).
    routing: RoutingPolicy
    #: Hold a free slot for each active tenant below its share (the module docstring).
    isolation: bool = True
    #: The ``prefix`` picture's size for a backend without ``cache_tokens`` (``[routing] cache_tokens``).
    default_cache_tokens: int = 262_144
    #: (backend, reason) -> routing decisions so far.
    _decisions: collections.Counter[tuple[str, str]] = attrs.field(factory=collections.Counter, init=False)
    #: Tenant -> its requests running here (tenants with none are not in it).
    _per_tenant: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    #: Tenants with no request running here -> when their last one ended, oldest first (so forgetting
    #: those older than ``tenant_active_s`` is amortised O(1)).
    _idle_since: dict[str, float] = attrs.field(factory=dict, init=False)
    #: The running requests whose tenant was below its share when dispatched (for ``priority``).
    _below_share: set[InferenceRequest] = attrs.field(factory=set, init=False)
    kind: str = attrs.field(default="forward", init=False)
    apis: tuple[str, ...] = attrs.field(default=ALL_APIS, init=False)
    #: Each running request's cancel scope and backend.
    _running: dict[InferenceRequest, tuple[trio.CancelScope, Backend]] = attrs.field(factory=dict, init=False)
    #: Requests cancelled because their backend went down before their first token: back to the queue.
    _moved: set[InferenceRequest] = attrs.field(factory=set, init=False)
    #: The backends a requeued request already failed on.
    _tried: dict[InferenceRequest, set[str]] = attrs.field(factory=dict, init=False)
    #: Models no healthy backend serves now, and since when (model time); "" stands for "any model".
    _unserved_since: dict[str, float] = attrs.field(factory=dict, init=False)
    #: Set when a model loses its last healthy backend (the watchdog then has a deadline to keep).
    _unserved_changed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    _demands: trio.MemorySendChannel[Demand] | None = attrs.field(default=None, init=False)
    _asked: bool = attrs.field(default=False, init=False)
    #: The last answer was empty: no asking until capacity changes.
    _blocked: bool = attrs.field(default=False, init=False)
    #: Capacity changed while an ask was out: its empty answer may be stale, so it must not block.
    _changed_while_asking: bool = attrs.field(default=False, init=False)
    #: The scope of the engine's wait for an answer: cancelled when it should look at its room again.
    _wait_scope: trio.CancelScope | None = attrs.field(default=None, init=False)
    _dispatches: int = attrs.field(default=0, init=False)
    _tokens: int = attrs.field(default=0, init=False)
    _busy_s: float = attrs.field(default=0.0, init=False)
    _cost_usd: float = attrs.field(default=0.0, init=False)

    # -- the seam --------------------------------------------------------------------------------
    def refuse(self, request: InferenceRequest) -> Refusal | None:
        """503 ``no_backend`` at once when no healthy backend serves the request's model (what a
        backend cannot take, it says itself: its 4xx is relayed)."""
        if self._serves(request.model):
            return None
        what = f"the model {request.model!r}" if request.model is not None else "any model"
        return Refusal(503, "no_backend", f"no backend serving {what} is up; retry later",
                       headers={"Retry-After": str(max(1, math.ceil(self.settings.health_interval_s)))})

    def _serves(self, model: str | None) -> bool:
        """Whether a healthy backend serves ``model`` (None: any model) now."""
        return any(b.healthy and b.models and (model is None or model in b.models) for b in self.backends)

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
        if not self.isolation:
            return Capacity(sequences=total, kv_tokens=UNBOUNDED, reserve_output=False, slots_per_model=slots)
        caps = self._caps(now)
        return Capacity(sequences=total, kv_tokens=UNBOUNDED, reserve_output=False, slots_per_model=slots,
                        under_share=lambda r: self._room(caps, r) > 0, tenant_room=lambda r: self._room(caps, r))

    def _active(self, now: float) -> int:
        """Tenants with requests here or one within ``tenant_active_s`` (forgetting the others)."""
        since = now - self.settings.tenant_active_s
        idle = self._idle_since
        while idle:
            tenant = next(iter(idle))
            if idle[tenant] >= since:
                break
            del idle[tenant]
        return len(self._per_tenant) + len(idle)

    def _slots(self) -> int:
        return sum(b.config.max_concurrency for b in self.backends if b.healthy)

    def _caps(self, now: float) -> tuple[int, int, int]:
        """(The slots of the healthy backends, the active tenants, how many of them are below their share:
        every idle one, and those running fewer than their share; O(tenants running here))."""
        active = self._active(now)
        slots = self._slots()
        below = len(self._idle_since) + sum(1 for n in self._per_tenant.values() if n * active < slots)
        return slots, active, below

    def _room(self, caps: tuple[int, int, int], request: InferenceRequest) -> int:
        """How many more slots ``request``'s tenant may take: all of them but one for each other active
        tenant below its share."""
        slots, active, below = caps
        tenant = request.tenant_id
        mine = self._per_tenant[tenant]
        if tenant in self._idle_since or (mine and mine * active < slots):
            below -= 1   # (itself)
        elif not mine:
            active += 1  # (a newcomer)
        return slots - below - mine

    def under_share(self, request: InferenceRequest) -> bool:
        """Whether ``request``'s tenant is below its share of the backends' slots (the module docstring)."""
        tenant = request.tenant_id
        mine = self._per_tenant[tenant]
        active = self._active(self.clock.now()) + (not mine and tenant not in self._idle_since)
        return mine * active < self._slots()

    @staticmethod
    def priority_for(request: InferenceRequest, below_share: bool, polarity: str) -> int:
        """The ``priority`` sent to a backend that preempts by it: tenants below their share before the
        others, then higher bids first, in the backend's ``polarity`` (``[[backends]] priority``)."""
        rank = (MAX_BID + 1) * (not below_share) + (MAX_BID - request.priority_bid)  # lower: sooner
        return rank if polarity == "lower-first" else 2 * MAX_BID + 1 - rank

    def cancel(self, request: InferenceRequest) -> bool:
        running = self._running.get(request)
        if running is None:
            return False
        running[0].cancel()
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

    def ask_again(self) -> None:
        """A request the last empty answer did not hold came in and fits (a slot held for its tenant):
        ask now, without waiting for capacity to change."""
        self._changed_now()

    def _changed_now(self) -> None:
        """Capacity may have grown (a request ended, a backend came back): the engine may ask again."""
        self._blocked = False
        self._changed_while_asking = self._asked   # (an empty answer to that ask is stale then)
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
                nursery.start_soon(self._serve_unserved)
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
            self._blocked = not self._changed_while_asking
            self._changed_while_asking = False
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
            if self.under_share(request):
                self._below_share.add(request)
            self._per_tenant[request.tenant_id] += 1
            self._idle_since.pop(request.tenant_id, None)
            scope = trio.CancelScope()
            self._running[request] = (scope, backend)
            request.backend = backend.name
            sent = trio.Event()
            self._nursery.start_soon(self._forward, request, backend, scope, previous, sent)
            previous = sent

    def _pick(self, request: InferenceRequest) -> Backend | None:
        """The backend the routing policy chooses for ``request`` among the healthy ones serving its
        model (one it failed on left out while another with room remains), if it has room; None otherwise."""
        now = self.clock.now()
        serving = [b for b in self.backends if b.healthy and b.models
                   and (request.model is None or request.model in b.models)]
        tried = self._tried.get(request)
        if tried:   # (elsewhere if a backend it has not failed on has room; else where there is room)
            untried = [b for b in serving if b.name not in tried]
            if any(b.free(now, self.settings) > 0 for b in untried):
                serving = untried
        if not serving:
            return None
        targets = [self._target(b, now) for b in serving]
        route = self.routing.route(request, targets)
        backend, target = serving[route.index], targets[route.index]
        if not target.room:
            return None
        self.routing.placed(request, target)
        self._decisions[(backend.name, route.reason)] += 1
        request.route = f"{backend.name}; reason={route.reason}"
        return backend

    def _target(self, backend: Backend, now: float) -> Target:
        return Target(name=backend.name, load=backend.in_flight, capacity=backend.config.max_concurrency,
                      room=backend.free(now, self.settings) > 0,
                      cache_tokens=backend.config.cache_tokens or self.default_cache_tokens)

    def route_decisions(self) -> dict[tuple[str, str], int]:
        """(backend, reason) -> how many requests the routing policy sent there for that reason."""
        return dict(self._decisions)

    # -- one request -------------------------------------------------------------------------------
    def _body(self, request: InferenceRequest, backend: Backend) -> tuple[str, dict, bool]:
        """The API, the body to send, and whether the client asked for usage in its stream.

        The client's body is copied one level deep (only top-level keys change; nothing of the
        client's is walked or copied further). Its output limit is apsd's reservation, under every
        name a backend reads it by (:data:`apsd.serve.http.openai.LENGTH_FIELDS`); a request that set
        none (``open_ended``) is sent without one: the backend generates until it stops, and the
        tenant is charged what it did.
        """
        if request.payload is not None and request.api is not None:
            api, body = request.api, dict(request.payload)
        else:  # POST /infer: a plain completion of its prompt
            api, body = "completions", {"prompt": request.prompt}
        body["model"] = request.model or backend.models[0]
        if backend.config.priority != "off":
            body["priority"] = self.priority_for(request, request in self._below_share, backend.config.priority)
        else:  # (a client's vLLM priority is its bid here: it must not reorder the backend's queue too)
            body.pop("priority", None)
        if api == "embeddings":   # (nothing to generate, nothing to stream)
            return api, body, False
        if api == "responses":
            if not request.open_ended:
                body["max_output_tokens"] = request.tokens_requested
            body["stream"] = request.stream is not None   # (its stream ends with its usage)
            return api, body, False
        if not request.open_ended:
            if "max_completion_tokens" not in body:
                body["max_tokens"] = request.tokens_requested
            for name in LENGTH_ALIASES:
                if name in body:
                    body[name] = request.tokens_requested
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

    def _relay(self, request: InferenceRequest, backend: Backend,
               wants_usage: bool, received: list[str]) -> OnChunk:
        """What to do with each chunk of ``request``'s stream from the backend: count its tokens and
        hand it to the client's stream without waiting for the client (a slow reader delays only
        itself: the backend's slot is freed at the backend's pace, and the request is charged what
        the backend generated; what waits for the reader is bounded by the request's output). A
        backend that streams more tokens than the limit it was sent fails the request and is
        suspected: the tenant is never charged past its reservation.

        A chunk whose tokens the backend does not say counts as one if it has text: a live count
        (vLLM sends some chunks with no text and some with several tokens), which settlement
        replaces by the backend's usage, or by its count of the text in ``received``
        (:meth:`_count_unreported`)."""
        stream = request.stream
        held: list[tuple[dict, bytes | None]] = []

        def on_chunk(piece: BackendChunk) -> None:
            chunk, raw = piece.data, piece.raw
            text = _chunk_text(chunk)
            tokens = piece.tokens if piece.tokens is not None else 1 if text else 0
            if piece.tokens is None and text:
                received.append(text)
            now = self.clock.now()
            if tokens and request.started_at is None:
                self.ledger.started(request, now)
            if not request.open_ended and request.tokens_generated + tokens > request.tokens_requested:
                raise BackendError(502, "backend_failed", f"backend {backend.name} sent more tokens than the "
                                   f"{request.tokens_requested} it was allowed (max_tokens)", retryable=False,
                                   unhealthy=True)
            request.tokens_generated += tokens
            if stream is None:
                return
            if chunk.get("usage") is not None and not wants_usage:
                chunk, raw = {k: v for k, v in chunk.items() if k != "usage"}, None
                if not chunk.get("choices"):
                    return  # (a usage-only chunk the client did not ask for)
            if request.started_at is None:
                held.append((chunk, raw))  # (a role chunk: held until a token comes, so a retry elsewhere
                return                     # cannot send the client a second one)
            for early, early_raw in held:
                stream.push_nowait(TokenChunk(tokens=0, at=now, data=early, raw=early_raw))
            held.clear()
            stream.push_nowait(TokenChunk(tokens=tokens, text=text, at=now, data=chunk, raw=raw))

        return on_chunk

    async def _forward(self, request: InferenceRequest, backend: Backend, scope: trio.CancelScope,
                       after: trio.Event | None, sent: trio.Event) -> None:
        """Send ``request`` (once the one dispatched before it was sent: a backend's own queue then
        receives a dispatch in apsd's order) and see it to its end.

        Whatever happens, the request ends answered or back in the queue, and nothing escapes to
        the engine's nursery: an unexpected error fails this request only (logged with its id)."""
        start = self.clock.now()
        backend.requests += 1
        outcome: Completion | Refusal | None = None
        requeue: str | None = None
        received: list[str] = []   # (the text of chunks whose tokens the backend did not say)
        try:
            api, body, wants_usage = self._body(request, backend)
            with scope:
                try:
                    if after is not None:
                        await after.wait()
                    sent.set()
                    answer = await self.client.complete(backend, api, body,
                                                        self._relay(request, backend, wants_usage, received),
                                                        request.request_id)
                    outcome = self._completed(request, backend, answer, start)
                except BackendError as error:
                    outcome, requeue = self._failed(request, backend, error)
            if scope.cancelled_caught:
                if request in self._moved:   # its backend went down before its first token
                    outcome, requeue = None, f"backend {backend.name} went down before the first token"
                    request.retries -= 1     # (not the request's failure: no retry spent)
                else:                        # its client left: billed for what arrived
                    outcome = Refusal(499, "client_disconnected",
                                      "the client disconnected while the request was running", kind="cancelled")
            if isinstance(outcome, Refusal) and request.started_at is not None:
                await self._count_unreported(request, backend, api, body, "".join(received))
        except Exception:  # a bug or a surprise: this request fails, the daemon goes on
            log.exception("request %s on backend %s failed unexpectedly", request.request_id, backend.name)
            outcome, requeue = Refusal(502, "backend_failed", f"forwarding to backend {backend.name} failed "
                                       f"unexpectedly (request {request.request_id}; see the log)",
                                       kind="failed"), None
        finally:
            sent.set()
            self._end(request, backend, start, outcome, requeue)

    async def _count_unreported(self, request: InferenceRequest, backend: Backend, api: str, body: dict,
                                output: str) -> None:
        """A request that ended after its first token without the backend's usage (its client left,
        the stream broke or timed out) is charged the backend's own counts, asked of it together
        (each bounded by ``health_timeout_s``; shielded: the request's scope may be cancelled): of
        its prompt, and of the ``output`` text that arrived in chunks that did not say their tokens
        (at least one token per such chunk with text, at most the limit it was sent). apsd's
        counts stay where the backend cannot say."""
        counts: dict[str, int | None] = {}

        async def ask(what: str, count: Callable[[], Awaitable[int | None]]) -> None:
            counts[what] = await count()

        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "prompt", lambda: self.client.count_prompt_tokens(backend, api, body))
                if output:
                    nursery.start_soon(ask, "output", lambda: self.client.count_output_tokens(
                        backend, body.get("model"), output))
        if counts.get("prompt") is not None:
            request.prompt_tokens = counts["prompt"]
        tokens = counts.get("output")
        if tokens is not None:
            tokens = max(tokens, request.tokens_generated)
            request.tokens_generated = tokens if request.open_ended else min(tokens, request.tokens_requested)

    def _end(self, request: InferenceRequest, backend: Backend, start: float, outcome: Completion | Refusal | None,
             requeue: str | None) -> None:
        """Book a forwarded request's end: the backend's counts, then its answer or its requeue."""
        backend.in_flight -= 1
        self._running.pop(request, None)
        self._moved.discard(request)
        self._below_share.discard(request)
        self._per_tenant[request.tenant_id] -= 1
        if not self._per_tenant[request.tenant_id]:
            del self._per_tenant[request.tenant_id]
            self._idle_since[request.tenant_id] = self.clock.now()   # (newest last)
        try:
            self._account(request, backend, start)
            if requeue is not None and not request.answered:
                self._tried.setdefault(request, set()).add(backend.name)
                self.requeue(request, requeue)
            else:
                self._tried.pop(request, None)
                if outcome is not None:
                    self.ledger.finish(request, outcome)
        except Exception:
            log.exception("ending request %s on backend %s failed", request.request_id, backend.name)
            if not request.answered:
                self.ledger.finish(request, Refusal(500, "internal_error", f"apsd failed ending request "
                                                    f"{request.request_id}; see the log", kind="failed"))
        self._changed_now()

    def _completed(self, request: InferenceRequest, backend: Backend, answer: BackendAnswer,
                   start: float) -> Completion:
        """A completed request's figures become the backend's usage (checked by the client:
        :class:`~apsd.engines.backends.UsageBounds`)."""
        now = self.clock.now()
        if answer.prompt_tokens is not None:
            request.prompt_tokens = answer.prompt_tokens
        if answer.completion_tokens is not None:
            request.tokens_generated = answer.completion_tokens
        request.cached_tokens = answer.cached_tokens
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
            self._mark_down(backend, error.message)
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
            if self.clock.reached(next_health):   # (not now >= ...: a rounding error would spin)
                next_health = now + settings.health_interval_s
                await self._check_health(backend)
            reads_metrics = backend.healthy and backend.has_metrics is not False
            if reads_metrics and self.clock.reached(next_metrics):
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
        if healthy and not backend.healthy:
            backend.healthy = True
            if backend.was_down:   # (a recovery the log reported the outage of: as loud as the outage)
                log.warning("backend %s is up again", backend.name)
            else:
                log.info("backend %s is up", backend.name)
            backend.was_down = False
            self._note_served()
            self._changed_now()
        elif not healthy and backend.healthy:
            self._mark_down(backend, "its health check failed")

    def _mark_down(self, backend: Backend, why: str) -> None:
        """Take ``backend`` out of service until its health check passes: the requests it holds
        that have no token yet go back to the queue (to another backend, or to wait for one)."""
        backend.healthy = False
        backend.was_down = True
        moved = [request for request, (_, on) in self._running.items() if on is backend
                 and request.started_at is None]
        log.warning("backend %s is down (%s)%s", backend.name, why,
                    f"; {len(moved)} requests without a token yet go back to the queue" if moved else "")
        for request in moved:
            self._moved.add(request)
            self._running[request][0].cancel()
        self._note_served()
        self._changed_now()

    # -- models no backend serves ------------------------------------------------------------------
    def _note_served(self) -> None:
        """Track which models have lost every healthy backend (and since when)."""
        now = self.clock.now()
        for model in ["", *self.models()]:
            if self._serves(model or None):
                self._unserved_since.pop(model, None)
            elif model not in self._unserved_since:
                self._unserved_since[model] = now
                self._unserved_changed.set()

    async def _serve_unserved(self) -> None:
        """Answer 503 ``no_backend`` to the requests queued for a model that has had no healthy
        backend for ``[forward] no_backend_wait_s`` (new ones are refused at once: :meth:`refuse`).
        Runs until cancelled."""
        wait = self.settings.no_backend_wait_s
        while True:
            now = self.clock.now()
            for model, since in list(self._unserved_since.items()):
                if now >= since + wait:
                    self._answer_unserved(model or None, now - since)
            self._unserved_changed = trio.Event()
            due = [since + wait for since in self._unserved_since.values() if since + wait > now]
            with trio.move_on_at(self.clock.deadline(min(due)) if due else math.inf):
                await self._unserved_changed.wait()

    def _answer_unserved(self, model: str | None, for_s: float) -> None:
        what = f"the model {model!r}" if model is not None else "any model"
        queued = [r for r in self.ledger.outstanding if r.dispatched_at is None and not r.answered
                  and r.model == model]   # (None: the requests for any model, POST /infer's)
        if not queued:
            return
        log.warning("%d queued requests for %s answered 503 no_backend: no backend up for %.0f s",
                    len(queued), what, for_s)
        for request in queued:
            self.ledger.finish(request, Refusal(
                503, "no_backend", f"no backend serving {what} has been up for {for_s:.0f} s "
                "([forward] no_backend_wait_s); retry later",
                headers={"Retry-After": str(max(1, math.ceil(self.settings.health_interval_s)))}, kind="failed"))

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
    """The text a stream chunk adds (chat ``delta.content``, completion ``text``, or a Responses
    ``response.output_text.delta`` event's ``delta``)."""
    if chunk.get("type") == "response.output_text.delta":
        delta = chunk.get("delta")
        return delta if isinstance(delta, str) else ""
    choices = chunk.get("choices")
    if type(choices) is list and len(choices) == 1 and type(choices[0]) is dict:   # (nearly every chunk)
        choice = choices[0]
        delta = choice.get("delta")
        content = delta.get("content") if type(delta) is dict else None
        if type(content) is str:
            return content
        text = choice.get("text")
        return text if type(text) is str else ""
    text = []
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
            text.append(delta["content"])
        elif isinstance(choice.get("text"), str):
            text.append(choice["text"])
    return "".join(text)
