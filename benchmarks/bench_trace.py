"""Benchmark: replaying a 12,000-request Mooncake-format trace with 12,000-token prompts.

Generates the trace (:mod:`apsd.sim.traces.synthetic`: Mooncake's conversation-trace shape, a mean prompt
of about 12,000 tokens in 512-token blocks, 12,000 requests over about an hour), then times, in one run:

* reading it (:func:`apsd.sim.traces.load_trace`: streamed into columns), and
* replaying it through apsd's pipeline on 4 continuous engines (a100-80gb, llama-3.1-8b, prefix caches,
  ``prefix`` routing, the ``fair`` queue), as ``apsd simulate --trace`` does.

The goal: the whole replay within a minute of wall time on a 2-core machine (the ratio printed last is
the replay's wall time over 60 s: below 1 meets it). The CPU time is printed beside the wall time: on
a machine others share, the wall time is the larger.

    .venv/bin/python benchmarks/bench_trace.py
    .venv/bin/python benchmarks/bench_trace.py --requests 50000    # larger
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from apsd.core.config import Config
from apsd.plugins import make_plugin_manager
from apsd.sim.research.trace_routing import trace_routing_config
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.traces import load_trace
from apsd.sim.traces.reuse import infinite_cache_share
from apsd.sim.traces.synthetic import MooncakeShape, write_mooncake_trace

GOAL_S = 60.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12_000, help="requests in the trace (default 12,000)")
    parser.add_argument("--policy", default="prefix", help="routing policy (default prefix)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        path = write_mooncake_trace(Path(directory) / "trace.jsonl", MooncakeShape(requests=args.requests))
        size = path.stat().st_size
        wall, cpu = time.perf_counter(), time.process_time()
        workload = load_trace(path)
        load_wall, load_cpu = time.perf_counter() - wall, time.process_time() - cpu
    arrivals = list(workload.arrivals)
    prompt = sum(a.prompt_tokens for a in arrivals) / len(arrivals)
    print(f"trace: {len(arrivals):,} requests, {size / 1e6:.1f} MB, mean prompt {prompt:,.0f} tokens, "
          f"{arrivals[-1].at / 60:.0f} minutes; an infinite cache holds {infinite_cache_share(arrivals):.1%}")
    config = trace_routing_config(Config(), args.policy)
    wall, cpu = time.perf_counter(), time.process_time()
    run = run_policy(workload, parse_policy_choice("fair"), base_config=config,
                     plugin_manager=make_plugin_manager(load_entry_points=False))
    replay_wall, replay_cpu = time.perf_counter() - wall, time.process_time() - cpu
    done = [r for r in run.requests if r.outcome == "completed"]
    cached = sum(r.cached_tokens for r in done) / sum(r.prompt_tokens for r in done)
    print(f"read:   {load_wall:6.2f} s wall, {load_cpu:6.2f} s CPU")
    print(f"replay: {replay_wall:6.2f} s wall, {replay_cpu:6.2f} s CPU ({len(done):,} of {len(arrivals):,} completed, "
          f"{cached:.1%} of prompt tokens cached, {args.policy} routing)")
    total = load_wall + replay_wall
    print(f"read + replay: {total:.2f} s wall = {total / GOAL_S:.2f}x the {GOAL_S:.0f}-second goal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
