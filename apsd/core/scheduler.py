"""Scheduler stage: the waiting queue, the batch window, and dispatching to engines on demand.

Ownership: admission puts admitted requests in through :meth:`Scheduler.enqueue`
(in its own task); the scheduler owns the receive end of the demand channel and
the send ends of the engines' answer channels (:meth:`Scheduler.serve_dispatch`).
The queue itself is the aging policy object; the scheduler is its only user, and
the only caller of the three policies on the hot path.

When a dispatch is cut: engines *pull*. An engine with free capacity sends a
:class:`~apsd.core.engine.Demand` and the scheduler answers that engine; only
then does it wait out the window and cut, sized to the engine's free capacity as
it is at that moment, so a dispatch is formed at the last moment and a late
high-priority request still gets in. If the next request in queue order does
not fit, the engine gets an empty dispatch and asks again when it has more room
(queue order is never overtaken by a smaller request).

The window: a dispatch is cut as soon as the batching policy says it is full, or
once ``window_s`` (from the governor) has passed since the first request of
the current backlog arrived. Requests left over after a cut have already
waited, so they go out as soon as an engine has room.

Routing between engines: with several engines that can say how a request would fit them
(``engine.target``: the ``continuous`` engines), the routing policy (``[routing] policy``,
:mod:`apsd.core.routing`) decides where each request with a routing key goes. An engine asking
for work takes a request only if the policy chose it, or chose one that has no room for it (a
spill); otherwise the cut stops there, as for a request that does not fit, and the chosen engine is
asked to ask again. The choice is kept until its engine has no room. So queue order is kept and
routing decides only where. Requests without a key go to whichever engine asks (one pool).

Concurrency: a tenant's (or a key's) ``max_concurrency`` is held before the queue: a request beyond it
waits in its tenant's line (:class:`~apsd.core.concurrency.ConcurrencyGate`, :attr:`Scheduler.gate`)
and enters the queue when one of its tenant's requests ends (step 4 of ``Ledger.finish``:
:meth:`Scheduler.policy_finished`). Its queue deadline runs while it waits.

Requeues: a request whose engine failed before its first token comes back through
:meth:`Scheduler.requeue`, keeping its arrival and sequence number (so its place in
queue order) and its deadline.

Error handling: a policy that raises fails the requests it was handling with a
500 ``policy_error`` naming the policy, and the scheduler carries on. If the
exception came while deciding or cutting a batch (governor reading, batching
``is_full``/``cut``, the queue's ``peek``/``pop``/``effective_priority``), no
batch can be trusted to come out of the queue: every queued request is failed
and the aging policy is replaced by a fresh one (its state is lost), so the
scheduler cannot spin on a queue it cannot empty.
Requests answered while still queued (failed, timed out, or cancelled) are
skipped when they come out of the queue.

Queue timeouts: :meth:`Scheduler.enqueue` stamps each request's ``deadline``
(its arrival plus the shorter of ``queue_timeout_s`` and the request's own
``timeout_s``; none if both are unset) and pushes ``(deadline, seq, request)``
on one heap. One task, :meth:`Scheduler.serve_timeouts`, sleeps until the
earliest deadline (woken early when a push makes an earlier one) and answers
every due request that is still queued with 504 ``queue_timeout`` through the
ledger (which refunds its tokens). Requests already dispatched or answered are
dropped from the heap when they reach its top, or when it is compacted; a
running request is never timed out. O(log N) per request, no task per request,
and in virtual time the expiry happens exactly at the deadline.
"""

from __future__ import annotations

import collections
import heapq
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import attrs
import trio

from apsd.core.clock import ModelClock
from apsd.core.concurrency import ConcurrencyGate
from apsd.core.engine import Demand, Engine
from apsd.core.ledger import Ledger
from apsd.core.models import Capacity, Dispatch, InferenceRequest, Outcome, Refusal
from apsd.core.policy import GovernorReading, OrderingPolicy, PolicySet
from apsd.core.queue import FifoQueue
from apsd.core.routing import routing_key

__all__ = ["Scheduler"]

log = logging.getLogger("apsd.core.scheduler")


