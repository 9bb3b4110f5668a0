"""The data-plane benchmark's stand-in backend (benchmarks/standin, Go), in a small run: it builds,
it serves the OpenAI API with vLLM-shaped streams, and its load generator drives apsd in front of
it, every stream whole, over upstream connections that are kept and reused. (The benchmark itself,
benchmarks/bench_dataplane.py, is not part of the suite.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import trio

from apsd.core.config import TenantConfig
from benchmarks.bench_dataplane import build_standin, free_port
from tests.helpers import backends_up, forwarding_config, start_daemon, wait_until
from tests.llama_server import REQUIRE_ENV


@pytest.fixture(scope="module")
def standin() -> str:
    if shutil.which("go") is None and not os.path.exists("/usr/bin/go"):
        reason = "go not found (Debian's golang-go builds the benchmark's stand-in)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}; ${REQUIRE_ENV}=1 forbids skipping", pytrace=False)
        pytest.skip(reason)
    return str(build_standin())


async def _load(binary: str, url: str, *args: str) -> dict:
    done = await trio.run_process([binary, "load", "--url", url, "--header", "X-Apsd-Tenant: bench", *args],
                                  capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return json.loads(done.stdout)


async def test_the_stand_in_through_apsd_every_stream_whole_on_reused_connections(nursery, standin):
    port = free_port()
    server = subprocess.Popen([standin, "serve", "--port", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        config = forwarding_config([f"http://127.0.0.1:{port}"], {"bench": TenantConfig(rate=1e9, burst=10**9)},
                                   max_concurrency=64)
        running = await start_daemon(nursery, config)
        await wait_until(backends_up(running.daemon, 1))
        url = running.url + "/v1/chat/completions"
        with trio.fail_after(60):
            answers = await _load(standin, url, "--mode", "latency", "--n", "20")
            assert answers["ok"] == 20 and answers["errors"] == 0
            for _ in range(2):
                streams = await _load(standin, url, "--mode", "streams", "--streams", "16", "--tokens", "64")
                assert streams["all_complete"] and streams["errors"] == 0
                assert streams["chunks"] == 16 * 64
            direct = await _load(standin, f"http://127.0.0.1:{port}/v1/chat/completions", "--mode", "streams",
                                 "--streams", "4", "--tokens", "8")
            assert direct["all_complete"] and direct["chunks"] == 4 * 8
        client = running.daemon.pipeline.engines[0].client
        # 20 requests one after the other, then twice 16 streams at once: kept connections serve them
        assert client.connections_opened <= 16 + 2
        async with running.client as http:
            status = (await http.get("/tenants/bench/status")).json()
        # every token relayed was counted once: 20 answers of 16 tokens, 32 streams of 64
        assert status["generated_tokens"] == 20 * 16 + 2 * 16 * 64
        running.daemon.request_shutdown()
    finally:
        server.terminate()
        server.wait(timeout=10)
