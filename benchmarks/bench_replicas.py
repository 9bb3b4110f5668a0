"""Benchmark: apsd replicas sharing one Redis store, on one machine: throughput and added latency.

What it measures
    1. Aggregate throughput of 1 replica and of N replicas (``--replicas``, default 2). Each replica
       is the installed ``apsd`` command, a process of its own, with ``[store] kind = "redis"`` on
       one real ``redis-server`` (Debian's package, on a free loopback port, no persistence). The
       simulated GPU is made fast with its own constants, because a shared store requires
       ``gpu.time_scale = 1``: ``prefill_tokens_per_s`` and ``decode_tokens_per_s`` of 1e12 (a
       batch of 16-token requests "runs" in nanoseconds), no batch window (the ``fixed`` governor,
       ``window_ms = 0``: the default governor holds a batch open up to 10 ms of wall time),
       ``policy.micro.max_batch_size`` 1024, one tenant with rate 1e9 and burst 1e12 (admission
       never throttles) and queue limits far above the concurrency, so the HTTP stack is what is
       measured. ``--concurrency`` keep-alive
       connections (closed loop: each sends its next request as soon as its answer is in) POST
       /infer for ``--duration`` seconds per round, after a warm-up. Configurations, loaded in
       alternating rounds (``--rounds``) so that other work on the machine skews them alike:
         * 1 replica, memory store (a reference: what the shared store costs one replica);
         * 1 replica, Redis store;
         * N replicas, Redis store, each on its own port (0: any free one), the client spreading
           its connections over them round-robin (what a load balancer in front would do);
         * N replicas, Redis store, ``[server] reuse_port = true`` on one port: the kernel spreads
           the connections (by a hash of their addresses, so unevenly with few connections).
       Reported per configuration: requests/s (answers completed in the measured window), p50/p99
       of the closed-loop latency, each replica's share of the answers (``split``, from its
       /metrics.json; on a shared port the replica behind each /metrics.json answer is found in
       /proc), and where the CPU went during the window (from /proc): the replicas, the load
       generator, redis-server and everything else ("other": the kernel's own threads, and any
       other work on the machine, which makes every figure suspect: the run reports a problem
       above 0.25 cores), in cores out of the machine's; then the ratio N replicas / 1 replica
       (the issue's goal: >= 1.6 for 2).
    2. The p99 latency the shared store adds. One replica with the memory store and one with the
       Redis store (both running, loaded one at a time in alternating rounds) get the same open
       loop: Poisson arrivals at a fixed rate (``--rate``, default ``--load-fraction`` 0.5 of the
       single-replica Redis throughput measured in part 1), the same seeded arrival times for
       both. Latency runs from a request's scheduled time (so a late client cannot hide a slow
       server: no coordinated omission) to the last byte of its answer. Reported: p50/p90/p99/
       p99.9/max of each and the differences and ratios Redis/memory.

Afterwards every replica's /metrics.json must show every request it got admitted and completed
(the client's 200s add up to the replicas' completions), nothing refused, ``conservation_ok``; every
answer must be 200 with no client error; every replica must exit 0 on SIGTERM with no traceback.
Figures are printed, not asserted: this is not a pytest test and is not collected.

The load generator
    ``--clients`` processes (default 2), each a single-threaded ``selectors`` loop over
    non-blocking sockets with pre-encoded request bytes and answers parsed by Content-Length (a
    few tens of microseconds of CPU per request, against about half a millisecond for a replica).
    It reconnects when an answer says ``Connection: close`` (hypercorn closes a connection after
    1000 requests) and never retries a request. The open loop takes the idle connection that has
    waited longest and closes one idle for over 2 s rather than reuse it: a request sent just as
    apsd's keep-alive timeout (5 s) closes its connection is lost, sometimes after apsd admitted it
    (logged 499 ``client_disconnected``). At the end of a window no new request is sent and the
    ones in flight are awaited (counted only if they finished inside the window), so the servers'
    books balance. Its own CPU time is measured (``time.process_time`` in each process) and shown
    beside the servers': on a 2-core machine it competes with them for the same cores.

Reading the figures on a 2-core machine
    One replica is one Python thread: it saturates one core (``replica cores`` 1.00) while the
    other core is nearly idle. N replicas share both cores with the load generator (about 0.1 core)
    and redis-server (about 0.01), and each costs a little more CPU per request when the cores are
    contended (context switches, caches), so 2 replicas can reach at most about 1.8x; more
    replicas than cores add nothing but contention.

How to run (from the repository root)
    .venv/bin/python benchmarks/bench_replicas.py                   # default: about 2 minutes
    .venv/bin/python benchmarks/bench_replicas.py --quick           # a smoke run: under a minute
    .venv/bin/python benchmarks/bench_replicas.py --replicas 3 --duration 10 --rate 800

All traffic goes to 127.0.0.1 servers this script starts (redis-server and the replicas) and stops.
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import itertools
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks.bench_http import report_problems, stop_process
from tests.helpers import APSD, LISTENING, ROOT
from tests.redis_server import RedisServer, free_loopback_port

TICKS = os.sysconf("SC_CLK_TCK")
BODY = json.dumps({"tenant_id": "bench", "prompt": "Explain token buckets in one paragraph.",
                   "tokens_requested": 16, "priority_bid": 5}).encode()
#: Longest a client waits for the answers still in flight at the end of a window.
DRAIN_TIMEOUT_S = 10.0
#: The open loop closes a connection idle for longer than this rather than reuse it, well before the
#: server's keep-alive timeout (``server.keep_alive_timeout_s``, 5 s): a request sent just as the
#: server closes an idle connection is lost.
IDLE_EXPIRY_S = 2.0


def replica_config(store: str, redis_url: str, key_prefix: str, reuse_port: bool) -> str:
    store_section = (f'[store]\nkind = "redis"\nurl = "{redis_url}"\nkey_prefix = "{key_prefix}"\n'
                     if store == "redis" else '[store]\nkind = "memory"\n')
    return textwrap.dedent(f"""
        [server]
        shutdown_grace_s = 5.0
        reuse_port = {'true' if reuse_port else 'false'}
        [gpu]
        prefill_tokens_per_s = 1e12
        decode_tokens_per_s = 1e12
        [policy]
        governor = "fixed"
        [policy.fixed]
        window_ms = 0.0
        [policy.micro]
        max_batch_size = 1024
        [queue]
        max_requests = 1000000
        max_requests_per_tenant = 1000000
        ingress_buffer = 65536
        [tenants.bench]
        rate = 1e9
        burst = 1000000000000
        """) + store_section


# -- CPU from /proc -------------------------------------------------------------------------------

def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (nan once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / TICKS


def machine_cpu_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, over all cores."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]   # idle + iowait
    total = sum(values[:8])         # (guest time is already counted in user)
    return (total - idle) / TICKS, total / TICKS


# -- servers --------------------------------------------------------------------------------------

@attrs.define
class Replica:
    name: str
    process: subprocess.Popen
    url: str
    log_path: Path

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host.strip("[]"), int(port)

    def cpu_s(self) -> float:
        return process_cpu_s(self.process.pid)

    def metrics(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/metrics.json", timeout=10).json()

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def stop(self, timeout: float = 30.0) -> int | None:
        return stop_process(self.process, timeout)


def start_replica(directory: Path, name: str, config_text: str, port: int = 0) -> Replica:
    """The ``apsd`` command on ``config_text`` (built-in plugins only), its stderr in a log file."""
    config = directory / f"{name}.toml"
    config.write_text(config_text)
    log_path = directory / f"{name}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([APSD, str(config), "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log,
                                   env={**os.environ, "APSD_PLUGINS": "", "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 30
    while not (match := LISTENING.search(log_path.read_bytes())):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"apsd did not start:\n{log_path.read_text(errors='replace')}")
        time.sleep(0.02)
    return Replica(name, process, match.group(1).decode(), log_path)


@attrs.define
class Setup:
    """One configuration under test: its replicas, and the addresses the client connects to."""

    label: str
    replicas: list[Replica]
    reuse_port: bool = False

    @property
    def targets(self) -> list[tuple[str, int]]:
        return sorted({r.address for r in self.replicas})

    def metrics(self) -> list[dict[str, Any]]:
        """Each replica's ``/metrics.json`` ``requests`` figures, in replica order.

        On a shared port (``reuse_port``) a request reaches whichever replica the kernel picks, so
        each answer's replica is found from the server side of its connection: the socket's inode
        in ``/proc/net/tcp``, then the replica whose ``/proc/<pid>/fd`` holds it."""
        if not self.reuse_port:
            return [r.metrics()["requests"] for r in self.replicas]
        found: dict[int, dict[str, Any]] = {}
        for _ in range(100 * len(self.replicas)):
            with socket.create_connection(self.replicas[0].address, timeout=10) as sock:
                sock.sendall(b"GET /metrics.json HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                buffer = b""
                while (parsed := _answer(buffer)) is None:
                    chunk = sock.recv(65536)
                    if not chunk:
                        raise SystemExit(f"{self.label}: /metrics.json: the connection closed early")
                    buffer += chunk
                status, _, used = parsed
                head_end = buffer.find(b"\r\n\r\n") + 4
                owner = _socket_owner(self.replicas, sock.getpeername()[1], sock.getsockname()[1])
                if status == 200 and owner is not None and owner not in found:
                    found[owner] = json.loads(buffer[head_end:used])["requests"]
            if len(found) == len(self.replicas):
                return [found[i] for i in range(len(self.replicas))]
        raise SystemExit(f"{self.label}: could not reach every replica through the shared port")


def _socket_owner(replicas: list[Replica], server_port: int, client_port: int) -> int | None:
    """Which replica (an index) holds the server end of the connection from ``client_port``."""
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if (int(fields[1].split(":")[1], 16) == server_port and int(fields[2].split(":")[1], 16) == client_port
                and fields[9] != "0"):
            inode = f"socket:[{fields[9]}]"
            break
    if inode is None:
        return None
    for index, replica in enumerate(replicas):
        fd_dir = f"/proc/{replica.process.pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                if os.readlink(f"{fd_dir}/{fd}") == inode:
                    return index
            except OSError:   # (closed since listed)
                continue
    return None


def start_setup(directory: Path, label: str, count: int, store: str, redis_url: str, *,
                reuse_port: bool = False) -> Setup:
    key_prefix = f"apsd-bench-{label.replace(' ', '-').replace(',', '')}"
    port = free_loopback_port() if reuse_port else 0
    text = replica_config(store, redis_url, key_prefix, reuse_port)
    replicas: list[Replica] = []
    try:
        for index in range(count):
            replicas.append(start_replica(directory, f"{key_prefix}-{index}", text, port))
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return Setup(label, replicas, reuse_port)


# -- the load generator (runs in its own processes) -----------------------------------------------

REQUEST = (b"POST /infer HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n" % len(BODY)) + BODY


@attrs.frozen
class LoadSpec:
    """What one load process does. Times are ``time.monotonic()`` (one clock for every process)."""

    targets: tuple[tuple[str, int], ...]
    connections: int       # closed loop: this many, always busy; open loop: kept open to start with
    start_at: float        # the measured window opens (the load starts at ``warmup_from``)
    warmup_from: float
    end_at: float
    rate: float = 0.0      # 0: closed loop; else Poisson arrivals at this rate (requests/s) from warmup_from
    seed: int = 0
    max_connections: int = 512


@attrs.define
class LoadReport:
    latencies_s: list[float]              # answers completed inside the window
    statuses: dict[int, int]              # every answer, warm-up and drain included
    errors: dict[str, int]
    sent: int                             # every request sent, warm-up included
    answered: int                         # every answer received, warm-up and drain included
    cpu_s: float                          # this process's CPU time during the window
    max_lag_s: float = 0.0                # open loop: how late a request left after its scheduled time
    connections_opened: int = 0


class _Connection:
    __slots__ = ("buffer", "busy", "idle_since", "scheduled_at", "sock")

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.buffer = b""
        self.scheduled_at = 0.0
        self.busy = False
        self.idle_since = time.monotonic()


def _answer(buffer: bytes) -> tuple[int, bool, int] | None:
    """(status, connection: close, bytes used) of the first whole answer in ``buffer``, if any."""
    end = buffer.find(b"\r\n\r\n")
    if end < 0:
        return None
    lines = buffer[:end].split(b"\r\n")
    length, close = 0, False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection" and value.strip().lower() == b"close":
            close = True
    if len(buffer) < end + 4 + length:
        return None
    return int(lines[0].split()[1]), close, end + 4 + length


def run_load(spec: LoadSpec) -> LoadReport:
    """One load process's loop (synchronous: ``selectors`` over non-blocking sockets)."""
    selector = selectors.DefaultSelector()
    targets = itertools.cycle(spec.targets)
    report = LoadReport([], collections.Counter(), collections.Counter(), 0, 0, 0.0)
    idle: collections.deque[_Connection] = collections.deque()   # (oldest first: each one is reused soon)
    rng = random.Random(spec.seed)
    open_loop = spec.rate > 0

    def open_connection() -> _Connection:
        connection = _Connection(next(targets))
        selector.register(connection.sock, selectors.EVENT_READ, connection)
        report.connections_opened += 1
        return connection

    def close(connection: _Connection) -> None:
        selector.unregister(connection.sock)
        connection.sock.close()

    def send(connection: _Connection, scheduled_at: float) -> None:
        connection.scheduled_at, connection.busy = scheduled_at, True
        connection.sock.sendall(REQUEST)   # (small: the kernel's buffer takes it whole)
        report.sent += 1

    connections = [open_connection() for _ in range(spec.connections)]
    in_flight = 0
    next_arrival = spec.warmup_from + rng.expovariate(spec.rate) if open_loop else float("inf")
    window_cpu_from: float | None = None
    window_cpu_to: float | None = None
    while time.monotonic() < spec.warmup_from:
        time.sleep(min(0.01, max(0.0, spec.warmup_from - time.monotonic())))
    if open_loop:
        idle.extend(connections)
    else:
        for connection in connections:
            send(connection, time.monotonic())
            in_flight += 1
    drain_deadline = spec.end_at + DRAIN_TIMEOUT_S
    while True:
        now = time.monotonic()
        if window_cpu_from is None and now >= spec.start_at:
            window_cpu_from = time.process_time()
        if window_cpu_to is None and now >= spec.end_at:
            window_cpu_to = time.process_time()
        if now >= spec.end_at and (in_flight == 0 or now >= drain_deadline):
            break
        if open_loop:   # send every request whose time has come (late ones at once: their lag counts)
            while next_arrival <= now and next_arrival < spec.end_at:
                connection = None
                while idle and connection is None:
                    connection = idle.popleft()
                    if now - connection.idle_since > IDLE_EXPIRY_S:   # (before the server's keep-alive timeout)
                        close(connection)
                        connection = None
                if connection is None:
                    if len(selector.get_map()) >= spec.max_connections:
                        report.errors["no free connection (max_connections)"] += 1
                        next_arrival += rng.expovariate(spec.rate)
                        continue
                    connection = open_connection()
                report.max_lag_s = max(report.max_lag_s, now - next_arrival)
                send(connection, next_arrival)
                in_flight += 1
                next_arrival += rng.expovariate(spec.rate)
            timeout = max(0.0, min(next_arrival, spec.end_at) - time.monotonic())
        else:
            timeout = max(0.0, spec.end_at - now)
        if now >= spec.end_at:
            timeout = max(0.0, drain_deadline - now)
        for key, _ in selector.select(timeout):
            connection: _Connection = key.data
            try:
                data = connection.sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                data, error = b"", type(exc).__name__
            else:
                error = "connection closed before an answer"
            if not data:
                if connection.busy:
                    report.errors[error] += 1
                    in_flight -= 1
                close(connection)
                if connection in idle:
                    idle.remove(connection)
                if not open_loop and time.monotonic() < spec.end_at:
                    fresh = open_connection()
                    send(fresh, time.monotonic())
                    in_flight += 1
                continue
            connection.buffer += data
            while (parsed := _answer(connection.buffer)) is not None:
                status, must_close, used = parsed
                connection.buffer = connection.buffer[used:]
                done = time.monotonic()
                connection.busy = False
                in_flight -= 1
                report.answered += 1
                report.statuses[status] += 1
                if spec.start_at <= done <= spec.end_at:
                    report.latencies_s.append(done - connection.scheduled_at)
                if must_close:
                    close(connection)
                    connection = open_connection()
                if open_loop:
                    connection.idle_since = done
                    idle.append(connection)
                elif done < spec.end_at:
                    send(connection, done)
                    in_flight += 1
    now_cpu = time.process_time()
    report.cpu_s = (window_cpu_to if window_cpu_to is not None else now_cpu) - (
        window_cpu_from if window_cpu_from is not None else now_cpu)
    if in_flight:
        report.errors["no answer within the drain timeout"] += in_flight
    for key in list(selector.get_map().values()):
        key.fileobj.close()
    report.statuses, report.errors = dict(report.statuses), dict(report.errors)
    return report


