"""``report.md``: the runs of one ``apsd simulate`` (or one research comparison) in Markdown,
grouped by workload, from their :class:`~apsd.sim.report.summary.RunSummary` values."""

from __future__ import annotations

import json
from collections.abc import Sequence

from apsd.core.ledger import FAIRNESS_DEFINITION
from apsd.sim.report.service import SERVICE_DIFFERENCE_DEFINITION
from apsd.sim.report.summary import RunSummary
from apsd.sim.report.tables import (
    S,
    batch_table,
    classes_table,
    describe_engine,
    engine_figures,
    fmt,
    format_summary_table,
    governor_table,
    isolation_table,
    routing_table,
    service_difference_table,
    tenant_table,
)

__all__ = ["report_markdown"]

_COMPARISON_NOTE = (
    "Throughput is output tokens per model second to the last outcome; GPU utilization is "
    "busy time over (engines × duration), where an engine is busy while it computes (a `batch` "
    "engine while a batch runs, a `continuous` one while any sequence is in it); cost per 1M "
    "tokens is the engines' cost over the output tokens produced; TTFT is arrival to first "
    "token and TPOT the mean time between output tokens after the first (requests of two or "
    "more tokens); the lowest bidder is every request with the smallest bid among the "
    "arrivals, and its wait is the longest queue wait among its completed requests. Batch "
    "sizes exist only for the `batch` engine (—: none ran)."
)


def _describe_workload(summary: RunSummary, runs: Sequence[RunSummary]) -> str:
    wl = summary.workload
    params = ", ".join(f"`{k}={json.dumps(v)}`" for k, v in sorted(wl.params.items())) or "none"
    engines = list(dict.fromkeys(describe_engine(s.engine, s.gpus) for s in runs))
    durations = ", ".join(f"`{s.label}` {fmt(s.duration_s, S)} s" for s in runs)
    description = wl.description.strip()
    if description and description[-1] not in ".!?":
        description += "."
    return (
        f"{description} {wl.arrivals} arrivals from {wl.tenants} tenants, "
        f"generated with seed {wl.seed} and parameters {params}; "
        f"run on {' or '.join(engines)}; "
        f"model time to the last outcome: {durations}."
    ).strip()


def _policy_section(s: RunSummary) -> list[str]:
    lb = s.overall.lowest_bidder
    out = [f"### `{s.label}`", "",
           "Policy: " + (", ".join(f"{k} `{v}`" for k, v in s.policy.items()) or "—")
           + f". Lowest bid {lb.bid if lb.bid is not None else '—'}: "
           + f"{lb.completed} of {lb.requests} requests completed, queue wait p99 "
           + fmt(lb.p99_queue_wait_ms, S, 1e-3, suffix=" s") + ", max "
           + fmt(lb.max_queue_wait_ms, S, 1e-3, suffix=" s") + "." + engine_figures(s), "",
           "#### Tenants", "", tenant_table(s), ""]
    routes = routing_table(s)
    if routes is not None or s.overall.cached_prompt_share:
        out += ["#### Prefix cache and routing", "",
                "The engines found " + fmt(s.overall.cached_prompt_share, ".1f", 100, suffix="%")
                + " of the completed requests' prompt tokens in their prefix caches.", ""]
        if routes is not None:
            out += ["Where the routing policy sent each request, and why:", "", routes, ""]
    classes = classes_table(s)
    if classes is not None:
        out += ["#### Service classes", "", "Attainment is met / requests of the class (met: its first token "
                "within `ttft_s`; refused: 503 `deadline_unmeetable`).", "", classes, ""]
    return out + ["#### Governor time in state", "", governor_table(s), "",
                  "#### Batch sizes", "", batch_table(s), ""]


def report_markdown(title: str, groups: Sequence[Sequence[RunSummary]], plots: dict[str, str]) -> str:
    """``report.md``: ``groups`` are the summaries of each workload, in order; ``plots`` the PNGs
    drawn beside it (file name -> what it shows)."""
    out = [f"# {title}", ""]
    if not groups:
        out += ["No runs.", ""]
    for group in groups:
        first = group[0]
        out += [f"## Workload `{first.workload.name}`", "",
                _describe_workload(first, group), ""]
        isolated = isolation_table(group)
        if isolated is not None:
            out += ["### Isolation", "", "Each tenant beside the others against alone: the very same arrivals of its own "
                    "and nobody else's, under the same policy and engine. A ratio near 1 and throughput kept near "
                    "100% mean the others did not hurt it.", "", isolated, ""]
        out += ["### Comparison", "", format_summary_table(group), "",
                _COMPARISON_NOTE, "",
                "### Service difference between backlogged tenants", "", service_difference_table(group), "",
                SERVICE_DIFFERENCE_DEFINITION[0].upper() + SERVICE_DIFFERENCE_DEFINITION[1:] + ". The first half "
                "is the windows that end by half the run's duration: a fair scheduler keeps the difference "
                "bounded however long the run, so the whole run's maximum stays near the first half's. The mean "
                "is over the windows with a difference.", ""]
        for s in group:
            out += _policy_section(s)
    out += ["## Fairness", "", FAIRNESS_DEFINITION + ". 1.0 means every active tenant got service "
            "in proportion to its rate; 1/n means one tenant got everything.", ""]
    if plots:
        out += ["## Plots", ""]
        for name, what in plots.items():
            out += [f"![{what}]({name})", ""]
    return "\n".join(out)
