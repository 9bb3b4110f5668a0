"""Markdown tables and figures in words, read from :class:`~apsd.sim.report.summary.RunSummary` values.

Units: every duration (wait, TTFT, latency, run time, time in a state) is in seconds with
:data:`S` (three decimals, millisecond resolution). Two durations live at millisecond scale and
are in milliseconds: the governor's batch window, configured in milliseconds (``window_ms``), and
the time per output token (TPOT, a decode step or a share of one), with :data:`MS` in tables (two
decimals, 10 µs resolution: seconds with three decimals would round 9.6 ms and 10.4 ms alike).
Every column with a unit names it in its header.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from apsd.sim.report.summary import EngineSummary, Percentiles, RunSummary

__all__ = ["MS", "S", "batch_table", "classes_table", "describe_engine", "engine_figures", "fmt",
           "format_summary_table", "governor_table", "isolation_table", "routing_table", "service_difference_table",
           "table", "tenant_table"]

S = ".3f"
MS = ".2f"

_SUMMARY_HEADER = (
    "policy", "completed", "rejected", "throughput (tok/s)", "GPU util (%)", "cost per 1M tokens (USD)",
    "Jain", "lowest bidder max wait (s)", "p99 TTFT (s)", "p99 TPOT (ms)", "p99 latency (s)",
    "mean batch size (requests)",
)


def fmt(x: float | None, spec: str, scale: float = 1.0, prefix: str = "", suffix: str = "") -> str:
    """``x * scale`` formatted with ``spec``; an em dash for a missing value."""
    if x is None:
        return "—"
    return f"{prefix}{x * scale:{spec}}{suffix}"


def _row(cells: Iterable[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def table(header: Sequence[str], rows: Iterable[Sequence[str]], align: str) -> str:
    """A Markdown table; ``align`` has one letter per column, ``l`` or ``r``."""
    lines = [_row(header), "|" + "|".join({"l": ":---", "r": "---:"}[a] for a in align) + "|"]
    lines += [_row(r) for r in rows]
    return "\n".join(lines)


def format_summary_table(summaries: Sequence[RunSummary]) -> str:
    """A Markdown table with one row per summary (as returned by :func:`~apsd.sim.report.summarize`)."""
    rows = []
    for s in summaries:
        o = s.overall
        rows.append((
            f"`{s.label}`",
            str(o.completed),
            str(o.rejected),
            fmt(o.throughput_tokens_per_s, ".1f"),
            fmt(o.gpu_utilization, ".1f", 100),
            fmt(o.cost_per_1m_tokens_usd, ".2f", prefix="$"),
            fmt(o.fairness.jain_index, ".3f"),
            fmt(o.lowest_bidder.max_queue_wait_ms, S, 1e-3),
            fmt(o.ttft_ms.p99, S, 1e-3),
            fmt(o.tpot_ms.p99, MS),
            fmt(o.latency_ms.p99, S, 1e-3),
            fmt(o.batch_sizes.mean, ".2f"),
        ))
    return table(_SUMMARY_HEADER, rows, "l" + "r" * (len(_SUMMARY_HEADER) - 1))


def isolation_table(summaries: Sequence[RunSummary]) -> str | None:
    """Each tenant's p99 TTFT and throughput beside the others against alone, a row per policy and
    tenant (None when no summary compared its tenants alone)."""
    rows = []
    for s in summaries:
        for t in s.isolation:
            kept = (t.tokens_per_s / t.tokens_per_s_alone if t.tokens_per_s is not None and t.tokens_per_s_alone
                    else None)
            rows.append((f"`{s.label}`", f"`{t.tenant}`", fmt(t.ttft_p99_alone_ms, S, 1e-3), fmt(t.ttft_p99_ms, S, 1e-3),
                         fmt(t.ratio, ".2f", suffix="x"), fmt(t.tokens_per_s_alone, ".1f"), fmt(t.tokens_per_s, ".1f"),
                         fmt(kept, ".0f", 100)))
    if not rows:
        return None
    header = ("policy", "tenant", "p99 TTFT alone (s)", "p99 TTFT beside the others (s)", "ratio",
              "output tok/s alone", "output tok/s beside the others", "kept (%)")
    return table(header, rows, "llrrrrrr")


def _quantiles(p: Percentiles, spec: str, scale: float) -> str:
    return " / ".join(fmt(x, spec, scale) for x in (p.p50, p.p95, p.p99, p.max))


def tenant_table(summary: RunSummary) -> str:
    header = ("tenant", "bids", "sent", "completed", "rejected", "failed", "cancelled",
              "wait p50/p95/p99/max (s)", "TTFT p50/p95/p99/max (s)", "TPOT p50/p95/p99/max (ms)",
              "latency p50/p95/p99/max (s)", "output tokens", "rejections")
    rows = []
    for name, t in summary.tenants.items():
        rows.append((
            f"`{name}`",
            ", ".join(str(b) for b in t.bids) or "—",
            str(t.sent), str(t.completed), str(t.rejected), str(t.failed), str(t.cancelled),
            _quantiles(t.queue_wait_ms, S, 1e-3),
            _quantiles(t.ttft_ms, S, 1e-3),
            _quantiles(t.tpot_ms, MS, 1.0),
            _quantiles(t.latency_ms, S, 1e-3),
            str(t.output_tokens),
            ", ".join(f"{code}: {n}" for code, n in t.rejected_by_error.items()) or "—",
        ))
    return table(header, rows, "llrrrrrrrrrrl")


def service_difference_table(summaries: Sequence[RunSummary]) -> str:
    header = ("policy", "windows with 2+ backlogged tenants", "max, first half (service)",
              "max, whole run (service)", "window of the max, from (s)", "mean, whole run (service)")
    rows = []
    for s in summaries:
        d = s.overall.service_difference
        rows.append((f"`{s.label}`", f"{d.windows} (first half {d.first_half_windows})",
                     fmt(d.first_half_max, ",.0f"), fmt(d.max, ",.0f"), fmt(d.max_window_start_s, S),
                     fmt(d.mean, ",.0f")))
    return table(header, rows, "lrrrrr")


def governor_table(summary: RunSummary) -> str:
    g = summary.overall.governor
    if not g.samples:
        return "No governor samples."
    rows = [(f"`{state}`", fmt(v.seconds, S), fmt(v.fraction, ".1f", 100)) for state, v in g.time_in_state.items()]
    return (table(("state", "time (s)", "share (%)"), rows, "lrr")
            + f"\n\n{g.samples} samples, one every {g.sample_interval_s:g} s; mean window "
            + fmt(g.mean_window_ms, ".3g", suffix=" ms") + ", mean entropy "
            + fmt(g.mean_entropy_bits, ".2f", suffix=" bits") + ".")


def batch_table(summary: RunSummary) -> str:
    """The fixed batches' sizes; an engine that ran requests without any batched at the iteration level."""
    b = summary.overall.batch_sizes
    o = summary.overall
    if not b.count:
        if o.completed or o.failed:
            return (f"No fixed batches: the `{summary.engine.kind}` engine batches at the iteration "
                    "level (sequences join and leave at every step).")
        return "No batches ran."
    items = sorted(b.distribution.items(), key=lambda kv: int(kv[0]))
    rows = [(size, str(n), fmt(n / b.count, ".1f", 100)) for size, n in items]
    return (table(("batch size (requests)", "batches", "share (%)"), rows, "rrr")
            + f"\n\n{b.count} batches, mean size {fmt(b.mean, '.2f')}.")


