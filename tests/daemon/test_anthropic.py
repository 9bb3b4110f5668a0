"""Anthropic's Messages API over real HTTP (daemons on 127.0.0.1:0) with the official ``anthropic``
client and raw httpx, against the simulated engines: answers and streams in Anthropic's shape, keys in
``x-api-key``, every refusal in Anthropic's error shape, ``count_tokens``, and the ``RateLimit`` fields
on every answer of a tenant's request (the official ``openai`` client's too).

Real sockets cannot run in virtual time: the daemons use a fast ``gpu.time_scale``. The values of the
``RateLimit`` fields are checked in virtual time in ``tests/unit/test_rate_limit_fields.py``.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import openai
import pytest
import trio

from apsd.core.config import AuthConfig, ServerConfig, TenantConfig
from apsd.serve.auth import hash_key
from apsd.serve.http.anthropic import error_type
from tests.helpers import FAST_GPU, LiveDaemon, backends_up, forwarding_config, make_config, start_daemon, wait_until
from tests.standin_backend import start_standin_backend

TENANT = {"X-Apsd-Tenant": "tenant_a"}
MODEL = "apsd-batch"
HELLO = [{"role": "user", "content": "Hello there"}]
KEY_A = "a" * 43
ADMIN = "d" * 43
SCRAPER = "s" * 43
#: A structured-field List of one Item: a String with Integer parameters (the IETF draft's form).
POLICY = re.compile(r'"tokens";q=(\d+);w=(\d+)')
LIMIT = re.compile(r'"tokens";r=(\d+);t=(\d+)')


def tenants(**extra: TenantConfig) -> dict[str, TenantConfig]:
    return {"tenant_a": TenantConfig(rate=1e6, burst=100_000), **extra}


async def start(nursery: trio.Nursery, **sections: Any) -> LiveDaemon:
    sections.setdefault("server", ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=1.0))
    sections.setdefault("gpu", FAST_GPU)
    sections.setdefault("tenants", tenants())
    return await start_daemon(nursery, make_config(**sections))


@pytest.fixture
async def apsd(nursery: trio.Nursery) -> Any:
    """A daemon on the batch engine with a fast GPU; ``small`` has a burst of 100; ``trickle`` refills 100
    tokens per wall second (0.1 per model second at time_scale 0.001)."""
    live = await start(nursery, tenants=tenants(small=TenantConfig(rate=1e6, burst=100),
                                                trickle=TenantConfig(rate=0.1, burst=2000)))
    async with live.client:
        yield live
    live.daemon.request_shutdown()


def client(live: LiveDaemon, tenant: str = "tenant_a", **kwargs: Any) -> anthropic.Anthropic:
    kwargs.setdefault("max_retries", 0)
    return anthropic.Anthropic(base_url=live.url, api_key=kwargs.pop("api_key", "unused"), timeout=20,
                               default_headers={"X-Apsd-Tenant": tenant}, **kwargs)


async def in_thread(function: Any, *args: Any) -> Any:
    with trio.fail_after(30):
        return await trio.to_thread.run_sync(function, *args)


def rate_limit(headers: Any) -> tuple[int, int, int, int]:
    """(q, w, r, t) of an answer's RateLimit-Policy and RateLimit fields, which must be in the draft's form."""
    policy, limit = POLICY.fullmatch(headers["RateLimit-Policy"]), LIMIT.fullmatch(headers["RateLimit"])
    assert policy and limit, (headers.get("RateLimit-Policy"), headers.get("RateLimit"))
    return int(policy[1]), int(policy[2]), int(limit[1]), int(limit[2])


# -- the official client --------------------------------------------------------------------------

async def test_the_official_client_gets_a_whole_message_and_a_stream(apsd):
    def run() -> tuple[Any, Any, list[str], Any]:
        c = client(apsd)
        whole = c.messages.create(model=MODEL, max_tokens=7, messages=HELLO, system="Be brief.")
        with c.messages.stream(model=MODEL, max_tokens=9, messages=HELLO) as stream:
            texts = list(stream.text_stream)
            final = stream.get_final_message()
        raw = c.messages.with_raw_response.create(model=MODEL, max_tokens=3, messages=HELLO)
        return whole, final, texts, raw
    whole, final, texts, raw = await in_thread(run)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert len(whole.content[0].text.split()) == 7 and whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 7 and whole.usage.input_tokens > 0
    assert len("".join(texts).split()) == 9 and final.usage.output_tokens == 9 and final.stop_reason == "max_tokens"
    assert final.content[0].text == "".join(texts)
    assert raw.headers["request-id"] == raw.headers["x-request-id"] and raw.parse().usage.output_tokens == 3
    assert rate_limit(raw.headers)[0] == 100_000
    status = (await apsd.client.get("/tenants/tenant_a/status")).json()
    assert status["completed"] == 3 and status["generated_tokens"] == 7 + 9 + 3


async def test_the_official_client_lists_the_models_in_its_shape(apsd):
    page = await in_thread(lambda: client(apsd).models.list())
    assert [(m.id, m.type) for m in page.data] == [(MODEL, "model")] and page.has_more is False
    assert page.data[0].created_at.year >= 2024
    plain = (await apsd.client.get("/v1/models", headers=TENANT)).json()   # (without anthropic-version: OpenAI's)
    assert plain["object"] == "list" and plain["data"][0]["id"] == MODEL


async def test_a_stream_names_every_event_and_starts_the_message_once(apsd):
    async with apsd.client.stream("POST", "/v1/messages", headers=TENANT, json={
            "model": MODEL, "max_tokens": 20, "stream": True, "messages": HELLO}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        assert rate_limit(response.headers)
        body = (await response.aread()).decode()
    events = [block.split("\n") for block in body.strip().split("\n\n")]
    names = [lines[0].removeprefix("event: ") for lines in events]
    datas = [json.loads(lines[1].removeprefix("data: ")) for lines in events]
    assert [d["type"] for d in datas] == names
    assert names[:2] == ["message_start", "content_block_start"] and names.count("message_start") == 1
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert datas[-2]["usage"]["output_tokens"] == 20
    assert len("".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta").split()) == 20


async def test_count_tokens_is_the_estimate_admission_reserves_and_is_never_charged(apsd):
    def run() -> tuple[Any, Any]:
        c = client(apsd)
        counted = c.messages.count_tokens(model=MODEL, messages=HELLO, system="Be brief.")
        sent = c.messages.create(model=MODEL, max_tokens=1, messages=HELLO, system="Be brief.")
        return counted, sent
    before = (await apsd.client.get("/tenants/tenant_a/status")).json()
    counted, sent = await in_thread(run)
    after = (await apsd.client.get("/tenants/tenant_a/status")).json()
    assert counted.input_tokens == sent.usage.input_tokens > 0   # (the simulated engine reports apsd's estimate)
    assert after["admitted"] == before["admitted"] + 1 and after["prompt_tokens"] == sent.usage.input_tokens


# -- keys ---------------------------------------------------------------------------------------------

async def test_a_key_in_x_api_key_names_the_tenant_as_a_bearer_key_does(nursery):
    config_tenants = {"tenant_a": TenantConfig(rate=1e6, burst=100_000, api_key_hashes=[hash_key(KEY_A)])}
    live = await start(nursery, tenants=config_tenants,
                       auth=AuthConfig(admin_key_hashes=[hash_key(ADMIN)], metrics_key_hashes=[hash_key(SCRAPER)]))
    async with live.client:
        def run() -> Any:   # (the official client sends its api_key as x-api-key)
            return anthropic.Anthropic(base_url=live.url, api_key=KEY_A, max_retries=0, timeout=20).messages.create(
                model=MODEL, max_tokens=2, messages=HELLO)
        assert (await in_thread(run)).usage.output_tokens == 2
        body = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
        bearer = await live.client.post("/v1/messages", json=body, headers={"Authorization": f"Bearer {KEY_A}"})
        both = await live.client.post("/v1/messages", json=body,
                                      headers={"Authorization": f"Bearer {KEY_A}", "x-api-key": KEY_A})
        assert bearer.status_code == both.status_code == 200
        for headers, status, code in [({}, 401, "missing_api_key"), ({"x-api-key": "nope" * 11}, 401, "invalid_api_key"),
                                      ({"x-api-key": KEY_A, "Authorization": f"Bearer {ADMIN}"}, 401,
                                       "invalid_authorization"),
                                      ({"x-api-key": "two keys"}, 401, "invalid_authorization"),
                                      ({"x-api-key": ADMIN}, 403, "admin_cannot_submit"),
                                      ({"x-api-key": SCRAPER}, 403, "metrics_only")]:
            refused = await live.client.post("/v1/messages", json=body, headers=headers)
            assert refused.status_code == status, (headers, refused.text)
            assert refused.json()["error"]["details"]["error_code"] == code
            assert refused.json()["error"]["type"] == error_type(status)
        scraped = await live.client.get("/metrics", headers={"x-api-key": SCRAPER})
        assert scraped.status_code == 200   # (a metrics key in x-api-key reads the metrics, and nothing else)
    live.daemon.request_shutdown()


async def test_an_issued_keys_limits_and_usage_hold_on_the_messages_api(nursery):
    """A key issued through /admin, its models limited, sent as ``x-api-key`` (as Claude Code sends it):
    /v1/messages holds it to its models (403 ``model_not_allowed``), as /v1/chat/completions does; an
    unlimited key's messages are counted under its name in the usage."""
    live = await start(nursery, auth=AuthConfig(admin_key_hashes=[hash_key(ADMIN)]))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    async with live.client:
        keys = {}
        for name, limits in (("limited", {"models": ["apsd-other"]}), ("agent", {})):
            issued = await live.client.post("/admin/tenants/tenant_a/keys", headers=admin,
                                            json={"name": name, "owner_kind": "agent", **limits})
            assert issued.status_code == 201, issued.text
            keys[name] = issued.json()
        body = {"model": MODEL, "max_tokens": 2, "messages": HELLO}
        refused = await live.client.post("/v1/messages", json=body, headers={"x-api-key": keys["limited"]["key"]})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["details"]["error_code"] == "model_not_allowed"
        chat = await live.client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {keys['limited']['key']}"},
                                      json={"model": MODEL, "max_tokens": 2, "messages": HELLO})
        assert chat.status_code == 403 and chat.json()["error"]["code"] == "model_not_allowed"
        for _ in range(2):
            served = await live.client.post("/v1/messages", json=body, headers={"x-api-key": keys["agent"]["key"]})
            assert served.status_code == 200, served.text

        async def rows() -> list[dict]:
            answer = await live.client.get("/admin/usage", headers=admin, params={"tenant": "tenant_a", "by": "key"})
            return answer.json()["rows"]

        with trio.fail_after(10):
            while sum(r["completed"] for r in await rows() if r["key"] == keys["agent"]["id"]) != 2:
                await trio.sleep(0.1)
        assert {r["key_name"] for r in await rows() if r["key"] == keys["agent"]["id"]} == {"agent"}
    live.daemon.request_shutdown()