def _load_process(spec: LoadSpec, pipe: multiprocessing.connection.Connection) -> None:
    try:
        pipe.send(run_load(spec))
    except Exception as exc:   # (reported by the parent, which fails the run)
        pipe.send(exc)
    finally:
        pipe.close()


# -- one measured window --------------------------------------------------------------------------

@attrs.define
class Window:
    """Everything measured during one window of load on one setup."""

    label: str
    wall_s: float
    reports: list[LoadReport]
    replica_cpu_s: list[float]
    redis_cpu_s: float
    machine_busy_s: float
    completed: list[int]           # per replica: completions its /metrics.json counted during the run

    @property
    def latencies_s(self) -> list[float]:
        return [x for r in self.reports for x in r.latencies_s]

    @property
    def client_cpu_s(self) -> float:
        return sum(r.cpu_s for r in self.reports)

    @property
    def rate(self) -> float:
        return len(self.latencies_s) / self.wall_s

    @staticmethod
    def merge(windows: list[Window]) -> Window:
        first = windows[0]
        return Window(first.label, sum(w.wall_s for w in windows), [r for w in windows for r in w.reports],
                      [sum(c) for c in zip(*(w.replica_cpu_s for w in windows))],
                      sum(w.redis_cpu_s for w in windows), sum(w.machine_busy_s for w in windows),
                      [sum(c) for c in zip(*(w.completed for w in windows))])


