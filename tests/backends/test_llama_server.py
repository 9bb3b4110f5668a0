"""A real llama.cpp llama-server: what apsd's gateway tests will rely on, proven against the binary.

Each test starts its own server (~0.1 s) on a free loopback port and stops it by PID. Without the
binary the server tests skip, or fail when APSD_REQUIRE_BACKENDS=1 (CI): see tests/llama_server.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from httpx_sse import aconnect_sse
from prometheus_client.parser import text_string_to_metric_families

from tests import llama_server as ls
from tests.llama_server import (
    LlamaServer,
    LlamaServerError,
    llama_server,  # noqa: F401  (fixture)
    llama_server_binary,  # noqa: F401  (fixture)
    open_llama_server,
    require_llama_server,
    slow_llama_server,  # noqa: F401  (fixture)
    slow_model,  # noqa: F401  (fixture)
    tiny_model,  # noqa: F401  (fixture)
)

pytestmark = pytest.mark.timeout(60)

PROMPT = "Once upon a time"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


def client_for(server: LlamaServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=30)


async def post_json(server: LlamaServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with client_for(server) as client:
        response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def stream_events(client: httpx.AsyncClient, path: str, body: dict[str, Any], *,
                        limit: int) -> list[str]:
    """The ``data`` of every SSE event of a streamed POST; fails past ``limit`` events."""
    data: list[str] = []
    async with aconnect_sse(client, "POST", path, json=body) as source:
        assert source.response.status_code == 200, await source.response.aread()
        assert source.response.headers["content-type"].startswith("text/event-stream")
        async for event in source.aiter_sse():
            data.append(event.data)
            assert len(data) <= limit, f"more than {limit} events: {data[:3]}..."
    return data


async def scrape_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """llama-server's /metrics, parsed by prometheus_client: sample name -> value."""
    response = await client.get("/metrics")
    assert response.status_code == 200, response.text
    return {sample.name: sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples}


def assert_ascii_text(text: object) -> None:
    assert isinstance(text, str) and text, f"expected non-empty text, got {text!r}"
    assert text.isascii() and text.isprintable(), f"not plain printable ASCII: {text!r}"


# The server's surface


async def test_health_and_models_list_the_alias(llama_server: LlamaServer) -> None:
    async with client_for(llama_server) as client:
        health = await client.get("/health")
        models = await client.get("/v1/models")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == ["tiny"]


@pytest.mark.parametrize("max_tokens", [1, 17, 400])
async def test_completion_runs_to_max_tokens(llama_server: LlamaServer, max_tokens: int) -> None:
    body = await post_json(llama_server, "/v1/completions",
                           {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens})
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert_ascii_text(choice["text"])
    usage = body["usage"]
    assert usage["completion_tokens"] == max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + max_tokens
    # The prompt is counted as the server tokenizes it, BOS included.
    tokens = await post_json(llama_server, "/tokenize", {"content": PROMPT, "add_special": True})
    assert tokens["tokens"][0] == ls.BOS_ID
    assert usage["prompt_tokens"] == len(tokens["tokens"])


async def test_chat_completion_runs_to_max_tokens(llama_server: LlamaServer) -> None:
    body = await post_json(llama_server, "/v1/chat/completions",
                           {"model": "tiny", "messages": CHAT, "max_tokens": 23})
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["role"] == "assistant"
    assert_ascii_text(choice["message"]["content"])
    assert body["usage"]["completion_tokens"] == 23
    assert body["object"] == "chat.completion"


async def test_chat_stream_ends_with_a_usage_chunk_then_done(llama_server: LlamaServer) -> None:
    max_tokens = 31
    request = {"model": "tiny", "messages": CHAT, "max_tokens": max_tokens, "stream": True,
               "stream_options": {"include_usage": True}}
    async with client_for(llama_server) as client:
        data = await stream_events(client, "/v1/chat/completions", request, limit=max_tokens + 10)

    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    *deltas, finish, usage_chunk = chunks
    # OpenAI's shape: the usage chunk comes last, with no choices.
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == max_tokens
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + max_tokens
    assert [c["finish_reason"] for c in finish["choices"]] == ["length"]
    assert all("usage" not in c or c["usage"] is None for c in deltas)
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in deltas)
    assert_ascii_text(text)
    # Tokens arrive one by one: one content delta per generated token.
    assert sum(1 for c in deltas if c["choices"][0]["delta"].get("content")) == max_tokens


async def test_completion_stream_carries_usage_on_its_last_chunk(llama_server: LlamaServer) -> None:
    max_tokens = 12
    request = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
               "stream_options": {"include_usage": True}}
    async with client_for(llama_server) as client:
        data = await stream_events(client, "/v1/completions", request, limit=max_tokens + 10)

    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    with_usage = [c for c in chunks if c.get("usage")]
    assert with_usage == [chunks[-1]], "exactly one chunk, the last, carries usage"
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    finish_reasons = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finish_reasons == ["length"]
    assert_ascii_text("".join(ch["text"] for c in chunks for ch in c["choices"]))


