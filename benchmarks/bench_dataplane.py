"""Benchmark: the data plane, apsd against LiteLLM's proxy and against no gateway at all, on one machine.

The reference benchmark of what a gateway costs on the request path. Three targets get the same
load, in alternating rounds so that they see the same machine:

* ``direct``: a fast stand-in OpenAI-compatible server (``benchmarks/standin``, Go: it answers at
  once, or after 20 ms for the model ``standin-20ms``, and streams vLLM-shaped chunks as fast as
  the socket takes them), so what is measured is the gateway, not a model;
* ``apsd`` in front of it: one tenant with unlimited rate, one ``[[backends]]`` entry with
  ``max_concurrency = 1024``, everything else the shipped defaults (the point is to measure
  the defaults; ``--apsd-config-extra`` appends TOML to measure a variant);
* ``LiteLLM`` (``litellm[proxy]==1.108.7``, one worker, no database, a master key) in front of it.

The stand-in and the load generator (``standin load``, in the same Go program) run on core 1; the
gateway under test runs on core 0, alone (``taskset``): the gateway's own cost is what is read.

What it measures
    a. Latency at concurrency 1, non-streamed and streamed (16 tokens): p50/p99/mean of the whole
       answer, and of the time to the first content chunk (TTFT) for streams; "added" is the
       target's figure minus direct's.
    b. The highest open-loop rate (requests started at fixed intervals, whatever the answers do)
       that a target serves with p99 < 1 s, no error, against the 20 ms model: a ramp of rates,
       each held a few seconds; a target's ramp stops at its first failing rate.
    c. Relayed chunks per second with 64 and 256 concurrent streams of 256 tokens each, started
       at once: throughput, the inter-chunk gaps seen by the clients (p50/p99 over all streams,
       and the worst stream's p99), and whether every stream arrived whole (all its chunks and
       ``[DONE]``).
    d. The gateway's CPU (utime + stime from /proc, its child processes included) per 1,000
       non-streamed requests (over the runs of a.) and per 1,000 relayed chunks (over the runs of
       c.), and its peak RSS (VmHWM) at the end.

Goals (apsd)
    * added TTFT at concurrency 1: at most 1 ms at p50 and 3 ms at p99;
    * at most 1 ms of CPU per non-streamed request (1,000 ms per 1,000);
    * at least 1,000 req/s with p99 < 1 s against the 20 ms model;
    * at least 30,000 relayed chunks/s with 64 and with 256 streams, every stream complete, with an
      inter-chunk p99 of at most 2x direct's + 1 ms.

How to run (from the repository root; needs ``go`` (1.19+) and ``taskset``; LiteLLM is installed
on first use into its own venv under ~/.cache/apsd, which needs the network once)
    .venv/bin/python benchmarks/bench_dataplane.py                  # ~9 minutes on 2 cores
    .venv/bin/python benchmarks/bench_dataplane.py --quick          # ~4 minutes
    .venv/bin/python benchmarks/bench_dataplane.py --no-litellm     # direct and apsd only
    .venv/bin/python benchmarks/bench_dataplane.py --litellm-venv /tmp/litellm-venv --json out.json
    .venv/bin/python benchmarks/bench_dataplane.py --apsd-config-extra $'[engine]\\nisolation = false'
    .venv/bin/python benchmarks/bench_dataplane.py --floor          # also empty apps on apsd's HTTP stack
    .venv/bin/python benchmarks/bench_dataplane.py --no-litellm --measures latency --max-cpu-ratio 2.6
                                        # CI's check (.ci/run): exit 1 when apsd's CPU per request is above
                                        # 2.6x the empty Quart-Trio handler's, measured in the same run

Most of the time goes to LiteLLM, whose streams relay a few hundred chunks per second here
(``--measures latency,rate`` leaves the streams out). ``--no-apsd`` measures direct and LiteLLM
only (to check the rest of the benchmark while apsd does not start).

Reading the figures
    The stand-in answers at once, so a gateway that falls behind reads several events per socket
    read and relays them together: its inter-chunk gaps are then mostly zero, and a stall shows in
    the gap maximum, the worst stream's p99 and the streams' TTFT rather than in the pooled p99.
    The ramp's rates start at 25 req/s (below the 100 of the goal) so that a slow gateway still
    gets a figure; a step passes with no error, p99 < 1 s, and the generator having kept up
    (90% of the rate sent). CPU comes from /proc in clock ticks (10 ms): read small figures
    (the stand-in's) as rough.
Everything runs on 127.0.0.1; every process started is stopped by PID on the way out (SIGTERM,
then SIGKILL). Logs and configs are kept in a temporary directory, printed at the start. On a
machine with other work running, read the figures as upper bounds (and the ratios as rough).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STANDIN_DIR = ROOT / "benchmarks" / "standin"
#: The installed ``apsd`` command of this interpreter (as tests/helpers.py finds it; not imported
#: from there, so that this benchmark does not import apsd itself).
APSD = str(Path(sys.executable).with_name("apsd"))
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "apsd"
LITELLM_VERSION = "1.108.7"
#: LiteLLM refuses to start without a master key; without a database it checks it in memory.
LITELLM_KEY = "sk-bench-" + "0123456789abcdef" * 2
GATEWAY_CORE, CLIENT_CORE = "0", "1"
TARGETS = ("direct", "apsd", "LiteLLM")
FAST_MODEL, SLOW_MODEL, SLOW_MS = "standin", "standin-20ms", 20
RATES = (25, 50, 100, 200, 300, 400, 600, 800, 1000, 1200, 1600, 2000)
STREAMS = (64, 256)
STREAM_TOKENS = 256
P99_LIMIT_MS = 1000.0
#: The empty Quart-Trio handler (``--floor``): the reference of ``--max-cpu-ratio``.
FLOOR_QUART = "Quart-Trio, empty"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- processes ----------------------------------------------------------------------------------


class Processes:
    """What this run started, stopped by PID in reverse order (SIGTERM, then SIGKILL)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.started: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        out = open(self.work / f"{name}.log", "wb")
        log(f"starting {name}: {shlex.join(argv)}")
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env={**os.environ, **(env or {})}, cwd=cwd)
        out.close()
        self.started.append((name, process))
        return process

    def log_tail(self, name: str, lines: int = 20) -> str:
        text = (self.work / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop_all(self) -> None:
        for name, process in reversed(self.started):
            family = [process.pid, *descendants(process.pid)]
            for pid in family:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log(f"{name} ({process.pid}) ignored SIGTERM: SIGKILL")
            for pid in family:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
        self.started.clear()


def descendants(pid: int) -> list[int]:
    """The PIDs of ``pid``'s children, grandchildren, ... now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its live descendants, in seconds."""
    total = 0
    for each in (pid, *descendants(pid)):
        try:
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    """VmHWM of ``pid`` and its live descendants, summed, in MiB."""
    total = 0
    for each in (pid, *descendants(pid)):
        try:
            for line in Path(f"/proc/{each}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def wait_ready(name: str, process: subprocess.Popen, processes: Processes, check: Callable[[], bool],
               limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited ({process.returncode}) before it was ready:\n{processes.log_tail(name)}")
        try:
            if check():
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not ready after {limit_s:.0f} s:\n{processes.log_tail(name)}")
        time.sleep(0.2)


# -- the stand-in, apsd, LiteLLM ----------------------------------------------------------------


def build_standin() -> Path:
    """The stand-in binary, built once per version of its source into ~/.cache/apsd/standin/."""
    digest = hashlib.sha256()
    for name in ("go.mod", "main.go"):
        digest.update((STANDIN_DIR / name).read_bytes())
    binary = CACHE / "standin" / digest.hexdigest()[:16] / "standin"
    if not binary.exists():
        go = shutil.which("go") or "/usr/bin/go"
        binary.parent.mkdir(parents=True, exist_ok=True)
        log(f"building the stand-in: {binary}")
        subprocess.run([go, "build", "-o", str(binary), "."], cwd=STANDIN_DIR, check=True,
                       env={**os.environ, "CGO_ENABLED": "0", "GOPROXY": "off", "GOTOOLCHAIN": "local"})
    return binary


def start_standin(processes: Processes, binary: Path) -> str:
    port = free_port()
    process = processes.start("standin", ["taskset", "-c", CLIENT_CORE, str(binary), "serve", "--port", str(port),
                                          "--model-delay", f"{SLOW_MODEL}={SLOW_MS}"])
    url = f"http://127.0.0.1:{port}"
    wait_ready("standin", process, processes, lambda: httpx.get(url + "/health").status_code == 200, 20)
    return url


def apsd_config(port: int, backend: str, extra: str) -> str:
    return f"""\
[server]
port = {port}

[tenants.bench]
rate = 1e9
burst = 1000000000

[[backends]]
url = "{backend}"
max_concurrency = 1024
""" + (f"\n# --apsd-config-extra\n{extra}\n" if extra else "")


def start_apsd(processes: Processes, backend: str, extra: str) -> tuple[str, int]:
    port = free_port()
    config = processes.work / "apsd.toml"
    config.write_text(apsd_config(port, backend, extra))
    process = processes.start("apsd", ["taskset", "-c", GATEWAY_CORE, APSD, str(config)], env={"APSD_PLUGINS": ""})
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if httpx.get(url + "/ready").status_code != 200:
            return False
        models = {m["id"] for m in httpx.get(url + "/v1/models", headers={"X-Apsd-Tenant": "bench"}).json()["data"]}
        return {FAST_MODEL, SLOW_MODEL} <= models

    try:
        wait_ready("apsd", process, processes, ready, 60)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n(--no-apsd measures direct and LiteLLM without it)") from None
    return url, process.pid


def start_floor(processes: Processes, kind: str) -> tuple[str, int]:
    """An empty app (``benchmarks/http_floor.py``: ``quart`` or ``asgi``) on the gateway core."""
    port = free_port()
    process = processes.start(f"floor-{kind}", ["taskset", "-c", GATEWAY_CORE, sys.executable,
                                                str(ROOT / "benchmarks" / "http_floor.py"), kind, str(port)])
    url = f"http://127.0.0.1:{port}"
    wait_ready(f"floor-{kind}", process, processes,
               lambda: httpx.post(url + "/v1/chat/completions", json={"model": "standin"}).status_code == 200, 20)
    return url, process.pid


def litellm_venv(given: str | None) -> Path:
    """A venv with ``litellm[proxy]``: ``given``, or one made once under ~/.cache/apsd."""
    if given:
        venv = Path(given)
        if not (venv / "bin" / "litellm").exists():
            raise SystemExit(f"--litellm-venv {given}: no bin/litellm there")
        return venv
    venv = CACHE / f"litellm-venv-{LITELLM_VERSION}"
    if not (venv / "bin" / "litellm").exists():
        log(f"installing litellm[proxy]=={LITELLM_VERSION} into {venv} (once)")
        python = shutil.which("python3") or sys.executable
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "--quiet", f"litellm[proxy]=={LITELLM_VERSION}"],
                       check=True)
    return venv