def measure(setup: Setup, redis: RedisServer, *, clients: int, connections: int, warmup_s: float,
            duration_s: float, rate: float = 0.0, seed: int = 0) -> tuple[Window, list[str]]:
    """Load ``setup`` from ``clients`` processes for a warm-up and a window; CPU sampled at its edges."""
    problems: list[str] = []
    before = [m["completed"] for m in setup.metrics()]
    context = multiprocessing.get_context("fork")
    start_at = time.monotonic() + 0.5 + 0.1 * clients   # (time for the processes to start and connect)
    warmup_from, end_at = start_at - warmup_s, start_at + duration_s
    if warmup_from < time.monotonic() + 0.3:
        shift = time.monotonic() + 0.3 - warmup_from
        start_at, warmup_from, end_at = start_at + shift, warmup_from + shift, end_at + shift
    workers = []
    for index in range(clients):
        # each process connects to the targets from a different starting point (round-robin overall)
        targets = tuple(setup.targets[(index + k) % len(setup.targets)] for k in range(len(setup.targets)))
        share = connections // clients + (1 if index < connections % clients else 0)
        spec = LoadSpec(targets, share, start_at, warmup_from, end_at, rate / clients if rate else 0.0,
                        seed=seed * 1000 + index)
        receive, send = context.Pipe(duplex=False)
        process = context.Process(target=_load_process, args=(spec, send), daemon=True)
        process.start()
        send.close()
        workers.append((process, receive))
    time.sleep(max(0.0, start_at - time.monotonic()))
    cpu_from = [r.cpu_s() for r in setup.replicas]
    redis_from = process_cpu_s(redis.process.pid)
    busy_from, _ = machine_cpu_s()
    time.sleep(max(0.0, end_at - time.monotonic()))
    cpu_to = [r.cpu_s() for r in setup.replicas]
    redis_to = process_cpu_s(redis.process.pid)
    busy_to, _ = machine_cpu_s()
    reports: list[LoadReport] = []
    for process, receive in workers:
        if not receive.poll(DRAIN_TIMEOUT_S + 30):
            process.kill()
            raise SystemExit(f"{setup.label}: a load process did not report")
        result = receive.recv()
        process.join(10)
        if isinstance(result, BaseException):
            raise SystemExit(f"{setup.label}: a load process failed: {result!r}")
        reports.append(result)
    after = setup.metrics()
    completed = [a["completed"] - b for a, b in zip(after, before)]
    window = Window(setup.label, duration_s, reports, [t - f for t, f in zip(cpu_to, cpu_from)],
                    redis_to - redis_from, busy_to - busy_from, completed)
    answered, sent = sum(r.answered for r in reports), sum(r.sent for r in reports)
    errors = collections.Counter()
    for r in reports:
        errors.update(r.errors)
    statuses = collections.Counter()
    for r in reports:
        statuses.update(r.statuses)
    if errors or set(statuses) - {200}:
        problems.append(f"{setup.label}: statuses {dict(statuses)}, client errors {dict(errors)}")
    if sum(completed) != answered or answered != sent:
        problems.append(f"{setup.label}: {sent} sent, {answered} answered, the replicas completed {completed}")
    for r, a in zip(setup.replicas, after):
        if a["rejected"] or a["in_flight"] or not a["conservation_ok"]:
            problems.append(f"{setup.label}: {r.name}'s books after the run: rejected {a['rejected']}, "
                            f"in flight {a['in_flight']}, conservation_ok {a['conservation_ok']}")
    return window, problems


