"""Isolation figures: the isolation bounds for every built-in policy (and ``vtc`` when installed).

What it prints (virtual time, through apsd's own pipeline; the same seeds give the same figures)
    - continuous engine (the defaults: a100-80gb, llama-3-8b, isolation on): the steady tenant's p99
      time to first token on ``noisy-neighbor`` alone and beside the flood of ``CONTINUOUS_FLOOD``
      (tests/helpers.py: 512/128 every 0.5 s beside 512/512 at 40 req/s, as tests/sim/test_isolation.py
      runs it) (the full grid of workloads: ``apsd research --grid``);
    - batch engine (the default): its p99 latency on ``noisy-neighbor`` (120 s) alone and flooded,
      and the longest batch of the flooded run;
    - ``vtc-overload``: the largest service gap between the two backlogged tenants after 200 and
      800 s (``max_backlogged_service_gap`` of tests/helpers.py, tests/sim/test_isolation.py's measure);
    - ``vip-flood`` (300 s): the free tenant's longest queue wait, and the longest batch.

How to run (from the repository root; not collected by pytest)
    .venv/bin/python benchmarks/bench_isolation.py          # about a minute
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from apsd.core.config import Config, parse_config
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.workloads import build_workload
from tests.helpers import CONTINUOUS_FLOOD, latency, max_backlogged_service_gap, p99, steady, ttft


def presets() -> list[str]:
    names = ["fifo", "static", "aps", "fair"]
    try:
        import apsd_vtc  # noqa: F401
    except ImportError:
        return names
    return [*names, "vtc"]


def run(workload: str, preset: str, config: Config, **params):
    return run_policy(build_workload(workload, params), parse_policy_choice(preset), base_config=config)


def longest_batch(policy_run) -> float:
    return max(b.finished_at - b.started_at for b in policy_run.batches)


def row(preset: str) -> str:
    continuous = parse_config({"engine": {"kind": "continuous"}}, "<bench>")
    alone = p99(steady(run("noisy-neighbor", preset, continuous, **{**CONTINUOUS_FLOOD, "neighbor_rate": 0.0}), ttft))
    flooded = p99(steady(run("noisy-neighbor", preset, continuous, **CONTINUOUS_FLOOD), ttft))
    micro_alone = p99(steady(run("noisy-neighbor", preset, Config(), neighbor_rate=0.0), latency))
    micro_run = run("noisy-neighbor", preset, Config())
    gaps = [max_backlogged_service_gap(run("vtc-overload", preset, Config(), duration=d)) for d in (200.0, 800.0)]
    vip = run("vip-flood", preset, Config(), duration=300.0)
    waits = [r.queue_wait for r in vip.requests if r.tenant == "free" and r.queue_wait is not None]
    return (f"| {preset} | {alone * 1000:.1f} -> {flooded * 1000:.1f} ms ({flooded / alone:.1f}x) "
            f"| {micro_alone:.2f} -> {p99(steady(micro_run, latency)):.2f} s ({longest_batch(micro_run):.2f} s) "
            f"| {gaps[0]:,.0f} / {gaps[1]:,.0f} | {max(waits):.2f} s ({longest_batch(vip):.2f} s) |")


def main() -> int:
    print("| policy | continuous: steady p99 TTFT alone -> flooded | batch: steady p99 latency alone -> flooded "
          "(longest batch) | vtc-overload gap 200 s / 800 s | vip-flood: free's longest wait (longest batch) |")
    print("|---|---|---|---|---|")
    for preset in presets():
        print(row(preset))
    return 0


if __name__ == "__main__":
    sys.exit(main())
