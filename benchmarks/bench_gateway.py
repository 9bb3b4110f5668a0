"""Benchmark: what apsd adds in front of a real inference server, measured side by side in one run.

Starts a llama.cpp ``llama-server`` (the tiny test model, ``tests/llama_server.py``) and an
``apsd`` process forwarding to it (``[[backends]]``), both on loopback, then sends the same
streamed chat requests to each, alternating rounds so the two see the same machine:

* time to first token and end to end, p50 and p99, at concurrency 1 and 64, and what apsd adds
  (apsd's percentile minus the direct one);
* streamed tokens per second of long generations, through apsd against direct.

    .venv/bin/python benchmarks/bench_gateway.py            # ~1 minute
    .venv/bin/python benchmarks/bench_gateway.py --quick

Goals: at most 2 ms added at p50 and 10 ms at p99, at least 0.9x the direct streaming
throughput. On a 2-core machine the server, apsd and this client share the cores: read the added
latency as an upper bound.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import trio

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from tests.helpers import APSD
from tests.llama_server import find_llama_server, open_llama_server, write_tiny_model

PROMPT = [{"role": "user", "content": "Write a short poem about schedulers."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_stream(client: httpx.AsyncClient, url: str, headers: dict, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, end to end, tokens) of one streamed chat request, in seconds."""
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                tokens += 1
                if first is None:
                    first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start, tokens


#: Requests that failed (no answer, a broken stream), by path: counted and printed, not fatal.
ERRORS: dict[str, list[str]] = {}


async def round_of(url: str, headers: dict, n: int, concurrency: int, max_tokens: int) -> list[tuple[float, float, int]]:
    results: list[tuple[float, float, int]] = []
    limit = trio.CapacityLimiter(concurrency)
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency * 2)) as client:
        async def worker() -> None:
            async with limit:
                try:
                    results.append(await one_stream(client, url, headers, max_tokens))
                except httpx.HTTPError as exc:
                    ERRORS.setdefault(url, []).append(f"{type(exc).__name__}: {exc}")

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(worker)
    return results


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1000.0


async def main_async(quick: bool) -> int:
    binary = find_llama_server()
    if binary is None:
        print("llama-server not found: run .ci/build-llama-server (or set APSD_LLAMA_SERVER)")
        return 1
    work = Path(tempfile.mkdtemp(prefix="apsd-bench-gateway-"))
    print(f"logs in {work}", file=sys.stderr)
    model = write_tiny_model(work / "tiny.gguf")
    rounds = 2 if quick else 4
    async with open_llama_server(model, binary=binary, parallel=64, ctx=64 * 160, log_dir=work) as server:
        port = free_port()
        config = work / "apsd.toml"
        config.write_text(f"""
[server]
port = {port}
[policy]
preset = "fifo"
[policy.fixed]
window_ms = 0.0
[tenants.bench]
rate = 1e9
burst = 1000000000
[[backends]]
url = "{server.url}"
max_concurrency = 64
[forward]
health_interval_s = 0.5
metrics_interval_s = 0.25
""")
        apsd_log = open(work / "apsd.log", "w")
        apsd = subprocess.Popen([APSD, str(config)], stderr=apsd_log,
                                env={**os.environ, "APSD_PLUGINS": ""})
        try:
            via = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient() as probe:
                with trio.fail_after(20):
                    while True:
                        try:
                            if (await probe.get(via + "/v1/models")).json().get("data"):
                                break
                        except httpx.HTTPError:
                            pass
                        await trio.sleep(0.1)
            targets = {"direct": (server.url + "/v1/chat/completions", {}),
                       "apsd": (via + "/v1/chat/completions", {"X-Apsd-Tenant": "bench"})}
            await round_of(*targets["apsd"], 16, 8, 8)     # warm up both paths
            await round_of(*targets["direct"], 16, 8, 8)
            print(f"{'concurrency':>11} {'path':>7} {'requests':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
                  f"{'e2e p50':>9} {'e2e p99':>9}   (ms)")
            for concurrency, n in ((1, 60 if quick else 200), (64, 128 if quick else 512)):
                results: dict[str, list[tuple[float, float, int]]] = {"direct": [], "apsd": []}
                for _ in range(rounds):
                    for name in ("direct", "apsd"):
                        results[name] += await round_of(*targets[name], n // rounds, concurrency, 16)
                figures = {}
                for name, rows in results.items():
                    ttft, e2e = [r[0] for r in rows], [r[1] for r in rows]
                    figures[name] = (pct(ttft, 50), pct(ttft, 99), pct(e2e, 50), pct(e2e, 99))
                    print(f"{concurrency:>11} {name:>7} {len(rows):>9} " + " ".join(f"{v:>9.2f}" for v in figures[name]))
                added = [a - d for a, d in zip(figures["apsd"], figures["direct"])]
                print(f"{concurrency:>11} {'added':>7} {'':>9} " + " ".join(f"{v:>+9.2f}" for v in added))
            print()
            print(f"{'streams':>8} {'path':>7} {'tokens/s':>10}")
            for concurrency in (1, 8):
                speed = {}
                for name in ("direct", "apsd", "direct", "apsd"):
                    start = time.perf_counter()
                    rows = await round_of(*targets[name], concurrency, concurrency, 400 if quick else 1000)
                    rate = sum(r[2] for r in rows) / (time.perf_counter() - start)
                    speed[name] = max(speed.get(name, 0.0), rate)   # best of two: the machine is shared
                for name, rate in speed.items():
                    print(f"{concurrency:>8} {name:>7} {rate:>10,.0f}")
                print(f"{concurrency:>8} {'ratio':>7} {speed['apsd'] / speed['direct']:>10.2f}x")
        finally:
            apsd.send_signal(signal.SIGTERM)
            apsd.wait(timeout=30)
    print()
    for url, errors in ERRORS.items():
        print(f"{len(errors)} request(s) to {url} failed, e.g. {errors[0]} (apsd's log: {work / 'apsd.log'})")
    if not ERRORS:
        print("no request failed")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests")
    args = parser.parse_args(argv)
    return trio.run(main_async, args.quick)


if __name__ == "__main__":
    sys.exit(main())
