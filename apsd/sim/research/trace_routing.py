"""Routing on a Mooncake-format trace (``apsd research --routing``, its last section).

A trace with the structure of Mooncake's conversation trace (:mod:`apsd.sim.traces.synthetic`: about
12,000-token prompts, conversations whose turns repeat the blocks of the turn before, system prompts
shared with a Zipf popularity, one-off documents) is written to a temporary file, read back as a trace
(:func:`apsd.sim.traces.load_trace`: its ``hash_ids`` become the requests' routing keys and the engines'
cache blocks, 512 tokens each) and replayed at its own arrival times between :data:`ENGINES` continuous
engines serving a long-context model (:data:`MODEL`), under each routing policy, with the ``fair`` queue.

Figures per policy: time to first token, the share of prompt tokens the engines found cached, and that
share over what an infinite cache would hold (:func:`apsd.sim.traces.reuse.infinite_cache_share`: the
trace's own block reuse). The claim (:data:`REUSE_TARGET`): ``prefix`` routing keeps at least 70% of
the trace's reuse, and its mean time to first token is below ``least-loaded``'s.
"""

from __future__ import annotations

import math
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import attrs
import numpy as np

from apsd.core.config import Config
from apsd.sim.records import PolicyRun
from apsd.sim.research.routing import PRESET, ROUTING_POLICIES
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.traces import load_trace
from apsd.sim.traces.reuse import infinite_cache_share
from apsd.sim.traces.synthetic import MooncakeShape, write_mooncake_trace

__all__ = ["ENGINES", "MODEL", "REUSE_TARGET", "TraceRouting", "TraceRoutingRow", "run_trace_routing",
           "trace_routing_config", "trace_routing_markdown"]

ENGINES = 4
#: A Mooncake prompt (12,000 tokens on average, up to 30,000) needs a long context.
MODEL = "llama-3.1-8b"
#: ``prefix`` routing's cached share must reach this much of the infinite cache's.
REUSE_TARGET = 0.70


@attrs.frozen
class TraceRoutingRow:
    policy: str
    requests: int
    completed: int
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    #: Cached prompt tokens / prompt tokens of the completed requests.
    cached_share: float
    gpu_utilization: float
    reasons: dict[str, int]


@attrs.frozen
class TraceRouting:
    shape: MooncakeShape
    seed: int
    engines: int
    model: str
    gpu: str
    #: The trace's own reuse: what an infinite cache would hold.
    infinite_share: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    span_s: float
    rows: tuple[TraceRoutingRow, ...]

    def row(self, policy: str) -> TraceRoutingRow:
        return next(r for r in self.rows if r.policy == policy)


def trace_routing_config(base: Config, policy: str, engines: int = ENGINES) -> Config:
    """``base`` with ``engines`` continuous engines of :data:`MODEL`, prefix caches on, routed by ``policy``."""
    return attrs.evolve(base, engine=attrs.evolve(base.engine, kind="continuous", count=engines, model=MODEL,
                                                  prefix_cache=True),
                        routing=attrs.evolve(base.routing, policy=policy))


def run_trace_routing(base: Config | None = None, *, requests: int = 12_000, seed: int = 1, engines: int = ENGINES,
                      policies: Sequence[str] = ROUTING_POLICIES,
                      progress: Callable[[str], None] | None = None) -> TraceRouting:
    """The study (the module docstring) on a generated trace of ``requests`` requests from ``seed``."""
    base = base or Config()
    shape = MooncakeShape(requests=requests)
    with tempfile.TemporaryDirectory(prefix="apsd-trace-") as directory:
        workload = load_trace(write_mooncake_trace(Path(directory) / "mooncake-shaped.jsonl", shape, seed=seed))
    arrivals = list(workload.arrivals)
    rows = []
    for policy in policies:
        if progress is not None:
            progress(f"mooncake-shaped trace, {policy}")
        config = trace_routing_config(base, policy, engines)
        rows.append(_row(policy, run_policy(workload, parse_policy_choice(PRESET), base_config=config)))
    return TraceRouting(shape=shape, seed=seed, engines=engines, model=MODEL, gpu=base.engine.gpu,
                        infinite_share=infinite_cache_share(arrivals),
                        mean_prompt_tokens=float(np.mean([a.prompt_tokens for a in arrivals])),
                        mean_output_tokens=float(np.mean([a.output_tokens for a in arrivals])),
                        span_s=arrivals[-1].at - arrivals[0].at, rows=tuple(rows))


