"""Service classes: a promised time to first token, kept, refused early, or counted as missed.

A class (``[classes.<name>]``, :class:`~apsd.core.config.ServiceClassConfig`) promises its requests
their first token within ``ttft_s`` model seconds of admission (and, with ``tpot_s``, a mean time
per output token after it). A tenant may use the classes its ``classes`` lists; a request names one
(``X-Apsd-Class`` or ``service_class``) or gets its tenant's ``default_class``.

Ownership: one :class:`ServiceClasses` per pipeline. Admission calls :meth:`ServiceClasses.resolve`
(step 2 of its checks) and :meth:`ServiceClasses.refuse_unmeetable` (the last check before the
bucket); the pipeline runs :meth:`ServiceClasses.serve_deadlines` beside the scheduler's loops; the
ledger calls it at each of a request's steps, in order, as one of its bookkeepers
(:class:`~apsd.core.ledger.Bookkeeper`); it answers only through the ledger.

Rules:

* **Deadline.** An admitted classed request gets ``class_deadline = arrival + ttft_s``. The ``fair``
  queue serves classed requests in deadline order (:mod:`apsd.policies.fair` states the rule and
  what stays of fair share).
* **Refused early** (``on_miss = "refuse"``): at admission, the wait ahead of the request is
  estimated as the classed requests queued whose class's ``ttft_s`` is at most its own (those that
  the ``fair`` queue serves no later than it), times the mean time between dispatches while
  requests were queued (the engines' measured rate, over the last :data:`GAP_SAMPLES` such
  dispatches; before any was measured, nothing is refused), plus what the engines say a first
  token takes from dispatch (``engine_wait``: the ``continuous`` engine's prompts ahead of it at its
  measured prefill rate; the least over the engines); none at all when an engine would take it at once
  (``takes_now``: a ``forward`` engine with a free slot, or a request to preempt for it). An estimate
  past ``ttft_s`` is answered at
  once: 503 ``deadline_unmeetable`` with ``Retry-After`` (the estimated wait, in wall seconds).
* **Refused in the queue** (``refuse``): a request still queued when its deadline comes can no
  longer meet it, and is answered then with the same 503 (counted ``cancelled`` in the books, its
  tokens refunded): an answer within ``ttft_s`` for every client, never a truncated 200. One task
  sleeps until the earliest such deadline; O(log N) per request.
* **Best effort** (``on_miss = "best_effort"``): never refused for its deadline; once late it stays
  queued behind the requests that can still meet theirs, and it is counted missed.

Attainment, per class: ``met`` (a 200 whose ``ttft_ms`` is at most ``ttft_s``, and whose
``tpot_ms`` is at most ``tpot_s`` when that is set), ``missed`` (any other end of an admitted
request, but a client's own disconnection), ``refused`` (``deadline_unmeetable``, at admission or
in the queue). ``attainment = met / (met + missed + refused)``. Requests refused for other reasons
(rate limits, queue limits) are not counted: they are their tenant's limits, not the class's.
"""

from __future__ import annotations

import collections
import heapq
import math
from collections.abc import Callable, Mapping

import attrs
import trio

from apsd.core.clock import ModelClock
from apsd.core.config import ServiceClassConfig, TenantConfig
from apsd.core.ledger import Bookkeeper
from apsd.core.models import Completion, InferenceRequest, Outcome, Refusal

__all__ = ["ClassFigures", "DEADLINE_UNMEETABLE", "GAP_SAMPLES", "ServiceClasses", "class_result", "urgency"]

#: The error code of a request refused because it cannot meet its class's deadline.
DEADLINE_UNMEETABLE = "deadline_unmeetable"
#: Dispatches (made while requests were queued) over which the mean time between dispatches is kept.
GAP_SAMPLES = 64
_EPSILON = 1e-9


def urgency(request: InferenceRequest) -> float:
    """A classed request's place among those that can still meet their deadline (smaller: more
    urgent): its class's ``ttft_s`` first (tighter first), then its deadline. ``ttft_s`` is scaled by
    ``2 ** 32`` so that a millisecond between two classes outweighs any span of deadlines; inside a
    class deadline order is arrival order, so the rounding of large keys falls back to admission
    order (``seq``), which is the same. The ``fair`` queue and the continuous engine both order by it."""
    deadline = request.class_deadline
    assert deadline is not None
    return (deadline - request.arrival) * 2.0 ** 32 + deadline


@attrs.frozen
class ClassFigures:
    """One class's counts since start (``apsd_class_requests_total``, ``apsd_class_attainment``)."""

    name: str
    ttft_s: float
    tpot_s: float
    on_miss: str
    met: int
    missed: int
    refused: int
    queued: int

    @property
    def total(self) -> int:
        return self.met + self.missed + self.refused

    @property
    def attainment(self) -> float | None:
        """met / (met + missed + refused); None before any request of the class ended."""
        return self.met / self.total if self.total else None


