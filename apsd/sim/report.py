"""The report of ``apsd simulate``: numbers, Markdown and plots from :class:`~apsd.sim.records.PolicyRun`.

Ownership: this module only reads runs; it never runs anything. :func:`summarize`
turns one run into JSON-ready figures, :func:`format_summary_table` puts several
summaries side by side in Markdown, :func:`build_figure` draws one of the plots
and hands the figure back unsaved, and :func:`write_report` writes
``summary.json``, ``report.md`` and the PNG plots of :data:`PLOT_FILES` into a directory.

In ``report.md`` every duration is in seconds (three decimals) except the two that
live at millisecond scale, the batch window and the time per output token, which are
in milliseconds; every table column with a unit names it. (``summary.json`` keeps
its ``_ms`` keys.) Every plot names its workload in its suptitle; panels comparing
policies share their axes; lines that would coincide are drawn once, labelled with
every policy they stand for.

Engines: busy time and cost are the engines' own (:attr:`PolicyRun.busy_s`,
:attr:`PolicyRun.cost_usd`), so they hold for every engine kind; batch sizes exist
only for the ``micro`` engine, which runs fixed batches. Time to first token (TTFT)
is arrival to first token; time per output token (TPOT) is the engine's mean gap
between output tokens after the first, for requests of two or more tokens.

Every figure is measured from the run's records (model time, never wall-clock
time: :attr:`PolicyRun.wall_s` is left out on purpose), and floats are rounded
to :data:`SIGNIFICANT_DIGITS` significant digits, so two identical runs give a
byte-identical ``summary.json``. The plots are reproducible too: matplotlib's
Agg canvas is used directly (no pyplot, no global backend switch) and the PNGs
carry no ``Software`` metadata. matplotlib is imported only inside the plotting
functions, so ``import apsd.sim.report`` stays light.

Fairness is the daemon's own (:mod:`apsd.core.ledger`): Jain's index over
``x_i`` = output tokens served to tenant ``i`` divided by its configured rate,
over the tenants with at least one admitted request.

Service difference (VTC's measure, Sheng et al., "Fairness in Serving Large Language
Models", OSDI '24), :func:`service_difference_over_time`:

* A completed request gives its tenant ``service = SERVICE_INPUT_WEIGHT * prompt_tokens +
  SERVICE_OUTPUT_WEIGHT * output_tokens`` (1 and 2, VTC's defaults), received evenly from its
  first token to its end (VTC's attribution); divided by the tenant's ``weight``. Requests that
  did not complete give nothing.
* A tenant is *backlogged* while it has a request waiting in the queue: admitted, from its
  arrival to its (last) dispatch, as VTC counts a client backlogged while it has queued requests.
  A tenant whose requests all run at once is not: it asks for no more than it gets.
* Windows are :data:`SERVICE_WINDOW_S` long, one starting every :data:`SERVICE_STEP_S` from
  t = 0, each ending by the run's end (``duration_s``). A window's *service difference* is the
  service the most served tenant received within it minus what the least served received,
  among the tenants backlogged throughout it; none when fewer than two were.
* ``overall.service_difference`` has its maximum over the whole run (``max``) and over the
  windows that end by half the run's duration (``first_half_max``), and how many windows had a
  difference: a fair scheduler bounds the difference whatever the run's length (VTC's Theorem),
  so the whole run's maximum should not exceed the first half's by much. ``mean`` is its mean over
  the windows that have one (VTC reports both): the maximum is often the start of a backlog, when
  the service still comes from requests dispatched before it began.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from apsd.core.ledger import jain_index
from apsd.sim.records import PolicyRun, RequestRecord

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "FAIRNESS_DEFINITION",
    "PLOT_FILES",
    "SERVICE_DIFFERENCE_DEFINITION",
    "SERVICE_INPUT_WEIGHT",
    "SERVICE_OUTPUT_WEIGHT",
    "SERVICE_STEP_S",
    "SERVICE_WINDOW_S",
    "SIGNIFICANT_DIGITS",
    "build_figure",
    "describe_engine",
    "format_summary_table",
    "service_difference_over_time",
    "summarize",
    "write_report",
]

#: Floats in summaries are rounded to this many significant digits.
SIGNIFICANT_DIGITS = 6

#: Service is ``SERVICE_INPUT_WEIGHT * prompt tokens + SERVICE_OUTPUT_WEIGHT * output tokens`` (VTC's defaults).
SERVICE_INPUT_WEIGHT = 1.0
SERVICE_OUTPUT_WEIGHT = 2.0
#: The service difference is measured in windows this long, one starting every :data:`SERVICE_STEP_S`.
SERVICE_WINDOW_S = 10.0
SERVICE_STEP_S = 1.0

#: The service difference in one sentence, for reports (the module docstring has the whole definition).
SERVICE_DIFFERENCE_DEFINITION = (
    f"service = {SERVICE_INPUT_WEIGHT:g} × prompt tokens + {SERVICE_OUTPUT_WEIGHT:g} × output tokens of each "
    "completed request (VTC's weights) over its tenant's weight, received evenly from its first token to its "
    "end; a tenant is "
    "backlogged while it has a request waiting in the queue (arrived, not yet dispatched); in each window of "
    f"{SERVICE_WINDOW_S:g} s (one starting every {SERVICE_STEP_S:g} s), the service difference is the service "
    "received within the window by the most served minus the least served of the tenants backlogged throughout "
    "it (none with fewer than two)"
)

FAIRNESS_DEFINITION = (
    "Jain's index (sum x)^2/(n*sum x^2); x_i = output tokens served to tenant i "
    "divided by its configured rate, over tenants with at least one admitted request"
)

#: The plots :func:`write_report` draws, in order (file name -> what it shows).
PLOT_FILES: dict[str, str] = {
    "latency_cdf.png": "end-to-end latency CDF per tenant",
    "ttft_cdf.png": "time to first token (TTFT) CDF per tenant",
    "tpot_cdf.png": "time per output token (TPOT) CDF per tenant",
    "queue_wait.png": "queue wait against arrival time, coloured by bid",
    "governor.png": "governor entropy and batch window over time",
    "gpu_busy.png": "GPU busy fraction over time",
    "service.png": "cumulative output tokens served per tenant",
    "service_difference.png": "service difference between backlogged tenants over time",
}

_PERCENTILES = (50, 95, 99)
_MAX_TENANT_LINES = 8          # tenants drawn individually; the rest are merged as "other"
_MAX_SCATTER_POINTS = 20_000   # per run in queue_wait.png (the slowest 1% are always kept)
_MAX_CURVE_POINTS = 1_000      # points per CDF / cumulative-service line
_BUSY_BINS = 100
_DPI = 100


# -- numbers ----------------------------------------------------------------------------

def _round(x: float) -> float | None:
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}") + 0.0  # + 0.0 turns -0.0 into 0.0


def _clean(value: Any) -> Any:
    """JSON-ready copy of ``value``: floats rounded, numpy scalars unwrapped, keys as strings."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return _round(value)
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return str(value)