def _row(policy: str, run: PolicyRun) -> TraceRoutingRow:
    done = [r for r in run.requests if r.outcome == "completed" and r.ttft is not None]
    ttft = np.array([r.ttft for r in done]) * 1000.0
    prompt = sum(r.prompt_tokens for r in done)
    reasons = Counter(r.route.split("reason=")[1] for r in done if r.route)
    engines = max(1, len(run.engines))
    return TraceRoutingRow(policy=policy, requests=len(run.requests), completed=len(done),
                           ttft_mean_ms=float(ttft.mean()) if done else math.nan,
                           ttft_p50_ms=float(np.median(ttft)) if done else math.nan,
                           ttft_p99_ms=float(np.percentile(ttft, 99)) if done else math.nan,
                           cached_share=sum(r.cached_tokens for r in done) / prompt if prompt else 0.0,
                           gpu_utilization=run.busy_s / (engines * run.duration_s) if run.duration_s else 0.0,
                           reasons=dict(sorted(reasons.items())))


def trace_routing_markdown(result: TraceRouting) -> str:
    """The section: the trace, a table per policy, and the claim's verdict."""
    s = result.shape
    lines = [f"**mooncake-shaped trace**: {s.requests:,} requests in Mooncake's format (a generated trace with the "
             f"structure of its conversation trace; the published traces cannot be downloaded here: "
             f"`apsd.sim.traces.synthetic`, seed {result.seed}), replayed at their own times over "
             f"{result.span_s / 60:.0f} minutes: mean prompt {result.mean_prompt_tokens:,.0f} tokens, mean output "
             f"{result.mean_output_tokens:,.0f}; `hash_ids` of {s.block_tokens} tokens are the routing keys and the "
             f"engines' cache blocks. {result.engines} continuous engines ({result.model} on {result.gpu}). An infinite "
             f"cache would hold {result.infinite_share:.1%} of the prompt tokens (the trace's own reuse).", "",
             "| routing | requests | TTFT mean | p50 | p99 | vs least-loaded | cached prompt tokens | of an infinite "
             "cache | GPU busy | reasons |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    baseline = next((r for r in result.rows if r.policy == "least-loaded"), None)
    for r in result.rows:
        ratio = "1" if r is baseline else (f"{baseline.ttft_mean_ms / r.ttft_mean_ms:.2f}x lower" if baseline else "")
        reasons = ", ".join(f"{k} {v}" for k, v in r.reasons.items())
        lines.append(f"| {r.policy} | {r.completed}/{r.requests} | {r.ttft_mean_ms:.0f} ms | {r.ttft_p50_ms:.0f} ms | "
                     f"{r.ttft_p99_ms:.0f} ms | {ratio} | {r.cached_share:.1%} | "
                     f"{r.cached_share / result.infinite_share:.0%} | {r.gpu_utilization:.0%} | {reasons} |")
    prefix = next((r for r in result.rows if r.policy == "prefix"), None)
    if prefix is not None and baseline is not None:
        kept = prefix.cached_share / result.infinite_share
        holds = kept >= REUSE_TARGET and prefix.ttft_mean_ms < baseline.ttft_mean_ms
        lines += ["", f"`prefix` keeps {kept:.0%} of the trace's reuse (the target: {REUSE_TARGET:.0%}) at a mean "
                  f"time to first token {baseline.ttft_mean_ms / prefix.ttft_mean_ms:.2f}x below `least-loaded`'s: "
                  f"the claim {'holds' if holds else 'does NOT hold'}."]
    return "\n".join(lines) + "\n"
