"""Anthropic's Messages API through the forward engine, in virtual time against simulated servers that
speak ``/v1/messages`` as llama.cpp does (their token ``i`` reads `` t<i>``, so a resumed answer shows
any text lost or repeated): the events relayed, the usage charged, a preempted stream resumed with its
client seeing one message, and backends that do not serve the API."""

from __future__ import annotations

import contextlib

import attrs
import pytest
import trio
import trio.testing

from apsd.core.clock import ModelClock
from apsd.core.config import ForwardConfig, TenantConfig, parse_config
from apsd.core.models import Completion, InferenceRequest, Refusal
from apsd.core.streams import TokenStream
from apsd.engines.backends import (
    Backend,
    BackendChunk,
    BackendError,
    SimulatedBackendClient,
    SimulatedServer,
    UsageBounds,
)
from apsd.engines.preemption import resumable
from apsd.engines.relay import Progress, StreamRelay, continuation, prefill_text
from apsd.pipeline import open_pipeline
from tests.helpers import build_policies


def config_for(servers, *, tenants=("flood", "steady"), **forward):
    config = parse_config({"policy": {"preset": "fair"},
                           "backends": [{"url": f"http://{name}.test", "name": name,
                                         "max_concurrency": server.slots} for name, server in servers.items()]},
                          "<test>")
    settings = {"health_interval_s": 1.0, "metrics_interval_s": 0.1, **forward}
    return attrs.evolve(config, forward=ForwardConfig(**settings),
                        tenants={t: TenantConfig(rate=1e9, burst=10**9) for t in tenants})


@contextlib.asynccontextmanager
async def forwarding(servers, **settings):
    config = config_for(servers, **settings)
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), servers)) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        await pipeline.clock.sleep(0.01)
        yield pipeline


MESSAGES = [{"role": "user", "content": "hello"}]


def message(pipeline, tenant, tokens, *, stream=True, messages=MESSAGES, **body):
    r = pipeline.new_request(tenant_id=tenant, prompt="hello", tokens_requested=tokens, priority_bid=5, model="sim",
                             api="messages", payload={"model": "sim", "max_tokens": tokens, "messages": messages,
                                                      **body})
    if stream:
        r.stream = TokenStream(max_chunks=10**6)
    return r


def admitted(pipeline, request):
    assert pipeline.admit_now(request)
    return request


def events_of(request) -> list[dict]:
    """The events the request's client received, drained from its stream."""
    return [chunk.data for chunk in request.stream.receive_ready() if chunk.data is not None]


def text_in(events) -> str:
    return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")


def expected(tokens: int) -> str:
    return "".join(f" t{i}" for i in range(tokens))


async def test_a_whole_message_is_relayed_and_charged_the_backends_usage(autojump_clock):
    servers = {"a": SimulatedServer(slots=2)}
    async with forwarding(servers) as pipeline:
        r = admitted(pipeline, message(pipeline, "steady", 12, stream=False, system="be brief"))
        outcome = await r.reply.wait()
    assert isinstance(outcome, Completion)
    body = servers["a"].bodies[0]
    assert body["max_tokens"] == 12 and body["stream"] is False and body["system"] == "be brief"
    answer = outcome.response
    assert answer["type"] == "message" and answer["content"][0]["text"] == expected(12)
    assert (outcome.prompt_tokens, outcome.tokens_generated) == (answer["usage"]["input_tokens"], 12)
    books = pipeline.ledger.tenants["steady"]
    assert (books.prompt_tokens, books.generated_tokens) == (answer["usage"]["input_tokens"], 12)


async def test_a_streamed_message_relays_every_event_in_order_and_counts_its_tokens_as_they_come(autojump_clock):
    servers = {"a": SimulatedServer(slots=2, ttft_s=0.05, tpot_s=0.01)}
    async with forwarding(servers) as pipeline:
        r = admitted(pipeline, message(pipeline, "steady", 40))
        await pipeline.clock.sleep(0.05 + 0.01 * 20)
        assert 0 < r.tokens_generated < 40   # (counted per content_block_delta, while it streams)
        outcome = await r.reply.wait()
    events = events_of(r)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert text_in(events) == expected(40)
    usage = events[0]["message"]["usage"]
    assert isinstance(outcome, Completion) and outcome.prompt_tokens == usage["input_tokens"]
    assert outcome.tokens_generated == events[-2]["usage"]["output_tokens"] == 40
    assert servers["a"].bodies[0]["stream"] is True and "stream_options" not in servers["a"].bodies[0]