def _percentiles_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99/max of ``values_s`` (seconds) in milliseconds; all None without data."""
    if not len(values_s):
        return {"p50": None, "p95": None, "p99": None, "max": None}
    x = np.asarray(values_s, dtype=float) * 1000.0
    p = np.percentile(x, _PERCENTILES, method="linear")
    return {"p50": float(p[0]), "p95": float(p[1]), "p99": float(p[2]), "max": float(x.max())}


def _counts(requests: Iterable[RequestRecord]) -> dict[str, Any]:
    outcomes = collections.Counter()
    rejected_by_error: collections.Counter[str] = collections.Counter()
    sent = 0
    for r in requests:
        sent += 1
        outcomes[r.outcome] += 1
        if r.outcome == "rejected":
            rejected_by_error[r.error or "unknown"] += 1
    return {
        "sent": sent,
        "completed": outcomes["completed"],
        "rejected": outcomes["rejected"],
        "failed": outcomes["failed"],
        "cancelled": outcomes["cancelled"],
        "rejected_by_error": dict(sorted(rejected_by_error.items())),
    }


def _completed(requests: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in requests if r.outcome == "completed"]


def _waits(requests: Iterable[RequestRecord]) -> list[float]:
    return [r.queue_wait for r in requests if r.queue_wait is not None]


def _latencies(requests: Iterable[RequestRecord]) -> list[float]:
    return [r.latency for r in requests if r.latency is not None]


def _ttfts(requests: Iterable[RequestRecord]) -> list[float]:
    return [r.ttft for r in requests if r.ttft is not None]


def _tpots(requests: Iterable[RequestRecord]) -> list[float]:
    return [r.tpot for r in requests if r.tpot is not None]


def _engine_count(run: PolicyRun) -> int:
    """What busy time is measured against: engines (an engine of ``tp`` GPUs counts once), or the
    forward engine's backends; runs recorded without engine records count one per GPU, as the
    ``micro`` engine has."""
    backends = run.engine.get("backends")
    if backends:
        return len(backends)
    return len(run.engines) or run.gpus


def _tenant_names(run: PolicyRun) -> list[str]:
    return sorted({r.tenant for r in run.requests} | set(run.workload.tenants))


def _lowest_bidder(run: PolicyRun) -> dict[str, Any]:
    bids = [a.bid for a in run.workload.arrivals] or [r.bid for r in run.requests]
    if not bids:
        return {"bid": None, "tenants": [], "requests": 0, "completed": 0,
                "max_queue_wait_ms": None, "p99_queue_wait_ms": None}
    low = min(bids)
    mine = [r for r in run.requests if r.bid == low]
    waits = _waits(_completed(mine))
    stats = _percentiles_ms(waits)
    return {
        "bid": low,
        "tenants": sorted({r.tenant for r in mine}),
        "requests": len(mine),
        "completed": len(waits),
        "max_queue_wait_ms": stats["max"],
        "p99_queue_wait_ms": stats["p99"],
    }


def _governor(run: PolicyRun) -> dict[str, Any]:
    n = len(run.samples)
    by_state = collections.Counter(s.state for s in run.samples)
    windows = [s.window_s for s in run.samples]
    entropies = [s.entropy_bits for s in run.samples if s.entropy_bits is not None]
    return {
        "samples": n,
        "sample_interval_s": run.sample_interval_s,
        "time_in_state": {
            state: {"seconds": count * run.sample_interval_s, "fraction": count / n}
            for state, count in sorted(by_state.items())
        },
        "mean_window_ms": float(np.mean(windows)) * 1000.0 if windows else None,
        "mean_entropy_bits": float(np.mean(entropies)) if entropies else None,
    }


def _weighted_mean(values: Sequence[tuple[float, float]]) -> float | None:
    """Mean of ``(value, weight)`` pairs weighted by weight; the plain mean when every weight is 0."""
    if not values:
        return None
    total = sum(w for _, w in values)
    if total > 0:
        return sum(v * w for v, w in values) / total
    return sum(v for v, _ in values) / len(values)


def _engine(run: PolicyRun) -> dict[str, Any]:
    """The run's ``[engine]``, and its engines' totals: preemptions, and MFU/MBU over their busy
    time (each engine's figure weighted by its busy seconds; None for engines without a hardware
    model, such as ``micro``)."""
    return {
        **dict(sorted(run.engine.items())),
        "preemptions": sum(e.preemptions for e in run.engines),
        "mfu": _weighted_mean([(e.mfu, e.busy_s) for e in run.engines if e.mfu is not None]),
        "mbu": _weighted_mean([(e.mbu, e.busy_s) for e in run.engines if e.mbu is not None]),
    }


def _batch_sizes(run: PolicyRun) -> dict[str, Any]:
    sizes = collections.Counter(b.size for b in run.batches)
    total = sum(sizes.values())
    return {
        "count": total,
        "distribution": {str(size): count for size, count in sorted(sizes.items())},
        "mean": sum(size * count for size, count in sizes.items()) / total if total else None,
    }


def _union(intervals: Iterable[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """The union of closed intervals ``(start, end)`` as disjoint spans (starts, ends), sorted;
    intervals that touch merge."""
    spans: list[list[float]] = []
    for s, e in sorted(intervals):
        if spans and s <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], e)
        else:
            spans.append([s, e])
    return np.asarray([s for s, _ in spans], dtype=float), np.asarray([e for _, e in spans], dtype=float)


def _spread_cumulative(start: np.ndarray, end: np.ndarray, amount: np.ndarray, edges: np.ndarray) -> np.ndarray:
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


def _by_tenant(run: PolicyRun) -> dict[str, list[RequestRecord]]:
    by_tenant: dict[str, list[RequestRecord]] = collections.defaultdict(list)
    for r in run.requests:
        by_tenant[r.tenant].append(r)
    return by_tenant


def _tenant_weight(run: PolicyRun, tenant: str) -> float:
    config = run.workload.tenants.get(tenant)
    return 1.0 if config is None else config.weight


def _backlogged_throughout(requests: Sequence[RequestRecord], starts: np.ndarray,
                           ends: np.ndarray) -> np.ndarray | None:
    """Per window ``[starts[k], ends[k]]``: whether some request of ``requests`` waited in the queue at
    every instant of it (each waits from its arrival to its last dispatch; never dispatched: never).
    None when the queue never held one of them for a whole window."""
    span_start, span_end = _union((r.arrival, r.dispatched_at) for r in requests
                                  if r.outcome != "rejected" and r.dispatched_at is not None)
    if not span_start.size or (span_end - span_start).max() < SERVICE_WINDOW_S:
        return None
    i = np.searchsorted(span_start, starts, side="right") - 1
    return (i >= 0) & (span_end[np.maximum(i, 0)] >= ends)


def _service_cumulative(requests: Sequence[RequestRecord], edges: np.ndarray) -> np.ndarray:
    """Service received by each time in ``edges``: each completed request's
    ``input_weight * prompt_tokens + output_weight * output_tokens`` spread evenly from its first
    token to its end (at its end when it has no first token)."""
    done = [r for r in _completed(requests) if r.finished_at is not None]
    return _spread_cumulative([r.finished_at if r.started_at is None else r.started_at for r in done],
                              [r.finished_at for r in done],
                              [SERVICE_INPUT_WEIGHT * r.prompt_tokens + SERVICE_OUTPUT_WEIGHT * r.output_tokens
                               for r in done], edges)


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
    for tenant, requests in _by_tenant(run).items():
        throughout = _backlogged_throughout(requests, starts, ends)
        if throughout is None:
            continue
        served = _service_cumulative(requests, edges) / _tenant_weight(run, tenant)
        in_window = served[steps:] - served[:count]
        high = np.where(throughout, np.maximum(high, in_window), high)
        low = np.where(throughout, np.minimum(low, in_window), low)
        backlogged += throughout
    return starts, np.where(backlogged >= 2, high - low, np.nan)


def _service_difference(run: PolicyRun) -> dict[str, Any]:
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
    return {
        "window_s": SERVICE_WINDOW_S, "step_s": SERVICE_STEP_S,
        "input_weight": SERVICE_INPUT_WEIGHT, "output_weight": SERVICE_OUTPUT_WEIGHT,
        "windows": int(measured.sum()), "max": whole_max, "max_window_start_s": whole_at,
        "mean": float(difference[measured].mean()) if measured.any() else None,
        "first_half_windows": int(first_half.sum()), "first_half_max": half_max,
        "first_half_max_window_start_s": half_at,
    }


def summarize(run: PolicyRun) -> dict[str, Any]:
    """The run's figures, JSON-ready and deterministic (see the module docstring).

    Queue waits, TTFT, TPOT and latencies cover completed requests only; rejected,
    failed and cancelled requests are counted but never enter a percentile. Times are
    in milliseconds where a key ends in ``_ms``, model seconds elsewhere. A figure
    with nothing to measure (no completions, zero duration) is ``None``.

    GPU busy time and cost are the engines' (``gpu_busy_s`` counts an engine of ``tp``
    GPUs once); ``gpu_utilization`` is that busy time over (engines × duration).
    ``engine`` is the run's ``[engine]`` with its engines' preemptions and MFU/MBU.
    """
    by_tenant = _by_tenant(run)
    tenants: dict[str, Any] = {}
    fairness_x: list[float] = []
    for name in _tenant_names(run):
        reqs = by_tenant.get(name, [])
        done = _completed(reqs)
        tokens = sum(r.output_tokens for r in done)
        rate = run.tenant_rates.get(name)
        admitted = sum(1 for r in reqs if r.outcome != "rejected")
        if admitted and rate:
            fairness_x.append(tokens / rate)
        tenants[name] = {
            **_counts(reqs),
            "admitted": admitted,
            "rate": rate,
            "bids": sorted({r.bid for r in reqs}),
            "output_tokens": tokens,
            "service_per_rate": tokens / rate if rate else None,
            "cost_usd": sum(r.cost_usd for r in done),
            "queue_wait_ms": _percentiles_ms(_waits(done)),
            "ttft_ms": _percentiles_ms(_ttfts(done)),
            "tpot_ms": _percentiles_ms(_tpots(done)),
            "latency_ms": _percentiles_ms(_latencies(done)),
        }

    done = _completed(run.requests)
    tokens = sum(r.output_tokens for r in done)
    duration = run.duration_s
    busy = run.busy_s
    cost = run.cost_usd
    engines = _engine_count(run)
    overall = {
        **_counts(run.requests),
        "output_tokens": tokens,
        "throughput_tokens_per_s": tokens / duration if duration > 0 else None,
        "batches": len(run.batches),
        "gpu_busy_s": busy,
        "gpu_utilization": busy / (engines * duration) if duration > 0 and engines else None,
        "cost_usd": cost,
        "cost_per_1m_tokens_usd": cost / tokens * 1e6 if tokens else None,
        "fairness": {
            "jain_index": jain_index(fairness_x),
            "tenants_counted": len(fairness_x),
            "fairness_definition": FAIRNESS_DEFINITION,
        },
        "lowest_bidder": _lowest_bidder(run),
        "queue_wait_ms": _percentiles_ms(_waits(done)),
        "ttft_ms": _percentiles_ms(_ttfts(done)),
        "tpot_ms": _percentiles_ms(_tpots(done)),
        "latency_ms": _percentiles_ms(_latencies(done)),
        "governor": _governor(run),
        "batch_sizes": _batch_sizes(run),
        "service_difference": _service_difference(run),
    }
    wl = run.workload
    return _clean({
        "label": run.label,
        "policy": dict(sorted(run.policy.items())),
        "workload": {
            "name": wl.name,
            "description": wl.description,
            "params": wl.params,
            "seed": wl.seed,
            "arrivals": len(wl.arrivals),
            "tenants": len(wl.tenants),
        },
        "gpus": run.gpus,
        "engine": _engine(run),
        "duration_s": duration,
        "tenants": tenants,
        "overall": overall,
    })


# -- Markdown ---------------------------------------------------------------------------

def _f(x: float | None, spec: str, scale: float = 1.0, prefix: str = "", suffix: str = "") -> str:
    """``x * scale`` formatted with ``spec``; an em dash for a missing value."""
    if x is None:
        return "—"
    return f"{prefix}{x * scale:{spec}}{suffix}"


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> str:
    lines = [_row(header), "|" + "|".join({"l": ":---", "r": "---:"}[a] for a in align) + "|"]
    lines += [_row(r) for r in rows]
    return "\n".join(lines)


#: Units in report.md: every duration (wait, TTFT, latency, run time, time in a state) in seconds
#: with :data:`_S` (three decimals, millisecond resolution). Two durations live at millisecond
#: scale and are in milliseconds: the governor's batch window, configured in milliseconds
#: (``window_ms``), and the time per output token (TPOT, a decode step or a share of one), with
#: :data:`_MS` in tables (two decimals, 10 µs resolution: seconds with three decimals would round
#: 9.6 ms and 10.4 ms alike). Every column with a unit names it in its header.
_S = ".3f"
_MS = ".2f"
_QUANTILES = ("p50", "p95", "p99", "max")

_SUMMARY_HEADER = (
    "policy", "completed", "rejected", "throughput (tok/s)", "GPU util (%)", "cost per 1M tokens (USD)",
    "Jain", "lowest bidder max wait (s)", "p99 TTFT (s)", "p99 TPOT (ms)", "p99 latency (s)",
    "mean batch size (requests)",
)


def format_summary_table(summaries: Sequence[dict[str, Any]]) -> str:
    """A Markdown table with one row per summary (as returned by :func:`summarize`)."""
    rows = []
    for s in summaries:
        o = s["overall"]
        rows.append((
            f"`{s['label']}`",
            str(o["completed"]),
            str(o["rejected"]),
            _f(o["throughput_tokens_per_s"], ".1f"),
            _f(o["gpu_utilization"], ".1f", 100),
            _f(o["cost_per_1m_tokens_usd"], ".2f", prefix="$"),
            _f(o["fairness"]["jain_index"], ".3f"),
            _f(o["lowest_bidder"]["max_queue_wait_ms"], _S, 1e-3),
            _f(o["ttft_ms"]["p99"], _S, 1e-3),
            _f(o["tpot_ms"]["p99"], _MS),
            _f(o["latency_ms"]["p99"], _S, 1e-3),
            _f(o["batch_sizes"]["mean"], ".2f"),
        ))
    return _table(_SUMMARY_HEADER, rows, "l" + "r" * (len(_SUMMARY_HEADER) - 1))


def _quantiles(p: dict[str, float | None], spec: str, scale: float) -> str:
    return " / ".join(_f(p[k], spec, scale) for k in _QUANTILES)


def _tenant_table(summary: dict[str, Any]) -> str:
    header = ("tenant", "bids", "sent", "completed", "rejected", "failed", "cancelled",
              "wait p50/p95/p99/max (s)", "TTFT p50/p95/p99/max (s)", "TPOT p50/p95/p99/max (ms)",
              "latency p50/p95/p99/max (s)", "output tokens", "rejections")
    rows = []
    for name, t in summary["tenants"].items():
        rows.append((
            f"`{name}`",
            ", ".join(str(b) for b in t["bids"]) or "—",
            str(t["sent"]), str(t["completed"]), str(t["rejected"]), str(t["failed"]), str(t["cancelled"]),
            _quantiles(t["queue_wait_ms"], _S, 1e-3),
            _quantiles(t["ttft_ms"], _S, 1e-3),
            _quantiles(t["tpot_ms"], _MS, 1.0),
            _quantiles(t["latency_ms"], _S, 1e-3),
            str(t["output_tokens"]),
            ", ".join(f"{code}: {n}" for code, n in t["rejected_by_error"].items()) or "—",
        ))
    return _table(header, rows, "llrrrrrrrrrrl")


def _service_difference_table(summaries: Sequence[dict[str, Any]]) -> str:
    header = ("policy", "windows with 2+ backlogged tenants", "max, first half (service)",
              "max, whole run (service)", "window of the max, from (s)", "mean, whole run (service)")
    rows = []
    for s in summaries:
        d = s["overall"]["service_difference"]
        rows.append((f"`{s['label']}`", f"{d['windows']} (first half {d['first_half_windows']})",
                     _f(d["first_half_max"], ",.0f"), _f(d["max"], ",.0f"), _f(d["max_window_start_s"], _S),
                     _f(d["mean"], ",.0f")))
    return _table(header, rows, "lrrrrr")


def _governor_table(summary: dict[str, Any]) -> str:
    g = summary["overall"]["governor"]
    if not g["samples"]:
        return "No governor samples."
    rows = [(f"`{state}`", _f(v["seconds"], _S), _f(v["fraction"], ".1f", 100))
            for state, v in g["time_in_state"].items()]
    return (_table(("state", "time (s)", "share (%)"), rows, "lrr")
            + f"\n\n{g['samples']} samples, one every {g['sample_interval_s']:g} s; mean window "
            + _f(g["mean_window_ms"], ".3g", suffix=" ms") + ", mean entropy "
            + _f(g["mean_entropy_bits"], ".2f", suffix=" bits") + ".")


def _batch_table(summary: dict[str, Any]) -> str:
    b = summary["overall"]["batch_sizes"]
    if not b["count"]:
        if summary["engine"].get("kind", "micro") != "micro":
            return (f"No fixed batches: the `{summary['engine']['kind']}` engine batches at the iteration "
                    "level (sequences join and leave at every step).")
        return "No batches ran."
    items = sorted(b["distribution"].items(), key=lambda kv: int(kv[0]))
    rows = [(size, str(n), _f(n / b["count"], ".1f", 100)) for size, n in items]
    return (_table(("batch size (requests)", "batches", "share (%)"), rows, "rrr")
            + f"\n\n{b['count']} batches, mean size {_f(b['mean'], '.2f')}.")


def describe_engine(engine: dict[str, Any], gpus: int | None = None) -> str:
    """An ``engine`` block of a summary in words: "1 `continuous` engine (a100-80gb × llama-3-8b, tp 1)"."""
    count = engine.get("count", 1)
    kind = engine.get("kind", "?")
    noun = "engine" if count == 1 else "engines"
    if "gpu" in engine:
        what = f"{engine['gpu']} × {engine['model']}, tp {engine.get('tp', 1)}"
    elif "backends" in engine:
        what = "to " + ", ".join(f"`{b}`" for b in engine["backends"])
    else:
        what = "a simulated GPU, `[gpu]`"
    text = f"{count} `{kind}` {noun}" + (f" ({what})" if what else "")
    if gpus is not None and gpus != count:
        text += f", {gpus} GPUs"
    return text


def _engine_figures(summary: dict[str, Any]) -> str:
    """The engines' own figures, for a policy's section ("" when the engine has none)."""
    e = summary["engine"]
    if e["mfu"] is None and e["mbu"] is None and not e["preemptions"]:
        return ""
    return (" Engine: MFU " + _f(e["mfu"], ".1f", 100, suffix="%") + ", MBU " + _f(e["mbu"], ".1f", 100, suffix="%")
            + f" over its busy time; {e['preemptions']} preemption{'' if e['preemptions'] == 1 else 's'}.")


def _describe_workload(summary: dict[str, Any], runs: Sequence[dict[str, Any]]) -> str:
    wl = summary["workload"]
    params = ", ".join(f"`{k}={json.dumps(v)}`" for k, v in sorted(wl["params"].items())) or "none"
    engines = list(dict.fromkeys(describe_engine(s["engine"], s["gpus"]) for s in runs))
    durations = ", ".join(f"`{s['label']}` {_f(s['duration_s'], _S)} s" for s in runs)
    description = wl["description"].strip()
    if description and description[-1] not in ".!?":
        description += "."
    return (
        f"{description} {wl['arrivals']} arrivals from {wl['tenants']} tenants, "
        f"generated with seed {wl['seed']} and parameters {params}; "
        f"run on {' or '.join(engines)}; "
        f"model time to the last outcome: {durations}."
    ).strip()


def _workload_key(run: PolicyRun) -> tuple[str, int, str, int]:
    wl = run.workload
    return (wl.name, wl.seed, json.dumps(_clean(wl.params), sort_keys=True), len(wl.arrivals))


def _group(runs: Sequence[PolicyRun], summaries: Sequence[dict[str, Any]]):
    groups: dict[tuple, list[int]] = {}
    for i, run in enumerate(runs):
        groups.setdefault(_workload_key(run), []).append(i)
    return [[summaries[i] for i in idx] for idx in groups.values()]


def _markdown(title: str, summaries: Sequence[dict[str, Any]], groups: Sequence[Sequence[dict[str, Any]]],
              plots: Sequence[str]) -> str:
    out = [f"# {title}", ""]
    if not summaries:
        out += ["No runs.", ""]
    for group in groups:
        first = group[0]
        out += [f"## Workload `{first['workload']['name']}`", "",
                _describe_workload(first, group), "",
                "### Comparison", "", format_summary_table(group), "",
                "Throughput is output tokens per model second to the last outcome; GPU utilization is "
                "busy time over (engines × duration), where an engine is busy while it computes (a `micro` "
                "engine while a batch runs, a `continuous` one while any sequence is in it); cost per 1M "
                "tokens is the engines' cost over the output tokens produced; TTFT is arrival to first "
                "token and TPOT the mean time between output tokens after the first (requests of two or "
                "more tokens); the lowest bidder is every request with the smallest bid among the "
                "arrivals, and its wait is the longest queue wait among its completed requests. Batch "
                "sizes exist only for the `micro` engine (—: none ran).", "",
                "### Service difference between backlogged tenants", "", _service_difference_table(group), "",
                SERVICE_DIFFERENCE_DEFINITION[0].upper() + SERVICE_DIFFERENCE_DEFINITION[1:] + ". The first half "
                "is the windows that end by half the run's duration: a fair scheduler keeps the difference "
                "bounded however long the run, so the whole run's maximum stays near the first half's. The mean "
                "is over the windows with a difference.", ""]
        for s in group:
            lb = s["overall"]["lowest_bidder"]
            out += [f"### `{s['label']}`", "",
                    "Policy: " + (", ".join(f"{k} `{v}`" for k, v in s["policy"].items()) or "—")
                    + f". Lowest bid {lb['bid'] if lb['bid'] is not None else '—'}: "
                    + f"{lb['completed']} of {lb['requests']} requests completed, queue wait p99 "
                    + _f(lb["p99_queue_wait_ms"], _S, 1e-3, suffix=" s") + ", max "
                    + _f(lb["max_queue_wait_ms"], _S, 1e-3, suffix=" s") + "." + _engine_figures(s), "",
                    "#### Tenants", "", _tenant_table(s), "",
                    "#### Governor time in state", "", _governor_table(s), "",
                    "#### Batch sizes", "", _batch_table(s), ""]
    out += ["## Fairness", "", FAIRNESS_DEFINITION + ". 1.0 means every active tenant got service "
            "in proportion to its rate; 1/n means one tenant got everything.", ""]
    if plots:
        out += ["## Plots", ""]
        for name in plots:
            out += [f"![{PLOT_FILES[name]}]({name})", ""]
    return "\n".join(out)


# -- plots ------------------------------------------------------------------------------
#
# Every figure names its workload in its suptitle, so a PNG seen alone says what it shows.
# Panels that compare policies share their axes: a difference between two panels is a
# difference in the runs, never in the scales. Where policies are drawn as lines on one
# axes, policies whose curves are identical share one line whose label names them all, so
# the legend never lists a line that another one hides.

def _figure(n_panels: int, width: float = 5.0, height: float = 3.6) -> tuple[Figure, list[Axes]]:
    """A figure on matplotlib's Agg canvas with one subplot per panel (at most 3 per row).

    The panels share their x and y axes (limits, and scale), and each keeps its tick labels.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = max(n_panels, 1)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes: list[Axes] = []
    for i in range(n):
        first = axes[0] if axes else None
        axes.append(fig.add_subplot(nrows, ncols, i + 1, sharex=first, sharey=first))
    return fig, axes


