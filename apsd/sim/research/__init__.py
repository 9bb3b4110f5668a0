"""The research report: the design's workloads and tenant isolation under each policy, on two engines.

:func:`write_research` runs :data:`POLICIES`, then the presets of the installed plugins
(:func:`plugin_presets`), on every workload of :data:`WORKLOADS` with :mod:`apsd.sim.runner`, twice:
on the ``batch`` engine (a simulated GPU whose defaults approximate an A100, the default
configuration) and on the ``continuous`` engine described by :data:`CONTINUOUS_ENGINE`; then, on the
continuous engine only, the scaled variants of :data:`SCALED`. The tenant-isolation workloads of
:data:`ISOLATION_WORKLOADS` run on the batch engine with their defaults and on the continuous engine
as :data:`ISOLATION_SCALED`; :data:`NOISY` also runs without its neighbour (:data:`ALONE`) for
research.md only. It writes each comparison with :func:`apsd.sim.report.write_report` (paths in
:func:`report_dir`) and ``<out>/research.md``: which policies ran and which plugins they came from,
which of the design's claims hold on the batch engine, which conclusions change on the continuous
engine, how well each policy isolates tenants (a noisy neighbour's effect on a steady tenant, and
the service difference between backlogged tenants of :mod:`apsd.sim.report`), the comparison
tables, and plots. Every figure and every verdict in it is computed from the runs: regenerate with
``apsd research``.

Modules, by concept:

* :mod:`~apsd.sim.research.suite` — what runs: policies, workloads, engines, report directories.
* :mod:`~apsd.sim.research.run` — :func:`write_research` and :func:`open_report_writer`.
* :mod:`~apsd.sim.research.measured` — what research.md is computed from (:class:`Measured`).
* :mod:`~apsd.sim.research.claims` — the design's claims and the thresholds of every verdict.
* Studies with a page of their own under ``research/``: :mod:`~apsd.sim.research.classes`
  (``--classes``), :mod:`~apsd.sim.research.routing` and :mod:`~apsd.sim.research.trace_routing`
  (``--routing``), :mod:`~apsd.sim.research.grid` (``--grid``), and the benchmark table
  (``--table``): :mod:`~apsd.sim.research.table_suite` (its rows and workloads),
  :mod:`~apsd.sim.research.table` (running and measuring) and :mod:`~apsd.sim.research.table_page`.
* :mod:`~apsd.sim.research.design`, :mod:`~apsd.sim.research.continuous`,
  :mod:`~apsd.sim.research.isolation` and :mod:`~apsd.sim.research.document` — research.md's sections,
  and the document; :mod:`~apsd.sim.research.prose` formats their figures.

Plugins: by default the plugin manager is the daemon's (:func:`~apsd.plugins.make_plugin_manager`:
built-ins plus installed ``apsd`` entry points, filtered by ``APSD_PLUGINS``), so the
report covers what an operator could run. The same seed and the same installed plugins
(names and versions, which ``research.md`` lists) give the same bytes.
"""

from apsd.sim.research.claims import (
                                      CLAIMED_COST_PER_1M_TOKENS_USD,
                                      CLAIMED_GPU_UTILIZATION,
                                      CLAIMED_JAIN,
                                      CLAIMED_JAIN_ELSEWHERE,
)
from apsd.sim.research.measured import Comparison, Measured, OverloadService, ServedByThen
from apsd.sim.research.run import MAX_REPORT_WORKERS, open_report_writer, write_research
from apsd.sim.research.suite import (
                                      ALONE,
                                      CONTINUOUS_ENGINE,
                                      GOVERNOR_WORKLOADS,
                                      ISOLATION_SCALED,
                                      ISOLATION_WORKLOADS,
                                      NOISY,
                                      POLICIES,
                                      SCALED,
                                      WORKLOADS,
                                      ZERO_WINDOW,
                                      ScaledWorkload,
                                      engine_configs,
                                      plugin_presets,
                                      report_dir,
)

__all__ = ["ALONE", "CLAIMED_COST_PER_1M_TOKENS_USD", "CLAIMED_GPU_UTILIZATION", "CLAIMED_JAIN",
           "CLAIMED_JAIN_ELSEWHERE", "CONTINUOUS_ENGINE", "GOVERNOR_WORKLOADS", "ISOLATION_SCALED",
           "ISOLATION_WORKLOADS", "MAX_REPORT_WORKERS", "NOISY", "POLICIES", "SCALED", "WORKLOADS", "ZERO_WINDOW",
           "Comparison", "Measured", "OverloadService", "ScaledWorkload", "ServedByThen", "engine_configs",
           "open_report_writer", "plugin_presets", "report_dir", "write_research"]
