"""Running the benchmark table (``apsd research --table``): every row on every workload, and the figures
of each cell (:class:`Cell`), measured from the runs' records in model time.

A cell's figures:

* ``max_service_difference``: the largest service difference between backlogged tenants over time (VTC's
  definition, :mod:`apsd.sim.report.service`: weighted service in 10 s windows);
* ``jain``: Jain's index of the weighted service of the tenants backlogged throughout each window, averaged
  over the windows (:func:`apsd.sim.report.service.weighted_service_jain`);
* per tenant, p50 and p99 time to first token beside the others and alone (its own arrivals, nobody
  else's, under the same row);
* per service class, attainment (met / requests, :mod:`apsd.sim.report.classes`), measured against the
  workload's classes whether or not the row configures them;
* ``qoe``: Andes' streaming quality of experience, the mean over every request sent
  (:mod:`apsd.sim.report.qoe`);
* ``throughput``: output tokens per model second to the last outcome; ``shed``: the share of requests
  that were not served (refused at the door or by admission, timed out, refused at a deadline).

Rows whose configuration is the same on a workload (one engine: routing cannot differ; no classes:
``fair + classes`` is ``fair``) share one run; the cell says which (``same_as``).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

import attrs
import numpy as np
import pluggy

from apsd.core.config import Config
from apsd.core.version import VERSION
from apsd.sim.alone import tenant_alone
from apsd.sim.baselines import RequestsPerMinute, baseline_plugin_manager, fair_rpm_limits
from apsd.sim.records import PolicyRun, RequestRecord, Workload
from apsd.sim.replicas import run_replicas
from apsd.sim.report.classes import class_attainment
from apsd.sim.report.qoe import mean_qoe
from apsd.sim.report.service import backlogged_service_shares, summarize_service_difference, weighted_service_jain
from apsd.sim.research.table_suite import ROWS, WORKLOADS, TableRow, TableWorkload
from apsd.sim.runner import parse_policy_choice, run_policy

__all__ = ["Cell", "TableResult", "TenantTimes", "WorkloadResult", "run_table", "versions"]

#: A tenant is backlogged while a request of its waits for its first token, in apsd's queue or in an engine
#: (an engine of 256 sequences holds most of the waiting: :func:`apsd.sim.report.service.service_difference_over_time`).
BACKLOGGED = "first_token"
#: The store's exchange period for the replicas' workload (the default ``[store] sync_interval_s``).
SYNC_INTERVAL_S = 0.05
#: The longest exchange period (``[store] sync_interval_s`` at its maximum), longer than the replicas'
#: run: they exchange once, at the start, and share nothing of what they serve.
UNSHARED_SYNC_S = 60.0


@attrs.frozen
class TenantTimes:
    """One tenant's time to first token beside the others and alone, milliseconds (None: none completed)."""

    tenant: str
    p50_ms: float | None
    p99_ms: float | None
    alone_p50_ms: float | None
    alone_p99_ms: float | None


@attrs.frozen
class Cell:
    """One row on one workload (the module docstring)."""

    row: str
    max_service_difference: float | None
    jain: float | None
    tenants: tuple[TenantTimes, ...]
    #: Class -> attainment (empty: the workload has no classes).
    attainment: dict[str, float | None]
    qoe: float | None
    throughput: float | None
    shed: float
    #: Tenant -> its share of the service while every tenant was backlogged
    #: (:func:`apsd.sim.report.service.backlogged_service_shares`; empty: they never all were).
    service_share: dict[str, float]
    #: Tenant -> output tokens it was served by the last arrival (while the offered load lasted).
    served: dict[str, int] = attrs.field(factory=dict)
    #: The row whose run this cell repeats (None: a run of its own).
    same_as: str | None = None


@attrs.frozen
class WorkloadResult:
    name: str
    description: str
    arrivals: int
    engines: int
    model: str
    replicas: int
    cells: tuple[Cell, ...]
    #: Replicas only: ``fair`` with each replica on its own (no shared store): tenant -> tokens served by
    #: the last arrival (empty: one apsd).
    fair_unshared: dict[str, int] = attrs.field(factory=dict)

    def cell(self, row: str) -> Cell:
        return next(c for c in self.cells if c.row == row)


@attrs.frozen
class TableResult:
    seed: int
    gpu: str
    workloads: tuple[WorkloadResult, ...]

    def workload(self, name: str) -> WorkloadResult:
        return next(w for w in self.workloads if w.name == name)


