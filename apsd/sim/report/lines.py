"""Plots with every run on one time axis, identical curves drawn once: the governor's entropy and
window, the engines' busy fraction, and the service difference between backlogged tenants."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from apsd.sim.records import PolicyRun
from apsd.sim.report.plotting import (
    MAX_CURVE_POINTS,
    draw_shared_lines,
    identical_curves,
    labels,
    line_style,
    no_data,
    single_figure,
    thin,
)
from apsd.sim.report.runs import engine_count, workload_key
from apsd.sim.report.service import SERVICE_STEP_S, SERVICE_WEIGHTS, SERVICE_WINDOW_S, service_difference_over_time
from apsd.sim.report.timeline import Floats, busy_cumulative

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["BUSY_BINS", "draw_governor", "draw_gpu_busy", "draw_service_difference"]

#: Bins of gpu_busy.png over each run.
BUSY_BINS = 100


def _measures_entropy(run: PolicyRun) -> bool:
    return any(s.entropy_bits is not None for s in run.samples)


def _entropy_groups(runs: Sequence[PolicyRun]) -> list[list[PolicyRun]]:
    """The runs whose governor reads entropy, grouped so that each group has one entropy curve.

    The simulator replays a run's admitted arrivals into a fresh governor (``runner._sample``),
    so the reading is a function of the governor, the workload and the admitted arrival times:
    runs alike in all three have the same curve, however their policies order the queue.
    """
    groups: dict[tuple[object, ...], list[PolicyRun]] = {}
    for run in runs:
        if _measures_entropy(run):
            admitted = tuple(r.arrival for r in run.requests if r.outcome != "rejected")
            key = (run.policy.get("governor"), workload_key(run), admitted)
            groups.setdefault(key, []).append(run)
    return list(groups.values())


def _window_groups(runs: Sequence[PolicyRun]) -> list[tuple[list[PolicyRun], float | None]]:
    """Runs grouped by identical batch windows: (runs, the constant window in s, or None if it varies)."""
    groups: dict[tuple[object, ...], tuple[list[PolicyRun], float | None]] = {}
    for run in runs:
        if not run.samples:
            continue
        w = np.asarray([s.window_s for s in run.samples], dtype=float)
        if (w == w[0]).all():
            key: tuple[object, ...] = ("constant", float(w[0]))
        else:
            key = ("varies", np.asarray([s.at for s in run.samples], dtype=float).tobytes(), w.tobytes())
        groups.setdefault(key, ([], float(w[0]) if key[0] == "constant" else None))[0].append(run)
    return list(groups.values())


def draw_governor(runs: Sequence[PolicyRun], several: bool) -> Figure:
    fig, (ax_h, ax_w) = single_figure(10, 6.4, rows=2)

    # Entropy: a property of the arrivals, drawn once per group of runs that read the same.
    entropy_groups = _entropy_groups(runs)
    for i, group in enumerate(entropy_groups):
        run = max(group, key=lambda r: r.duration_s)  # the same function of time: the longest covers all
        t = np.asarray([s.at for s in run.samples], dtype=float)
        h = np.asarray([np.nan if s.entropy_bits is None else s.entropy_bits for s in run.samples], dtype=float)
        ax_h.plot(t, h, linewidth=1.0, label=labels(group, several), **line_style(i))
    measured = [run for group in entropy_groups for run in group]
    unmeasured = [run for run in runs if not any(run is m for m in measured)]
    if len(entropy_groups) == 1:
        title = "entropy of inter-arrival gaps: a property of the arrivals"
        if len(measured) > 1:
            title += f", the same for {labels(measured, several)} (drawn once)"
    else:
        title = "entropy of inter-arrival gaps, as each entropy-reading governor sees the arrivals"
    if unmeasured:
        by_governor: dict[str, list[PolicyRun]] = {}
        for run in unmeasured:
            by_governor.setdefault(str(run.policy.get("governor", "?")), []).append(run)
        title += "\nnot read by " + "; ".join(f"{labels(group, several)} (governor {name})"
                                              for name, group in by_governor.items())
    ax_h.set_title(title, fontsize="medium")

    # Window: each policy's, policies with identical windows on one line.
    window_groups = _window_groups(runs)
    for i, (group, constant) in enumerate(window_groups):
        label = labels(group, several)
        if constant is not None:
            end = max(max(s.at for s in run.samples) for run in group)
            t, w = np.asarray([0.0, end]), np.asarray([constant, constant]) * 1000.0
            label += f" (constant {constant * 1000:g} ms)"
        else:
            t = np.asarray([s.at for s in group[0].samples], dtype=float)
            w = np.asarray([s.window_s for s in group[0].samples], dtype=float) * 1000.0
        ax_w.plot(t, w, drawstyle="steps-post", linewidth=1.2, label=label, **line_style(i))
    ax_w.set_title("batch window of each policy (identical windows share a line)", fontsize="medium")

    for ax, groups, what in ((ax_h, entropy_groups, "no policy's governor reads entropy"),
                             (ax_w, window_groups, "no governor samples")):
        if groups:
            ax.legend(fontsize="x-small", loc="best")  # lines go anywhere: let matplotlib find room
        else:
            no_data(ax, what)
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


def _busy_fraction(run: PolicyRun) -> tuple[Floats, Floats] | None:
    """The edges of :data:`BUSY_BINS` bins over the run, and the engines' busy fraction in each."""
    if run.duration_s <= 0 or not engine_count(run):
        return None
    edges = np.linspace(0.0, run.duration_s, BUSY_BINS + 1)
    width = edges[1] - edges[0]
    return edges, np.diff(busy_cumulative(run, edges)) / (engine_count(run) * width)


