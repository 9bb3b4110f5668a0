"""One run's figures: :func:`summarize` turns a :class:`~apsd.sim.records.PolicyRun` into a
:class:`~apsd.sim.report.summary.RunSummary`, measured from its records in model time (never
wall-clock time: :attr:`PolicyRun.wall_s` is left out on purpose).

Engines: busy time and cost are the engines' own (:attr:`PolicyRun.busy_s`,
:attr:`PolicyRun.cost_usd`), so they hold for every engine kind; batch sizes exist only for an
engine that runs fixed batches (``batch``). Time to first token (TTFT) is arrival to first token;
time per output token (TPOT) is the engine's mean gap between output tokens after the first, for
requests of two or more tokens.

Fairness is the daemon's own (:mod:`apsd.core.ledger`: :func:`~apsd.core.ledger.jain_index` of
:data:`~apsd.core.ledger.FAIRNESS_DEFINITION`).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from typing import TypedDict

import numpy as np

from apsd.core.ledger import jain_index
from apsd.sim.records import PolicyRun, RequestRecord
from apsd.sim.report.classes import class_attainment
from apsd.sim.report.runs import by_tenant, completed, engine_count, latencies, queue_waits, tenant_names, tpots, ttfts
from apsd.sim.report.service import summarize_service_difference
from apsd.sim.report.summary import (
    BatchSizes,
    ClassSummary,
    EngineSummary,
    Fairness,
    GovernorSummary,
    LowestBidder,
    Overall,
    Percentiles,
    RunSummary,
    TenantIsolation,
    TenantSummary,
    TimeInState,
    WorkloadSummary,
)

__all__ = ["isolation", "routing_reasons", "summarize"]


class _OutcomeFields(TypedDict):
    """The fields of :class:`~apsd.sim.report.summary.Outcomes`."""

    sent: int
    completed: int
    rejected: int
    failed: int
    cancelled: int
    rejected_by_error: dict[str, int]


def _outcomes(requests: Iterable[RequestRecord]) -> _OutcomeFields:
    """The fields of :class:`~apsd.sim.report.summary.Outcomes`."""
    outcomes: collections.Counter[str] = collections.Counter()
    rejected_by_error: collections.Counter[str] = collections.Counter()
    sent = 0
    for r in requests:
        sent += 1
        outcomes[r.outcome] += 1
        if r.outcome == "rejected":
            rejected_by_error[r.error or "unknown"] += 1
    return {"sent": sent, "completed": outcomes["completed"], "rejected": outcomes["rejected"],
            "failed": outcomes["failed"], "cancelled": outcomes["cancelled"],
            "rejected_by_error": dict(sorted(rejected_by_error.items()))}


def _lowest_bidder(run: PolicyRun) -> LowestBidder:
    bids = [a.bid for a in run.workload.arrivals] or [r.bid for r in run.requests]
    if not bids:
        return LowestBidder(bid=None, tenants=(), requests=0, completed=0, max_queue_wait_ms=None,
                            p99_queue_wait_ms=None)
    low = min(bids)
    mine = [r for r in run.requests if r.bid == low]
    waits = queue_waits(completed(mine))
    stats = Percentiles.of_seconds(waits)
    return LowestBidder(bid=low, tenants=tuple(sorted({r.tenant for r in mine})), requests=len(mine),
                        completed=len(waits), max_queue_wait_ms=stats.max, p99_queue_wait_ms=stats.p99)


def _governor(run: PolicyRun) -> GovernorSummary:
    n = len(run.samples)
    by_state = collections.Counter(s.state for s in run.samples)
    windows = [s.window_s for s in run.samples]
    entropies = [s.entropy_bits for s in run.samples if s.entropy_bits is not None]
    return GovernorSummary(
        samples=n,
        sample_interval_s=run.sample_interval_s,
        time_in_state={state: TimeInState(seconds=count * run.sample_interval_s, fraction=count / n)
                       for state, count in sorted(by_state.items())},
        mean_window_ms=float(np.mean(windows)) * 1000.0 if windows else None,
        mean_entropy_bits=float(np.mean(entropies)) if entropies else None,
    )


def _weighted_mean(values: Sequence[tuple[float, float]]) -> float | None:
    """Mean of ``(value, weight)`` pairs weighted by weight; the plain mean when every weight is 0."""
    if not values:
        return None
    total = sum(w for _, w in values)
    if total > 0:
        return sum(v * w for v, w in values) / total
    return sum(v for v, _ in values) / len(values)


def _engine(run: PolicyRun) -> EngineSummary:
    """The run's ``[engine]``, and its engines' totals: preemptions, and MFU/MBU over their busy
    time (each engine's figure weighted by its busy seconds; None for engines without a hardware
    model, such as ``batch``)."""
    return EngineSummary.of(
        run.engine,
        preemptions=sum(e.preemptions for e in run.engines),
        mfu=_weighted_mean([(e.mfu, e.busy_s) for e in run.engines if e.mfu is not None]),
        mbu=_weighted_mean([(e.mbu, e.busy_s) for e in run.engines if e.mbu is not None]),
    )


def _batch_sizes(run: PolicyRun) -> BatchSizes:
    sizes = collections.Counter(b.size for b in run.batches)
    total = sum(sizes.values())
    return BatchSizes(count=total, distribution={str(size): count for size, count in sorted(sizes.items())},
                      mean=sum(size * count for size, count in sizes.items()) / total if total else None)


class _TimeFields(TypedDict):
    """The times of :class:`~apsd.sim.report.summary.TenantSummary` and :class:`~apsd.sim.report.summary.Overall`."""

    queue_wait_ms: Percentiles
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    latency_ms: Percentiles


def _times(requests: Sequence[RequestRecord]) -> _TimeFields:
    """Queue wait, TTFT, TPOT and latency of ``requests`` (the completed ones, by the caller)."""
    return {"queue_wait_ms": Percentiles.of_seconds(queue_waits(requests)),
            "ttft_ms": Percentiles.of_seconds(ttfts(requests)),
            "tpot_ms": Percentiles.of_seconds(tpots(requests)),
            "latency_ms": Percentiles.of_seconds(latencies(requests))}


def _p99_ttft_ms(requests: Sequence[RequestRecord]) -> float | None:
    ttfts = [r.ttft for r in completed(requests) if r.ttft is not None]
    return Percentiles.of_seconds(ttfts).p99


def _tokens_per_s(requests: Sequence[RequestRecord]) -> float | None:
    """Output tokens of the completed requests over their span: from the first arrival to the last finish."""
    done = completed(requests)
    if not done:
        return None
    span = max(r.finished_at or r.arrival for r in done) - min(r.arrival for r in requests)
    return sum(r.output_tokens for r in done) / span if span > 0 else None


def isolation(run: PolicyRun, alone: Mapping[str, PolicyRun]) -> tuple[TenantIsolation, ...]:
    """Each tenant of ``run`` against its run alone (``alone``: tenant -> that run)."""
    grouped = by_tenant(run)
    rows = []
    for tenant, solo in sorted(alone.items()):
        mine = grouped.get(tenant, [])
        ttft, ttft_alone = _p99_ttft_ms(mine), _p99_ttft_ms(solo.requests)
        rows.append(TenantIsolation(
            tenant=tenant, ttft_p99_alone_ms=ttft_alone, ttft_p99_ms=ttft,
            ratio=ttft / ttft_alone if ttft is not None and ttft_alone else None,
            tokens_per_s_alone=_tokens_per_s(solo.requests),
            tokens_per_s=_tokens_per_s(mine)))
    return tuple(rows)


def summarize(run: PolicyRun, alone: Mapping[str, PolicyRun] | None = None) -> RunSummary:
    """The run's figures, typed and deterministic (see :mod:`apsd.sim.report.summary`).

    Queue waits, TTFT, TPOT and latencies cover completed requests only; rejected,
    failed and cancelled requests are counted but never enter a percentile.

    GPU busy time and cost are the engines' (``gpu_busy_s`` counts an engine of ``tp``
    GPUs once); ``gpu_utilization`` is that busy time over (engines × duration).
    ``engine`` is the run's ``[engine]`` with its engines' preemptions and MFU/MBU.
    ``alone`` (tenant -> its run alone, :func:`apsd.sim.alone.alone_runs`) fills ``isolation``.
    """
    grouped = by_tenant(run)
    tenants: dict[str, TenantSummary] = {}
    fairness_x: list[float] = []
    for name in tenant_names(run):
        reqs = grouped.get(name, [])
        done = completed(reqs)
        tokens = sum(r.output_tokens for r in done)
        rate = run.tenant_rates.get(name)
        admitted = sum(1 for r in reqs if r.outcome != "rejected")
        if admitted and rate:
            fairness_x.append(tokens / rate)
        tenants[name] = TenantSummary(
            **_outcomes(reqs), admitted=admitted, rate=rate, bids=tuple(sorted({r.bid for r in reqs})),
            output_tokens=tokens, service_per_rate=tokens / rate if rate else None,
            cost_usd=sum(r.cost_usd for r in done), **_times(done))

    done = completed(run.requests)
    tokens = sum(r.output_tokens for r in done)
    duration = run.duration_s
    busy = run.busy_s
    cost = run.cost_usd
    engines = engine_count(run)
    overall = Overall(
        **_outcomes(run.requests),
        output_tokens=tokens,
        throughput_tokens_per_s=tokens / duration if duration > 0 else None,
        batches=len(run.batches),
        gpu_busy_s=busy,
        gpu_utilization=busy / (engines * duration) if duration > 0 and engines else None,
        cost_usd=cost,
        cost_per_1m_tokens_usd=cost / tokens * 1e6 if tokens else None,
        cached_prompt_share=_cached_share(done),
        fairness=Fairness(jain_index=jain_index(fairness_x), tenants_counted=len(fairness_x)),
        lowest_bidder=_lowest_bidder(run),
        **_times(done),
        governor=_governor(run),
        batch_sizes=_batch_sizes(run),
        service_difference=summarize_service_difference(run),
    )
    wl = run.workload
    return RunSummary(
        label=run.label,
        policy=dict(sorted(run.policy.items())),
        workload=WorkloadSummary(name=wl.name, description=wl.description, params=wl.params, seed=wl.seed,
                                 arrivals=len(wl.arrivals), tenants=len(wl.tenants)),
        gpus=run.gpus,
        engine=_engine(run),
        duration_s=duration,
        tenants=tenants,
        overall=overall,
        isolation=isolation(run, alone) if alone else (),
        routing=routing_reasons(run.requests),
        classes=tuple(ClassSummary(name=c.name, ttft_s=c.ttft_s, tpot_s=run.classes[c.name].tpot_s,
                                   on_miss=c.on_miss, requests=c.requests, met=c.met, missed=c.missed,
                                   refused=c.refused, attainment=c.attainment)
                      for c in class_attainment(run, run.classes)),
    )


def _cached_share(done: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens over prompt tokens of ``done`` (None: nothing completed)."""
    prompt = sum(r.prompt_tokens for r in done)
    return sum(r.cached_tokens for r in done) / prompt if prompt else None


def routing_reasons(requests: Iterable[RequestRecord]) -> dict[str, dict[str, int]]:
    """Engine (or backend) -> routing reason -> requests, from each record's ``route``
    (``engine-2; reason=cache_match``); both levels sorted."""
    counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in requests:
        if r.route:
            where, _, reason = r.route.partition("; reason=")
            counts[where][reason or "?"] += 1
    return {where: dict(sorted(c.items())) for where, c in sorted(counts.items())}
