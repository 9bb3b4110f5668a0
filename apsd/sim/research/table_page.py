"""``docs/research/benchmark.md``: the benchmark table's page (``apsd research --table``).

:func:`benchmark_document` writes it from a :class:`~apsd.sim.research.table.TableResult`: how it was made
(the command, the seed, the versions, the definitions' fingerprint), what each row and column is, an
overview across workloads, then one section per workload (:func:`workload_section`).

:func:`definition_fingerprint` digests everything the table is defined by: its rows, each workload's
description, engines, classes, placement and very arrivals, and the constants of its metrics. The test
that keeps the page current (``tests/sim/test_table.py``) recomputes it, and reruns one workload whose
section must come out byte for byte the same: the whole table takes minutes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import attrs
import numpy as np

from apsd.sim.report.qoe import EXPECTED_TDS, EXPECTED_TTFT_S, QOE_DEFINITION
from apsd.sim.report.service import SERVICE_STEP_S, SERVICE_WEIGHTS, SERVICE_WINDOW_S
from apsd.sim.research.table import BACKLOGGED, SYNC_INTERVAL_S, Cell, TableResult, WorkloadResult
from apsd.sim.research.table_suite import ROWS, WORKLOADS, TableRow, TableWorkload

__all__ = ["benchmark_document", "definition_fingerprint", "workload_section"]


def definition_fingerprint(seed: int, rows: Sequence[TableRow] = ROWS,
                           workloads: Sequence[TableWorkload] = WORKLOADS) -> str:
    """A digest of what the table is defined by (the module docstring): 16 hexadecimal digits."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(repr((seed, [attrs.astuple(r) for r in rows], EXPECTED_TTFT_S, EXPECTED_TDS, SERVICE_WINDOW_S,
                        SERVICE_STEP_S, attrs.astuple(SERVICE_WEIGHTS), BACKLOGGED, SYNC_INTERVAL_S)).encode())
    for spec in workloads:
        digest.update(repr((spec.name, spec.description, spec.engines, spec.model,
                            sorted((k, attrs.astuple(v)) for k, v in spec.classes.items()),
                            sorted((spec.placement or {}).items()))).encode())
        workload = spec.build(seed)
        digest.update(repr(sorted((k, attrs.astuple(v)) for k, v in workload.tenants.items())).encode())
        for a in workload.arrivals:
            digest.update(repr((a.at, a.tenant, a.prompt_tokens, a.output_tokens, a.bid, a.service_class,
                                a.prefix_block_tokens)).encode())
            if a.prefix_blocks:
                digest.update(np.asarray(a.prefix_blocks, dtype=np.uint64).tobytes())
    return digest.hexdigest()


def _num(x: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x * scale:{spec}}{suffix}"


def _seconds(ms: float | None) -> str:
    return _num(ms, ".2f", 1e-3)


def _cell_row(cell: Cell, classes: Sequence[str]) -> str:
    label = f"{cell.row}" + (f" (= {cell.same_as})" if cell.same_as else "")
    attainment = ", ".join(f"`{name}` {_num(cell.attainment.get(name), '.0%')}" for name in classes) or "—"
    return (f"| {label} | {_num(cell.max_service_difference, ',.0f')} | {_num(cell.jain, '.3f')} | {attainment} "
            f"| {_num(cell.qoe, '.3f')} | {_num(cell.throughput, ',.0f')} | {_num(cell.shed, '.1%')} |")


def _tenant_rows(w: WorkloadResult) -> list[str]:
    tenants = [t.tenant for t in w.cells[0].tenants]
    lines = ["| row | " + " | ".join(f"`{t}` beside (alone)" for t in tenants) + " |",
             "|---|" + "---:|" * len(tenants)]
    for cell in w.cells:
        if cell.same_as:
            continue
        cells = [f"{_seconds(t.p50_ms)} / {_seconds(t.p99_ms)} ({_seconds(t.alone_p50_ms)} / "
                 f"{_seconds(t.alone_p99_ms)})" for t in cell.tenants]
        lines.append(f"| {cell.row} | " + " | ".join(cells) + " |")
    return lines


def _ratio(served: dict[str, int]) -> str:
    values = list(served.values())
    if len(values) != 2 or not values[1]:
        return "—"
    return f"{values[0] / values[1]:.2f}:1"