def _busy_without_batches(run: PolicyRun) -> bool:
    """Whether the run's busy curve comes from its requests, not from fixed batches (see
    :func:`~apsd.sim.report.timeline.busy_spans`)."""
    return not run.batches and any(r.dispatched_at is not None for r in run.requests)


def draw_gpu_busy(runs: Sequence[PolicyRun], several: bool) -> Figure:
    fig, (ax,) = single_figure(10, 4)
    curves = identical_curves(runs, _busy_fraction)
    draw_shared_lines(ax, curves, several, lambda edges, frac, **style: ax.stairs(frac, edges, **style),
                      legend="lower right", missing="no data")
    notes = []
    if any(len(group) > 1 for group, _, _ in curves):
        notes.append("one line per policy; policies with identical curves share a line")
    if any(_busy_without_batches(run) for run in runs):
        notes.append("an engine without batches (continuous) is busy while any sequence is in it")
    if notes:
        ax.set_title("\n".join(notes), fontsize="medium")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"GPU busy fraction ({BUSY_BINS} bins per run)")
    ax.grid(alpha=0.3)
    return fig


def _service_difference_curve(run: PolicyRun) -> tuple[Floats, Floats] | None:
    """Each window's middle and service difference (thinned for long runs); None without any."""
    starts, difference = service_difference_over_time(run)
    if np.isnan(difference).all():
        return None
    shown = thin(np.arange(starts.size), MAX_CURVE_POINTS * 4)
    return starts[shown] + SERVICE_WINDOW_S / 2, difference[shown]


def draw_service_difference(runs: Sequence[PolicyRun], several: bool) -> Figure:
    """One line per policy (identical ones shared) of each window's service difference, at the
    window's middle; gaps where fewer than two tenants were backlogged throughout a window."""
    fig, (ax,) = single_figure(10, 4)
    curves = identical_curves(runs, _service_difference_curve)
    draw_shared_lines(ax, curves, several, ax.plot, legend="best",
                      missing=f"no {SERVICE_WINDOW_S:g} s window with two tenants backlogged throughout")
    unmeasured = [run for run in runs if not any(run is r for group, _, _ in curves for r in group)]
    notes = [f"{SERVICE_WINDOW_S:g} s windows, one every {SERVICE_STEP_S:g} s; service = "
             f"{SERVICE_WEIGHTS.input_weight:g}·prompt + {SERVICE_WEIGHTS.output_weight:g}·output tokens; policies "
             "with identical curves share a line"]
    if unmeasured and curves:
        notes.append(f"never two tenants backlogged throughout a window: {labels(unmeasured, several)}")
    ax.set_title("\n".join(notes), fontsize="medium")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("time (s), middle of the window")
    ax.set_ylabel("most − least served backlogged tenant\n(service in the window)")
    ax.grid(alpha=0.3)
    return fig