def describe_engine(engine: EngineSummary | Mapping[str, Any], gpus: int | None = None) -> str:
    """An engine in words: "1 `continuous` engine (a100-80gb × llama-3-8b, tp 1)" (a summary's
    ``engine``, or an ``engine`` block: ``kind``, ``count`` and its details)."""
    if isinstance(engine, Mapping):   # (an ``engine`` block read from a file)
        engine = EngineSummary.of(engine)
    return engine.describe(gpus)


def engine_figures(summary: RunSummary) -> str:
    """The engines' own figures, for a policy's section ("" when the engine has none)."""
    e = summary.engine
    if e.mfu is None and e.mbu is None and not e.preemptions:
        return ""
    return (" Engine: MFU " + fmt(e.mfu, ".1f", 100, suffix="%") + ", MBU " + fmt(e.mbu, ".1f", 100, suffix="%")
            + f" over its busy time; {e.preemptions} preemption{'' if e.preemptions == 1 else 's'}.")


def routing_table(summary: RunSummary) -> str | None:
    """Where the routing policy sent requests, by engine and reason (None: it made no decision)."""
    if not summary.routing:
        return None
    return table(("engine", "reason", "requests"),
                 ((f"`{where}`", f"`{reason}`", str(n)) for where, reasons in summary.routing.items()
                  for reason, n in reasons.items()), "llr")


def classes_table(summary: RunSummary) -> str | None:
    """Each service class's attainment (None: the run had no classes)."""
    if not summary.classes:
        return None
    return table(("class", "ttft_s", "on_miss", "requests", "met", "missed", "refused", "attainment (%)"),
                 ((f"`{c.name}`", f"{c.ttft_s:g}", c.on_miss, str(c.requests), str(c.met), str(c.missed),
                   str(c.refused), fmt(c.attainment, ".1f", 100)) for c in summary.classes), "lrlrrrrr")
