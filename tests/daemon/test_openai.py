"""The OpenAI-compatible API over real HTTP (daemons on 127.0.0.1:0), with the official ``openai``
client (sync in a thread, async under trio) and raw httpx/httpx-sse, against the simulated engines.

Real sockets cannot run in virtual time: the daemons use a fast ``gpu.time_scale``, and the few
waits for the books to catch up are bounded loops.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import httpx
import openai
import pytest
import trio
from httpx_sse import aconnect_sse

from apsd.core.config import ConfigError, GpuConfig, ServerConfig, TenantConfig, parse_config
from apsd.core.hookspecs import hookimpl
from apsd.serve.auth import hash_key
from apsd.serve.http.common import BodyError
from apsd.serve.http.openai import CHAT, COMPLETIONS, parse_openai_body, placeholder_text, priority_bid
from tests.helpers import FAST_GPU, WAIT_S, LiveDaemon, expected_prompt_tokens, make_config, start_daemon

TENANT = {"X-Apsd-Tenant": "tenant_a"}
MICRO_MODEL = "apsd-batch"
HELLO = [{"role": "user", "content": "Hello there"}]  # 11 characters: 3 tokens + 4 for the message


class Recorder:
    """A plugin keeping every admitted request, by id (to see its bid and payload)."""

    def __init__(self) -> None:
        self.admitted: dict[str, Any] = {}

    @hookimpl
    def request_admitted(self, request: Any, now: float) -> None:
        self.admitted[request.request_id] = request


def server(**changes: Any) -> ServerConfig:
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, "shutdown_grace_s": 1.0, **changes})


def tenants(**extra: TenantConfig) -> dict[str, TenantConfig]:
    return {"tenant_a": TenantConfig(rate=1e6, burst=100_000), **extra}


async def start(nursery: trio.Nursery, toml: dict[str, Any] | None = None, *, preset: str | None = None,
                plugins: tuple[object, ...] = (), **sections: Any) -> LiveDaemon:
    sections.setdefault("server", server())
    sections.setdefault("gpu", FAST_GPU)
    sections.setdefault("tenants", tenants())
    return await start_daemon(nursery, make_config(toml, **sections), preset=preset, plugins=plugins)


@pytest.fixture
async def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def apsd(nursery: trio.Nursery, recorder: Recorder) -> Any:
    """A daemon on the micro engine with a fast GPU; tenant ``capped`` may bid at most 3 (default 2);
    ``trickle`` refills slowly. Queue order ``static``: a request's effective priority is its bid."""
    live = await start(nursery, preset="static", plugins=(recorder,), tenants=tenants(
        capped=TenantConfig(rate=1e6, burst=100_000, max_bid=3, default_bid=2),
        # 1 token per model second: 1000 per wall second at time_scale 0.001
        trickle=TenantConfig(rate=1.0, burst=2000, output_estimate_tokens=2000)))  # (reserves its worst case)
    async with live.client:
        yield live
    live.daemon.request_shutdown()


def sync_client(live: LiveDaemon, **kwargs: Any) -> openai.OpenAI:
    kwargs.setdefault("default_headers", TENANT)
    kwargs.setdefault("max_retries", 0)
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=kwargs.pop("api_key", "unused"), timeout=20, **kwargs)


def async_client(live: LiveDaemon, **kwargs: Any) -> openai.AsyncOpenAI:
    kwargs.setdefault("default_headers", TENANT)
    kwargs.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=kwargs.pop("api_key", "unused"), timeout=20,
                              **kwargs)


async def in_thread(function: Any, *args: Any) -> Any:
    """Run a blocking (sync client) call without blocking the daemon's loop."""
    with trio.fail_after(30):
        return await trio.to_thread.run_sync(function, *args)


async def status(live: LiveDaemon, tenant: str = "tenant_a") -> dict[str, Any]:
    return (await live.client.get(f"/tenants/{tenant}/status")).json()


