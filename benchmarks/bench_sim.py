"""Benchmark: simulated requests per wall-clock second of ``apsd simulate`` on the continuous engine.

Runs Poisson-like periodic arrivals of 256-token prompts and 256-token outputs on one
``continuous`` engine (a100-80gb, llama-3-8b, the daemon's default policies) at 10^4, 10^5 and
10^6 arrivals, at two loads: below the engine's capacity (every request has its own events:
arrival, dispatch, first token, finish) and above it (requests join and leave in groups). The
simulation's cost should grow with events, not tokens: linear in the arrivals at a given load.

    .venv/bin/python benchmarks/bench_sim.py            # 10^4, 10^5 and 10^6 arrivals (several minutes)
    .venv/bin/python benchmarks/bench_sim.py --quick    # 10^4 and 10^5

Figures depend on the machine; the ratios between sizes are what to compare (linear growth:
the same requests per second at every size).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from apsd.core.config import Config, EngineConfig
from apsd.plugins import make_plugin_manager
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.workloads import build_workload

#: Requests per model second that one engine sustains at 256/256 (measured: ~19.5), and the loads run.
LOADS = {"below capacity (15 req/s)": 15.0, "above capacity (25 req/s)": 25.0}


def bench(arrivals: int, rate: float) -> tuple[float, float]:
    """(wall seconds, simulated requests per wall second) for ``arrivals`` arrivals at ``rate``."""
    config = attrs.evolve(Config(), engine=EngineConfig(kind="continuous", gpu="a100-80gb", model="llama-3-8b"))
    workload = build_workload("poisson", {"rate": rate, "duration": arrivals / rate, "tenants": 4,
                                          "prompt_mean": 256.0, "prompt_sigma": 0.0,
                                          "output_mean": 256.0, "output_sigma": 0.0}, seed=1)
    run = run_policy(workload, parse_policy_choice("aps"), base_config=config,
                     plugin_manager=make_plugin_manager(load_entry_points=False))
    return run.wall_s, len(workload.arrivals) / run.wall_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10^4 and 10^5 arrivals only")
    args = parser.parse_args(argv)
    sizes = (10**4, 10**5) if args.quick else (10**4, 10**5, 10**6)
    print(f"{'load':<28} {'arrivals':>10} {'wall s':>9} {'requests/s':>12} {'vs 10^4':>8}")
    for label, rate in LOADS.items():
        first = None
        for n in sizes:
            wall, speed = bench(n, rate)
            first = first or speed
            print(f"{label:<28} {n:>10,} {wall:>9.2f} {speed:>12,.0f} {speed / first:>7.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
