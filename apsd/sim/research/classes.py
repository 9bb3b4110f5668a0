"""Service classes under overload, in virtual time (``apsd research --classes``).

Two tenants of equal weight share one continuous engine with the shipped ``[engine]`` defaults
(llama-3-8b on an a100-80gb, 256 sequences, isolation on: :func:`study_config` changes only the kind).
Each sends the same mix: a fifth of its requests in the tight class ``interactive`` (``ttft_s = 1``,
``refuse``) and the rest in the loose class ``batch`` (``ttft_s = 30``, ``best_effort``), every request
a 512-token prompt for 128 tokens, Poisson arrivals at twice what the engine completes
(:func:`capacity`: its steady completion rate under a flood of the same requests).

The same arrivals run twice under ``fair``: with the classes configured, and without any (the same
requests, measured against the classes they would have had). Figures per class: met, missed,
refused (``deadline_unmeetable``), and attainment = met / requests (:mod:`apsd.sim.report.classes`).
What is claimed: with classes the tight class's attainment is at least :data:`TIGHT_TARGET` while the
loose class absorbs the overload. The engine holds far more work than one second of it (256 sequences):
the tight class holds because the engine orders prompts by deadline and a tight request takes the
place of a looser prompt of its own tenant (:mod:`apsd.engines.continuous`, service classes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import numpy as np

from apsd.core.config import Config, ServiceClassConfig, TenantConfig
from apsd.sim.records import Arrival, PolicyRun, Workload
from apsd.sim.report.classes import ClassAttainment, class_attainment
from apsd.sim.runner import parse_policy_choice, run_policy

__all__ = ["CLASSES", "TIGHT_TARGET", "ClassesResult", "capacity", "classes_document", "classes_markdown",
           "class_workload", "run_classes_study", "study_config"]

#: The classes of the study.
CLASSES = {"interactive": ServiceClassConfig(ttft_s=1.0),
           "batch": ServiceClassConfig(ttft_s=30.0, on_miss="best_effort")}
#: The tight class's attainment the study must show with classes.
TIGHT_TARGET = 0.95
PRESET = "fair"
TENANTS = ("tenant_a", "tenant_b")
PROMPT_TOKENS, OUTPUT_TOKENS = 512, 128


@attrs.frozen
class ClassesResult:
    """The study's figures: the same arrivals with and without classes."""

    capacity: float
    rate: float
    duration: float
    tight_share: float
    overload: float
    with_classes: list[ClassAttainment]
    without_classes: list[ClassAttainment]

    def attainment(self, name: str, classes: bool = True) -> float | None:
        rows = self.with_classes if classes else self.without_classes
        return next(r.attainment for r in rows if r.name == name)


def study_config(base: Config) -> Config:
    """``base`` with one continuous engine of its ``[engine]`` settings (the shipped defaults unless
    ``base`` changes them: 256 sequences, isolation on)."""
    return attrs.evolve(base, engine=attrs.evolve(base.engine, kind="continuous", count=1))


_config = study_config


def _tenants(classes: bool) -> dict[str, TenantConfig]:
    names = tuple(CLASSES) if classes else ()
    return {name: TenantConfig(rate=1e6, burst=10**9, classes=names) for name in TENANTS}


def class_workload(rate: float, duration: float, tight_share: float, seed: int, classes: bool = True) -> Workload:
    """Poisson arrivals at ``rate`` over the two tenants, ``tight_share`` of them ``interactive``."""
    rng = np.random.default_rng(seed)
    count = rng.poisson(rate * duration)
    times = np.sort(rng.uniform(0.0, duration, count))
    tenants = rng.integers(0, len(TENANTS), count)
    tight = rng.random(count) < tight_share
    arrivals = tuple(Arrival(at=float(t), tenant=TENANTS[int(k)], prompt_tokens=PROMPT_TOKENS,
                             output_tokens=OUTPUT_TOKENS, bid=5,
                             service_class=("interactive" if is_tight else "batch") if classes else None)
                     for t, k, is_tight in zip(times, tenants, tight))
    return Workload(name="service-classes", description=f"{len(TENANTS)} tenants, {tight_share:.0%} interactive",
                    arrivals=arrivals, tenants=_tenants(classes),
                    params={"rate": rate, "duration": duration, "tight_share": tight_share}, seed=seed)