async def wait_for(predicate: Any, what: str, seconds: float = WAIT_S) -> None:
    """Poll ``predicate`` (async, no arguments) every 0.05 s until true: at most ``seconds``."""
    with trio.move_on_after(seconds):
        while not await predicate():
            await trio.sleep(0.05)
        return
    raise AssertionError(f"still not {what} after {seconds} s")


def words(text: str) -> int:
    return len(text.split())


# -- the official client --------------------------------------------------------------------------

async def test_models_are_the_engines_models(apsd):
    page = await in_thread(lambda: sync_client(apsd).models.list())
    assert [m.id for m in page.data] == [MICRO_MODEL] and page.data[0].owned_by == "apsd"
    raw = (await apsd.client.get("/v1/models")).json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"
    assert isinstance(raw["data"][0]["created"], int)


async def test_sync_client_chat_and_completions(apsd):
    def run() -> tuple[Any, Any]:
        client = sync_client(apsd)
        chat = client.chat.completions.create(model=MICRO_MODEL, messages=HELLO, max_tokens=7)
        text = client.completions.create(model=MICRO_MODEL, prompt="Hello there", max_tokens=5)
        return chat, text

    chat, text = await in_thread(run)
    assert chat.object == "chat.completion" and chat.model == MICRO_MODEL
    assert chat.choices[0].message.role == "assistant" and words(chat.choices[0].message.content) == 7
    assert chat.choices[0].finish_reason == "length"
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens) == (3 + 4, 7, 14)
    assert text.object == "text_completion" and text.choices[0].text == placeholder_text(0, 5)
    assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (3, 5)
    assert chat._request_id and chat.id == f"chatcmpl-{chat._request_id}"
    books = await status(apsd)
    assert (books["completed"], books["generated_tokens"], books["prompt_tokens"]) == (2, 12, 10)


async def test_sync_client_streams_with_usage(apsd):
    def run() -> list[Any]:
        stream = sync_client(apsd).chat.completions.create(
            model=MICRO_MODEL, messages=HELLO, max_tokens=300, stream=True, stream_options={"include_usage": True})
        return list(stream)

    chunks = await in_thread(run)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == placeholder_text(0, 300) and words(content) == 300
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 300
    assert chunks[-1].usage.prompt_tokens == 7
    assert all(c.usage is None for c in chunks[:-1])


async def test_async_client_runs_under_trio(apsd):
    client = async_client(apsd)
    async with client:
        with trio.fail_after(20):
            answer = await client.chat.completions.create(model=MICRO_MODEL, messages=HELLO, max_tokens=4)
            stream = await client.completions.create(model=MICRO_MODEL, prompt="Hi", max_tokens=50, stream=True,
                                                     stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
    assert words(answer.choices[0].message.content) == 4
    assert "".join(c.choices[0].text for c in chunks if c.choices) == placeholder_text(0, 50)
    assert chunks[-1].usage.completion_tokens == 50


# -- streams, raw --------------------------------------------------------------------------------

async def read_events(client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str] | None = None
                      ) -> tuple[httpx.Response, list[str]]:
    with trio.fail_after(20):
        async with aconnect_sse(client, "POST", "/v1/chat/completions" if "messages" in body else "/v1/completions",
                                json=body, headers=headers or TENANT) as source:
            return source.response, [event.data async for event in source.aiter_sse()]


