"""systemd integration: the sd_notify protocol against a real datagram socket, and the unit file.

The daemon runs as a subprocess (the installed ``apsd``) with ``$NOTIFY_SOCKET``
pointing at a socket the test binds, the way systemd starts a ``Type=notify`` service.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from apsd.core.config import GpuConfig, TenantConfig, load_config
from apsd.core.scheduler import Scheduler
from apsd.pipeline import GovernorView, Health, open_pipeline
from apsd.serve.daemon import HTTP_GRACEFUL_TIMEOUT_S, Daemon
from apsd.serve.notify import ProgressProbe, SystemdNotifier, serve_status, serve_watchdog, status_line
from tests.helpers import build_policies, make_config

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "apsd.service"
APSD = str(Path(sys.executable).with_name("apsd"))
LISTENING = re.compile(r"apsd listening on (http://\S+)")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


# -- helpers ---------------------------------------------------------------------------------
async def bound_notify_socket(address: str) -> trio.socket.SocketType:
    """A bound AF_UNIX datagram socket: what systemd listens on for a Type=notify service."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await sock.bind(address)
    return sock


async def receive(sock: trio.socket.SocketType, timeout: float = 15) -> dict[str, str]:
    """The next notification as a dict of its ``KEY=value`` lines."""
    with trio.fail_after(timeout):
        data = await sock.recv(4096)
    return dict(line.split("=", 1) for line in data.decode().splitlines())


@attrs.define
class Apsd:
    process: trio.Process
    stderr: list[bytes]

    @property
    def log(self) -> str:
        return b"".join(self.stderr).decode()

    async def url(self, timeout: float = 30) -> str:
        with trio.fail_after(timeout):
            while not (match := LISTENING.search(self.log)):
                if self.process.returncode is not None:
                    raise AssertionError(f"apsd exited before listening: {self.log}")
                await trio.sleep(0.01)
        return match.group(1)

    async def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            return await self.process.wait()


@asynccontextmanager
async def running_apsd(env: dict[str, str], *args: str) -> AsyncIterator[Apsd]:
    """The installed apsd on 127.0.0.1:0 with ``env`` added (NOTIFY_SOCKET etc. removed first)."""
    base = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")}
    process = await trio.lowlevel.open_process(
        [APSD, "--host", "127.0.0.1", "--port", "0", *args], stderr=subprocess.PIPE,
        env={**base, "PYTHONUNBUFFERED": "1", "APSD_PLUGINS": "", **env})
    apsd = Apsd(process, [])

    async def drain_stderr() -> None:
        assert process.stderr is not None
        while chunk := await process.stderr.receive_some():
            apsd.stderr.append(chunk)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_stderr)
            yield apsd
            with trio.fail_after(30):
                await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
    assert "Traceback" not in apsd.log, apsd.log


