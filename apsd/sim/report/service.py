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

from apsd.policies.fair import ChargeWeights
from apsd.sim.records import PolicyRun, RequestRecord
from apsd.sim.report.runs import by_tenant, completed, tenant_weight
from apsd.sim.report.summary import ServiceDifference
from apsd.sim.report.timeline import spread_cumulative, union

__all__ = ["SERVICE_DIFFERENCE_DEFINITION", "SERVICE_STEP_S", "SERVICE_WEIGHTS", "SERVICE_WINDOW_S",
           "service_difference_over_time", "summarize_service_difference"]

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


def _backlogged_throughout(requests: Sequence[RequestRecord], starts: np.ndarray,
                           ends: np.ndarray) -> np.ndarray | None:
    """Per window ``[starts[k], ends[k]]``: whether some request of ``requests`` waited in the queue at
    every instant of it (each waits from its arrival to its last dispatch; never dispatched: never).
    None when the queue never held one of them for a whole window."""
    span_start, span_end = union((r.arrival, r.dispatched_at) for r in requests
                                 if r.outcome != "rejected" and r.dispatched_at is not None)
    if not span_start.size or (span_end - span_start).max() < SERVICE_WINDOW_S:
        return None
    i = np.searchsorted(span_start, starts, side="right") - 1
    return (i >= 0) & (span_end[np.maximum(i, 0)] >= ends)


def _service_cumulative(requests: Sequence[RequestRecord], edges: np.ndarray) -> np.ndarray:
    """Service received by each time in ``edges``: each completed request's service spread evenly
    from its first token to its end (at its end when it has no first token)."""
    done = [r for r in completed(requests) if r.finished_at is not None]
    w = SERVICE_WEIGHTS
    return spread_cumulative([r.finished_at if r.started_at is None else r.started_at for r in done],
                             [r.finished_at for r in done],
                             [w.input_weight * r.prompt_tokens + w.output_weight * r.output_tokens for r in done],
                             edges)


def service_difference_over_time(run: PolicyRun) -> tuple[np.ndarray, np.ndarray]:
    """The start of every window of :data:`SERVICE_WINDOW_S` (one every :data:`SERVICE_STEP_S` from 0,
    ending by the run's end), and its service difference: NaN where fewer than two tenants were
    backlogged throughout it. See the module docstring for the definition."""
    steps = round(SERVICE_WINDOW_S / SERVICE_STEP_S)
    count = max(math.floor((run.duration_s - SERVICE_WINDOW_S) / SERVICE_STEP_S + 1e-9) + 1, 0)
    edges = np.arange(count + steps) * SERVICE_STEP_S
    starts, ends = edges[:count], edges[steps:]
    high, low = np.full(count, -np.inf), np.full(count, np.inf)
    backlogged = np.zeros(count, dtype=int)
    for tenant, requests in by_tenant(run).items():
        throughout = _backlogged_throughout(requests, starts, ends)
        if throughout is None:
            continue
        served = _service_cumulative(requests, edges) / tenant_weight(run, tenant)
        in_window = served[steps:] - served[:count]
        high = np.where(throughout, np.maximum(high, in_window), high)
        low = np.where(throughout, np.minimum(low, in_window), low)
        backlogged += throughout
    return starts, np.where(backlogged >= 2, high - low, np.nan)


def summarize_service_difference(run: PolicyRun) -> ServiceDifference:
    """The largest service difference over the whole run and over its first half (windows that end
    by half its duration), its mean over the run's windows, and how many windows had one."""
    starts, difference = service_difference_over_time(run)
    measured = ~np.isnan(difference)
    first_half = measured & (starts + SERVICE_WINDOW_S <= run.duration_s / 2)

    def largest(which: np.ndarray) -> tuple[float | None, float | None]:
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