# -- errors ---------------------------------------------------------------------------------------------

async def test_every_refusal_is_in_anthropics_shape_and_the_client_raises_its_class(apsd):
    def expect(error: type[Exception], call: Any) -> Any:
        with pytest.raises(error) as raised:
            call()
        return raised.value

    def run() -> list[Any]:
        c = client(apsd)
        return [
            expect(anthropic.BadRequestError, lambda: c.messages.create(model=MODEL, max_tokens=0, messages=HELLO)),
            expect(anthropic.NotFoundError, lambda: c.messages.create(model="nope", max_tokens=5, messages=HELLO)),
            expect(anthropic.NotFoundError, lambda: client(apsd, "nobody").messages.create(
                model=MODEL, max_tokens=5, messages=HELLO)),
            expect(anthropic.RequestTooLargeError, lambda: client(apsd, "small").messages.create(   # (a prompt
                model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "9 " * 600}])),    # beyond its burst)
            expect(anthropic.BadRequestError, lambda: c.messages.create(
                model=MODEL, max_tokens=5, messages=[{"role": "system", "content": "x"}])),
        ]
    bad, model, tenant, too_large, role = await in_thread(run)
    assert bad.body["error"]["details"]["error_code"] == "invalid_field" and "max_tokens" in bad.message
    assert model.body["error"]["details"]["error_code"] == "model_not_found"
    assert tenant.body["error"]["details"]["error_code"] == "unknown_tenant"
    assert too_large.status_code == 413 and too_large.body["error"]["type"] == "request_too_large"
    assert too_large.body["error"]["details"]["error_code"] == "exceeds_tenant_burst"
    assert "Retry-After" not in too_large.response.headers and rate_limit(too_large.response.headers)[0] == 100
    assert "system" in role.message
    for raw, status, code in [(b"{", 400, "invalid_json"), (b'{"model": "x", "model": "y"}', 400, "duplicate_key"),
                              (json.dumps({"model": MODEL, "messages": HELLO}).encode(), 400, "missing_field")]:
        answer = await apsd.client.post("/v1/messages", content=raw, headers={**TENANT, "Content-Type": "application/json"})
        assert answer.status_code == status and answer.json()["type"] == "error"
        assert answer.json()["error"]["details"]["error_code"] == code
    for method, path, status in [("GET", "/v1/messages", 405), ("POST", "/v1/messages/nothing", 404)]:
        answer = await apsd.client.request(method, path, headers=TENANT)
        assert answer.status_code == status and answer.json()["error"]["type"] == error_type(status)