# -- figures --------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in column) for column in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) if i else str(c).ljust(w)
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def cores(seconds: float, window: Window) -> str:
    return f"{seconds / window.wall_s:.2f}"


def other_cores(window: Window) -> float:
    """Cores busy during the window with neither the replicas, the load generator nor redis-server."""
    return max(0.0, window.machine_busy_s - sum(window.replica_cpu_s) - window.client_cpu_s
               - window.redis_cpu_s) / window.wall_s


def throughput_row(window: Window) -> list[str]:
    lat = window.latencies_s
    replicas = window.replica_cpu_s
    split = "/".join(f"{c / max(1, sum(window.completed)):.0%}" for c in window.completed) if len(replicas) > 1 else "-"
    return [window.label, f"{len(lat):,}", f"{window.rate:,.0f}", f"{percentile(lat, 50) * 1000:.1f}",
            f"{percentile(lat, 99) * 1000:.1f}", split, " + ".join(cores(c, window) for c in replicas),
            cores(window.client_cpu_s, window), cores(window.redis_cpu_s, window), f"{other_cores(window):.2f}",
            cores(window.machine_busy_s, window),
            f"{sum(replicas) / max(1, len(lat)) * 1e6:,.0f}", f"{window.client_cpu_s / max(1, len(lat)) * 1e6:,.0f}"]