class PolicyFailure(Exception):
    """A policy raised; ``str()`` names the kind, the policy and the exception."""


@attrs.define(eq=False)
class Scheduler:
    policies: PolicySet
    ledger: Ledger
    clock: ModelClock
    #: ``[queue] timeout_s``: the longest a request may wait queued, in model seconds (0: no limit).
    queue_timeout_s: float = 0.0
    queue: OrderingPolicy = attrs.field(init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _backlog_since: float | None = attrs.field(default=None, init=False)
    _next_batch_id: int = attrs.field(default=1, init=False)
    #: (kind, bound method) of every policy that defines on_dispatch / on_finish.
    _on_dispatch: list[tuple[str, Callable[..., None]]] = attrs.field(factory=list, init=False)
    _on_finish: list[tuple[str, Callable[..., None]]] = attrs.field(factory=list, init=False)
    _fallback: str | None = attrs.field(default=None, init=False)
    #: The model time the dispatcher waits until (inf: for work); None when it is not waiting.
    _waiting_until: float | None = attrs.field(default=None, init=False)
    #: Requests answered while queued that the queue still holds (skipped when popped).
    _answered_in_queue: int = attrs.field(default=0, init=False)
    #: Decisions the dispatcher has made: a heartbeat (the systemd watchdog reads it).
    decisions: int = attrs.field(default=0, init=False)
    #: Told of every new waiting queue (the store shares fair-share queues' service between replicas).
    on_new_queue: Callable[[OrderingPolicy], None] | None = attrs.field(default=None, init=False)
    #: Engines answered with an empty dispatch, not asked to ask again since (by engine id).
    _answered_empty: dict[int, Engine] = attrs.field(factory=dict, init=False)
    #: The engine whose demand the dispatcher is answering (None: none is asking).
    _asking: Engine | None = attrs.field(default=None, init=False)
    #: The scope of the dispatcher's wait (None: it is not waiting): an arrival may move its deadline.
    _wait_scope: trio.CancelScope | None = attrs.field(default=None, init=False)
    #: (deadline, seq, request) of every queued request with a deadline (and of some that have
    #: left the queue since: dropped lazily). Only enqueue pushes, only serve_timeouts pops.
    _deadlines: list[tuple[float, int, InferenceRequest]] = attrs.field(factory=list, init=False)
    #: Set when a push makes an earlier deadline the heap's first (serve_timeouts waits on it).
    _earlier_deadline: trio.Event = attrs.field(factory=trio.Event, init=False)
    #: Heap size at which requests no longer queued are swept out of it.
    _compact_deadlines_at: int = attrs.field(default=1024, init=False)
    #: The routing policy between several engines, and those engines (:meth:`route_between`).
    _routing: Any = attrs.field(default=None, init=False)
    _routable: list[Any] = attrs.field(factory=list, init=False)
    #: A queued request's chosen engine and the reason, until it is dispatched.
    _routes: dict[InferenceRequest, tuple[Any, str]] = attrs.field(factory=dict, init=False)
    #: With routing: the requests each engine was given and has not finished (its load as routing sees it:
    #: an engine counts a dispatch only once it receives it), by engine id.
    _placed: dict[InferenceRequest, int] = attrs.field(factory=dict, init=False)
    _engine_load: collections.Counter[int] = attrs.field(factory=collections.Counter, init=False)
    #: (engine name, reason) -> requests routed so.
    route_counts: collections.Counter[tuple[str, str]] = attrs.field(factory=collections.Counter, init=False)
    #: Tenants' and keys' ``max_concurrency`` (:mod:`apsd.core.concurrency`; the pipeline sets its limits).
    gate: ConcurrencyGate = attrs.field(factory=ConcurrencyGate, init=False)

    def __attrs_post_init__(self) -> None:
        self._use_queue(self.policies.aging)

    def use_policies(self, policies: PolicySet) -> None:
        """Switch to new policies (a reload): queued requests move to the new queue in admission order.
        The policies already in use: nothing to do (a change to tenants' keys or limits keeps them)."""
        if policies is self.policies:
            return
        now = self.clock.now()
        try:
            waiting = sorted((r for r in self.queue if not r.answered), key=lambda r: r.seq)
        except Exception as exc:  # the old queue cannot even be read: fail what it held
            failure = self._failure("aging", exc)
            waiting = []
            self._fail([r for r in list(self.ledger.outstanding) if r.dispatched_at is None], failure)
        backlog = self._backlog_since
        self.policies, self._fallback, self._answered_in_queue = policies, None, 0
        self._use_queue(policies.aging)
        for request in waiting:
            try:
                self.policies.governor.observe_arrival(request.arrival)
            except Exception as exc:  # the governor starts without that history; the request still runs
                self._failure("governor", exc)
            try:
                self.queue.push(request, now)
            except Exception as exc:
                self._fail([request], self._failure("aging", exc))
        if waiting:
            self._backlog_since = backlog if backlog is not None else now
        self._wake()

    def route_between(self, routing: Any, engines: list[Any]) -> None:
        """Route requests with a routing key between ``engines`` (each with ``target(request)``) by
        ``routing`` (a :class:`~apsd.core.routing.RoutingPolicy`); see the module docstring."""
        self._routing, self._routable = routing, list(engines)

    def _may_take(self, request: InferenceRequest, engine: Engine, taken: int) -> bool:
        """Whether ``engine``, which has room for ``request`` beside the ``taken`` requests it is being
        given in the same dispatch, may take it under the routing policy."""
        if not routing_key(request):
            return True
        chosen = self._routes.get(request)
        if chosen is None or (chosen[0] is not engine and not chosen[0].target(request).room):
            targets = [self._target(e, request, taken if e is engine else 0) for e in self._routable]
            route = self._routing.route(request, targets)
            chosen = (self._routable[route.index], route.reason)
            if not targets[route.index].room:
                chosen = (engine, "spill")
            self._routes[request] = chosen
        if chosen[0] is engine:
            return True
        ask_again = getattr(chosen[0], "ask_again", None)
        if ask_again is not None:
            ask_again()
        return False

    def _target(self, engine: Any, request: InferenceRequest, taken: int) -> Any:
        """``engine`` as the routing policy sees it for ``request``: its load is what it was given and has
        not finished, and the ``taken`` requests it is being given now."""
        target = engine.target(request)
        return attrs.evolve(target, load=self._engine_load[engine.engine_id] + taken)

    def _unplace(self, request: InferenceRequest) -> None:
        engine_id = self._placed.pop(request, None)
        if engine_id is not None:
            self._engine_load[engine_id] -= 1

    def _routed(self, requests: list[InferenceRequest], engine: Engine) -> None:
        """``requests`` were cut for ``engine``: tell the routing policy, stamp and count them."""
        for request in requests:
            self._placed[request] = engine.engine_id
            self._engine_load[engine.engine_id] += 1
            chosen = self._routes.pop(request, None)
            if not routing_key(request):
                continue
            reason = chosen[1] if chosen is not None and chosen[0] is engine else "spill"
            target = self._target(engine, request, 0)
            self._routing.placed(request, target)
            request.route = f"{target.name}; reason={reason}"
            self.route_counts[(target.name, reason)] += 1

    def _use_queue(self, queue: OrderingPolicy) -> None:
        """Make ``queue`` the waiting queue and find which policies want events."""
        self.queue = queue
        self._backlog_since = None
        policies = (("aging", queue), ("governor", self.policies.governor), ("batching", self.policies.batching))
        self._on_dispatch = [(k, p.on_dispatch) for k, p in policies if hasattr(p, "on_dispatch")]
        self._on_finish = [(k, p.on_finish) for k, p in policies if hasattr(p, "on_finish")]
        if self.on_new_queue is not None:
            self.on_new_queue(queue)

    @property
    def queue_depth(self) -> int:
        """Requests waiting for dispatch (the ledger's count: the queue may also hold answered ones)."""
        return self.ledger.queued_total

    def governor_reading(self) -> GovernorReading:
        return self.policies.governor.reading(self.clock.now())

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- policy calls and their failures ----------------------------------------------------
    def _failure(self, which: str, exc: Exception) -> PolicyFailure:
        """Log and describe a policy's exception; ``which``: the policy kind, or ``cut``."""
        if which == "cut":  # batching.cut drives the queue's peek/pop: either policy may have raised
            who = (f"cutting a batch (batching policy {self.policies.names['batching']!r} from aging "
                   f"policy {self.policies.names['aging']!r})")
        else:
            who = f"{which} policy {self.policies.names[which]!r}"
        log.error("%s raised", who, exc_info=exc)
        return PolicyFailure(f"{who} raised {type(exc).__name__}: {exc}")

    def _bad_value(self, kind: str, what: str) -> PolicyFailure:
        """A policy returned something unusable (logged like an exception)."""
        message = f"{kind} policy {self.policies.names[kind]!r} {what}"
        log.error("%s", message)
        return PolicyFailure(message)

    @property
    def policy_names(self) -> dict[str, str]:
        """The policies in force (``aging`` reads ``fifo (fallback)`` after a failed rebuild)."""
        return {**self.policies.names, **({"aging": self._fallback} if self._fallback else {})}

    def _fresh_queue(self) -> None:
        """Replace the aging policy with a new instance; arrival order if even that fails."""
        try:
            fresh = self.policies.new_aging()
        except Exception as exc:
            self._failure("aging", exc)
            log.error("serving in arrival order (fifo) from now on")
            fresh, self._fallback = FifoQueue(), "fifo (fallback)"
        self._use_queue(fresh)

    def _fail(self, requests: Iterable[InferenceRequest], failure: PolicyFailure) -> None:
        for request in requests:
            self.ledger.finish(request, Refusal(500, "policy_error", str(failure), kind="failed"))

    def policy_finished(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        """Tell every policy with an ``on_finish`` method that ``request`` ended (step 4 of
        :meth:`apsd.core.ledger.Ledger.finish`); a policy that raises is logged and reported as a
        policy failure, and the others are still told."""
        if self._placed:
            self._unplace(request)
        for kind, on_finish in self._on_finish:
            try:
                on_finish(request, outcome, now)
            except Exception as exc:  # the outcome is delivered already: log only
                self._failure(kind, exc)
        for released in self.gate.leave(request):
            self._push(released)

    def release_waiting(self) -> None:
        """Queue the requests waiting in their tenant's line that the limits in force now let in (a
        reload raised or removed a ``max_concurrency``)."""
        for released in self.gate.release():
            self._push(released)

    # -- intake ----------------------------------------------------------------------------
    def enqueue(self, request: InferenceRequest) -> None:
        """Put an admitted request in the queue, or in its tenant's line when its tenant or key has its
        ``max_concurrency`` in flight (:attr:`gate`), and tell the governor it arrived."""
        try:
            self.policies.governor.observe_arrival(request.arrival)
        except Exception as exc:
            self._fail([request], self._failure("governor", exc))
            return
        if not self.gate.enter(request):
            self._set_deadline(request)  # (its queue timeout runs while it waits in line)
            return
        self._push(request)

    def _push(self, request: InferenceRequest) -> None:
        """Put a request that may run (the gate let it in) in the queue."""
        try:
            self.queue.push(request, self.clock.now())
        except Exception as exc:
            self._fail([request], self._failure("aging", exc))
            return
        if self._backlog_since is None:
            self._backlog_since = request.arrival
        if request.deadline is None:
            self._set_deadline(request)
        if self._answered_empty:
            self._retry_empty(request)
        if self._waiting_until is not None:
            self._after_arrival()

    def requeue(self, request: InferenceRequest, reason: str, *, retry: bool = True,
                keep_progress: bool = False) -> None:
        """Put a dispatched request back in the queue, in its old place (arrival and ``seq`` kept):
        its engine failed before its first token (``retry``: that spends one of its retries), or
        preempted it. Its deadline is kept (it may expire at once), but for a request paused after
        its first token (``keep_progress``: its output so far is kept, and it resumes from there),
        which no queue timeout cuts short any more."""
        if self._placed:
            self._unplace(request)
        self.ledger.requeued(request, reason, retry=retry, keep_progress=keep_progress)
        if keep_progress:
            request.deadline = None
        now = self.clock.now()
        try:
            self.queue.push(request, now)
        except Exception as exc:
            self._fail([request], self._failure("aging", exc))
            return
        if self._backlog_since is None:
            self._backlog_since = now
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.seq, request))
            if self._deadlines[0][2] is request:
                self._earlier_deadline.set()
        if self._answered_empty:
            self._retry_empty(request)
        self._wake()

    def _retry_empty(self, request: InferenceRequest) -> None:
        """Engines answered with an empty dispatch (the head did not fit them) ask again at once if
        ``request``, just queued, fits them: it may lead the queue now, or take their headroom."""
        for engine_id, engine in list(self._answered_empty.items()):
            ask_again = getattr(engine, "ask_again", None)
            if ask_again is not None and engine.free().fits(request):
                del self._answered_empty[engine_id]
                ask_again()

    def rank(self, request: InferenceRequest, now: float) -> float:
        """``request``'s priority under the queue policy now (higher: served sooner); engines
        preempt the lowest-ranked running sequence first. The bid if the policy raises."""
        try:
            return float(self.queue.effective_priority(request, now))
        except Exception:
            return float(request.priority_bid)

    def _set_deadline(self, request: InferenceRequest) -> None:
        """Stamp ``request.deadline`` (the shorter of the two timeouts, from its arrival) and
        remember it for :meth:`serve_timeouts`. A timeout longer than the config's is clamped."""
        timeouts = [t for t in (self.queue_timeout_s, request.timeout_s) if t]
        if not timeouts:  # the default: no limit, nothing to remember
            return
        request.deadline = request.arrival + min(timeouts)
        heap = self._deadlines
        if len(heap) >= self._compact_deadlines_at:  # amortised O(1): sweep out who left the queue
            heap[:] = [entry for entry in heap if self._still_queued(entry[2])]
            heapq.heapify(heap)
            self._compact_deadlines_at = max(1024, 2 * len(heap))
        heapq.heappush(heap, (request.deadline, request.seq, request))
        if heap[0][2] is request:
            self._earlier_deadline.set()

    @staticmethod
    def _still_queued(request: InferenceRequest) -> bool:
        return not request.answered and request.dispatched_at is None

    async def serve_timeouts(self) -> None:
        """Answer queued requests that reach their deadline with 504 ``queue_timeout``; runs until cancelled."""
        heap = self._deadlines
        while True:
            while heap and (not self._still_queued(heap[0][2]) or self.clock.reached(heap[0][0])):
                _, _, request = heapq.heappop(heap)
                if self._still_queued(request):
                    self._expire(request)
            self._earlier_deadline = trio.Event()
            with trio.move_on_at(self.clock.deadline(heap[0][0]) if heap else math.inf):
                await self._earlier_deadline.wait()

    def _expire(self, request: InferenceRequest) -> None:
        waited = self.clock.now() - request.arrival
        assert request.deadline is not None
        timeout = request.deadline - request.arrival
        self.ledger.finish(request, Refusal(
            504, "queue_timeout", f"waited {waited:.3f} s in the queue (timeout {timeout:g} s)", kind="cancelled"))
        request.prompt = ""  # the queue may hold it a while longer: keep only what ordering needs
        self.note_answered_in_queue()

    def _after_arrival(self) -> None:
        """The dispatcher waits: wake it if it could decide differently now (the dispatch is full,
        the window has passed, or it waited for work with no window to wait out); if only the
        window's end came closer, move its wake-up there instead (no task switch). Skipping
        needless wake-ups keeps the simulator fast; when in doubt, wake."""
        try:
            now = self.clock.now()
            engine, scope, waiting_until = self._asking, self._wait_scope, self._waiting_until
            if engine is None or scope is None or waiting_until is None or self._backlog_since is None \
                    or self.policies.batching.is_full(self.queue, now, engine.free()):
                self._wake()
                return
            window = float(self.policies.governor.reading(now).window_s)
            cut_at = self._backlog_since + window
            if not 0.0 <= window < math.inf or self.clock.reached(cut_at):
                self._wake()
            elif cut_at < waiting_until:
                self._waiting_until = cut_at
                scope.deadline = self.clock.deadline(cut_at)
        except Exception:  # the dispatcher will meet (and handle) the same failure
            self._wake()

    def drop_queued(self) -> list[InferenceRequest]:
        """Empty the queue (shutdown) and return what it held, unanswered: the caller must answer
        every request still outstanding afterwards (:meth:`Pipeline.abort_outstanding` answers all
        of the ledger's), since a request left in no queue would otherwise never be answered."""
        now = self.clock.now()
        try:
            dropped = [self.queue.pop(now) for _ in range(len(self.queue))]
        except Exception as exc:
            self._failure("aging", exc)
            dropped = []
            self._fresh_queue()
        self._backlog_since = None
        return dropped

    def note_answered_in_queue(self) -> None:
        """A queued request was answered (its client left): compact the queue if such
        leftovers outnumber the live requests, for policies that can (``discard_answered``)."""
        self._answered_in_queue += 1
        if self._answered_in_queue > max(1024, self.ledger.queued_total):
            discard = getattr(self.queue, "discard_answered", None)
            if discard is not None:
                try:
                    discard()
                except Exception as exc:
                    self._fail([r for r in list(self.ledger.outstanding) if r.dispatched_at is None],
                               self._failure("aging", exc))
                    self._fresh_queue()
            self._answered_in_queue = 0

    # -- dispatch --------------------------------------------------------------------------
    async def serve_dispatch(
        self,
        demands: trio.MemoryReceiveChannel[Demand],
        answers: dict[int, trio.MemorySendChannel[Dispatch]],
    ) -> None:
        """For each engine that asks, wait for a dispatch that fits it and answer that engine.

        Owns ``demands`` and every channel in ``answers`` (by engine id): closes them when it returns.
        """
        async with demands:
            try:
                while True:
                    try:  # (no checkpoint when a demand is already there: one task switch less per dispatch)
                        demand = demands.receive_nowait()
                    except trio.WouldBlock:
                        try:
                            demand = await demands.receive()
                        except trio.EndOfChannel:
                            return
                    except trio.EndOfChannel:
                        return
                    dispatch = await self.wait_next_dispatch(demand.engine)
                    try:  # (each engine has one ask outstanding and an answer buffer of one: never full)
                        answers[demand.engine.engine_id].send_nowait(dispatch)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):  # the engine stopped
                        for request in dispatch.requests:
                            self.requeue(request, "its engine stopped before running it")
            finally:
                for channel in answers.values():
                    channel.close()

    def dispatch_owed(self) -> bool:
        """Whether the dispatcher owes a decision now: an engine asked for work and either
        the window it waits out has passed, or it waits for work although requests are queued."""
        waiting_until = self._waiting_until
        if waiting_until is None:
            return False
        if waiting_until == float("inf"):
            return self.ledger.queued_total > 0
        return self.clock.reached(waiting_until)

    async def wait_next_dispatch(self, engine: Engine) -> Dispatch:
        """Wait until the queue has a dispatch for ``engine`` (full for its free capacity, or the
        window elapsed), then cut it; empty if the next request in queue order does not fit."""
        self._asking = engine
        try:
            return await self._wait_next_dispatch(engine)
        finally:
            self._asking = None

    async def _wait_next_dispatch(self, engine: Engine) -> Dispatch:
        while True:
            self.decisions += 1
            try:
                decision = self._decide(self.clock.now(), engine)
            except PolicyFailure as failure:  # a policy raised, or returned something unusable
                self._fail_queued(failure)
                # Everything queued has been answered: nothing to do before the next arrival
                # (and a policy that fails every time cannot make this loop spin).
                decision = None
            if isinstance(decision, Dispatch):
                return decision
            self._waiting_until = float("inf") if decision is None else decision
            try:
                with trio.move_on_at(self.clock.deadline(self._waiting_until)) as self._wait_scope:
                    await self._changed.wait()
            finally:
                self._waiting_until = self._wait_scope = None

    def _decide(self, now: float, engine: Engine) -> Dispatch | float | None:
        """A dispatch to send now, else the model time to look again (None: when something arrives)."""
        try:
            if not self.queue:
                return None
        except Exception as exc:
            raise self._failure("aging", exc) from exc
        try:
            reading = self.policies.governor.reading(now)
            window = float(reading.window_s)
        except Exception as exc:
            raise self._failure("governor", exc) from exc
        if not 0.0 <= window < float("inf"):
            raise self._bad_value("governor", f"returned window_s {window!r} (must be finite and >= 0)")
        if self._backlog_since is None:  # a push that raised may have left a request in the queue
            self._backlog_since = now
        cut_at = self._backlog_since + window
        free = engine.free()
        if self._routing is not None:
            free = attrs.evolve(free, route=lambda request, taken: self._may_take(request, engine, taken))
        try:
            full = self.policies.batching.is_full(self.queue, now, free)
        except Exception as exc:
            raise self._failure("batching", exc) from exc
        if not (full or self.clock.reached(cut_at)):
            return cut_at
        # Everything cut may have been answered already (skipped): look again at once.
        return self._cut(now, reading, free, engine) or now

    def _head_fits(self, now: float, free: Capacity) -> bool:
        """Whether the next request in queue order fits ``free`` (True when that cannot be told)."""
        try:
            head = self.queue.peek(now)
        except Exception:
            return True
        return free.fits(head)

    def _fail_queued(self, failure: PolicyFailure) -> None:
        """After a failed cut: fail every admitted request not yet dispatched, start a fresh queue."""
        self._fail([r for r in list(self.ledger.outstanding) if r.dispatched_at is None], failure)
        self._fresh_queue()

    def _cut(self, now: float, reading: GovernorReading, free: Capacity, engine: Engine) -> Dispatch | None:
        """Cut a dispatch (None if everything that came out had been answered already; empty if the
        next request does not fit ``free``)."""
        queue, engine_id = self.queue, engine.engine_id
        try:
            before = len(queue)
            cut = list(self.policies.batching.cut(queue, now, free))
            after = len(queue)
        except Exception as exc:
            raise self._failure("cut", exc) from exc
        if not cut:
            if self._head_fits(now, free):
                raise self._bad_value("batching", "cut an empty batch from a non-empty queue")
            self._answered_empty[engine_id] = engine
            return Dispatch(dispatch_id=0, requests=(), formed_at=now, window_s=reading.window_s, engine_id=engine_id)
        if not all(isinstance(r, InferenceRequest) for r in cut):
            raise self._bad_value("batching", "cut something that is not a request")
        if len({id(r) for r in cut}) != len(cut) or after > before - len(cut):
            raise self._bad_value("batching", "cut requests it did not pop from the queue (or one twice)")
        requests = [r for r in cut if not r.answered]  # skip requests answered while queued
        self._answered_in_queue = max(0, self._answered_in_queue - (len(cut) - len(requests)))
        if self._routing is not None:
            self._routed(requests, engine)
        if not after:
            self._backlog_since = None
            self._routes.clear()
        if not requests:
            return None
        try:
            priorities = [float(queue.effective_priority(request, now)) for request in requests]
        except Exception as exc:  # nothing stamped yet: _fail_queued answers them
            raise self._failure("aging", exc) from exc
        if not all(math.isfinite(p) for p in priorities):
            raise self._bad_value("aging", "returned an effective priority that is not a finite number")
        dispatch_id, size = self._next_batch_id, len(requests)
        for request, priority in zip(requests, priorities):
            request.dispatched_at = now
            request.effective_priority = priority
            request.engine_id, request.dispatch_id, request.dispatch_size = engine_id, dispatch_id, size
        batch = Dispatch(dispatch_id=dispatch_id, requests=tuple(requests), formed_at=now, window_s=reading.window_s,
                         engine_id=engine_id)
        self._next_batch_id += 1
        self.ledger.dispatched(batch)
        for kind, on_dispatch in self._on_dispatch:
            try:
                on_dispatch(batch, now)
            except Exception as exc:
                self._fail(requests, self._failure(kind, exc))
                return None
        return batch