async def test_a_raw_stream_has_openai_chunks_and_ends_with_done(apsd):
    response, events = await read_events(apsd.client, {"model": MICRO_MODEL, "messages": HELLO, "max_tokens": 20,
                                                       "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"] and "RateLimit" in response.headers
    assert events[-1] == "[DONE]"
    chunks = [json.loads(data) for data in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all("usage" not in c for c in chunks)  # not asked for
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == placeholder_text(0, 20)


@pytest.mark.parametrize("engine", ["batch", "continuous"])
@pytest.mark.parametrize("max_tokens", [1, 17, 1000])
async def test_placeholder_streams_deliver_exactly_max_tokens(nursery, engine, max_tokens):
    live = await start(nursery, {"engine": {"kind": engine}})
    async with live.client:
        model = (await live.client.get("/v1/models")).json()["data"][0]["id"]
        _, events = await read_events(live.client, {"model": model, "prompt": "count", "max_tokens": max_tokens,
                                                    "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(data) for data in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert words(text) == max_tokens and text == placeholder_text(0, max_tokens)
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": max_tokens,
                                   "total_tokens": 2 + max_tokens}
    live.daemon.request_shutdown()


async def test_without_max_tokens_the_configured_default_applies(nursery):
    live = await start(nursery, {"gateway": {"default_max_tokens": 12}})
    async with live.client:
        answer = (await live.client.post("/v1/completions", json={"model": MICRO_MODEL, "prompt": "x"},
                                         headers=TENANT)).json()
    assert answer["usage"]["completion_tokens"] == 12
    live.daemon.request_shutdown()


# -- errors ---------------------------------------------------------------------------------------

def openai_error(response: httpx.Response, status: int, code: str, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    assert error["param"] == param and error["message"]
    return error


async def test_the_tenant_header_is_required_without_keys(apsd):
    response = await apsd.client.post("/v1/chat/completions", json={"model": MICRO_MODEL, "messages": HELLO})
    error = openai_error(response, 400, "missing_tenant", "X-Apsd-Tenant")
    assert error["type"] == "invalid_request_error" and "X-Apsd-Tenant" in error["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        await in_thread(lambda: sync_client(apsd, default_headers={}).chat.completions.create(
            model=MICRO_MODEL, messages=HELLO))
    assert raised.value.code == "missing_tenant"


async def test_unknown_tenant_and_model_are_404(apsd):
    response = await apsd.client.post("/v1/chat/completions", json={"model": MICRO_MODEL, "messages": HELLO},
                                      headers={"X-Apsd-Tenant": "nobody"})
    assert openai_error(response, 404, "unknown_tenant", "X-Apsd-Tenant")["type"] == "not_found_error"
    with pytest.raises(openai.NotFoundError) as raised:
        await in_thread(lambda: sync_client(apsd).chat.completions.create(model="gpt-5", messages=HELLO))
    assert raised.value.code == "model_not_found" and MICRO_MODEL in raised.value.message


@pytest.mark.parametrize(("raw", "code"), [(b"{", "invalid_json"), (b"[]", "invalid_json"),
                                           (b'{"model": "a", "model": "b"}', "duplicate_key")])
async def test_malformed_bodies_are_400(apsd, raw, code):
    response = await apsd.client.post("/v1/completions", content=raw, headers=TENANT)
    openai_error(response, 400, code, "model" if code == "duplicate_key" else None)


CHAT_BODY = {"model": MICRO_MODEL, "messages": HELLO}
PROMPT_BODY = {"model": MICRO_MODEL, "prompt": "Hi"}


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"messages": HELLO}, "model", "missing_field"),
    ({**CHAT_BODY, "model": 7}, "model", "invalid_field"),
    ({"model": MICRO_MODEL}, "messages", "missing_field"),
    ({**CHAT_BODY, "messages": []}, "messages", "invalid_field"),
    ({**CHAT_BODY, "messages": ["hi"]}, "messages[0]", "invalid_field"),
    ({**CHAT_BODY, "messages": [{"content": "hi"}]}, "messages[0].role", "missing_field"),
    ({**CHAT_BODY, "messages": [{"role": "user"}]}, "messages[0].content", "missing_field"),
    ({**CHAT_BODY, "messages": [{"role": "user", "content": 3}]}, "messages[0].content", "invalid_field"),
    ({**CHAT_BODY, "messages": [{"role": "user", "content": [{"type": "hologram", "hologram": {"url": "x"}}]}]},
     "messages[0].content[0]", "invalid_field"),
    ({**CHAT_BODY, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]},
     "messages[0].content[0]", "invalid_field"),
    ({**CHAT_BODY, "messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name", "invalid_field"),
    ({**CHAT_BODY, "n_predict": -1}, "n_predict", "invalid_field"),
    ({**CHAT_BODY, "max_tokens": 8, "n_predict": 4000}, "max_tokens", "invalid_field"),
    ({**CHAT_BODY, "max_new_tokens": 0}, "max_new_tokens", "invalid_field"),
    ({**CHAT_BODY, "max_tokens": 8, "min_tokens": 9}, "min_tokens", "invalid_field"),
    ({**CHAT_BODY, "n_cmpl": 4}, "n_cmpl", "invalid_field"),
    ({**CHAT_BODY, "temperature": "hot"}, "temperature", "invalid_field"),
    ({**CHAT_BODY, "stop": [1]}, "stop", "invalid_field"),
    ({**CHAT_BODY, "max_tokens": 0}, "max_tokens", "invalid_field"),
    ({**CHAT_BODY, "max_tokens": True}, "max_tokens", "invalid_field"),
    ({**CHAT_BODY, "max_completion_tokens": "9"}, "max_completion_tokens", "invalid_field"),
    ({**CHAT_BODY, "max_tokens": 5, "max_completion_tokens": 6}, "max_tokens", "invalid_field"),
    ({**CHAT_BODY, "stream": "yes"}, "stream", "invalid_field"),
    ({**CHAT_BODY, "stream_options": {"include_usage": True}}, "stream_options", "invalid_field"),
    ({**CHAT_BODY, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage",
     "invalid_field"),
    ({**CHAT_BODY, "n": 2}, "n", "invalid_field"),
    ({**CHAT_BODY, "priority": "high"}, "priority", "invalid_field"),
    ({**CHAT_BODY, "priority": 1.5}, "priority", "invalid_field"),
    ({"model": MICRO_MODEL}, "prompt", "missing_field"),
    ({**PROMPT_BODY, "prompt": ["a", "b"]}, "prompt", "invalid_field"),
    ({**PROMPT_BODY, "prompt": [1, 2, 3]}, "prompt", "invalid_field"),
    ({**PROMPT_BODY, "best_of": 3}, "best_of", "invalid_field"),
])
async def test_bad_fields_are_422_naming_the_param(apsd, body, param, code):
    path = "/v1/completions" if "prompt" in body or param == "prompt" else "/v1/chat/completions"
    response = await apsd.client.post(path, json=body, headers=TENANT)
    error = openai_error(response, 422, code, param)
    assert error["type"] == "invalid_request_error" and param.split("[")[0].split(".")[0] in error["message"]


