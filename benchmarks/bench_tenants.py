"""Benchmark: does the number of tenants slow serving? POST /infer at 1 and 10,000 tenants, and
request latency while ``GET /metrics`` is scraped.

What it measures
    Two ``apsd`` daemons run as subprocesses on 127.0.0.1, port 0, with benchmarks/bench_http.py's fast
    settings (``gpu.time_scale = 1e-6``, queue limits far above the concurrency): one with a
    single tenant, one with ``--tenants`` (10,000) ``[tenants.x]`` tables, every tenant with rate
    and burst 1e12 (admission never throttles). Requests (16 tokens, a 44-character prompt) are
    spread over all the tenants (request i goes to tenant i * 7919 mod n, so consecutive requests
    name different tenants and every tenant is used).

    (a) Throughput. ``--requests`` POST /infer per daemon, sent by ``--concurrency`` client tasks
        on keep-alive connections (benchmarks/bench_http.py's raw client), in ``--rounds`` alternating rounds
        (1 tenant, 10,000, 10,000, 1, ...) so that other work on the machine hits both alike.
        Reported: requests/s, latency percentiles and server CPU per request of each, and the
        ratio of the 10,000-tenant throughput to the 1-tenant one (goal: close to 1.0).
    (b) Scrapes. Against the 10,000-tenant daemon, rounds of ``--seconds`` of the same load
        alternate between no scraping and a scraper that GETs /metrics every ``--interval`` (2 s),
        the first one 0.5 s into the round. The scraper is a separate process (reading tens of
        megabytes must not slow the load generator). Reported: p50/p99/max latency of both, the
        ratio of the p99s (goal: close to 1.0: a scrape must not hold up requests), and the
        scrapes' wall time and size as the scraper saw them. One scrape before the rounds (the
        first renders every tenant; later ones only the tenants whose figures moved) is reported
        on its own, with a /health request sent while it is under way.

    Afterwards each daemon's /metrics.json must show every request admitted and completed,
    nothing refused, ``conservation_ok``; any failed request or traceback is a problem.

How to run (from the repository root; this is not a pytest test and is not collected)
    .venv/bin/python benchmarks/bench_tenants.py               # default: about 70 s on 2 cores
    .venv/bin/python benchmarks/bench_tenants.py --quick       # about 30 s
    .venv/bin/python benchmarks/bench_tenants.py --requests 60000 --seconds 20 --rounds 6   # longer
    .venv/bin/python benchmarks/bench_tenants.py --policy aps  # another preset than the config's default

All traffic goes to 127.0.0.1 servers this script starts on port 0 and stops; every load run is
bounded by its request count or its seconds, and by ``--time-limit``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import attrs
import httpx
import trio

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.bench_http import (
    FAST_CONFIG,
    Figures,
    LoadRun,
    Server,
    get_json,
    percentile,
    report_problems,
    run_load,
    start_apsd,
    table,
)

#: Spreads consecutive requests over the tenants (a prime: every tenant is used).
STRIDE = 7919
PROMPT = "Explain token buckets in one paragraph."

#: The scraper, run as ``python -c``: GET /metrics every interval until stdin closes; one JSON line
#: per scrape (start offset, seconds, bytes, status). http.client: nothing to import but the stdlib.
SCRAPER = r'''
import http.client, json, select, sys, time
host, port, interval, first = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
started = time.perf_counter()
next_at = started + first
while True:
    ready, _, _ = select.select([sys.stdin], [], [], max(0.0, next_at - time.perf_counter()))
    if ready:
        break
    at = time.perf_counter()
    connection = http.client.HTTPConnection(host, port, timeout=60)
    connection.request("GET", "/metrics")
    response = connection.getresponse()
    size = len(response.read())
    connection.close()
    print(json.dumps({"at": at - started, "seconds": time.perf_counter() - at, "bytes": size,
                      "status": response.status}), flush=True)
    next_at += interval
'''


def tenants_config(count: int) -> str:
    """benchmarks/bench_http.py's fast config with ``count`` tenants instead of its one."""
    head = FAST_CONFIG.split("[tenants.")[0]
    return head + "".join(f"[tenants.t{i:05d}]\nrate = 1e12\nburst = 1000000000000\n" for i in range(count))


def tenant_bodies(count: int) -> list[bytes]:
    return [json.dumps({"tenant_id": f"t{i:05d}", "prompt": PROMPT, "tokens_requested": 16,
                        "priority_bid": 5}).encode() for i in range(count)]


def spread(bodies: list[bytes]):
    """``make_body`` for run_load: request i to tenant i * STRIDE mod n."""
    return lambda index: bodies[index * STRIDE % len(bodies)]