async def health(url: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return await client.get("/health")


# -- the protocol, end to end ------------------------------------------------------------------
async def check_protocol(bind_address: str, notify_socket_value: str) -> None:
    with await bound_notify_socket(bind_address) as sock:
        async with running_apsd({"NOTIFY_SOCKET": notify_socket_value, "WATCHDOG_USEC": "200000"}) as apsd:
            ready = await receive(sock, timeout=30)
            assert ready["READY"] == "1"
            # At that moment the port already listens: freeze apsd, then the URL must be in
            # what it wrote so far and the kernel must accept a connection on it.
            apsd.process.send_signal(signal.SIGSTOP)
            try:
                url = await apsd.url(timeout=5)
                host, port = url.removeprefix("http://").rsplit(":", 1)
                with trio.fail_after(5):
                    await (await trio.open_tcp_stream(host, int(port))).aclose()
            finally:
                apsd.process.send_signal(signal.SIGCONT)
            response = await health(url)
            assert response.status_code == 200 and response.json()["status"] == "ok"
            assert re.fullmatch(r"queue=0 in_flight=0 governor=[A-Z]+ window=\d+\.\dms state=serving",
                                ready["STATUS"]), ready

            # pings every WATCHDOG_USEC/2 = 0.1 s: the median gap between 8 of them is below WATCHDOG_USEC
            # (a median: a loaded machine may hold up one or two without changing the rhythm)
            seen: list[dict[str, str]] = []
            pinged_at: list[float] = []
            with trio.fail_after(30):
                while len(pinged_at) < 8:
                    seen.append(await receive(sock))
                    if seen[-1].get("WATCHDOG") == "1":
                        pinged_at.append(trio.current_time())
            gaps = sorted(b - a for a, b in itertools.pairwise(pinged_at))
            assert gaps[len(gaps) // 2] < 0.2, gaps
            assert all(set(m) <= {"WATCHDOG", "STATUS"} for m in seen), seen
            assert any("STATUS" in m for m in [ready, *seen])

            apsd.process.send_signal(signal.SIGTERM)
            with trio.fail_after(30):
                while "STOPPING" not in (message := await receive(sock)):
                    assert set(message) <= {"WATCHDOG", "STATUS"}, message
            assert message["STOPPING"] == "1"
            assert "queue=0" in message["STATUS"] and message["STATUS"].endswith("state=draining")
            with trio.fail_after(30):
                assert await apsd.process.wait() == 0
        assert "sd_notify" not in apsd.log


async def test_notify_protocol_over_a_filesystem_socket(tmp_path):
    path = str(tmp_path / "notify")  # short: AF_UNIX paths are limited to 107 bytes
    await check_protocol(path, path)


async def test_notify_protocol_over_an_abstract_socket():
    name = f"apsd-test-{os.getpid()}-{secrets.token_hex(4)}"
    await check_protocol("\0" + name, "@" + name)


async def test_watchdog_is_off_when_watchdog_pid_names_another_process(tmp_path):
    path = str(tmp_path / "notify")
    with await bound_notify_socket(path) as sock:
        env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000", "WATCHDOG_PID": "1"}
        async with running_apsd(env) as apsd:
            assert (await receive(sock, timeout=30))["READY"] == "1"
            with trio.move_on_after(0.6):
                while True:
                    assert "WATCHDOG" not in await receive(sock)
            assert await apsd.stop() == 0


async def test_without_notify_socket_apsd_runs_normally():
    async with running_apsd({}) as apsd:
        assert (await health(await apsd.url())).status_code == 200
        assert await apsd.stop() == 0
    assert "sd_notify" not in apsd.log


@pytest.mark.parametrize("value", ["/nonexistent-apsd-dir/notify", "vsock:2:1234", "relative/notify"])
async def test_a_bad_notify_socket_is_logged_once_and_apsd_still_serves(value):
    async with running_apsd({"NOTIFY_SOCKET": value, "WATCHDOG_USEC": "100000"}) as apsd:
        url = await apsd.url()
        await trio.sleep(0.5)  # several watchdog pings fail meanwhile (a path that does not exist)
        assert (await health(url)).status_code == 200
        assert await apsd.stop() == 0
    assert apsd.log.count("sd_notify") == 1, apsd.log
    assert "WARNING apsd.serve.notify" in apsd.log


# -- the notifier and its loops, in process ----------------------------------------------------
@contextmanager
def receiver(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A plain non-blocking receiving socket (read without waiting: works in virtual time)."""
    path = str(tmp_path / "n")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.setblocking(False)
        yield path, sock


def drain(sock: socket.socket) -> list[str]:
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except BlockingIOError:
            return messages


def test_from_environ():
    assert not SystemdNotifier.from_environ({}).enabled
    assert SystemdNotifier.from_environ({"NOTIFY_SOCKET": "@sd/notify"}).address == "\0sd/notify"
    assert SystemdNotifier.from_environ({"NOTIFY_SOCKET": "/run/n"}).address == "/run/n"
    assert not SystemdNotifier.from_environ({"NOTIFY_SOCKET": "vsock:1:2"}).enabled
    watched = {"NOTIFY_SOCKET": "/run/n", "WATCHDOG_USEC": "30000000"}
    assert SystemdNotifier.from_environ(watched).watchdog_timeout_s == 30.0
    assert SystemdNotifier.from_environ({**watched, "WATCHDOG_PID": str(os.getpid())}).watchdog_timeout_s == 30.0
    assert SystemdNotifier.from_environ({**watched, "WATCHDOG_PID": str(os.getpid() + 1)}).watchdog_timeout_s is None
    assert SystemdNotifier.from_environ({**watched, "WATCHDOG_USEC": "soon"}).watchdog_timeout_s is None
    assert SystemdNotifier.from_environ({"WATCHDOG_USEC": "30000000"}).watchdog_timeout_s is None


async def test_messages(tmp_path):
    with receiver(tmp_path) as (path, sock):
        notifier = SystemdNotifier(path)
        before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert await notifier.reloading(status="reloading\nconfig")
        after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        assert await notifier.ready()
        assert await notifier.status("queue=1")
        assert await notifier.stopping()
        reloading, *rest = drain(sock)
    lines = reloading.split("\n")
    assert lines[0] == "RELOADING=1" and lines[2] == "STATUS=reloading config"
    assert before <= int(lines[1].removeprefix("MONOTONIC_USEC=")) <= after
    assert rest == ["READY=1", "STATUS=queue=1", "STOPPING=1"]


async def test_a_disabled_notifier_does_nothing():
    notifier = SystemdNotifier()
    assert not await notifier.ready() and not await notifier.watchdog()


async def test_send_failures_are_logged_once(tmp_path, caplog):
    notifier = SystemdNotifier(str(tmp_path / "nobody"))
    with caplog.at_level(logging.DEBUG, logger="apsd.serve.notify"):
        assert not any([await notifier.watchdog() for _ in range(3)])
    levels = [r.levelno for r in caplog.records]
    assert levels == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert "cannot notify systemd" in caplog.records[0].getMessage()


async def test_watchdog_pings_only_while_alive(tmp_path, autojump_clock, caplog):
    alive = True
    with receiver(tmp_path) as (path, sock), caplog.at_level(logging.WARNING, logger="apsd.serve.notify"):
        notifier = SystemdNotifier(path, watchdog_timeout_s=2.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_watchdog, notifier, lambda: alive)
            await trio.sleep(10.5)           # a ping at once, then every second
            assert drain(sock) == ["WATCHDOG=1"] * 11
            alive = False
            await trio.sleep(5)
            assert drain(sock) == []
            alive = True
            await trio.sleep(2)
            assert drain(sock) == ["WATCHDOG=1"] * 2
            nursery.cancel_scope.cancel()
    assert [r.levelname for r in caplog.records] == ["ERROR", "WARNING"]   # stalled, alive again


def test_progress_probe():
    count, owed = 0, False
    probe = ProgressProbe(lambda: count, lambda: owed)
    assert probe() and probe()               # nothing owed: a waiting loop is alive
    owed = True
    assert probe()                           # owed: first sighting
    count += 1
    assert probe()                           # it made progress since
    assert not probe()                       # a whole period owed, no progress: stalled
    assert not probe()
    count += 1
    assert probe()
    owed = False
    assert probe()
    owed = True
    assert probe()                           # a new stall is judged afresh


async def test_watchdog_stops_pinging_when_the_dispatcher_misses_a_wakeup(tmp_path, autojump_clock, monkeypatch):
    config = make_config(tenants={"a": TenantConfig(rate=1e6, burst=10**6)}, gpu=GpuConfig(time_scale=0.001))
    with receiver(tmp_path) as (path, sock):
        async with open_pipeline(config, build_policies(config)) as pipeline, trio.open_nursery() as nursery:
            notifier = SystemdNotifier(path, watchdog_timeout_s=2.0)
            probe = Daemon._watchdog_probe(pipeline)
            await nursery.start(serve_watchdog, notifier, probe)
            for _ in range(50):  # a busy scheduler, and then an idle one, are alive
                request = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=50, priority_bid=1)
                assert pipeline.submit_nowait(request) is None
                await trio.sleep(0.1)
            await trio.sleep(2.5)
            assert drain(sock) == ["WATCHDOG=1"] * 8    # at once, then every second
            monkeypatch.setattr(Scheduler, "_after_arrival", lambda self: None)  # a lost wake-up
            stuck = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=5, priority_bid=1)
            assert pipeline.submit_nowait(stuck) is None
            await trio.sleep(10)
            assert pipeline.scheduler.dispatch_owed() and not stuck.answered
            assert len(drain(sock)) <= 1     # at most the ping of the first sighting
            nursery.cancel_scope.cancel()


async def test_status_is_sent_when_it_changes(tmp_path, autojump_clock):
    text = "queue=0"
    with receiver(tmp_path) as (path, sock):
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_status, SystemdNotifier(path), lambda: text, 1.0)
            await trio.sleep(3.5)
            assert drain(sock) == ["STATUS=queue=0"]
            text = "queue=7"
            await trio.sleep(1)
            assert drain(sock) == ["STATUS=queue=7"]
            nursery.cancel_scope.cancel()


def test_status_line():
    health = Health(status="ok", policy={}, queue_depth=3,
                    governor=GovernorView(state="CRITICAL BURST", entropy_bits=3.0, window_ms=4.25))
    assert status_line(health, 5) == "queue=3 in_flight=5 governor=CRITICAL BURST window=4.2ms state=serving"
    broken = Health(status="draining", policy={}, queue_depth=0,
                    governor=GovernorView(state="ERROR", entropy_bits=None, window_ms=None, error="boom"))
    assert status_line(broken, 0) == "queue=0 in_flight=0 governor=ERROR window=? state=draining"


# -- the unit file --------------------------------------------------------------------------------
def unit_settings() -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_unit_file_settings():
    settings = unit_settings()
    assert settings["Type"] == ["notify"]
    assert settings["ExecStart"] == ["/usr/local/bin/apsd /etc/apsd/apsd.toml"]
    assert settings["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert settings["WatchdogSec"] == ["30"]
    grace = load_config(ROOT / "config" / "apsd.toml").server.shutdown_grace_s
    assert float(settings["TimeoutStopSec"][0]) > grace + HTTP_GRACEFUL_TIMEOUT_S
    for key, value in [("DynamicUser", "yes"), ("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "yes"), ("PrivateTmp", "yes"), ("PrivateDevices", "yes"),
                       ("CapabilityBoundingSet", ""), ("MemoryDenyWriteExecute", "yes"),
                       ("RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6"), ("UMask", "0077")]:
        assert settings[key] == [value], key
    assert int(settings["LimitNOFILE"][0]) >= 65536   # one descriptor per client connection


def unit_with_existing_binary(tmp_path: Path) -> Path:
    """The unit with ExecStart= pointing at this environment's apsd (verify checks it exists)."""
    text = UNIT.read_text().replace("ExecStart=/usr/local/bin/apsd ", f"ExecStart={APSD} ")
    assert APSD in text
    path = tmp_path / "apsd.service"
    path.write_text(text)
    return path


def unit_under_test(which: str, tmp_path: Path) -> Path:
    """``apsd.service``, or the template's instance ``apsd@8001.service``, runnable here."""
    return unit_with_existing_binary(tmp_path) if which == "unit" else template_with_existing_binary(tmp_path)


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("which", ["unit", "template"])
def test_systemd_analyze_verify(which, tmp_path):
    result = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(unit_under_test(which, tmp_path))],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), result


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("which", ["unit", "template"])
def test_systemd_analyze_security_rates_the_unit_ok(which, tmp_path):
    unit = unit_under_test(which, tmp_path)
    result = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", "--no-pager", str(unit)],
                            capture_output=True, text=True, timeout=60)
    if "--offline" in result.stderr or "unrecognized option" in result.stderr:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    match = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+\.\d+) (\w+)", result.stdout)
    assert match, result
    assert float(match.group(1)) <= 2.0 and match.group(2) == "OK", match.group(0)


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only")
async def test_apsd_serves_without_writable_executable_memory():
    """MemoryDenyWriteExecute=yes: the kernel's PR_SET_MDWE (Linux >= 6.3) refuses W+X the same way."""
    wrapper = ("import ctypes, os, sys\n"
               "if ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0: sys.exit(77)\n"
               "os.execv(sys.argv[1], sys.argv[1:])\n")
    base = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", wrapper, APSD, "--port", "0"], stderr=subprocess.PIPE,
        env={**base, "PYTHONUNBUFFERED": "1", "APSD_PLUGINS": ""})
    seen = b""
    try:
        with trio.fail_after(30):
            while not (match := LISTENING.search(seen.decode())):
                chunk = await process.stderr.receive_some()
                if not chunk:
                    if await process.wait() == 77:
                        pytest.skip("PR_SET_MDWE is not supported by this kernel")
                    raise AssertionError(seen.decode())
                seen += chunk
        async with httpx.AsyncClient(base_url=match.group(1), timeout=30) as client:
            answer = await client.post("/infer", json={"tenant_id": "tenant_a", "prompt": "hello",
                                                       "tokens_requested": 4, "priority_bid": 1})
            assert answer.status_code == 200
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()