def _single_figure(width: float, height: float, rows: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure on matplotlib's Agg canvas with ``rows`` panels stacked on one shared time axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes: list[Axes] = []
    for i in range(rows):
        axes.append(fig.add_subplot(rows, 1, i + 1, sharex=axes[0] if axes else None))
    return fig, axes


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=_DPI, metadata={"Software": None})
    fig.clear()  # not owned by pyplot, so nothing else holds it once this returns
    return path


def _no_data(ax: Axes, what: str = "no data") -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="grey")


def _run_title(run: PolicyRun, several_workloads: bool) -> str:
    return f"{run.label} — {run.workload.name}" if several_workloads else run.label


def _workloads_shown(runs: Sequence[PolicyRun]) -> str:
    """What a figure's suptitle says about its workload(s)."""
    if not runs:
        return "no runs"
    keys = list(dict.fromkeys(_workload_key(run) for run in runs))
    if len(keys) == 1:
        wl = runs[0].workload
        return f"workload {wl.name} ({len(wl.arrivals)} arrivals, seed {wl.seed})"
    names = list(dict.fromkeys(run.workload.name for run in runs))
    if len(names) < len(keys):  # one name with several seeds or parameters
        names = list(dict.fromkeys(f"{run.workload.name} (seed {run.workload.seed})" for run in runs))
    return "workloads " + ", ".join(names)


