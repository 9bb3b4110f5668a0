"""Anthropic's Messages API through apsd to a real llama.cpp ``llama-server``, with the official
``anthropic`` client: whole and streamed messages charged exactly the server's usage (its cache reads at
the cached-prompt discount), ``count_tokens`` answered by the server and never charged, the server's
and apsd's refusals in Anthropic's shape, a client that leaves charged what ran, and a preempted greedy
stream that reads as the uninterrupted one. Real HTTP both ways, real processes, stopped by their PIDs.

vLLM serves ``/v1/messages`` too: its tests are in ``tests/backends/test_vllm.py`` (they share its servers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anthropic
import attrs
import httpx
import pytest
import trio

from apsd.core.config import TenantConfig
from tests.helpers import backends_up, bucket_level, forwarding_config, start_daemon, wait_until
from tests.llama_server import (  # noqa: F401  (fixtures)
    CHARACTER_PIECES,
    SLOW_MODEL,
    llama_server,
    llama_server_binary,
    open_llama_server,
    slow_model,
    tiny_model,
    write_tiny_model,
)
from tests.real_pool import open_pool

pytestmark = pytest.mark.timeout(240)

BURST = 10**9
#: Buckets that hold far more than the tests use and do not refill during a test: what is missing from
#: one at the end is exactly what its requests were charged.
TENANTS = {"t": TenantConfig(rate=1e-6, burst=BURST), "small": TenantConfig(rate=1e-6, burst=300)}
DISCOUNT = 0.5
SYSTEM = "You answer in one short line."
HELLO = [{"role": "user", "content": "Hello there, how are you?"}]


def client(url: str, tenant: str = "t") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", default_headers={"X-Apsd-Tenant": tenant},
                               max_retries=0, timeout=60)


async def in_thread(function: Any) -> Any:
    with trio.fail_after(120):
        return await trio.to_thread.run_sync(function)


async def gateway(nursery: trio.Nursery, url: str, **forward: Any) -> Any:
    config = forwarding_config([url], TENANTS, **forward)
    config = attrs.evolve(config, admission=attrs.evolve(config.admission, cached_prompt_discount=DISCOUNT))
    running = await start_daemon(nursery, config)
    await wait_until(backends_up(running.daemon, 1))
    return running


def prompt_of(usage: Any) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


async def test_the_anthropic_client_through_apsd_to_llama_cpp_is_charged_exactly_the_servers_usage(
        nursery, llama_server):
    running = await gateway(nursery, llama_server.url)
    assert running.daemon.pipeline.engines[0].backends[0].messages is True   # (asked of the server)

    def run() -> tuple[list[Any], list[str], list[str]]:
        c = client(running.url)
        usages, texts, streamed = [], [], []
        whole = c.messages.create(model="tiny", max_tokens=9, system=SYSTEM, messages=HELLO)
        usages.append(whole.usage)
        texts.append(whole.content[0].text)
        for _ in range(2):   # (the same prompt twice: the second finds it in the server's prefix cache)
            with c.messages.stream(model="tiny", max_tokens=11, system=SYSTEM, messages=HELLO) as stream:
                streamed.append("".join(stream.text_stream))
                final = stream.get_final_message()
            usages.append(final.usage)
            texts.append(final.content[0].text)
        return usages, texts, streamed

    usages, texts, streamed = await in_thread(run)
    assert [u.output_tokens for u in usages] == [9, 11, 11]   # (the tiny model never stops early)
    assert texts[1:] == streamed
    prompt = sum(prompt_of(u) for u in usages)
    cached = [u.cache_read_input_tokens or 0 for u in usages]
    charged = prompt - sum(int(c * DISCOUNT) for c in cached) + 9 + 11 + 11
    status = (await running.client.get("/tenants/t/status")).json()
    print(f"usage seen by the client: {[(u.input_tokens, u.cache_read_input_tokens, u.output_tokens) for u in usages]}"
          f"; charged {BURST - bucket_level(running.daemon, 't'):.0f}, expected {charged}")
    assert any(cached), "the repeated prompt should have been read from llama.cpp's prefix cache"
    assert status["prompt_tokens"] == prompt and status["generated_tokens"] == 31 and status["completed"] == 3
    assert BURST - bucket_level(running.daemon, "t") == pytest.approx(charged, abs=1)
    running.daemon.request_shutdown()


async def test_count_tokens_is_the_servers_own_count_and_is_never_charged(nursery, llama_server):
    running = await gateway(nursery, llama_server.url)
    ask = {"model": "tiny", "system": SYSTEM, "messages": HELLO}
    async with httpx.AsyncClient(base_url=llama_server.url, timeout=30) as direct:
        own = (await direct.post("/v1/messages/count_tokens", json=ask)).json()["input_tokens"]
    before = bucket_level(running.daemon, "t")

    def run() -> tuple[int, Any]:
        c = client(running.url)
        counted = c.messages.count_tokens(**ask).input_tokens
        return counted, c.messages.create(max_tokens=1, **ask)

    counted, sent = await in_thread(run)
    assert counted == own == prompt_of(sent.usage)
    charged = before - bucket_level(running.daemon, "t")
    assert charged == pytest.approx(prompt_of(sent.usage) - int((sent.usage.cache_read_input_tokens or 0) * DISCOUNT)
                                    + 1, abs=1)   # (the message only)
    running.daemon.request_shutdown()


async def test_refusals_of_the_server_and_of_apsd_reach_the_client_in_anthropics_shape(nursery, llama_server):
    running = await gateway(nursery, llama_server.url)

    def run() -> list[Any]:
        caught = []
        for tenant, kwargs in [
                ("t", {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "9 " * 3000}]}),
                ("t", {"model": "elsewhere", "max_tokens": 5, "messages": HELLO}),
                ("small", {"model": "tiny", "max_tokens": 5,   # (a prompt beyond the burst: never admitted)
                           "messages": [{"role": "user", "content": "9 " * 400}]})]:
            with pytest.raises(anthropic.APIStatusError) as raised:
                client(running.url, tenant).messages.create(**kwargs)
            caught.append(raised.value)
        return caught

    too_long, no_model, too_large = await in_thread(run)
    assert isinstance(too_long, anthropic.BadRequestError) and "exceeds the available context size" in too_long.message
    assert too_long.body["error"]["details"]["error_code"] == "backend_rejected"
    assert isinstance(no_model, anthropic.NotFoundError)
    assert no_model.body["error"]["details"]["error_code"] == "model_not_found"
    assert too_large.status_code == 413 and too_large.body["error"]["type"] == "request_too_large"
    assert too_large.response.headers["RateLimit-Policy"].startswith('"tokens";q=300;')
    status = (await running.client.get("/tenants/t/status")).json()   # (the server refused it before any token:
    assert (status["failed"], status["prompt_tokens"], status["generated_tokens"]) == (1, 0, 0)   # nothing charged)
    assert bucket_level(running.daemon, "t") == pytest.approx(BURST, abs=1)
    running.daemon.request_shutdown()


async def test_a_client_that_leaves_a_message_stream_is_charged_the_servers_prompt_and_what_arrived(
        nursery, llama_server_binary, slow_model, tmp_path):
    """The client reads a few events of a long stream and leaves: the request is cancelled upstream, and
    its tenant is charged the server's own count of the prompt and the tokens that had arrived."""
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path,
                                 parallel=2) as server:
        running = await gateway(nursery, server.url, max_concurrency=2)
        ask = {"model": "slow", "system": SYSTEM, "messages": HELLO}
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as direct:
            own = (await direct.post("/v1/messages/count_tokens", json=ask)).json()["input_tokens"]
        read = 0
        async with running.client.stream("POST", "/v1/messages", headers={"X-Apsd-Tenant": "t"},
                                         json={**ask, "max_tokens": 3000, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                read += line == "event: content_block_delta"
                if read == 20:
                    break
        await wait_until(lambda: running.daemon.pipeline.ledger.tenants["t"].cancelled == 1)
        books = running.daemon.pipeline.ledger.tenants["t"]
        assert books.prompt_tokens == own and 20 <= books.generated_tokens < 3000
        assert BURST - bucket_level(running.daemon, "t") == pytest.approx(own + books.generated_tokens, abs=1)
        running.daemon.request_shutdown()


async def test_a_preempted_greedy_message_stream_reads_as_the_uninterrupted_one(llama_server_binary, tmp_path):
    """A model whose vocabulary is single characters (so the text so far tokenizes back into the same
    tokens), greedy decoding: the flood's message streams, preempted for the steady tenant and resumed on
    llama.cpp (which continues the final assistant message and echoes it first), read exactly as the same
    requests answered alone by the server, and each has one message_start and a final usage counting
    every output token."""
    model = write_tiny_model(Path(tmp_path) / "chars.gguf", vocab_pieces=CHARACTER_PIECES, **SLOW_MODEL)
    asks = [{"model": "chars", "max_tokens": 300, "temperature": 0.0, "stream": True,
             "messages": [{"role": "user", "content": f"tell me about the number {i}"}]} for i in range(2)]
    async with open_llama_server(model, alias="chars", binary=llama_server_binary, parallel=2,
                                 log_dir=tmp_path) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as direct:
            alone = [(await stream_message(direct, "-", ask))[0] for ask in asks]
        async with open_pool(server.url, "chars", slots=2) as pool:
            apsd = pool.clients[0]
            answers: list[Any] = [None, None]

            async def flood(i: int) -> None:
                answers[i] = await stream_message(apsd, "flood", asks[i])

            async with trio.open_nursery() as nursery:
                for i in range(2):
                    nursery.start_soon(flood, i)
                await trio.sleep(1.5)
                for _ in range(3):
                    await stream_message(apsd, "steady", {**asks[0], "max_tokens": 8})
                    await trio.sleep(0.3)
            resumed = pool.engines[0].preemptions[("b0", "resumed")]
    assert resumed >= 1
    assert [text for text, _ in answers] == alone
    for _, events in answers:
        names = [e["type"] for e in events]
        assert names.count("message_start") == 1 and names.count("content_block_start") == 1
        assert names[-1] == "message_stop" and events[-2]["usage"]["output_tokens"] == 300


async def stream_message(client: httpx.AsyncClient, tenant: str, body: dict) -> tuple[str, list[dict]]:
    """Stream one message as ``tenant``: (its text, every event)."""
    import json
    events = []
    async with client.stream("POST", "/v1/messages", json=body, headers={"X-Apsd-Tenant": tenant}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    return text, events