async def test_a_429_carries_retry_after_and_the_rate_limit_fields_and_the_client_waits_them(apsd):
    body = {"model": MODEL, "max_tokens": 1500, "messages": HELLO}
    assert (await apsd.client.post("/v1/messages", json=body, headers={"X-Apsd-Tenant": "trickle"})).status_code == 200

    def run() -> Any:
        with pytest.raises(anthropic.RateLimitError) as raised:
            client(apsd, "trickle").messages.create(**body)
        return raised.value
    limited = await in_thread(run)
    headers = limited.response.headers
    q, w, r, t = rate_limit(headers)
    assert (q, w) == (2000, 20) and r < 1500 and t > 0 and int(headers["Retry-After"]) >= 1   # (w: 2000 / 100 per s)
    assert limited.body["error"]["details"]["error_code"] == "rate_limited"


def test_statuses_map_to_anthropics_error_types():
    assert [error_type(s) for s in (400, 401, 403, 404, 413, 429, 500, 502, 503, 504, 529)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error", "request_too_large",
        "rate_limit_error", "api_error", "api_error", "overloaded_error", "timeout_error", "overloaded_error"]


# -- RateLimit fields on every answer -----------------------------------------------------------------

async def test_every_answer_of_a_tenants_request_carries_the_rate_limit_fields(nursery):
    """200s (whole and streamed, both APIs), 413s, 429s, 400s after the tenant is known, count_tokens: each carries RateLimit-Policy and RateLimit in the draft's form; the official
    openai client still works with them."""
    live = await start(nursery, tenants=tenants(small=TenantConfig(rate=1e-3, burst=100)))
    async with live.client:
        message = {"model": MODEL, "max_tokens": 4, "messages": HELLO}
        chat = {"model": MODEL, "max_tokens": 4, "messages": HELLO}
        answers = {
            "message": await live.client.post("/v1/messages", json=message, headers=TENANT),
            "chat": await live.client.post("/v1/chat/completions", json=chat, headers=TENANT),
            "infer": await live.client.post("/infer", json={"tenant_id": "tenant_a", "prompt": "x",
                                                            "tokens_requested": 4, "priority_bid": 5}),
            "count_tokens": await live.client.post("/v1/messages/count_tokens", json=message, headers=TENANT),
            "413": await live.client.post("/v1/messages", headers={"X-Apsd-Tenant": "small"},   # (a prompt beyond the burst)
                                          json={**message, "messages": [{"role": "user", "content": "9 " * 300}]}),
            "400": await live.client.post("/v1/messages", json={**message, "max_tokens": "many"}, headers=TENANT),
        }
        small = {**message, "max_tokens": 60}
        assert (await live.client.post("/v1/messages", json=small, headers={"X-Apsd-Tenant": "small"})).status_code == 200
        answers["429"] = await live.client.post("/v1/messages", json=small, headers={"X-Apsd-Tenant": "small"})
        async with live.client.stream("POST", "/v1/chat/completions", headers=TENANT,
                                      json={**chat, "stream": True}) as stream:
            answers["stream"] = stream
            await stream.aread()

        def sdk() -> Any:
            c = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", default_headers=TENANT, max_retries=0)
            return c.chat.completions.with_raw_response.create(**chat)
        raw = await in_thread(sdk)
        assert raw.parse().usage.completion_tokens == 4
        answers["openai client"] = raw
        statuses = {name: answer.status_code for name, answer in answers.items()}
        assert statuses == {"message": 200, "chat": 200, "infer": 200, "count_tokens": 200, "413": 413, "400": 400,
                            "429": 429, "stream": 200, "openai client": 200}
        for name, answer in answers.items():
            q, w, r, t = rate_limit(answer.headers)
            assert q == (100 if name in ("413", "429") else 100_000), name
        assert rate_limit(answers["429"].headers)[2] < 64 and "Retry-After" in answers["429"].headers
        unknown = await live.client.post("/v1/messages", json=message, headers={"X-Apsd-Tenant": "nobody"})
        assert unknown.status_code == 404 and "RateLimit" not in unknown.headers   # (no bucket to describe)
    live.daemon.request_shutdown()