async def test_a_prompt_over_the_limit_is_413_and_body_errors_are_counted(apsd):
    before = (await apsd.client.get("/metrics.json")).json()["requests"]["rejected"]
    response = await apsd.client.post("/v1/completions", json={"model": MICRO_MODEL, "prompt": "x" * 131_073},
                                      headers=TENANT)
    openai_error(response, 413, "prompt_too_long", "prompt")
    with pytest.raises(openai.UnprocessableEntityError):
        await in_thread(lambda: sync_client(apsd).chat.completions.create(model=MICRO_MODEL, messages=HELLO, n=3))
    assert (await apsd.client.get("/metrics.json")).json()["requests"]["rejected"] == before + 2


async def test_unknown_v1_paths_and_methods_answer_in_openai_shape(apsd):
    openai_error(await apsd.client.post("/v1/images/generations", json={}), 404, "not_found")
    response = await apsd.client.get("/v1/chat/completions")
    openai_error(response, 405, "method_not_allowed")
    assert "POST" in response.headers["Allow"]


async def test_an_engine_failure_before_the_first_token_is_an_http_error(nursery):
    live = await start(nursery, gpu=attrs.evolve(FAST_GPU, fail_every_n_batches=1))
    async with live.client:
        body = {"model": MICRO_MODEL, "messages": HELLO, "stream": True}
        response = await live.client.post("/v1/chat/completions", json=body, headers=TENANT)
        assert openai_error(response, 502, "executor_failed")["type"] == "server_error"
        with pytest.raises(openai.InternalServerError):
            await in_thread(lambda: sync_client(live).chat.completions.create(**body))
    live.daemon.request_shutdown()


