"""Plots with one panel per run, all panels on shared axes: CDFs of request times, queue wait
against arrival time, cumulative service per tenant."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from apsd.sim.records import PolicyRun, RequestRecord
from apsd.sim.report.plotting import MAX_CURVE_POINTS, no_data, panels_figure, run_title, tenant_lines, thin
from apsd.sim.report.runs import completed, latencies, tpots, ttfts

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure
    from matplotlib.typing import LegendLocType

__all__ = ["draw_latency_cdf", "draw_queue_wait", "draw_service", "draw_tpot_cdf", "draw_ttft_cdf"]

_MAX_SCATTER_POINTS = 20_000   # per run in queue_wait.png (the slowest 1% are always kept)


def _draw_cdf(runs: Sequence[PolicyRun], several: bool, values: Callable[[Sequence[RequestRecord]], list[float]],
              xlabel: str, ylabel: str, scale: float = 1.0, missing: str = "no completed requests",
              legend: LegendLocType = "lower right") -> Figure:
    """One panel per run: the CDF of ``values(requests) * scale`` over its completed requests, a line per tenant."""
    fig, axes = panels_figure(len(runs))
    low, high = math.inf, 0.0
    for ax, run in zip(axes, runs):
        groups = tenant_lines(run, completed(run.requests))
        drawn = False
        for name, reqs, colour in groups:
            v = np.sort(np.asarray(values(reqs), dtype=float)) * scale
            if not v.size:
                continue
            idx = thin(np.arange(v.size), MAX_CURVE_POINTS)
            # The step starts at 0 at the fastest request, so even one request draws a line.
            x = np.concatenate(([v[0]], v[idx]))
            y = np.concatenate(([0.0], (idx + 1) / v.size))
            ax.step(x, y, where="post", color=colour, label=name, linewidth=1.2)
            low, high = min(low, float(v[0])), max(high, float(v[-1]))
            drawn = True
        if drawn:
            ax.legend(fontsize="x-small", loc=legend)
        else:
            no_data(ax, missing)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(run_title(run, several))
        ax.grid(alpha=0.3)
    if low > 0 and high / low > 20:  # log scale only when the values span decades (shared: every panel)
        axes[0].set_xscale("log")
    axes[0].set_ylim(0, 1.02)
    return fig


def draw_latency_cdf(runs: Sequence[PolicyRun], several: bool) -> Figure:
    return _draw_cdf(runs, several, latencies, "end-to-end latency (s)", "fraction of completed requests")


def draw_ttft_cdf(runs: Sequence[PolicyRun], several: bool) -> Figure:
    return _draw_cdf(runs, several, ttfts, "time to first token (s)", "fraction of completed requests")


def draw_tpot_cdf(runs: Sequence[PolicyRun], several: bool) -> Figure:
    return _draw_cdf(runs, several, tpots, "time per output token (ms)",
                     "fraction of completed requests (2+ tokens)", scale=1000.0,
                     missing="no completed request of 2+ tokens",
                     legend="upper left")  # most requests decode at the batch's pace: the curves climb late


def draw_queue_wait(runs: Sequence[PolicyRun], several: bool) -> Figure:
    fig, axes = panels_figure(len(runs))
    all_bids = [r.bid for run in runs for r in run.requests]
    vmin: float
    vmax: float
    vmin, vmax = (min(all_bids), max(all_bids)) if all_bids else (0, 1)
    if vmin == vmax:
        vmin, vmax = vmin - 0.5, vmax + 0.5
    mappable = None
    for ax, run in zip(axes, runs):
        done = [r for r in completed(run.requests) if r.dispatched_at is not None]
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
        title = run_title(run, several)
        if shown.size < at.size:
            title += f"\n({shown.size} of {at.size} requests shown, slowest 1% all kept)"
        if at.size:
            mappable = ax.scatter(at[shown], wait[shown], c=bid[shown], s=4 if shown.size > 2_000 else 14,
                                  cmap="viridis",
                                  vmin=vmin, vmax=vmax, linewidths=0, rasterized=False)
        else:
            no_data(ax, "no completed requests")
        ax.set_xlabel("arrival time (s)")
        ax.set_ylabel("queue wait (s)")
        ax.set_title(title, fontsize="medium")
        ax.grid(alpha=0.3)
    if mappable is not None:
        fig.colorbar(mappable, ax=axes, label="bid", shrink=0.9)
    return fig


def draw_service(runs: Sequence[PolicyRun], several: bool) -> Figure:
    fig, axes = panels_figure(len(runs))
    for ax, run in zip(axes, runs):
        done = [r for r in completed(run.requests) if r.finished_at is not None]
        groups = tenant_lines(run, done)
        end = max(run.duration_s, max((f for r in done if (f := r.finished_at) is not None), default=0.0))
        drawn = False
        for name, reqs, colour in groups:
            if not reqs:
                continue
            t = np.asarray([r.finished_at for r in reqs], dtype=float)
            order = np.argsort(t, kind="stable")
            t = t[order]
            cum = np.cumsum(np.asarray([r.output_tokens for r in reqs], dtype=float)[order])
            # Exact steps for small runs; the curve sampled on a fixed grid for large ones.
            if t.size > MAX_CURVE_POINTS:
                grid = np.linspace(0.0, end, MAX_CURVE_POINTS)
                k = np.searchsorted(t, grid, side="right")
                x, y = grid, np.where(k > 0, cum[np.maximum(k - 1, 0)], 0.0)
            else:
                x, y = np.concatenate(([0.0], t, [end])), np.concatenate(([0.0], cum, [cum[-1]]))
            ax.plot(x, y, drawstyle="steps-post", color=colour, label=name, linewidth=1.2)
            drawn = True
        if drawn:
            ax.legend(fontsize="x-small", loc="upper left")
        else:
            no_data(ax, "no completed requests")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("cumulative output tokens served")
        ax.set_title(run_title(run, several))
        ax.grid(alpha=0.3)
    return fig
