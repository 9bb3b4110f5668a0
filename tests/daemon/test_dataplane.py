"""The ``/v1`` data plane, served below Quart (apsd/serve/http/dataplane.py): what the framework used to
do for it and the data plane now does itself, over real HTTP against a daemon on port 0: the routes,
``OPTIONS`` and ``HEAD``, a body beyond ``max_body_bytes`` or slower than ``body_timeout_s``, an error
inside a handler, each in its protocol's shape."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from apsd.core.models import OPENAI_APIS
from apsd.pipeline import open_pipeline
from apsd.serve.http import create_app, dataplane, openai
from tests.helpers import FAST_GPU, LiveDaemon, build_policies, make_config, start_daemon

TENANT = {"X-Apsd-Tenant": "tenant_a"}
MODEL = "apsd-batch"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4}


async def start(nursery: trio.Nursery, **server: Any) -> LiveDaemon:
    config = make_config({"server": {"host": "127.0.0.1", "port": 0, **server},
                          "tenants": {"tenant_a": {"rate": 1e6, "burst": 100_000}}}, gpu=FAST_GPU)
    return await start_daemon(nursery, config)


@pytest.fixture
async def apsd(nursery: trio.Nursery) -> Any:
    live = await start(nursery, max_body_bytes=4096, body_timeout_s=0.5)
    async with live.client:
        yield live
    live.daemon.request_shutdown()


def test_every_v1_endpoint_is_the_data_planes_and_none_is_quarts():
    assert set(dataplane.ROUTES) == {"/v1/" + api.replace(".", "/") for api in OPENAI_APIS} | {
        "/v1/models", "/v1/messages", "/v1/messages/count_tokens"}



async def test_the_quart_app_has_no_v1_route():
    async with open_pipeline(make_config(gpu=FAST_GPU), build_policies(make_config(gpu=FAST_GPU))) as pipeline:
        rules = [rule.rule for rule in create_app(pipeline).url_map.iter_rules()]
    assert "/infer" in rules and not [rule for rule in rules if rule.startswith("/v1")], rules


async def test_options_and_head_are_answered_as_the_framework_did(apsd):
    options = await apsd.client.options("/v1/chat/completions", headers=TENANT)
    assert options.status_code == 200 and options.content == b"" and options.headers["Allow"] == "POST, OPTIONS"
    got = await apsd.client.get("/v1/models", headers=TENANT)
    head = await apsd.client.head("/v1/models", headers=TENANT)
    assert got.status_code == head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == got.headers["content-length"] == str(len(got.content))
    wrong = await apsd.client.put("/v1/models", headers=TENANT)
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert wrong.headers["Allow"] == "GET, HEAD, OPTIONS"
    for path in ("/v1/models/", "/v1//models", "/v1/chat"):
        missing = await apsd.client.get(path, headers=TENANT)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found", path


async def test_a_body_beyond_max_body_bytes_is_413_in_each_protocols_shape(apsd):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    refused = await apsd.client.post("/v1/chat/completions", json=big, headers=TENANT)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "body_too_large"
    assert refused.headers["Connection"] == "close" and "RateLimit" in refused.headers   # (the tenant was known)
    message = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x" * 5000}]}
    refused = await apsd.client.post("/v1/messages", json=message, headers=TENANT)
    assert refused.status_code == 413
    assert refused.json()["error"]["type"] == "request_too_large"
    assert refused.json()["error"]["details"]["error_code"] == "body_too_large"
    fine = await apsd.client.post("/v1/chat/completions", json=CHAT, headers=TENANT)
    assert fine.status_code == 200 and fine.json()["usage"]["completion_tokens"] == 4


async def test_a_body_that_does_not_arrive_in_time_is_408_and_the_connection_closes(apsd):
    host, port = apsd.url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Apsd-Tenant: tenant_a\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\"")
        answer = b""
        with trio.fail_after(30):   # (the server's own timeout is 0.5 s; this only bounds the test)
            while chunk := await stream.receive_some(65536):
                answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer
    assert b"connection: close" in head.lower() and b'"code": "request_timeout"' in body


async def test_an_error_inside_a_handler_is_a_500_in_the_protocols_shape_and_counted(apsd, monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai, "parse_openai_body", broken)
    before = (await apsd.client.get("/metrics.json")).json()["requests"]["rejected"]
    answer = await apsd.client.post("/v1/chat/completions", json=CHAT, headers=TENANT)
    assert answer.status_code == 500
    assert answer.json()["error"]["code"] == "internal_error" and "Traceback" not in answer.text
    assert (await apsd.client.get("/metrics.json")).json()["requests"]["rejected"] == before + 1
    still = await apsd.client.post("/v1/messages", headers=TENANT,
                                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert still.status_code == 200   # (the daemon serves on)
