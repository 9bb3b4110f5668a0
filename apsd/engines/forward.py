"""The ``forward`` engine: relays requests to real OpenAI-compatible servers (``[[backends]]``).

One engine routes to every backend. A backend's *slots* (``max_concurrency``: llama.cpp's ``-np``,
vLLM's ``max_num_seqs``) are what it shares out, and every request it runs holds a lease on one
(:mod:`apsd.core.slots`): this daemon's own table, or with replicas one table in Redis that every
replica claims from, so that together they never send a server more than its slots.

**Work-conserving dispatch.** The engine asks the scheduler for work while any usable backend has a
free slot (a backend is usable while healthy and not saturated, :mod:`apsd.engines.backends`), per
model (``Capacity.slots_per_model``); every free slot may take the next request in queue order. No
slot is held back for anyone, so no slot idles while a request that fits it waits; requests wait in
apsd's queue, in its policy's order, rather than in a backend's FIFO.

**Gateway preemption** (``[forward] preempt``, on by default; :mod:`apsd.engines.preemption`): real
servers cannot preempt for apsd, so apsd does. When a tenant below its share of the slots of its
model's backends finds none free, the room that preempting tenants above their share would free is
offered to the scheduler as held room (``Capacity.held_sequences`` / ``held_per_model``), which only
such tenants may take (the fair-share queues let them pass the head). A request given that room takes
the slot of a victim (:func:`~apsd.engines.preemption.choose_victim`), which is cancelled upstream:

* a victim without a first token goes back to the queue at its place (uncharged, no retry spent);
* a started one is *paused*: it goes back to the queue with what it produced, its client's stream
  open, and is resumed later as a continuation of its own text (:func:`apsd.engines.relay.continuation`),
  preferably on the same backend, whose prefix cache makes the second prefill cheap, and only on a
  server that can continue it while one serving its model is up (:func:`apsd.engines.relay.continues`). Its client sees a
  pause; its tenant is charged the backend's work once.

Each request goes to a backend serving its model (a request without a model, from ``POST /infer``,
to any) that the routing policy chooses (``[routing] policy``, :mod:`apsd.core.routing`; a resumed
request prefers the backend it ran on), in a task of its own. Where it went and why is stamped on
the request (``request.route``: the ``X-Apsd-Route`` header) and counted (:meth:`ForwardEngine.route_decisions`).

* The body sent is the client's (:func:`apsd.engines.relay.request_body`); tokens reach the client's
  stream as they arrive (:class:`apsd.engines.relay.StreamRelay`), never waiting for the client.
* Anthropic's Messages API (``request.api == "messages"``) goes only to backends that serve
  ``/v1/messages`` (asked of each when it is first healthy, :meth:`~apsd.engines.backends.BackendClient.serves_messages`);
  a request for a model none of whose healthy backends does is refused 404 ``unsupported_api`` at once.
  In a pool that mixes the two, a messages request waits for a backend that serves it (and the requests
  behind it in queue order wait with it, as behind any request whose backends are full).
* The end settles against the backend's usage: ``prompt_tokens`` and ``tokens_generated`` become
  the backend's figures, and admission gives back or takes the difference with what it reserved.
  Usage is untrusted: a figure that is not a believable count fails the request and the backend
  is suspected (:class:`~apsd.engines.backends.UsageBounds`).
* A client that leaves cancels the request at once: the upstream request is closed (freeing the
  backend's slot), and it is billed for the tokens that had arrived.
* A backend that fails before the first token (unreachable, timed out, 5xx or 429) is marked
  down if it looks so, and the request goes back to the queue in its place, to be dispatched to
  another backend, at most ``[forward] max_retries`` times; then 502 ``backend_failed``. If no healthy
  backend serves its model any more, it is answered 503 ``no_backend`` at once, as a new request would
  be. After the first token, a failure ends the stream with an error and the request is charged what
  arrived. A 4xx is the request's own fault: its status and message are relayed.
* A backend marked down (its health check failed, or a request found it unreachable) hands back the
  requests it holds at once: those without a first token go to the queue without spending a retry,
  resumable streams are paused and resumed elsewhere (or there once it is back), and the others end
  with an error event now rather than at their read timeout.
* Every exchange is bounded in time: connecting (``connect_timeout_s``), the first token, headers
  included (``first_token_timeout_s``; the whole answer when not streamed), each later chunk
  (``read_timeout_s``), and the health checks (``health_timeout_s``). While no healthy backend serves a
  model, new requests for it get 503 ``no_backend`` at once; those already queued get it once it has
  been so for ``no_backend_wait_s``.
* An unexpected error while forwarding fails that request only (logged with its id).

``priority``: a backend configured for it (``[[backends]] priority``) is sent
:func:`apsd.engines.relay.priority_for`: a tenant's requests outstanding first, then its bid.

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
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from apsd.core.clock import ModelClock
from apsd.core.config import Config, ForwardConfig
from apsd.core.engine import UNBOUNDED, Demand, EngineStatistics, completion
from apsd.core.ledger import Ledger
from apsd.core.models import (
    ALL_APIS,
    Capacity,
    Completion,
    Dispatch,
    InferenceRequest,
    Refusal,
    RefusalKind,
)
from apsd.core.routing import RoutingPolicy, Target
from apsd.core.slots import Lease, LocalSlots, SlotTable
from apsd.core.tracing import AttemptTrace
from apsd.engines.backends import (
    Backend,
    BackendAnswer,
    BackendChunk,
    BackendClient,
    BackendError,
    BackendStatistics,
)
from apsd.engines.preemption import (
    PreemptionRules,
    Shares,
    choose_victim,
    eligible,
    next_eligible_at,
    resumable,
)
from apsd.engines.relay import (
    CHUNK_PER_TOKEN,
    ECHOES_PREFILL,
    MESSAGES,
    Progress,
    StreamRelay,
    continuation,
    continues,
    prefill_text,
    priority_for,
    request_body,
)
from apsd.engines.watch import BackendWatch

__all__ = ["ForwardEngine"]

log = logging.getLogger("apsd.engines.forward")

#: Requeue is the scheduler's: (request, reason, spend a retry, keep what it produced).
Requeue = Callable[..., None]


@attrs.define(eq=False)
class _Attempt:
    """One request's run on one backend, from its placement to its end."""

    request: InferenceRequest
    backend: Backend
    lease: Lease
    #: The lease whose slot it takes (None: a free slot).
    victim: Lease | None = None
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    #: Why the engine stops it: ``preempted``, ``moved`` (its backend went down); None: it runs, or its
    #: client left.
    stop: str | None = None
    #: The tenant's requests outstanding when it was placed (its ``priority``'s rank).
    outstanding: int = 0
    #: The request's output tokens when this attempt began.
    base_tokens: int = 0
    #: Its stream relay, once it is sent.
    relay: StreamRelay | None = None
    #: Its time's cost is booked (once, at its end or with its completion).
    accounted: bool = False