async def test_a_stream_cut_short_ends_with_an_error_event_and_no_done(nursery):
    live = await start(nursery, {"engine": {"kind": "continuous"}}, gpu=GpuConfig(time_scale=0.1),
                       server=server(shutdown_grace_s=0.0))
    body = {"model": "llama-3-8b", "prompt": "long", "max_tokens": 5000, "stream": True}
    events: list[str] = []
    async with live.client:
        with trio.fail_after(20):
            async with aconnect_sse(live.client, "POST", "/v1/completions", json=body, headers=TENANT) as source:
                async for event in source.aiter_sse():
                    events.append(event.data)
                    if len(events) == 3:
                        live.daemon.request_shutdown()  # the grace is 0: the running request gets 503
    assert events[-1] != "[DONE]"
    error = json.loads(events[-1])["error"]
    assert (error["code"], error["type"]) == ("shutting_down", "server_error")


# -- rate limits and the client's retries -----------------------------------------------------------

async def test_a_429_carries_retry_after_and_the_ratelimit_fields(apsd):
    client = sync_client(apsd, default_headers={"X-Apsd-Tenant": "trickle"})
    await in_thread(lambda: client.completions.create(model=MICRO_MODEL, prompt="", max_tokens=1900))
    with pytest.raises(openai.RateLimitError) as raised:
        await in_thread(lambda: client.completions.create(model=MICRO_MODEL, prompt="", max_tokens=1900))
    error = raised.value
    assert error.status_code == 429 and error.code == "rate_limited" and error.type == "rate_limit_error"
    assert int(error.response.headers["Retry-After"]) >= 1
    assert error.response.headers["RateLimit-Policy"].startswith('"tokens";q=2000;')
    assert error.response.headers["RateLimit"].startswith('"tokens";r=')


async def test_the_client_waits_retry_after_and_then_succeeds(apsd):
    # trickle refills 1000 tokens per wall second: after 1900, the next 1900 lack ~1.8 s: Retry-After 2
    client = sync_client(apsd, default_headers={"X-Apsd-Tenant": "trickle"}, max_retries=2)
    await in_thread(lambda: client.completions.create(model=MICRO_MODEL, prompt="", max_tokens=1900))
    started = trio.current_time()
    answer = await in_thread(lambda: client.completions.create(model=MICRO_MODEL, prompt="", max_tokens=1900))
    waited = trio.current_time() - started
    assert answer.usage.completion_tokens == 1900
    assert 1.5 < waited < 10, waited  # it waited the Retry-After (2 s), not its own 0.5-0.8 s backoff
    books = await status(apsd, "trickle")
    assert (books["completed"], books["rejected_by_error"]) == (2, {"rate_limited": 1})


async def test_rate_limit_error_after_the_clients_retries(nursery):
    """A tenant whose queue share stays full: 429 ``tenant_queue_full`` (Retry-After 1) on every
    attempt; the client retries twice, waiting 1 s each time, then raises RateLimitError."""
    live = await start(nursery, {"queue": {"max_requests_per_tenant": 1}}, gpu=GpuConfig(time_scale=1.0),
                       server=server(shutdown_grace_s=0.0))
    long = {"model": MICRO_MODEL, "prompt": "", "max_tokens": 2000}  # 2000 tokens at 128/s: 15 s
    async with live.client, trio.open_nursery() as clients:
        clients.start_soon(post, live, long)  # runs
        await wait_for(lambda: _running(live, 1), "running")
        clients.start_soon(post, live, long)  # waits in the queue
        await wait_for(lambda: _queued(live, 1), "queued")
        started = trio.current_time()
        with pytest.raises(openai.RateLimitError) as raised:
            await in_thread(lambda: sync_client(live, max_retries=2).completions.create(
                model=MICRO_MODEL, prompt="", max_tokens=5))
        waited = trio.current_time() - started
        assert raised.value.code == "tenant_queue_full"
        assert (await status(live))["rejected_by_error"] == {"tenant_queue_full": 3}  # 1 + 2 retries
        assert 1.8 < waited < 10, waited
        clients.cancel_scope.cancel()
    live.daemon.request_shutdown()


