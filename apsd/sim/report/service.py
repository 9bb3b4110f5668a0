"""The service difference between backlogged tenants: VTC's fairness measure (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI '24), :func:`service_difference_over_time`.

* A completed request gives its tenant ``service = input_weight * prompt_tokens + output_weight *
  output_tokens`` (:data:`SERVICE_WEIGHTS`: the fair-share policy's charge, VTC's defaults 1 and 2),
  received evenly from its first token to its end (VTC's attribution); divided by the tenant's
  ``weight``. Requests that did not complete give nothing.
* A tenant is *backlogged* while it has a request waiting in the queue: admitted, from its
  arrival to its (last) dispatch, as VTC counts a client backlogged while it has queued requests.
  A tenant whose requests all run at once is not: it asks for no more than it gets.
* Windows are :data:`SERVICE_WINDOW_S` long, one starting every :data:`SERVICE_STEP_S` from
  t = 0, each ending by the run's end (``duration_s``). A window's *service difference* is the
  service the most served tenant received within it minus what the least served received,
  among the tenants backlogged throughout it; none when fewer than two were.
* A summary's ``overall.service_difference`` (:func:`summarize_service_difference`) has its maximum
  over the whole run (``max``) and over the windows that end by half the run's duration
  (``first_half_max``), and how many windows had a difference: a fair scheduler bounds the
  difference whatever the run's length (VTC's Theorem), so the whole run's maximum should not
  exceed the first half's by much. ``mean`` is its mean over the windows that have one (VTC
  reports both): the maximum is often the start of a backlog, when the service still comes from
  requests dispatched before it began.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from apsd.policies.fair import ChargeWeights
from apsd.sim.records import PolicyRun, RequestRecord
from apsd.sim.report.runs import by_tenant, completed, tenant_weight
from apsd.sim.report.summary import ServiceDifference
from apsd.sim.report.timeline import Floats, spread_cumulative, union

__all__ = ["SERVICE_DIFFERENCE_DEFINITION", "SERVICE_STEP_S", "SERVICE_WEIGHTS", "SERVICE_WINDOW_S",
           "backlogged_service_shares", "service_difference_over_time", "summarize_service_difference",
           "weighted_service_jain"]

#: Service per prompt and output token: what the fair-share policy charges by default (VTC's weights).
SERVICE_WEIGHTS = ChargeWeights()
#: The service difference is measured in windows this long, one starting every :data:`SERVICE_STEP_S`.
SERVICE_WINDOW_S = 10.0
SERVICE_STEP_S = 1.0

#: The service difference in one sentence, for reports (the module docstring has the whole definition).
SERVICE_DIFFERENCE_DEFINITION = (
    f"service = {SERVICE_WEIGHTS.input_weight:g} × prompt tokens + {SERVICE_WEIGHTS.output_weight:g} × output "
    "tokens of each completed request (VTC's weights) over its tenant's weight, received evenly from its first "
    "token to its end; a tenant is backlogged while it has a request waiting in the queue (arrived, not yet "
    f"dispatched); in each window of {SERVICE_WINDOW_S:g} s (one starting every {SERVICE_STEP_S:g} s), the "
    "service difference is the service received within the window by the most served minus the least served "
    "of the tenants backlogged throughout it (none with fewer than two)"
)


def _backlogged_throughout(requests: Sequence[RequestRecord], starts: Floats,
                           ends: Floats, until: str = "dispatch") -> NDArray[np.bool_] | None:
    """Per window ``[starts[k], ends[k]]``: whether some request of ``requests`` waited at every instant of
    it: in the queue, from its arrival to its (last) dispatch (``until="dispatch"``), or anywhere, from its
    arrival to its first token (``until="first_token"``: in an engine that holds many sequences, most of
    the waiting is inside it); never dispatched (or started): never. None when no request waited for a
    whole window."""
    if until == "dispatch":
        spans = ((r.arrival, r.dispatched_at) for r in requests if r.outcome != "rejected" and r.dispatched_at is not None)
    else:
        spans = ((r.arrival, r.started_at) for r in requests if r.started_at is not None)
    span_start, span_end = union(spans)
    if not span_start.size or (span_end - span_start).max() < SERVICE_WINDOW_S:
        return None
    i = np.searchsorted(span_start, starts, side="right") - 1
    return (i >= 0) & (span_end[np.maximum(i, 0)] >= ends)


def _service_cumulative(requests: Sequence[RequestRecord], edges: Floats) -> Floats:
    """Service received by each time in ``edges``: each completed request's service spread evenly
    from its first token to its end (at its end when it has no first token)."""
    done = [r for r in completed(requests) if r.finished_at is not None]
    w = SERVICE_WEIGHTS
    return spread_cumulative([r.finished_at if r.started_at is None else r.started_at for r in done],
                             [r.finished_at for r in done],
                             [w.input_weight * r.prompt_tokens + w.output_weight * r.output_tokens for r in done],
                             edges)


def _windows(run: PolicyRun,
             until: str = "dispatch") -> tuple[Floats, list[str], list[NDArray[np.bool_]], list[Floats]]:
    """Every window's start, and per tenant that was ever backlogged throughout one: its name, whether it
    was in each window, and the weighted service it received within each."""
    steps = round(SERVICE_WINDOW_S / SERVICE_STEP_S)
    count = max(math.floor((run.duration_s - SERVICE_WINDOW_S) / SERVICE_STEP_S + 1e-9) + 1, 0)
    edges = np.arange(count + steps) * SERVICE_STEP_S
    starts, ends = edges[:count], edges[steps:]
    names, throughouts, services = [], [], []
    for tenant, requests in by_tenant(run).items():
        throughout = _backlogged_throughout(requests, starts, ends, until)
        if throughout is None:
            continue
        served = _service_cumulative(requests, edges) / tenant_weight(run, tenant)
        names.append(tenant)
        throughouts.append(throughout)
        services.append(served[steps:] - served[:count])
    return starts, names, throughouts, services


def weighted_service_jain(run: PolicyRun, until: str = "dispatch") -> float | None:
    """Jain's index of the weighted service of the tenants backlogged throughout each window (the
    windows of the service difference), averaged over the windows with two or more: 1 when every
    backlogged tenant received service in proportion to its weight. None: no such window. ``until``: as
    :func:`service_difference_over_time`'s."""
    starts, _, throughouts, services = _windows(run, until)
    if len(throughouts) < 2 or not len(starts):
        return None
    mask = np.array(throughouts)
    x = np.where(mask, np.array(services), 0.0)
    n = mask.sum(axis=0)
    total, squares = x.sum(axis=0), np.square(x).sum(axis=0)
    measured = (n >= 2) & (squares > 0)
    if not measured.any():
        return None
    return float(np.mean(total[measured] ** 2 / (n[measured] * squares[measured])))