def litellm_version(venv: Path) -> str:
    return subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import importlib.metadata as m; print(m.version('litellm'))"],
                          capture_output=True, text=True).stdout.strip() or "?"


#: Quiet and offline: no per-request access log (LITELLM_LOG puts uvicorn's log level at ERROR), the
#: bundled model cost map (no fetch from GitHub at start), telemetry vetoed, no .env read
#: (PRODUCTION), no admin UI or docs pages; in the config: no message logging, no spend or error
#: logs (there is no database anyway).
LITELLM_ENV = {"LITELLM_LOG": "ERROR", "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY_DISABLED": "true",
               "LITELLM_MODE": "PRODUCTION", "DISABLE_ADMIN_UI": "True", "NO_DOCS": "True", "NO_REDOC": "True"}


def litellm_config(backend: str) -> str:
    models = "".join(f"""\
  - model_name: {name}
    litellm_params:
      model: openai/{name}
      api_base: {backend}/v1
      api_key: dummy
""" for name in (FAST_MODEL, SLOW_MODEL))
    return f"""\
model_list:
{models}
litellm_settings:
  turn_off_message_logging: true
  set_verbose: false
general_settings:
  master_key: {LITELLM_KEY}
  disable_spend_logs: true
  disable_error_logs: true
"""


