"""apsd in front of real llama.cpp servers (``llama-server``, a tiny model written by the tests):
forwarding, two backends, a backend killed under load, settlement against the backend's usage, and
priority order while the backends are saturated. Real HTTP both ways, real processes."""

from __future__ import annotations

import attrs
import httpx
import pytest
import trio

from apsd.core.config import TenantConfig
from tests.helpers import (
    WAIT_S,
    backends_up,
    bucket_level,
    forwarding_config,
    infer_body,
    openai_client,
    start_apsd,
    start_daemon,
    stop_apsd,
    wait_until,
)
from tests.llama_server import (  # noqa: F401  (fixtures)
    llama_server,
    llama_server_binary,
    open_llama_server,
    slow_model,
    tiny_model,
)

#: Buckets that hold far more than the tests use and do not refill during a test: what is missing from
#: one at the end is exactly what its requests were charged.
TENANTS = {"t": TenantConfig(rate=1e-6, burst=10**9), "u": TenantConfig(rate=1e-6, burst=10**9)}


def gateway_config(servers, *, preset="aps", max_concurrency=4, **forward):
    return forwarding_config([s.url for s in servers], TENANTS, preset=preset, max_concurrency=max_concurrency,
                             **forward)


def infer(tenant="t", tokens=8, bid=5, prompt="Hello there, how are you?"):
    return infer_body(tenant, prompt, tokens, bid)


async def test_infer_is_forwarded_and_settled_against_the_backends_usage(nursery, llama_server):
    running = await start_daemon(nursery, gateway_config([llama_server]))
    await wait_until(backends_up(running.daemon, 1))
    async with running.client as client:
        answer = (await client.post("/infer", json=infer(tokens=9))).json()
        assert answer["tokens_generated"] == 9            # the tiny model never stops early
        assert answer["engine_id"] == 0 and answer["ttft_ms"] > 0
        status = (await client.get("/tenants/t/status")).json()
        # the tenant's counters and bucket follow the backend's usage, not apsd's estimate
        assert status["generated_tokens"] == 9 and status["prompt_tokens"] == answer["prompt_tokens"]
        assert bucket_level(running.daemon, "t") == pytest.approx(10**9 - answer["prompt_tokens"] - 9, abs=1)
        text = (await client.get("/metrics")).text
        assert 'apsd_backend_up{backend="b0"} 1.0' in text
        assert 'apsd_backend_tokens_total{backend="b0",phase="completion"} 9.0' in text
    running.daemon.request_shutdown()


async def test_two_backends_share_the_load_and_one_killed_mid_load_loses_nothing(nursery, llama_server_binary,
                                                                                  slow_model, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path / "a",
                                 parallel=2) as a, \
            open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path / "b",
                              parallel=2) as b:
        # (health checks every 5 s: the kill is found by the requests it breaks, not by a check that
        # happens to run first and puts them back in the queue uncounted, as on a loaded machine)
        running = await start_daemon(nursery, gateway_config([a, b], max_concurrency=2, max_retries=3,
                                                              health_interval_s=5.0))
        await wait_until(backends_up(running.daemon, 2))
        answers: list[httpx.Response] = []
        async with running.client as client, trio.open_nursery() as load:
            async def one(i: int) -> None:
                answers.append(await client.post("/infer", json=infer(tokens=40, bid=1 + i % 10)))

            for i in range(24):
                load.start_soon(one, i)
            engine = running.daemon.pipeline.engines[0]
            await wait_until(lambda: all(backend.requests >= 2 for backend in engine.backends))
            a.process.kill()                      # a backend dies with requests in flight
        assert len(answers) == 24
        statuses = sorted(r.status_code for r in answers)
        completed = [r.json() for r in answers if r.status_code == 200]
        failed = [r.json() for r in answers if r.status_code != 200]
        # requests in flight on the killed backend after their first token fail (502); the rest,
        # queued or not started yet, are retried on the other one
        assert all(f["error"] in ("backend_failed", "backend_timeout") for f in failed), statuses
        assert len(completed) >= 24 - 2 and all(c["tokens_generated"] == 40 for c in completed)
        b0, b1 = running.daemon.pipeline.statistics().backends
        assert not b0.healthy and b1.healthy and b0.failures >= 1 and b1.requests >= 12
        counts = running.daemon.pipeline.statistics().books.requests
        assert counts.completed + counts.failed == 24 and counts.conservation_ok
        running.daemon.request_shutdown()


