"""Routing in virtual time: ``least-loaded``, ``prefix`` and ``prefix-hash`` between several continuous
engines with prefix caches, on workloads with shared prefixes (``apsd research --routing``).

Each case is a built-in workload (:mod:`apsd.sim.workloads`) on ``engines`` continuous engines (the
default ``[engine]`` profile: llama-3-8b on an a100-80gb) at a stated load. *Load* is the arrival rate
over the engines' capacity **without** a prefix cache (:func:`capacity`: their steady completion rate
when flooded by the same mix with ``prefix_cache = false``), so 80% load means the engines would be
80% busy if nothing were cached; what a cache saves is then what routing wins.

Cases:

* ``zipf``: ``shared-prefixes`` with a population of prefixes twice what one engine's KV cache holds
  (Zipf popularity), at 80% load. The routing policy that keeps each prefix on one engine lets the four
  caches hold the population between them; spreading every prefix over every engine makes each cache
  hold what it can of all of them.
* ``small``: ``shared-prefixes`` with four prefixes (they fit every engine's cache) at 20% load: the
  case where pinning has nothing to win and a router must not lose by it.
* ``multi-turn``: ``multi-turn`` conversations at 80% load: each turn's prompt is the conversation so
  far, cached where the turn before ran.

Figures per case and policy: mean, p50 and p99 time to first token, the share of prompt tokens the
engines found cached (their own count: ``request.cached_tokens``), and the routing reasons.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from apsd.core.config import Config
from apsd.engines import deployment_for
from apsd.sim.records import PolicyRun
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.workloads import build_workload

__all__ = ["ROUTING_POLICIES", "RoutingCase", "RoutingRow", "capacity", "routing_cases", "routing_document",
           "routing_markdown", "run_routing_study"]

ROUTING_POLICIES = ("least-loaded", "prefix", "prefix-hash")
#: The queue policy every case runs under (routing decides where, it decides when).
PRESET = "fair"


@attrs.frozen
class RoutingCase:
    """One workload at one load: ``params`` are the workload's, its ``rate`` set from ``load``."""

    name: str
    workload: str
    params: dict[str, Any]
    load: float
    description: str


@attrs.frozen
class RoutingRow:
    """One case under one routing policy."""

    case: str
    policy: str
    requests: int
    completed: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    #: Prompt tokens the engines found in their prefix caches / all prompt tokens (completed requests).
    hit_rate: float
    reasons: dict[str, int]
    rate: float


def engines_config(base: Config, engines: int, policy: str, prefix_cache: bool = True) -> Config:
    return attrs.evolve(base, engine=attrs.evolve(base.engine, kind="continuous", count=engines,
                                                  prefix_cache=prefix_cache),
                        routing=attrs.evolve(base.routing, policy=policy))


def capacity(workload: str, params: dict[str, Any], base: Config, engines: int, seed: int = 1) -> float:
    """Requests per model second the engines complete when flooded by ``workload``'s mix with no prefix
    cache: the steady rate between the first and last quarter of the completions of a run whose arrival
    rate they cannot keep up with (the rate is raised until they cannot)."""
    rate = params["rate"] * 4
    for _ in range(6):
        flood = {**params, "rate": rate, "duration": 60.0}
        run = run_policy(build_workload(workload, flood, seed=seed), parse_policy_choice(PRESET),
                         base_config=engines_config(base, engines, "least-loaded", prefix_cache=False))
        finished = sorted(r.finished_at for r in run.requests
                          if r.outcome == "completed" and r.finished_at is not None)
        a, b = len(finished) // 4, 3 * len(finished) // 4
        if b > a and finished[b] > finished[a]:
            served = (b - a) / (finished[b] - finished[a])
            if served < 0.7 * len(run.requests) / 60.0:   # it fell behind: that is its capacity
                return served
        rate *= 3
    raise RuntimeError(f"capacity of {workload}: the engines kept up with every rate tried")


def routing_cases(base: Config, *, duration: float = 600.0) -> list[RoutingCase]:
    """The three cases (the module docstring), sized from ``base``'s ``[engine]`` deployment."""
    kv = deployment_for(base).kv_capacity_tokens
    prefix_tokens = 4096
    population = math.ceil(2 * kv / prefix_tokens)
    return [
        RoutingCase("zipf", "shared-prefixes",
                    {"duration": duration, "rate": 1.0, "prefixes": population, "prefix_tokens": prefix_tokens},
                    0.8, f"{population} prefixes of {prefix_tokens:,} tokens (2x one engine's {kv:,}-token KV cache), "
                    "Zipf popularity, 128 tokens of each request's own, 64 out"),
        RoutingCase("small", "shared-prefixes",
                    {"duration": duration, "rate": 1.0, "prefixes": 4, "prefix_tokens": prefix_tokens},
                    0.2, f"4 prefixes of {prefix_tokens:,} tokens (they fit every engine's cache), 128 of its own, 64 out"),
        RoutingCase("multi-turn", "multi-turn", {"duration": duration, "rate": 0.2},
                    0.8, "conversations of 6 turns: a 2,048-token system prompt, 128-token questions and answers"),
    ]


