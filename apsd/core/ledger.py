"""The books: every request's steps and outcome, counted once, and the figures derived from them.

Ownership: the ledger is the only code that resolves a request's reply slot
(:meth:`Ledger.finish`, :meth:`Ledger.refuse_unadmitted`), and the only code that
moves a request between queued and running, so counting and answering cannot drift
apart. :meth:`Ledger.finish` is where every admitted request ends, in one written sequence
(the books, the tenant's settlement, the policies, the stream, the bookkeepers, then the observers).
What else must follow a request's steps (the service classes' queue and deadlines, the usage history
for chargeback) is a :class:`Bookkeeper`, called directly at each step, in order, unshielded: its
failure is the request's step failing, never a log line. Each step is then announced on the
:class:`~apsd.core.events.EventBus`, which carries observation only (the Prometheus histograms,
logs, plugins), each listener shielded from the others: nothing that must happen hangs off an event.
It keeps, per tenant and overall::

    admitted == completed + failed + cancelled + queued + running

at every moment (``conservation_ok`` in :meth:`Ledger.statistics`).

Cost per request: independent of the number of tenants. Every figure a request moves is a
running counter (the tenant's, and the totals over all tenants: ``queued_total``,
``running_total``, ``queued_tokens``, ``totals``), so no step of a request and none of
admission's checks sums over tenants. :attr:`Ledger.changes` names the tenants whose counters
moved since a reader last looked (the Prometheus exporter renders only those again), in time
proportional to their number. :meth:`Ledger.statistics` reads the totals; only its fairness
index visits every tenant with admitted work (a sum over floats, once per call).

Usage: a request's tenant is charged what it used (``request.used_tokens``: its prompt
once it started, and the tokens it generated), whatever its outcome (:func:`billed_tokens`;
a request that failed before its first token used nothing). The per-tenant token and cost
counters are those charges, and so is the spend in dollars (``[prices]``, :mod:`apsd.core.prices`),
set on the request (``spend_usd``) when the books count it; an issued key's counters
(:attr:`Ledger.keys`) are its requests' part of them.

Fairness: Jain's index ``(sum x)^2 / (n * sum x^2)`` where ``x_i`` is the
output tokens served to tenant ``i`` divided by its configured rate (its
entitled share), over the tenants that had at least one request admitted.
1.0 means every active tenant got service in proportion to its rate; 1/n
means one tenant got everything.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping

import attrs
import numpy as np
import trio

from apsd.core.clock import ModelClock
from apsd.core.config import strings
from apsd.core.events import EventBus
from apsd.core.models import Completion, Dispatch, InferenceRequest, Outcome, Refusal

__all__ = ["Bookkeeper", "ChangeLog", "KeyStats", "Ledger", "LedgerStatistics", "TenantStats", "jain_index"]

FAIRNESS_DEFINITION = ("Jain's index (sum x)^2/(n*sum x^2); x_i = output tokens served to tenant i divided by "
                       "its configured rate, over tenants with at least one admitted request")


class Bookkeeper:
    """What follows a request's steps and must not miss one (see the module docstring): the ledger
    calls these in the order its bookkeepers were added (:meth:`Ledger.keep_books_with`), after its
    own books and before the observers, and lets their exceptions propagate. Each does nothing here:
    a bookkeeper overrides the steps it follows."""

    def admitted(self, request: InferenceRequest, now: float) -> None:
        """``request`` entered the queue."""

    def dispatched(self, request: InferenceRequest, now: float) -> None:
        """``request`` left the queue for its engine."""

    def requeued(self, request: InferenceRequest, now: float) -> None:
        """``request`` went back to the queue (its engine failed before its first token, or preempted it)."""

    def rejected(self, request: InferenceRequest, refusal: Refusal, now: float) -> None:
        """Admission refused ``request`` (it never entered the queue)."""

    def finished(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        """``request`` ended (:meth:`Ledger.finish`, step 6)."""


def jain_index(values: Iterable[float]) -> float | None:
    """Jain's fairness index of ``values`` (None when there is nothing to compare)."""
    x = np.asarray(list(values), dtype=float)
    if x.size == 0 or not np.any(x):
        return None
    return float(x.sum() ** 2 / (x.size * np.square(x).sum()))