async def test_reload_sends_reloading_then_ready_and_status_says_when_it_failed(tmp_path):
    config = tmp_path / "apsd.toml"
    config.write_text("[tenants.a]\nrate = 100.0\nburst = 1000\n")
    sock = await bound_notify_socket(str(tmp_path / "notify.sock"))
    async with running_apsd({"NOTIFY_SOCKET": str(tmp_path / "notify.sock")}, str(config)) as apsd:
        assert (await receive(sock))["READY"] == "1"
        config.write_text("[tenants.a]\nrate = 200.0\nburst = 1000\n")
        apsd.process.send_signal(signal.SIGHUP)
        message = await receive(sock)
        while "RELOADING" not in message:           # skip STATUS updates
            message = await receive(sock)
        assert message["RELOADING"] == "1" and int(message["MONOTONIC_USEC"]) > 0
        ready = await receive(sock)
        while "READY" not in ready:                 # a STATUS update may come in between
            ready = await receive(sock)
        assert ready["READY"] == "1" and "reload_failed" not in ready.get("STATUS", "")
        config.write_text("[tenants.a]\nrate = 'fast'\nburst = 1000\n")
        apsd.process.send_signal(signal.SIGHUP)
        message = await receive(sock)
        while "READY" not in message:
            message = await receive(sock)
        assert "reload_failed" in message["STATUS"]
        async with httpx.AsyncClient(base_url=await apsd.url(), timeout=10) as client:
            assert (await client.get("/tenants/a/status")).json()["rate"] == 200.0
        assert await apsd.stop() == 0
    sock.close()


