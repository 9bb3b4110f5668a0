"""The research report: the seeds' workloads and tenant isolation under each policy, on two engines.

Ownership: :func:`write_research` runs :data:`POLICIES`, then the presets of the
installed plugins (:func:`plugin_presets`), on every workload of :data:`WORKLOADS`
with :mod:`apsd.sim.runner`, twice: on the seeds' simulated A100 (the ``micro``
engine, the default configuration) and on the ``continuous`` engine described by
:data:`CONTINUOUS_ENGINE`; then, on the continuous engine only, the scaled variants of
:data:`SCALED`. The tenant-isolation workloads of :data:`ISOLATION_WORKLOADS` run on
the seed engine with their defaults and on the continuous engine as :data:`ISOLATION_SCALED`;
:data:`NOISY` also runs without its neighbour (:data:`ALONE`) for research.md only. It
writes each comparison with :func:`apsd.sim.report.write_report` (paths in
:func:`report_dir`) and ``<out>/research.md``: which policies ran and which plugins they
came from, which of the seed documents' claims hold on the seed engine, which conclusions
change on the continuous engine, how well each policy isolates tenants (a noisy
neighbour's effect on a steady tenant, and the service difference between backlogged
tenants of :mod:`apsd.sim.report`), the comparison tables, and plots. Every figure and
every verdict in it is computed here from the runs: regenerate with ``apsd research``.

Plugins: by default the plugin manager is the daemon's (:func:`~apsd.plugins.make_plugin_manager`:
built-ins plus installed ``apsd`` entry points, filtered by ``APSD_PLUGINS``), so the
report covers what an operator could run. The same seed and the same installed plugins
(names and versions, which ``research.md`` lists) give the same bytes.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from apsd.core.config import Config
from apsd.engines import deployment_for
from apsd.engines.batch import GpuModel
from apsd.engines.roofline import Deployment, DeploymentError, estimate_static_batch
from apsd.core.ledger import jain_index
from apsd.plugins import (DEFAULT_PLUGINS, describe_plugins, load_policy_registry, load_profile_registry,
                       make_plugin_manager)
from apsd.policies.aging import ApsParams
from apsd.core.policy import PolicyRegistry
from apsd.sim.records import PolicyRun, Workload
from apsd.sim.report import SERVICE_DIFFERENCE_DEFINITION, describe_engine, format_summary_table, summarize, write_report
from apsd.sim.runner import PolicyChoice, parse_policy_choice, run_policy
from apsd.sim.workloads import build_workload

__all__ = ["ALONE", "CONTINUOUS_ENGINE", "ISOLATION_SCALED", "ISOLATION_WORKLOADS", "NOISY", "POLICIES", "SCALED",
           "WORKLOADS", "ScaledWorkload", "open_report_writer", "plugin_presets", "report_dir", "write_research"]

#: Compared on every workload: FIFO, static priority, APS with the entropy governor, APS with a
#: fixed window (to isolate the governor), and the weighted fair share between tenants (the default
#: preset). The installed plugins' presets follow them.
POLICIES = ("fifo", "static", "aps", "aps:governor=fixed", "fair")

#: The seed documents' scenarios, with the built-in workloads' default parameters.
WORKLOADS = ("seed-stress", "burst-50", "vip-flood", "periodic", "bursty", "head-of-line", "vtc-overload")

#: The second engine (``[engine]``): one A100-80GB serving Llama-3-8B, batching at the iteration level.
CONTINUOUS_ENGINE: dict[str, Any] = {"kind": "continuous", "gpu": "a100-80gb", "model": "llama-3-8b", "tp": 1,
                                     "count": 1}

#: Tenant isolation (issue 14): a noisy neighbour and VTC's experiments (Sheng et al., OSDI '24, §5),
#: on the seed engine with the built-in defaults, on the continuous engine as :data:`ISOLATION_SCALED`.
ISOLATION_WORKLOADS = ("noisy-neighbor", "proportional", "on-off", "increase", "dist-shift")

#: The workload whose steady tenant research.md compares with and without its neighbour, and the
#: parameter that removes the neighbour (its "alone" run).
NOISY = "noisy-neighbor"
ALONE = {"neighbor_rate": 0.0}

#: The workloads the governor claim is checked on (two regular, two irregular arrival patterns).
GOVERNOR_WORKLOADS = ("periodic", "bursty", "burst-50", "seed-stress")


@attrs.frozen
class ScaledWorkload:
    """A built-in workload with some parameters scaled, run on the continuous engine only."""

    #: Its name in the report and its directory: the workload's name and the factor.
    name: str
    workload: str
    params: dict[str, Any]
    #: Why, in a few words (research.md prints it beside the measured load).
    why: str


#: The seeds' workloads were sized for the seed GPU, which serves a few hundred tokens per second; the
#: continuous engine serves thousands, so the two overload scenarios are re-run with their rates
#: scaled until they overload it again. The built-in defaults stay as they are.
SCALED = (
    ScaledWorkload("vip-flood-x16", "vip-flood", {"vip_rate": 80.0},
                   "the VIP's rate ×16, 5 → 80 req/s, with the free tenant's trickle unchanged: starvation"),
    ScaledWorkload("vtc-overload-x8", "vtc-overload", {"rate_a": 12.0, "rate_b": 24.0, "duration": 120.0},
                   "both rates ×8, 1.5 → 12 and 3 → 24 req/s, over 120 s instead of 600 s so that no "
                   "tenant's queue reaches `max_requests_per_tenant`: both tenants above their fair share"),
)

#: The isolation workloads on the continuous engine: rates scaled until they overload it (it serves about
#: 18 req/s of 256/256-token requests and 54 req/s of 64/128), over durations short enough that no tenant's
#: queue reaches `max_requests_per_tenant` (2,000) under FIFO.
ISOLATION_SCALED = (
    ScaledWorkload("noisy-neighbor-x10", "noisy-neighbor", {"steady_rate": 5.0, "neighbor_rate": 100.0,
                                                            "duration": 20.0},
                   "both rates ×10, 0.5 → 5 and 10 → 100 req/s, about twice what the engine serves, over 20 s "
                   "instead of 120 s"),
    ScaledWorkload("proportional-x16", "proportional", {"rate": 8.0, "duration": 30.0},
                   "the rates ×16, 0.5, 1 and 1.5 → 8, 16 and 24 req/s, over 30 s instead of 120 s"),
    ScaledWorkload("on-off-x8", "on-off", {"steady_rate": 24.0, "on_rate": 16.0, "period_s": 10.0,
                                           "duration": 60.0},
                   "both rates ×8, 3 → 24 and 2 → 16 req/s, in 10 s periods over 60 s instead of 60 s "
                   "periods over 600 s"),
    ScaledWorkload("increase-x16", "increase", {"constant_rate": 8.0, "start_rate": 3.2, "end_rate": 32.0,
                                                "duration": 60.0},
                   "the rates ×16, 0.5 → 8 and a ramp from 3.2 to 32 req/s, over 60 s instead of 600 s"),
    ScaledWorkload("dist-shift-x16", "dist-shift", {"rate_a": 16.0, "rate_b": 16.0, "duration": 60.0,
                                                    "shift_at": 30.0},
                   "both rates ×16, 1 → 16 req/s, over 60 s instead of 120 s, swapped at 30 s"),
)


#: Most worker processes drawing the reports' plots at once (one per CPU, up to this).
MAX_REPORT_WORKERS = 8

#: The control for the governor: APS with a fixed window of 0 ms (``[policy.fixed] window_ms = 0``),
#: run on :data:`GOVERNOR_WORKLOADS` on both engines for research.md's governor paragraph only.
ZERO_WINDOW = PolicyChoice(label="aps+fixed 0 ms", preset="aps", overrides={"governor": "fixed"})


def report_dir(engine: str, name: str) -> Path:
    """Where a workload's report goes under ``<out>``: ``research/<workload>`` on the ``micro``
    engine (as before the continuous engine existed), ``research/continuous/<workload>`` on the
    continuous engine (scaled variants included, under their own names)."""
    return Path("research", name) if engine == "batch" else Path("research", engine, name)


def plugin_presets(registry: PolicyRegistry) -> tuple[str, ...]:
    """The presets registered by plugins other than the built-ins, by plugin name, then preset name.

    The order depends only on the names, never on installation or registration order.
    """
    return tuple(p.name for p in sorted(registry.presets.values(), key=lambda p: (p.plugin, p.name))
                 if p.plugin not in DEFAULT_PLUGINS)


def engine_configs(config: Config) -> dict[str, Config]:
    """``config`` on one ``micro`` engine, and on the continuous engine of :data:`CONTINUOUS_ENGINE`."""
    micro = attrs.evolve(config, engine=attrs.evolve(config.engine, kind="batch", count=1))
    fields = {k: v for k, v in CONTINUOUS_ENGINE.items()}
    continuous = attrs.evolve(config, engine=attrs.evolve(config.engine, **fields))
    return {"batch": micro, "continuous": continuous}


@attrs.frozen
class _Measured:
    """Everything research.md is computed from."""

    #: engine ("batch", "continuous") -> workload (or scaled variant) name -> summaries, in policy order.
    results: dict[str, dict[str, list[dict[str, Any]]]]
    #: report directory (as text) -> :func:`_service_during_overload` of its runs.
    overload: dict[str, dict[str, Any]]
    #: engine -> workload -> the summary of :data:`ZERO_WINDOW`.
    zero_window: dict[str, dict[str, dict[str, Any]]]
    #: engine -> policy label -> the summary of :data:`NOISY`'s steady tenant alone (:data:`ALONE`).
    alone: dict[str, dict[str, dict[str, Any]]]
    #: workload (or scaled variant) -> output tokens/s of a full continuous engine for its mean request.
    full_engine_tps: dict[str, float | None]
    #: workload (or scaled variant) -> (mean prompt tokens, mean output tokens).
    shapes: dict[str, tuple[int, int]]
    configs: dict[str, Config]
    deployment: Deployment


def write_research(out_dir: Path, *, seed: int = 1, config: Config | None = None,
                   progress: Callable[[int], None] | None = None, plugin_manager: Any = None,
                   plots: bool = True) -> Path:
    """Run the suite and write ``out_dir/research.md`` (+ ``out_dir/research/``); returns its path.

    ``config`` (default: the embedded defaults) gives queue limits and policy parameters; its
    ``[engine]`` is replaced by each engine's (:func:`engine_configs`). ``plugin_manager`` defaults
    to the daemon's (installed plugins, ``APSD_PLUGINS`` applies): its plugins' presets run after
    :data:`POLICIES`. Raises :class:`~apsd.plugins.PluginError` for a plugin that fails to load or
    build, :class:`~apsd.core.config.ConfigError` for an engine profile the plugins do not provide.
    """
    config = config or Config()
    pm = plugin_manager or make_plugin_manager()
    registry = load_policy_registry(pm)
    extra = plugin_presets(registry)
    plugins = [d for d in describe_plugins(pm, registry) if not d["builtin"]]
    choices = [parse_policy_choice(p) for p in (*POLICIES, *extra)]
    configs = engine_configs(config)
    deployment = deployment_for(configs["continuous"], load_profile_registry(pm))
    results: dict[str, dict[str, list[dict[str, Any]]]] = {engine: {} for engine in configs}
    overload: dict[str, dict[str, Any]] = {}
    zero_window: dict[str, dict[str, dict[str, Any]]] = {engine: {} for engine in configs}
    alone: dict[str, dict[str, dict[str, Any]]] = {}
    full: dict[str, float | None] = {}
    shapes: dict[str, tuple[int, int]] = {}

    def run_all(engine: str, workload: Workload) -> list[PolicyRun]:
        return [run_policy(workload, choice, base_config=configs[engine], plugin_manager=pm, progress=progress)
                for choice in choices]

    def run(engine: str, name: str, workload: Workload, title: str) -> None:
        runs = run_all(engine, workload)
        directory = report_dir(engine, name)
        write(runs, out_dir / directory, title)
        results[engine][name] = [summarize(r) for r in runs]
        if workload.name == "vtc-overload":
            overload[directory.as_posix()] = _service_during_overload(runs)
        if workload.name == NOISY:
            alone[engine] = {r.label: summarize(r) for r in run_all(engine, _alone(workload))}

    with open_report_writer(plots) as write:
        for name in WORKLOADS:
            workload = build_workload(name, None, seed=seed)
            shapes[name] = _mean_shape(workload)
            full[name] = _full_engine_tps(deployment, configs["continuous"], shapes[name])
            run("batch", name, workload, f"apsd research: {name}")
            run("continuous", name, workload, f"apsd research: {name} on the continuous engine")
            if name in GOVERNOR_WORKLOADS:
                for engine, base in configs.items():
                    zero = _with_fixed_window(base, 0.0)
                    zero_window[engine][name] = summarize(run_policy(workload, ZERO_WINDOW, base_config=zero,
                                                                     plugin_manager=pm, progress=progress))
        for name in ISOLATION_WORKLOADS:
            run("batch", name, build_workload(name, None, seed=seed), f"apsd research: {name}")
        for scaled in (*SCALED, *ISOLATION_SCALED):
            workload = build_workload(scaled.workload, scaled.params, seed=seed)
            shapes[scaled.name] = _mean_shape(workload)
            full[scaled.name] = _full_engine_tps(deployment, configs["continuous"], shapes[scaled.name])
            run("continuous", scaled.name, workload,
                f"apsd research: {scaled.name}, {scaled.workload} scaled for the continuous engine")
    measured = _Measured(results=results, overload=overload, zero_window=zero_window, alone=alone,
                         full_engine_tps=full, shapes=shapes, configs=configs, deployment=deployment)
    path = out_dir / "research.md"
    path.write_text(_markdown(measured, config, seed, extra, plugins), encoding="utf-8")
    return path


@contextlib.contextmanager
def open_report_writer(plots: bool) -> Iterator[Callable[[list[PolicyRun], Path, str], None]]:
    """``write(runs, directory, title)``: :func:`~apsd.sim.report.write_report` for one comparison.

    Without plots it writes at once. With plots, which take most of research's time and depend on
    nothing but their runs, it hands the runs to a pool of up to :data:`MAX_REPORT_WORKERS` worker
    processes (started fresh, not forked) and returns; every report is written when the block exits.
    The files are the same bytes either way.

    Error handling: a worker's exception is raised when the block exits, once every report has been
    written or has failed; the pool is shut down either way.
    """
    workers = min(MAX_REPORT_WORKERS, os.cpu_count() or 1)
    if not plots or workers == 1:
        yield lambda runs, directory, title: write_report(runs, directory, title=title, plots=plots)
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        written: list[Future[list[Path]]] = []
        yield lambda runs, directory, title: written.append(pool.submit(write_report, runs, directory, title=title))
        for report in written:
            report.result()


def _alone(workload: Workload) -> Workload:
    """:data:`NOISY` with the same parameters and seed but :data:`ALONE`: its steady tenant's very arrivals, alone."""
    return build_workload(workload.name, {**workload.params, **ALONE}, seed=workload.seed)