async def test_a_preempted_message_stream_resumes_as_one_message_with_no_text_lost_or_repeated(autojump_clock):
    """A flood's message streams hold every slot; steady requests take slots one after another. Each
    flood stream paused is resumed on the same llama.cpp server from its own text: its client sees one
    message_start, one start of its text block, its text whole and in order, and a final usage that
    counts the whole request (the first prompt, every output token); it is charged once."""
    servers = {"a": SimulatedServer(slots=2, ttft_s=0.05, tpot_s=0.02)}
    async with forwarding(servers) as pipeline:
        floods = [admitted(pipeline, message(pipeline, "flood", 200)) for _ in range(4)]
        await pipeline.clock.sleep(1.0)
        for _ in range(3):
            steady = admitted(pipeline, message(pipeline, "steady", 5))
            assert isinstance(await steady.reply.wait(), Completion)
            await pipeline.clock.sleep(0.5)
        outcomes = [await r.reply.wait() for r in floods]
        engine = pipeline.engines[0]
    assert engine.preemptions[("a", "resumed")] >= 3 and servers["a"].bad_continuations == 0
    resumed = [r for r in floods if r.preemptions]
    assert resumed
    for r, outcome in zip(floods, outcomes):
        events = events_of(r)
        kinds = [e["type"] for e in events]
        assert kinds.count("message_start") == 1 and kinds.count("content_block_start") == 1, kinds
        assert kinds.count("message_stop") == 1 and kinds[-1] == "message_stop"
        assert kinds.count("ping") == 1   # (the first attempt's; a resumed attempt's are dropped)
        assert text_in(events) == expected(200)
        first_usage = events[0]["message"]["usage"]
        assert events[-2]["usage"]["output_tokens"] == 200
        assert isinstance(outcome, Completion) and outcome.tokens_generated == 200
        assert outcome.prompt_tokens == first_usage["input_tokens"]   # (the first prompt, not a continuation's)
    for r in resumed:   # each continuation: the text so far as a final assistant message, the rest of the limit
        continued = [b for b in servers["a"].bodies if b["messages"][-1]["role"] == "assistant"]
        assert continued and all(b["max_tokens"] < 200 for b in continued)
    books = pipeline.ledger.tenants["flood"]
    assert books.generated_tokens == 4 * 200 and books.prompt_tokens == sum(r.prompt_tokens for r in floods)


async def test_a_message_stream_on_vllm_is_never_paused_once_started(autojump_clock):
    """vLLM's /v1/messages starts a new turn after a final assistant message, so it cannot continue a
    paused message: a started message stream there runs to its end, and the newcomer waits for a slot."""
    servers = {"a": SimulatedServer(slots=1, ttft_s=0.01, tpot_s=0.01, server="vllm")}
    async with forwarding(servers) as pipeline:
        flood = admitted(pipeline, message(pipeline, "flood", 300))
        await pipeline.clock.sleep(1.0)
        steady = admitted(pipeline, message(pipeline, "steady", 5))
        assert isinstance(await steady.reply.wait(), Completion)
        assert isinstance(await flood.reply.wait(), Completion)
        assert sum(pipeline.engines[0].preemptions.values()) == 0
    assert steady.dispatched_at - steady.arrival > 1.5 and text_in(events_of(flood)) == expected(300)


async def test_a_paused_message_stream_waits_for_a_server_that_can_continue_it(autojump_clock):
    """A llama.cpp server and a vLLM one, a flood stream on each: the steady tenant's request takes the
    llama.cpp one's slot (vLLM's stream cannot be paused). When vLLM's slot frees first, the paused
    stream does not go there (vLLM could not continue it): it resumes on llama.cpp once that has room."""
    servers = {"l": SimulatedServer(slots=1, ttft_s=0.01, tpot_s=0.01),
               "v": SimulatedServer(slots=1, ttft_s=0.01, tpot_s=0.01, server="vllm")}
    async with forwarding(servers) as pipeline:
        floods = [admitted(pipeline, message(pipeline, "flood", 300)) for _ in range(2)]
        await pipeline.clock.sleep(1.0)
        steady = admitted(pipeline, message(pipeline, "steady", 250))
        for r in [steady, *floods]:
            assert isinstance(await r.reply.wait(), Completion)
    paused = [r for r in floods if r.preemptions]
    assert len(paused) == 1 and paused[0].backend == "l" and steady.backend == "l"
    assert paused[0].finished_at > steady.finished_at   # (it waited for llama.cpp, though vLLM freed first)
    assert servers["l"].bad_continuations == 0 and all(text_in(events_of(r)) == expected(300) for r in floods)
    assert not any(b["messages"][-1]["role"] == "assistant" for b in servers["v"].bodies)


