"""The research report: the seeds' workloads under each policy, and their claims checked.

Ownership: :func:`write_research` runs :data:`POLICIES` on every workload of
:data:`WORKLOADS` with :mod:`apsd.simulate`, writes each comparison with
:func:`apsd.report.write_report` under ``<out>/research/<workload>/``, and writes
``<out>/research.md``: the comparison tables, plots, and a section that states,
from the measured numbers, which of the seed documents' claims hold on apsd's
simulated A100. Every figure and every verdict in it is computed here from the
runs: regenerate with ``apsd research`` (the same seed gives the same bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .config import Config
from .executor import GpuModel
from .report import format_summary_table, summarize, write_report
from .simulate import parse_policy_choice, run_policy
from .workloads import build_workload

__all__ = ["POLICIES", "WORKLOADS", "write_research"]

#: Compared on every workload: FIFO, static priority, APS with the entropy governor, APS with a
#: fixed window (to isolate the governor).
POLICIES = ("fifo", "static", "aps", "aps:governor=fixed")

#: The seed documents' scenarios, with the built-in workloads' default parameters.
WORKLOADS = ("seed-stress", "burst-50", "vip-flood", "periodic", "bursty", "head-of-line", "vtc-overload")


def write_research(out_dir: Path, *, seed: int = 1, config: Config | None = None,
                   progress: Callable[[int], None] | None = None, plugin_manager: Any = None,
                   plots: bool = True) -> Path:
    """Run the suite and write ``out_dir/research.md`` (+ ``out_dir/research/``); returns its path."""
    config = config or Config()
    results: dict[str, list[dict[str, Any]]] = {}
    for name in WORKLOADS:
        workload = build_workload(name, None, seed=seed)
        runs = [run_policy(workload, parse_policy_choice(p), base_config=config, plugin_manager=plugin_manager,
                           progress=progress) for p in POLICIES]
        write_report(runs, out_dir / "research" / name, title=f"apsd research: {name}", plots=plots)
        results[name] = [summarize(run) for run in runs]
    path = out_dir / "research.md"
    path.write_text(_markdown(results, config, seed), encoding="utf-8")
    return path


# -- reading the summaries ------------------------------------------------------------------------

def _run(results: dict[str, list[dict[str, Any]]], workload: str, label: str) -> dict[str, Any]:
    return next(s for s in results[workload] if s["label"] == label)


def _overall(results: dict[str, list[dict[str, Any]]], workload: str, label: str) -> dict[str, Any]:
    return _run(results, workload, label)["overall"]


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:.1f}%"


def _usd(x: float | None) -> str:
    return "n/a" if x is None else f"${x:.2f}"


def _s(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms / 1000:.1f} s"


def _change(new: float | None, old: float | None) -> str:
    if new is None or old is None or old == 0:
        return "n/a"
    return f"{(new - old) / old * 100:+.1f}%"


# -- the claims -----------------------------------------------------------------------------------

def _claim_utilization(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = [(name, _overall(results, name, "aps")) for name in WORKLOADS]
    best = max(rows, key=lambda r: r[1]["gpu_utilization"] or 0)
    saturated = [name for name, o in rows if (o["gpu_utilization"] or 0) >= 0.95]
    lines = [f"| `{name}` | {_pct(o['gpu_utilization'])} | {_s(o['queue_wait_ms']['p99'])} |" for name, o in rows]
    verdict = (f"Busy-time utilization reached 95% only on {', '.join(f'`{n}`' for n in saturated)}"
               if saturated else "No workload reached 95% busy-time utilization")
    return "\n".join([
        "**\"95% GPU utilization\"** (seeds 000-002).",
        "",
        "| workload (`aps`) | GPU busy time | p99 queue wait |",
        "|:---|---:|---:|", *lines, "",
        f"{verdict}; the highest was {_pct(best[1]['gpu_utilization'])} on `{best[0]}`. Busy time near 100% "
        "is what an overloaded GPU shows, and it comes with queue waits that grow for as long as the "
        "overload lasts (the p99 column): it is a property of the workload's load, not an achievement "
        "of a policy. The simulated A100 does not model FLOP utilization (MFU), which for decode is far "
        "lower.",
    ])


def _claim_cost(results: dict[str, list[dict[str, Any]]], config: Config) -> str:
    runs = [(name, s) for name in WORKLOADS for s in results[name] if s["overall"]["cost_per_1m_tokens_usd"]]
    name, best = min(runs, key=lambda r: r[1]["overall"]["cost_per_1m_tokens_usd"])
    gpu = GpuModel(config.gpu)
    max_batch = int(config.policy.params.get("micro", {}).get("max_batch_size", 16))
    fastest = gpu.decode_tokens_per_s(max_batch)
    floor = config.gpu.price_per_hour_usd / 3600 / fastest * 1e6
    needed = config.gpu.price_per_hour_usd / 3600 / 0.53e-6
    holds = best["overall"]["cost_per_1m_tokens_usd"] <= 0.53
    return "\n".join([
        "**\"$0.53 per 1M tokens\"** (seeds 000-002).",
        "",
        f"The lowest measured cost was {_usd(best['overall']['cost_per_1m_tokens_usd'])} per 1M output tokens "
        f"(`{best['label']}` on `{name}`, mean batch {best['overall']['batch_sizes']['mean']:.1f}). "
        f"{'The claim holds.' if holds else 'The claim does not hold on this model.'} "
        f"At ${config.gpu.price_per_hour_usd:.2f}/hour, $0.53 per 1M tokens needs {needed:,.0f} output tokens/s "
        f"sustained; the seed's own decode model gives at most {fastest:,.0f} tokens/s at the batch cap of "
        f"{max_batch} ({config.gpu.decode_tokens_per_s:g}·({config.gpu.decode_batch_base:g} + "
        f"{config.gpu.decode_batch_sqrt:g}·√{max_batch})), so no schedule can cost less than "
        f"{_usd(floor)} per 1M tokens even before prefill time is counted.",
    ])


def _claim_fairness(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for name in ("seed-stress", "vip-flood", "vtc-overload"):
        cells = [f"{s['overall']['fairness']['jain_index']:.3f}" if s["overall"]["fairness"]["jain_index"]
                 is not None else "n/a" for s in results[name]]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    definition = results["seed-stress"][0]["overall"]["fairness"]["fairness_definition"]
    same = all(len({s["overall"]["fairness"]["jain_index"] for s in results[n]}) == 1
               for n in ("seed-stress", "vip-flood", "vtc-overload"))
    return "\n".join([
        "**\"Jain's fairness 0.94\"** (seeds 000-001; seed 002 says 0.67).",
        "",
        "| workload | " + " | ".join(f"`{p}`" for p in (s["label"] for s in results["seed-stress"])) + " |",
        "|:---|" + "---:|" * len(POLICIES), *lines, "",
        f"Definition used: {definition}. "
        + ("Over a whole run in which every request is eventually served, every policy gives the same "
           "index: the tokens each tenant receives are the tokens it asked for, and only *when* it "
           "receives them depends on the policy. A single Jain figure therefore says nothing about a "
           "scheduler here; the differences show in the waits below, and in service over time "
           "(`service.png`, and the VTC plugin's bounded service difference). "
           if same else "The index differs between policies only where some requests were refused or left "
           "unserved. ")
        + "The seeds' 0.94 is not reproduced as a property of APS.",
    ])


def _claim_starvation(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = []
    for s in results["vip-flood"]:
        low = s["overall"]["lowest_bidder"]
        rows.append(f"| `{s['label']}` | {_s(low['max_queue_wait_ms'])} | {_s(low['p99_queue_wait_ms'])} | "
                    f"{_s(s['overall']['queue_wait_ms']['p99'])} |")
    static = _overall(results, "vip-flood", "static")["lowest_bidder"]["max_queue_wait_ms"]
    aps = _overall(results, "vip-flood", "aps")["lowest_bidder"]["max_queue_wait_ms"]
    fifo = _overall(results, "vip-flood", "fifo")["lowest_bidder"]["max_queue_wait_ms"]
    return "\n".join([
        "**Starvation** (seed 002: \"high-volume tenants can starve low-volume ones\").",
        "",
        "| `vip-flood` | lowest bidder max wait | its p99 wait | everyone's p99 wait |",
        "|:---|---:|---:|---:|", *rows, "",
        f"Static priority makes the bid-1 tenant wait {_s(static)} at worst; APS cuts that to {_s(aps)} "
        f"({_change(aps, static)}), which is {'more' if aps > fifo else 'less'} than FIFO's {_s(fifo)}: with "
        "`alpha = 1`, a bid-1 request overtakes bid-10 requests that arrived more than 9 s after it, so under "
        "a sustained overload it waits about 9 s longer than the flood's own requests, instead of for the "
        "whole flood. `alpha` trades priority against waiting: larger values move APS towards FIFO.",
    ])


def _claim_governor(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = []
    verdicts = []
    for name in ("periodic", "bursty", "burst-50", "seed-stress"):
        entropy, fixed = _overall(results, name, "aps"), _overall(results, name, "aps+fixed")
        gov = entropy["governor"]
        rows.append(f"| `{name}` | {gov['mean_entropy_bits']:.2f} | {gov['mean_window_ms']:.2f} | "
                    f"{_s(entropy['latency_ms']['p99'])} vs {_s(fixed['latency_ms']['p99'])} "
                    f"({_change(entropy['latency_ms']['p99'], fixed['latency_ms']['p99'])}) | "
                    f"{entropy['batch_sizes']['mean']:.2f} vs {fixed['batch_sizes']['mean']:.2f} |")
        verdicts.append(entropy["latency_ms"]["p99"] is not None and fixed["latency_ms"]["p99"] is not None
                        and entropy["latency_ms"]["p99"] < fixed["latency_ms"]["p99"] * 0.95)
    helped = sum(verdicts)
    return "\n".join([
        "**The entropy governor** (seed 004: \"prevents phase transitions into congestion\").",
        "",
        "| workload | mean entropy (bits) | mean window (ms) | p99 latency, entropy vs fixed 10 ms | "
        "mean batch, entropy vs fixed |",
        "|:---|---:|---:|---:|---:|", *rows, "",
        f"The entropy governor lowered p99 latency by more than 5% on {helped} of {len(verdicts)} workloads. "
        "Its window only ranges between 10 ms·e^(−H/5) ≈ 3.2 ms (H at its bound, log2 50) and 10 ms, "
        "while a batch on the simulated A100 takes seconds: the window is a small part of any request's "
        "latency, so the governor cannot prevent congestion, which is decided by load against capacity. "
        "Note also that entropy measures how *varied* the gaps are, not how *dense* arrivals are: a burst "
        "of simultaneous arrivals has H ≈ 0 and reads as STABLE (see `burst-50`).",
    ])


def _claim_lazy_aging() -> str:
    return "\n".join([
        "**\"Lazy aging is O(1)\"** (seeds 000-004).",
        "",
        "With one `alpha` for every request, P_eff(r1, τ) − P_eff(r2, τ) = (P_bid1 − α·t_a1) − (P_bid2 − α·t_a2) "
        "does not depend on τ, so a heap keyed on `α·t_a − P_bid` is exact at every moment: aging costs nothing "
        "per tick, and push and pop are O(log N), not O(1). The property test `tests/test_aging.py` checks the "
        "order against brute-force re-evaluation of P_eff at every pop; `python tests/bench_queue.py` measures "
        "push+pop rates against raw `heapq` at depths 10³–10⁵ on the machine it runs on.",
    ])


# -- the document ---------------------------------------------------------------------------------

def _markdown(results: dict[str, list[dict[str, Any]]], config: Config, seed: int) -> str:
    g = config.gpu
    parts = [
        "# apsd research: FIFO, static priority and APS on the seeds' workloads",
        "",
        "Generated by `apsd research` (this file and `research/`); every number below was measured by "
        "running apsd's own admission, scheduler, policies and simulated GPU in virtual time "
        f"(`apsd simulate`), with workload seed {seed}. Same seed, same bytes.",
        "",
        f"Simulated GPU (seed model, `[gpu]`): {g.count} GPU, prefill {g.prefill_tokens_per_s:g} tokens/s, batch "
        f"decode {g.decode_tokens_per_s:g}·({g.decode_batch_base:g} + {g.decode_batch_sqrt:g}·√b) tokens/s, "
        f"${g.price_per_hour_usd:.2f}/hour of busy time. Policies: "
        + ", ".join(f"`{parse_policy_choice(p).label}`" for p in POLICIES)
        + " (`aps` uses the entropy governor, `aps+fixed` a fixed 10 ms window). Tenants are not rate-limited "
        "in these runs, so the comparison measures scheduling alone.",
        "",
        "## What the seeds claim, and what apsd measures",
        "",
        _claim_utilization(results), "",
        _claim_cost(results, config), "",
        _claim_fairness(results), "",
        _claim_starvation(results), "",
        _claim_governor(results), "",
        _claim_lazy_aging(), "",
        "## The workloads",
        "",
    ]
    for name in WORKLOADS:
        summaries = results[name]
        workload = summaries[0]["workload"]
        parts += [
            f"### `{name}`",
            "",
            f"{workload['description']} ({workload['arrivals']} arrivals; details, per-tenant tables and "
            f"all plots: [research/{name}/report.md](research/{name}/report.md)).",
            "",
            format_summary_table(summaries),
            "",
            f"![queue wait against arrival time, {name}](research/{name}/queue_wait.png)",
            "",
        ]
    return "\n".join(parts).rstrip() + "\n"