async def post(live: LiveDaemon, body: dict[str, Any]) -> None:
    """A client that waits for its answer (until cancelled)."""
    await live.client.post("/v1/completions", json=body, headers=TENANT)


async def _running(live: LiveDaemon, n: int) -> bool:
    return (await status(live))["running"] == n


async def _queued(live: LiveDaemon, n: int) -> bool:
    return (await status(live))["queued"] == n


# -- keys ------------------------------------------------------------------------------------------

KEY_A, KEY_B, ADMIN = "a" * 32, "b" * 32, "c" * 32


@pytest.fixture
async def keyed(nursery: trio.Nursery) -> Any:
    live = await start(nursery, {"auth": {"admin_key_hashes": [hash_key(ADMIN)]}}, tenants={
        "tenant_a": TenantConfig(rate=1e6, burst=100_000, api_key_hashes=(hash_key(KEY_A),)),
        "tenant_b": TenantConfig(rate=1e6, burst=100_000, api_key_hashes=(hash_key(KEY_B),))})
    async with live.client:
        yield live
    live.daemon.request_shutdown()


async def test_with_keys_the_key_names_the_tenant(keyed):
    answer = await in_thread(lambda: sync_client(keyed, api_key=KEY_B, default_headers={}).chat.completions.create(
        model=MICRO_MODEL, messages=HELLO, max_tokens=3))
    assert words(answer.choices[0].message.content) == 3
    assert (await keyed.client.get("/tenants/tenant_b/status", headers={"Authorization": f"Bearer {KEY_B}"})
            ).json()["completed"] == 1
    # the header may name the key's own tenant, never another
    same = await keyed.client.post("/v1/completions", json={**PROMPT_BODY, "max_tokens": 1},
                                   headers={"Authorization": f"Bearer {KEY_A}", **TENANT})
    assert same.status_code == 200
    other = await keyed.client.post("/v1/completions", json=PROMPT_BODY,
                                    headers={"Authorization": f"Bearer {KEY_B}", **TENANT})
    assert openai_error(other, 403, "tenant_mismatch", "X-Apsd-Tenant")["type"] == "permission_error"


async def test_with_keys_bad_keys_and_the_admin_key_are_refused(keyed):
    with pytest.raises(openai.AuthenticationError) as raised:
        await in_thread(lambda: sync_client(keyed, api_key="wrong" * 6).chat.completions.create(
            model=MICRO_MODEL, messages=HELLO))
    assert raised.value.code == "invalid_api_key"
    assert raised.value.response.headers["WWW-Authenticate"].startswith("Bearer")
    missing = await keyed.client.post("/v1/chat/completions", json=CHAT_BODY, headers=TENANT)
    assert openai_error(missing, 401, "missing_api_key")["type"] == "authentication_error"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await in_thread(lambda: sync_client(keyed, api_key=ADMIN).chat.completions.create(
            model=MICRO_MODEL, messages=HELLO))
    assert denied.value.code == "admin_cannot_submit"
    # any valid key may list the models
    for key in (KEY_A, ADMIN):
        assert (await keyed.client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code == 200
    openai_error(await keyed.client.get("/v1/models"), 401, "missing_api_key")


# -- priority ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("tenant", "body", "header", "bid"), [
    ("capped", {"priority": -100}, None, 3),   # default 2 - (-100), clamped to max_bid 3
    ("capped", {}, None, 2),                   # the default bid
    ("capped", {"priority": 5}, None, 1),      # 2 - 5, clamped to 1
    ("capped", {}, "9", 3),                    # the header is apsd's bid, clamped too
    ("capped", {"priority": 1}, "3", 3),       # the header wins over the body
    ("tenant_a", {"priority": -3}, None, 8),   # defaults: 5 - (-3)
    ("tenant_a", {"priority": -10**40}, None, 10),
    ("tenant_a", {}, "0", 1),
])
async def test_priority_maps_to_a_bid_within_the_tenants_contract(apsd, recorder, tenant, body, header, bid):
    headers = {"X-Apsd-Tenant": tenant, **({"X-Apsd-Priority": header} if header else {})}
    response = await apsd.client.post("/v1/chat/completions", json={**CHAT_BODY, "max_tokens": 2, **body},
                                      headers=headers)
    assert response.status_code == 200, response.text
    request = recorder.admitted[response.headers["X-Request-Id"]]
    assert request.priority_bid == bid
    assert request.effective_priority == bid  # (the static order serves the bid as it is)