THROUGHPUT_HEADER = ["setup", "answers", "req/s", "p50 ms", "p99 ms", "split", "replica cores", "client cores",
                     "redis cores", "other cores", "busy cores", "replica CPU us/req", "client CPU us/req"]


def latency_row(window: Window) -> list[str]:
    lat = window.latencies_s
    lag = max(r.max_lag_s for r in window.reports)
    return [window.label, f"{len(lat):,}", f"{window.rate:,.0f}",
            *(f"{percentile(lat, q) * 1000:.2f}" for q in (50, 90, 99, 99.9, 100)),
            cores(sum(window.replica_cpu_s), window), cores(window.client_cpu_s, window),
            cores(window.redis_cpu_s, window), f"{other_cores(window):.2f}", f"{lag * 1000:.1f}"]


LATENCY_HEADER = ["store", "answers", "req/s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms", "replica cores",
                  "client cores", "redis cores", "other cores", "client max lag ms"]


def versions() -> str:
    names = ("apsd", "trio", "hypercorn", "quart", "quart-trio", "coredis")
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} ?")
    redis_version = subprocess.run([shutil.which("redis-server") or "redis-server", "--version"], check=False,
                                   capture_output=True, text=True).stdout.split()
    found.append("redis-server " + next((w.split("=")[1] for w in redis_version if w.startswith("v=")), "?"))
    return ", ".join(found)


