"""The plots of a report: :data:`PLOT_FILES` and :func:`build_figure`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from apsd.sim.records import PolicyRun
from apsd.sim.report.lines import draw_governor, draw_gpu_busy, draw_service_difference
from apsd.sim.report.panels import draw_latency_cdf, draw_queue_wait, draw_service, draw_tpot_cdf, draw_ttft_cdf
from apsd.sim.report.plotting import workloads_shown
from apsd.sim.report.runs import workload_key

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["PLOT_FILES", "build_figure"]

#: The plots :func:`~apsd.sim.report.write_report` draws, in order (file name -> what it shows).
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

_DRAWERS: dict[str, Callable[[Sequence[PolicyRun], bool], Figure]] = {
    "latency_cdf.png": draw_latency_cdf,
    "ttft_cdf.png": draw_ttft_cdf,
    "tpot_cdf.png": draw_tpot_cdf,
    "queue_wait.png": draw_queue_wait,
    "governor.png": draw_governor,
    "gpu_busy.png": draw_gpu_busy,
    "service.png": draw_service,
    "service_difference.png": draw_service_difference,
}


def build_figure(name: str, runs: Sequence[PolicyRun]) -> Figure:
    """The plot ``name`` (a key of :data:`PLOT_FILES`) of ``runs``, drawn but not saved.

    The suptitle says what the plot shows and on which workload(s). The figure is on
    matplotlib's Agg canvas, not pyplot's: the caller owns it, nothing else holds it, and
    ``fig.savefig(path)`` writes it. Raises KeyError for an unknown ``name``.
    """
    runs = list(runs)
    several = len({workload_key(run) for run in runs}) > 1
    fig = _DRAWERS[name](runs, several)
    fig.suptitle(f"{PLOT_FILES[name]} — {workloads_shown(runs)}")
    return fig