def _labels(runs: Sequence[PolicyRun], several: bool) -> str:
    return ", ".join(_run_title(run, several) for run in runs)


def _top_tenants(run: PolicyRun) -> tuple[list[str], set[str]]:
    """The tenants drawn individually (most requests first) and the ones merged as "other"."""
    sent = collections.Counter(r.tenant for r in run.requests)
    ranked = sorted(sent, key=lambda t: (-sent[t], t))
    return ranked[:_MAX_TENANT_LINES], set(ranked[_MAX_TENANT_LINES:])


def _tenant_lines(run: PolicyRun, requests: Sequence[RequestRecord]) -> list[tuple[str, list[RequestRecord], Any]]:
    """``requests`` split into one (name, requests, colour) line per top tenant, plus "other"."""
    top, rest = _top_tenants(run)
    index = {t: i for i, t in enumerate(top)}
    split: list[list[RequestRecord]] = [[] for _ in range(len(top) + 1)]
    for r in requests:
        split[index.get(r.tenant, len(top))].append(r)
    lines = [(t, split[i], _tenant_colour(i)) for i, t in enumerate(top)]
    if rest:
        lines.append((f"other ({len(rest)} tenants)", split[-1], "black"))
    return lines


_PALETTE = (0, 1, 2, 3, 4, 5, 6, 8, 9)  # tab10 without its grey, which would look like "other"
_STYLES = ("-", "--", ":", "-.")


