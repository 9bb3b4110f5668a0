"""The installed ``apsd`` command, run as a subprocess the way an operator runs it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import trio

from tests.helpers import APSD, ROOT, WAIT_S, infer_body, run_cli, start_apsd, stop_apsd


def test_version_and_help():
    version = run_cli("--version")
    assert version.returncode == 0 and re.fullmatch(r"apsd \d+\.\d+\.\d+\S*\n", version.stdout)
    help_ = run_cli("--help")
    assert help_.returncode == 0 and "--policy" in help_.stdout and "CONFIG" in help_.stdout


#: One config error of each way the command meets one: a file it cannot read, a file that is not TOML,
#: a value the config loader refuses, a policy the daemon cannot build. (Every message the loader and
#: the policy registry give is checked in process: tests/unit/test_config.py.)
@pytest.mark.parametrize(
    ("text", "args", "fragment"),
    [
        (None, ["/no/such/apsd.toml"], "/no/such/apsd.toml: no such config file"),
        ("[server\n", [], "TOML syntax error"),
        ("[server]\nprot = 8002\n", [], "server.prot: unknown key"),
        ("[server]\nport = 0\n", ["--policy", "lottery"],
         "policy preset 'lottery' is unknown (available: aps, fair, fifo, static)"),
        ("# emptied by an editor that crashed\n", [], "the file sets nothing (it is empty, or holds only comments"),
        # config strings end up in headers, labels and logs: a CR/LF there made every answer a 500
        ('[[backends]]\nurl = "http://127.0.0.1:9"\nname = "b0\\r\\nX-Injected: 1"\n', [],
         "backends[0].name: the value holds a control character (U+000D at position 2)"),
        ('[[backends]]\nurl = "http://127.0.0.1:9"\nname = "gpu\\u00e9"\n', [],
         "backends[0].name: must be 1-128 printable ASCII characters"),
        ('[tenants."team\\nb"]\nrate = 1\nburst = 1\n', [], "the name holds a control character (U+000A"),
        ('[tenants.t]\nrate = 1\nburst = 1\nmodels = ["m\\t1"]\n', [],
         "tenants.t.models[0]: the value holds a control character (U+0009"),
    ],
)
def test_bad_config_exits_2_with_one_message(tmp_path, text, args, fragment):
    if text is not None:
        path = tmp_path / "apsd.toml"
        path.write_text(text)
        args = [*args, str(path)]
    result = run_cli(*args)
    assert result.returncode == 2
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_bad_port_option():
    result = run_cli("--port", "99999")
    assert result.returncode == 2 and "port must be 0-65535" in result.stderr


async def wait_admitted(client: httpx.AsyncClient, n: int) -> None:
    """Until apsd has admitted ``n`` requests (counted, not "in flight at once": on a loaded machine the
    first may end before the last arrives)."""
    with trio.fail_after(WAIT_S):
        while (await client.get("/metrics.json")).json()["requests"]["admitted"] < n:
            await trio.sleep(0.02)


async def wait_draining(client: httpx.AsyncClient) -> None:
    """Until apsd says it drains (it has handled the SIGTERM)."""
    with trio.fail_after(WAIT_S):
        while (await client.get("/health")).json()["status"] != "draining":
            await trio.sleep(0.02)


async def test_shipped_config_serves_and_sigterm_answers_in_flight_requests():
    process, url, seen = await start_apsd(str(ROOT / "config" / "apsd.toml"), "--port", "0")
    log = b"".join(seen).decode()
    assert "policy=preset=fair" in log and "tenant_a,tenant_b,tenant_c" in log
    answers: list[httpx.Response] = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            first = await client.post("/infer", json=infer_body("tenant_c", tokens=8))
            assert first.status_code == 200 and first.json()["tokens_generated"] == 8

            async def one(tenant: str) -> None:  # ~1 s of real (time_scale 1.0) decoding
                answers.append(await client.post("/infer", json=infer_body(tenant, "x" * 100, 64, 3)))

            async with trio.open_nursery() as nursery:
                for tenant in ("tenant_a", "tenant_b", "tenant_c"):
                    nursery.start_soon(one, tenant)
                await wait_admitted(client, 1 + 3)
                process.send_signal(signal.SIGTERM)
                await wait_draining(client)
                late = await client.post("/infer", json=infer_body(prompt="", tokens=1, bid=1))
                assert late.status_code == 503
        with trio.fail_after(30):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
    assert [a.status_code for a in answers] == [200, 200, 200]
    rest = await process.stderr.receive_some() if process.stderr else b""
    assert b"Traceback" not in b"".join(seen) + rest


async def test_port_in_use_is_one_clear_message():
    process, url, _ = await start_apsd("--port", "0")
    try:
        port = url.rsplit(":", 1)[1]
        result = await trio.to_thread.run_sync(run_cli, "--port", port)
        assert result.returncode == 1
        assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in result.stderr
        assert "Traceback" not in result.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0


async def test_sighup_keeps_serving_and_a_second_sigterm_ends_the_grace_period(tmp_path):
    config = tmp_path / "slow.toml"
    config.write_text("[server]\nshutdown_grace_s = 600.0\n[tenants.t]\nrate = 1e6\nburst = 1000000\n")
    process, url, _ = await start_apsd(str(config), "--port", "0")
    answers: list[httpx.Response] = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def long_one() -> None:   # 5000 tokens at 128/s: about 40 s of real time
                answers.append(await client.post("/infer", json=infer_body("t", "", 5000, 1)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(long_one)
                with trio.fail_after(WAIT_S):
                    while (await client.get("/metrics.json")).json()["requests"]["running"] < 1:
                        await trio.sleep(0.02)
                process.send_signal(signal.SIGHUP)
                await trio.sleep(0.2)
                assert (await client.get("/health")).json()["status"] == "ok"   # still serving
                process.send_signal(signal.SIGTERM)
                await wait_draining(client)
                process.send_signal(signal.SIGTERM)                           # don't wait 600 s
                with trio.fail_after(30):
                    assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
    assert [(a.status_code, a.json()["error"]) for a in answers] == [(503, "shutting_down")]


async def test_sighup_reloads_under_load_and_refuses_a_bad_config(tmp_path):
    config = tmp_path / "apsd.toml"
    base = "[gpu]\ntime_scale = 0.05\n[tenants.t]\nrate = 1e6\nburst = 1000000\n"
    config.write_text(base)
    process, url, seen = await start_apsd(str(config), "--port", "0")
    answers: list[httpx.Response] = []
    try:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            async def one() -> None:
                answers.append(await client.post("/infer", json=infer_body("t", "", 300, 3)))

            async with trio.open_nursery() as nursery:
                for _ in range(20):
                    nursery.start_soon(one)
                await wait_admitted(client, 20)
                config.write_text(base + '[tenants.u]\nrate = 50.0\nburst = 500\n[policy]\npreset = "static"\n')
                process.send_signal(signal.SIGHUP)
                with trio.fail_after(WAIT_S):
                    while (await client.get("/tenants/u/status")).status_code != 200:
                        await trio.sleep(0.02)
                assert (await client.get("/health")).json()["policy"]["aging"] == "static"
            assert [a.status_code for a in answers] == [200] * 20          # nothing in flight was lost

            config.write_text(base + "[tenants.u]\nrate = -1\nburst = 5\n")  # does not validate
            process.send_signal(signal.SIGHUP)
            await trio.sleep(0.5)
            assert (await client.get("/tenants/u/status")).json()["rate"] == 50.0   # the old config stays
            ok = await client.post("/infer", json=infer_body("u", "", 5, 1))
            assert ok.status_code == 200
        log = await stop_apsd(process, seen)
    finally:
        if process.returncode is None:
            process.kill()
    assert "reloaded" in log and "tenant u added" in log and "policies: preset=static" in log
    assert "reload refused, the running configuration stays" in log and "tenants.u.rate" in log
    assert "Traceback" not in log


@pytest.mark.parametrize("args", [["plugins", "--json"], ["plugins"], ["simulate", "--list"], ["hash-key", "--new"]])
def test_output_to_a_closed_pipe_ends_quietly_like_a_unix_tool(args):
    """Issue 11.4: ``apsd plugins --json | head -c 100`` must not print a BrokenPipeError traceback."""
    reader, writer = os.pipe()
    os.close(reader)  # the reader is gone before apsd writes anything
    try:
        result = subprocess.run([APSD, *args], stdout=writer, stderr=subprocess.PIPE, text=True, timeout=60,
                                env={**os.environ, "APSD_PLUGINS": ""})
    finally:
        os.close(writer)
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr
    assert result.returncode == 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


async def test_the_daemon_raises_its_open_file_limit_to_the_hard_limit():
    """Issue 11.7: one descriptor per connection; the usual soft limit of 1024 locks clients out."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 256:
        pytest.skip(f"the hard open-file limit here is only {hard}")

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    process, _url, seen = await start_apsd("--port", "0", preexec_fn=low_soft_limit)
    try:
        limits = Path(f"/proc/{process.pid}/limits").read_text()
        line = next(line for line in limits.splitlines() if line.startswith("Max open files"))
        expected = str(1 << 20 if hard == resource.RLIM_INFINITY else hard)
        assert line.split()[3] == expected  # the soft limit
    finally:
        log = await stop_apsd(process, seen)
    assert "open-file limit raised from 256" in log