def billed_tokens(request: InferenceRequest, outcome: Outcome) -> int:
    """What ``request`` is charged once it has ``outcome``: what it used (its prompt once it
    started, and the output produced), whatever the outcome. A request that failed before its
    first token used nothing and pays nothing; one that failed after tokens reached its client
    pays for them (the backend did that work)."""
    return request.used_tokens


@attrs.define
class TenantStats:
    """Counters for one tenant (all monotonic except ``queued`` and ``running``)."""

    admitted: int = 0
    rejected: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    queued: int = 0
    running: int = 0
    #: Tokens charged (prompt, and output): completed requests' and those cancelled while running.
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cost_usd: float = 0.0
    #: What those charges cost the tenant at ``[prices]`` (US dollars), and requests whose model had no price.
    spend_usd: float = 0.0
    unpriced: int = 0
    #: (A dict of str -> int: the garbage collector does not track it, a Counter it would.)
    rejected_by_error: dict[str, int] = attrs.field(factory=dict)

    @property
    def in_flight(self) -> int:
        return self.queued + self.running


class ChangeLog:
    """Which keys changed, for any number of readers that each remember how far they read.

    :meth:`touch` is O(1). A reader keeps the :attr:`mark` it last read at and asks
    :meth:`since` for the keys touched after it: the time is proportional to their number,
    not to the number of keys there are.
    """

    def __init__(self) -> None:
        #: Touches so far: the mark of the latest.
        self.mark = 0
        self._latest: dict[str, int] = {}  # key -> mark of its latest touch, oldest first

    def touch(self, key: str) -> None:
        self.mark += 1
        latest = self._latest
        latest.pop(key, None)  # (moved to the end: the dict stays ordered by latest touch)
        latest[key] = self.mark

    def since(self, mark: int) -> list[str]:
        """The keys touched after ``mark`` (each once, most recently touched first)."""
        keys = []
        for key, touched in reversed(self._latest.items()):
            if touched <= mark:
                break
            keys.append(key)
        return keys


@attrs.define
class KeyStats:
    """Counters for one issued key (its requests admitted, ended, and what they were charged)."""

    tenant: str
    admitted: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    spend_usd: float = 0.0


@attrs.frozen
class RequestCounts:
    admitted: int
    rejected: int
    rejected_by_error: dict[str, int]
    completed: int
    failed: int
    cancelled: int
    queued: int
    running: int
    in_flight: int
    conservation_ok: bool


@attrs.frozen
class TokenCounts:
    #: Prompt and output tokens charged to tenants so far.
    prompt: int
    generated: int
    #: Prompt + requested tokens of the requests queued now (what ``queue.max_tokens`` bounds).
    queued: int


@attrs.frozen
class Percentiles:
    """Milliseconds over the most recent samples (None before the first)."""

    p50: float | None
    p95: float | None
    p99: float | None


@attrs.frozen
class Fairness:
    jain_index: float | None
    definition: str = FAIRNESS_DEFINITION


@attrs.frozen
class LedgerStatistics:
    """The books at one moment (model time); :meth:`Ledger.statistics` makes them."""

    requests: RequestCounts
    tokens: TokenCounts
    #: Micro-batches that finished running (0 for the continuous and forward engines).
    batches: int
    elapsed_s: float
    throughput_tokens_per_s: float
    #: Busy time / (engines * elapsed_s): an engine (or forwarded backend) busy all along counts 1.
    gpu_utilization: float
    cost_usd: float
    cost_per_1m_tokens_usd: float | None
    queue_wait_ms: Percentiles
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    latency_ms: Percentiles
    fairness: Fairness


