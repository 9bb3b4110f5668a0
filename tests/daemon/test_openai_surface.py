"""The rest of the OpenAI surface clients use, through apsd with the official client: embeddings
(charged on their input) and responses, whole and streamed (charged on their usage), against a real
llama.cpp server; image parts passed through and ``X-Request-Id`` end to end, against the stand-in
backend that records what it received; and a clear answer where the engine cannot serve them."""

from __future__ import annotations

import pytest
import trio

from apsd.core.config import ServerConfig, TenantConfig
from tests.helpers import (
    FAST_GPU,
    backends_up,
    bucket_level,
    forwarding_config,
    make_config,
    openai_client,
    start_daemon,
    wait_until,
)
from tests.llama_server import (  # noqa: F401  (fixtures)
    llama_server_binary,
    open_llama_server,
    tiny_model,
)
from tests.standin_backend import start_standin_backend

pytestmark = pytest.mark.timeout(90)

BURST = 10**9
TENANTS = {"t": TenantConfig(rate=1e-6, burst=BURST)}


def forwarding_to(url: str):
    return forwarding_config([url], TENANTS, metrics_interval_s=0.2)


def charged(daemon) -> float:
    return BURST - bucket_level(daemon, "t")


async def test_embeddings_and_responses_through_apsd_to_llama_cpp(nursery, llama_server_binary, tiny_model, tmp_path):
    async with open_llama_server(tiny_model, binary=llama_server_binary, log_dir=tmp_path,
                                 extra_args=("--embeddings", "--pooling", "mean")) as server:
        running = await start_daemon(nursery, forwarding_to(server.url))
        daemon = running.daemon
        await wait_until(backends_up(daemon))

        def embed():
            return openai_client(running.url).embeddings.create(model="tiny", input=["Hello there", "General Kenobi"])

        embedded = await trio.to_thread.run_sync(embed)
        assert len(embedded.data) == 2 and len(embedded.data[0].embedding) > 0
        assert embedded.usage.prompt_tokens > 0
        assert charged(daemon) == pytest.approx(embedded.usage.prompt_tokens)   # its input, nothing generated
        status = daemon.pipeline.tenant_status("t")
        assert status.completed == 1 and status.generated_tokens == 0

        def respond():
            client = openai_client(running.url)
            whole = client.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=5)
            events = list(client.responses.create(model="tiny", input=[{"role": "user", "content": "Go on."}],
                                                  instructions="Be brief.", max_output_tokens=4, stream=True))
            return whole, events

        spent = charged(daemon)
        whole, events = await trio.to_thread.run_sync(respond)
        assert whole.usage.output_tokens == 5 and whole.output_text
        deltas = [e for e in events if e.type == "response.output_text.delta"]
        completed = events[-1]
        assert completed.type == "response.completed" and len(deltas) == 4
        assert completed.response.usage.output_tokens == 4
        usage = [whole.usage, completed.response.usage]
        assert charged(daemon) - spent == pytest.approx(sum(u.input_tokens + u.output_tokens for u in usage))
        status = daemon.pipeline.tenant_status("t")
        assert status.completed == 3 and status.generated_tokens == 9
        daemon.request_shutdown()


async def test_image_parts_and_the_request_id_reach_the_backend(nursery):
    backend = await start_standin_backend(nursery, model="vision")
    running = await start_daemon(nursery, forwarding_to(backend.url))
    await wait_until(backends_up(running.daemon))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}

    def ask():
        client = openai_client(running.url)
        return client.chat.completions.with_raw_response.create(
            model="vision", max_tokens=3, extra_headers={"X-Request-Id": "trace-42"},
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])

    raw = await trio.to_thread.run_sync(ask)
    assert raw.headers["x-request-id"] == "trace-42"
    assert raw.parse().choices[0].message.content
    sent = [e for e in backend.received if e.path == "/v1/chat/completions"][-1]
    assert sent.json["messages"][0]["content"][1] == image                     # passed through as sent
    assert sent.headers["x-request-id"] == "trace-42"                          # and named upstream
    running.daemon.request_shutdown()


async def test_embeddings_need_an_engine_that_relays_to_servers(nursery):
    running = await start_daemon(nursery, make_config(
        server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=2.0), gpu=FAST_GPU, tenants=TENANTS))
    async with running.client as client:
        answer = await client.post("/v1/embeddings", json={"model": "apsd-batch", "input": "x"},
                                   headers={"X-Apsd-Tenant": "t"})
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "unsupported_api"
        assert "[[backends]]" in answer.json()["error"]["message"]
    running.daemon.request_shutdown()
