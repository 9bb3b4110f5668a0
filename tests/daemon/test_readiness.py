"""Readiness (``GET /ready``) apart from liveness (``GET /health``): the decision on its own, then real
daemons over HTTP on port 0: a simulated engine, a forward engine whose backend is a closed port and
then comes up and goes away again, and a daemon draining."""

from __future__ import annotations

import json
import logging
import socket

import attrs
import pytest
import trio

from apsd.core.config import GpuConfig, ServerConfig, TenantConfig, parse_config
from apsd.core.engine import BackendStatistics
from apsd.serve.readiness import decide_readiness
from tests.helpers import (
    FAST_GPU,
    WAIT_S,
    backends_up,
    forwarding_config,
    infer_body,
    make_config,
    start_daemon,
    wait_until,
)
from tests.standin_backend import DONE, Exchange, Reply, sse, start_standin_backend, stream_chunks


def backend(name: str, models: tuple[str, ...], healthy: bool) -> BackendStatistics:
    figures = {field.name: 0 for field in attrs.fields(BackendStatistics)}   # (counters: not looked at)
    figures.update(name=name, url=f"http://{name}", models=models, healthy=healthy, saturated=False,
                   waiting=None, kv_usage=None)
    return BackendStatistics(**figures)


# -- the decision ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("accepting", "backends", "status", "missing"), [
    (True, None, "ready", ()),                                          # a simulated engine
    (False, None, "draining", ()),
    (False, [backend("a", ("m",), True)], "draining", ()),              # draining wins
    (True, [backend("a", ("m",), True)], "ready", ()),
    (True, [backend("a", ("m",), False)], "no_backend", ("m",)),
    (True, [backend("a", ("m", "n"), False), backend("b", ("m",), False)], "no_backend", ("m", "n")),
    (True, [backend("a", (), False)], "no_backend", ()),                # models not known yet
    (True, [backend("a", (), True)], "no_backend", ()),                 # healthy, but serves nothing yet
    (True, [], "no_backend", ()),
    (True, [backend("a", ("m",), False), backend("b", ("m",), True)], "ready", ()),   # one of two is enough
    (True, [backend("a", ("n",), False), backend("b", ("m",), True)], "ready", ("n",)),  # partly: ready, says so
])
def test_the_decision(accepting, backends, status, missing):
    answer = decide_readiness(accepting=accepting, backends=backends)
    assert (answer.status, answer.models_without_backend, answer.ready) == (status, missing, status == "ready")
    assert answer.message


# -- over HTTP -------------------------------------------------------------------------------------

def forward_config(port: int, **backend_fields):
    config = parse_config({"backends": [{"url": f"http://127.0.0.1:{port}", "name": "b0", **backend_fields}],
                           "forward": {"health_interval_s": 0.05, "connect_timeout_s": 1.0}}, "<test>")
    return attrs.evolve(config, server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=2.0),
                        tenants={"t": TenantConfig(rate=1e4, burst=10_000)})


