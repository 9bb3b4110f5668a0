"""Benchmark: apsd over HTTP on loopback, against a bare quart-trio app, and under signals.

What it measures
    1. Throughput and latency. The installed ``apsd`` runs as a subprocess on 127.0.0.1, port 0,
       with a config that takes the scheduler out of the way: ``gpu.time_scale = 1e-6`` (a batch
       "runs" in well under a millisecond), one tenant with rate and burst 1e12 (admission never
       throttles) and queue limits far above the concurrency. ``--requests`` POST /infer requests
       (16 tokens, a 44-character prompt) are sent by ``--concurrency`` client tasks, each on its
       own keep-alive connection. Every answer is timed from the first byte sent to the last byte
       received. Then the same load goes to a **bare quart-trio app** served by hypercorn.trio
       (written to a temp dir and run as a subprocess on port 0) that parses the same JSON body and
       answers a small JSON object: the HTTP stack alone, what apsd cannot be faster than.
       Reported: requests/s, p50/p90/p99/max latency, statuses, transport errors, the server
       process's CPU time per request (from /proc) and the client's CPU use, and the ratios
       apsd/bare. Afterwards apsd's /metrics.json must show every request admitted and
       completed (nothing lost, nothing refused) and ``conservation_ok``.
    2. The same comparison with ``httpx.AsyncClient`` (a pool of ``--concurrency`` connections)
       as the load generator, with fewer requests: httpx is slow under concurrency (its own CPU
       and pool bookkeeping dominate: encode/httpx#3215), so these figures measure httpx more
       than the servers; they are there because httpx is what most Python clients use.
    3. Signals under load. A fresh apsd (``gpu.time_scale = 0.05``, JSON DEBUG logs with
       ``--log-prompts``) gets a load run; one third of the way in it receives SIGHUP (its
       config file was rewritten: a tenant re-rated, one added), two thirds in SIGTERM.
       Run twice: with a 30 s grace period (requests in flight at SIGTERM finish: 200) and with
       a 0.01 s grace period and a slow GPU (what is still queued or running is answered 503
       ``shutting_down``). Every request carries a unique prompt, which apsd logs with each
       admitted request's outcome and request id, so client and server books are compared
       request by request:
         * every request apsd admitted got exactly one answer, and it is the one apsd logged
           (200 with the same request_id, or 503 shutting_down for one aborted at shutdown);
         * every 503 was sent after SIGTERM; before it, only 200s (the SIGHUP changes nothing);
         * client errors (connection refused or closed) are only for requests apsd never
           admitted: sent after its listener closed, or on a keep-alive connection the server
           closed as it stopped; their count is explained, not hidden.

The load generator
    The main client is a minimal HTTP/1.1 keep-alive client on trio sockets (pre-encoded
    request bytes, responses parsed by Content-Length): it costs the client a small fraction
    of a core, so on a 2-core machine the server, not the client, is what is measured. It
    reconnects when a response says ``Connection: close`` (hypercorn closes a connection after
    ``keep_alive_max_requests``, 1000, requests) and never retries a request.

How to run (from the repository root; this is not a pytest test and is not collected)
    .venv/bin/python benchmarks/bench_http.py                  # default: a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_http.py --quick          # under a minute
    .venv/bin/python benchmarks/bench_http.py --requests 50000 --concurrency 128

Every load loop is bounded by its request count and by ``--time-limit`` seconds per phase; all
traffic goes to 127.0.0.1 servers this script starts on port 0 and stops.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

APSD = str(Path(sys.executable).with_name("apsd"))
LISTENING = re.compile(r"apsd listening on (http://[0-9.:\[\]]+)")
TICKS = os.sysconf("SC_CLK_TCK")
REQUEST_TIMEOUT_S = 30.0

FAST_CONFIG = """
[server]
shutdown_grace_s = 5.0
[gpu]
time_scale = 1e-6
[queue]
max_requests = 1000000
max_requests_per_tenant = 1000000
ingress_buffer = 65536
[tenants.bench]
rate = 1e12
burst = 1000000000000
"""

BARE_APP = '''
"""The HTTP stack alone: quart-trio + hypercorn.trio answering POST /infer with a small JSON."""
import functools
import json

import hypercorn.config
import hypercorn.trio
import trio
from quart import Response, request
from quart_trio import QuartTrio

app = QuartTrio("bare")


@app.post("/infer")
async def infer():
    body = json.loads(await request.get_data(cache=False))
    answer = {"request_id": "bare-1", "tenant_id": body["tenant_id"], "tokens_generated": body["tokens_requested"]}
    return Response(json.dumps(answer), status=200, content_type="application/json")


async def main():
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(functools.partial(hypercorn.trio.serve, app, config))
        print(binds[0], flush=True)


trio.run(main)
'''


# -- servers --------------------------------------------------------------------------------------

def stop_process(process: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """SIGTERM ``process`` (by its PID), SIGKILL it after ``timeout`` s; its exit status."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    return process.returncode