#: Recent samples kept per latency figure, for the percentiles of ``/metrics``.
_SAMPLES = 10_000


def _percentiles(samples: Iterable[float]) -> Percentiles:
    values = np.asarray(list(samples), dtype=float)
    if not values.size:
        return Percentiles(None, None, None)
    return Percentiles(*(float(v) * 1000 for v in np.percentile(values, [50, 95, 99])))


def _recent() -> collections.deque[float]:
    return collections.deque(maxlen=_SAMPLES)


@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)  # (counters are set per request: no hooks)
class Ledger:
    """Counts, outstanding requests, GPU busy time and cost."""

    tenant_names: tuple[str, ...] = attrs.field(default=(), converter=strings)
    tenants: dict[str, TenantStats] = attrs.field(init=False)
    #: Refusals that name no configured tenant (unknown tenant, malformed body): counted, but
    #: never as a new entry per name, so a client cannot grow this dict.
    unattributed: TenantStats = attrs.field(factory=TenantStats, init=False)
    #: Admitted requests without an outcome yet, by identity, in admission order.
    outstanding: dict[InferenceRequest, None] = attrs.field(factory=dict)
    #: The monotonic counters summed over every tenant and ``unattributed``, kept as they move
    #: (its ``queued`` and ``running`` stay 0: those totals are ``queued_total``, ``running_total``).
    totals: TenantStats = attrs.field(factory=TenantStats, init=False)
    #: The configured tenants whose counters moved, touched on every move (see :class:`ChangeLog`).
    changes: ChangeLog = attrs.field(factory=ChangeLog, init=False)
    #: Requests queued and running now, over every tenant (running counters: O(1) to read).
    queued_total: int = 0
    running_total: int = 0
    #: Tokens (prompt + requested) of the queued requests: what ``[queue] max_tokens`` bounds.
    queued_tokens: int = 0
    batches: int = 0
    #: Model seconds engines spent computing, summed over engines (a tp deployment counts once; a
    #: forwarded backend its requests' time over its max_concurrency), and what it cost.
    gpu_busy_s: float = 0.0
    cost_usd: float = 0.0
    queue_waits_s: collections.deque[float] = attrs.field(factory=_recent)
    ttfts_s: collections.deque[float] = attrs.field(factory=_recent)
    tpots_s: collections.deque[float] = attrs.field(factory=_recent)
    latencies_s: collections.deque[float] = attrs.field(factory=_recent)
    clock: ModelClock | None = None
    events: EventBus = attrs.field(factory=EventBus)
    #: Step 3 of :meth:`finish`: settle the tenant's bucket for a request that ended (the pipeline
    #: wires admission's :meth:`~apsd.core.admission.Admission.settle`; None: no buckets).
    settle: Callable[[InferenceRequest, Outcome, float], None] | None = None
    #: Step 4 of :meth:`finish`: tell the policies (the pipeline wires the scheduler's
    #: :meth:`~apsd.core.scheduler.Scheduler.policy_finished`; None: no policies).
    tell_policies: Callable[[InferenceRequest, Outcome, float], None] | None = None
    #: Part of step 2 of :meth:`finish`: what a request's charges cost its tenant in dollars (None: its
    #: model has no price; the pipeline wires :meth:`apsd.core.prices.Prices.spend_usd`; None: no prices).
    price: Callable[[InferenceRequest], float | None] | None = None
    #: Issued keys' counters, by key id (keys whose requests were admitted since start).
    keys: dict[str, KeyStats] = attrs.field(factory=dict, init=False)
    #: What follows every step, in order, unshielded (:class:`Bookkeeper`).
    bookkeepers: list[Bookkeeper] = attrs.field(factory=list, init=False)
    _idle: trio.Event = attrs.field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.tenants = {name: TenantStats() for name in self.tenant_names}
        self._idle.set()

    def keep_books_with(self, bookkeeper: Bookkeeper) -> None:
        """Call ``bookkeeper`` at every step from now on, after those added before it (once)."""
        if bookkeeper not in self.bookkeepers:
            self.bookkeepers.append(bookkeeper)

    def add_tenants(self, names: Iterable[str]) -> None:
        """Start counting for newly configured tenants (removed ones keep their counts)."""
        for name in names:
            self.tenants.setdefault(name, TenantStats())

    def _changing(self, tenant_id: str | None) -> TenantStats:
        """The counters of ``tenant_id`` (``unattributed`` if it is None or not configured), which
        the caller is about to move: every ledger method that moves a tenant's counters gets them
        here, and a configured tenant's move is logged in :attr:`changes`."""
        if tenant_id is None or (stats := self.tenants.get(tenant_id)) is None:
            return self.unattributed
        self.changes.touch(tenant_id)
        return stats

    def _now(self) -> float:
        return self.clock.now() if self.clock is not None else 0.0

    # -- a request's steps -------------------------------------------------------------
    def refuse_unadmitted(self, request: InferenceRequest, refusal: Refusal) -> None:
        """Answer a request that admission turned away (it was never in flight)."""
        if request.reply.resolve(refusal):
            if request.stream is not None:
                request.stream.close(refusal.message)
            self.count_refusal(request.tenant_id, refusal.error)
            now = self._now()
            for bookkeeper in self.bookkeepers:
                bookkeeper.rejected(request, refusal, now)
            self.events.emit("request_rejected", request=request, refusal=refusal, now=now)

    def count_refusal(self, tenant_id: str | None, error: str) -> None:
        """Count a refusal of a request that never entered the pipeline (e.g. a bad body)."""
        stats = self._changing(tenant_id)
        stats.rejected += 1
        stats.rejected_by_error[error] = stats.rejected_by_error.get(error, 0) + 1
        totals = self.totals
        totals.rejected += 1
        totals.rejected_by_error[error] = totals.rejected_by_error.get(error, 0) + 1

    def admit(self, request: InferenceRequest) -> None:
        if request in self.outstanding:
            raise ValueError(f"request {request.request_id} was admitted twice")
        stats = self._changing(request.tenant_id)
        stats.admitted += 1
        self.totals.admitted += 1
        if request.key_id is not None:
            key = self.keys.get(request.key_id)
            if key is None:
                key = self.keys[request.key_id] = KeyStats(request.tenant_id)
            key.admitted += 1
        self._to_queue(request, stats)
        if not self.outstanding:
            self._idle = trio.Event()
        self.outstanding[request] = None
        now = self._now()
        for bookkeeper in self.bookkeepers:
            bookkeeper.admitted(request, now)
        self.events.emit("request_admitted", request=request, now=now)

    def _to_queue(self, request: InferenceRequest, stats: TenantStats) -> None:
        stats.queued += 1
        self.queued_total += 1
        self.queued_tokens += request.cost_tokens

    def _from_queue(self, request: InferenceRequest, stats: TenantStats) -> None:
        stats.queued -= 1
        self.queued_total -= 1
        self.queued_tokens -= request.cost_tokens

    def dispatched(self, dispatch: Dispatch) -> None:
        """``dispatch``'s requests left the queue for their engine (the scheduler stamped them)."""
        for request in dispatch.requests:
            stats = self._changing(request.tenant_id)
            self._from_queue(request, stats)
            stats.running += 1
            self.running_total += 1
            assert request.dispatched_at is not None
            if request.started_at is None:   # (a resumed request's wait was counted the first time)
                self.queue_waits_s.append(request.dispatched_at - request.arrival)
        for bookkeeper in self.bookkeepers:
            for request in dispatch.requests:
                bookkeeper.dispatched(request, dispatch.formed_at)
        if self.events.wants("request_dispatched"):
            for request in dispatch.requests:
                self.events.emit("request_dispatched", request=request, dispatch=dispatch, batch=dispatch,
                                 engine_id=dispatch.engine_id, now=dispatch.formed_at)

    def started(self, request: InferenceRequest, at: float) -> None:
        """``request`` produced its first token at model time ``at`` (its engine calls this once)."""
        request.started_at = at
        self.ttfts_s.append(at - request.arrival)
        if self.events.wants("request_started"):
            self.events.emit("request_started", request=request, engine_id=request.engine_id, now=at)

    def requeued(self, request: InferenceRequest, reason: str, *, retry: bool = True,
                 keep_progress: bool = False) -> None:
        """``request`` goes back to waiting (the scheduler puts it back in the queue): its engine failed
        before its first token (``retry``: one of its retries is spent), or preempted it. Its progress is
        reset, but for a request paused after its first token (``keep_progress``), which resumes from
        what it produced."""
        if request.answered or request.dispatched_at is None:
            raise ValueError(f"request {request.request_id} is not running")
        stats = self._changing(request.tenant_id)
        stats.running -= 1
        self.running_total -= 1
        self._to_queue(request, stats)
        engine_id = request.engine_id
        request.dispatched_at = request.effective_priority = request.engine_id = None
        if not keep_progress:
            request.tokens_generated, request.cost_usd = 0, 0.0
        request.retries += retry
        now = self._now()
        for bookkeeper in self.bookkeepers:
            bookkeeper.requeued(request, now)
        self.events.emit("request_requeued", request=request, engine_id=engine_id, reason=reason, now=now)

    def batch_started(self, batch: Dispatch, engine_id: int) -> None:
        self.events.emit("batch_started", batch=batch, engine_id=engine_id, now=self._now())

    def batch_ran(self, batch: Dispatch, engine_id: int, busy_s: float, cost_usd: float) -> None:
        self.batches += 1
        self.engine_ran(busy_s, cost_usd)
        self.events.emit("batch_finished", batch=batch, engine_id=engine_id, now=self._now(),
                         busy_s=busy_s, cost_usd=cost_usd)

    def engine_ran(self, busy_s: float, cost_usd: float) -> None:
        """An engine computed for ``busy_s`` model seconds, costing ``cost_usd``."""
        self.gpu_busy_s += busy_s
        self.cost_usd += cost_usd

    def finish(self, request: InferenceRequest, outcome: Outcome, at: float | None = None) -> bool:
        """End an admitted request with its terminal outcome; False (and nothing done) if it
        already had one. ``at`` is the model time it ended (default: now); an engine that
        schedules in model time passes its own.

        This is where every admitted request ends, in this order:

        1. its reply is resolved: the client's answer (the guard against a second outcome);
        2. the books: the tenant's counters and the totals, latency samples, what it used;
        3. the tenant's bucket is settled (:attr:`settle`);
        4. the policies are told (:attr:`tell_policies`);
        5. its stream, if any, is closed;
        6. the bookkeepers follow it (:class:`Bookkeeper`: service classes, usage history);
        7. observers are notified (``request_finished`` on :attr:`events`: metrics, logs,
           plugins), each shielded from the others' failures.

        Nothing before step 7 is shielded: an exception in settlement propagates to the caller
        (an engine's task, then the pipeline), so a billing bug stops the daemon loudly rather
        than becoming a log line. (The scheduler handles its policies' exceptions itself.)
        """
        if not request.reply.resolve(outcome):
            return False
        now = self._now() if at is None else at
        self._book_end(request, outcome, now)
        if self.settle is not None:
            self.settle(request, outcome, now)
        if self.tell_policies is not None:
            self.tell_policies(request, outcome, now)
        if request.stream is not None:
            request.stream.close(None if isinstance(outcome, Completion) else outcome.message)
        for bookkeeper in self.bookkeepers:
            bookkeeper.finished(request, outcome, now)
        self.events.emit("request_finished", request=request, outcome=outcome, now=now)
        return True

    def _book_end(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        """Step 2 of :meth:`finish`: count the outcome and what the request used."""
        request.finished_at = now
        stats = self._changing(request.tenant_id)
        if request.dispatched_at is None:
            self._from_queue(request, stats)
        else:
            stats.running -= 1
            self.running_total -= 1
        totals = self.totals
        key = self.keys.get(request.key_id) if request.key_id is not None else None
        match outcome:
            case Completion():
                stats.completed += 1
                totals.completed += 1
                if key is not None:
                    key.completed += 1
                self.latencies_s.append(now - request.arrival)
                if outcome.tpot_ms is not None:
                    self.tpots_s.append(outcome.tpot_ms / 1000.0)
            case Refusal(kind="failed"):
                stats.failed += 1
                totals.failed += 1
                if key is not None:
                    key.failed += 1
            case _:
                stats.cancelled += 1
                totals.cancelled += 1
                if key is not None:
                    key.cancelled += 1
        if billed_tokens(request, outcome):
            prompt = request.prompt_tokens if request.prompt_used else 0
            spend = self.price(request) if self.price is not None else 0.0
            request.spend_usd, request.unpriced = spend or 0.0, spend is None
            stats.prompt_tokens += prompt
            stats.generated_tokens += request.tokens_generated
            stats.cost_usd += request.cost_usd
            stats.spend_usd += request.spend_usd
            stats.unpriced += request.unpriced
            totals.prompt_tokens += prompt
            totals.generated_tokens += request.tokens_generated
            totals.cost_usd += request.cost_usd
            totals.spend_usd += request.spend_usd
            totals.unpriced += request.unpriced
            if key is not None:
                key.prompt_tokens += prompt
                key.generated_tokens += request.tokens_generated
                key.spend_usd += request.spend_usd
        del self.outstanding[request]
        if not self.outstanding:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no admitted request is queued or running."""
        while self.outstanding:
            await self._idle.wait()

    # -- figures ----------------------------------------------------------------------
    def fairness(self, rates: Mapping[str, float]) -> float | None:
        """Jain's index over rate-normalised output tokens of tenants with admitted work."""
        return jain_index(
            s.generated_tokens / rates[name]
            for name, s in self.tenants.items()
            if s.admitted and name in rates
        )

    def statistics(self, elapsed_s: float, units: int, rates: Mapping[str, float]) -> LedgerStatistics:
        """The figures behind ``GET /metrics`` (model time), as of now; busy time is measured against
        ``units`` engines (or backends). Reads the running totals; only the fairness index visits
        the tenants."""
        total = self.totals
        rejected_by_error = dict(total.rejected_by_error)
        in_flight = self.queued_total + self.running_total
        generated = total.generated_tokens
        return LedgerStatistics(
            requests=RequestCounts(
                admitted=total.admitted, rejected=total.rejected, rejected_by_error=rejected_by_error,
                completed=total.completed, failed=total.failed, cancelled=total.cancelled,
                queued=self.queued_total, running=self.running_total, in_flight=in_flight,
                conservation_ok=total.admitted == total.completed + total.failed + total.cancelled + in_flight),
            tokens=TokenCounts(prompt=total.prompt_tokens, generated=generated, queued=self.queued_tokens),
            batches=self.batches,
            elapsed_s=elapsed_s,
            throughput_tokens_per_s=generated / elapsed_s if elapsed_s > 0 else 0.0,
            gpu_utilization=self.gpu_busy_s / (units * elapsed_s) if elapsed_s > 0 else 0.0,
            cost_usd=self.cost_usd,
            cost_per_1m_tokens_usd=self.cost_usd / generated * 1e6 if generated else None,
            queue_wait_ms=_percentiles(self.queue_waits_s),
            ttft_ms=_percentiles(self.ttfts_s),
            tpot_ms=_percentiles(self.tpots_s),
            latency_ms=_percentiles(self.latencies_s),
            fairness=Fairness(self.fairness(rates)),
        )