@attrs.define
class Scrapes:
    """What the scraper saw: one dict per scrape (at, seconds, bytes, status)."""

    rows: list[dict]

    def summary(self) -> str:
        if not self.rows:
            return "no scrape"
        seconds = sorted(r["seconds"] for r in self.rows)
        statuses = sorted({r["status"] for r in self.rows})
        return (f"{len(self.rows)} scrapes of {self.rows[-1]['bytes'] / 1e6:.1f} MB, statuses {statuses}, "
                f"wall time median {percentile(seconds, 50) * 1000:.0f} ms, max {seconds[-1] * 1000:.0f} ms")


def load(server: Server, n: int, concurrency: int, bodies: list[bytes], time_limit_s: float) -> LoadRun:
    return trio.run(lambda: run_load(server, n, concurrency, spread(bodies), time_limit_s=time_limit_s))


def load_while_scraped(server: Server, seconds: float, concurrency: int, bodies: list[bytes], interval: float
                       ) -> tuple[LoadRun, Scrapes]:
    """``seconds`` of load while a scraper process GETs /metrics every ``interval``."""
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    scraper = subprocess.Popen([sys.executable, "-c", SCRAPER, host, port, str(interval), "0.5"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        run = load(server, 10**9, concurrency, bodies, seconds)
    finally:
        out, _ = scraper.communicate(timeout=120)   # (closes its stdin: it ends the scrape under way and stops)
    return run, Scrapes([json.loads(line) for line in out.splitlines() if line.strip()])


def first_scrape(server: Server) -> tuple[float, int, float]:
    """One scrape (the first: every tenant rendered), and a /health request sent 50 ms into it:
    (scrape seconds, bytes, /health seconds)."""
    async def main() -> tuple[float, int, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            done: dict[str, float] = {}

            async def scrape() -> int:
                started = time.perf_counter()
                response = await http.get("/metrics")
                done["scrape"] = time.perf_counter() - started
                return len(response.content)

            async def health() -> None:
                await trio.sleep(0.05)
                started = time.perf_counter()
                await http.get("/health")
                done["health"] = time.perf_counter() - started

            async with trio.open_nursery() as nursery:
                nursery.start_soon(health)
                size = await scrape()
            return done["scrape"], size, done["health"]
    return trio.run(main)


def check_books(server: Server, label: str, before: dict, runs: list[LoadRun], problems: list[str]) -> None:
    after = get_json(server.url, "/metrics.json")["requests"]
    figures = Figures(label, "raw", LoadRun.merge(runs))
    sent, ok = len(figures.run.results), figures.statuses[200]
    admitted = after["admitted"] - before["admitted"]
    completed = after["completed"] - before["completed"]
    if not sent == ok == admitted == completed:
        problems.append(f"{label}: {sent} sent, {ok} answered 200, {admitted} admitted, {completed} completed: "
                        "they should all be equal")
    if after["rejected"] != before["rejected"] or after["in_flight"] or not after["conservation_ok"]:
        problems.append(f"{label}: books after the runs: {after}")
    if set(figures.statuses) - {200} or figures.errors:
        problems.append(f"{label}: statuses {dict(figures.statuses)}, errors {dict(figures.errors)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=10_000, help="tenants of the many-tenant daemon (10000)")
    parser.add_argument("--requests", type=int, help="(a): requests per daemon (default 16000; --quick 6000)")
    parser.add_argument("--seconds", type=float, help="(b): seconds per round (default 8; --quick 5)")
    parser.add_argument("--rounds", type=int, help="rounds per arm in (a) and (b) (default 3; --quick 2)")
    parser.add_argument("--interval", type=float, default=2.0, help="(b): seconds between scrapes (2)")
    parser.add_argument("--concurrency", type=int, default=64, help="client tasks/connections (64)")
    parser.add_argument("--policy", help="the daemons' policy preset (apsd --policy; default: the config's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: about 30 s")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds a load run may take at most")
    args = parser.parse_args(argv)
    n = args.requests or (6_000 if args.quick else 16_000)
    seconds = args.seconds or (5.0 if args.quick else 8.0)
    rounds = max(1, args.rounds or (2 if args.quick else 3))
    concurrency = max(1, args.concurrency)
    if args.tenants < 2:
        raise SystemExit("--tenants must be at least 2")

    directory = Path(tempfile.mkdtemp(prefix="apsd-bench-tenants-"))
    problems: list[str] = []
    started = time.perf_counter()
    print(f"apsd tenant-scale benchmark: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
          f"concurrency {concurrency}, {rounds} rounds per arm{' (quick)' if args.quick else ''}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; POST /infer, 16 tokens, spread over "
          f"every tenant; gpu.time_scale 1e-6, tenants' rate/burst 1e12\n")
    one_bodies, many_bodies = tenant_bodies(1), tenant_bodies(args.tenants)
    one = many = None
    try:
        policy = ("--policy", args.policy) if args.policy else ()
        one = start_apsd(directory, "one-tenant", tenants_config(1), *policy)
        began = time.perf_counter()
        many = start_apsd(directory, "many-tenants", tenants_config(args.tenants), *policy)
        print(f"started: 1 tenant, and {args.tenants:,} tenants ({time.perf_counter() - began:.1f} s to listen)")
        warmup = max(2 * concurrency, 500)
        for server, bodies in ((one, one_bodies), (many, many_bodies)):
            load(server, warmup, concurrency, bodies, args.time_limit)
        before = {s.name: get_json(s.url, "/metrics.json")["requests"] for s in (one, many)}

        # (a) throughput, 1 tenant against many, alternating rounds
        runs: dict[str, list[LoadRun]] = {"one-tenant": [], "many-tenants": []}
        for round_ in range(rounds):
            count = n // rounds + (1 if round_ < n % rounds else 0)
            for server, bodies in ((one, one_bodies), (many, many_bodies))[::1 if round_ % 2 == 0 else -1]:
                runs[server.name].append(load(server, count, concurrency, bodies, args.time_limit / rounds))
        a_one = Figures("1 tenant", "raw", LoadRun.merge(runs["one-tenant"]))
        a_many = Figures(f"{args.tenants:,} tenants", "raw", LoadRun.merge(runs["many-tenants"]))
        check_books(one, "1 tenant", before["one-tenant"], runs["one-tenant"], problems)

        # (b) at many tenants: the first scrape, then rounds without and with a scrape every interval
        cold_s, cold_bytes, health_s = first_scrape(many)
        quiet: list[LoadRun] = []
        scraped: list[LoadRun] = []
        scrapes = Scrapes([])
        for round_ in range(rounds):
            for with_scrapes in (False, True)[::1 if round_ % 2 == 0 else -1]:
                if with_scrapes:
                    run, seen = load_while_scraped(many, seconds, concurrency, many_bodies, args.interval)
                    scraped.append(run)
                    scrapes.rows += seen.rows
                else:
                    quiet.append(load(many, 10**9, concurrency, many_bodies, seconds))
        check_books(many, f"{args.tenants:,} tenants", before["many-tenants"],
                    runs["many-tenants"] + quiet + scraped, problems)
        b_quiet = Figures("no scrape", "raw", LoadRun.merge(quiet))
        b_scraped = Figures(f"/metrics every {args.interval:g} s", "raw", LoadRun.merge(scraped))
        if any(r["status"] != 200 for r in scrapes.rows) or not scrapes.rows:
            problems.append(f"scrapes: {scrapes.summary()}")
    finally:
        for server in (one, many):
            if server is not None and server.stop() != 0:
                problems.append(f"{server.name} did not exit 0 on SIGTERM")
            if server is not None and "Traceback" in server.log():
                problems.append(f"{server.name}: a traceback in its log {server.log_path}")
    header = ["daemon", "sent", "200", "req/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "srv CPU us/req"]

    def row(f: Figures) -> list[str]:
        return [f.label, f"{len(f.run.results):,}", f"{f.statuses[200]:,}", f"{f.rate:,.0f}", f"{f.latency_ms(50):.1f}",
                f"{f.latency_ms(90):.1f}", f"{f.latency_ms(99):.1f}", f"{f.latency_ms(100):.1f}",
                f"{f.server_us_per_request:,.0f}"]

    print("\n(a) POST /infer throughput, requests spread over every tenant")
    print(textwrap.indent(table([row(a_one), row(a_many)], header), "  "))
    throughput = a_many.rate / a_one.rate if a_one.rate else float("nan")
    print(f"  ratio {args.tenants:,} tenants / 1 tenant: throughput {throughput:.2f}, p99 latency "
          f"{a_many.latency_ms(99) / a_one.latency_ms(99):.2f}, server CPU per request "
          f"{a_many.server_us_per_request / a_one.server_us_per_request:.2f}  (goal: throughput close to 1.0)")

    print(f"\n(b) at {args.tenants:,} tenants: the first scrape (every tenant rendered) took {cold_s * 1000:,.0f} ms "
          f"for {cold_bytes / 1e6:.1f} MB (as the client saw it); a /health sent 50 ms into it took "
          f"{health_s * 1000:,.0f} ms")
    print(textwrap.indent(table([row(b_quiet), row(b_scraped)], header), "  "))
    ratio = b_scraped.latency_ms(99) / b_quiet.latency_ms(99) if b_quiet.answered else float("nan")
    print(f"  ratio p99 while scraped / not scraped: {ratio:.2f}  (goal: close to 1.0); "
          f"throughput ratio {b_scraped.rate / b_quiet.rate:.2f}")
    print(f"  scraper (a separate process): {scrapes.summary()}")

    return report_problems(problems, started, directory)


if __name__ == "__main__":
    sys.exit(main())