def _tenant_colour(i: int) -> Any:
    from matplotlib import colormaps
    return colormaps["tab10"](_PALETTE[i % len(_PALETTE)])


def _line_style(i: int) -> dict[str, Any]:
    return {"color": _tenant_colour(i), "linestyle": _STYLES[i % len(_STYLES)]}


def _thin(x: np.ndarray, limit: int) -> np.ndarray:
    """At most ``limit`` evenly spaced elements of the sorted array ``x`` (ends kept)."""
    if x.size <= limit:
        return x
    return x[np.unique(np.linspace(0, x.size - 1, limit).round().astype(int))]


def _draw_cdf(runs: Sequence[PolicyRun], several: bool, values: Callable[[Sequence[RequestRecord]], list[float]],
              xlabel: str, ylabel: str, scale: float = 1.0, missing: str = "no completed requests",
              legend: str = "lower right") -> Figure:
    """One panel per run: the CDF of ``values(requests) * scale`` over its completed requests, a line per tenant."""
    fig, axes = _figure(len(runs))
    low, high = math.inf, 0.0
    for ax, run in zip(axes, runs):
        groups = _tenant_lines(run, _completed(run.requests))
        drawn = False
        for name, reqs, colour in groups:
            v = np.sort(np.asarray(values(reqs), dtype=float)) * scale
            if not v.size:
                continue
            idx = _thin(np.arange(v.size), _MAX_CURVE_POINTS)
            # The step starts at 0 at the fastest request, so even one request draws a line.
            x = np.concatenate(([v[0]], v[idx]))
            y = np.concatenate(([0.0], (idx + 1) / v.size))
            ax.step(x, y, where="post", color=colour, label=name, linewidth=1.2)
            low, high = min(low, float(v[0])), max(high, float(v[-1]))
            drawn = True
        if drawn:
            ax.legend(fontsize="x-small", loc=legend)
        else:
            _no_data(ax, missing)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(_run_title(run, several))
        ax.grid(alpha=0.3)
    if low > 0 and high / low > 20:  # log scale only when the values span decades (shared: every panel)
        axes[0].set_xscale("log")
    axes[0].set_ylim(0, 1.02)
    return fig


