"""Running the suite: :func:`write_research` measures every comparison, writes its report, then
research.md; :func:`open_report_writer` writes the reports, in worker processes when they have plots."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from apsd.core.config import Config
from apsd.engines import deployment_for
from apsd.plugins import describe_plugins, load_policy_registry, load_profile_registry, make_plugin_manager
from apsd.sim.records import PolicyRun, Workload
from apsd.sim.report import summarize, write_report
from apsd.sim.research.document import research_markdown
from apsd.sim.research.measured import (
    Comparison,
    Measured,
    OverloadService,
    full_engine_tps,
    mean_shape,
    service_during_overload,
)
from apsd.sim.research.suite import (
    ALONE,
    BATCH,
    CONTINUOUS,
    GOVERNOR_WORKLOADS,
    ISOLATION_SCALED,
    ISOLATION_WORKLOADS,
    NOISY,
    POLICIES,
    SCALED,
    WORKLOADS,
    ZERO_WINDOW,
    engine_configs,
    plugin_presets,
    report_dir,
)
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.workloads import build_workload

__all__ = ["MAX_REPORT_WORKERS", "open_report_writer", "write_research"]

#: Most worker processes drawing the reports' plots at once (one per CPU, up to this).
MAX_REPORT_WORKERS = 8


def write_research(out_dir: Path, *, seed: int = 1, config: Config | None = None,
                   progress: Callable[[int], None] | None = None, plugin_manager: Any = None,
                   plots: bool = True) -> Path:
    """Run the suite and write ``out_dir/research.md`` (+ ``out_dir/research/``); returns its path.

    ``config`` (default: the embedded defaults) gives queue limits and policy parameters; its
    ``[engine]`` is replaced by each engine's (:func:`~apsd.sim.research.suite.engine_configs`).
    ``plugin_manager`` defaults to the daemon's (installed plugins, ``APSD_PLUGINS`` applies): its
    plugins' presets run after :data:`~apsd.sim.research.suite.POLICIES`. Raises
    :class:`~apsd.plugins.PluginError` for a plugin that fails to load or build,
    :class:`~apsd.core.config.ConfigError` for an engine profile the plugins do not provide.
    """
    config = config or Config()
    pm = plugin_manager or make_plugin_manager()
    registry = load_policy_registry(pm)
    extra = plugin_presets(registry)
    plugins = [d for d in describe_plugins(pm, registry) if not d["builtin"]]
    choices = [parse_policy_choice(p) for p in (*POLICIES, *extra)]
    configs = engine_configs(config)
    deployment = deployment_for(configs[CONTINUOUS], load_profile_registry(pm))
    results: dict[str, dict[str, Comparison]] = {engine: {} for engine in configs}
    overload: dict[str, OverloadService] = {}
    zero_window: dict[str, dict[str, Any]] = {engine: {} for engine in configs}
    alone: dict[str, Comparison] = {}
    full: dict[str, float | None] = {}
    shapes: dict[str, tuple[int, int]] = {}

    def run_all(engine: str, workload: Workload) -> list[PolicyRun]:
        return [run_policy(workload, choice, base_config=configs[engine], plugin_manager=pm, progress=progress)
                for choice in choices]

    def run(engine: str, name: str, workload: Workload, title: str) -> None:
        runs = run_all(engine, workload)
        directory = report_dir(engine, name)
        write(runs, out_dir / directory, title)
        results[engine][name] = Comparison(tuple(summarize(r) for r in runs))
        if workload.name == "vtc-overload":
            overload[directory.as_posix()] = service_during_overload(runs)
        if workload.name == NOISY:
            alone[engine] = Comparison(tuple(summarize(r) for r in run_all(engine, _alone(workload))))

    def measure_shape(name: str, workload: Workload) -> None:
        shapes[name] = mean_shape(workload)
        full[name] = full_engine_tps(deployment, configs[CONTINUOUS], shapes[name])

    with open_report_writer(plots) as write:
        for name in WORKLOADS:
            workload = build_workload(name, None, seed=seed)
            measure_shape(name, workload)
            run(BATCH, name, workload, f"apsd research: {name}")
            run(CONTINUOUS, name, workload, f"apsd research: {name} on the continuous engine")
            if name in GOVERNOR_WORKLOADS:
                for engine, base in configs.items():
                    zero = _with_fixed_window(base, 0.0)
                    zero_window[engine][name] = summarize(run_policy(workload, ZERO_WINDOW, base_config=zero,
                                                                     plugin_manager=pm, progress=progress))
        for name in ISOLATION_WORKLOADS:
            run(BATCH, name, build_workload(name, None, seed=seed), f"apsd research: {name}")
        for variant in (*SCALED, *ISOLATION_SCALED):
            workload = build_workload(variant.workload, variant.params, seed=seed)
            measure_shape(variant.name, workload)
            run(CONTINUOUS, variant.name, workload,
                f"apsd research: {variant.name}, {variant.workload} scaled for the continuous engine")
    measured = Measured(results=results, overload=overload, zero_window=zero_window, alone=alone,
                        full_engine_tps=full, shapes=shapes, configs=configs, deployment=deployment)
    path = out_dir / "research.md"
    path.write_text(research_markdown(measured, config, seed, extra, plugins), encoding="utf-8")
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
        def write_now(runs: list[PolicyRun], directory: Path, title: str) -> None:
            write_report(runs, directory, title=title, plots=plots)
        yield write_now
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