def class_result(spec: ServiceClassConfig, outcome: Outcome) -> str | None:
    """``met``, ``missed`` or ``refused`` for an admitted request of class ``spec`` that ended with
    ``outcome``; None for a client that left (not counted)."""
    if isinstance(outcome, Completion):
        if outcome.ttft_ms > spec.ttft_s * 1000.0 + _EPSILON:
            return "missed"
        if spec.tpot_s and outcome.tpot_ms is not None and outcome.tpot_ms > spec.tpot_s * 1000.0 + _EPSILON:
            return "missed"
        return "met"
    if outcome.error == DEADLINE_UNMEETABLE:
        return "refused"
    if outcome.error == "client_disconnected":
        return None
    return "missed"


@attrs.define(eq=False)
class _Counts:
    met: int = 0
    missed: int = 0
    refused: int = 0
    queued: int = 0


@attrs.define(eq=False)
class ServiceClasses(Bookkeeper):
    """The classes, the wait estimate, the queue deadlines and the attainment counts; it follows every
    request's steps as one of the ledger's bookkeepers (:meth:`~apsd.core.ledger.Ledger.keep_books_with`)."""

    classes: dict[str, ServiceClassConfig]
    clock: ModelClock
    #: The ledger's count of queued requests (whether a dispatch left work behind).
    queued_total: Callable[[], int]
    #: Answers a queued request (the ledger's ``finish``), then tells the scheduler it is in its queue.
    finish: Callable[[InferenceRequest, Outcome], object]
    note_answered_in_queue: Callable[[], None]
    #: Model seconds from dispatch to the first token of a request of a class of ``ttft_s`` on the engines
    #: (the least of theirs, :meth:`apsd.engines.continuous.ContinuousEngine.first_token_wait_s`); None:
    #: not known.
    engine_wait: Callable[[InferenceRequest, float], float] | None = None
    #: Whether an engine would take ``request`` at once (a ``forward`` engine with a free slot for it, or
    #: a request to preempt for it): its queue wait is then none (None: not known).
    takes_now: Callable[[InferenceRequest], bool] | None = None
    _counts: dict[str, _Counts] = attrs.field(factory=dict, init=False)
    #: Classed requests in the queue now.
    _in_queue: set[InferenceRequest] = attrs.field(factory=set, init=False)
    #: (deadline, seq, request) of queued requests of ``refuse`` classes (stale entries dropped lazily).
    _deadlines: list[tuple[float, int, InferenceRequest]] = attrs.field(factory=list, init=False)
    _earlier_deadline: trio.Event = attrs.field(factory=trio.Event, init=False)
    #: Model seconds between consecutive dispatches while requests stayed queued, and their sum.
    _gaps: collections.deque[float] = attrs.field(factory=lambda: collections.deque(maxlen=GAP_SAMPLES),
                                                  init=False)
    _gap_sum: float = attrs.field(default=0.0, init=False)
    _last_dispatch: float | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self._counts = {name: _Counts() for name in self.classes}

    def reconfigure(self, classes: Mapping[str, ServiceClassConfig]) -> list[str]:
        """Take new classes (a reload); counts of classes kept are kept. Returns what changed."""
        changes = [f"class {name} {'added' if name not in self.classes else 'changed'}"
                   for name, spec in sorted(classes.items()) if self.classes.get(name) != spec]
        changes += [f"class {name} removed" for name in sorted(set(self.classes) - set(classes))]
        self.classes = dict(classes)
        for name in classes:
            self._counts.setdefault(name, _Counts())
        return changes

    # -- admission -------------------------------------------------------------------------------
    def resolve(self, request: InferenceRequest, tenant: TenantConfig) -> Refusal | None:
        """Check the class ``request`` names against the classes and its tenant's list, or give it
        its tenant's ``default_class``: 400 ``unknown_class``, 403 ``class_not_allowed``, or None."""
        name = request.service_class
        if name is None:
            default = tenant.default_class
            request.service_class = default if default and default in self.classes else None
            return None
        if name not in self.classes:
            known = ", ".join(sorted(self.classes)) or "none configured"
            return Refusal(400, "unknown_class", f"service_class: no class named {name!r} (classes: {known})",
                           field="service_class")
        if name not in tenant.classes:
            return Refusal(403, "class_not_allowed", f"tenant {request.tenant_id!r} may not use class {name!r} "
                           f"(it may use: {', '.join(tenant.classes) or 'none'})", field="service_class")
        return None

    def estimated_wait(self, name: str) -> float:
        """Model seconds a new request of class ``name`` is estimated to wait before dispatch."""
        if not self._gaps:
            return 0.0
        ttft = self.classes[name].ttft_s
        ahead = sum(self._counts[c].queued for c, spec in self.classes.items() if spec.ttft_s <= ttft)
        return ahead * self._gap_sum / len(self._gaps)

    def refuse_unmeetable(self, request: InferenceRequest, now: float) -> Refusal | None:
        """Stamp ``request``'s deadline (``now`` is its arrival); a ``refuse`` class's request whose
        estimated wait passes it is refused 503 ``deadline_unmeetable``."""
        name = request.service_class
        if name is None:
            return None
        spec = self.classes[name]
        request.class_deadline = now + spec.ttft_s
        request.class_best_effort = spec.on_miss == "best_effort"
        if request.class_best_effort:
            return None
        if self.takes_now is not None and self.takes_now(request):
            return None
        wait = self.estimated_wait(name)
        if wait <= spec.ttft_s and self.engine_wait is not None:
            wait += self.engine_wait(request, spec.ttft_s)
        if wait <= spec.ttft_s:
            return None
        request.class_deadline = None
        return Refusal(503, DEADLINE_UNMEETABLE,
                       f"class {name!r} promises a first token within {spec.ttft_s:g} s, but the requests ahead "
                       f"of this one are estimated to take {wait:.2f} s; retry later or use a looser class",
                       headers={"Retry-After": str(max(1, math.ceil(self.clock.wall_seconds(wait))))},
                       field="service_class")

    # -- the queue's deadlines ---------------------------------------------------------------------
    async def serve_deadlines(self) -> None:
        """Answer queued requests of ``refuse`` classes whose deadline came (503
        ``deadline_unmeetable``); runs until cancelled."""
        heap = self._deadlines
        while True:
            while heap and (heap[0][2] not in self._in_queue or self.clock.reached(heap[0][0])):
                _, _, request = heapq.heappop(heap)
                if request in self._in_queue and not request.answered:
                    self._expire(request)
            self._earlier_deadline = trio.Event()
            with trio.move_on_at(self.clock.deadline(heap[0][0]) if heap else math.inf):
                await self._earlier_deadline.wait()

    def _expire(self, request: InferenceRequest) -> None:
        name = request.service_class
        spec = self.classes.get(name or "")
        target = f"{spec.ttft_s:g} s" if spec is not None else "its target"
        retry = str(max(1, math.ceil(self.clock.wall_seconds(spec.ttft_s)))) if spec is not None else "1"
        self.finish(request, Refusal(503, DEADLINE_UNMEETABLE,
                                     f"class {name!r} promises a first token within {target}; this request was still "
                                     "queued at its deadline", kind="cancelled", headers={"Retry-After": retry},
                                     field="service_class"))
        request.prompt = ""
        self.note_answered_in_queue()

    def _watch(self, request: InferenceRequest) -> None:
        if request.class_deadline is None or request.class_best_effort:
            return
        heap = self._deadlines
        if len(heap) > 2 * len(self._in_queue) + 64:  # amortised O(1): sweep out who left the queue
            heap[:] = [entry for entry in heap if entry[2] in self._in_queue]
            heapq.heapify(heap)
        heapq.heappush(heap, (request.class_deadline, request.seq, request))
        if heap[0][2] is request:
            self._earlier_deadline.set()

    # -- the request's steps (a Bookkeeper's) -------------------------------------------------------
    def _enter(self, request: InferenceRequest) -> None:
        counts = self._counts.get(request.service_class or "")
        if counts is not None and request not in self._in_queue:
            self._in_queue.add(request)
            counts.queued += 1
            self._watch(request)

    def _leave(self, request: InferenceRequest) -> None:
        if request in self._in_queue:
            self._in_queue.discard(request)
            self._counts[request.service_class or ""].queued -= 1

    def admitted(self, request: InferenceRequest, now: float) -> None:
        if request.service_class is not None:
            self._enter(request)

    def requeued(self, request: InferenceRequest, now: float) -> None:
        if request.service_class is not None and request.started_at is None:   # (a paused one met its deadline or not)
            self._enter(request)

    def dispatched(self, request: InferenceRequest, now: float) -> None:
        if request.service_class is not None:
            self._leave(request)
        last = self._last_dispatch
        if last is not None:
            gaps = self._gaps
            if len(gaps) == gaps.maxlen:
                self._gap_sum -= gaps[0]
            gap = max(0.0, now - last)
            gaps.append(gap)
            self._gap_sum += gap
        self._last_dispatch = now if self.queued_total() > 0 else None

    def rejected(self, request: InferenceRequest, refusal: Refusal, now: float) -> None:
        if refusal.error == DEADLINE_UNMEETABLE and request.service_class in self._counts:
            self._counts[request.service_class].refused += 1

    def finished(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        name = request.service_class
        if name is None:
            return
        self._leave(request)
        spec, counts = self.classes.get(name), self._counts.get(name)
        if spec is None or counts is None:
            return
        result = class_result(spec, outcome)
        if result is not None:
            setattr(counts, result, getattr(counts, result) + 1)

    # -- the view ----------------------------------------------------------------------------------
    def statistics(self) -> tuple[ClassFigures, ...]:
        """Every configured class's figures, by name."""
        return tuple(ClassFigures(name, spec.ttft_s, spec.tpot_s, spec.on_miss, c.met, c.missed, c.refused, c.queued)
                     for name, spec in sorted(self.classes.items()) if (c := self._counts[name]) is not None)