def _draw_latency_cdf(runs: Sequence[PolicyRun], several: bool) -> Figure:
    return _draw_cdf(runs, several, _latencies, "end-to-end latency (s)", "fraction of completed requests")


def _draw_ttft_cdf(runs: Sequence[PolicyRun], several: bool) -> Figure:
    return _draw_cdf(runs, several, _ttfts, "time to first token (s)", "fraction of completed requests")


def _draw_tpot_cdf(runs: Sequence[PolicyRun], several: bool) -> Figure:
    return _draw_cdf(runs, several, _tpots, "time per output token (ms)",
                     "fraction of completed requests (2+ tokens)", scale=1000.0,
                     missing="no completed request of 2+ tokens",
                     legend="upper left")  # most requests decode at the batch's pace: the curves climb late


def _draw_queue_wait(runs: Sequence[PolicyRun], several: bool) -> Figure:
    fig, axes = _figure(len(runs))
    all_bids = [r.bid for run in runs for r in run.requests]
    vmin, vmax = (min(all_bids), max(all_bids)) if all_bids else (0, 1)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    mappable = None
    for ax, run in zip(axes, runs):
        done = [r for r in _completed(run.requests) if r.dispatched_at is not None]
        at = np.asarray([r.arrival for r in done], dtype=float)
        wait = np.asarray([r.queue_wait for r in done], dtype=float)
        bid = np.asarray([r.bid for r in done], dtype=float)
        shown = np.arange(at.size)
        if at.size > _MAX_SCATTER_POINTS:
            # Keep every request in the slowest 1% (the tail is the point of the plot) and an
            # evenly spaced sample of the rest: deterministic and fast for 100k+ requests.
            slow = np.argsort(wait, kind="stable")[-max(at.size // 100, 1):]
            even = np.linspace(0, at.size - 1, _MAX_SCATTER_POINTS - slow.size).round().astype(int)
            shown = np.union1d(slow, even)
        title = _run_title(run, several)
        if shown.size < at.size:
            title += f"\n({shown.size} of {at.size} requests shown, slowest 1% all kept)"
        if at.size:
            mappable = ax.scatter(at[shown], wait[shown], c=bid[shown], s=4 if shown.size > 2_000 else 14,
                                  cmap="viridis",
                                  vmin=vmin, vmax=vmax, linewidths=0, rasterized=False)
        else:
            _no_data(ax, "no completed requests")
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel("queue wait (s)")
        ax.set_title(title, fontsize="medium")
        ax.grid(alpha=0.3)
    if mappable is not None:
        fig.colorbar(mappable, ax=axes, label="bid", shrink=0.9)
    return fig


def _measures_entropy(run: PolicyRun) -> bool:
    return any(s.entropy_bits is not None for s in run.samples)


def _entropy_groups(runs: Sequence[PolicyRun]) -> list[list[PolicyRun]]:
    """The runs whose governor reads entropy, grouped so that each group has one entropy curve.

    The simulator replays a run's admitted arrivals into a fresh governor (``simulate._sample``),
    so the reading is a function of the governor, the workload and the admitted arrival times:
    runs alike in all three have the same curve, however their policies order the queue.
    """
    groups: dict[tuple, list[PolicyRun]] = {}
    for run in runs:
        if _measures_entropy(run):
            admitted = tuple(r.arrival for r in run.requests if r.outcome != "rejected")
            key = (run.policy.get("governor"), _workload_key(run), admitted)
            groups.setdefault(key, []).append(run)
    return list(groups.values())


def _window_groups(runs: Sequence[PolicyRun]) -> list[tuple[list[PolicyRun], float | None]]:
    """Runs grouped by identical batch windows: (runs, the constant window in s, or None if it varies)."""
    groups: dict[tuple, tuple[list[PolicyRun], float | None]] = {}
    for run in runs:
        if not run.samples:
            continue
        w = np.asarray([s.window_s for s in run.samples], dtype=float)
        if (w == w[0]).all():
            key: tuple = ("constant", float(w[0]))
        else:
            key = ("varies", np.asarray([s.at for s in run.samples], dtype=float).tobytes(), w.tobytes())
        groups.setdefault(key, ([], float(w[0]) if key[0] == "constant" else None))[0].append(run)
    return list(groups.values())


def _draw_governor(runs: Sequence[PolicyRun], several: bool) -> Figure:
    fig, (ax_h, ax_w) = _single_figure(10, 6.4, rows=2)

    # Entropy: a property of the arrivals, drawn once per group of runs that read the same.
    entropy_groups = _entropy_groups(runs)
    for i, group in enumerate(entropy_groups):
        run = max(group, key=lambda r: r.duration_s)  # the same function of time: the longest covers all
        t = np.asarray([s.at for s in run.samples], dtype=float)
        h = np.asarray([np.nan if s.entropy_bits is None else s.entropy_bits for s in run.samples], dtype=float)
        ax_h.plot(t, h, linewidth=1.0, label=_labels(group, several), **_line_style(i))
    measured = [run for group in entropy_groups for run in group]
    unmeasured = [run for run in runs if not any(run is m for m in measured)]
    if len(entropy_groups) == 1:
        title = "entropy of inter-arrival gaps: a property of the arrivals"
        if len(measured) > 1:
            title += f", the same for {_labels(measured, several)} (drawn once)"
    else:
        title = "entropy of inter-arrival gaps, as each entropy-reading governor sees the arrivals"
    if unmeasured:
        by_governor: dict[str, list[PolicyRun]] = {}
        for run in unmeasured:
            by_governor.setdefault(str(run.policy.get("governor", "?")), []).append(run)
        title += "\nnot read by " + "; ".join(f"{_labels(group, several)} (governor {name})"
                                              for name, group in by_governor.items())
    ax_h.set_title(title, fontsize="medium")

    # Window: each policy's, policies with identical windows on one line.
    window_groups = _window_groups(runs)
    for i, (group, constant) in enumerate(window_groups):
        label = _labels(group, several)
        if constant is not None:
            end = max(max(s.at for s in run.samples) for run in group)
            t, w = np.asarray([0.0, end]), np.asarray([constant, constant]) * 1000.0
            label += f" (constant {constant * 1000:g} ms)"
        else:
            t = np.asarray([s.at for s in group[0].samples], dtype=float)
            w = np.asarray([s.window_s for s in group[0].samples], dtype=float) * 1000.0
        ax_w.plot(t, w, drawstyle="steps-post", linewidth=1.2, label=label, **_line_style(i))
    ax_w.set_title("batch window of each policy (identical windows share a line)", fontsize="medium")

    for ax, groups, what in ((ax_h, entropy_groups, "no policy's governor reads entropy"),
                             (ax_w, window_groups, "no governor samples")):
        if groups:
            ax.legend(fontsize="x-small", loc="best")  # lines go anywhere: let matplotlib find room
        else:
            _no_data(ax, what)
        ax.grid(alpha=0.3)
    # Both from 0 (less a margin, so a line at 0 stays visible): a flat line reads as its value
    # (a constant 10 ms window), not as noise around it.
    for ax in (ax_h, ax_w):
        top = max([1.0, *(float(np.nanmax(line.get_ydata())) for line in ax.get_lines())]) * 1.08
        ax.set_ylim(-0.03 * top, top)
    ax_h.set_ylabel("arrival entropy (bits)")
    ax_w.set_ylabel("batch window (ms)")
    ax_w.set_xlabel("time (s)")
    return fig


def _busy_spans(run: PolicyRun) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, busy seconds) of each stretch an engine computed.

    The ``micro`` engine: its batches (busy time spread evenly over each). An engine without batch
    records (``continuous``): it steps whenever a sequence is in it, so its busy stretches are the
    union of the intervals from each request's dispatch to its end, per engine.
    """
    if run.batches:
        return (np.asarray([b.started_at for b in run.batches], dtype=float),
                np.asarray([b.finished_at for b in run.batches], dtype=float),
                np.asarray([b.busy_s for b in run.batches], dtype=float))
    by_engine: dict[int | None, list[tuple[float, float]]] = {}
    for r in run.requests:
        if r.dispatched_at is not None and r.finished_at is not None:
            by_engine.setdefault(r.engine_id, []).append((r.dispatched_at, r.finished_at))
    spans = [_union(intervals) for intervals in by_engine.values()]  # each engine's own: busy time adds up
    start = np.concatenate([s for s, _ in spans]) if spans else np.zeros(0)
    end = np.concatenate([e for _, e in spans]) if spans else np.zeros(0)
    return start, end, end - start


def _busy_cumulative(run: PolicyRun, edges: np.ndarray) -> np.ndarray:
    """Engine busy seconds accumulated by each time in ``edges`` (see :func:`_busy_spans`)."""
    return _spread_cumulative(*_busy_spans(run), edges)


def _identical_curves(runs: Sequence[PolicyRun], curve: Callable[[PolicyRun], tuple[np.ndarray, np.ndarray] | None]
                      ) -> list[tuple[list[PolicyRun], np.ndarray, np.ndarray]]:
    """Each distinct ``curve(run)`` (x, y; None: nothing to draw) with the runs that have it, in order."""
    curves: dict[tuple[bytes, bytes], tuple[list[PolicyRun], np.ndarray, np.ndarray]] = {}
    for run in runs:
        xy = curve(run)
        if xy is not None:
            curves.setdefault((xy[0].tobytes(), xy[1].tobytes()), ([], *xy))[0].append(run)
    return list(curves.values())


def _draw_shared_lines(ax: Axes, curves: Sequence[tuple[list[PolicyRun], np.ndarray, np.ndarray]], several: bool,
                       draw: Callable[..., Any], legend: str, missing: str) -> None:
    """``draw(x, y, label=..., **style)`` for each curve of :func:`_identical_curves`, labelled with its
    runs, and a legend; ``missing`` when there is none."""
    for i, (group, x, y) in enumerate(curves):
        draw(x, y, label=_labels(group, several), linewidth=1.2, **_line_style(i))
    if curves:
        ax.legend(fontsize="x-small", loc=legend)
    else:
        _no_data(ax, missing)


def _busy_fraction(run: PolicyRun) -> tuple[np.ndarray, np.ndarray] | None:
    """The edges of :data:`_BUSY_BINS` bins over the run, and the engines' busy fraction in each."""
    if run.duration_s <= 0 or not _engine_count(run):
        return None
    edges = np.linspace(0.0, run.duration_s, _BUSY_BINS + 1)
    width = edges[1] - edges[0]
    return edges, np.diff(_busy_cumulative(run, edges)) / (_engine_count(run) * width)


def _service_difference_curve(run: PolicyRun) -> tuple[np.ndarray, np.ndarray] | None:
    """Each window's middle and service difference (thinned for long runs); None without any."""
    starts, difference = service_difference_over_time(run)
    if np.isnan(difference).all():
        return None
    shown = _thin(np.arange(starts.size), _MAX_CURVE_POINTS * 4)
    return starts[shown] + SERVICE_WINDOW_S / 2, difference[shown]


def _draw_gpu_busy(runs: Sequence[PolicyRun], several: bool) -> Figure:
    fig, (ax,) = _single_figure(10, 4)
    curves = _identical_curves(runs, _busy_fraction)
    _draw_shared_lines(ax, curves, several, lambda edges, frac, **style: ax.stairs(frac, edges, **style),
                       legend="lower right", missing="no data")
    notes = []
    if any(len(group) > 1 for group, _, _ in curves):
        notes.append("one line per policy; policies with identical curves share a line")
    if any(run.engine.get("kind", "micro") != "micro" for run in runs):
        notes.append("an engine without batches (continuous) is busy while any sequence is in it")
    if notes:
        ax.set_title("\n".join(notes), fontsize="medium")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"GPU busy fraction ({_BUSY_BINS} bins per run)")
    ax.grid(alpha=0.3)
    return fig


