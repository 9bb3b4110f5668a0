"""Tenant isolation: a noisy neighbour's effect on a steady tenant, and the service difference
between backlogged tenants on every workload that has one (a section of research.md)."""

from __future__ import annotations

import math

from apsd.sim.report import SERVICE_DIFFERENCE_DEFINITION, RunSummary
from apsd.sim.research.claims import GROWTH_RATIO, TIE_RATIO, percent
from apsd.sim.research.measured import Comparison, Measured
from apsd.sim.research.prose import listing, ratio, sec_cell, seconds, whole
from apsd.sim.research.suite import (
    BATCH,
    CONTINUOUS,
    ENGINES,
    ISOLATION_SCALED,
    ISOLATION_WORKLOADS,
    WORKLOADS,
    continuous_names,
    isolation_names,
    noisy_name,
)

__all__ = ["isolation_headline", "isolation_section"]


def _steady(summary: RunSummary) -> tuple[float | None, float | None]:
    """The steady tenant's p99 latency and p99 TTFT, in ms."""
    steady = summary.tenants["steady"]
    return steady.latency_ms.p99, steady.ttft_ms.p99


def _noisy_neighbor(m: Measured) -> str:
    rows, verdicts = [], []
    for engine in ENGINES:
        summaries = m.results[engine][noisy_name(engine)]
        for s in summaries:
            (latency, ttft), (alone_latency, alone_ttft) = _steady(s), _steady(m.alone[engine][s.label])
            rows.append(f"| `{s.label}` | {engine} | {sec_cell(latency)} | {sec_cell(alone_latency)} | "
                        f"{ratio(latency, alone_latency)} | {sec_cell(ttft)} | {sec_cell(alone_ttft)} | "
                        f"{ratio(ttft, alone_ttft)} |")
        verdicts.append(_noisy_verdict(m, engine, summaries))
    return "\n".join([
        "**A noisy neighbour** (`noisy-neighbor`; on the continuous engine `" + noisy_name(CONTINUOUS) + "`). The "
        "steady tenant's p99 latency and p99 time to first token beside the neighbour's flood, and alone: the same "
        "workload with `neighbor_rate = 0`, so the very same steady arrivals (run for this table only).",
        "",
        "| policy | engine | steady p99 latency (s) | alone (s) | ratio | steady p99 TTFT (s) | alone (s) | ratio |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|", *rows, "",
        " ".join(verdicts),
    ])


def _noisy_verdict(m: Measured, engine: str, summaries: Comparison) -> str:
    """Which policy kept the steady tenant closest to its latency alone, against FIFO."""
    def latency(s: RunSummary) -> float:
        return _steady(s)[0] or math.inf

    best = min(summaries, key=latency)
    tied = [f"`{s.label}`" for s in summaries if latency(s) <= latency(best) * TIE_RATIO]
    fifo = summaries["fifo"]
    alone = [p99 for a in m.alone[engine] if (p99 := _steady(a)[0]) is not None]
    low, high = (min(alone), max(alone)) if alone else (None, None)
    return (f"On the {engine} engine the steady tenant alone has a p99 latency of "
            f"{seconds(low)}" + (f" to {seconds(high)}" if low is not None and high is not None and high > low else "")
            + f"; beside the flood, `fifo` makes it {seconds(_steady(fifo)[0])} and {listing(tied)} "
            f"{seconds(latency(best))}, {ratio(latency(best), _steady(m.alone[engine][best.label])[0])} its latency "
            "alone, the lowest of the policies.")


def isolation_headline(m: Measured) -> list[str]:
    """The result first: the steady tenant's p99 TTFT beside the flood over alone, per policy and engine."""
    labels = m.results[BATCH][noisy_name(BATCH)].labels
    cells = {engine: {s.label: (_steady(s)[1], _steady(m.alone[engine][s.label])[1])
                      for s in m.results[engine][noisy_name(engine)]} for engine in ENGINES}
    rows = [f"| `{label}` | " + " | ".join(
        f"{sec_cell(cells[engine][label][1])} → {sec_cell(cells[engine][label][0])} "
        f"({ratio(*cells[engine][label])})" for engine in ENGINES) + " |" for label in labels]
    return [
        "## Isolation first",
        "",
        "A steady tenant beside a same-bid neighbour's flood (`noisy-neighbor`; on the continuous engine "
        f"`{noisy_name(CONTINUOUS)}`): its p99 time to first token alone → beside the flood (the ratio), per "
        "policy. On the batch engine a request waits for the batch in progress and then shares a whole batch "
        "with the flood; on the continuous engine (isolation on, the default) a tenant below its share gets in "
        "at the next step. The section [Tenant isolation](#tenant-isolation) has the details, and "
        "[research/isolation-grid.md](research/isolation-grid.md) (`apsd research --grid`) the same comparison "
        "over 81 workloads.",
        "",
        "| policy | " + " | ".join(f"{engine} engine: p99 TTFT alone → flooded (s)" for engine in ENGINES) + " |",
        "|:---|" + "---:|" * len(ENGINES),
        *rows,
        "",
    ]