def capacity(base: Config, seed: int = 1) -> float:
    """Requests per model second the engine completes under a flood of the study's requests (the
    middle half of a 60-second run at 100 arrivals/s)."""
    run = run_policy(class_workload(100.0, 60.0, 0.0, seed, classes=False), parse_policy_choice(PRESET),
                     base_config=_config(base))
    finished = sorted(r.finished_at for r in run.requests if r.outcome == "completed" and r.finished_at is not None)
    a, b = len(finished) // 4, 3 * len(finished) // 4
    return (b - a) / (finished[b] - finished[a])


def run_classes_study(base: Config | None = None, *, duration: float = 120.0, seed: int = 1,
                      overload: float = 2.0, tight_share: float = 0.2,
                      progress: Callable[[str], None] | None = None) -> ClassesResult:
    """Run the study (the module docstring); ``duration`` in model seconds."""
    base = _config(base or Config())
    full = capacity(base, seed)
    rate = overload * full
    runs: dict[bool, PolicyRun] = {}
    for classes in (True, False):
        if progress is not None:
            progress(f"fair {'with' if classes else 'without'} classes")
        config = attrs.evolve(base, classes=dict(CLASSES) if classes else {})
        runs[classes] = run_policy(class_workload(rate, duration, tight_share, seed, classes),
                                   parse_policy_choice(PRESET), base_config=config)
    labels = [a.service_class for a in class_workload(rate, duration, tight_share, seed).arrivals]
    return ClassesResult(capacity=full, rate=rate, duration=duration, tight_share=tight_share, overload=overload,
                         with_classes=class_attainment(runs[True], CLASSES, labels),
                         without_classes=class_attainment(runs[False], CLASSES, labels))


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def classes_markdown(result: ClassesResult, base: Config | None = None) -> str:
    """The study's table: each class with and without classes, side by side."""
    base = _config(base or Config())
    tight, loose = CLASSES["interactive"], CLASSES["batch"]
    engine = base.engine
    lines = [f"Two tenants of equal weight on one continuous engine with the shipped defaults ({engine.model} on "
             f"{engine.gpu}, at most {engine.max_sequences} sequences, isolation "
             f"{'on' if engine.isolation else 'off'}), `{PRESET}` queue. Every request is a {PROMPT_TOKENS}-token "
             f"prompt for {OUTPUT_TOKENS} tokens; {result.tight_share:.0%} of each tenant's requests are "
             f"`interactive` (ttft_s {tight.ttft_s:g}, {tight.on_miss}), the rest `batch` (ttft_s {loose.ttft_s:g}, "
             f"best effort). Arrivals: {result.rate:.1f}/s, {result.overload:g}x the "
             f"{result.capacity:.1f} requests/s the engine completes, for {result.duration:g} model seconds.", "",
             "| class | requests | with classes: met | missed | refused | attainment "
             "| without classes: met | missed | attainment |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w, wo in zip(result.with_classes, result.without_classes):
        lines.append(f"| `{w.name}` (ttft_s {w.ttft_s:g}, {w.on_miss}) | {w.requests} | {w.met} | {w.missed} "
                     f"| {w.refused} | **{_percent(w.attainment)}** | {wo.met} | {wo.missed} "
                     f"| {_percent(wo.attainment)} |")
    attained = result.attainment("interactive")
    verdict = "holds" if attained is not None and attained >= TIGHT_TARGET else "does NOT hold"
    lines += ["", f"The tight class's attainment with classes is {_percent(attained)}: the target of "
              f"{TIGHT_TARGET:.0%} {verdict}. Attainment counts every request of the class (met / requests)."]
    return "\n".join(lines) + "\n"


def classes_document(result: ClassesResult, *, duration: float, seed: int) -> str:
    """``research/service-classes.md``."""
    return "\n".join([
        "# Service classes under overload", "",
        f"Generated by `apsd research --classes --duration {duration:g} --seed {seed}` (virtual time; the "
        "figures are the simulator's, on the roofline model of the continuous engine). How classes work: "
        "[docs/how-to/service-classes.md](../how-to/service-classes.md).", "",
        classes_markdown(result)])


def summary_lines(result: ClassesResult) -> Sequence[str]:
    """What ``apsd research --classes`` prints."""
    out = [f"capacity {result.capacity:.2f} req/s, arrivals {result.rate:.2f}/s ({result.overload:g}x)",
           f"{'class':<12} {'with classes':>14} {'without':>10}"]
    for w, wo in zip(result.with_classes, result.without_classes):
        out.append(f"{w.name:<12} {_percent(w.attainment):>14} {_percent(wo.attainment):>10}")
    return out