async def test_infer_bids_are_clamped_to_max_bid_too(apsd):
    response = await apsd.client.post("/infer", json={"tenant_id": "capped", "prompt": "", "tokens_requested": 2,
                                                      "priority_bid": 10})
    assert response.status_code == 200 and response.json()["effective_priority"] == 3


@pytest.mark.parametrize("value", ["high", "1.5", "", "1 2", "9" * 30])
async def test_a_bad_priority_header_is_400(apsd, value):
    response = await apsd.client.post("/v1/chat/completions", json=CHAT_BODY,
                                      headers={**TENANT, "X-Apsd-Priority": value})
    openai_error(response, 400, "invalid_header", "X-Apsd-Priority")


def test_priority_bid_formula():
    capped = TenantConfig(rate=1, burst=1, max_bid=3, default_bid=2)
    assert [priority_bid(capped, priority=p) for p in (-100, -1, 0, 1, 2)] == [3, 3, 2, 1, 1]
    assert [priority_bid(None, priority=p) for p in (-9, -5, 0, 4, 9)] == [10, 10, 5, 1, 1]
    assert [priority_bid(capped, header=h) for h in (-5, 1, 2, 3, 10)] == [1, 1, 2, 3, 3]


def test_tenant_bids_are_validated():
    with pytest.raises(ConfigError, match=r"tenants\.a\.default_bid: must be <= max_bid \(3\), got 5"):
        parse_config({"tenants": {"a": {"rate": 1.0, "burst": 1, "max_bid": 3}}})
    with pytest.raises(ConfigError, match=r"tenants\.a\.max_bid: must be between 1 and 10, got 11"):
        parse_config({"tenants": {"a": {"rate": 1.0, "burst": 1, "max_bid": 11}}})
    config = parse_config({"tenants": {"a": {"rate": 1.0, "burst": 1, "max_bid": 4, "default_bid": 4}},
                           "gateway": {"default_max_tokens": 9}})
    assert (config.tenants["a"].max_bid, config.tenants["a"].default_bid, config.gateway.default_max_tokens) == \
        (4, 4, 9)


# -- what reaches the pipeline ---------------------------------------------------------------------------

PASSED_THROUGH = {"temperature": 0.7, "top_p": 0.9, "stop": ["\n"], "seed": 42, "user": "u-1",
                  "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                  "response_format": {"type": "json_object"}, "logit_bias": {"50256": -100}, "x_vendor": [1, {}]}


def test_the_payload_keeps_every_parameter_but_priority():
    config = make_config()
    body = {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                                    {"type": "text", "text": " there"}]},
                                       {"role": "assistant", "content": None,
                                        "tool_calls": [{"id": "1", "type": "function",
                                                        "function": {"name": "f", "arguments": "{}"}}]}],
            "max_completion_tokens": 40, "stream": True, "stream_options": {"include_usage": True},
            "priority": -2, **PASSED_THROUGH}
    parsed = parse_openai_body(json.dumps(body).encode(), CHAT, config)
    assert parsed.payload == {k: v for k, v in body.items() if k != "priority"}
    assert (parsed.max_tokens, parsed.stream, parsed.include_usage, parsed.priority) == (40, True, True, -2)
    tool_calls = json.dumps(body["messages"][2]["tool_calls"])
    # (the messages' texts, each message's parts a line; 4 tokens a message for the template)
    assert parsed.prompt_tokens == math.ceil(expected_prompt_tokens("Be brief." + "Hello\n there" + tool_calls)) + 3 * 4
    text = parse_openai_body(b'{"model": "m", "prompt": ["abcdefgh"], "echo": true}', COMPLETIONS, config)
    assert (text.prompt, text.prompt_tokens, text.max_tokens, text.payload) == (
        "abcdefgh", 2, 256, {"model": "m", "prompt": ["abcdefgh"], "echo": True})