def git_state() -> str:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], check=False,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               check=False, capture_output=True, text=True, timeout=10).stdout.split("\n")
    except OSError:
        return "?"
    changed = [line[3:] for line in dirty if line.strip()]
    return head + (f" + uncommitted changes to {', '.join(changed)}" if changed else "")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


# -- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=2, help="replicas in the multi-replica setups (default 2)")
    parser.add_argument("--duration", type=float, help="seconds per measured throughput round (default 5; --quick 2)")
    parser.add_argument("--latency-duration", type=float,
                        help="seconds per measured latency round (default 10; --quick 3)")
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds of load before each window (default 1.5)")
    parser.add_argument("--rounds", type=int, help="rounds per setup, alternating setups (default 2; --quick 1)")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="keep-alive connections of the throughput runs, over all clients (default 64)")
    parser.add_argument("--clients", type=int, default=2, help="load generator processes (default 2)")
    parser.add_argument("--rate", type=float, help="requests/s of the latency runs (default: --load-fraction "
                        "of the measured 1-replica Redis throughput)")
    parser.add_argument("--load-fraction", type=float, default=0.5,
                        help="the latency runs' rate as a share of 1-replica throughput (default 0.5)")
    parser.add_argument("--skip-reuse-port", action="store_true", help="leave out the reuse_port setup")
    parser.add_argument("--quick", action="store_true", help="a smoke run: under a minute")
    parser.add_argument("--seed", type=int, default=1, help="seed of the latency runs' arrival times (default 1)")
    args = parser.parse_args(argv)
    duration = args.duration or (2.0 if args.quick else 5.0)
    latency_duration = args.latency_duration or (3.0 if args.quick else 10.0)
    rounds = max(1, args.rounds or (1 if args.quick else 2))
    n = max(2, args.replicas)
    clients = max(1, args.clients)
    concurrency = max(clients, args.concurrency)
    if not Path(APSD).exists():
        raise SystemExit(f"{APSD} not found: install apsd into this interpreter's environment")
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed (Debian package 'redis-server')")

    directory = Path(tempfile.mkdtemp(prefix="apsd-bench-replicas-"))
    problems: list[str] = []
    started = time.perf_counter()
    print(f"apsd replicas benchmark: {os.cpu_count()} CPUs ({cpu_model()}), Linux {platform.release()}, "
          f"Python {sys.version.split()[0]}")
    print(f"versions: {versions()}")
    print(f"repository: {git_state()}")
    print(f"command: {' '.join([sys.executable, *sys.argv])}")
    busy_from, _ = machine_cpu_s()
    time.sleep(1.0)
    idle_busy = machine_cpu_s()[0] - busy_from
    print(f"before the run: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {idle_busy:.2f} cores busy "
          f"over 1 s (other work on this machine skews every figure: see 'other cores' below; setups are loaded "
          f"in alternating rounds so it skews them alike)")
    print(f"POST /infer, 16 tokens, one tenant (rate 1e9, burst 1e12); [gpu] prefill/decode 1e12 tokens/s, "
          f"time_scale 1; governor fixed, window 0 ms; policy.micro.max_batch_size 1024; "
          f"store sync_interval_s 0.05 (the default); load: {clients} client processes (selectors, keep-alive)\n")

    redis = RedisServer(binary, free_loopback_port())
    trio.run(redis.start)
    setups: list[Setup] = []
    try:
        # -- part 1: throughput --
        setups = [start_setup(directory, "1 replica, memory", 1, "memory", redis.url),
                  start_setup(directory, "1 replica, redis", 1, "redis", redis.url),
                  start_setup(directory, f"{n} replicas, redis, own ports", n, "redis", redis.url)]
        if not args.skip_reuse_port:
            setups.append(start_setup(directory, f"{n} replicas, redis, reuse_port", n, "redis", redis.url,
                                      reuse_port=True))
        print(f"1. Throughput: closed loop, {concurrency} connections, {rounds} round(s) of {duration:g} s per "
              f"setup after {args.warmup:g} s of warm-up each; 'cores' are CPU-seconds per second of the window "
              f"(this machine has {os.cpu_count()})")
        windows: dict[str, list[Window]] = collections.defaultdict(list)
        for round_ in range(rounds):
            for setup in setups if round_ % 2 == 0 else reversed(setups):
                window, found = measure(setup, redis, clients=clients, connections=concurrency,
                                        warmup_s=args.warmup, duration_s=duration)
                windows[setup.label].append(window)
                problems += found
        merged = {label: Window.merge(ws) for label, ws in windows.items()}
        print(table([throughput_row(merged[s.label]) for s in setups], THROUGHPUT_HEADER))
        per_round = {s.label: " ".join(f"{w.rate:,.0f}" for w in windows[s.label]) for s in setups}
        print("  req/s per round: " + "; ".join(f"{label}: {rates}" for label, rates in per_round.items()))
        one = merged["1 replica, redis"].rate
        print()
        for setup in setups[2:]:
            ratio = merged[setup.label].rate / one if one else float("nan")
            verdict = (f"{'meets' if ratio >= 1.6 else 'MISSES'} the issue's x1.6 goal" if n == 2
                       else "the issue's goal, x1.6, is for 2 replicas")
            print(f"  {setup.label}: x{ratio:.2f} the throughput of 1 replica with redis ({verdict})")
        memory_one = merged["1 replica, memory"].rate
        print(f"  1 replica: redis store / memory store throughput x{one / memory_one:.2f}")

        # -- part 2: latency at a fixed rate --
        rate = args.rate or args.load_fraction * one
        source = "--rate" if args.rate else f"{args.load_fraction:g} x the 1-replica redis throughput"
        print(f"\n2. Latency the shared store adds: 1 replica, memory store vs Redis store, open loop, Poisson "
              f"arrivals at {rate:,.0f} req/s ({source}), "
              f"the same arrival times for both (seed {args.seed}), {rounds} round(s) of {latency_duration:g} s each; "
              f"latency from each request's scheduled time to the last byte of its answer")
        lat_windows: dict[str, list[Window]] = collections.defaultdict(list)
        pair = [setups[0], setups[1]]
        for round_ in range(rounds):
            for setup in pair if round_ % 2 == 0 else reversed(pair):
                window, found = measure(setup, redis, clients=clients, connections=8, warmup_s=args.warmup,
                                        duration_s=latency_duration, rate=rate, seed=args.seed + round_)
                window.label = "memory" if setup is setups[0] else "redis"
                lat_windows[window.label].append(window)
                problems += found
        lat = {label: Window.merge(ws) for label, ws in lat_windows.items()}
        busiest = max((w for ws in (*windows.values(), *lat_windows.values()) for w in ws), key=other_cores)
        if other_cores(busiest) > 0.25:
            problems.append(f"other work on this machine used up to {other_cores(busiest):.2f} cores during a window "
                            f"({busiest.label}): every figure above is skewed by it; run again on a quiet machine")
        print(table([latency_row(lat[label]) for label in ("memory", "redis")], LATENCY_HEADER))
        m, r = lat["memory"].latencies_s, lat["redis"].latencies_s
        print("  redis - memory: " + ", ".join(
            f"p{q:g} {(percentile(r, q) - percentile(m, q)) * 1000:+.2f} ms "
            f"(x{percentile(r, q) / percentile(m, q):.2f})" for q in (50, 90, 99, 99.9)))
        print("  p99 per round: " + "; ".join(
            f"{label}: {' '.join(f'{percentile(w.latencies_s, 99) * 1000:.2f}' for w in lat_windows[label])} ms"
            for label in ("memory", "redis")))
    finally:
        for setup in setups:
            for replica in setup.replicas:
                code = replica.stop()
                if code != 0:
                    problems.append(f"{replica.name} exited {code} on SIGTERM")
                if "Traceback" in replica.log():
                    problems.append(f"{replica.name}: a traceback in its log {replica.log_path}")
        redis.kill()
    return report_problems(problems, started, directory, "replica logs")


if __name__ == "__main__":
    sys.exit(main())
