"""OpenTelemetry traces (``[tracing]``, apsd/serve/tracing.py) exported by a real daemon to a real
OTLP/HTTP receiver started here (an HTTP server on a free loopback port; what arrives is decoded with
``opentelemetry-proto``), in front of a real llama.cpp ``llama-server`` and of the stand-in backend
(which records the ``traceparent`` apsd sends upstream). The official ``openai`` client sends a
``traceparent`` of its own, which apsd continues.

Without the SDK, enabling tracing is a configuration error that names the extra; with tracing off a
request carries no trace."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from apsd.core.config import ConfigError, TenantConfig, TracingConfig
from apsd.serve.tracing import Tracing
from tests.helpers import backends_up, forwarding_config, start_daemon, wait_until
from tests.llama_server import (  # noqa: F401  (fixtures)
    llama_server,
    llama_server_binary,
    tiny_model,
)
from tests.standin_backend import start_standin_backend, well_behaved
from tests.webhook_receiver import WebhookReceiver, open_webhook_receiver

pytestmark = pytest.mark.timeout(240)

TENANTS = {"t": TenantConfig(rate=1e6, burst=10**6), "tiny": TenantConfig(rate=1e-6, burst=20)}
#: OpenTelemetry's span kinds in OTLP (SERVER, CLIENT).
SERVER, CLIENT = 2, 3


def traced_config(urls: list[str], receiver: WebhookReceiver) -> Any:
    return forwarding_config(urls, TENANTS, sections={"tracing": {
        "enabled": True, "endpoint": receiver.url, "export_interval_s": 0.1}})


def spans_of(receiver: WebhookReceiver) -> Iterator[tuple[dict[str, Any], Any]]:
    """(resource attributes, span) of every span the receiver got."""
    for received in receiver.received:
        assert received.path == "/v1/traces" and received.headers["content-type"] == "application/x-protobuf"
        export = ExportTraceServiceRequest()
        export.ParseFromString(received.body)
        for resource_spans in export.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    yield resource, span


def attributes(pairs: Any) -> dict[str, Any]:
    values = {}
    for pair in pairs:
        value = pair.value
        values[pair.key] = getattr(value, value.WhichOneof("value"))
    return values


async def wait_for_spans(receiver: WebhookReceiver, servers: int) -> list[tuple[dict[str, Any], Any]]:
    """Every span received once ``servers`` SERVER spans (one per request) have arrived."""
    with trio.fail_after(30):
        while sum(span.kind == SERVER for _, span in spans_of(receiver)) < servers:
            await trio.sleep(0.05)
    return list(spans_of(receiver))


def traceparent() -> tuple[str, str, str]:
    """A client's ``traceparent`` header, its trace id and its span id (hex)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


