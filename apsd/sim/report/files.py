"""The files of a report: :func:`write_report`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from apsd.sim.records import PolicyRun
from apsd.sim.report.figures import PLOT_FILES, build_figure
from apsd.sim.report.markdown import report_markdown
from apsd.sim.report.measure import summarize
from apsd.sim.report.plotting import save
from apsd.sim.report.runs import workload_key
from apsd.sim.report.summary import RunSummary, summary_json

__all__ = ["write_report"]


def _by_workload(runs: Sequence[PolicyRun], summaries: Sequence[RunSummary]) -> list[list[RunSummary]]:
    """The summaries grouped by workload, in the order each workload first appears."""
    groups: dict[tuple[str, int, str, int], list[RunSummary]] = {}
    for run, summary in zip(runs, summaries):
        groups.setdefault(workload_key(run), []).append(summary)
    return list(groups.values())


def write_report(runs: Sequence[PolicyRun], out_dir: Path, *, title: str | None = None,
                 plots: bool = True, alone: Sequence[Mapping[str, PolicyRun] | None] | None = None) -> list[Path]:
    """Write ``summary.json``, ``report.md`` and (with ``plots``) the PNGs into ``out_dir``.

    ``out_dir`` is created if missing; existing files of the same names are
    overwritten. Runs on different workloads are grouped by workload in the
    Markdown; the plots hold one panel (or line) per run. ``alone``, one entry per run (its
    tenants' runs alone, :func:`apsd.sim.alone.alone_runs`), adds the isolation table that leads each
    workload's section. Returns the paths written, in that order. Identical runs give
    byte-identical files.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = list(runs)
    summaries = [summarize(run, solo) for run, solo in zip(runs, alone or [None] * len(runs))]
    title = title or "apsd simulate report"

    summary_path = out_dir / "summary.json"
    summary_path.write_text(summary_json(title, summaries), encoding="utf-8")
    written = [summary_path]

    plot_names = list(PLOT_FILES) if plots else []
    report_path = out_dir / "report.md"
    report_path.write_text(report_markdown(title, _by_workload(runs, summaries),
                                           {name: PLOT_FILES[name] for name in plot_names}), encoding="utf-8")
    written.append(report_path)

    for name in plot_names:
        written.append(save(build_figure(name, runs), out_dir / name))
    return written
