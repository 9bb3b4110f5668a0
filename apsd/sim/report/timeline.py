"""Quantities accumulated over a run's model time: busy time and anything spread over intervals.

:func:`spread_cumulative` is how much of amounts spread evenly over intervals has accumulated by
given times; :func:`busy_cumulative` uses it for the engines' busy time (behind ``gpu_busy.png``),
and :mod:`apsd.sim.report.service` for the service tenants received.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from apsd.sim.records import PolicyRun

__all__ = ["Floats", "busy_cumulative", "busy_spans", "spread_cumulative", "union"]

#: An array of floats (float64 in practice; numpy's stubs type its arithmetic as any floating type).
Floats = NDArray[np.floating[Any]]


def union(intervals: Iterable[tuple[float, float]]) -> tuple[Floats, Floats]:
    """The union of closed intervals ``(start, end)`` as disjoint spans (starts, ends), sorted;
    intervals that touch merge."""
    spans: list[list[float]] = []
    for s, e in sorted(intervals):
        if spans and s <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], e)
        else:
            spans.append([s, e])
    return np.asarray([s for s, _ in spans], dtype=float), np.asarray([e for _, e in spans], dtype=float)


def spread_cumulative(start: Any, end: Any, amount: Any, edges: Floats) -> Floats:
    """How much of ``amount`` has accumulated by each time in ``edges``, each amount spread evenly
    over its ``[start, end]`` (all of it at ``start`` when the span is empty)."""
    start, end, amount = (np.asarray(x, dtype=float) for x in (start, end, amount))
    if not start.size:
        return np.zeros_like(edges)
    span = end - start
    spread = span > 0
    total = np.zeros_like(edges)
    # Empty spans: a step at their start.
    order = np.argsort(start[~spread], kind="stable")
    s0, b0 = start[~spread][order], np.cumsum(amount[~spread][order])
    k = np.searchsorted(s0, edges, side="right")
    total += np.where(k > 0, b0[np.maximum(k - 1, 0)] if b0.size else 0.0, 0.0)
    # Spans with a duration: slope amount/span between start and end, i.e.
    # sum_{start<e} slope*(e-start) - sum_{end<e} slope*(e-end).
    slope = amount[spread] / span[spread]
    for points, sign in ((start[spread], 1.0), (end[spread], -1.0)):
        order = np.argsort(points, kind="stable")
        p, w = points[order], slope[order]
        cw, cwp = np.concatenate(([0.0], np.cumsum(w))), np.concatenate(([0.0], np.cumsum(w * p)))
        k = np.searchsorted(p, edges, side="right")
        total += sign * (edges * cw[k] - cwp[k])
    return total


def busy_spans(run: PolicyRun) -> tuple[Floats, Floats, Floats]:
    """(start, end, busy seconds) of each stretch an engine computed.

    An engine that runs fixed batches (``batch``): its batches (busy time spread evenly over each).
    An engine without batch records (``continuous``): it steps whenever a sequence is in it, so its
    busy stretches are the union of the intervals from each request's dispatch to its end, per engine.
    """
    if run.batches:
        return (np.asarray([b.started_at for b in run.batches], dtype=float),
                np.asarray([b.finished_at for b in run.batches], dtype=float),
                np.asarray([b.busy_s for b in run.batches], dtype=float))
    by_engine: dict[int | None, list[tuple[float, float]]] = {}
    for r in run.requests:
        if r.dispatched_at is not None and r.finished_at is not None:
            by_engine.setdefault(r.engine_id, []).append((r.dispatched_at, r.finished_at))
    spans = [union(intervals) for intervals in by_engine.values()]  # each engine's own: busy time adds up
    start = np.concatenate([s for s, _ in spans]) if spans else np.zeros(0)
    end = np.concatenate([e for _, e in spans]) if spans else np.zeros(0)
    return start, end, end - start


def busy_cumulative(run: PolicyRun, edges: Floats) -> Floats:
    """Engine busy seconds accumulated by each time in ``edges`` (see :func:`busy_spans`)."""
    return spread_cumulative(*busy_spans(run), edges)