async def test_while_the_backend_is_saturated_the_queue_keeps_apsds_priority_order(nursery, llama_server_binary,
                                                                                    slow_model, tmp_path):
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path,
                                 parallel=1) as server:
        running = await start_daemon(nursery, gateway_config([server], preset="static", max_concurrency=1))
        await wait_until(backends_up(running.daemon, 1))
        finished: list[int] = []
        async with running.client as client, trio.open_nursery() as load:
            async def one(bid: int, tokens: int) -> None:
                response = await client.post("/infer", json=infer(tokens=tokens, bid=bid))
                assert response.status_code == 200
                finished.append(bid)

            load.start_soon(one, 5, 300)         # occupies the only slot for a while (a second or so)
            await wait_until(lambda: running.daemon.pipeline.engines[0].backends[0].in_flight == 1)
            for _ in range(4):
                load.start_soon(one, 1, 4)       # low bids queue in apsd, in arrival order...
            await wait_until(lambda: running.daemon.pipeline.scheduler.queue_depth == 4)
            load.start_soon(one, 10, 4)          # ...and a late high bid goes first
            await wait_until(lambda: running.daemon.pipeline.scheduler.queue_depth == 5)
        assert finished == [5, 10, 1, 1, 1, 1]
        running.daemon.request_shutdown()


# -- the OpenAI API, forwarded -------------------------------------------------------------------------

async def test_the_official_client_through_apsd_to_llama_cpp(nursery, llama_server):
    running = await start_daemon(nursery, gateway_config([llama_server]))
    await wait_until(backends_up(running.daemon, 1))

    def calls():
        client = openai_client(running.url)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}],
                                              max_tokens=6, temperature=0.7, seed=3)
        plain = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi!"}],
                                                    max_tokens=5, stream=True))
        usage = list(client.completions.create(model="tiny", prompt="Once upon", max_tokens=4, stream=True,
                                               stream_options={"include_usage": True}))
        return chat, plain, usage

    chat, plain, usage = await trio.to_thread.run_sync(calls)
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    assert chat.model == "tiny" and len(chat.choices[0].message.content) > 0
    text = [c.choices[0].delta.content for c in plain if c.choices and c.choices[0].delta.content]
    assert len(text) == 5 and all(c.usage is None for c in plain)   # the usage apsd asked for is not shown
    assert usage[-1].usage.completion_tokens == 4 and usage[-1].usage.prompt_tokens > 0
    status = running.daemon.pipeline.tenant_status("t")
    # every token the backend reported is on the tenant's books, the hidden stream usage included
    assert status.completed == 3 and status.generated_tokens == 6 + 5 + 4
    assert status.prompt_tokens == chat.usage.prompt_tokens * 2 + usage[-1].usage.prompt_tokens
    running.daemon.request_shutdown()


async def test_the_async_client_streams_through_apsd(nursery, llama_server):
    import openai

    running = await start_daemon(nursery, gateway_config([llama_server]))
    await wait_until(backends_up(running.daemon, 1))
    client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused",
                                default_headers={"X-Apsd-Tenant": "u"}, max_retries=0, timeout=30)
    stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Go"}],
                                                  max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    await client.close()
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 12
    assert chunks[-1].usage.completion_tokens == 12
    running.daemon.request_shutdown()


