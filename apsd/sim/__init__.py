"""The simulator: apsd's own pipeline in virtual time (``apsd simulate``, ``apsd research``).

* :mod:`apsd.sim.workloads` — built-in workload generators (parameters, arrival building blocks, the built-ins).
* :mod:`apsd.sim.traces` (a package) — trace files (apsd's own, Mooncake / Dynamo, Azure, BurstGPT) read
  as workloads, tenant rules, and a generated Mooncake-format trace.
* :mod:`apsd.sim.baselines` — other schedulers' rules the benchmark table compares with (least counter
  first, a requests-per-minute limit): the simulator's only, not the daemon's.
* :mod:`apsd.sim.records` — the plain values a simulation reads and produces (a
  :class:`~apsd.sim.records.PolicyRun` per policy and workload).
* :mod:`apsd.sim.runner` — one workload under one policy choice, through the daemon's
  admission, scheduler, policies and engines under a ``MockClock``.
* :mod:`apsd.sim.replicas` and :mod:`apsd.sim.profile` — replicas sharing a simulated store
  (``apsd simulate --replicas``), and one continuous engine profiled (``apsd profile``).
* :mod:`apsd.sim.report` (a package) — a run's figures as typed values
  (:class:`~apsd.sim.report.RunSummary`, from :func:`~apsd.sim.report.summarize`), their
  ``summary.json``, ``report.md`` and the plots.
* :mod:`apsd.sim.research` (a package) — the research suite behind ``docs/research.md``: what
  it runs, the design's claims and the thresholds of its verdicts, and the document's sections.
"""
