"""What every plot shares: figures on matplotlib's Agg canvas, titles, tenants' lines and styles.

Every figure names its workload in its suptitle, so a PNG seen alone says what it shows.
Panels that compare policies share their axes: a difference between two panels is a
difference in the runs, never in the scales. Where policies are drawn as lines on one
axes, policies whose curves are identical share one line whose label names them all, so
the legend never lists a line that another one hides.

matplotlib's Agg canvas is used directly (no pyplot, no global backend switch) and the PNGs
carry no ``Software`` metadata, so identical runs give identical PNGs. matplotlib is imported
only inside these functions, so ``import apsd.sim.report`` stays light.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from apsd.sim.records import PolicyRun, RequestRecord
from apsd.sim.report.runs import workload_key
from apsd.sim.report.timeline import Floats

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.typing import LegendLocType

MAX_TENANT_LINES = 8          # tenants drawn individually; the rest are merged as "other"
MAX_CURVE_POINTS = 1_000      # points per CDF / cumulative-service line
DPI = 100

_PALETTE = (0, 1, 2, 3, 4, 5, 6, 8, 9)  # tab10 without its grey, which would look like "other"
_STYLES = ("-", "--", ":", "-.")


def panels_figure(n_panels: int, width: float = 5.0, height: float = 3.6) -> tuple[Figure, list[Axes]]:
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


def single_figure(width: float, height: float, rows: int = 1) -> tuple[Figure, list[Axes]]:
    """A figure on matplotlib's Agg canvas with ``rows`` panels stacked on one shared time axis."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    axes: list[Axes] = []
    for i in range(rows):
        axes.append(fig.add_subplot(rows, 1, i + 1, sharex=axes[0] if axes else None))
    return fig, axes


def save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, metadata={"Software": None})
    fig.clear()  # not owned by pyplot, so nothing else holds it once this returns
    return path


def no_data(ax: Axes, what: str = "no data") -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="grey")


def run_title(run: PolicyRun, several_workloads: bool) -> str:
    return f"{run.label} — {run.workload.name}" if several_workloads else run.label


def workloads_shown(runs: Sequence[PolicyRun]) -> str:
    """What a figure's suptitle says about its workload(s)."""
    if not runs:
        return "no runs"
    keys = list(dict.fromkeys(workload_key(run) for run in runs))
    if len(keys) == 1:
        wl = runs[0].workload
        return f"workload {wl.name} ({len(wl.arrivals)} arrivals, seed {wl.seed})"
    names = list(dict.fromkeys(run.workload.name for run in runs))
    if len(names) < len(keys):  # one name with several seeds or parameters
        names = list(dict.fromkeys(f"{run.workload.name} (seed {run.workload.seed})" for run in runs))
    return "workloads " + ", ".join(names)


def labels(runs: Sequence[PolicyRun], several: bool) -> str:
    return ", ".join(run_title(run, several) for run in runs)


def _top_tenants(run: PolicyRun) -> tuple[list[str], set[str]]:
    """The tenants drawn individually (most requests first) and the ones merged as "other"."""
    sent = collections.Counter(r.tenant for r in run.requests)
    ranked = sorted(sent, key=lambda t: (-sent[t], t))
    return ranked[:MAX_TENANT_LINES], set(ranked[MAX_TENANT_LINES:])


def tenant_lines(run: PolicyRun, requests: Sequence[RequestRecord]) -> list[tuple[str, list[RequestRecord], Any]]:
    """``requests`` split into one (name, requests, colour) line per top tenant, plus "other"."""
    top, rest = _top_tenants(run)
    index = {t: i for i, t in enumerate(top)}
    split: list[list[RequestRecord]] = [[] for _ in range(len(top) + 1)]
    for r in requests:
        split[index.get(r.tenant, len(top))].append(r)
    lines = [(t, split[i], tenant_colour(i)) for i, t in enumerate(top)]
    if rest:
        lines.append((f"other ({len(rest)} tenants)", split[-1], "black"))
    return lines


def tenant_colour(i: int) -> Any:
    from matplotlib import colormaps
    return colormaps["tab10"](_PALETTE[i % len(_PALETTE)])


def line_style(i: int) -> dict[str, Any]:
    return {"color": tenant_colour(i), "linestyle": _STYLES[i % len(_STYLES)]}


#: The scalar type of an array (:func:`thin` keeps it).
Scalar = TypeVar("Scalar", bound=np.generic)


def thin(x: NDArray[Scalar], limit: int) -> NDArray[Scalar]:
    """At most ``limit`` evenly spaced elements of the sorted array ``x`` (ends kept)."""
    if x.size <= limit:
        return x
    return x[np.unique(np.linspace(0, x.size - 1, limit).round().astype(np.intp))]


Curve = tuple[list[PolicyRun], Floats, Floats]


def identical_curves(runs: Sequence[PolicyRun],
                     curve: Callable[[PolicyRun], tuple[Floats, Floats] | None]) -> list[Curve]:
    """Each distinct ``curve(run)`` (x, y; None: nothing to draw) with the runs that have it, in order."""
    curves: dict[tuple[bytes, bytes], Curve] = {}
    for run in runs:
        xy = curve(run)
        if xy is not None:
            curves.setdefault((xy[0].tobytes(), xy[1].tobytes()), ([], *xy))[0].append(run)
    return list(curves.values())


def draw_shared_lines(ax: Axes, curves: Sequence[Curve], several: bool, draw: Callable[..., Any],
                      legend: LegendLocType, missing: str) -> None:
    """``draw(x, y, label=..., **style)`` for each curve of :func:`identical_curves`, labelled with its
    runs, and a legend; ``missing`` when there is none."""
    for i, (group, x, y) in enumerate(curves):
        draw(x, y, label=labels(group, several), linewidth=1.2, **line_style(i))
    if curves:
        ax.legend(fontsize="x-small", loc=legend)
    else:
        no_data(ax, missing)