def start_litellm(processes: Processes, venv: Path, backend: str) -> tuple[str, int]:
    port = free_port()
    config = processes.work / "litellm.yaml"
    config.write_text(litellm_config(backend))
    process = processes.start("litellm", ["taskset", "-c", GATEWAY_CORE, str(venv / "bin" / "litellm"),
                                          "--config", str(config), "--host", "127.0.0.1", "--port", str(port),
                                          "--num_workers", "1"], env=LITELLM_ENV, cwd=processes.work)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {LITELLM_KEY}"}
    body = {"model": FAST_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    wait_ready("litellm", process, processes,
               lambda: httpx.get(url + "/health/liveliness").status_code == 200
               and httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=30).status_code == 200,
               240)
    return url, process.pid


# -- the load generator -------------------------------------------------------------------------


class Target:
    def __init__(self, name: str, url: str, headers: dict[str, str], pid: int, floor: bool = False) -> None:
        self.name, self.url, self.headers, self.pid = name, url + "/v1/chat/completions", headers, pid
        #: An empty app (``--floor``): measured at concurrency 1 and in the rate ramp, not in the streams.
        self.floor = floor


def load(binary: Path, target: Target, *args: str, timeout_s: float = 600) -> dict[str, Any]:
    """One ``standin load`` run against ``target`` on the client core; its JSON report."""
    argv = ["taskset", "-c", CLIENT_CORE, str(binary), "load", "--url", target.url, "--raw", *args]
    for key, value in target.headers.items():
        argv += ["--header", f"{key}: {value}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 120)
    if done.returncode != 0:
        raise RuntimeError(f"standin load failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def rounds_order(targets: list[Target], round_: int) -> list[Target]:
    """Every target once, the order turned by one each round (no target always first)."""
    k = round_ % len(targets)
    return targets[k:] + targets[:k]


def stats(values: Iterable[float]) -> dict[str, float | None]:
    array = np.asarray(list(values), dtype=float)
    if not array.size:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    return {"n": int(array.size), "p50": float(np.percentile(array, 50)), "p90": float(np.percentile(array, 90)),
            "p99": float(np.percentile(array, 99)), "mean": float(array.mean()), "max": float(array.max())}


def warm_up(binary: Path, targets: list[Target]) -> None:
    for target in targets:
        log(f"warming up {target.name}")
        load(binary, target, "--mode", "latency", "--n", "50", "--timeout", "60")
        load(binary, target, "--mode", "latency", "--n", "50", "--stream", "--timeout", "60")
        if not target.floor:
            load(binary, target, "--mode", "streams", "--streams", "8", "--tokens", "64", "--timeout", "120")


# -- a. latency at concurrency 1 (and d. CPU per request) ---------------------------------------


def measure_latency(binary: Path, targets: list[Target], rounds: int, n: int) -> dict[str, Any]:
    samples = {t.name: {"plain": [], "stream_ttft": [], "stream_total": []} for t in targets}
    errors = {t.name: 0 for t in targets}
    cpu = {t.name: [0.0, 0] for t in targets}   # seconds, requests
    for round_ in range(rounds):
        for target in rounds_order(targets, round_):
            log(f"latency: round {round_ + 1}/{rounds}, {target.name}")
            before = cpu_seconds(target.pid)
            plain = load(binary, target, "--mode", "latency", "--n", str(n), "--timeout", "60")
            cpu[target.name][0] += cpu_seconds(target.pid) - before
            cpu[target.name][1] += plain["sent"]
            stream = load(binary, target, "--mode", "latency", "--n", str(n), "--stream", "--timeout", "60")
            samples[target.name]["plain"] += plain["samples"]["latency_ms"]
            samples[target.name]["stream_ttft"] += stream["samples"]["ttft_ms"]
            samples[target.name]["stream_total"] += stream["samples"]["latency_ms"]
            errors[target.name] += plain["errors"] + stream["errors"]
    result: dict[str, Any] = {}
    for name, kinds in samples.items():
        result[name] = {kind: stats(values) for kind, values in kinds.items()}
        result[name]["errors"] = errors[name]
        seconds, requests = cpu[name]
        result[name]["cpu_ms_per_1k_requests"] = seconds * 1000 / requests * 1000 if requests else None
    if "direct" in result:
        for name in result:
            result[name]["added"] = {kind: {q: _minus(result[name][kind][q], result["direct"][kind][q])
                                            for q in ("p50", "p99", "mean")} for kind in samples[name]}
    return result


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


# -- b. the highest rate with p99 < 1 s against the 20 ms model ---------------------------------


def measure_rate(binary: Path, targets: list[Target], duration_s: float) -> dict[str, Any]:
    result: dict[str, Any] = {t.name: {"highest_rps": None, "p99_ms_at_highest": None, "failed_at": None,
                                       "steps": []} for t in targets}
    running = list(targets)
    for rate in RATES:
        for target in list(running):
            log(f"rate: {rate} req/s for {duration_s:g} s, {target.name}")
            run = load(binary, target, "--mode", "rate", "--rate", str(rate), "--duration", str(duration_s),
                       "--model", SLOW_MODEL, "--timeout", "5", timeout_s=duration_s + 10)
            p99 = run["latency_ms"]["p99"]
            generator_kept_up = run["offered_rps"] >= 0.9 * rate
            passed = run["errors"] == 0 and p99 is not None and p99 < P99_LIMIT_MS and generator_kept_up
            entry = result[target.name]
            entry["steps"].append({"rate": rate, "passed": passed, "p50_ms": run["latency_ms"]["p50"], "p99_ms": p99,
                                   "errors": run["errors"], "error_samples": run["error_samples"],
                                   "achieved_rps": run["achieved_rps"], "offered_rps": run["offered_rps"]})
            if passed:
                entry["highest_rps"], entry["p99_ms_at_highest"] = rate, p99
            else:
                entry["failed_at"] = rate
                entry["generator_limited"] = not generator_kept_up
                running.remove(target)
                time.sleep(2)   # let what it still holds drain before the next target's step
        if not running:
            break
    return result


# -- c. relayed chunks/s with many streams (and d. CPU per chunk) -------------------------------


def measure_streams(binary: Path, targets: list[Target], rounds: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    cpu = {t.name: [0.0, 0] for t in targets}   # seconds, chunks
    for streams in STREAMS:
        pooled = {t.name: {"chunks": 0, "wall_s": 0.0, "gaps": [], "ttft": [], "complete": True, "errors": 0,
                           "worst_stream_p99": 0.0, "error_samples": []} for t in targets}
        for round_ in range(rounds):
            for target in rounds_order(targets, round_):
                log(f"streams: {streams} x {STREAM_TOKENS} tokens, round {round_ + 1}/{rounds}, {target.name}")
                before = cpu_seconds(target.pid)
                run = load(binary, target, "--mode", "streams", "--streams", str(streams),
                           "--tokens", str(STREAM_TOKENS), "--timeout", "900", timeout_s=900)
                cpu[target.name][0] += cpu_seconds(target.pid) - before
                cpu[target.name][1] += run["chunks"]
                entry = pooled[target.name]
                entry["chunks"] += run["chunks"]
                entry["wall_s"] += run["wall_s"]
                entry["gaps"] += run["samples"]["gap_ms"]
                entry["ttft"] += run["samples"]["ttft_ms"]
                entry["complete"] = entry["complete"] and run["all_complete"]
                entry["errors"] += run["errors"]
                entry["error_samples"] = entry["error_samples"] or run["error_samples"]
                entry["worst_stream_p99"] = max(entry["worst_stream_p99"], run["gap_ms"]["worst_stream_p99"] or 0.0)
        result[str(streams)] = {name: {"chunks_per_s": e["chunks"] / e["wall_s"] if e["wall_s"] else None,
                                       "gap_ms": stats(e["gaps"]), "ttft_ms": stats(e["ttft"]),
                                       "worst_stream_gap_p99_ms": e["worst_stream_p99"], "all_complete": e["complete"],
                                       "errors": e["errors"], "error_samples": e["error_samples"]}
                                for name, e in pooled.items()}
    result["cpu_ms_per_1k_chunks"] = {name: seconds * 1000 / chunks * 1000 if chunks else None
                                      for name, (seconds, chunks) in cpu.items()}
    return result


# -- the report ---------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    model = "?"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    # (the checkout the measured apsd comes from: the one its venv imports, not necessarily this one)
    package = subprocess.run([str(Path(APSD).with_name("python")), "-c", "import apsd, os; print(os.path.dirname("
                              "apsd.__file__))"], capture_output=True, text=True).stdout.strip() or str(ROOT)
    commit = subprocess.run(["git", "-C", package, "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    go = subprocess.run([shutil.which("go") or "/usr/bin/go", "version"], capture_output=True, text=True).stdout.strip()
    return {"cores": os.cpu_count(), "cpu": model, "apsd_commit": commit or "?", "go": go,
            "python": sys.version.split()[0]}


def fmt(value: Any, digits: int = 2, sign: bool = False) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    if abs(value) >= 1000:
        return f"{value:+,.0f}" if sign else f"{value:,.0f}"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def ratio(a: Any, b: Any) -> str:
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or isinstance(a, bool) or not b:
        return "—"
    value = a / b
    return "< 0.01x" if 0 < value < 0.01 else f"{value:,.2f}x" if value < 100 else f"{value:,.0f}x"


def table(results: dict[str, Any], names: list[str]) -> list[str]:
    """The rows: | measure | direct | apsd | LiteLLM | apsd/direct | apsd/LiteLLM | (the ratio columns
    where both targets ran). A latency cell of a gateway reads "value (+added)"; its ratios compare
    what the gateways add."""
    rows: list[tuple[str, dict[str, str], str, str]] = []   # label, cells by target, apsd/direct, apsd/LiteLLM

    def row(label: str, values: dict[str, Any], vs_direct: bool = False, vs_litellm: bool = True,
            added: dict[str, Any] | None = None, **style: Any) -> None:
        cells = {n: fmt(v, **style) for n, v in values.items()}
        for n, extra in (added or {}).items():
            if extra is not None and n != "direct":
                cells[n] += f" ({fmt(extra, sign=True, **style)})"
        basis = added if added is not None else values
        a = basis.get("apsd")
        rows.append((label, cells, ratio(a, values.get("direct")) if vs_direct else "",
                     ratio(a, basis.get("LiteLLM")) if vs_litellm else ""))

    latency = results.get("latency")
    if latency:
        for kind, label in (("plain", "c=1 non-streamed"), ("stream_ttft", "c=1 streamed, TTFT"),
                            ("stream_total", "c=1 streamed, whole answer")):
            for q in ("p50", "p99", "mean"):
                added = {n: latency[n]["added"][kind][q] for n in latency} if "direct" in latency else None
                row(f"{label} {q} (ms)", {n: latency[n][kind][q] for n in latency}, added=added,
                    vs_litellm=added is not None)
        row("c=1 errors", {n: latency[n]["errors"] for n in latency}, vs_litellm=False, digits=0)
    rate = results.get("rate")
    if rate:
        row(f"highest rate with p99 < 1 s at {SLOW_MS} ms (req/s)",
            {n: (rate[n]["highest_rps"] if rate[n]["highest_rps"] is not None else f"< {RATES[0]}")
             for n in rate}, vs_direct=True, digits=0)
        row("  p99 at that rate (ms)", {n: rate[n]["p99_ms_at_highest"] for n in rate}, vs_litellm=False)
        row("  first failing rate (req/s)",
            {n: rate[n]["failed_at"] if rate[n]["failed_at"] is not None else f"none to {RATES[-1]}" for n in rate},
            vs_litellm=False, digits=0)
    streams = results.get("streams")
    if streams:
        for k in STREAMS:
            per = streams[str(k)]
            row(f"{k} streams x {STREAM_TOKENS}: chunks/s", {n: per[n]["chunks_per_s"] for n in per},
                vs_direct=True, digits=0)
            row("  inter-chunk gap p50 (ms)", {n: per[n]["gap_ms"]["p50"] for n in per}, vs_litellm=False, digits=3)
            row("  inter-chunk gap p99 (ms)", {n: per[n]["gap_ms"]["p99"] for n in per}, digits=3)
            row("  inter-chunk gap max (ms)", {n: per[n]["gap_ms"]["max"] for n in per}, vs_litellm=False, digits=1)
            row("  worst stream's gap p99 (ms)", {n: per[n]["worst_stream_gap_p99_ms"] for n in per},
                vs_litellm=False, digits=3)
            row("  TTFT p99 (ms)", {n: per[n]["ttft_ms"]["p99"] for n in per}, vs_litellm=False, digits=1)
            row("  every stream complete", {n: per[n]["all_complete"] for n in per}, vs_litellm=False)
    cpu = results.get("cpu")
    if cpu:
        if cpu["per_1k_requests"]:
            row("CPU per 1,000 non-streamed requests (ms)", cpu["per_1k_requests"], digits=0)
        if cpu["per_1k_chunks"]:
            row("CPU per 1,000 relayed chunks (ms)", cpu["per_1k_chunks"], digits=1)
        row("peak RSS (MiB)", cpu["peak_rss_mib"], digits=0)

    ratios = [(title, i) for i, (title, other) in enumerate((("apsd/direct", "direct"), ("apsd/LiteLLM", "LiteLLM")))
              if "apsd" in names and other in names]
    header = ["measure", *names, *(title for title, _ in ratios)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for label, cells, *by_ratio in rows:
        line = [label, *(cells.get(n, "—") for n in names), *(by_ratio[i] for _, i in ratios)]
        lines.append("| " + " | ".join(line) + " |")
    return lines


def goals(results: dict[str, Any]) -> list[str]:
    """apsd's goals, each met or not (or not measured)."""
    out = []
    latency, rate, streams, cpu = (results.get(k) for k in ("latency", "rate", "streams", "cpu"))

    def line(ok: bool | None, text: str) -> None:
        out.append(f"  [{'met' if ok else 'NOT met' if ok is not None else 'n/a'}] {text}")

    if latency and "apsd" in latency and "direct" in latency:
        added = latency["apsd"]["added"]["stream_ttft"]
        line(added["p50"] <= 1 and added["p99"] <= 3,
             f"added TTFT at c=1 <= 1 ms p50 / 3 ms p99: {added['p50']:+.2f} / {added['p99']:+.2f} ms")
    if cpu and cpu["per_1k_requests"].get("apsd") is not None:
        ms = cpu["per_1k_requests"]["apsd"] / 1000
        line(ms <= 1, f"CPU per non-streamed request <= 1 ms: {ms:.2f} ms")
    if rate and "apsd" in rate:
        best = rate["apsd"]["highest_rps"]
        line(best is not None and best >= 1000, f">= 1,000 req/s with p99 < 1 s at {SLOW_MS} ms: {best or 0} req/s")
    if streams and "apsd" in streams[str(STREAMS[0])]:
        for k in STREAMS:
            mine, direct = streams[str(k)]["apsd"], streams[str(k)].get("direct")
            bound = 2 * direct["gap_ms"]["p99"] + 1 if direct and direct["gap_ms"]["p99"] is not None else None
            p99 = mine["gap_ms"]["p99"]
            ok = (mine["chunks_per_s"] or 0) >= 30_000 and mine["all_complete"] and bound is not None \
                and p99 is not None and p99 <= bound
            line(ok, f"{k} streams: >= 30,000 chunks/s, all complete, inter-chunk p99 <= 2x direct + 1 ms: "
                     f"{mine['chunks_per_s'] or 0:,.0f} chunks/s, complete {fmt(mine['all_complete'])}, "
                     f"p99 {fmt(p99, 3)} ms (bound {fmt(bound, 3)} ms)")
    return out


# -- main ---------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    quick = args.quick
    rounds = args.rounds or (2 if quick else 3)
    stream_rounds = args.stream_rounds or (1 if quick else 2)
    n = args.requests or (150 if quick else 300)
    duration = args.rate_duration or (2.0 if quick else 4.0)
    measures = set(args.measures.split(","))
    started = time.monotonic()

    binary = build_standin()
    venv = None if args.no_litellm else litellm_venv(args.litellm_venv)
    work = Path(tempfile.mkdtemp(prefix="apsd-bench-dataplane-"))
    log(f"logs and configs in {work}")
    processes = Processes(work)
    results: dict[str, Any] = {"machine": machine(), "command": shlex.join([sys.executable, *sys.argv]),
                               "litellm_version": litellm_version(venv) if venv else None,
                               "settings": {"rounds": rounds, "stream_rounds": stream_rounds, "requests": n,
                                            "rate_duration_s": duration, "rates": RATES, "streams": STREAMS,
                                            "stream_tokens": STREAM_TOKENS,
                                            "apsd_config_extra": args.apsd_config_extra}}
    try:
        standin = start_standin(processes, binary)
        targets = [Target("direct", standin, {}, processes.started[0][1].pid)]
        if not args.no_apsd:
            url, pid = start_apsd(processes, standin, args.apsd_config_extra)
            targets.append(Target("apsd", url, {"X-Apsd-Tenant": "bench"}, pid))
        if venv:
            url, pid = start_litellm(processes, venv, standin)
            targets.append(Target("LiteLLM", url, {"Authorization": f"Bearer {LITELLM_KEY}"}, pid))
        if args.floor:
            for kind, name in (("quart", FLOOR_QUART), ("asgi", "Hypercorn, empty")):
                url, pid = start_floor(processes, kind)
                targets.append(Target(name, url, {}, pid, floor=True))
        names = [t.name for t in targets]
        warm_up(binary, targets)
        if "latency" in measures:
            results["latency"] = measure_latency(binary, targets, rounds, n)
        if "rate" in measures:
            results["rate"] = measure_rate(binary, targets, duration)
        if "streams" in measures:
            results["streams"] = measure_streams(binary, [t for t in targets if not t.floor], stream_rounds)
        results["cpu"] = {
            "per_1k_requests": {name: v["cpu_ms_per_1k_requests"] for name, v in results.get("latency", {}).items()},
            "per_1k_chunks": results.get("streams", {}).get("cpu_ms_per_1k_chunks", {}),
            "peak_rss_mib": {t.name: peak_rss_mib(t.pid) for t in targets}}
    finally:
        processes.stop_all()
    results["wall_s"] = time.monotonic() - started

    m = results["machine"]
    print(f"\nData plane: {', '.join(names)} on {m['cores']} cores ({m['cpu']}); gateways on core {GATEWAY_CORE}, "
          f"stand-in and load generator on core {CLIENT_CORE}")
    print(f"apsd {m['apsd_commit']}" + (f", LiteLLM {results['litellm_version']}" if venv else "")
          + f", {m['go']}, Python {m['python']}")
    plan = {"latency": f"c=1: {rounds} round(s) x {n} requests per target and mode",
            "rate": f"rates {RATES[0]} to {RATES[-1]} req/s, {duration:g} s each",
            "streams": f"streams: {stream_rounds} round(s)"}
    print("; ".join(text for name, text in plan.items() if name in measures) + f"; {results['wall_s']:.0f} s in all")
    print(f"command: {results['command']}\n")
    print("\n".join(table(results, names)))
    print("\nGoals (apsd):")
    print("\n".join(goals(results)) or "  (apsd not measured)")
    failures = [f"{name}: {entry['error_samples'][:1]}" for k in STREAMS
                for name, entry in results.get("streams", {}).get(str(k), {}).items() if entry["errors"]]
    if failures:
        print("\nstream errors: " + "; ".join(failures))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nresults written to {args.json}")
    if args.max_cpu_ratio is not None:
        return check_cpu_ratio(results, args.max_cpu_ratio)
    return 0


def check_cpu_ratio(results: dict[str, Any], limit: float) -> int:
    """``--max-cpu-ratio``: 1 (and why) when apsd's CPU per non-streamed request is above ``limit`` times
    the empty Quart-Trio handler's, both measured in this run; else 0."""
    per_1k = results.get("cpu", {}).get("per_1k_requests", {})
    mine, floor = per_1k.get("apsd"), per_1k.get(FLOOR_QUART)
    if not mine or not floor:
        print(f"\nCPU check: not measured (apsd {mine}, {FLOOR_QUART} {floor})", file=sys.stderr)
        return 1
    ratio = mine / floor
    verdict = "within" if ratio <= limit else "ABOVE"
    print(f"\nCPU check: apsd {mine / 1000:.2f} ms per non-streamed request, {ratio:.2f}x the empty Quart-Trio "
          f"handler's {floor / 1000:.2f} ms: {verdict} the limit of {limit:g}x")
    return 0 if ratio <= limit else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and requests, shorter rate steps")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--no-litellm", action="store_true", help="measure direct and apsd only")
    parser.add_argument("--no-apsd", action="store_true", help="measure direct and LiteLLM only")
    parser.add_argument("--litellm-venv", metavar="PATH",
                        help=f"a venv with litellm[proxy] (default: one made once under {CACHE})")
    parser.add_argument("--apsd-config-extra", metavar="TOML", default="", help="TOML appended to apsd's config")
    parser.add_argument("--floor", action="store_true",
                        help="also measure empty apps on apsd's HTTP stack (benchmarks/http_floor.py): what it "
                             "costs with no work at all")
    parser.add_argument("--measures", default="latency,rate,streams",
                        help="which of latency,rate,streams to run (default: all)")
    parser.add_argument("--rounds", type=int, help="rounds of latency (default 3, --quick 2)")
    parser.add_argument("--stream-rounds", type=int, help="rounds of streams (default 2, --quick 1)")
    parser.add_argument("--requests", type=int, help="requests per target per round at c=1 (default 300, --quick 150)")
    parser.add_argument("--rate-duration", type=float, help="seconds per rate step (default 4, --quick 2)")
    parser.add_argument("--max-cpu-ratio", type=float, metavar="X",
                        help="exit 1 when apsd's CPU per non-streamed request is above X times the empty Quart-Trio "
                             "handler's in this run (implies --floor; .ci/run uses it)")
    args = parser.parse_args(argv)
    if args.max_cpu_ratio is not None:
        args.floor = True
    if shutil.which("taskset") is None:
        parser.error("needs taskset (util-linux)")
    if (os.cpu_count() or 1) < 2:
        parser.error("needs 2 cores: the gateway on core 0, the stand-in and the load generator on core 1")
    try:
        return run(args)
    except RuntimeError as exc:   # a process that would not start, a load run that failed
        print(f"bench_dataplane: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