async def test_a_clients_own_prefill_is_continued_not_repeated(autojump_clock):
    """The client ends its messages with its own assistant prefill, which llama.cpp echoes at the start
    of the answer: a resumed attempt continues the text the client has (which starts with that prefill),
    not the prefill followed by it again."""
    prefill = [*MESSAGES, {"role": "assistant", "content": "Sure:"}]
    servers = {"a": SimulatedServer(slots=2, ttft_s=0.05, tpot_s=0.02)}
    async with forwarding(servers) as pipeline:
        floods = [admitted(pipeline, message(pipeline, "flood", 150, messages=prefill)) for _ in range(2)]
        await pipeline.clock.sleep(1.0)
        steady = admitted(pipeline, message(pipeline, "steady", 5))
        assert isinstance(await steady.reply.wait(), Completion)
        for flood in floods:
            assert isinstance(await flood.reply.wait(), Completion)
    assert sum(flood.preemptions for flood in floods) == 1 and servers["a"].bad_continuations == 0
    for flood in floods:
        assert text_in(events_of(flood)) == "Sure:" + expected(150)
    resumed = [b for b in servers["a"].bodies if b["messages"][-1]["content"].startswith("Sure: t0")]
    assert len(resumed) == 1


def test_a_continuation_replaces_an_echoed_prefill_and_extends_one_that_was_not():
    request = InferenceRequest("r", "t", 1, 100, 5, api="messages")
    request.tokens_generated = 30
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "q"},
                                                          {"role": "assistant", "content": "Sure:"}]}
    echoed = continuation("messages", body, "Sure: and so", request, "llama.cpp", echoed=True)
    assert echoed["messages"][-1] == {"role": "assistant", "content": "Sure: and so"} and echoed["max_tokens"] == 70
    assert prefill_text(echoed) == "Sure: and so"
    chat = {**body, "max_tokens": 100}
    assert continuation("chat.completions", chat, " and so", request, "vllm")["messages"][-1]["content"] \
        == "Sure: and so"
    # (a first attempt on a server that did not echo, resumed on one that does: the prefill is kept)
    assert continuation("messages", body, " Sure: x", request, "llama.cpp")["messages"][-1]["content"] \
        == "Sure: Sure: x"
    assert continuation("messages", body, "x", request, "vllm") is None   # (vLLM's /v1/messages cannot)
    assert continuation("messages", {**body, "messages": body["messages"][:1]}, "x", request, "llama.cpp")[
        "messages"][-1] == {"role": "assistant", "content": "x"}


@pytest.mark.parametrize("body, stream, ok", [
    ({}, True, True), ({}, False, False), ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, True, False),
    ({"thinking": {"type": "disabled"}}, True, True), ({"tool_choice": {"type": "any"}}, True, False),
    ({"tool_choice": {"type": "auto"}, "tools": [{"name": "f", "input_schema": {}}]}, True, True),
    ({"output_format": {"type": "json_schema", "schema": {}}}, True, False)])
def test_which_message_streams_can_be_resumed(body, stream, ok):
    r = InferenceRequest("r", "t", 1, 10, 5, api="messages", payload={"messages": MESSAGES, **body})
    r.stream = TokenStream() if stream else None
    assert resumable(r) is ok


def relay_for(progress, unresumable=lambda: None):
    request = InferenceRequest("r", "t", 1, 100, 5, api="messages")
    request.stream = TokenStream(max_chunks=1000)
    starts = []
    relay = StreamRelay(request, "b", True, lambda r, at: (starts.append(at), setattr(r, "started_at", at)),
                        lambda: 1.0, progress, unresumable)
    return request, relay


def event(kind, **fields):
    return BackendChunk({"type": kind, **fields})


def delta(text, kind="text_delta"):
    return event("content_block_delta", index=0, delta={"type": kind, **({"text": text} if kind == "text_delta"
                                                                           else {"thinking": text})})


def test_a_tool_use_block_or_the_answers_end_makes_a_message_stream_unresumable():
    """A continuation of the text could not carry a tool call on; after the last block there is nothing
    left to resume."""
    for last in (event("content_block_start", index=1, content_block={"type": "tool_use", "id": "t", "name": "f",
                                                                      "input": {}}),
                 event("content_block_stop", index=0), delta("x", "thinking_delta")):
        calls = []
        progress = Progress(api="messages")
        request, relay = relay_for(progress, lambda: calls.append(1))
        relay(event("message_start", message={"usage": {"input_tokens": 7, "cache_read_input_tokens": 5}}))
        relay(event("content_block_start", index=0, content_block={"type": "text", "text": ""}))
        relay(delta("hello"))
        assert progress.resumable and not calls and progress.prompt_tokens == 12 and progress.blocks == {0}
        relay(last)
        assert not progress.resumable and calls == [1]


