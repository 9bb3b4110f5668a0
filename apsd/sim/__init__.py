"""The simulator: apsd's own pipeline in virtual time (``apsd simulate``, ``apsd research``).

* :mod:`apsd.sim.workloads` — built-in workload generators and the trace loader.
* :mod:`apsd.sim.records` — the plain values a simulation reads and produces.
* :mod:`apsd.sim.runner` — one workload under one policy choice, through the daemon's
  admission, scheduler, policies and engines under a ``MockClock``.
* :mod:`apsd.sim.report` — summaries, ``summary.json``, ``report.md`` and plots.
* :mod:`apsd.sim.research` — the research suite behind ``docs/research.md``.
"""