def _service_difference_cell(summary: RunSummary) -> str:
    d = summary.overall.service_difference
    if d.max is None:
        return "—"
    return f"{d.max:,.0f} ({whole(d.first_half_max)}) / {d.mean:,.0f}"


def _backlogged_rows(m: Measured) -> list[tuple[str, str, Comparison]]:
    """(engine, workload, comparison) of every workload with two tenants backlogged in some window."""
    names = {BATCH: [*WORKLOADS, *isolation_names(BATCH)],
             CONTINUOUS: [*continuous_names(), *isolation_names(CONTINUOUS)]}
    return [(engine, name, m.results[engine][name]) for engine in ENGINES for name in names[engine]
            if any(s.overall.service_difference.windows for s in m.results[engine][name])]


def _service_differences(m: Measured) -> str:
    rows = _backlogged_rows(m)
    labels = rows[0][2].labels
    lowest = {label: 0 for label in labels}
    grew = {label: 0 for label in labels}
    lines = []
    for engine, name, summaries in rows:
        lines.append(f"| `{name}` | {engine} | " + " | ".join(_service_difference_cell(s) for s in summaries) + " |")
        d = {s.label: s.overall.service_difference for s in summaries}
        low = min(x.mean or 0.0 for x in d.values())
        for label, x in d.items():
            lowest[label] += (x.mean or 0.0) <= low * TIE_RATIO
            grew[label] += x.max is not None and x.first_half_max is not None \
                and x.max > GROWTH_RATIO * x.first_half_max
    best = max(labels, key=lambda label: lowest[label])
    definition = SERVICE_DIFFERENCE_DEFINITION[0].upper() + SERVICE_DIFFERENCE_DEFINITION[1:]
    return "\n".join([
        "**The service difference between backlogged tenants** (VTC's fairness measure), on every workload where "
        "two tenants were backlogged throughout some window under some policy: the whole run's maximum, in "
        "brackets the first half's (windows that end by half the run's duration), then the mean over the run's "
        "windows; — where no two tenants were backlogged throughout any window.",
        "",
        "| workload | engine | " + " | ".join(f"`{label}`" for label in labels) + " |",
        "|:---|:---|" + "---:|" * len(labels), *lines, "",
        f"{definition}. A policy with no difference on a workload (—) never kept two tenants waiting for a whole "
        "window; one without a first-half figure (—) did only in the second half. The lowest mean (or none), "
        "ties included: " + ", ".join(f"`{label}` on {lowest[label]}" for label in labels)
        + f" of the {len(rows)} workloads, `{best}` most often. The whole run's maximum exceeds the first half's "
        f"by more than {percent(GROWTH_RATIO - 1)} on " + ", ".join(f"{grew[label]} under `{label}`" for label in labels)
        + ": a fair scheduler keeps the difference bounded however long the run lasts. Its maximum is often at "
        "the start of a backlog, where the service still comes from requests dispatched before it: on the "
        "continuous engine a request runs for seconds, hundreds at a time, so the maximum says less than the "
        "mean there.",
    ])


def isolation_section(m: Measured) -> list[str]:
    scaled = "; ".join(s.described() for s in ISOLATION_SCALED)
    return [
        "## Tenant isolation",
        "",
        "Five more workloads, where tenants compete for one engine: "
        + ", ".join(f"`{name}`" for name in ISOLATION_WORKLOADS) + " (a noisy neighbour, then the shapes of VTC's "
        "experiments, Sheng et al., \"Fairness in Serving Large Language Models\", OSDI '24, §5). They run with the "
        "built-in defaults on the batch engine and scaled on the continuous engine: " + scaled + ".",
        "",
        _noisy_neighbor(m),
        "",
        _service_differences(m),
        "",
    ]