@attrs.define
class Server:
    name: str
    process: subprocess.Popen
    url: str
    log_path: Path | None = None

    def cpu_seconds(self) -> float:
        try:
            fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")
        return (int(fields[11]) + int(fields[12])) / TICKS   # utime + stime

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path else ""

    def stop(self, timeout: float = 30.0) -> int | None:
        return stop_process(self.process, timeout)


def start_apsd(directory: Path, name: str, config_text: str, *args: str) -> Server:
    config = directory / f"{name}.toml"
    config.write_text(config_text)
    log_path = directory / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([APSD, str(config), "--port", "0", *args], stdout=subprocess.DEVNULL,
                                   stderr=log, env={**os.environ, "APSD_PLUGINS": "", "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 30
    while not (match := LISTENING.search(log_path.read_text(errors="replace"))):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"apsd did not start:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.02)
    return Server(name, process, match.group(1), log_path)


def start_bare(directory: Path) -> Server:
    script = directory / "bare_app.py"
    script.write_text(BARE_APP)
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert process.stdout is not None
    url = process.stdout.readline().decode().strip()   # (hypercorn prints its bind once listening)
    if not url.startswith("http://127.0.0.1:"):
        process.kill()
        raise SystemExit(f"the bare app did not start (got {url!r})")
    return Server("bare", process, url)


# -- the load generator ---------------------------------------------------------------------------

@attrs.define
class Result:
    """One request's fate: an HTTP answer (status, body) or a client-side error."""

    index: int
    sent_at: float
    latency_s: float
    status: int | None = None
    body: bytes = b""
    error: str | None = None


def infer_request(host: str, body: bytes) -> bytes:
    return (b"POST /infer HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % (host.encode(), len(body))) + body


class Connection:
    """One keep-alive HTTP/1.1 connection: send a request, read one Content-Length response."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.stream: trio.SocketStream | None = None
        self.buffer = b""

    async def request(self, raw: bytes) -> tuple[int, bytes]:
        if self.stream is None:
            try:
                self.stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:   # (trio wraps the refusal: "all attempts to connect ... failed")
                raise ConnectionRefusedError(str(exc)) from exc
            self.buffer = b""
        await self.stream.send_all(raw)
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end >= 0:
                head = self.buffer[:end].decode("latin-1").lower().split("\r\n")
                headers = dict(line.split(":", 1) for line in head[1:])
                length = int(headers["content-length"])
                if len(self.buffer) >= end + 4 + length:
                    body = self.buffer[end + 4:end + 4 + length]
                    self.buffer = self.buffer[end + 4 + length:]
                    if headers.get("connection", "").strip() == "close":
                        await self.close()
                    return int(head[0].split()[1]), body
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                await self.close()
                raise ConnectionError("the server closed the connection without answering")
            self.buffer += chunk

    async def close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            with trio.CancelScope(shield=True):
                await stream.aclose()


@attrs.define
class LoadRun:
    results: list[Result]
    wall_s: float
    client_cpu_s: float
    server_cpu_s: float
    unsent: int

    @classmethod
    def merge(cls, runs: list[LoadRun]) -> LoadRun:
        return cls([r for run in runs for r in run.results], sum(run.wall_s for run in runs),
                   sum(run.client_cpu_s for run in runs), sum(run.server_cpu_s for run in runs),
                   sum(run.unsent for run in runs))


def error_name(exc: BaseException) -> str:
    if isinstance(exc, (ConnectionRefusedError, httpx.ConnectError)) or (
            isinstance(exc, OSError) and "refused" in str(exc).lower()):
        return "connection refused"
    if isinstance(exc, (trio.TooSlowError, httpx.TimeoutException)):
        return f"no answer in {REQUEST_TIMEOUT_S:g} s"
    if isinstance(exc, (ConnectionError, trio.BrokenResourceError, httpx.RemoteProtocolError, httpx.ReadError,
                        httpx.WriteError)):
        return "connection closed before an answer"
    return type(exc).__name__


async def run_load(server: Server, n: int, concurrency: int, make_body: Callable[[int], bytes], *,
                   time_limit_s: float, client: str = "raw",
                   on_answer: Callable[[int], None] | None = None) -> LoadRun:
    """Send ``n`` POST /infer requests from ``concurrency`` tasks; stop at ``time_limit_s``.

    A task stops after a connection is refused (the server is gone). ``on_answer`` is called
    with the number of requests finished so far, after each.
    """
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    results: list[Result] = []
    next_index = 0
    deadline = time.perf_counter() + time_limit_s

    async def one(send: Callable[[bytes], Any], index: int) -> bool:
        body = make_body(index)
        started = time.perf_counter()
        result = Result(index, started, 0.0)
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                result.status, result.body = await send(body)
        except (OSError, trio.TooSlowError, trio.BrokenResourceError, httpx.HTTPError) as exc:
            result.error = error_name(exc)
        result.latency_s = time.perf_counter() - started
        results.append(result)
        if on_answer is not None:
            on_answer(len(results))
        return result.error != "connection refused"

    async def raw_worker() -> None:
        nonlocal next_index
        connection = Connection(host, int(port))
        try:
            while next_index < n and time.perf_counter() < deadline:
                index, next_index = next_index, next_index + 1

                async def send(body: bytes) -> tuple[int, bytes]:
                    try:
                        return await connection.request(infer_request(host, body))
                    except BaseException:
                        await connection.close()   # a failed exchange leaves the connection unusable
                        raise

                if not await one(send, index):
                    return
        finally:
            await connection.close()

    async def httpx_worker(http: httpx.AsyncClient) -> None:
        nonlocal next_index
        while next_index < n and time.perf_counter() < deadline:
            index, next_index = next_index, next_index + 1

            async def send(body: bytes) -> tuple[int, bytes]:
                response = await http.post("/infer", content=body, headers={"content-type": "application/json"})
                return response.status_code, response.content

            if not await one(send, index):
                return

    client_cpu, server_cpu, started = time.process_time(), server.cpu_seconds(), time.perf_counter()
    if client == "raw":
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(raw_worker)
    else:
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=server.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http:
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(httpx_worker, http)
    wall = time.perf_counter() - started
    return LoadRun(results, wall, time.process_time() - client_cpu, server.cpu_seconds() - server_cpu,
                   unsent=n - len(results))


def bench_body(_index: int, _cache: dict[str, bytes] = {}) -> bytes:  # noqa: B006 (a deliberate cache)
    if "body" not in _cache:
        _cache["body"] = json.dumps({"tenant_id": "bench", "prompt": "Explain token buckets in one paragraph.",
                                     "tokens_requested": 16, "priority_bid": 5}).encode()
    return _cache["body"]


# -- figures --------------------------------------------------------------------------------------

def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]


@attrs.define
class Figures:
    label: str
    client: str
    run: LoadRun

    @property
    def answered(self) -> list[Result]:
        return [r for r in self.run.results if r.status is not None]

    @property
    def rate(self) -> float:
        return len(self.answered) / self.run.wall_s if self.run.wall_s else 0.0

    def latency_ms(self, q: float) -> float:
        return percentile(sorted(r.latency_s for r in self.answered), q) * 1000

    @property
    def statuses(self) -> collections.Counter[int]:
        return collections.Counter(r.status for r in self.answered)

    @property
    def errors(self) -> collections.Counter[str]:
        return collections.Counter(r.error for r in self.run.results if r.error is not None)

    @property
    def server_us_per_request(self) -> float:
        return self.run.server_cpu_s / max(1, len(self.run.results)) * 1e6

    def row(self) -> list[str]:
        other = sum(c for s, c in self.statuses.items() if s != 200)
        return [self.label, self.client, f"{len(self.run.results):,}", f"{self.statuses[200]:,}", f"{other:,}",
                f"{sum(self.errors.values()):,}", f"{self.run.unsent:,}", f"{self.rate:,.0f}",
                f"{self.latency_ms(50):.1f}", f"{self.latency_ms(90):.1f}", f"{self.latency_ms(99):.1f}",
                f"{self.latency_ms(100):.1f}", f"{self.server_us_per_request:,.0f}",
                f"{self.run.client_cpu_s / self.run.wall_s:.0%}" if self.run.wall_s else "-"]


HEADER = ["server", "client", "sent", "200", "other", "errors", "unsent", "req/s", "p50 ms", "p90 ms", "p99 ms",
          "max ms", "srv CPU us/req", "client CPU"]


def report_problems(problems: list[str], started: float, directory: Path, logs: str = "server logs") -> int:
    """Print the benchmark's verdict and its problems; keep ``directory`` only if there are any.
    Returns the exit status (1 with problems)."""
    elapsed = time.perf_counter() - started
    if not problems:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"\n{'PROBLEMS' if problems else 'OK'}: {len(problems)} problem(s); {elapsed:.0f} s in all")
    for problem in problems[:40]:
        print(f"  - {problem}")
    if problems:
        print(f"  ({logs} kept in {directory})")
    return 1 if problems else 0


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def get_json(url: str, path: str) -> dict:
    with httpx.Client(base_url=url, timeout=10) as http:
        return http.get(path).json()


# -- phase 1 and 2: apsd against the bare app -----------------------------------------------------

def compare(directory: Path, n: int, concurrency: int, client: str, time_limit_s: float,
            rounds: int) -> tuple[Figures, Figures, list[str]]:
    """apsd and the bare app, both running, loaded in alternating rounds (apsd, bare, bare, apsd, ...)
    so that whatever else the machine is doing hits both alike; figures are over all rounds."""
    problems: list[str] = []
    warmup = max(2 * concurrency, 200)
    apsd = start_apsd(directory, f"apsd-{client}", FAST_CONFIG)
    bare: Server | None = None
    runs: dict[str, list[LoadRun]] = {"apsd": [], "bare": []}
    try:
        bare = start_bare(directory)
        for server in (apsd, bare):
            trio.run(lambda: run_load(server, warmup, concurrency, bench_body, time_limit_s=time_limit_s,
                                      client=client))
        before = get_json(apsd.url, "/metrics.json")["requests"]
        for round_ in range(rounds):
            count = n // rounds + (1 if round_ < n % rounds else 0)
            for server in (apsd, bare) if round_ % 2 == 0 else (bare, apsd):
                runs["apsd" if server is apsd else "bare"].append(trio.run(lambda: run_load(
                    server, count, concurrency, bench_body, time_limit_s=time_limit_s / rounds, client=client)))
        after = get_json(apsd.url, "/metrics.json")["requests"]
    finally:
        exit_code = apsd.stop()
        if bare is not None:
            bare.stop(timeout=5)
    apsd_figures = Figures("apsd", client, LoadRun.merge(runs["apsd"]))
    bare_figures = Figures("bare quart-trio", client, LoadRun.merge(runs["bare"]))
    admitted = after["admitted"] - before["admitted"]
    completed = after["completed"] - before["completed"]
    ok = apsd_figures.statuses[200]
    if not (admitted == completed == ok == len(apsd_figures.run.results)):
        problems.append(f"apsd ({client}): {len(apsd_figures.run.results)} sent, {ok} answered 200, "
                        f"{admitted} admitted, {completed} completed: they should all be equal")
    if after["rejected"] != before["rejected"] or after["in_flight"] or not after["conservation_ok"]:
        problems.append(f"apsd ({client}): books after the run: {after}")
    if set(apsd_figures.statuses) - {200} or apsd_figures.errors:
        problems.append(f"apsd ({client}): unexpected statuses {dict(apsd_figures.statuses)} or errors "
                        f"{dict(apsd_figures.errors)}")
    if set(bare_figures.statuses) - {200} or bare_figures.errors:
        problems.append(f"bare ({client}): statuses {dict(bare_figures.statuses)} errors {dict(bare_figures.errors)}")
    if exit_code != 0:
        problems.append(f"apsd ({client}) exited {exit_code} on SIGTERM")
    if "Traceback" in apsd.log():
        problems.append(f"apsd ({client}): a traceback in its log {apsd.log_path}")
    return apsd_figures, bare_figures, problems


# -- phase 3: signals under load -----------------------------------------------------------------

def signal_config(grace_s: float, time_scale: float, *, reloaded: bool = False) -> str:
    return textwrap.dedent(f"""
        [server]
        shutdown_grace_s = {grace_s}
        [gpu]
        time_scale = {time_scale}
        [queue]
        max_requests = 1000000
        max_requests_per_tenant = 1000000
        ingress_buffer = 65536
        [tenants.bench]
        rate = {1e11 if reloaded else 1e12}
        burst = 1000000000000
        """) + ("[tenants.extra]\nrate = 100.0\nburst = 1000\n" if reloaded else "")


@attrs.define
class SignalRun:
    label: str
    figures: Figures
    hup_at: float
    term_at: float
    exit_code: int | None
    exit_after_term_s: float
    in_flight_at_term: int | None
    rows: list[list[str]]
    problems: list[str]


def signals_under_load(directory: Path, label: str, n: int, concurrency: int, grace_s: float, time_scale: float,
                       tokens: int, time_limit_s: float) -> SignalRun:
    name = f"signals-{label.split(':')[0]}"
    apsd = start_apsd(directory, name, signal_config(grace_s, time_scale), "--log-level", "DEBUG",
                      "--log-format", "json", "--log-prompts")
    config_path = directory / f"{name}.toml"
    marks: dict[str, float] = {}

    def make_body(index: int) -> bytes:
        return json.dumps({"tenant_id": "bench", "prompt": f"sig-{index:07d}", "tokens_requested": tokens,
                           "priority_bid": 1 + index % 10}).encode()

    def on_answer(done: int) -> None:
        if "hup" not in marks and done >= n // 3:
            config_path.write_text(signal_config(grace_s, time_scale, reloaded=True))
            apsd.process.send_signal(signal.SIGHUP)
            marks["hup"] = time.perf_counter()
        elif "term" not in marks and done >= 2 * n // 3:
            apsd.process.send_signal(signal.SIGTERM)
            marks["term"] = time.perf_counter()

    try:
        run = trio.run(lambda: run_load(apsd, n, concurrency, make_body, time_limit_s=time_limit_s,
                                        on_answer=on_answer))
        if "term" not in marks:   # (the run ended early: still stop it the way it should be stopped)
            apsd.process.send_signal(signal.SIGTERM)
            marks["term"] = time.perf_counter()
        try:
            exit_code = apsd.process.wait(timeout=max(30.0, grace_s + 30))
        except subprocess.TimeoutExpired:
            exit_code = None
        exit_after = time.perf_counter() - marks["term"]
    finally:
        apsd.stop()
    figures = Figures("apsd", "raw", run)
    problems: list[str] = []
    if exit_code != 0:
        problems.append(f"{label}: apsd exited {exit_code} after SIGTERM")

    # the server's books, request by request (prompts are unique and logged with each admitted request)
    finished: dict[str, list[dict]] = collections.defaultdict(list)
    rejected = collections.Counter()
    in_flight_at_term = None
    reloaded = False
    log_text = apsd.log()
    for line in log_text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            problems.append(f"{label}: a log line that is not JSON: {line[:200]}")
            continue
        if event.get("event") == "request":
            finished[event.get("prompt", "")].append(event)
        elif event.get("event") == "reject":
            rejected[(event.get("status"), event.get("error"))] += 1
        elif event.get("event") == "reload":
            reloaded = True
        elif event.get("event") == "shutdown" and (m := re.search(r"(\d+) requests in flight", event["msg"])):
            in_flight_at_term = int(m.group(1))
    if "Traceback" in log_text:
        problems.append(f"{label}: a traceback in apsd's log ({apsd.log_path})")
    if not reloaded:
        problems.append(f"{label}: no 'reload' event in apsd's log after SIGHUP")
    duplicates = [p for p, events in finished.items() if len(events) > 1]
    if duplicates:
        problems.append(f"{label}: {len(duplicates)} requests finished more than once, e.g. {duplicates[:3]}")

    kinds = collections.Counter()
    timing: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)   # kind -> (sent, took)
    by_prompt = {f"sig-{r.index:07d}": r for r in run.results}
    for prompt, result in by_prompt.items():
        counted = sum(kinds.values())
        server = finished.get(prompt, [None])[0]
        answer_error = None
        if result.status is not None and result.status != 200:
            try:
                answer_error = json.loads(result.body).get("error")
            except ValueError:
                answer_error = "<not JSON>"
        after_term = result.sent_at + result.latency_s >= marks["term"]
        if result.status == 200:
            request_id = json.loads(result.body).get("request_id")
            if server is None or server["outcome"] != "completed" or server["request_id"] != request_id:
                problems.append(f"{label}: {prompt} answered 200 ({request_id}) but apsd logged {server}")
            kinds["200 (admitted, completed)"] += 1
        elif result.status == 503 and answer_error == "shutting_down" and after_term:
            if server is None:
                kinds["503 shutting_down (refused at the door)"] += 1
            elif server["outcome"] == "cancelled":
                kinds["503 shutting_down (admitted, aborted at the end of the grace period)"] += 1
            else:
                problems.append(f"{label}: {prompt} answered 503 but apsd logged {server}")
        elif result.error is not None:
            if server is not None:
                problems.append(f"{label}: LOST: {prompt} was admitted ({server['outcome']}, "
                                f"{server['request_id']}) but its client got {result.error!r}")
            kinds[f"client error: {result.error} (never admitted)"] += 1
        else:
            problems.append(f"{label}: {prompt}: unexpected answer {result.status} {answer_error} "
                            f"({'after' if after_term else 'before'} SIGTERM)")
        if sum(kinds.values()) > counted:
            kind = next(k for k in kinds if kinds[k] > len(timing[k]))
            timing[kind].append((result.sent_at - marks["term"], result.latency_s))
    for prompt in finished.keys() - by_prompt.keys():
        problems.append(f"{label}: apsd logged {prompt} as admitted but no client request was recorded")
    at_door = kinds["503 shutting_down (refused at the door)"]
    # A door refusal can miss its client only as a closed connection at the very end: a request that
    # arrives on a new connection as hypercorn stops is refused by apsd, but hypercorn's shutdown
    # closes the connection before the answer is written (its idle-connection closer races the
    # request; never admitted, nothing lost). Each such refusal must match a client's closed connection.
    closed_late = sum(count for kind, count in kinds.items() if kind.startswith("client error: connection closed"))
    logged_at_door = rejected[(503, "shutting_down")]
    if not at_door <= logged_at_door <= at_door + closed_late:
        problems.append(f"{label}: apsd logged {logged_at_door} refusals at the door, clients got {at_door} "
                        f"(and {closed_late} closed connections)")

    if set(rejected) - {(503, "shutting_down")}:
        problems.append(f"{label}: unexpected refusals in apsd's log: {dict(rejected)}")
    rows = [[kind, f"{count:,}", f"{min(t[0] for t in timing[kind]):+.2f} .. {max(t[0] for t in timing[kind]):+.2f}",
             f"{max(t[1] for t in timing[kind]) * 1000:,.0f}"]
            for kind, count in sorted(kinds.items(), key=lambda kv: -kv[1])]
    if logged_at_door > at_door:
        rows.append(["  of the closed: refused by apsd, answer lost as hypercorn stopped",
                     f"{logged_at_door - at_door:,}", "", ""])
    rows.append(["not sent (the daemon had stopped)", f"{run.unsent:,}", "", ""])
    return SignalRun(label, figures, marks.get("hup", float("nan")) - run.results[0].sent_at if run.results else 0,
                     marks["term"] - run.results[0].sent_at if run.results else 0, exit_code, exit_after,
                     in_flight_at_term, rows, problems)


# -- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, help="requests per measured run (default 20000; --quick 3000)")
    parser.add_argument("--concurrency", type=int, default=64, help="client tasks/connections (default 64)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: under a minute")
    parser.add_argument("--time-limit", type=float, help="seconds per load run before it stops by itself "
                        "(default 120; --quick 20)")
    args = parser.parse_args(argv)
    n = args.requests or (3_000 if args.quick else 20_000)
    n_httpx = max(1, min(n, 1_000 if args.quick else 4_000))
    n_signals = max(300, min(n, 1_500 if args.quick else 4_000))
    n_abort = max(300, min(n, 600 if args.quick else 1_200))
    rounds = 2 if args.quick else 4
    concurrency = max(1, args.concurrency)
    time_limit = args.time_limit or (20.0 if args.quick else 120.0)
    if not Path(APSD).exists():
        raise SystemExit(f"{APSD} not found: install apsd into this interpreter's environment")

    directory = Path(tempfile.mkdtemp(prefix="apsd-bench-"))
    problems: list[str] = []
    started = time.perf_counter()
    print(f"apsd HTTP benchmark: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, concurrency {concurrency}, "
          f"time limit {time_limit:g} s per run{' (quick)' if args.quick else ''}")
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} (other work on this machine skews "
          f"the figures; apsd and bare are loaded in alternating rounds so it skews both alike)")
    print(f"POST /infer, 16 tokens; apsd: gpu.time_scale 1e-6, tenant rate/burst 1e12, INFO logs (no line per batch); bare: quart-trio + "
          f"hypercorn.trio; {rounds} rounds each; warm-up of max(2*C, 200) requests per server not counted\n")
    try:
        comparisons = []
        for client, count in (("raw", n), ("httpx", n_httpx)):
            apsd_figures, bare_figures, found = compare(directory, count, concurrency, client, time_limit, rounds)
            comparisons.append((client, apsd_figures, bare_figures))
            problems += found
        print(table([f.row() for _, a, b in comparisons for f in (a, b)], HEADER))
        print()
        for client, a, b in comparisons:
            ratio = a.rate / b.rate if b.rate else float("nan")
            verdict = "meets" if ratio >= 0.8 else "MISSES"
            print(f"{client:>5} client: apsd/bare throughput {ratio:.2f} ({verdict} the 0.8 goal); added latency "
                  f"p50 {a.latency_ms(50) - b.latency_ms(50):+.1f} ms, p99 {a.latency_ms(99) - b.latency_ms(99):+.1f} "
                  f"ms; server CPU per request {a.server_us_per_request:,.0f} vs {b.server_us_per_request:,.0f} us "
                  f"(x{a.server_us_per_request / b.server_us_per_request:.2f})")
        print("  (with httpx the client, not the server, sets the pace: see its client CPU and the raw rows)")

        print(f"\nSignals under load: SIGHUP (config rewritten: tenant re-rated, one added) after 1/3 of the "
              f"answers, SIGTERM after 2/3; raw client, concurrency {concurrency}, gpu.time_scale 0.05")
        runs = [signals_under_load(directory, f"graceful: grace 30 s, {n_signals:,} requests of 16 tokens",
                                   n_signals, concurrency, 30.0, 0.05, 16, time_limit),
                signals_under_load(directory, f"abort: grace 0.01 s, {n_abort:,} requests of 64 tokens",
                                   n_abort, concurrency, 0.01, 0.05, 64, time_limit)]
        for run in runs:
            f = run.figures
            print(f"\n  {run.label}: SIGHUP at {run.hup_at:.2f} s, SIGTERM at {run.term_at:.2f} s "
                  f"({run.in_flight_at_term} requests in flight), apsd exited {run.exit_code} "
                  f"{run.exit_after_term_s:.2f} s after SIGTERM; {f.rate:,.0f} req/s, p99 {f.latency_ms(99):.1f} ms")
            print(textwrap.indent(table(run.rows, ["outcome", "requests", "sent (s after SIGTERM)",
                                                   "longest wait ms"]), "    "))
            problems += run.problems
        print(textwrap.dedent("""
              Client errors are requests apsd never saw: its log (every admission and every refusal) has no
              trace of them, checked request by request above.
              - connection refused: sent after apsd closed its listener, on the way out. Nothing to answer.
              - connection closed before an answer: sent on a new connection as the drain ended and apsd
                stopped hypercorn, which closes connections that have no request in progress. (While
                draining every answer says "Connection: close", so no request waits on a kept-alive
                connection for hypercorn's 2 s graceful timeout as it used to.) Rarely, hypercorn's closer
                races a request that has just arrived: apsd refuses it (503, logged) but the connection
                closes before the answer is written; such refusals are counted separately above. Either
                way the request was never admitted.""")
              .rstrip().replace("\n", "\n  "))
    finally:
        code = report_problems(problems, started, directory)
    return code


if __name__ == "__main__":
    sys.exit(main())