# -- the template unit: several replicas on one machine (apsd@8001 apsd@8002 ...) ------------------
TEMPLATE = ROOT / "systemd" / "apsd@.service"
#: The settings in which an instance of the template differs from apsd.service; every other one
#: (notify, watchdog, stop timeout, limits, hardening, [Install]) must be the same.
TEMPLATE_OWN_SETTINGS = ("Description", "ExecStart")


def unit_file_settings(path: Path) -> dict[str, list[str]]:
    """``unit_settings`` for any unit file: each key's values in order (sections ignored)."""
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_template_unit_runs_one_replica_per_port_with_the_shared_config():
    settings = unit_file_settings(TEMPLATE)
    assert settings["ExecStart"] == ["/usr/local/bin/apsd --port %i /etc/apsd/apsd.toml"]
    assert "%i" in settings["Description"][0]


def test_template_unit_matches_apsd_service_but_for_its_own_settings():
    single, template = unit_file_settings(UNIT), unit_file_settings(TEMPLATE)
    assert set(template) == set(single)
    for key in single.keys() - set(TEMPLATE_OWN_SETTINGS):
        assert template[key] == single[key], key
    sections = [line for line in TEMPLATE.read_text().splitlines() if line.startswith("[")]
    assert sections == [line for line in UNIT.read_text().splitlines() if line.startswith("[")]


def test_template_unit_header_says_how_to_install_it():
    header = TEMPLATE.read_text().partition("[Unit]")[0]
    assert "systemctl enable --now apsd@8001 apsd@8002" in header
    assert "cp systemd/apsd@.service /etc/systemd/system/" in header


def template_with_existing_binary(tmp_path: Path) -> Path:
    """The template in ``tmp_path`` with ExecStart= at this environment's apsd; returns the path of
    its instance ``apsd@8001.service``, which systemd-analyze loads from the template beside it."""
    text = TEMPLATE.read_text().replace("ExecStart=/usr/local/bin/apsd ", f"ExecStart={APSD} ")
    assert APSD in text
    (tmp_path / TEMPLATE.name).write_text(text)
    return tmp_path / "apsd@8001.service"