def _with_fixed_window(config: Config, window_ms: float) -> Config:
    params = {**config.policy.params, "fixed": {**config.policy.params.get("fixed", {}), "window_ms": window_ms}}
    return attrs.evolve(config, policy=attrs.evolve(config.policy, params=params))


def _mean_shape(workload: Workload) -> tuple[int, int]:
    """The workload's mean prompt and output tokens, rounded (at least 1)."""
    n = max(len(workload.arrivals), 1)
    return (max(round(sum(a.prompt_tokens for a in workload.arrivals) / n), 1),
            max(round(sum(a.output_tokens for a in workload.arrivals) / n), 1))


def _full_engine_tps(deployment: Deployment, config: Config, shape: tuple[int, int]) -> float | None:
    """Output tokens/s of one engine full of the workload's mean request: ``max_sequences`` of them
    run together (the roofline's static-batch estimate; None if they do not fit its KV cache)."""
    try:
        return estimate_static_batch(deployment, config.engine.max_sequences, *shape,
                                     chunk_budget=config.engine.max_batched_tokens).output_tokens_per_s
    except DeploymentError:
        return None


def _service_during_overload(runs: list[PolicyRun]) -> dict[str, Any]:
    """Per run: output tokens each tenant had asked for and been served by the last arrival, and Jain.

    The index is the report's (tokens / configured rate, over tenants with a request admitted by
    then); ``backlogged`` says whether every such tenant still had a request waiting at that moment.
    """
    at = max((a.at for a in runs[0].workload.arrivals), default=0.0)
    by_label: dict[str, Any] = {}
    for run in runs:
        asked: dict[str, int] = {}
        tokens: dict[str, int] = {}
        waiting: dict[str, bool] = {}
        for r in run.requests:
            if r.arrival > at or r.outcome == "rejected":
                continue
            asked[r.tenant] = asked.get(r.tenant, 0) + r.output_tokens
            tokens.setdefault(r.tenant, 0)
            waiting.setdefault(r.tenant, False)
            if r.outcome == "completed" and r.finished_at is not None and r.finished_at <= at:
                tokens[r.tenant] += r.output_tokens
            if r.dispatched_at is None or r.dispatched_at > at:
                waiting[r.tenant] = True
        x = [tokens[t] / run.tenant_rates[t] for t in sorted(tokens) if run.tenant_rates.get(t)]
        by_label[run.label] = {"asked": dict(sorted(asked.items())), "tokens": dict(sorted(tokens.items())),
                               "jain": jain_index(x), "backlogged": bool(waiting) and all(waiting.values())}
    return {"at": at, "runs": by_label}


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
    """A duration in prose: seconds with the unit, one decimal (three below a second)."""
    if ms is None:
        return "n/a"
    return f"{ms / 1000:.1f} s" if abs(ms) >= 1000 else f"{ms / 1000:.3f} s"


