"""apsd in front of a real llama.cpp server that fails: stopped (SIGSTOP) before and after the first
token and resumed, killed, a client that stops reading, a client that leaves a CJK stream, and the
length parameters a backend obeys. Every client must be answered within the configured bounds and
charged what the backend did. Real HTTP both ways, real processes, stopped by their PIDs."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
import trio

from apsd.core.config import TenantConfig
from tests.helpers import backends_up, bucket_level, forwarding_config, start_daemon, wait_until
from tests.llama_server import (  # noqa: F401  (fixtures)
    llama_server,
    llama_server_binary,
    open_llama_server,
    slow_model,
    tiny_model,
)

pytestmark = pytest.mark.timeout(120)

#: A bucket that holds far more than a test uses and does not refill: what is missing at the end is
#: exactly what the tenant was charged.
BURST = 10**9
TENANTS = {"t": TenantConfig(rate=1e-6, burst=BURST)}
#: Short bounds, so that the tests wait seconds rather than the defaults' minutes.
BOUNDS = {"health_interval_s": 0.2, "metrics_interval_s": 0.1, "health_timeout_s": 1.0, "read_timeout_s": 2.0,
          "first_token_timeout_s": 30.0, "no_backend_wait_s": 2.0}
#: What a loaded machine may add to a bound above (real seconds). Every bound plus this stays below
#: the default it replaces (``read_timeout_s`` 60 s, ``no_backend_wait_s`` 30 s): a daemon that
#: ignored the configured value would still fail.
SLACK_S = 15.0
#: A client is answered 503 ``no_backend`` within this when its backend stops (found down by a
#: health check, then ``no_backend_wait_s``).
NO_BACKEND_S = BOUNDS["health_interval_s"] + BOUNDS["health_timeout_s"] + BOUNDS["no_backend_wait_s"]
HEADERS = {"X-Apsd-Tenant": "t"}


def config_for(server, *, max_concurrency=1, **forward):
    return forwarding_config([server.url], TENANTS, preset="fair", max_concurrency=max_concurrency,
                             **{**BOUNDS, **forward})


def backend_up(daemon):
    return backends_up(daemon, 1)


def charged(daemon) -> float:
    return BURST - bucket_level(daemon, "t")


def refused_at_once(answer: httpx.Response) -> bool:
    """Whether ``answer`` is the 503 ``no_backend`` a new request gets at once while no backend is
    up (not the one a queued request gets after ``no_backend_wait_s``, which names that setting)."""
    error = answer.json()["error"]
    return (answer.status_code == 503 and error["code"] == "no_backend" and "is up; retry later" in error["message"]
            and "no_backend_wait_s" not in error["message"])


def chat(content="Tell me everything.", **fields):
    return {"model": fields.pop("model", "slow"), "messages": [{"role": "user", "content": content}], **fields}


async def read_stream(lines, *, stop_after: int | None = None) -> tuple[int, list[dict]]:
    """(content chunks, other events) of an SSE answer's ``lines`` (``response.aiter_lines()``); stops
    reading after ``stop_after`` content chunks (the same iterator then reads on)."""
    tokens, others = 0, []
    async for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            others.append({"done": True})
            continue
        data = json.loads(line[6:])
        if any((c.get("delta") or {}).get("content") for c in data.get("choices") or ()):
            tokens += 1
            if stop_after is not None and tokens >= stop_after:
                break
        else:
            others.append(data)
    return tokens, others


async def test_a_stopped_backend_answers_every_client_in_bounded_time_and_recovers(
        nursery, llama_server_binary, slow_model, tmp_path):
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path,
                                 parallel=1) as server:
        running = await start_daemon(nursery, config_for(server))
        daemon = running.daemon
        await wait_until(backend_up(daemon))
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
            assert (await client.get("/ready")).status_code == 200
            queued: list[httpx.Response] = []

            async def queued_request() -> None:   # behind the stream (one slot), never started
                queued.append(await client.post("/v1/chat/completions", json=chat(max_tokens=5), headers=HEADERS))

            async with client.stream("POST", "/v1/chat/completions", headers=HEADERS,
                                     json=chat(max_tokens=4000, stream=True)) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                tokens = 0
                async for line in lines:             # some tokens, then the backend stops
                    if '"content":"' in line:
                        tokens += 1
                    if tokens == 5:
                        break
                async with trio.open_nursery() as waiting:
                    waiting.start_soon(queued_request)
                    await wait_until(lambda: daemon.pipeline.ledger.queued_total == 1)
                    os.kill(server.pid, signal.SIGSTOP)
                    stopped_at = trio.current_time()
                    events = []
                    with trio.fail_after(BOUNDS["read_timeout_s"] + SLACK_S):   # the stream: read_timeout_s
                        async for line in lines:
                            if '"content":"' in line:
                                tokens += 1
                            elif line.startswith("data: "):
                                events.append(line)
                    assert events and '"error"' in events[-1] and "[DONE]" not in events[-1]
            # the queued request: the health check (1 s timeout) finds it down, then no_backend_wait_s
            await wait_until(lambda: queued, limit_s=NO_BACKEND_S + SLACK_S)
            assert queued[0].status_code == 503 and queued[0].json()["error"]["code"] == "no_backend"
            assert "no_backend_wait_s" in queued[0].json()["error"]["message"]   # it waited that long
            assert "Retry-After" in queued[0].headers
            assert trio.current_time() - stopped_at < NO_BACKEND_S + SLACK_S
            # a new request is refused at once (not queued to wait), and the daemon says it is not ready
            refused = await client.post("/v1/chat/completions", json=chat(max_tokens=5), headers=HEADERS)
            assert refused_at_once(refused), refused.text
            assert (await client.get("/ready")).status_code == 503
            assert (await client.get("/health")).status_code == 200    # alive all the same
            status = daemon.pipeline.tenant_status("t")
            assert status.generated_tokens == tokens                    # charged what arrived, once
            # resumed: up again, ready again, serving again
            os.kill(server.pid, signal.SIGCONT)
            await wait_until(backend_up(daemon))
            with trio.fail_after(SLACK_S + 5):
                while (await client.get("/ready")).status_code != 200:
                    await trio.sleep(0.1)
                answer = await client.post("/v1/chat/completions", json=chat(max_tokens=3), headers=HEADERS)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        daemon.request_shutdown()


async def test_a_request_sent_to_a_backend_stopped_before_its_first_token_is_answered(
        nursery, llama_server_binary, tiny_model, tmp_path):
    async with open_llama_server(tiny_model, binary=llama_server_binary, log_dir=tmp_path, parallel=1) as server:
        running = await start_daemon(nursery, config_for(server))
        await wait_until(backend_up(running.daemon))
        os.kill(server.pid, signal.SIGSTOP)          # before the health check notices
        try:
            async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
                start = trio.current_time()
                with trio.fail_after(NO_BACKEND_S + SLACK_S):
                    answer = await client.post("/v1/chat/completions", headers=HEADERS,
                                               json=chat(model="tiny", max_tokens=5, stream=True))
                # no token ever came: an ordinary HTTP error, once the wait for a backend ran out
                assert answer.status_code == 503 and answer.json()["error"]["code"] == "no_backend"
                assert trio.current_time() - start < NO_BACKEND_S + SLACK_S
                assert charged(running.daemon) == 0
        finally:
            os.kill(server.pid, signal.SIGCONT)
        running.daemon.request_shutdown()


async def test_a_killed_backend_ends_its_stream_and_new_requests_are_refused_at_once(
        nursery, llama_server_binary, slow_model, tmp_path):
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path,
                                 parallel=1) as server:
        running = await start_daemon(nursery, config_for(server))
        await wait_until(backend_up(running.daemon))
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
            async with client.stream("POST", "/v1/chat/completions", headers=HEADERS,
                                     json=chat(max_tokens=4000, stream=True)) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                tokens, _ = await read_stream(lines, stop_after=3)
                os.kill(server.pid, signal.SIGKILL)
                with trio.fail_after(SLACK_S):
                    more, events = await read_stream(lines)
            assert events and "error" in events[-1]
            await wait_until(lambda: not running.daemon.pipeline.engines[0].backends[0].healthy)
            refused = await client.post("/v1/chat/completions", json=chat(max_tokens=5), headers=HEADERS)
            assert refused_at_once(refused), refused.text
            assert running.daemon.pipeline.tenant_status("t").generated_tokens == tokens + more
        running.daemon.request_shutdown()


async def test_a_client_that_stops_reading_is_charged_what_the_backend_generated(nursery, llama_server):
    running = await start_daemon(nursery, config_for(llama_server, read_timeout_s=0.5))
    await wait_until(backend_up(running.daemon))
    async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", headers=HEADERS,
                                 json=chat(model="tiny", max_tokens=400, stream=True)) as response:
            assert response.status_code == 200
            backend = running.daemon.pipeline.engines[0].backends[0]
            await wait_until(lambda: backend.in_flight == 0)   # done at the backend's pace
            await trio.sleep(1.0)                    # and the client still has not read a byte
            tokens, events = await read_stream(response.aiter_lines())
    assert tokens == 400 and events[-1] == {"done": True}
    assert backend.failures == 0                     # the client's slowness is not the backend's failure
    status = running.daemon.pipeline.tenant_status("t")
    assert status.generated_tokens == 400 and status.completed == 1
    running.daemon.request_shutdown()


async def test_an_abandoned_cjk_stream_is_charged_the_backends_prompt_count(
        nursery, llama_server_binary, slow_model, tmp_path):
    prompt = "天地玄黄，宇宙洪荒。日月盈昃，辰宿列张。" * 30
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path,
                                 parallel=1) as server:
        running = await start_daemon(nursery, config_for(server))
        daemon = running.daemon
        await wait_until(backend_up(daemon))
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
            truth = await client.post("/v1/chat/completions", json=chat(prompt, max_tokens=1), headers=HEADERS)
            backend_count = truth.json()["usage"]["prompt_tokens"]     # the backend's own count
            before = daemon.pipeline.tenant_status("t").prompt_tokens
            async with client.stream("POST", "/v1/chat/completions", headers=HEADERS,
                                     json=chat(prompt, max_tokens=3000, stream=True)) as response:
                assert response.status_code == 200
                await read_stream(response.aiter_lines(), stop_after=5)   # and leaves
        await wait_until(lambda: daemon.pipeline.tenant_status("t").cancelled == 1)
        charged_prompt = daemon.pipeline.tenant_status("t").prompt_tokens - before
        assert abs(charged_prompt - backend_count) <= 0.05 * backend_count, (charged_prompt, backend_count)
        daemon.request_shutdown()


async def test_backend_length_parameters_cannot_pass_the_reservation(nursery, llama_server):
    running = await start_daemon(nursery, config_for(llama_server, max_concurrency=2))
    await wait_until(backend_up(running.daemon))
    async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
        # llama.cpp obeys n_predict before max_tokens: apsd reserves it and sends it as it is
        answer = await client.post("/v1/chat/completions", json=chat(model="tiny", n_predict=30), headers=HEADERS)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 30
        usage = answer.json()["usage"]
        assert charged(running.daemon) == pytest.approx(usage["prompt_tokens"] + 30)
        for body in (chat(model="tiny", n_predict=-1), chat(model="tiny", max_tokens=5, n_predict=4000)):
            refused = await client.post("/v1/chat/completions", json=body, headers=HEADERS)
            assert refused.status_code == 422, refused.text
        # no limit at all: none is sent, the backend decides (the tiny model runs to its context's end),
        # and the tenant is charged what it generated, beyond admission's estimate of 256
        spent = charged(running.daemon)
        open_ended = await client.post("/v1/chat/completions", json=chat(model="tiny"), headers=HEADERS)
        assert open_ended.status_code == 200
        usage = open_ended.json()["usage"]
        assert usage["completion_tokens"] > 256
        assert charged(running.daemon) - spent == pytest.approx(usage["prompt_tokens"] + usage["completion_tokens"])
    running.daemon.request_shutdown()