def workload_section(w: WorkloadResult) -> str:
    """One workload's section: its set-up, the table of its rows, and its tenants' times."""
    classes = sorted(w.cells[0].attainment)
    engines = f"{w.engines} continuous engine{'s' if w.engines > 1 else ''} ({w.model})"
    if w.replicas > 1:
        engines = f"{w.replicas} apsd replicas sharing a store (exchanges every {SYNC_INTERVAL_S:g} s), each with {engines}"
    lines = [f"### `{w.name}`", "", f"{w.description}. {w.arrivals:,} arrivals; {engines}.", "",
             "| row | max service difference | Jain (weighted service) | class attainment | QoE | throughput (tok/s) "
             "| shed |", "|---|---:|---:|---|---:|---:|---:|"]
    lines += [_cell_row(cell, classes) for cell in w.cells]
    lines += ["", "Time to first token, p50 / p99 in seconds, beside the others (and alone: the tenant's own arrivals "
              "with nobody else's, under the same row):", ""]
    lines += _tenant_rows(w)
    if w.replicas > 1:
        names = list(w.cells[0].served)
        lines += ["", f"Output tokens served by the last arrival, `{names[0]}`:`{names[1]}` (weights 4:1): "
                  + ", ".join(f"{cell.row} {_ratio(cell.served)}" for cell in w.cells if not cell.same_as)
                  + f"; `fair` with each replica on its own (no shared store) {_ratio(w.fair_unshared)}.",
                  "", "Why `fair` does not reach 4:1 here, shared store or not: each replica's continuous engine "
                  "isolates tenants by their weighted share of *its own* sequences. The second replica sees "
                  f"`{names[0]}` below its share there (it sends only a tenth of its traffic there) and serves all "
                  f"of it; the first keeps a fifth of its engine for `{names[1]}`, however much `{names[1]}` was "
                  "served on the second. The counters the store shares order each replica's queue, but the engines "
                  "let a tenant below its local share pass the queue. Beyond that, no scheduler could give "
                  f"`{names[0]}` more than the first replica's whole engine and everything it sends to the second: "
                  "with this placement 4:1 is out of reach (about 2:1 at most)."]
    return "\n".join(lines) + "\n"


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _overview(result: TableResult) -> list[str]:
    lines = ["| row | mean QoE | mean Jain | largest max service difference | tight-class attainment "
             "(`interactive-batch`) | mean shed |", "|---|---:|---:|---:|---:|---:|"]
    for row in ROWS:
        cells = [w.cell(row.label) for w in result.workloads]
        differences = [c.max_service_difference for c in cells if c.max_service_difference is not None]
        tight = next((c.attainment.get("interactive") for w, c in zip(result.workloads, cells)
                      if w.name == "interactive-batch"), None)
        lines.append(f"| {row.label} | {_num(_mean([c.qoe for c in cells]), '.3f')} "
                     f"| {_num(_mean([c.jain for c in cells]), '.3f')} "
                     f"| {_num(max(differences) if differences else None, ',.0f')} | {_num(tight, '.0%')} "
                     f"| {_num(_mean([c.shed for c in cells]), '.1%')} |")
    return lines


def benchmark_document(result: TableResult, versions: dict[str, str], fingerprint: str) -> str:
    """The page (see the module docstring)."""
    w = SERVICE_WEIGHTS
    parts = [
        "# How multi-tenant schedulers compare: the benchmark table", "",
        f"Generated by `apsd research --table --seed {result.seed}` (virtual time: apsd's own admission, "
        "scheduler, policies and simulated engines, the roofline model of the continuous engine on "
        f"{result.gpu}; the figures are the simulator's, not a real GPU's). Versions: "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
        + f". Definition fingerprint `{fingerprint}` (its rows, workloads, arrivals and metrics: "
        "`tests/sim/test_table.py` recomputes it and reruns one workload, so the page cannot fall behind "
        "its definition unnoticed). Nothing here is a published trace: the trace-shaped workload is generated "
        "in Mooncake's format (`apsd.sim.traces.synthetic`), because the published traces cannot be "
        "downloaded where apsd is built.", "",
        "## Rows", "",
        "- **FCFS**: first come first served (`fifo`), what most servers and gateways do.",
        "- **static priority**: the highest bid first (`static`).",
        "- **RPM limit (LiteLLM-style, baseline)**: FCFS behind a per-tenant requests-per-minute limit "
        "(fixed one-minute windows), each tenant's limit its share by weight of the requests the engines "
        "complete per minute under FCFS on the same workload; what LiteLLM's proxy offers as `rpm_limit`. "
        "A baseline implemented in the simulator only (`apsd.sim.baselines`), not a policy of apsd.",
        "- **LCF (VTC's baseline)**: least counter first, fair share's counters without the lift of a "
        "tenant that comes back from idle (it banks credit while idle). Also a simulator-only baseline.",
        "- **fair (VTC)**: apsd's default, the Virtual Token Counter's fair share between tenants (weighted).",
        "- **fair + prefix routing**: the same, routing between several engines by cached prefix "
        "(`[routing] policy = \"prefix\"`; every other row routes `least-loaded`).",
        "- **fair + classes**: the same with the workload's service classes configured (every other row runs "
        "the same arrivals without classes and is measured against the classes they would have had).", "",
        "A row whose run is the same as another's on a workload (one engine: routing cannot differ; no "
        "classes) says so, `(= fair (VTC))`, and repeats its figures.", "",
        "## Columns", "",
        f"- **max service difference**: VTC's measure: in each {SERVICE_WINDOW_S:g} s window (one every "
        f"{SERVICE_STEP_S:g} s), the weighted service (tokens × {w.input_weight:g} in, {w.output_weight:g} out, "
        "over the tenant's weight) received by the most served tenant minus the least served, among the tenants "
        "backlogged throughout it; the largest over the run. Here a tenant is backlogged while a request of its "
        "waits for its first token, in apsd's queue or inside an engine (an engine of 256 sequences holds most "
        "of the waiting). —: never two tenants backlogged for a whole window (each got what it asked for).",
        "- **Jain (weighted service)**: Jain's index of the backlogged tenants' weighted service in each window, "
        "averaged over the windows (1: service in proportion to weights).",
        "- **class attainment**: per class, met / requests (met: first token within the class's `ttft_s`).",
        f"- **QoE**: {QOE_DEFINITION}.",
        "- **throughput**: output tokens per model second to the last outcome; **shed**: the share of requests "
        "not served (refused at the door or by admission, timed out, refused at a deadline).",
        "- Each workload's second table: every tenant's p50 / p99 time to first token beside the others and "
        "alone.", "",
        "## Overview", "",
        *_overview(result), "",
        "Means over the workloads where a figure exists. The largest max service difference is in weighted "
        "tokens, over every workload.", "",
        "## Workloads", "",
    ]
    for workload in result.workloads:
        parts += [workload_section(workload), ""]
    return "\n".join(parts).rstrip() + "\n"