async def test_a_client_that_leaves_mid_stream_cancels_the_upstream_request(nursery, llama_server_binary,
                                                                           slow_model, tmp_path):
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path,
                                 parallel=1) as server:
        running = await start_daemon(nursery, gateway_config([server], max_concurrency=1))
        await wait_until(backends_up(running.daemon, 1))
        pipeline = running.daemon.pipeline
        received = 0
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            body = {"model": "slow", "messages": [{"role": "user", "content": "Tell me everything."}],
                    "max_tokens": 2000, "stream": True}
            async with client.stream("POST", "/v1/chat/completions", json=body,
                                     headers={"X-Apsd-Tenant": "t"}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"content":"' in line:
                        received += 1
                    if received == 20:
                        break                    # the client leaves with ~1,980 tokens to go
        backend = pipeline.engines[0].backends[0]
        await wait_until(lambda: backend.in_flight == 0)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as direct:
            async def llama_metric(name: str) -> float:
                text = (await direct.get("/metrics")).text
                return float(next(line.split()[1] for line in text.splitlines()
                                  if line.startswith(f"llamacpp:{name} ")))

            with trio.fail_after(WAIT_S):           # llama.cpp itself stopped generating...
                while await llama_metric("requests_processing") != 0:
                    await trio.sleep(0.05)
            decoded = await llama_metric("n_decode_total")
            assert decoded < 1000, decoded          # ...long before the 2,000 tokens asked for
            status = pipeline.tenant_status("t")
            assert status.cancelled == 1 and 20 <= status.generated_tokens < 300   # billed what had arrived
            # the backend's slot is free again: the next request is served at once, not after 2,000 tokens
            async with httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as client:
                answer = await client.post("/v1/completions", json={"model": "slow", "prompt": "x", "max_tokens": 3},
                                           headers={"X-Apsd-Tenant": "t"})
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
            assert await llama_metric("n_decode_total") - decoded < 100   # not the 1,980 tokens left first
        running.daemon.request_shutdown()


async def test_the_daemons_log_has_no_line_per_forwarded_request(llama_server, tmp_path):
    """httpx logs every request at INFO: a busy gateway's log would be a line per forwarded request."""
    config = tmp_path / "gateway.toml"
    config.write_text(f'[[backends]]\nurl = "{llama_server.url}"\n[forward]\nhealth_interval_s = 0.2\n'
                      '[tenants.t]\nrate = 1e6\nburst = 1000000\n')
    process, url, seen = await start_apsd(str(config), "--port", "0")
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            with trio.fail_after(WAIT_S):
                while not (await client.get("/v1/models")).json()["data"]:
                    await trio.sleep(0.05)
            for _ in range(3):
                answer = await client.post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2},
                                           headers={"X-Apsd-Tenant": "t"})
                assert answer.status_code == 200
    finally:
        log = await stop_apsd(process, seen)
    assert "backend " in log and " is up" in log
    assert "HTTP Request" not in log and "httpx" not in log


async def test_metrics_json_answers_once_a_request_was_routed_to_a_backend(nursery, llama_server):
    """``/metrics.json`` answered 500 on every forward-engine deployment once the routing policy had
    sent a request (its routes were keyed by a tuple)."""
    running = await start_daemon(nursery, gateway_config([llama_server]))
    await wait_until(backends_up(running.daemon, 1))
    async with running.client as client:
        assert (await client.post("/infer", json=infer(tokens=3))).status_code == 200
        answer = await client.get("/metrics.json")
        assert answer.status_code == 200, answer.text
        routes = answer.json()["routes"]
        assert list(routes) == ["b0"] and sum(routes["b0"].values()) == 1, routes
    running.daemon.request_shutdown()


async def test_models_lists_only_what_the_tenant_may_use(nursery, llama_server):
    """``/v1/models`` listed every model to every tenant, including those its ``models`` forbids (which
    it would then be refused 403 ``model_not_allowed``). Two backends serve ``tiny`` and ``tiny-chat``;
    a tenant limited to ``tiny-chat`` sees that one only, through the official client, with a key and
    without keys; the admin key and an unlimited tenant see both."""
    import openai

    from apsd.core.config import AuthConfig
    from apsd.serve.auth import hash_key, new_key

    limited, free, admin = new_key(), new_key(), new_key()
    base = forwarding_config([llama_server.url, llama_server.url], {})
    backends = (attrs.evolve(base.backends[0], models=("tiny",)), attrs.evolve(base.backends[1], models=("tiny-chat",)))
    tenants = {"limited": TenantConfig(rate=1e6, burst=10**6, models=("tiny-chat",)),
               "free": TenantConfig(rate=1e6, burst=10**6)}
    keyed = attrs.evolve(base, backends=backends, auth=AuthConfig(admin_key_hashes=[hash_key(admin)]),
                         tenants={"limited": attrs.evolve(tenants["limited"], api_key_hashes=[hash_key(limited)]),
                                  "free": attrs.evolve(tenants["free"], api_key_hashes=[hash_key(free)])})
    open_daemon = attrs.evolve(base, backends=backends, tenants=tenants)
    for config, callers in ((keyed, {limited: ["tiny-chat"], free: ["tiny", "tiny-chat"], admin: ["tiny", "tiny-chat"]}),
                            (open_daemon, {"limited": ["tiny-chat"], "free": ["tiny", "tiny-chat"],
                                           None: ["tiny", "tiny-chat"]})):
        running = await start_daemon(nursery, config)
        await wait_until(backends_up(running.daemon, 2))

        def listed(who):
            headers = {"X-Apsd-Tenant": who} if config is open_daemon and who else {}
            client = openai.OpenAI(base_url=running.url + "/v1", api_key=who if config is keyed else "unused",
                                   default_headers=headers, max_retries=0, timeout=30)
            return sorted(m.id for m in client.models.list().data)

        for who, expected in callers.items():
            assert await trio.to_thread.run_sync(listed, who) == expected, who
        await running.client.aclose()
        running.daemon.request_shutdown()