def closed_port() -> socket.socket:
    """A loopback port bound but not listening (connections to it are refused), held while the socket
    is open, with SO_REUSEPORT so that a daemon with ``reuse_port`` can listen on it later."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


async def wait_for_status(client, status: str, limit_s: float = WAIT_S):
    with trio.fail_after(limit_s):
        while (answer := await client.get("/ready")).json()["status"] != status:
            await trio.sleep(0.05)
    return answer


async def test_a_simulated_engine_is_ready(nursery):
    running = await start_daemon(nursery, make_config(server=ServerConfig(host="127.0.0.1", port=0), gpu=FAST_GPU))
    async with running.client as client:
        ready = await client.get("/ready")
        assert ready.status_code == 200 and ready.headers["cache-control"] == "no-store"
        assert ready.json() == {"status": "ready", "message": "the engines are serving", "models_without_backend": []}
        assert (await client.get("/health")).status_code == 200
    running.daemon.request_shutdown()


async def test_a_forward_engine_without_a_usable_backend_is_not_ready_but_alive(nursery):
    with closed_port() as sock:
        running = await start_daemon(nursery, forward_config(sock.getsockname()[1], models=["m"]))
        async with running.client as client:
            await trio.sleep(0.3)  # several health checks have failed by now
            answer = await client.get("/ready")
            assert answer.status_code == 503, answer.text
            assert answer.json()["status"] == "no_backend" and answer.json()["models_without_backend"] == ["m"]
            assert "m cannot be served" in answer.json()["message"]
            health = await client.get("/health")   # liveness: the process serves, nothing to restart
            assert health.status_code == 200 and health.json()["status"] == "ok"
        running.daemon.request_shutdown()


async def test_readiness_follows_the_backend_up_and_down(nursery, caplog):
    """A closed port, then an apsd (micro) listening there as the backend, then that backend stopped
    (the log says why its health check failed)."""
    caplog.set_level(logging.WARNING, logger="apsd")
    with closed_port() as sock:
        port = sock.getsockname()[1]
        running = await start_daemon(nursery, forward_config(port))   # models read from its /v1/models
        async with running.client as client:
            down = await wait_for_status(client, "no_backend")
            assert down.status_code == 503 and down.json()["models_without_backend"] == []
            async with trio.open_nursery() as backend_nursery:
                backend_config = make_config(server=ServerConfig(host="127.0.0.1", port=port, reuse_port=True),
                                             gpu=FAST_GPU)
                backend_daemon = await start_daemon(backend_nursery, backend_config)
                sock.close()                     # (the backend listens on the port now)
                up = await wait_for_status(client, "ready")
                assert up.status_code == 200 and up.json()["models_without_backend"] == []
                models = (await client.get("/v1/models")).json()["data"]
                assert [m["id"] for m in models] and [m["id"] for m in models] == \
                       [m["id"] for m in (await backend_daemon.client.get("/v1/models")).json()["data"]]
                await backend_daemon.client.aclose()
                backend_daemon.daemon.request_shutdown()
            again = await wait_for_status(client, "no_backend")
            assert again.status_code == 503 and again.json()["models_without_backend"] == [m["id"] for m in models]
            downs = [r.getMessage() for r in caplog.records if " is down " in r.getMessage()]
            assert downs and "its health check failed: backend b0: ConnectError" in downs[-1], downs
        running.daemon.request_shutdown()


async def test_a_backend_that_fails_its_health_check_while_it_streams_is_kept_up_until_it_stops(nursery, caplog):
    """A backend streams 30 tokens, one every 0.1 s, while its ``/health`` answers 503 (a server busy on
    every core answers it late): the stream is not cut, the backend stays up while it streams (logged
    once), and is marked down at the first check after the stream ended."""
    caplog.set_level(logging.INFO, logger="apsd")

    def slow(exchange: Exchange) -> Reply:
        return Reply(events=[sse(c) for c in stream_chunks(exchange.json, 30)] + [DONE], gap_s=0.1)

    backend = await start_standin_backend(nursery, slow, model="m")
    running = await start_daemon(nursery, forwarding_config([backend.url], {"t": TenantConfig(rate=1e6, burst=10**6)},
                                                            health_interval_s=0.05))
    await wait_until(backends_up(running.daemon))
    (b0,) = running.daemon.pipeline.engines[0].backends
    async with running.client as client:
        async with client.stream("POST", "/v1/chat/completions", headers={"X-Apsd-Tenant": "t"}, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}) as answer:
            assert answer.status_code == 200
            lines = answer.aiter_lines()
            async for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    break
            backend.healthy = False
            body = "".join([line async for line in lines])
        assert body.rstrip().endswith("data: [DONE]") and body.count('"content":"') == 29, body[-300:]
        messages = [r.getMessage() for r in caplog.records]
        kept = [m for m in messages if "failed its health check" in m]
        assert len(kept) == 1 and "kept up while it streams" in kept[0] and "503" in kept[0], kept
        assert not any(" is down " in m for m in messages[:messages.index(kept[0]) + 1])
        await wait_until(lambda: not b0.healthy)
        downs = [m for m in (r.getMessage() for r in caplog.records) if " is down " in m]
        assert downs and "its health check failed: its /health answered 503" in downs[0], downs
    running.daemon.request_shutdown()


async def test_a_request_timing_out_in_a_busy_servers_queue_does_not_mark_the_server_down(nursery, caplog):
    """A backend streams to one client (a token every 0.1 s) while it leaves a second request without
    a first token past ``first_token_timeout_s`` (as a server at its ``max_num_seqs`` keeps one in its
    own queue): that request ends 504 ``backend_timeout``, and the backend stays up, its stream whole.
    A server silent to everyone is marked down by the same timeout."""
    caplog.set_level(logging.WARNING, logger="apsd")

    def script(exchange: Exchange) -> Reply:
        if "stall" in json.dumps(exchange.json):
            return Reply(stall_s=3.0)
        return Reply(events=[sse(c) for c in stream_chunks(exchange.json, 30)] + [DONE], gap_s=0.1)

    backend = await start_standin_backend(nursery, script, model="m")
    running = await start_daemon(nursery, forwarding_config([backend.url], {"t": TenantConfig(rate=1e6, burst=10**6)},
                                                            first_token_timeout_s=0.5, max_retries=0))
    await wait_until(backends_up(running.daemon))
    (b0,) = running.daemon.pipeline.engines[0].backends

    def body(content: str, stream: bool) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 40, "stream": stream}

    async with running.client as client:
        async with client.stream("POST", "/v1/chat/completions", headers={"X-Apsd-Tenant": "t"},
                                 json=body("slow", True)) as answer:
            lines = answer.aiter_lines()
            async for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    break
            stalled = await client.post("/v1/chat/completions", headers={"X-Apsd-Tenant": "t"},
                                        json=body("stall", False))
            assert stalled.status_code == 504 and stalled.json()["error"]["code"] == "backend_timeout", stalled.text
            assert b0.healthy
            rest = "".join([line async for line in lines])
        assert rest.rstrip().endswith("data: [DONE]") and rest.count('"content":"') == 29, rest[-300:]
        assert not any(" is down " in r.getMessage() for r in caplog.records)
        alone = await client.post("/v1/chat/completions", headers={"X-Apsd-Tenant": "t"}, json=body("stall", False))
        assert alone.status_code == 504
        downs = [r.getMessage() for r in caplog.records if " is down " in r.getMessage()]
        assert downs and "silent before the first token" in downs[0], downs
    running.daemon.request_shutdown()


async def test_a_draining_daemon_is_not_ready_but_alive(nursery):
    # one model second is one wall second: a 2000-token request is still running when shutdown begins
    config = make_config(server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=60.0),
                         gpu=GpuConfig(time_scale=1.0), tenants={"t": TenantConfig(rate=1e6, burst=10**6)})
    running = await start_daemon(nursery, config)
    answers = []
    async with running.client as client:
        assert (await client.get("/ready")).status_code == 200
        async with trio.open_nursery() as requests:
            async def one() -> None:
                answers.append(await client.post("/infer", json=infer_body("t", prompt="", tokens=2000)))
            requests.start_soon(one)
            with trio.fail_after(WAIT_S):
                while (await client.get("/metrics.json")).json()["requests"]["in_flight"] < 1:
                    await trio.sleep(0.01)
            running.daemon.request_shutdown()       # what SIGTERM does: the drain begins
            await wait_until(lambda: not running.daemon.pipeline.accepting)
            draining = await client.get("/ready")
            assert draining.status_code == 503 and draining.json()["status"] == "draining", draining.text
            health = await client.get("/health")   # liveness: still serving (the drain's answers)
            assert health.status_code == 200 and health.json()["status"] == "draining"
            running.daemon.request_shutdown()       # a second signal: the grace period ends now
    assert [a.status_code for a in answers] == [503]
