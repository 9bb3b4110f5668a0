"""Benchmark: isolation through a real llama.cpp server, for fifo, aps, fair and vtc.

Starts ``llama-server`` (4 slots, the tests' slower tiny model: tens of tokens a second per stream)
and, per policy, a daemon forwarding to it with the shipped defaults but for the policy. A steady
tenant streams one chat completion a second (20 of them; 4 where it waits behind the flood), first alone, then beside a same-bid tenant
holding 20 streams of 400 tokens (``tests/real_isolation.py``). It prints the steady tenant's p99 time
to first token alone and beside the flood, the goal (twice alone plus one prefill of its prompt on the
server, measured on the idle server), the most slots the flood held while the steady tenant was active,
and the flood's streamed tokens per second.

    .venv/bin/python benchmarks/bench_isolation_llama.py          # about 10 minutes (fifo, aps and fair
                                                                 # without isolation are slow: the steady
                                                                 # tenant waits behind the flood)
    .venv/bin/python benchmarks/bench_isolation_llama.py fair vtc

The server, the daemon and the clients share the machine's cores: on 2 cores, read the times as
what this machine gives, and compare the policies with each other.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import trio

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from tests.llama_server import SLOW_MODEL, find_llama_server, open_llama_server, write_tiny_model  # noqa: E402
from tests.real_isolation import prefill_ms, steady_beside_flood, warm_up  # noqa: E402

PRESETS = ("fifo", "aps", "fair", "vtc", "fair-without-isolation")
#: Steady requests per policy: fewer where each waits behind the flood's requests (tens of seconds each).
STEADY_REQUESTS = {"fifo": 4, "aps": 4, "fair-without-isolation": 4}


async def main(presets: list[str]) -> int:
    binary = find_llama_server()
    if binary is None:
        print("no llama-server: build it with .ci/build-llama-server or set APSD_LLAMA_SERVER")
        return 2
    with tempfile.TemporaryDirectory() as directory:
        model = write_tiny_model(Path(directory) / "slow.gguf", **SLOW_MODEL)
        async with open_llama_server(model, alias="slow", binary=binary, parallel=4) as server:
            await warm_up(server.url, "slow", 4)
            prefill = await prefill_ms(server.url, "slow")
            print(f"llama-server, 4 slots; the steady prompt's prefill alone: {prefill:.0f} ms\n")
            print("| policy | steady p99 TTFT alone (ms) | beside the flood (ms) | goal: 2 x alone + prefill (ms) | "
                  "met | flood's most slots | flood tokens/s |")
            print("|---|---:|---:|---:|:---:|---:|---:|")
            for preset in presets:
                plugins: tuple = ()
                policy, isolation = preset.removesuffix("-without-isolation"), not preset.endswith("-without-isolation")
                if preset == "vtc":
                    try:
                        import apsd_vtc
                    except ImportError:
                        print("| vtc | (apsd-vtc not installed) |||||")
                        continue
                    plugins = (apsd_vtc,)
                m = await steady_beside_flood(server.url, "slow", policy, steady_requests=STEADY_REQUESTS.get(preset, 20),
                                              plugins=plugins, isolation=isolation)
                goal = 2 * m.alone_p99 + prefill
                print(f"| {preset} | {m.alone_p99:.0f} | {m.flooded_p99:,.0f} | {goal:.0f} | "
                      f"{'yes' if m.flooded_p99 <= goal else 'no'} | {m.flood_most_running} | "
                      f"{m.flood_tokens_per_s:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(trio.run(main, sys.argv[1:] or list(PRESETS)))