def run_routing_study(base: Config | None = None, *, engines: int = 4, duration: float = 600.0, seed: int = 1,
                      policies: Sequence[str] = ROUTING_POLICIES, cases: Sequence[str] | None = None,
                      progress: Callable[[str], None] | None = None) -> list[RoutingRow]:
    """Every case under every policy, on the same arrivals (per case); rows in that order."""
    base = base or Config()
    rows = []
    for case in routing_cases(base, duration=duration):
        if cases is not None and case.name not in cases:
            continue
        per_arrival = case.params.get("turns", 6) if case.workload == "multi-turn" else 1
        full = capacity(case.workload, case.params, base, engines, seed=seed) / per_arrival
        params = {**case.params, "rate": case.load * full * case.params["rate"]}
        workload = build_workload(case.workload, params, seed=seed)
        for policy in policies:
            if progress is not None:
                progress(f"{case.name} {policy}")
            run = run_policy(workload, parse_policy_choice(PRESET), base_config=engines_config(base, engines, policy))
            rows.append(_row(case.name, policy, run, params["rate"]))
    return rows


def _row(case: str, policy: str, run: PolicyRun, rate: float) -> RoutingRow:
    done = [r for r in run.requests if r.outcome == "completed" and r.ttft is not None]
    ttft = np.array([r.ttft for r in done]) * 1000.0
    prompt = sum(r.prompt_tokens for r in done)
    reasons = Counter(r.route.split("reason=")[1] for r in done if r.route)
    return RoutingRow(case=case, policy=policy, requests=len(run.requests), completed=len(done),
                      ttft_mean_ms=float(ttft.mean()) if done else math.nan,
                      ttft_p50_ms=float(np.median(ttft)) if done else math.nan,
                      ttft_p99_ms=float(np.percentile(ttft, 99)) if done else math.nan,
                      hit_rate=sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
                      reasons=dict(sorted(reasons.items())), rate=rate)


def routing_markdown(rows: Sequence[RoutingRow], base: Config | None = None, *, engines: int = 4) -> str:
    """The study as a Markdown section: a table per case, and each case's ratio of mean TTFT to
    ``least-loaded``'s."""
    base = base or Config()
    lines = [f"{engines} continuous engines ({base.engine.model} on {base.engine.gpu}), prefix caches on, "
             f"`{PRESET}` queue. Load is the arrival rate over the engines' capacity with no prefix cache.", ""]
    described = {c.name: c for c in routing_cases(base)}
    for case in dict.fromkeys(r.case for r in rows):
        mine = [r for r in rows if r.case == case]
        baseline = next((r for r in mine if r.policy == "least-loaded"), None)
        c = described[case]
        lines += [f"**{case}**: {c.description}; {c.load:.0%} load ({mine[0].rate:.2f} arrivals/s).", "",
                  "| routing | requests | TTFT mean | p50 | p99 | vs least-loaded | cached prompt tokens | reasons |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in mine:
            ratio = f"{baseline.ttft_mean_ms / r.ttft_mean_ms:.2f}x lower" if baseline else ""
            if baseline is r:
                ratio = "1"
            reasons = ", ".join(f"{k} {v}" for k, v in r.reasons.items())
            lines.append(f"| {r.policy} | {r.completed}/{r.requests} | {r.ttft_mean_ms:.0f} ms | {r.ttft_p50_ms:.0f} ms "
                         f"| {r.ttft_p99_ms:.0f} ms | {ratio} | {r.hit_rate:.0%} | {reasons} |")
        lines.append("")
    return "\n".join(lines)


def routing_document(rows: Sequence[RoutingRow], *, duration: float, seed: int, engines: int = 4) -> str:
    """``research/routing.md``: how it was made, then :func:`routing_markdown`."""
    return "\n".join([
        "# Routing between engines with prefix caches", "",
        f"Generated by `apsd research --routing --duration {duration:g} --seed {seed}` "
        "(virtual time; the figures are the simulator's, on the roofline model of the continuous engine). "
        "How the policies decide: [docs/explanation/routing.md](../explanation/routing.md).", "",
        routing_markdown(rows, engines=engines)])