async def test_a_request_through_apsd_to_llama_server_is_one_trace_with_the_genai_attributes(nursery, llama_server):
    async with open_webhook_receiver(path="/v1/traces", reply=b"", reply_type="application/x-protobuf") as receiver:
        running = await start_daemon(nursery, traced_config([llama_server.url], receiver))
        await wait_until(backends_up(running.daemon))
        header, trace_id, client_span = traceparent()
        client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                                    default_headers={"X-Apsd-Tenant": "t", "traceparent": header})
        whole = await client.chat.completions.create(model=llama_server.alias, max_tokens=8,
                                                     messages=[{"role": "user", "content": "Hello there"}])
        stream = await client.chat.completions.create(model=llama_server.alias, max_tokens=8, stream=True,
                                                      stream_options={"include_usage": True},
                                                      messages=[{"role": "user", "content": "Hello again"}])
        streamed = [chunk async for chunk in stream]
        usage = next(c.usage for c in streamed if c.usage is not None)
        refused = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0,
                                     default_headers={"X-Apsd-Tenant": "tiny"})
        with pytest.raises(openai.APIStatusError) as too_big:
            await refused.chat.completions.create(model=llama_server.alias, max_tokens=500,
                                                  messages=[{"role": "user", "content": "x " * 200}])
        assert too_big.value.status_code == 413
        spans = await wait_for_spans(receiver, 3)
        running.daemon.request_shutdown()

    resource = spans[0][0]
    assert resource["service.name"] == "apsd" and resource["service.version"]
    servers = [span for _, span in spans if span.kind == SERVER]
    ours = [span for span in servers if span.trace_id.hex() == trace_id]
    assert len(ours) == 2, "the client's traceparent is continued by both of its requests"
    assert all(span.parent_span_id.hex() == client_span for span in ours)
    for span, answer_usage in zip(sorted(ours, key=lambda s: s.start_time_unix_nano), (whole.usage, usage)):
        seen = attributes(span.attributes)
        assert span.name == f"chat {llama_server.alias}"
        assert seen["gen_ai.operation.name"] == "chat" and seen["gen_ai.request.model"] == llama_server.alias
        assert seen["gen_ai.request.max_tokens"] == 8 and isinstance(seen["gen_ai.response.model"], str)
        assert (seen["gen_ai.usage.input_tokens"], seen["gen_ai.usage.output_tokens"]) == (
            answer_usage.prompt_tokens, answer_usage.completion_tokens)
        assert seen["apsd.tenant"] == "t" and seen["apsd.route.backend"] == "b0" and seen["apsd.route.reason"]
        assert seen["http.response.status_code"] == 200 and "error.type" not in seen
        assert 0 <= seen["apsd.queue_wait_s"] < seen["gen_ai.response.time_to_first_chunk"] < 60
        assert seen["apsd.preemptions"] == 0
        children = {child.name: child for _, child in spans if child.parent_span_id == span.span_id}
        assert set(children) == {"apsd.queue", "apsd.attempt b0"}
        attempt = children["apsd.attempt b0"]
        assert attempt.kind == CLIENT and attempt.trace_id == span.trace_id
        assert span.start_time_unix_nano <= attempt.start_time_unix_nano <= attempt.end_time_unix_nano \
            <= span.end_time_unix_nano
        assert children["apsd.queue"].end_time_unix_nano <= attempt.start_time_unix_nano + 1
    (refusal,) = [span for span in servers if span.trace_id.hex() != trace_id]
    seen = attributes(refusal.attributes)
    assert seen["error.type"] == "exceeds_tenant_burst" and seen["http.response.status_code"] == 413
    assert seen["apsd.tenant"] == "tiny" and refusal.parent_span_id == b""
    assert not [child for _, child in spans if child.parent_span_id == refusal.span_id]   # (never queued)


async def test_the_attempt_upstream_carries_its_span_as_traceparent(nursery):
    """The stand-in records the ``traceparent`` apsd sent with the attempt: the attempt span's."""
    backend = await start_standin_backend(nursery, well_behaved, model="m")
    async with open_webhook_receiver(path="/v1/traces", reply=b"", reply_type="application/x-protobuf") as receiver:
        running = await start_daemon(nursery, traced_config([backend.url], receiver))
        await wait_until(backends_up(running.daemon))
        header, trace_id, _ = traceparent()
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as client:
            answer = await client.post("/v1/chat/completions", headers={"X-Apsd-Tenant": "t", "traceparent": header},
                                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 4})
            assert answer.status_code == 200, answer.text
        spans = await wait_for_spans(receiver, 1)
        running.daemon.request_shutdown()
    (attempt,) = [span for _, span in spans if span.kind == CLIENT]
    sent = [exchange.headers.get("traceparent") for exchange in backend.received
            if exchange.path == "/v1/chat/completions"]
    assert sent == [f"00-{trace_id}-{attempt.span_id.hex()}-01"]


def test_enabling_tracing_without_the_sdk_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)   # (as if the extra were not installed)
    with pytest.raises(ConfigError, match=r"pip install 'apsd\[tracing\]'"):
        Tracing.check(TracingConfig(enabled=True))
    Tracing.check(TracingConfig(enabled=False))   # (off: nothing is asked of the SDK)
    assert Tracing.start(TracingConfig(enabled=False), "0") is None


async def test_with_tracing_off_a_request_carries_no_trace(nursery):
    backend = await start_standin_backend(nursery, well_behaved, model="m")
    seen = []

    class Recorder:
        from apsd.core.hookspecs import hookimpl

        @hookimpl
        def request_finished(self, request: Any, outcome: Any) -> None:
            seen.append(request.trace)

    running = await start_daemon(nursery, forwarding_config([backend.url], TENANTS), plugins=(Recorder(),))
    await wait_until(backends_up(running.daemon))
    assert running.daemon.tracing is None
    answer = await running.client.post("/v1/chat/completions", headers={"X-Apsd-Tenant": "t"},
                                       json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200 and seen == [None]
    running.daemon.request_shutdown()