def _draw_service(runs: Sequence[PolicyRun], several: bool) -> Figure:
    fig, axes = _figure(len(runs))
    for ax, run in zip(axes, runs):
        done = [r for r in _completed(run.requests) if r.finished_at is not None]
        groups = _tenant_lines(run, done)
        end = max(run.duration_s, max((r.finished_at for r in done), default=0.0))
        drawn = False
        for name, reqs, colour in groups:
            if not reqs:
                continue
            t = np.asarray([r.finished_at for r in reqs], dtype=float)
            order = np.argsort(t, kind="stable")
            t = t[order]
            cum = np.cumsum(np.asarray([r.output_tokens for r in reqs], dtype=float)[order])
            # Exact steps for small runs; the curve sampled on a fixed grid for large ones.
            if t.size > _MAX_CURVE_POINTS:
                grid = np.linspace(0.0, end, _MAX_CURVE_POINTS)
                k = np.searchsorted(t, grid, side="right")
                x, y = grid, np.where(k > 0, cum[np.maximum(k - 1, 0)], 0.0)
            else:
                x, y = np.concatenate(([0.0], t, [end])), np.concatenate(([0.0], cum, [cum[-1]]))
            ax.plot(x, y, drawstyle="steps-post", color=colour, label=name, linewidth=1.2)
            drawn = True
        if drawn:
            ax.legend(fontsize="x-small", loc="upper left")
        else:
            _no_data(ax, "no completed requests")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("cumulative output tokens served")
        ax.set_title(_run_title(run, several))
        ax.grid(alpha=0.3)
    return fig