def backlogged_service_shares(run: PolicyRun, until: str = "dispatch") -> dict[str, float]:
    """Each tenant's share of the service (unweighted) received in the windows in which every tenant
    that was ever backlogged throughout a window was backlogged throughout (empty: no such window, or
    fewer than two such tenants): what each got while all competed. ``until``: as
    :func:`service_difference_over_time`'s."""
    _, names, throughouts, services = _windows(run, until)
    if len(throughouts) < 2:
        return {}
    all_in = np.logical_and.reduce(np.array(throughouts))
    if not all_in.any():
        return {}
    served = {name: float(service[all_in].sum()) * tenant_weight(run, name) for name, service in zip(names, services)}
    total = sum(served.values())
    return {name: value / total for name, value in sorted(served.items())} if total > 0 else {}


def service_difference_over_time(run: PolicyRun, until: str = "dispatch") -> tuple[Floats, Floats]:
    """The start of every window of :data:`SERVICE_WINDOW_S` (one every :data:`SERVICE_STEP_S` from 0,
    ending by the run's end), and its service difference: NaN where fewer than two tenants were
    backlogged throughout it. See the module docstring for the definition; ``until="first_token"`` counts
    a tenant backlogged while a request of its waits for its first token, in the queue or in an engine."""
    starts, _, throughouts, services = _windows(run, until)
    count = len(starts)
    high, low = np.full(count, -np.inf), np.full(count, np.inf)
    backlogged = np.zeros(count, dtype=int)
    for throughout, in_window in zip(throughouts, services):
        high = np.where(throughout, np.maximum(high, in_window), high)
        low = np.where(throughout, np.minimum(low, in_window), low)
        backlogged += throughout
    return starts, np.where(backlogged >= 2, high - low, np.nan)


def summarize_service_difference(run: PolicyRun, until: str = "dispatch") -> ServiceDifference:
    """The largest service difference over the whole run and over its first half (windows that end
    by half its duration), its mean over the run's windows, and how many windows had one."""
    starts, difference = service_difference_over_time(run, until)
    measured = ~np.isnan(difference)
    first_half = measured & (starts + SERVICE_WINDOW_S <= run.duration_s / 2)

    def largest(which: NDArray[np.bool_]) -> tuple[float | None, float | None]:
        if not which.any():
            return None, None
        k = int(np.flatnonzero(which)[np.argmax(difference[which])])
        return float(difference[k]), float(starts[k])

    whole_max, whole_at = largest(measured)
    half_max, half_at = largest(first_half)
    return ServiceDifference(
        window_s=SERVICE_WINDOW_S, step_s=SERVICE_STEP_S,
        input_weight=SERVICE_WEIGHTS.input_weight, output_weight=SERVICE_WEIGHTS.output_weight,
        windows=int(measured.sum()), max=whole_max, max_window_start_s=whole_at,
        mean=float(difference[measured].mean()) if measured.any() else None,
        first_half_windows=int(first_half.sum()), first_half_max=half_max, first_half_max_window_start_s=half_at,
    )
