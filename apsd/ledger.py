"""The books: every request's outcome, counted once, and the figures derived from them.

Ownership: the ledger is the only code that resolves a request's reply slot
(:meth:`Ledger.finish`, :meth:`Ledger.refuse_unadmitted`), so counting and
answering cannot drift apart. For the same reason it is where the observation
hooks are emitted (:class:`~apsd.events.EventBus`) and where the policies hear
that a request finished (``on_finish``). It keeps, per tenant and overall::

    admitted == completed + failed + cancelled + queued + running

at every moment (``conservation_ok`` in :meth:`Ledger.snapshot`).

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

from .clock import ModelClock
from .events import EventBus
from .models import Batch, Completion, InferenceRequest, Outcome, Refusal

__all__ = ["Ledger", "TenantStats", "jain_index"]


def jain_index(values: Iterable[float]) -> float | None:
    """Jain's fairness index of ``values`` (None when there is nothing to compare)."""
    x = np.asarray(list(values), dtype=float)
    if x.size == 0 or not np.any(x):
        return None
    return float(x.sum() ** 2 / (x.size * np.square(x).sum()))


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
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cost_usd: float = 0.0
    rejected_by_error: collections.Counter[str] = attrs.field(factory=collections.Counter)

    @property
    def in_flight(self) -> int:
        return self.queued + self.running


_WAIT_SAMPLES = 10_000  # recent queue waits kept for percentiles