def _sec(ms: float | None) -> str:
    """A duration in a table cell: seconds with three decimals, as in the comparison tables (unit in the header)."""
    return "n/a" if ms is None else f"{ms / 1000:.3f}"


def _pct_cell(x: float | None) -> str:
    """A fraction in a table cell: percent, one decimal (unit in the header)."""
    return "n/a" if x is None else f"{x * 100:.1f}"


def _change(new: float | None, old: float | None) -> str:
    if new is None or old is None or old == 0:
        return "n/a"
    return f"{(new - old) / old * 100:+.1f}%"


# -- the claims -----------------------------------------------------------------------------------

def _claim_utilization(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = [(name, _overall(results, name, "aps")) for name in WORKLOADS]
    best = max(rows, key=lambda r: r[1]["gpu_utilization"] or 0)
    saturated = [name for name, o in rows if (o["gpu_utilization"] or 0) >= 0.95]
    lines = [f"| `{name}` | {_pct_cell(o['gpu_utilization'])} | {_sec(o['queue_wait_ms']['p99'])} |"
             for name, o in rows]
    verdict = (f"Busy-time utilization reached 95% only on {', '.join(f'`{n}`' for n in saturated)}"
               if saturated else "No workload reached 95% busy-time utilization")
    return "\n".join([
        "**\"95% GPU utilization\"** (seeds 000-002).",
        "",
        "| workload (`aps`) | GPU busy time (%) | p99 queue wait (s) |",
        "|:---|---:|---:|", *lines, "",
        f"{verdict}; the highest was {_pct(best[1]['gpu_utilization'])} on `{best[0]}`. Busy time near 100% "
        "is what an overloaded GPU shows, and it comes with queue waits that grow for as long as the "
        "overload lasts (the p99 column): it is a property of the workload's load, not an achievement "
        "of a policy. The seed model has no FLOP utilization (MFU), which for decode is far lower: the "
        "continuous engine measures it (below).",
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


def _jain_cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _claim_fairness(results: dict[str, list[dict[str, Any]]], overload: dict[str, Any],
                    extra: tuple[str, ...]) -> str:
    labels = [s["label"] for s in results["seed-stress"]]
    workloads = ("seed-stress", "vip-flood", "vtc-overload")
    lines = [f"| `{name}`, whole run | " + " | ".join(_jain_cell(s["overall"]["fairness"]["jain_index"])
                                                  for s in results[name]) + " |" for name in workloads]
    at, during = overload["at"], overload["runs"]
    lines.append(f"| `vtc-overload`, served by t = {at:.1f} s | "
                 + " | ".join(_jain_cell(during[label]["jain"]) for label in labels) + " |")
    definition = results["seed-stress"][0]["overall"]["fairness"]["fairness_definition"]
    same = all(len({s["overall"]["fairness"]["jain_index"] for s in results[n]}) == 1 for n in workloads)

    # While the overload lasts: who served the tenants most evenly?
    fifo = during["fifo"]
    best = max(labels, key=lambda label: during[label]["jain"] or 0.0)  # the first of equals
    like_fifo = [label for label in labels if label != "fifo"
                 and abs((during[label]["jain"] or 0.0) - (fifo["jain"] or 0.0)) < 0.005]
    backlogged = all(run["backlogged"] for run in during.values())

    def shares(tokens: dict[str, int]) -> list[float]:
        total = sum(tokens.values())
        return [n / total * 100 if total else 0.0 for n in tokens.values()]

    served_share, asked_share = shares(fifo["tokens"]), shares(fifo["asked"])
    proportional = all(abs(a - b) < 5 for a, b in zip(served_share, asked_share))
    tenants = list(fifo["tokens"])
    overload_text = (
        f"On `vtc-overload`, at the last arrival (t = {at:.1f} s; "
        + ("every tenant still has requests waiting, under every policy" if backlogged
           else "under some policy, some tenant has no request left waiting")
        + "), `fifo` had served " + " and ".join(f"`{t}` {n:,}" for t, n in fifo["tokens"].items())
        + f" output tokens (Jain {_jain_cell(fifo['jain'])}): "
        + " and ".join(f"{x:.1f}%" for x in served_share) + " of the service, "
        + ("in proportion to" if proportional else "against") + " their "
        + " and ".join(f"{x:.1f}%" for x in asked_share) + " of the tokens asked for"
        + (f", as under {', '.join(f'`{label}`' for label in like_fifo)}" if like_fifo else "") + ". ")
    if (during[best]["jain"] or 0.0) >= (fifo["jain"] or 0.0) + 0.005:
        whole = {s["label"]: s["overall"]["fairness"]["jain_index"] for s in results["vtc-overload"]}
        overload_text += (
            f"`{best}`{' (a plugin preset)' if best in extra else ''} had served them "
            + " and ".join(f"{during[best]['tokens'].get(t, 0):,}" for t in tenants)
            + f" (Jain {_jain_cell(during[best]['jain'])}): the most even service of the "
            f"{len(labels)} policies while the overload lasted"
            + (", with the same whole-run index as FIFO" if whole[best] == whole["fifo"] else "")
            + " (`research/vtc-overload/service.png` shows service over time). ")
    else:
        overload_text += ("No policy run here served the tenants more evenly than FIFO while the overload lasted"
                          + ("" if "vtc" in labels else ": VTC, which exists for that, is the `apsd-vtc` plugin "
                             "(`plugins/apsd-vtc`), which was not loaded when this file was generated")
                          + ". ")
    return "\n".join([
        "**\"Jain's fairness 0.94\"** (seeds 000-001; seed 002 says 0.67).",
        "",
        "| Jain's index | " + " | ".join(f"`{label}`" for label in labels) + " |",
        "|:---|" + "---:|" * len(labels), *lines, "",
        f"Definition used: {definition}. "
        + ("Over a whole run in which every request is eventually served, every policy gives the same "
           "index: the tokens each tenant receives are the tokens it asked for, and only *when* it "
           "receives them depends on the policy. A single Jain figure over a whole run therefore says "
           "nothing about a scheduler here. "
           if same else "Over whole runs, the index differs between policies only where some requests were "
           "refused or left unserved. ")
        + overload_text
        + "The seeds' 0.94 is not reproduced as a property of APS.",
    ])


def _claim_starvation(results: dict[str, list[dict[str, Any]]], extra: tuple[str, ...],
                      origin: dict[str, str]) -> str:
    rows = []
    for s in results["vip-flood"]:
        low = s["overall"]["lowest_bidder"]
        rows.append(f"| `{s['label']}` | {_sec(low['max_queue_wait_ms'])} | {_sec(low['p99_queue_wait_ms'])} | "
                    f"{_sec(s['overall']['queue_wait_ms']['p99'])} |")

    def worst(label: str) -> float:
        return _overall(results, "vip-flood", label)["lowest_bidder"]["max_queue_wait_ms"]

    static, aps, fifo = worst("static"), worst("aps"), worst("fifo")
    fifo_p99 = _overall(results, "vip-flood", "fifo")["queue_wait_ms"]["p99"]
    text = [
        f"Static priority makes the bid-1 tenant wait {_s(static)} at worst; APS cuts that to {_s(aps)} "
        f"({_change(aps, static)}), which is {'more' if aps > fifo else 'less'} than FIFO's {_s(fifo)}: with "
        "`alpha = 1`, a bid-1 request overtakes bid-10 requests that arrived more than 9 s after it, so under "
        "a sustained overload it waits about 9 s longer than the flood's own requests, instead of for the "
        "whole flood. `alpha` trades priority against waiting: larger values move APS towards FIFO."
    ]
    for label in ("fair", *extra):
        o = _overall(results, "vip-flood", label)
        text.append(f"The `{label}` preset ({origin.get(label, 'built in')}) gives the bid-1 tenant "
                    f"{_s(worst(label))} at worst ({_change(worst(label), fifo)} against FIFO), with everyone's "
                    f"p99 wait at {_s(o['queue_wait_ms']['p99'])} (FIFO: {_s(fifo_p99)})"
                    + (": the bid-1 tenant is another tenant, and a bid never buys another tenant's share."
                       if label == "fair" else "."))
    labels = [s["label"] for s in results["vip-flood"]]
    shortest = min(worst(label) for label in labels)
    best = [f"`{label}`" for label in labels if worst(label) <= shortest * 1.005]
    text.append(f"Of the {len(labels)} policies run, {_list(best)} "
                f"{'give' if len(best) > 1 else 'gives'} the lowest bidder the shortest worst wait.")
    return "\n".join([
        "**Starvation** (seed 002: \"high-volume tenants can starve low-volume ones\").",
        "",
        "| `vip-flood` | lowest bidder max wait (s) | its p99 wait (s) | everyone's p99 wait (s) |",
        "|:---|---:|---:|---:|", *rows, "",
        " ".join(text),
    ])


def _claim_governor(results: dict[str, list[dict[str, Any]]]) -> str:
    rows = []
    verdicts = []
    for name in ("periodic", "bursty", "burst-50", "seed-stress"):
        entropy, fixed = _overall(results, name, "aps"), _overall(results, name, "aps+fixed")
        gov = entropy["governor"]
        rows.append(f"| `{name}` | {gov['mean_entropy_bits']:.2f} | {gov['mean_window_ms']:.2f} | "
                    f"{_sec(entropy['latency_ms']['p99'])} vs {_sec(fixed['latency_ms']['p99'])} "
                    f"({_change(entropy['latency_ms']['p99'], fixed['latency_ms']['p99'])}) | "
                    f"{entropy['batch_sizes']['mean']:.2f} vs {fixed['batch_sizes']['mean']:.2f} |")
        verdicts.append(entropy["latency_ms"]["p99"] is not None and fixed["latency_ms"]["p99"] is not None
                        and entropy["latency_ms"]["p99"] < fixed["latency_ms"]["p99"] * 0.95)
    helped = sum(verdicts)
    return "\n".join([
        "**The entropy governor** (seed 004: \"prevents phase transitions into congestion\").",
        "",
        "| workload | mean entropy (bits) | mean window (ms) | p99 latency, entropy vs fixed 10 ms (s) | "
        "mean batch, entropy vs fixed (requests) |",
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
        "per tick, and push and pop are O(log N), not O(1). The property test `tests/unit/test_aging.py` checks the "
        "order against brute-force re-evaluation of P_eff at every pop; `python benchmarks/bench_queue.py` measures "
        "push+pop rates against raw `heapq` at depths 10³–10⁵ on the machine it runs on.",
    ])


# -- the continuous engine ------------------------------------------------------------------------

def _names() -> list[str]:
    """The continuous engine's workloads: the seeds', then the scaled variants."""
    return [*WORKLOADS, *(s.name for s in SCALED)]


def _scaled(name: str) -> ScaledWorkload | None:
    return next((s for s in (*SCALED, *ISOLATION_SCALED) if s.name == name), None)


def _cont(m: _Measured, name: str, label: str = "aps") -> dict[str, Any]:
    return _run(m.results["continuous"], name, label)


def _load(m: _Measured, name: str, label: str = "aps") -> float | None:
    """Throughput of a run on the continuous engine as a fraction of a full engine's."""
    full = m.full_engine_tps[name]
    tps = _cont(m, name, label)["overall"]["throughput_tokens_per_s"]
    return None if not full or tps is None else tps / full


def _ms(ms: float | None) -> str:
    """A short duration in prose: milliseconds, one decimal, with the unit."""
    return "n/a" if ms is None else f"{ms:.1f} ms"


def _list(items: list[str]) -> str:
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def _decode_step_ms(m: _Measured) -> tuple[float, float]:
    """A decode step at 512 tokens of context: of one sequence, and of ``max_sequences``, in ms."""
    d, e = m.deployment, m.configs["continuous"].engine
    return d.step_s((), 1, 512) * 1000, d.step_s((), e.max_sequences, e.max_sequences * 512) * 1000


def _peak_throughput(m: _Measured, engine: str) -> float:
    return max(s["overall"]["throughput_tokens_per_s"] or 0.0 for runs in m.results[engine].values() for s in runs)


def _continuous_intro(m: _Measured, config: Config) -> str:
    d, e = m.deployment, m.configs["continuous"].engine
    one, full = _decode_step_ms(m)
    scaled = "; ".join(f"`{s.name}`: `{s.workload}` with " + ", ".join(f"`{k}={v:g}`" for k, v in s.params.items())
                       + f" ({s.why})" for s in SCALED)
    return "\n".join([
        f"The same policies and workloads on {describe_engine(CONTINUOUS_ENGINE)}: `[engine] kind = "
        f"\"continuous\"`, `gpu = \"{e.gpu}\"`, `model = \"{e.model}\"`, the roofline model of "
        "[docs/engines.md](engines.md). It batches at the iteration level: a dispatched request joins the "
        "running batch at the next step, and a step takes milliseconds, not seconds (one sequence decoding "
        f"at 512 tokens of context: {one:.1f} ms; {e.max_sequences} of them: {full:.1f} ms). Its KV cache "
        f"holds {d.kv_capacity_tokens:,} tokens; at most {e.max_sequences} sequences run at once and a step "
        f"carries at most {e.max_batched_tokens:,} tokens. It costs ${d.price_per_hour_usd:.2f} per hour of "
        f"busy time, the `{e.gpu}` profile's price (the seed model charges "
        f"${config.gpu.price_per_hour_usd:.2f}). Reports: `research/continuous/<workload>/`.",
        "",
        "The seeds' workloads were sized for the seed GPU: the most it served in these runs is "
        f"{_peak_throughput(m, 'micro'):,.0f} output tokens/s, against {_peak_throughput(m, 'continuous'):,.0f} "
        "for this engine. To see contention on it, two scaled variants of the overload scenarios run on it too "
        f"(not on the seed engine; the built-in defaults are unchanged): {scaled}.",
    ])


def _continuous_load(m: _Measured) -> tuple[str, str, str]:
    """The load, utilisation and cost table, and the utilisation and cost verdicts (bullet, paragraph)."""
    micro = m.results["batch"]
    lines = []
    for name in _names():
        o = _cont(m, name)["overall"]
        e = _cont(m, name)["engine"]
        mo = _overall(micro, name, "aps") if name in micro else None
        lines.append(
            f"| `{name}` | " + (f"{_pct_cell(mo['gpu_utilization'])} | {_usd(mo['cost_per_1m_tokens_usd'])}"
                                if mo else "— | —")
            + f" | {o['throughput_tokens_per_s']:,.0f} | "
            + ("n/a" if m.full_engine_tps[name] is None else f"{m.full_engine_tps[name]:,.0f}")
            + f" | {_pct_cell(_load(m, name))} | {_pct_cell(o['gpu_utilization'])} | {_pct_cell(e['mfu'])} | "
            f"{_pct_cell(e['mbu'])} | {_usd(o['cost_per_1m_tokens_usd'])} | {_sec(o['queue_wait_ms']['p99'])} |")
    table = "\n".join([
        "| workload (`aps`) | seed engine: busy (%) | seed engine: cost per 1M tokens (USD) | continuous: "
        "throughput (tok/s) | a full engine (tok/s) | throughput / full engine (%) | busy (%) | MFU (%) | MBU (%) | "
        "cost per 1M tokens (USD) | p99 queue wait (s) |",
        "|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|", *lines,
    ])

    loads = {name: _load(m, name) for name in WORKLOADS}
    micro_busy = [_overall(micro, name, "aps")["gpu_utilization"] or 0.0 for name in WORKLOADS]
    # Under aps+fixed the window is one constant: which workloads never made a request wait longer?
    fixed = {name: _cont(m, name, "aps+fixed")["overall"] for name in WORKLOADS}
    window_ms = fixed[WORKLOADS[0]]["governor"]["mean_window_ms"]
    quiet = [name for name in WORKLOADS if (fixed[name]["queue_wait_ms"]["max"] or 0.0) <= window_ms + 1e-3]
    light = [name for name in WORKLOADS if loads[name] is not None and loads[name] < 0.5]
    heaviest = max(WORKLOADS, key=lambda n: loads[n] or 0.0)
    busy = [name for name in WORKLOADS if (_cont(m, name)["overall"]["gpu_utilization"] or 0) >= 0.95]
    busy_light = [name for name in busy if name in light]
    all_runs = [(name, s) for name in _names() for s in m.results["continuous"][name]]
    mfu_name, mfu_run = max(all_runs, key=lambda r: r[1]["engine"]["mfu"] or 0.0)
    mfus = [_cont(m, n)["engine"]["mfu"] for n in busy_light if _cont(m, n)["engine"]["mfu"] is not None]
    mbus = [_cont(m, n)["engine"]["mbu"] for n in busy_light if _cont(m, n)["engine"]["mbu"] is not None]
    scaled_loads = ", ".join(f"`{s.name}` {_pct(_load(m, s.name))}" for s in SCALED)
    utilisation = (
        f"On the continuous engine, {len(light)} of the {len(WORKLOADS)} seed workloads use less than half of "
        f"a full engine (the most loaded is `{heaviest}` at {_pct(loads[heaviest])}; a full engine is "
        f"{m.configs['continuous'].engine.max_sequences} sequences of the workload's mean request run together, "
        f"the roofline's static-batch estimate), against busy times of {_pct(min(micro_busy))} to "
        f"{_pct(max(micro_busy))} on the seed engine: "
        + ("under `aps+fixed`, no request of "
           + ("any of them" if len(quiet) == len(WORKLOADS) else _list([f'`{n}`' for n in quiet]))
           + f" waits longer than the {window_ms:g} ms batch window. " if quiet else "")
        + "The scaled variants reach "
        f"{scaled_loads} of a full engine, which is what an overload looks like: the measured ceiling agrees "
        "with the estimate. "
        + (f"Busy time stops measuring load: {_list([f'`{n}`' for n in busy_light])} keep the engine busy "
           f"{_pct(min(_cont(m, n)['overall']['gpu_utilization'] for n in busy_light))} of the time or more while "
           "it runs at a fraction of its capacity, because a continuous engine steps whenever one sequence "
           f"decodes; their MFU is {_pct(min(mfus))} to {_pct(max(mfus))}, their MBU {_pct(min(mbus))} to "
           f"{_pct(max(mbus))}: their steps are bound by memory bandwidth. " if busy_light and mfus and mbus else "")
        + f"MFU is the measure that means something here, and the highest measured is {_pct(mfu_run['engine']['mfu'])} "
        f"(`{mfu_run['label']}` on `{mfu_name}`, MBU {_pct(mfu_run['engine']['mbu'])}): the seeds' \"95% "
        "utilization\" is reached as busy time by a lightly loaded engine, and as FLOP utilization by no run, "
        "even overloaded.")
    util_bullet = (f"**Utilisation** changes meaning: busy time reads ≥ 95% on {len(busy)} of {len(WORKLOADS)} "
                   f"seed workloads, {len(busy_light)} of them at under half of a full engine; MFU, measured now, "
                   f"peaks at {_pct(mfu_run['engine']['mfu'])} overloaded.")

    d = m.deployment
    costs = [(name, s) for name, s in all_runs if s["overall"]["cost_per_1m_tokens_usd"] is not None]
    cheap_name, cheap = min(costs, key=lambda r: r[1]["overall"]["cost_per_1m_tokens_usd"])
    dear_name, dear = max(costs, key=lambda r: r[1]["overall"]["cost_per_1m_tokens_usd"])
    lowest = cheap["overall"]["cost_per_1m_tokens_usd"]
    seed_price = m.configs["batch"].gpu.price_per_hour_usd
    at_seed_price = lowest * seed_price / d.price_per_hour_usd
    floor_name = max((n for n in _names() if m.full_engine_tps[n]), key=lambda n: m.full_engine_tps[n])
    floor = d.price_per_hour_usd / 3600 / m.full_engine_tps[floor_name] * 1e6
    holds = lowest <= 0.53
    step_one, step_full = _decode_step_ms(m)
    micro_best = min(s["overall"]["cost_per_1m_tokens_usd"] for name in WORKLOADS for s in m.results["batch"][name]
                     if s["overall"]["cost_per_1m_tokens_usd"] is not None)
    cost = (
        f"Cost per 1M output tokens on the continuous engine runs from {_usd(lowest)} (`{cheap['label']}` on "
        f"`{cheap_name}`, {_pct(_load(m, cheap_name, cheap['label']))} of a full engine) to "
        f"{_usd(dear['overall']['cost_per_1m_tokens_usd'])} (`{dear['label']}` on `{dear_name}`, "
        f"{_pct(_load(m, dear_name, dear['label']))}), at the profile's ${d.price_per_hour_usd:.2f} per GPU-hour "
        f"(at the seeds' ${seed_price:.2f}, the lowest would be {_usd(at_seed_price)}). "
        + (f"The seeds' $0.53 is reached, which the seed engine could not do (its lowest: {_usd(micro_best)}), "
           "but only by an engine kept full: " if holds else
           f"The seeds' $0.53 is not reached even here (the seed engine's lowest: {_usd(micro_best)}); ")
        + f"a decode step of one sequence takes {step_one:.1f} ms and one of "
        f"{m.configs['continuous'].engine.max_sequences} sequences {step_full:.1f} ms, so an engine running few "
        "sequences pays for most of a step per token. A full engine of `" + floor_name + f"`'s mean request "
        f"({m.shapes[floor_name][0]} in / {m.shapes[floor_name][1]} out) would produce "
        f"{m.full_engine_tps[floor_name]:,.0f} tokens/s, {_usd(floor)} per 1M tokens. Cost is charged for busy "
        "time, as the seed model does; a GPU rented by the hour also costs its idle time, which these figures "
        "leave out.")
    cost_bullet = (f"**Cost per 1M tokens** changes: from {_usd(micro_best)} at best on the seed engine to "
                   f"{_usd(lowest)} at best here (at ${d.price_per_hour_usd:.2f}/GPU-hour), so the seeds' $0.53 "
                   + ("is reached, " if holds else "is still not reached, ")
                   + "but only with the engine full; lightly loaded, up to "
                   + f"{_usd(dear['overall']['cost_per_1m_tokens_usd'])}.")
    return (table, f"{util_bullet}\n- {cost_bullet}",
            "**Utilisation** (\"95% GPU utilization\").\n\n" + utilisation
            + "\n\n**Cost** (\"$0.53 per 1M tokens\").\n\n" + cost)


def _continuous_starvation(m: _Measured, alpha: float) -> tuple[str, str]:
    scaled = next(s for s in SCALED if s.workload == "vip-flood")
    labels = [s["label"] for s in m.results["batch"]["vip-flood"]]

    def worst(engine: str, name: str, label: str) -> float | None:
        return _overall(m.results[engine], name, label)["lowest_bidder"]["max_queue_wait_ms"]

    rows = [f"| `{label}` | {_sec(worst('micro', 'vip-flood', label))} | "
            f"{_sec(worst('continuous', 'vip-flood', label))} | {_sec(worst('continuous', scaled.name, label))} | "
            f"{_sec(_overall(m.results['continuous'], scaled.name, label)['queue_wait_ms']['p99'])} |"
            for label in labels]
    default_worst = max(worst("continuous", "vip-flood", label) or 0.0 for label in labels)
    params = _cont(m, "vip-flood")["workload"]["params"]
    gap = (params["vip_bid"] - params["free_bid"]) / alpha if alpha else math.inf

    def ranking(engine: str, name: str) -> list[str]:
        return sorted(labels, key=lambda label: (worst(engine, name, label) or 0.0, label))

    same = ranking("batch", "vip-flood") == ranking("continuous", scaled.name)
    st, ap, ff = (worst("continuous", scaled.name, x) for x in ("static", "aps", "fifo"))
    map_, mff = (worst("batch", "vip-flood", x) for x in ("aps", "fifo"))
    best = min(labels, key=lambda label: worst("continuous", scaled.name, label) or 0.0)
    text = (
        f"At the default rates the flood is {_pct(_load(m, 'vip-flood', 'fifo'))} of a full continuous engine, "
        f"and nobody starves: the bid-1 tenant's longest wait is {_s(default_worst)} under every policy "
        "(the batch window). "
        f"With `{scaled.name}` ({_pct(_load(m, scaled.name, 'fifo'))} of a full engine) the seed engine's "
        f"picture returns: static priority makes it wait {_s(st)} at worst, APS {_s(ap)} "
        f"({_change(ap, st)}), FIFO {_s(ff)}"
        + (f", `{best}` {_s(worst('continuous', scaled.name, best))}" if best not in ("static", "aps", "fifo") else "")
        + f"; {'the same ranking as' if same else 'a different ranking from'} the seed engine's. "
        f"APS's bound is in seconds of waiting, not in work: a bid-{params['free_bid']} request passes "
        f"bid-{params['vip_bid']} requests that arrived more than {gap:g} s after it (alpha = {alpha:g}), "
        f"whatever the engine's speed. Its excess over FIFO is {_s(ap - ff)} ({_change(ap, ff)}) here and "
        f"{_s(map_ - mff)} ({_change(map_, mff)}) on the seed engine: on a faster engine the same bound is a "
        f"larger share of the wait (`{report_dir('continuous', scaled.name).as_posix()}/queue_wait.png` shows "
        "every request's wait).")
    bullet = (f"**Starvation** needs an overload, which the seeds' `vip-flood` is not on this engine: the bid-1 "
              f"tenant waits at most {_s(default_worst)} under every policy. With `{scaled.name}` it returns, "
              f"and so do the seed engine's bounds: at worst static {_s(st)}, APS {_s(ap)}, FIFO {_s(ff)}"
              + (f", `{best}` {_s(worst('continuous', scaled.name, best))}" if best not in ("static", "aps", "fifo")
                 else "")
              + f" ({'the same' if same else 'not the same'} ranking as on the seed engine).")
    return bullet, "\n".join([
        "**Starvation** (the lowest bidder's longest queue wait).",
        "",
        f"| policy | seed engine `vip-flood` (s) | continuous `vip-flood` (s) | continuous `{scaled.name}` (s) | "
        f"`{scaled.name}` everyone's p99 wait (s) |",
        "|:---|---:|---:|---:|---:|", *rows, "",
        text,
    ])


def _continuous_governor(m: _Measured) -> tuple[str, str]:
    rows = []
    ttft_helped: list[str] = []
    latency_helped = {"batch": 0, "continuous": 0}
    zero_best: list[str] = []
    window_is_wait: list[str] = []
    for name in GOVERNOR_WORKLOADS:
        for engine in ("batch", "continuous"):
            e, f = _run(m.results[engine], name, "aps"), _run(m.results[engine], name, "aps+fixed")
            z = m.zero_window[engine][name]
            eo, fo, zo = e["overall"], f["overall"], z["overall"]
            g = eo["governor"]
            rows.append(
                f"| `{name}` | {'seed' if engine == 'micro' else 'continuous'} | {g['mean_entropy_bits']:.2f} | "
                f"{g['mean_window_ms']:.2f} | "
                f"{_sec(eo['queue_wait_ms']['p50'])} vs {_sec(fo['queue_wait_ms']['p50'])} | "
                f"{_sec(eo['ttft_ms']['p50'])} vs {_sec(fo['ttft_ms']['p50'])} "
                f"({_change(eo['ttft_ms']['p50'], fo['ttft_ms']['p50'])}) | "
                f"{_sec(eo['ttft_ms']['p99'])} vs {_sec(fo['ttft_ms']['p99'])} | "
                f"{_sec(eo['latency_ms']['p99'])} vs {_sec(fo['latency_ms']['p99'])} "
                f"({_change(eo['latency_ms']['p99'], fo['latency_ms']['p99'])}) | {_sec(zo['ttft_ms']['p50'])} |")
            if eo["latency_ms"]["p99"] < fo["latency_ms"]["p99"] * 0.95:
                latency_helped[engine] += 1
            if engine == "continuous":
                if eo["ttft_ms"]["p50"] < fo["ttft_ms"]["p50"] * 0.95:
                    ttft_helped.append(f"`{name}` {_change(eo['ttft_ms']['p50'], fo['ttft_ms']['p50'])}")
                if zo["ttft_ms"]["p50"] <= min(eo["ttft_ms"]["p50"], fo["ttft_ms"]["p50"]):
                    zero_best.append(f"`{name}`")
                if abs(fo["queue_wait_ms"]["p50"] - 10.0) < 0.5:
                    window_is_wait.append(name)
    overload = []
    for s in SCALED:
        e, f = _cont(m, s.name, "aps")["overall"], _cont(m, s.name, "aps+fixed")["overall"]
        overload.append(abs((e["latency_ms"]["p99"] - f["latency_ms"]["p99"]) / f["latency_ms"]["p99"]))
    n = len(GOVERNOR_WORKLOADS)
    text = (
        f"On the seed engine the entropy governor changed p99 latency by more than 5% on {latency_helped['micro']} "
        f"of {n} workloads: a batch takes seconds and the window at most 10 ms. On the continuous engine a "
        "request waits in the queue for the window and no longer while the engine has room"
        + (f" (with the fixed 10 ms window the median wait is 10 ms on {_list([f'`{w}`' for w in window_is_wait])})"
           if window_is_wait else "")
        + ", and the window is a step or more of added time to first token. There the entropy governor lowered "
        f"median TTFT by more than 5% on {len(ttft_helped)} of {n} workloads"
        + (f" ({_list(ttft_helped)})" if ttft_helped else "")
        + ": where arrivals are irregular its window is shorter than 10 ms; where they are regular (H = 0) it is "
        "10 ms and nothing changes. It is the shorter window that helps, not the reading: APS with a fixed 0 ms "
        f"window (last column; run for this paragraph only) has the lowest median TTFT on {len(zero_best)} of {n} "
        f"workloads on the continuous engine. p99 latency moved by more than 5% on {latency_helped['continuous']} "
        f"of {n} there, and by at most {max(overload) * 100:.1f}% under the scaled overloads: congestion is decided "
        "by load against capacity on both engines, and no window prevents it.")
    bullet = (f"**The entropy governor** now shows, in time to first token: it lowered median TTFT by more than "
              f"5% on {len(ttft_helped)} of {n} workloads (on the seed engine it moved p99 latency by more than 5% "
              f"on {latency_helped['micro']} of {n}), because its window is shorter than the fixed 10 ms; a fixed "
              f"0 ms window has the lowest median TTFT on {len(zero_best)} of {n}. It still prevents no congestion.")
    return bullet, "\n".join([
        "**The entropy governor** (`aps` with the entropy governor vs `aps+fixed`, a fixed 10 ms window).",
        "",
        "| workload | engine | mean entropy (bits) | mean window (ms) | p50 queue wait, entropy vs fixed (s) | "
        "p50 TTFT, entropy vs fixed (s) | p99 TTFT, entropy vs fixed (s) | p99 latency, entropy vs fixed (s) | "
        "p50 TTFT, fixed 0 ms (s) |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|", *rows, "",
        text,
    ])


def _continuous_fairness(m: _Measured) -> tuple[str, str]:
    scaled = next(s for s in SCALED if s.workload == "vtc-overload")
    during = m.overload[report_dir("continuous", scaled.name).as_posix()]
    runs = during["runs"]
    labels = list(runs)
    best = max(labels, key=lambda label: (runs[label]["jain"] or 0.0, label == "fifo"))
    fifo = runs["fifo"]
    tenants = list(fifo["tokens"])

    def ttfts(label: str) -> str:
        t = _cont(m, scaled.name, label)["tenants"]
        return " and ".join(f"{_s(t[name]['ttft_ms']['p50'])}" for name in tenants)

    line = (f"| `{scaled.name}`, served by t = {during['at']:.1f} s | "
            + " | ".join(_jain_cell(runs[label]["jain"]) for label in labels) + " |")
    better = (runs[best]["jain"] or 0.0) >= (fifo["jain"] or 0.0) + 0.005
    text = (
        f"At the last arrival of `{scaled.name}` (t = {during['at']:.1f} s), `fifo` had served "
        + " and ".join(f"`{t}` {n:,}" for t, n in fifo["tokens"].items())
        + f" output tokens (Jain {_jain_cell(fifo['jain'])}; median TTFT {ttfts('fifo')}). "
        + (f"`{best}` had served them " + " and ".join(f"{runs[best]['tokens'].get(t, 0):,}" for t in tenants)
           + f" (Jain {_jain_cell(runs[best]['jain'])}; median TTFT {ttfts(best)}): as on the seed engine, the "
           "most even service while the overload lasts. The seed engine's conclusion holds."
           if better else "No policy served them more evenly than FIFO while the overload lasted."))
    bullet = (f"**Fairness under overload** holds: on `{scaled.name}`, `{best}` served the tenants with Jain "
              f"{_jain_cell(runs[best]['jain'])} while the overload lasted, FIFO {_jain_cell(fifo['jain'])}."
              if better else f"**Fairness under overload**: no policy was more even than FIFO on `{scaled.name}`.")
    return bullet, "\n".join([
        "**Fairness while overloaded** (Jain's index of the tokens served by the last arrival, as above).",
        "",
        "| Jain's index | " + " | ".join(f"`{label}`" for label in labels) + " |",
        "|:---|" + "---:|" * len(labels), line, "",
        text,
    ])


def _continuous_section(m: _Measured, config: Config) -> list[str]:
    table, load_bullets, load_text = _continuous_load(m)
    alpha = float(config.policy.params.get("aps", {}).get("alpha", ApsParams().alpha))
    starvation_bullet, starvation = _continuous_starvation(m, alpha)
    governor_bullet, governor = _continuous_governor(m)
    fairness_bullet, fairness = _continuous_fairness(m)
    return [
        "## On a continuous engine: which conclusions change",
        "",
        _continuous_intro(m, config),
        "",
        "What changes, in short (each computed from the runs below):",
        "",
        f"- {load_bullets}",
        f"- {governor_bullet}",
        f"- {starvation_bullet}",
        f"- {fairness_bullet}",
        "",
        "Load, utilisation and cost, per workload, under `aps`:",
        "",
        table,
        "",
        load_text,
        "",
        starvation,
        "",
        governor,
        "",
        fairness,
        "",
    ]


# -- tenant isolation -----------------------------------------------------------------------------

def _isolation_names(engine: str) -> list[str]:
    """The isolation workloads' report names on ``engine``: the built-ins, or their scaled variants."""
    return list(ISOLATION_WORKLOADS) if engine == "batch" else [s.name for s in ISOLATION_SCALED]


def _engine_name(engine: str) -> str:
    return "seed" if engine == "batch" else engine


def _noisy_name(engine: str) -> str:
    return next(name for name in _isolation_names(engine) if name.startswith(NOISY))


def _steady(summary: dict[str, Any]) -> tuple[float | None, float | None]:
    """The steady tenant's p99 latency and p99 TTFT, in ms."""
    steady = summary["tenants"]["steady"]
    return steady["latency_ms"]["p99"], steady["ttft_ms"]["p99"]


def _ratio(new: float | None, old: float | None) -> str:
    return "n/a" if new is None or not old else f"{new / old:,.1f}×"


def _noisy_neighbor(m: _Measured) -> str:
    rows, verdicts = [], []
    for engine in ("batch", "continuous"):
        summaries = m.results[engine][_noisy_name(engine)]
        for s in summaries:
            (latency, ttft), (alone_latency, alone_ttft) = _steady(s), _steady(m.alone[engine][s["label"]])
            rows.append(f"| `{s['label']}` | {_engine_name(engine)} | {_sec(latency)} | {_sec(alone_latency)} | "
                        f"{_ratio(latency, alone_latency)} | {_sec(ttft)} | {_sec(alone_ttft)} | "
                        f"{_ratio(ttft, alone_ttft)} |")
        verdicts.append(_noisy_verdict(m, engine, summaries))
    return "\n".join([
        "**A noisy neighbour** (`noisy-neighbor`; on the continuous engine `" + _noisy_name("continuous") + "`). The "
        "steady tenant's p99 latency and p99 time to first token beside the neighbour's flood, and alone: the same "
        "workload with `neighbor_rate = 0`, so the very same steady arrivals (run for this table only).",
        "",
        "| policy | engine | steady p99 latency (s) | alone (s) | ratio | steady p99 TTFT (s) | alone (s) | ratio |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|", *rows, "",
        " ".join(verdicts),
    ])


def _noisy_verdict(m: _Measured, engine: str, summaries: list[dict[str, Any]]) -> str:
    """Which policy kept the steady tenant closest to its latency alone, against FIFO."""
    def latency(s: dict[str, Any]) -> float:
        return _steady(s)[0] or math.inf

    best = min(summaries, key=latency)
    tied = [f"`{s['label']}`" for s in summaries if latency(s) <= latency(best) * 1.005]
    fifo = next(s for s in summaries if s["label"] == "fifo")
    alone = [_steady(a)[0] for a in m.alone[engine].values()]
    return (f"On the {_engine_name(engine)} engine the steady tenant alone has a p99 latency of "
            f"{_s(min(alone))}" + (f" to {_s(max(alone))}" if max(alone) > min(alone) else "")
            + f"; beside the flood, `fifo` makes it {_s(_steady(fifo)[0])} and {_list(tied)} {_s(latency(best))}, "
            f"{_ratio(latency(best), _steady(m.alone[engine][best['label']])[0])} its latency alone, the lowest "
            "of the policies.")


def _service_difference_cell(summary: dict[str, Any]) -> str:
    d = summary["overall"]["service_difference"]
    if d["max"] is None:
        return "—"
    return f"{d['max']:,.0f} ({_f0(d['first_half_max'])}) / {d['mean']:,.0f}"


def _f0(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def _backlogged_rows(m: _Measured) -> list[tuple[str, str, list[dict[str, Any]]]]:
    """(engine, workload, summaries) of every workload with two tenants backlogged in some window."""
    names = {"batch": [*WORKLOADS, *_isolation_names("batch")],
             "continuous": [*_names(), *_isolation_names("continuous")]}
    return [(engine, name, m.results[engine][name]) for engine in ("batch", "continuous") for name in names[engine]
            if any(s["overall"]["service_difference"]["windows"] for s in m.results[engine][name])]


def _service_differences(m: _Measured) -> str:
    rows = _backlogged_rows(m)
    labels = [s["label"] for s in rows[0][2]]
    lowest = {label: 0 for label in labels}
    grew = {label: 0 for label in labels}
    lines = []
    for engine, name, summaries in rows:
        lines.append(f"| `{name}` | {_engine_name(engine)} | "
                     + " | ".join(_service_difference_cell(s) for s in summaries) + " |")
        d = {s["label"]: s["overall"]["service_difference"] for s in summaries}
        low = min(x["mean"] or 0.0 for x in d.values())
        for label, x in d.items():
            lowest[label] += (x["mean"] or 0.0) <= low * 1.005
            grew[label] += x["max"] is not None and x["first_half_max"] is not None \
                and x["max"] > 1.25 * x["first_half_max"]
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
        "by more than 25% on " + ", ".join(f"{grew[label]} under `{label}`" for label in labels)
        + ": a fair scheduler keeps the difference bounded however long the run lasts. Its maximum is often at "
        "the start of a backlog, where the service still comes from requests dispatched before it: on the "
        "continuous engine a request runs for seconds, hundreds at a time, so the maximum says less than the "
        "mean there.",
    ])


def _isolation_section(m: _Measured) -> list[str]:
    scaled = "; ".join(f"`{s.name}`: `{s.workload}` with " + ", ".join(f"`{k}={v:g}`" for k, v in s.params.items())
                       + f" ({s.why})" for s in ISOLATION_SCALED)
    return [
        "## Tenant isolation",
        "",
        "Five more workloads, where tenants compete for one engine: "
        + ", ".join(f"`{name}`" for name in ISOLATION_WORKLOADS) + " (a noisy neighbour, then the shapes of VTC's "
        "experiments, Sheng et al., \"Fairness in Serving Large Language Models\", OSDI '24, §5). They run with the "
        "built-in defaults on the seed engine and scaled on the continuous engine: " + scaled + ".",
        "",
        _noisy_neighbor(m),
        "",
        _service_differences(m),
        "",
    ]


# -- the document ---------------------------------------------------------------------------------

def _plugins_text(extra: tuple[str, ...], plugins: list[dict[str, Any]]) -> str:
    """Which installed plugins were loaded, with their versions, and which presets they added."""
    rule = ("`apsd research` loads installed plugins as the daemon does (`APSD_PLUGINS` applies) and runs "
            "their presets after the built-in policies")
    if not plugins:
        return f"{rule}; no third-party plugin was loaded when this file was generated."
    described = []
    for d in plugins:
        presets = sorted(d["provides"].get("presets", []))
        provides = ("presets " if len(presets) > 1 else "preset ") + ", ".join(f"`{p}`" for p in presets) \
            if presets else "no preset"
        described.append(f"plugin `{d['name']}` from {_distribution(d)} ({provides})")
    return (f"{rule}; plugins loaded for this file: " + "; ".join(described) + "."
            + ("" if extra else " None of them registers a preset, so only the built-in policies ran."))


def _distribution(plugin: dict[str, Any]) -> str:
    """"dist version" of a plugin described by :func:`~apsd.plugins.describe_plugins`."""
    if plugin["distribution"] is None:
        return "no installed distribution"
    return f"{plugin['distribution']} {plugin['version']}"


def _origin(plugins: list[dict[str, Any]]) -> dict[str, str]:
    """Preset name -> "plugin `x`, dist version"."""
    return {p: f"plugin `{d['name']}`, {_distribution(d)}" for d in plugins for p in d["provides"].get("presets", [])}


def _workload_sections(results: dict[str, list[dict[str, Any]]], engine: str, names: list[str],
                       image: str, what: str) -> list[str]:
    parts: list[str] = []
    for name in names:
        summaries = results[name]
        workload = summaries[0]["workload"]
        directory = report_dir(engine, name).as_posix()
        scaled = _scaled(name) if engine != "batch" else None
        description = workload["description"]
        if scaled is not None:
            description = (f"`{scaled.workload}` scaled: " + ", ".join(f"`{k}={v:g}`" for k, v in scaled.params.items())
                           + f", {scaled.why}. " + description)
        parts += [
            f"### `{name}`" + ("" if engine == "batch" else f" on the {engine} engine"),
            "",
            f"{description} ({workload['arrivals']} arrivals; details, per-tenant tables and "
            f"all plots: [{directory}/report.md]({directory}/report.md)).",
            "",
            format_summary_table(summaries),
            "",
            f"![{what}, {name}]({directory}/{image})",
            "",
        ]
    return parts


def _markdown(m: _Measured, config: Config, seed: int, extra: tuple[str, ...], plugins: list[dict[str, Any]]) -> str:
    micro = m.results["batch"]
    g = m.configs["batch"].gpu
    builtin = ", ".join(f"`{parse_policy_choice(p).label}`" for p in POLICIES)
    origin = _origin(plugins)
    presets = ", ".join(f"`{p}` ({origin.get(p, 'a plugin')})" for p in extra)
    subject = ("FIFO, static priority, APS, fair share and " + ", ".join(f"`{p}`" for p in extra)
               if extra else "FIFO, static priority, APS and fair share")
    parts = [
        f"# apsd research: {subject} on the seeds' workloads and tenant isolation",
        "",
        "Generated by `apsd research` (this file and `research/`); every number below was measured by "
        "running apsd's own admission, scheduler, policies and simulated engines in virtual time "
        f"(`apsd simulate`), with workload seed {seed}. Same seed and same installed plugins, same bytes.",
        "",
        "Two engines. The seed engine is "
        f"{describe_engine({'kind': 'batch', 'count': m.configs['batch'].engine.count})}: prefill "
        f"{g.prefill_tokens_per_s:g} tokens/s, batch decode {g.decode_tokens_per_s:g}·({g.decode_batch_base:g} + "
        f"{g.decode_batch_sqrt:g}·√b) tokens/s, ${g.price_per_hour_usd:.2f}/hour of busy time, fixed batches of "
        "up to "
        f"{int(config.policy.params.get('micro', {}).get('max_batch_size', 16))} requests. The continuous engine is "
        f"{describe_engine(CONTINUOUS_ENGINE)}, described below. Tenants are not rate-limited in these runs, so the "
        "comparison measures scheduling alone.",
        "",
        f"Policies run: the built-in {builtin} (`aps` uses the entropy governor, `aps+fixed` a fixed 10 ms "
        "window, `fair` the weighted fair share between tenants with APS order inside each)"
        + (f", then the installed plugins' presets: {presets}" if extra else "") + ". "
        + _plugins_text(extra, plugins),
        "",
        "## What the seeds claim, and what apsd measures on the seed engine",
        "",
        _claim_utilization(micro), "",
        _claim_cost(micro, config), "",
        _claim_fairness(micro, m.overload[report_dir("batch", "vtc-overload").as_posix()], extra), "",
        _claim_starvation(micro, extra, _origin(plugins)), "",
        _claim_governor(micro), "",
        _claim_lazy_aging(), "",
        *_continuous_section(m, config),
        *_isolation_section(m),
        "## The workloads on the seed engine",
        "",
        *_workload_sections(micro, "batch", list(WORKLOADS), "queue_wait.png", "queue wait against arrival time"),
        *_workload_sections(micro, "batch", _isolation_names("batch"), "service_difference.png",
                            "service difference between backlogged tenants"),
        "## The workloads on the continuous engine",
        "",
        *_workload_sections(m.results["continuous"], "continuous", _names(), "ttft_cdf.png",
                            "time to first token"),
        *_workload_sections(m.results["continuous"], "continuous", _isolation_names("continuous"),
                            "service_difference.png", "service difference between backlogged tenants"),
    ]
    return "\n".join(parts).rstrip() + "\n"