# -- a backend that does not serve the Messages API --------------------------------------------------

async def test_a_model_whose_servers_lack_the_messages_api_is_refused_404_in_anthropics_shape(nursery):
    """An OpenAI-compatible server without ``/v1/messages`` (it answers 404 there): apsd notes it when the
    server comes up, refuses a message for its model at once with 404 ``unsupported_api`` naming the
    backend (never relays the server's 404, never a 500), nothing charged; ``count_tokens`` falls back to
    apsd's estimate; chat to the same model still works."""
    backend = await start_standin_backend(nursery)
    running = await start_daemon(nursery, forwarding_config([backend.url], tenants()))
    await wait_until(backends_up(running.daemon))
    await wait_until(lambda: running.daemon.pipeline.engines[0].backends[0].messages is False)

    def run() -> tuple[Any, int, Any]:
        c = client(running)
        with pytest.raises(anthropic.NotFoundError) as raised:
            c.messages.create(model="standin", max_tokens=5, messages=HELLO)
        counted = c.messages.count_tokens(model="standin", messages=HELLO).input_tokens
        chat = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", default_headers=TENANT, max_retries=0,
                             timeout=20).chat.completions.create(model="standin", max_tokens=5, messages=HELLO)
        return raised.value, counted, chat

    refused, counted, chat = await in_thread(run)
    assert refused.body["type"] == "error" and refused.body["error"]["type"] == "not_found_error"
    assert refused.body["error"]["details"]["error_code"] == "unsupported_api"
    assert "b0" in refused.message and "/v1/chat/completions" in refused.message
    assert rate_limit(refused.response.headers)[0] == 100_000
    assert counted > 0 and chat.choices[0].message.content
    probes = [e.json for e in backend.received if e.path.startswith("/v1/messages")]
    assert probes == [{}]        # (the one question whether it serves it: nothing was ever sent there)
    status = running.daemon.pipeline.tenant_status("tenant_a")
    assert (status.completed, status.failed, status.rejected) == (1, 0, 1)     # (the chat only ran)
    assert (status.prompt_tokens, status.generated_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    running.daemon.request_shutdown()