def _draw_service_difference(runs: Sequence[PolicyRun], several: bool) -> Figure:
    """One line per policy (identical ones shared) of each window's service difference, at the
    window's middle; gaps where fewer than two tenants were backlogged throughout a window."""
    fig, (ax,) = _single_figure(10, 4)
    curves = _identical_curves(runs, _service_difference_curve)
    _draw_shared_lines(ax, curves, several, ax.plot, legend="best",
                       missing=f"no {SERVICE_WINDOW_S:g} s window with two tenants backlogged throughout")
    unmeasured = [run for run in runs if not any(run is r for group, _, _ in curves for r in group)]
    notes = [f"{SERVICE_WINDOW_S:g} s windows, one every {SERVICE_STEP_S:g} s; service = "
             f"{SERVICE_INPUT_WEIGHT:g}·prompt + {SERVICE_OUTPUT_WEIGHT:g}·output tokens; policies with identical "
             "curves share a line"]
    if unmeasured and curves:
        notes.append(f"never two tenants backlogged throughout a window: {_labels(unmeasured, several)}")
    ax.set_title("\n".join(notes), fontsize="medium")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time (s), middle of the window")
    ax.set_ylabel("most − least served backlogged tenant\n(service in the window)")
    ax.grid(alpha=0.3)
    return fig


_DRAWERS: dict[str, Callable[[Sequence[PolicyRun], bool], Figure]] = {
    "latency_cdf.png": _draw_latency_cdf,
    "ttft_cdf.png": _draw_ttft_cdf,
    "tpot_cdf.png": _draw_tpot_cdf,
    "queue_wait.png": _draw_queue_wait,
    "governor.png": _draw_governor,
    "gpu_busy.png": _draw_gpu_busy,
    "service.png": _draw_service,
    "service_difference.png": _draw_service_difference,
}


def build_figure(name: str, runs: Sequence[PolicyRun]) -> Figure:
    """The plot ``name`` (a key of :data:`PLOT_FILES`) of ``runs``, drawn but not saved.

    The suptitle says what the plot shows and on which workload(s). The figure is on
    matplotlib's Agg canvas, not pyplot's: the caller owns it, nothing else holds it, and
    ``fig.savefig(path)`` writes it. Raises KeyError for an unknown ``name``.
    """
    runs = list(runs)
    several = len({_workload_key(run) for run in runs}) > 1
    fig = _DRAWERS[name](runs, several)
    fig.suptitle(f"{PLOT_FILES[name]} — {_workloads_shown(runs)}")
    return fig


# -- the report -------------------------------------------------------------------------

def write_report(runs: Sequence[PolicyRun], out_dir: Path, *, title: str | None = None,
                 plots: bool = True) -> list[Path]:
    """Write ``summary.json``, ``report.md`` and (with ``plots``) the PNGs into ``out_dir``.

    ``out_dir`` is created if missing; existing files of the same names are
    overwritten. Runs on different workloads are grouped by workload in the
    Markdown; the plots hold one panel (or line) per run. Returns the paths written,
    in that order. Identical runs give byte-identical files.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = list(runs)
    summaries = [summarize(run) for run in runs]
    groups = _group(runs, summaries)
    title = title or "apsd simulate report"

    written = []
    summary_path = out_dir / "summary.json"
    summary_path.write_text(json.dumps({"title": title, "runs": summaries}, indent=2, sort_keys=True) + "\n",
                            encoding="utf-8")
    written.append(summary_path)

    plot_names = list(PLOT_FILES) if plots else []
    report_path = out_dir / "report.md"
    report_path.write_text(_markdown(title, summaries, groups, plot_names), encoding="utf-8")
    written.append(report_path)

    for name in plot_names:
        written.append(_save(build_figure(name, runs), out_dir / name))
    return written