async def test_metrics_count_requests_and_tokens(llama_server: LlamaServer) -> None:
    async with client_for(llama_server) as client:
        before = await scrape_metrics(client)
        assert before["llamacpp:requests_processing"] == 0
        assert before["llamacpp:requests_deferred"] == 0
        response = await client.post("/v1/completions",
                                     json={"model": "tiny", "prompt": PROMPT, "max_tokens": 40})
        assert response.status_code == 200, response.text
        after = await scrape_metrics(client)
    assert after["llamacpp:requests_processing"] == 0
    # A counter's sample keeps its _total suffix; prometheus_client names the family without it.
    predicted = "llamacpp:tokens_predicted_total"
    assert after[predicted] - before[predicted] == 40


async def test_two_streams_progress_together(slow_llama_server: LlamaServer) -> None:
    """Two slots: both streams are generating at once, and each gets tokens before the other ends."""
    max_tokens = 200  # 0.5-1.6 s each: far longer than a /metrics scrape
    log: list[tuple[str, str]] = []  # (stream, "token" | "end"), in arrival order
    first_token = {name: trio.Event() for name in ("a", "b")}
    usage: dict[str, int] = {}

    async def stream(name: str, client: httpx.AsyncClient) -> None:
        request = {"model": "slow", "messages": CHAT, "max_tokens": max_tokens, "stream": True,
                   "stream_options": {"include_usage": True}}
        async with aconnect_sse(client, "POST", "/v1/chat/completions", json=request) as source:
            assert source.response.status_code == 200
            async for event in source.aiter_sse():
                if event.data == "[DONE]":
                    break
                chunk = json.loads(event.data)
                if chunk.get("usage"):
                    usage[name] = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    log.append((name, "token"))
                    first_token[name].set()
                assert len(log) <= 2 * max_tokens + 10
        log.append((name, "end"))

    async with client_for(slow_llama_server) as client:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream, "a", client)
                nursery.start_soon(stream, "b", client)
                await first_token["a"].wait()
                await first_token["b"].wait()
                metrics = await scrape_metrics(client)
                assert metrics["llamacpp:requests_processing"] == 2, log[-5:]

    assert usage == {"a": max_tokens, "b": max_tokens}
    for name, other in (("a", "b"), ("b", "a")):
        assert log.count((name, "token")) == max_tokens
        assert log.index((name, "token")) < log.index((other, "end")), f"{name} waited for {other}"


# The official OpenAI client (sync, in a worker thread: its async client needs asyncio)


async def test_openai_client(llama_server: LlamaServer) -> None:
    def use_client() -> None:
        client = openai.OpenAI(base_url=f"{llama_server.url}/v1", api_key="sk-test",
                               max_retries=0, timeout=30)
        with client:
            assert [m.id for m in client.models.list()] == ["tiny"]

            chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=9)  # type: ignore[arg-type]
            assert chat.choices[0].finish_reason == "length"
            assert_ascii_text(chat.choices[0].message.content)
            assert chat.usage is not None and chat.usage.completion_tokens == 9

            completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5)
            assert completion.choices[0].finish_reason == "length"
            assert completion.usage is not None and completion.usage.completion_tokens == 5

            chunks = list(client.chat.completions.create(
                model="tiny", messages=CHAT, max_tokens=14, stream=True,  # type: ignore[arg-type]
                stream_options={"include_usage": True}))
            assert chunks[-1].choices == []
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 14
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
            assert_ascii_text("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))

    await trio.to_thread.run_sync(use_client)


# The helper itself


async def test_the_server_is_stopped_when_the_body_raises(llama_server_binary: str, tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="the body failed") as raised:
        async with open_llama_server(tiny_model, binary=llama_server_binary) as server:
            process = server.process
            assert process.returncode is None
            raise ValueError("the body failed")
    assert process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(server.pid, 0)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "llama-server log" in notes and "listening on" in notes


async def test_a_model_that_does_not_load_fails_with_the_log(llama_server_binary: str, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(LlamaServerError, match="exited with") as raised:
        async with open_llama_server(bogus, binary=llama_server_binary, startup_timeout=15):
            pytest.fail("the server should not have started")
    assert "gguf" in str(raised.value).lower()


def test_require_llama_server_fails_in_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path) -> None:
    monkeypatch.delenv(ls.BINARY_ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ls.find_llama_server() is None

    monkeypatch.delenv(ls.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="llama-server not found"):
        require_llama_server()
    monkeypatch.setenv(ls.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="forbids skipping"):
        require_llama_server()

    # An explicit path that is not there fails even outside CI, rather than falling back.
    monkeypatch.delenv(ls.REQUIRE_ENV)
    monkeypatch.setenv(ls.BINARY_ENV, str(tmp_path / "missing"))
    with pytest.raises(pytest.fail.Exception, match="not an executable"):
        require_llama_server()


def test_find_llama_server_prefers_env_then_path_then_cache(monkeypatch: pytest.MonkeyPatch,
                                                            tmp_path: Path) -> None:
    cached = tmp_path / "cache" / "apsd" / "llama-server" / "0.0.0-abc" / "llama-server"
    cached.parent.mkdir(parents=True)
    cached.write_text("#!/bin/sh\n")
    cached.chmod(0o755)
    on_path = tmp_path / "bin" / "llama-server"
    on_path.parent.mkdir()
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(ls.BINARY_ENV, raising=False)

    monkeypatch.setenv("PATH", str(tmp_path))
    assert ls.find_llama_server() == str(cached)
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert ls.find_llama_server() == str(on_path)
    monkeypatch.setenv(ls.BINARY_ENV, "/somewhere/llama-server")
    assert ls.find_llama_server() == "/somewhere/llama-server"