def test_a_bad_body_names_the_param():
    with pytest.raises(BodyError) as raised:
        parse_openai_body(b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}', CHAT,
                          make_config())
    assert (raised.value.refusal.status, raised.value.refusal.field) == (422, "n")
    assert "one sequence per request" in raised.value.refusal.message


async def test_requests_reach_the_pipeline_with_model_api_and_payload(apsd, recorder):
    body = {**CHAT_BODY, "max_tokens": 3, "priority": 1, **PASSED_THROUGH}
    response = await apsd.client.post("/v1/chat/completions", json=body, headers=TENANT)
    assert response.status_code == 200
    request = recorder.admitted[response.headers["X-Request-Id"]]
    assert (request.model, request.api, request.tenant_id, request.tokens_requested, request.prompt_tokens) == (
        MICRO_MODEL, CHAT, "tenant_a", 3, 7)
    assert request.payload == {k: v for k, v in body.items() if k != "priority"}
    assert request.reserved_tokens == 7 + 3


# -- clients that leave ---------------------------------------------------------------------------------

async def test_a_client_that_leaves_mid_stream_cancels_its_request(nursery):
    """Continuous engine at time_scale 0.1: 1000 tokens take ~1.1 s of wall time. The client reads
    a few events and hangs up: the request is cancelled, billed for what ran, and its slot and KV
    cache are freed."""
    live = await start(nursery, {"engine": {"kind": "continuous"}}, gpu=GpuConfig(time_scale=0.1))
    body = {"model": "llama-3-8b", "messages": HELLO, "max_tokens": 1000, "stream": True}
    async with live.client:
        with trio.fail_after(20):
            async with aconnect_sse(live.client, "POST", "/v1/chat/completions", json=body,
                                    headers=TENANT) as source:
                seen = 0
                async for _ in source.aiter_sse():
                    seen += 1
                    if seen == 5:
                        break
        await wait_for(lambda: _cancelled(live), "cancelled")
        books = await status(live)
        assert (books["completed"], books["cancelled"], books["running"]) == (0, 1, 0)
        assert 0 < books["generated_tokens"] < 1000 and books["prompt_tokens"] == 7  # billed for what ran
        assert books["cost_usd"] > 0
        engine = (await live.client.get("/metrics.json")).json()["engines"][0]
        assert (engine["running"], engine["kv_tokens_used"]) == (0, 0)
        # the slot serves the next request
        answer = await live.client.post("/v1/chat/completions", json={**body, "max_tokens": 5, "stream": False},
                                        headers=TENANT)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
    live.daemon.request_shutdown()


async def _cancelled(live: LiveDaemon) -> bool:
    return (await status(live))["cancelled"] == 1


async def test_a_client_that_leaves_while_queued_cancels_its_request(nursery):
    live = await start(nursery, gpu=GpuConfig(time_scale=1.0), server=server(shutdown_grace_s=0.0))
    long = {"model": MICRO_MODEL, "prompt": "", "max_tokens": 2000}
    async with live.client, trio.open_nursery() as clients:
        clients.start_soon(post, live, long)
        await wait_for(lambda: _running(live, 1), "running")
        async with trio.open_nursery() as leaving:  # the stream waits in the queue for its first token...
            leaving.start_soon(post, live, {**long, "stream": True})
            await wait_for(lambda: _queued(live, 1), "queued")
            leaving.cancel_scope.cancel()             # ...and gives up
        await wait_for(lambda: _cancelled(live), "cancelled")
        books = await status(live)
        assert (books["queued"], books["rejected_by_error"]) == (0, {})
        clients.cancel_scope.cancel()
    live.daemon.request_shutdown()
