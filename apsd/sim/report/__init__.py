"""The report of ``apsd simulate``: numbers, Markdown and plots from :class:`~apsd.sim.records.PolicyRun`.

This package only reads runs; it never runs anything. Its modules, by concept:

* :mod:`~apsd.sim.report.summary` — the typed figures of a run (:class:`RunSummary` and the values it
  holds), their ``summary.json`` form, and the rounding that makes it byte-identical across runs.
* :mod:`~apsd.sim.report.measure` — :func:`summarize`: a run into a :class:`RunSummary`.
* :mod:`~apsd.sim.report.service` — the service difference between backlogged tenants (VTC's measure).
* :mod:`~apsd.sim.report.runs` and :mod:`~apsd.sim.report.timeline` — reading a run's records, and
  quantities accumulated over its model time (busy time, service).
* :mod:`~apsd.sim.report.tables` and :mod:`~apsd.sim.report.markdown` — Markdown tables and ``report.md``.
* :mod:`~apsd.sim.report.plotting`, :mod:`~apsd.sim.report.panels`, :mod:`~apsd.sim.report.lines` and
  :mod:`~apsd.sim.report.figures` — the plots of :data:`PLOT_FILES` (:func:`build_figure` draws one and
  hands the figure back unsaved).
* :mod:`~apsd.sim.report.files` — :func:`write_report`: ``summary.json``, ``report.md`` and the PNGs.

In ``report.md`` every duration is in seconds (three decimals) except the two that live at
millisecond scale, the batch window and the time per output token, which are in milliseconds;
every table column with a unit names it. (``summary.json`` keeps its ``_ms`` keys.) Every plot
names its workload in its suptitle; panels comparing policies share their axes; lines that would
coincide are drawn once, labelled with every policy they stand for.

The rules are not restated here: fairness is the daemon's Jain index
(:data:`apsd.core.ledger.FAIRNESS_DEFINITION`, :func:`apsd.core.ledger.jain_index`), and service is
charged with the fair-share policy's weights (:class:`apsd.policies.fair.ChargeWeights`).
matplotlib is imported only inside the plotting functions, so ``import apsd.sim.report`` stays light.
"""

from apsd.core.ledger import FAIRNESS_DEFINITION
from apsd.sim.report.figures import PLOT_FILES, build_figure
from apsd.sim.report.files import write_report
from apsd.sim.report.measure import summarize
from apsd.sim.report.service import (
                                     SERVICE_DIFFERENCE_DEFINITION,
                                     SERVICE_STEP_S,
                                     SERVICE_WEIGHTS,
                                     SERVICE_WINDOW_S,
                                     service_difference_over_time,
)
from apsd.sim.report.summary import (
                                     SIGNIFICANT_DIGITS,
                                     BatchSizes,
                                     EngineSummary,
                                     Fairness,
                                     GovernorSummary,
                                     LowestBidder,
                                     Outcomes,
                                     Overall,
                                     Percentiles,
                                     RunSummary,
                                     ServiceDifference,
                                     TenantSummary,
                                     TimeInState,
                                     WorkloadSummary,
                                     summary_json,
)
from apsd.sim.report.tables import describe_engine, format_summary_table

__all__ = [
    "FAIRNESS_DEFINITION",
    "PLOT_FILES",
    "SERVICE_DIFFERENCE_DEFINITION",
    "SERVICE_STEP_S",
    "SERVICE_WEIGHTS",
    "SERVICE_WINDOW_S",
    "SIGNIFICANT_DIGITS",
    "BatchSizes",
    "EngineSummary",
    "Fairness",
    "GovernorSummary",
    "LowestBidder",
    "Outcomes",
    "Overall",
    "Percentiles",
    "RunSummary",
    "ServiceDifference",
    "TenantSummary",
    "TimeInState",
    "WorkloadSummary",
    "build_figure",
    "describe_engine",
    "format_summary_table",
    "service_difference_over_time",
    "summarize",
    "summary_json",
    "write_report",
]