def test_a_resumed_attempts_events_are_stitched_onto_the_first():
    """No second message_start, content_block_start of the block in progress or ping; the echoed prefill
    dropped however the server splits it; the final usage is the whole request's."""
    progress = Progress(api="messages", resumed=1, message_usage={"input_tokens": 7, "cache_read_input_tokens": 5,
                                                                  "output_tokens": 0}, blocks={0})
    request, relay = relay_for(progress)
    request.started_at, request.tokens_generated = 0.5, 3
    relay.echo = "Sure: a b"
    relay.__attrs_post_init__()
    for chunk in (event("message_start", message={"usage": {"input_tokens": 2, "cache_read_input_tokens": 20}}),
                  event("content_block_start", index=0, content_block={"type": "text", "text": ""}), event("ping"),
                  delta("Sure:"), delta(" a b c"), delta(" d"), event("content_block_stop", index=0),
                  event("message_delta", delta={"stop_reason": "end_turn"},
                        usage={"input_tokens": 22, "output_tokens": 2}), event("message_stop")):
        relay(chunk)
    sent = [c.data for c in request.stream.receive_ready()]
    assert [e["type"] for e in sent] == ["content_block_delta", "content_block_delta", "content_block_stop",
                                         "message_delta", "message_stop"]
    assert "".join(e["delta"]["text"] for e in sent[:2]) == " c d"
    assert sent[3]["usage"] == {"input_tokens": 7, "output_tokens": 5}
    assert request.tokens_generated == 5   # (3 before, and a token per delta with new text)


# -- backends that do not serve /v1/messages -----------------------------------------------------------

async def test_a_model_no_backend_of_which_serves_messages_is_refused_404_at_once(autojump_clock):
    servers = {"a": SimulatedServer(slots=2, messages=False, server="sglang")}
    async with forwarding(servers) as pipeline:
        r = message(pipeline, "steady", 5)
        assert not pipeline.admit_now(r)
        chat = pipeline.new_request(tenant_id="steady", prompt="x", tokens_requested=5, priority_bid=5, model="sim",
                                    api="chat.completions", payload={"model": "sim", "messages": MESSAGES})
        assert pipeline.admit_now(chat) and isinstance(await chat.reply.wait(), Completion)
    outcome = r.reply.outcome
    assert isinstance(outcome, Refusal) and (outcome.status, outcome.error) == (404, "unsupported_api")
    assert "a (sglang)" in outcome.message and len(servers["a"].bodies) == 1   # (the chat's only)


async def test_in_a_mixed_pool_messages_go_only_to_backends_that_serve_them(autojump_clock):
    """Two backends serve the model, one of them not /v1/messages: every message runs on the other, chat
    on both; messages waiting while only the other has room do not make the engine spin."""
    servers = {"plain": SimulatedServer(slots=2, messages=False, server="sglang"),
               "full": SimulatedServer(slots=1, ttft_s=0.01, tpot_s=0.01)}
    async with forwarding(servers) as pipeline:
        sent = [admitted(pipeline, message(pipeline, "steady", 50, metadata={"user_id": "agent"})) for _ in range(4)]
        chats = [pipeline.new_request(tenant_id="flood", prompt="x", tokens_requested=50, priority_bid=5, model="sim",
                                      api="chat.completions", payload={"model": "sim", "messages": MESSAGES})
                 for _ in range(4)]
        for chat in chats:
            assert pipeline.admit_now(chat)
        for r in [*sent, *chats]:
            assert isinstance(await r.reply.wait(), Completion)
        engine = pipeline.engines[0]
    assert all(r.backend == "full" for r in sent) and {r.backend for r in chats} == {"plain", "full"}
    assert not any("metadata" in b for b in servers["plain"].bodies)
    assert sum("metadata" in b for b in servers["full"].bodies) == 4
    assert engine._dispatches < 100   # (no spin: each dispatch either placed a request or waited for a change)


# -- usage ---------------------------------------------------------------------------------------------

def test_an_anthropic_usage_counts_the_cache_in_the_prompt_and_bounds_every_figure():
    backend = Backend(config=parse_config({"backends": [{"url": "http://x.test"}]}, "<t>").backends[0])
    body = {"model": "m", "max_tokens": 10, "messages": MESSAGES}
    bounds = UsageBounds.of("messages", body, b'{"model": "m", "max_tokens": 10, "messages": []}' + b" " * 100)
    assert bounds.check(backend, {"input_tokens": 3, "cache_read_input_tokens": 50, "output_tokens": 10}) == (53, 10)
    assert bounds.check(backend, {"input_tokens": 3, "cache_creation_input_tokens": 4, "output_tokens": 1}) == (7, 1)
    for bad in ({"input_tokens": -1, "output_tokens": 1}, {"input_tokens": 1, "output_tokens": 11},
                {"input_tokens": 1, "cache_read_input_tokens": 10**6, "output_tokens": 1},
                {"input_tokens": 1000, "cache_read_input_tokens": 1000, "output_tokens": 1}):
        with pytest.raises(BackendError) as raised:
            bounds.check(backend, bad)
        assert raised.value.code == "backend_invalid_usage"