@attrs.define(eq=False)
class ForwardEngine:
    """See the module docstring."""

    engine_id: int
    backends: list[Backend]
    client: BackendClient
    ledger: Ledger
    clock: ModelClock
    settings: ForwardConfig
    #: Puts a request back in the queue (the scheduler's :meth:`~apsd.core.scheduler.Scheduler.requeue`).
    requeue: Requeue
    #: Where each request goes (``[routing] policy``).
    routing: RoutingPolicy
    #: Preemption's rules (``[forward] preempt``, ``preempt_min_run_s``, ``max_preemptions``).
    rules: PreemptionRules = attrs.field(factory=PreemptionRules)
    #: Every sender's leases on the backends' slots.
    slots: SlotTable = attrs.field(factory=LocalSlots)
    #: Tenants' weights (``[tenants.<name>] weight``): their shares of the slots.
    weights: Mapping[str, float] = attrs.field(factory=dict)
    #: The ``prefix`` picture's size for a backend without ``cache_tokens`` (``[routing] cache_tokens``).
    default_cache_tokens: int = 262_144
    kind: str = attrs.field(default="forward", init=False)
    apis: tuple[str, ...] = attrs.field(default=ALL_APIS, init=False)
    watch: BackendWatch = attrs.field(init=False)
    #: (backend, reason) -> routing decisions so far.
    _decisions: collections.Counter[tuple[str, str]] = attrs.field(factory=collections.Counter, init=False)
    #: Each running request's attempt, and the same by lease id.
    _running: dict[InferenceRequest, _Attempt] = attrs.field(factory=dict, init=False)
    _by_lease: dict[str, _Attempt] = attrs.field(factory=dict, init=False)
    #: What resumable requests produced so far (until they end).
    _progress: dict[InferenceRequest, Progress] = attrs.field(factory=dict, init=False)
    #: The backends a requeued request already failed on.
    _tried: dict[InferenceRequest, set[str]] = attrs.field(factory=dict, init=False)
    #: The backend a paused request ran on (it resumes there when it can).
    _ran_on: dict[InferenceRequest, str] = attrs.field(factory=dict, init=False)
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
    #: Preemptions so far, by (backend, kind): ``requeued`` (no first token yet) or ``resumed``.
    preemptions: collections.Counter[tuple[str, str]] = attrs.field(factory=collections.Counter, init=False)
    _next_lease: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        self.watch = BackendWatch(self.backends, self.client, self.ledger, self.clock, self.settings,
                                  on_down=self._hand_back, on_change=self._changed_now)
        self.slots.attach([b.name for b in self.backends], self.preempt_ordered, self._changed_now)

    # -- the seam --------------------------------------------------------------------------------
    def refuse(self, request: InferenceRequest) -> Refusal | None:
        """503 ``no_backend`` at once when no healthy backend serves the request's model; 404
        ``unsupported_api`` for an Anthropic message when none of them serves ``/v1/messages`` (what a
        backend cannot take, it says itself: its 4xx is relayed)."""
        if not self.watch.serves(request.model):
            return self._no_backend(request.model, "is up")
        if request.api == MESSAGES and not any(b.messages for b in self._serving(request.model)):
            what = f"the model {request.model!r}" if request.model is not None else "any model"
            kinds = ", ".join(f"{b.name} ({b.server or 'unknown'})" for b in self._serving(request.model))
            return Refusal(404, "unsupported_api", f"no backend serving {what} serves Anthropic's Messages API "
                           f"(/v1/messages): {kinds} do not; use /v1/chat/completions, or a llama.cpp or vLLM backend",
                           field="model")
        return None

    async def count_message_tokens(self, model: str, body: dict[str, Any]) -> int | None:
        """An Anthropic request's prompt tokens as a healthy backend serving ``model`` and ``/v1/messages``
        counts them (``/v1/messages/count_tokens``, within ``health_timeout_s``); None when none can say."""
        for backend in self._serving(model):
            if backend.messages:
                count = await self.client.count_prompt_tokens(backend, MESSAGES, {**body, "model": model})
                if count is not None:
                    return count
        return None

    def _no_backend(self, model: str | None, state: str, kind: RefusalKind = "rejected") -> Refusal:
        what = f"the model {model!r}" if model is not None else "any model"
        return Refusal(503, "no_backend", f"no backend serving {what} {state}; retry later", kind=kind,
                       headers={"Retry-After": str(max(1, math.ceil(self.settings.health_interval_s)))})

    def _serving(self, model: str | None) -> list[Backend]:
        """The healthy backends serving ``model`` (None: every healthy backend)."""
        return [b for b in self.backends if b.healthy and b.models and (model is None or model in b.models)]

    def models(self) -> list[str]:
        return list(dict.fromkeys(name for backend in self.backends for name in backend.models))

    def _free_slots(self, backend: Backend, now: float) -> int:
        """Slots of ``backend`` a request may take now (none while it is down or saturated)."""
        if not backend.healthy or backend.saturated(now, self.settings):
            return 0
        return self.slots.free(backend.name, backend.config.max_concurrency)

    def free(self) -> Capacity:
        now = self.clock.now()
        slots: dict[str, int] = {}
        total = 0
        for backend in self.backends:
            free = self._free_slots(backend, now)
            total += free
            for name in backend.models:
                slots[name] = slots.get(name, 0) + free
        if not self.rules.enabled or total and not self._running:   # (nothing to preempt for, or no one to)
            return Capacity(sequences=total, kv_tokens=UNBOUNDED, reserve_output=False, slots_per_model=slots)
        shares: dict[str | None, Shares] = {}
        held_per_model = {name: self._preemptible(name, now, shares) for name in slots}
        victims: dict[tuple[str | None, str, float], bool] = {}

        def has_victim(request: InferenceRequest) -> bool:
            """Whether a victim would give ``request`` its slot now (what :meth:`_place` will find)."""
            key = (request.model, request.tenant_id, _urgent_ttft(request, now, self.rules))
            found = victims.get(key)
            if found is None:
                found = victims[key] = self._victim(request, now, shares) is not None
            return found

        return Capacity(sequences=total, kv_tokens=UNBOUNDED, reserve_output=False, slots_per_model=slots,
                        held_sequences=self._preemptible(None, now, shares), held_per_model=held_per_model,
                        under_share=has_victim,
                        prefer=(lambda r: self._shares(r.model, shares).below(r.tenant_id)) if total else None)

    def _shares(self, model: str | None, cache: dict[str | None, Shares]) -> Shares:
        """Who holds the slots of the healthy backends serving ``model`` (None: every backend), every
        sender's leases counted."""
        shares = cache.get(model)
        if shares is None:
            serving = self._serving(model)
            leases = [lease for b in serving for lease in self.slots.leases(b.name)]
            shares = cache[model] = Shares.of(leases, sum(b.config.max_concurrency for b in serving), self.weights)
        return shares

    def _serving_request(self, request: InferenceRequest) -> list[Backend]:
        """The healthy backends that may run ``request``: those serving its model (and, for an Anthropic
        message, ``/v1/messages``); for a paused request, those that can continue it when there are any
        (else it goes where it can, and fails there: better than waiting for a server that may not come)."""
        serving = self._serving(request.model)
        if request.api == MESSAGES:
            serving = [b for b in serving if b.messages]
        progress = self._progress.get(request)
        if progress is not None and progress.resumed:
            able = [b for b in serving if continues(progress.api, b.server)]
            serving = able or serving
        return serving

    def takes_now(self, request: InferenceRequest) -> bool:
        """Whether ``request`` would be sent at once: a usable backend that may run it has a free slot,
        or there is a request to preempt for it (service classes' admission asks)."""
        now = self.clock.now()
        if any(self._free_slots(b, now) > 0 for b in self._serving_request(request)):
            return True
        return self.rules.enabled and self._victim(request, now, {}) is not None

    def _victim(self, request: InferenceRequest, now: float, cache: dict[str | None, Shares]) -> Lease | None:
        """The lease to preempt for ``request`` now (:func:`~apsd.engines.preemption.choose_victim`), if any."""
        leases = [lease for b in self._serving_request(request) for lease in self.slots.leases(b.name)]
        return choose_victim(leases, self._shares(request.model, cache), request.tenant_id, now, self.rules,
                             _urgent_ttft(request, now, self.rules))

    def _preemptible(self, model: str | None, now: float, cache: dict[str | None, Shares]) -> int:
        """Slots of ``model``'s backends that preempting tenants above their share (counting one more
        tenant: a newcomer) could free now."""
        shares = self._shares(model, cache)
        return sum(1 for b in self._serving(model) for lease in self.slots.leases(b.name)
                   if eligible(lease, now, self.rules) and shares.yields_to(lease.tenant, _NEWCOMER))

    def cancel(self, request: InferenceRequest) -> bool:
        attempt = self._running.get(request)
        if attempt is None:
            return False
        attempt.stop = None
        attempt.scope.cancel()
        return True

    def reconfigure(self, config: Config) -> list[str]:
        self.weights = {name: tenant.weight for name, tenant in config.tenants.items()}
        return []  # ([[backends]] and [forward] need a restart: Pipeline.reconfigure says so)

    def statistics(self) -> EngineStatistics:
        return EngineStatistics(
            engine_id=self.engine_id, kind=self.kind, running=len(self._running), waiting=0, kv_tokens_used=0,
            kv_tokens_capacity=0, busy_s=self._busy_s, cost_usd=self._cost_usd, dispatches=self._dispatches,
            tokens_generated=self._tokens, preemptions=sum(self.preemptions.values()))

    def backend_statistics(self) -> tuple[BackendStatistics, ...]:
        now = self.clock.now()
        return tuple(backend.statistics(now, self.settings) for backend in self.backends)

    def route_decisions(self) -> dict[tuple[str, str], int]:
        """(backend, reason) -> how many requests the routing policy sent there for that reason."""
        return dict(self._decisions)

    def ask_again(self) -> None:
        """A request the last empty answer did not hold came in and fits (a free slot, or a victim's for
        a tenant below its share): ask now, without waiting for capacity to change."""
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
                self.watch.start(nursery)
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
                if not self._asked and (at := self._next_change()) is not None:
                    self._wait_scope.deadline = self.clock.deadline(at)   # (a victim, or a slot, may be had then)
                self._take(await answers.receive())
            if self._wait_scope.cancelled_caught:
                self._blocked = False
            self._wait_scope = None

    def _next_change(self) -> float | None:
        """When what the engine may take next changes by time alone (None: not by time): a running request
        becomes eligible for preemption by its run time, or the reading that makes a backend saturated
        grows too old to trust (:meth:`Backend.saturated`)."""
        now = self.clock.now()
        times = [b.load_at + self.settings.metrics_max_age_s + 1e-6 for b in self.backends   # (just past it)
                 if b.load_at is not None and b.healthy and b.saturated(now, self.settings)]
        if self.rules.enabled:
            eligible_at = next_eligible_at([lease for b in self.backends for lease in self.slots.leases(b.name)],
                                           self.rules)
            times += [eligible_at] if eligible_at is not None else []
        future = [at for at in times if not self.clock.reached(at)]
        return min(future) if future else None

    def _ask(self) -> None:
        if self._asked or self._blocked:
            return
        free = self.free()
        if free.sequences > 0 or free.held_sequences > 0:
            assert self._demands is not None
            self._asked = True
            self._demands.send_nowait(Demand(self))

    def _take(self, dispatch: Dispatch) -> None:
        self._asked = False
        if not dispatch.requests:
            # the next request in queue order fits none of the free slots (its model's backends are
            # full) and no victim's: ask again only once something changed, or this would spin
            self._blocked = not self._changed_while_asking
            self._changed_while_asking = False
            return
        self._dispatches += 1
        assert self._nursery is not None
        previous: trio.Event | None = None   # requests are sent in dispatch (queue) order
        unplaced = False
        for request in dispatch.requests:
            if request.answered:
                continue
            attempt = self._place(request)
            if attempt is None:  # (it went down or filled up since the cut: back in line, no retry spent)
                unplaced = True
                self.requeue(request, "no backend could take it any more", retry=False,
                             keep_progress=request.started_at is not None)
                continue
            sent = trio.Event()
            self._nursery.start_soon(self._forward, attempt, previous, sent)
            previous = sent
        if unplaced and previous is None:
            # none could be placed although the model had room (a messages request whose model's free
            # slots are on backends that do not serve /v1/messages): as for an empty answer, ask again
            # only once something changed, or the same dispatch would come back at once, again and again
            self._blocked = not self._changed_while_asking
            self._changed_while_asking = False

    # -- placing a request ----------------------------------------------------------------------
    def _place(self, request: InferenceRequest) -> _Attempt | None:
        """Put ``request`` in a free slot of the backend the routing policy chooses, else (its tenant
        below its share) in a victim's slot; None when neither can be had."""
        now = self.clock.now()
        serving = self._serving_request(request)
        if not serving:
            return None
        if any(self._free_slots(b, now) > 0 for b in serving):
            backend = self._route(request, serving, now)
            return None if backend is None else self._hold(request, backend, serving, now)
        victim = self._victim(request, now, {}) if self.rules.enabled else None
        if victim is None:
            return None
        backend = next(b for b in serving if b.name == victim.backend)
        request.route = f"{backend.name}; reason=preempt"
        self._decisions[(backend.name, "preempt")] += 1
        attempt = self._hold(request, backend, serving, now, victim)
        self._preempt(victim)
        return attempt

    def _route(self, request: InferenceRequest, serving: list[Backend], now: float) -> Backend | None:
        """The backend the routing policy chooses among ``serving`` (one it failed on left out while
        another with room remains; a resumed request goes back where it ran if that has room), if it
        has room."""
        ran_on = self._ran_on.get(request)
        if ran_on is not None:
            for backend in serving:
                if backend.name == ran_on and self._free_slots(backend, now) > 0:
                    request.route = f"{backend.name}; reason=resume"
                    self._decisions[(backend.name, "resume")] += 1
                    return backend
        tried = self._tried.get(request)
        if tried:   # (elsewhere if a backend it has not failed on has room; else where there is room)
            untried = [b for b in serving if b.name not in tried]
            if any(self._free_slots(b, now) > 0 for b in untried):
                serving = untried
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
                      room=self._free_slots(backend, now) > 0,
                      cache_tokens=backend.config.cache_tokens or self.default_cache_tokens)

    def _hold(self, request: InferenceRequest, backend: Backend, serving: list[Backend], now: float,
              victim: Lease | None = None) -> _Attempt:
        """Take the slot (a free one, or ``victim``'s) on ``backend`` for ``request``."""
        self._next_lease += 1
        progress = self._progress.get(request)
        if progress is None and self.rules.enabled and resumable(request):
            progress = self._progress[request] = Progress()
        started = request.started_at is not None
        lease = Lease(lease_id=f"{request.request_id}#{self._next_lease}", backend=backend.name,
                      tenant=request.tenant_id, replica=self.slots.replica, since=now, started=started,
                      preemptible=request.stream is not None and (not started or self._resumes(progress, backend)),
                      preemptions=request.preemptions, ttft_s=_class_ttft(request))
        outstanding = 0
        if backend.config.priority != "off":   # (the rank of its priority: only a backend configured for it)
            stats = self.ledger.tenants.get(request.tenant_id)
            outstanding = sum(1 for b in serving for held in self.slots.leases(b.name)
                              if held.tenant == request.tenant_id) + (stats.queued if stats is not None else 0)
        self.slots.hold(lease, victim)
        attempt = _Attempt(request, backend, lease, victim, outstanding=outstanding)
        self._running[request] = attempt
        self._by_lease[lease.lease_id] = attempt
        backend.in_flight += 1
        request.backend = backend.name
        return attempt

    @staticmethod
    def _resumes(progress: Progress | None, backend: Backend) -> bool:
        """Whether a started request with ``progress`` can be paused on ``backend`` and resumed."""
        return progress is not None and progress.resumable and continues(progress.api, backend.server)

    def _preempt(self, victim: Lease) -> None:
        """Stop ``victim``'s request for the lease placed in its slot: at once if it is this engine's;
        another replica's is ordered through the shared table when that lease is confirmed."""
        attempt = self._by_lease.get(victim.lease_id)
        if attempt is not None:
            attempt.stop = "preempted"
            attempt.scope.cancel()

    def preempt_ordered(self, lease_id: str) -> None:
        """Another replica chose this engine's lease ``lease_id`` as a victim: stop its request if it may
        still be preempted; else the lease waiting for its slot is refused."""
        attempt = self._by_lease.get(lease_id)
        if attempt is None or attempt.stop == "preempted":
            return   # (it ended, and its release passed the slot on; or it is being preempted already)
        if attempt.stop is not None or not eligible(attempt.lease, self.clock.now(), self.rules):
            self.slots.abandon(attempt.lease)
            return
        attempt.stop = "preempted"
        attempt.scope.cancel()

    def _hand_back(self, backend: Backend) -> None:
        """``backend`` went down: stop what it holds (see the module docstring)."""
        moved = [a for a in self._running.values() if a.backend is backend]
        if moved:
            log.warning("backend %s is down: its %d requests go back to the queue or end", backend.name, len(moved))
        for attempt in moved:
            attempt.stop = "moved"
            attempt.scope.cancel()

    # -- one request -------------------------------------------------------------------------------
    async def _forward(self, attempt: _Attempt, after: trio.Event | None, sent: trio.Event) -> None:
        """Send ``attempt``'s request once its slot is confirmed (and the one dispatched before it was
        sent: a backend's own queue then receives a dispatch in apsd's order) and see it to its end.

        Whatever happens, the request ends answered or back in the queue, and nothing escapes to
        the engine's nursery: an unexpected error fails this request only (logged with its id)."""
        request, backend, lease = attempt.request, attempt.backend, attempt.lease
        start = self.clock.now()
        outcome: Completion | Refusal | None = None
        requeue: str | None = None
        pause = sending = False
        traced: AttemptTrace | None = None
        try:
            with attempt.scope:
                try:
                    if not await self.slots.confirm(lease, backend.config.max_concurrency, attempt.victim):
                        requeue = _SLOT_TAKEN
                    else:
                        if after is not None:
                            await after.wait()
                        sent.set()
                        start = lease.since = self.clock.now()
                        backend.requests += 1
                        api, body, relay = self._prepare(attempt)
                        sending = True
                        if request.trace is not None:
                            traced = request.trace.attempt(backend.name, backend.config.url)
                        answer = await self.client.complete(backend, api, body, self._noting(backend, relay),
                                                            request.request_id, traced.traceparent if traced else "")
                        outcome = self._completed(attempt, answer, start)
                except BackendError as error:
                    outcome, requeue = self._failed(request, backend, error, start)
            if attempt.scope.cancelled_caught:
                outcome, requeue, pause = self._stopped(attempt)
            if (pause or isinstance(outcome, Refusal)) and request.started_at is not None:
                await self._count_unreported(attempt, pausing=pause)
            elif sending and isinstance(outcome, Refusal) and outcome.kind == "cancelled":
                # its client left before the first token, after the backend took the prompt in (and
                # prefilled it): charged the backend's count of it, else the estimate
                request.prompt_charged = True
                await self._count_unreported(attempt)
        except Exception:  # a bug or a surprise: this request fails, the daemon goes on
            log.exception("request %s on backend %s failed unexpectedly", request.request_id, backend.name)
            outcome, requeue, pause = Refusal(502, "backend_failed", f"forwarding to backend {backend.name} "
                                              f"failed unexpectedly (request {request.request_id}; see the log)",
                                              kind="failed"), None, False
        finally:
            sent.set()
            if traced is not None:   # (how the attempt ended: stopped by apsd, failed, sent back, or answered)
                traced.end(attempt.stop or (outcome.error if isinstance(outcome, Refusal) else None) or
                           (requeue and "requeued"))
            self._end(attempt, start, outcome, requeue, pause)

    def _prepare(self, attempt: _Attempt) -> tuple[str, dict[str, Any], StreamRelay]:
        """The API, the body (a continuation for a resumed request) and the stream relay of an attempt."""
        request, backend, lease = attempt.request, attempt.backend, attempt.lease
        polarity = backend.config.priority
        priority = None if polarity == "off" else priority_for(request, attempt.outstanding, polarity,
                                                                 self.clock.now())
        api, body, wants_usage = request_body(request, request.model or backend.models[0], priority)
        progress = self._progress.get(request)
        attempt.base_tokens = request.tokens_generated
        echo = ""
        if progress is not None:
            progress.api = api
            if not progress.resumed:   # (the attempt whose text the client gets first: echoed or not)
                progress.echoed = backend.server in ECHOES_PREFILL
            else:
                resumed = continuation(api, body, progress.text, request, backend.server, echoed=progress.echoed)
                if resumed is None:
                    raise BackendError(502, "backend_failed", f"backend {backend.name} cannot continue a "
                                       f"preempted {api} request (its server kind is {backend.server or 'not known'})",
                                       retryable=False)
                body = resumed
                echo = prefill_text(body) if backend.server in ECHOES_PREFILL and api != "completions" else ""

        def started(request: InferenceRequest, at: float) -> None:
            self.ledger.started(request, at)
            lease.started, lease.since = True, at   # (a started request's run counts from its first token)
            lease.preemptible = self._resumes(progress, backend)
            self.slots.update(lease)

        def unresumable() -> None:
            lease.preemptible = False
            self.slots.update(lease)

        attempt.relay = StreamRelay(request, backend.name, wants_usage, started, self.clock.now, progress,
                                    unresumable, echo=echo)
        return api, body, attempt.relay

    def _stopped(self, attempt: _Attempt) -> tuple[Refusal | None, str | None, bool]:
        """(outcome, requeue reason, pause) of an attempt the engine or its client stopped."""
        request, backend = attempt.request, attempt.backend
        started = request.started_at is not None
        can_pause = started and self._resumes(self._progress.get(request), backend)
        if attempt.stop == "preempted":
            if not started:
                self.preemptions[(backend.name, "requeued")] += 1
                return None, f"preempted on backend {backend.name} before its first token", False
            if can_pause:
                self.preemptions[(backend.name, "resumed")] += 1
                return None, None, True
        elif attempt.stop == "moved":
            if not started:
                return None, f"backend {backend.name} went down before the first token", False
            if can_pause:
                return None, None, True
            return Refusal(502, "backend_failed", f"backend {backend.name} went down during the stream",
                           kind="failed"), None, False
        return Refusal(499, "client_disconnected", "the client disconnected while the request was running",
                       kind="cancelled"), None, False

    async def _count_unreported(self, attempt: _Attempt, *, pausing: bool = False) -> None:
        """An attempt that ended or paused after its first token without the backend's usage (its client
        left, the stream broke or timed out, it was preempted), or whose client left once it was sent, is
        charged the backend's own counts, asked of it together (each bounded by ``health_timeout_s``;
        shielded: the attempt's scope may be cancelled): of the request's prompt (once per request), and,
        from a server whose chunks are not its tokens (not :data:`CHUNK_PER_TOKEN`), of the text that
        arrived in chunks that did not say their tokens (at least what was counted live, one per such
        chunk with text; at most the limit it was sent). apsd's counts stay where the backend cannot say.

        A paused request keeps at least one token of its limit to resume with: a tokenizer may count more
        tokens in a text than the server generated to write it, and the resumed attempt must end as the
        server ends it (its finish reason and usage), not be sent a limit of 0."""
        request, backend = attempt.request, attempt.backend
        progress = self._progress.get(request)
        unsaid = "".join(attempt.relay.unsaid) if attempt.relay is not None else ""
        api, body, _ = request_body(request, request.model or backend.models[0], None)
        counts: dict[str, int | None] = {}

        async def ask(what: str, count: Callable[[], Awaitable[int | None]]) -> None:
            counts[what] = await count()

        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                if progress is None or progress.prompt_tokens is None:
                    nursery.start_soon(ask, "prompt", lambda: self.client.count_prompt_tokens(backend, api, body))
                if unsaid and backend.server not in CHUNK_PER_TOKEN:
                    nursery.start_soon(ask, "output", lambda: self.client.count_output_tokens(
                        backend, body.get("model"), unsaid))
        if progress is not None and progress.prompt_tokens is not None:
            request.prompt_tokens = progress.prompt_tokens
        elif (counted := counts.get("prompt")) is not None:
            request.prompt_tokens = counted
        if progress is not None:
            progress.prompt_tokens = request.prompt_tokens
        output = counts.get("output")
        if output is not None:
            tokens = max(attempt.base_tokens + output, request.tokens_generated)
            if not request.open_ended:
                limit = request.tokens_requested - 1 if pausing else request.tokens_requested
                tokens = min(tokens, max(limit, request.tokens_generated))
            request.tokens_generated = tokens

    def _end(self, attempt: _Attempt, start: float, outcome: Completion | Refusal | None,
             requeue: str | None, pause: bool) -> None:
        """Book an attempt's end: its slot, the backend's counts, then its answer, its requeue or its pause."""
        request, backend, lease = attempt.request, attempt.backend, attempt.lease
        if pause and not request.open_ended and request.tokens_generated >= request.tokens_requested:
            # (it had every token it may have, only its end had not come: nothing is left to resume)
            pause, outcome = False, completion(request, engine_id=self.engine_id, end=self.clock.now())
        self.slots.release(lease)
        backend.in_flight -= 1
        self._running.pop(request, None)
        self._by_lease.pop(lease.lease_id, None)
        try:
            self._account(attempt, start, ends=outcome is not None and not pause and requeue is None)
            if request.answered:
                self._forget(request)
            elif pause:
                self._progress[request].resumed += 1
                request.preemptions += 1
                self._ran_on[request] = backend.name
                self.requeue(request, f"preempted on backend {backend.name}; it resumes later", retry=False,
                             keep_progress=True)
            elif requeue is not None and request.started_at is None and not self.watch.serves(request.model):
                self._forget(request)   # (its last backend went down: answered as a new request would be)
                self.ledger.finish(request, self._no_backend(request.model, "is up any more", "failed"))
            elif requeue is not None and (attempt.stop is not None or requeue == _SLOT_TAKEN):
                request.preemptions += attempt.stop == "preempted"
                self.requeue(request, requeue, retry=False, keep_progress=request.started_at is not None)
            elif requeue is not None:
                self._tried.setdefault(request, set()).add(backend.name)
                self.requeue(request, requeue)
            else:
                self._forget(request)
                if outcome is not None:
                    self.ledger.finish(request, outcome)
        except Exception:
            log.exception("ending request %s on backend %s failed", request.request_id, backend.name)
            if not request.answered:
                self.ledger.finish(request, Refusal(500, "internal_error", f"apsd failed ending request "
                                                    f"{request.request_id}; see the log", kind="failed"))
        self._changed_now()

    def _noting(self, backend: Backend, relay: StreamRelay) -> Callable[[BackendChunk], None]:
        """``relay``, noting on ``backend`` when it last streamed (see :meth:`BackendWatch._check_health`)."""
        def relayed(piece: BackendChunk) -> None:
            backend.streamed_at = self.clock.now()
            relay(piece)
        return relayed

    def _forget(self, request: InferenceRequest) -> None:
        self._tried.pop(request, None)
        self._progress.pop(request, None)
        self._ran_on.pop(request, None)

    def _completed(self, attempt: _Attempt, answer: BackendAnswer, start: float) -> Completion:
        """A completed request's figures become the backend's usage (checked by the client:
        :class:`~apsd.engines.backends.UsageBounds`); a resumed request keeps its first prompt and adds
        this attempt's output to what it had."""
        request = attempt.request
        now = self.clock.now()
        progress = self._progress.get(request)
        if progress is not None and progress.resumed:
            if answer.completion_tokens is not None:
                request.tokens_generated = attempt.base_tokens + answer.completion_tokens
            if progress.prompt_tokens is not None:
                request.prompt_tokens = progress.prompt_tokens
        else:
            if answer.prompt_tokens is not None:
                request.prompt_tokens = answer.prompt_tokens
            if answer.completion_tokens is not None:
                request.tokens_generated = answer.completion_tokens
            request.cached_tokens = answer.cached_tokens
        if request.started_at is None:  # not streamed: its first token is seen with its last
            self.ledger.started(request, now)
        self._account(attempt, start, ends=True)
        return completion(request, engine_id=self.engine_id, end=now, response=answer.response,
                          response_bytes=answer.raw)

    def _failed(self, request: InferenceRequest, backend: Backend, error: BackendError,
                sent_at: float) -> tuple[Refusal | None, str | None]:
        """The answer, or (before the first token, a failure another backend may not have, retries
        left) the reason to put it back in the queue. The backend is marked down for an unhealthy
        error, but for a timeout while it streamed to others (a chunk came since this attempt was sent
        at ``sent_at``): the request waited in the server's own queue, and the server is busy, not down
        (a refused or broken connection is another matter)."""
        backend.failures += 1
        busy = error.code == "backend_timeout" and backend.streamed_at is not None and backend.streamed_at >= sent_at
        if error.unhealthy and backend.healthy and not busy:
            self.watch.mark_down(backend, error.message)
        started = request.started_at is not None
        if error.retryable and not started and request.retries < self.settings.max_retries:
            backend.retries += 1
            log.info("request %s failed on backend %s before its first token; back in the queue (%s)",
                     request.request_id, backend.name, error.message)
            return None, error.message
        return Refusal(error.status if not started else 502, error.code, error.message, kind="failed"), None

    def _account(self, attempt: _Attempt, start: float, *, ends: bool) -> None:
        """Book an attempt's cost once: its share of the backend's time, and, when the request ``ends``
        with it (it does not go back to the queue), its tokens at the backend's prices."""
        if attempt.accounted:
            return
        attempt.accounted = True
        request, backend = attempt.request, attempt.backend
        c = backend.config
        duration = self.clock.now() - start
        cost = duration * c.cost_per_gpu_hour_usd * c.gpus / 3600.0 / c.max_concurrency
        output = request.tokens_generated - attempt.base_tokens
        used = request.prompt_used
        prompt = request.prompt_tokens if used and not attempt.base_tokens else 0
        if ends:
            cost += ((request.prompt_tokens if used else 0) * c.cost_per_1m_prompt_tokens_usd
                     + request.tokens_generated * c.cost_per_1m_output_tokens_usd) / 1e6
        request.cost_usd += cost
        backend.cost_usd += cost
        backend.prompt_tokens += prompt
        backend.completion_tokens += output
        self._tokens += output
        self._busy_s += duration / c.max_concurrency
        self._cost_usd += cost
        self.ledger.engine_ran(duration / c.max_concurrency, cost)


def _class_ttft(request: InferenceRequest) -> float:
    """``request``'s service class's ``ttft_s`` (``math.inf``: no class)."""
    deadline = request.class_deadline
    return deadline - request.arrival if deadline is not None else math.inf


def _urgent_ttft(request: InferenceRequest, now: float, rules: PreemptionRules) -> float:
    """Its class's ``ttft_s`` while it has no first token and can still meet its deadline, and that deadline
    is nearer than ``preempt_min_run_s`` (a looser class is served by slots that free and the share rule),
    else ``math.inf``."""
    deadline = request.class_deadline
    if deadline is None or not now < deadline < now + rules.min_run_s or request.started_at is not None:
        return math.inf
    return deadline - request.arrival


#: A lease that could not be confirmed: its slot went to another sender's request.
_SLOT_TAKEN = "its slot went to another request"
#: A tenant not holding any slot, for counting who is above their share should one more tenant come.
_NEWCOMER = "\x00newcomer"