def versions() -> dict[str, str]:
    """The versions the table depends on: apsd, Python, numpy, trio."""
    out = {"apsd": VERSION, "Python": platform.python_version()}
    for name in ("numpy", "trio"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:  # pragma: no cover (both are dependencies)
            out[name] = "not installed"
    return out


def _without_classes(workload: Workload) -> Workload:
    return attrs.evolve(workload, arrivals=tuple(attrs.evolve(a, service_class=None) for a in workload.arrivals),
                        tenants={n: attrs.evolve(t, classes=()) for n, t in workload.tenants.items()})


def _config(base: Config, spec: TableWorkload, row: TableRow) -> Config:
    engine = attrs.evolve(base.engine, kind="continuous", count=spec.engines, model=spec.model, prefix_cache=True)
    return attrs.evolve(base, engine=engine, routing=attrs.evolve(base.routing, policy=row.routing),
                        classes=dict(spec.classes) if row.classes else {})


def _key(spec: TableWorkload, row: TableRow) -> tuple[object, ...]:
    """What makes two rows' runs differ on ``spec``."""
    return (row.preset, row.routing if spec.engines > 1 else None, row.rpm_limit,
            row.classes if spec.classes else False)


def _run(workload: Workload, spec: TableWorkload, row: TableRow, base: Config, limits: dict[str, int] | None,
         pm: pluggy.PluginManager, sync_interval_s: float = SYNC_INTERVAL_S) -> PolicyRun:
    config = _config(base, spec, row)
    if not (row.classes and spec.classes):
        workload = _without_classes(workload)
    door = RequestsPerMinute(limits) if row.rpm_limit and limits is not None else None
    choice = parse_policy_choice(row.preset)
    if spec.placement is None:
        return run_policy(workload, choice, base_config=config, plugin_manager=pm, door=door)
    replicas = len(next(iter(spec.placement.values())))
    result = run_replicas(workload, choice, replicas=replicas, sync_interval_s=sync_interval_s, base_config=config,
                          placement=spec.placement, plugin_manager=pm, door=door)
    return PolicyRun(label=row.label, policy={"preset": row.preset}, workload=workload, requests=result.requests,
                     batches=(), samples=(), sample_interval_s=1.0, duration_s=result.finished_s,
                     gpus=replicas * spec.engines, tenant_rates={}, classes=dict(config.classes))


def _ttft(records: Sequence[RequestRecord]) -> tuple[float | None, float | None]:
    values = [ttft for r in records if r.outcome == "completed" and (ttft := r.ttft) is not None]
    if not values:
        return None, None
    p50, p99 = np.percentile(np.array(values) * 1000.0, (50, 99))
    return float(p50), float(p99)


def _cell(row: TableRow, run: PolicyRun, alone: dict[str, PolicyRun], spec: TableWorkload,
          labels: list[str | None]) -> Cell:
    tenants = []
    for tenant in sorted(run.workload.tenants):
        mine = [r for r in run.requests if r.tenant == tenant]
        p50, p99 = _ttft(mine)
        a50, a99 = _ttft(alone[tenant].requests) if tenant in alone else (None, None)
        tenants.append(TenantTimes(tenant, p50, p99, a50, a99))
    done = [r for r in run.requests if r.outcome == "completed"]
    attainment = {c.name: c.attainment for c in class_attainment(run, spec.classes, labels)} if spec.classes else {}
    return Cell(row=row.label, max_service_difference=summarize_service_difference(run, BACKLOGGED).max,
                jain=weighted_service_jain(run, BACKLOGGED), tenants=tuple(tenants), attainment=attainment,
                qoe=mean_qoe(run.requests),
                throughput=sum(r.output_tokens for r in done) / run.duration_s if run.duration_s else None,
                shed=1.0 - len(done) / len(run.requests) if run.requests else 0.0,
                service_share=backlogged_service_shares(run, BACKLOGGED), served=_served(run))


def _served(run: PolicyRun) -> dict[str, int]:
    """Tenant -> output tokens of its requests finished by the last arrival."""
    last = max((r.arrival for r in run.requests), default=0.0)
    served = {tenant: 0 for tenant in sorted(run.workload.tenants)}
    for r in run.requests:
        if r.outcome == "completed" and r.finished_at is not None and r.finished_at <= last:
            served[r.tenant] = served.get(r.tenant, 0) + r.output_tokens
    return served


def run_workload(spec: TableWorkload, base: Config, seed: int, rows: Sequence[TableRow] = ROWS,
                 progress: Callable[[str], None] | None = None) -> WorkloadResult:
    """Every row of ``rows`` on ``spec`` (FCFS first: the RPM limit is set from its throughput)."""
    pm = baseline_plugin_manager()
    workload = spec.build(seed)
    labels = [a.service_class for a in workload.arrivals]
    done: dict[tuple[object, ...], Cell] = {}
    cells = []
    limits: dict[str, int] | None = None
    for row in rows:
        key = _key(spec, row)
        if key in done:
            cells.append(attrs.evolve(done[key], row=row.label, same_as=done[key].row))
            continue
        if progress is not None:
            progress(f"{spec.name}: {row.label}")
        run = _run(workload, spec, row, base, limits, pm)
        if row.preset == "fifo" and not row.rpm_limit:
            completed = sum(1 for r in run.requests if r.outcome == "completed")
            limits = fair_rpm_limits(workload.tenants, completed / run.duration_s if run.duration_s else 1.0)
        alone = {tenant: _run(tenant_alone(workload, tenant), spec, row, base, limits, pm)
                 for tenant in sorted(workload.tenants)} if len(workload.tenants) > 1 else {}
        cell = _cell(row, run, alone, spec, labels)
        done[key] = cell
        cells.append(cell)
    unshared: dict[str, int] = {}
    if spec.placement is not None:
        fair = next(r for r in rows if r.preset == "fair" and not r.classes and r.routing == "least-loaded")
        if progress is not None:
            progress(f"{spec.name}: {fair.label}, replicas not sharing")
        unshared = _served(_run(workload, spec, fair, base, limits, pm, sync_interval_s=UNSHARED_SYNC_S))
    return WorkloadResult(name=spec.name, description=spec.description, arrivals=len(workload.arrivals),
                          engines=spec.engines, model=spec.model,
                          replicas=len(next(iter(spec.placement.values()))) if spec.placement else 1,
                          cells=tuple(cells), fair_unshared=unshared)


def run_table(base: Config | None = None, *, seed: int = 1, workloads: Sequence[TableWorkload] = WORKLOADS,
              rows: Sequence[TableRow] = ROWS, progress: Callable[[str], None] | None = None) -> TableResult:
    """The whole table (see the module docstring); ``base`` gives everything but the engines, routing and
    classes each workload and row set (default: the shipped configuration)."""
    base = base or Config()
    return TableResult(seed=seed, gpu=base.engine.gpu,
                       workloads=tuple(run_workload(spec, base, seed, rows, progress) for spec in workloads))