@attrs.define(eq=False, on_setattr=attrs.setters.NO_OP)  # (counters are set per request: no hooks)
class Ledger:
    """Counts, outstanding requests, GPU busy time and cost."""

    tenant_names: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    tenants: dict[str, TenantStats] = attrs.field(init=False)
    #: Refusals that name no configured tenant (unknown tenant, malformed body): counted, but
    #: never as a new entry per name, so a client cannot grow this dict.
    unattributed: TenantStats = attrs.field(factory=TenantStats, init=False)
    #: Admitted requests without an outcome yet, by identity, in admission order.
    outstanding: dict[InferenceRequest, None] = attrs.field(factory=dict)
    #: Tokens (prompt + requested) of the queued requests: what ``[queue] max_tokens`` bounds.
    queued_tokens: int = 0
    batches: int = 0
    gpu_busy_s: float = 0.0
    cost_usd: float = 0.0
    queue_waits_s: collections.deque[float] = attrs.field(factory=lambda: collections.deque(maxlen=_WAIT_SAMPLES))
    clock: ModelClock | None = None
    events: EventBus = attrs.field(factory=EventBus)
    #: Called with (request, outcome, now) after every admitted request's outcome is delivered.
    on_finish: Callable[[InferenceRequest, Outcome, float], None] | None = None
    #: Called with an admitted request that ended without being served (failed or cancelled):
    #: its tokens go back to its tenant's bucket.
    on_refund: Callable[[InferenceRequest], None] | None = None
    _idle: trio.Event = attrs.field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.tenants = {name: TenantStats() for name in self.tenant_names}
        self._idle.set()

    def add_tenants(self, names: Iterable[str]) -> None:
        """Start counting for newly configured tenants (removed ones keep their counts)."""
        for name in names:
            self.tenants.setdefault(name, TenantStats())

    def _stats(self, tenant_id: str) -> TenantStats:
        return self.tenants.get(tenant_id, self.unattributed)

    def _now(self) -> float:
        return self.clock.now() if self.clock is not None else 0.0

    # -- events -----------------------------------------------------------------------
    def refuse_unadmitted(self, request: InferenceRequest, refusal: Refusal) -> None:
        """Answer a request that admission turned away (it was never in flight)."""
        if request.reply.resolve(refusal):
            self.count_refusal(request.tenant_id, refusal.error)
            self.events.emit("request_rejected", request=request, refusal=refusal, now=self._now())

    def count_refusal(self, tenant_id: str | None, error: str) -> None:
        """Count a refusal of a request that never entered the pipeline (e.g. a bad body)."""
        stats = self._stats(tenant_id) if tenant_id is not None else self.unattributed
        stats.rejected += 1
        stats.rejected_by_error[error] += 1

    def admit(self, request: InferenceRequest) -> None:
        if request in self.outstanding:
            raise ValueError(f"request {request.request_id} was admitted twice")
        stats = self._stats(request.tenant_id)
        stats.admitted += 1
        stats.queued += 1
        self.queued_tokens += request.cost_tokens
        if not self.outstanding:
            self._idle = trio.Event()
        self.outstanding[request] = None
        self.events.emit("request_admitted", request=request, now=self._now())

    def dispatched(self, batch: Batch) -> None:
        for request in batch.requests:
            stats = self._stats(request.tenant_id)
            stats.queued -= 1
            stats.running += 1
            self.queued_tokens -= request.cost_tokens
            assert request.dispatched_at is not None
            self.queue_waits_s.append(request.dispatched_at - request.arrival)
        if self.events.wants("request_dispatched"):
            for request in batch.requests:
                self.events.emit("request_dispatched", request=request, batch=batch, now=batch.formed_at)

    def batch_started(self, batch: Batch, executor_id: int) -> None:
        self.events.emit("batch_started", batch=batch, executor_id=executor_id, now=self._now())

    def batch_ran(self, batch: Batch, executor_id: int, busy_s: float, cost_usd: float) -> None:
        self.batches += 1
        self.gpu_busy_s += busy_s
        self.cost_usd += cost_usd
        self.events.emit("batch_finished", batch=batch, executor_id=executor_id, now=self._now(),
                         busy_s=busy_s, cost_usd=cost_usd)

    def finish(self, request: InferenceRequest, outcome: Outcome) -> bool:
        """Deliver an admitted request's terminal outcome; False if it already had one."""
        if not request.reply.resolve(outcome):
            return False
        stats = self._stats(request.tenant_id)
        if request.dispatched_at is None:
            stats.queued -= 1
            self.queued_tokens -= request.cost_tokens
        else:
            stats.running -= 1
        if isinstance(outcome, Completion):
            stats.completed += 1
            stats.prompt_tokens += outcome.prompt_tokens
            stats.generated_tokens += outcome.tokens_generated
            stats.cost_usd += outcome.cost_usd
        elif outcome.kind == "failed":
            stats.failed += 1
        else:
            stats.cancelled += 1
        if isinstance(outcome, Refusal) and self.on_refund is not None:
            self.on_refund(request)
        del self.outstanding[request]
        if not self.outstanding:
            self._idle.set()
        now = self._now()
        self.events.emit("request_finished", request=request, outcome=outcome, now=now)
        if self.on_finish is not None:
            self.on_finish(request, outcome, now)
        return True

    async def wait_idle(self) -> None:
        """Return once no admitted request is queued or running."""
        while self.outstanding:
            await self._idle.wait()

    # -- figures ----------------------------------------------------------------------
    @property
    def queued_total(self) -> int:
        return sum(s.queued for s in self.tenants.values())

    def fairness(self, rates: Mapping[str, float]) -> float | None:
        """Jain's index over rate-normalised output tokens of tenants with admitted work."""
        return jain_index(
            s.generated_tokens / rates[name]
            for name, s in self.tenants.items()
            if s.admitted and name in rates
        )

    def snapshot(self, elapsed_s: float, gpus: int, rates: Mapping[str, float]) -> dict:
        """The JSON-ready figures behind ``GET /metrics`` (model time)."""
        totals = TenantStats()
        for s in (*self.tenants.values(), self.unattributed):
            for name in ("admitted", "rejected", "completed", "failed", "cancelled", "queued",
                         "running", "prompt_tokens", "generated_tokens"):
                setattr(totals, name, getattr(totals, name) + getattr(s, name))
        generated = totals.generated_tokens
        waits = np.asarray(self.queue_waits_s, dtype=float)
        percentiles = (
            dict(zip(("p50", "p95", "p99"), (float(v) * 1000 for v in np.percentile(waits, [50, 95, 99]))))
            if waits.size else {"p50": None, "p95": None, "p99": None}
        )
        return {
            "requests": {
                "admitted": totals.admitted,
                "rejected": totals.rejected,
                "rejected_by_error": dict(sum((s.rejected_by_error for s in (*self.tenants.values(),
                                                                             self.unattributed)),
                                              collections.Counter())),
                "completed": totals.completed,
                "failed": totals.failed,
                "cancelled": totals.cancelled,
                "queued": totals.queued,
                "running": totals.running,
                "in_flight": totals.in_flight,
                "conservation_ok": totals.admitted
                == totals.completed + totals.failed + totals.cancelled + totals.in_flight,
            },
            "tokens": {"prompt": totals.prompt_tokens, "generated": generated, "queued": self.queued_tokens},
            "batches": self.batches,
            "elapsed_s": elapsed_s,
            "throughput_tokens_per_s": generated / elapsed_s if elapsed_s > 0 else 0.0,
            "gpu_utilization": self.gpu_busy_s / (gpus * elapsed_s) if elapsed_s > 0 else 0.0,
            "cost_usd": self.cost_usd,
            "cost_per_1m_tokens_usd": self.cost_usd / generated * 1e6 if generated else None,
            "queue_wait_ms": percentiles,
            "fairness": {
                "jain_index": self.fairness(rates),
                "definition": "Jain's index (sum x)^2/(n*sum x^2); x_i = output tokens served to tenant i "
                "divided by its configured rate, over tenants with at least one admitted request",
            },
        }
