"""What the forward engine sends a backend for a request, and how it relays what comes back.

* :func:`request_body`: the client's body (OpenAI's, or Anthropic's for ``messages``) as it came
  (parameters apsd does not interpret pass through untouched), its output limit set to what admission
  reserved under every name the client gave it by (``max_tokens``, llama.cpp's ``n_predict``,
  ``max_new_tokens``; a client that gave none gets none: the backend decides, the tenant pays what
  ran), the model set, and ``priority`` for a backend configured for it (:func:`priority_for`). An
  OpenAI stream always asks the backend for usage (``stream_options.include_usage``); the usage chunk
  reaches the client only if it asked for it. An Anthropic stream carries its usage in its
  ``message_start`` and ``message_delta`` events, always relayed.
* :func:`continuation`: the body that resumes a preempted request from the text it had produced:
  chat and messages, the conversation with that text as a final assistant message, which the server
  continues (llama.cpp's assistant prefill, on both APIs; ``continue_final_message`` on vLLM and
  SGLang, chat only: vLLM's ``/v1/messages`` starts a new turn after a final assistant message, so a
  started messages stream there is never resumed); text completions, the prompt followed by that
  text. Its output limit is what was left. A server that echoes the prefill (llama.cpp) has already
  streamed the client's own prefill as the start of the text so far, so that text replaces it.
* :class:`StreamRelay`: each chunk of a backend's stream, counted and handed to the client's stream
  without waiting for the client (a slow reader only delays itself; the backend's slot is freed at
  the backend's pace). A resumed attempt's chunks are stitched onto the first attempt's, so the client
  sees a pause and nothing else: the server's echo of the prefill dropped; for OpenAI chunks the same
  ``id`` and ``created``, no second role chunk, and a usage chunk that counts the whole request; for
  Anthropic events no second ``message_start``, no second ``content_block_start`` of the block in
  progress, no ``ping``, and a final ``message_delta`` whose usage is the whole request's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from apsd.core.config import MAX_BID
from apsd.core.models import LENGTH_ALIASES, InferenceRequest
from apsd.core.streams import TokenChunk
from apsd.engines.backends import BackendChunk, BackendError

__all__ = ["CONTINUES_CHATS", "CONTINUES_MESSAGES", "ECHOES_PREFILL", "Progress", "StreamRelay", "chunk_text",
           "CHUNK_PER_TOKEN", "continuation", "continues", "prefill_text", "priority_for", "request_body"]

#: Servers (``Backend.server``) that continue a chat whose last message is the assistant's.
CONTINUES_CHATS = frozenset({"llama.cpp", "vllm", "sglang"})
#: Servers whose ``/v1/messages`` continues a final assistant message (vLLM's renders it as a finished
#: turn and starts a new one).
CONTINUES_MESSAGES = frozenset({"llama.cpp"})
#: Servers that stream the assistant prefill back before continuing it (llama.cpp: in its first chunk,
#: with the first new token; and at the start of a whole answer's text), on both APIs.
ECHOES_PREFILL = frozenset({"llama.cpp"})
#: Servers whose stream chunks are their tokens, one each (llama.cpp: a chunk per token generated), so the
#: chunks counted are what they generated. Others' chunks are not (vLLM sends some with no text and, when
#: its reader falls behind, some with several tokens): what arrived is counted by the server's tokenizer.
CHUNK_PER_TOKEN = frozenset({"llama.cpp"})

#: The Anthropic API (``request.api``).
MESSAGES = "messages"

#: The most outstanding requests :func:`priority_for` tells apart (more rank the same).
PRIORITY_DEPTH = 1_000
#: Service classes' targets rank in steps of this many milliseconds, in this many tiers (a looser class
#: ranks as the last tier, before requests without a class).
CLASS_TIER_MS = 100
CLASS_TIERS = 600


def priority_for(request: InferenceRequest, outstanding: int, polarity: str, now: float = 0.0) -> int:
    """The ``priority`` sent to a backend that schedules by it (``[[backends]] priority``): first a
    service class that can still meet its deadline, the tightest (smallest ``ttft_s``) first, before
    requests without one; then the tenant's requests outstanding when this one was sent (running on the
    model's backends, from every replica, and queued here), so that a tenant with one request goes ahead
    of a flood however the flood started; then higher bids. ``lower-first``: smaller values run first
    (vLLM); ``higher-first``: the reverse."""
    deadline = request.class_deadline
    tier = CLASS_TIERS if deadline is None or now >= deadline else \
        min(CLASS_TIERS - 1, int((deadline - request.arrival) * 1000) // CLASS_TIER_MS)
    rank = (tier * (PRIORITY_DEPTH + 1) + min(outstanding, PRIORITY_DEPTH)) * (MAX_BID + 1) \
        + (MAX_BID - request.priority_bid)
    return rank if polarity == "lower-first" else (CLASS_TIERS + 1) * (PRIORITY_DEPTH + 1) * (MAX_BID + 1) - rank


def request_body(request: InferenceRequest, model: str, priority: int | None) -> tuple[str, dict[str, Any], bool]:
    """The API, the body to send, and whether the client asked for usage in its stream.

    The client's body is copied one level deep (only top-level keys change; nothing of the client's
    is walked or copied further). ``priority``: the value to send (None: none, and a client's own
    ``priority``, which is its bid here, is not relayed)."""
    if request.payload is not None and request.api is not None:
        api, body = request.api, dict(request.payload)
    else:  # POST /infer: a plain completion of its prompt
        api, body = "completions", {"prompt": request.prompt}
    body["model"] = model
    if priority is not None:
        body["priority"] = priority
    else:
        body.pop("priority", None)
    if api == "embeddings":   # (nothing to generate, nothing to stream)
        return api, body, False
    if api == "responses":
        if not request.open_ended:
            body["max_output_tokens"] = request.tokens_requested
        body["stream"] = request.stream is not None   # (its stream ends with its usage)
        return api, body, False
    if api == MESSAGES:   # (max_tokens is required there: always the reservation; usage is in the events)
        body["max_tokens"] = request.tokens_requested
        body["stream"] = request.stream is not None
        return api, body, True
    _set_limit(body, request, request.tokens_requested)
    wants_usage = False
    if request.stream is not None:
        options = body.get("stream_options")
        wants_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        body["stream"] = True
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
    else:
        body["stream"] = False
        body.pop("stream_options", None)
    return api, body, wants_usage


def _set_limit(body: dict[str, Any], request: InferenceRequest, limit: int) -> None:
    if request.open_ended:
        return
    if "max_completion_tokens" not in body:
        body["max_tokens"] = limit
    for name in ("max_completion_tokens", "max_tokens", *LENGTH_ALIASES):
        if name in body:
            body[name] = limit


def continues(api: str, server: str | None) -> bool:
    """Whether a ``server`` (``Backend.server``) can continue a request of ``api`` from its own text."""
    if api == "chat.completions":
        return server in CONTINUES_CHATS
    if api == MESSAGES:
        return server in CONTINUES_MESSAGES
    return True   # (a text completion: its prompt and the text so far, on any server)


def continuation(api: str, body: dict[str, Any], text: str, request: InferenceRequest, server: str | None, *,
                 echoed: bool = False) -> dict[str, Any] | None:
    """``body`` (from :func:`request_body`) made to resume from ``text``, the output so far, for a
    ``server`` (``llama.cpp``, ``vllm``, ``sglang``; None: not known); None when that server cannot
    continue a request of ``api`` (:func:`continues`). ``echoed``: the first attempt ran on a server
    that echoed the client's own prefill, so ``text`` starts with it (``Progress.echoed``)."""
    if not continues(api, server):
        return None
    body = dict(body)
    if api in ("chat.completions", MESSAGES):
        body["messages"] = _prefilled(body["messages"], text, echoed=echoed)
        if api == MESSAGES:
            body["max_tokens"] = request.tokens_requested - request.tokens_generated
            return body
        if server != "llama.cpp":   # (llama.cpp continues a final assistant message by itself)
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
    else:
        body["prompt"] = body["prompt"] + text
    _set_limit(body, request, request.tokens_requested - request.tokens_generated)
    return body


def _prefilled(messages: list[Any], text: str, *, echoed: bool) -> list[Any]:
    """``messages`` ending with an assistant message that holds ``text``: the client's own final
    assistant message (its prefill) continued by ``text``, or replaced by it when the server echoed that
    prefill at the start of ``text``; else ``text`` as a new final assistant message."""
    messages = list(messages)
    last = messages[-1] if messages else None
    if not (isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), (str, list))):
        return [*messages, {"role": "assistant", "content": text}]
    content = last["content"]
    if echoed and text.startswith(_text_of(content)):
        messages[-1] = {**last, "content": text}
    elif isinstance(content, str):
        messages[-1] = {**last, "content": content + text}
    else:
        messages[-1] = {**last, "content": [*content, {"type": "text", "text": text}]}
    return messages


def _text_of(content: str | list[Any]) -> str:
    """The text of a message's content (a string, or a list of parts or blocks: their ``text``)."""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content
                   if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str))


def prefill_text(body: dict[str, Any]) -> str:
    """The text of ``body``'s final assistant message (what a server that echoes the prefill streams
    back first), "" when its last message is not the assistant's."""
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, dict) or last.get("role") != "assistant" or not isinstance(last.get("content"), (str, list)):
        return ""
    return _text_of(last["content"])


def chunk_text(chunk: dict[str, Any]) -> str:
    """The text a stream chunk adds (chat ``delta.content``, completion ``text``, a Responses
    ``response.output_text.delta`` event's ``delta``, or an Anthropic ``content_block_delta`` event's
    ``text_delta``)."""
    kind = chunk.get("type")
    if kind is not None:   # (an event of the Responses or the Anthropic API: OpenAI chunks have no type)
        delta = chunk.get("delta")
        if kind == "response.output_text.delta":
            return delta if isinstance(delta, str) else ""
        if kind == "content_block_delta" and type(delta) is dict and delta.get("type") == "text_delta":
            text = delta.get("text")
            return text if type(text) is str else ""
        return ""
    choices = chunk.get("choices")
    if type(choices) is list and len(choices) == 1 and type(choices[0]) is dict:   # (nearly every chunk)
        choice = choices[0]
        delta = choice.get("delta")
        content = delta.get("content") if type(delta) is dict else None
        if type(content) is str:
            return content
        text = choice.get("text")
        return text if type(text) is str else ""
    text = []
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict) and isinstance(delta.get("content"), str):
            text.append(delta["content"])
        elif isinstance(choice.get("text"), str):
            text.append(choice["text"])
    return "".join(text)


def _continues_safely(chunk: dict[str, Any]) -> bool:
    """Whether a chunk leaves its stream resumable from its text: no tool call, function call or
    reasoning being streamed (a continuation could not carry them on); for Anthropic events, nothing but
    text blocks, and the answer not complete yet (after its last block there is nothing to resume)."""
    kind = chunk.get("type")
    if kind is not None:
        return _event_continues_safely(kind, chunk)
    choices = chunk.get("choices")
    if type(choices) is not list:
        return True
    for choice in choices:
        delta = choice.get("delta") if type(choice) is dict else None
        if type(delta) is dict and (delta.get("tool_calls") or delta.get("function_call")
                                    or delta.get("reasoning_content") or delta.get("reasoning")):
            return False
    return True


#: Anthropic events that change nothing a continuation would need.
_NEUTRAL_EVENTS = frozenset({"message_start", "ping", "message_stop"})


def _event_continues_safely(kind: str, chunk: dict[str, Any]) -> bool:
    if kind in _NEUTRAL_EVENTS:
        return True
    if kind == "content_block_start":
        block = chunk.get("content_block")
        return type(block) is dict and block.get("type") == "text"
    if kind == "content_block_delta":
        delta = chunk.get("delta")
        return type(delta) is dict and delta.get("type") == "text_delta"
    # content_block_stop, message_delta (the answer is complete), an error, or an event apsd does not know
    return kind.startswith("response.")   # (the Responses API's events are never resumed anyway)


def _delta_tokens(chunk: dict[str, Any]) -> int:
    """Output tokens an event without text carries: an Anthropic ``thinking_delta`` (at least one)."""
    if chunk.get("type") != "content_block_delta":
        return 0
    delta = chunk.get("delta")
    return 1 if type(delta) is dict and delta.get("type") == "thinking_delta" and delta.get("thinking") else 0


@attrs.define(eq=False)
class Progress:
    """What a resumable request has produced so far, across its attempts: the text (for the
    continuation), the first attempt's chunk ``id`` and ``created`` (a resumed stream keeps them), and
    whether it can still be resumed."""

    parts: list[str] = attrs.field(factory=list)
    resumable: bool = True
    #: The API it came through (set when it is first sent).
    api: str = ""
    chunk_id: str | None = None
    created: int | None = None
    #: Attempts so far that were preempted after their first token (the next one resumes).
    resumed: int = 0
    #: The first attempt ran on a server that echoes a final assistant message (the client's prefill):
    #: the text so far starts with it.
    echoed: bool = False
    #: Prompt tokens of the original request, as the backend counted them (None: not known).
    prompt_tokens: int | None = None
    #: An Anthropic stream's first ``message_start`` usage (a resumed stream's last ``message_delta``
    #: reports its input figures), and the content blocks its client has seen start.
    message_usage: dict[str, Any] | None = None
    blocks: set[int] = attrs.field(factory=set)

    @property
    def text(self) -> str:
        return "".join(self.parts)


#: What the relay calls when a stream stops being resumable (a tool call began).
OnUnresumable = Callable[[], None]


@attrs.define(eq=False)
class StreamRelay:
    """One attempt's relay of a backend's stream to ``request`` (see the module docstring): counts
    tokens, stamps the first token (``started``), keeps ``progress`` (None: not resumable), and pushes
    chunks to the client's stream without waiting. A backend that streams more tokens than the limit it
    was sent fails the request and is suspected: the tenant is never charged past its reservation."""

    request: InferenceRequest
    backend: str
    wants_usage: bool
    started: Callable[[InferenceRequest, float], None]
    now: Callable[[], float]
    progress: Progress | None = None
    on_unresumable: OnUnresumable | None = None
    #: This attempt resumes a preempted one on a server that echoes the prefill before continuing it: the
    #: part of that text not seen again yet ("": nothing to drop).
    echo: str = ""
    #: The text of this attempt's chunks whose tokens the backend did not say (a real server's: vLLM sends
    #: some chunks with no text and some with several tokens, so one per chunk with text is only a live
    #: count), for the backend's own count when the attempt ends without its usage.
    unsaid: list[str] = attrs.field(factory=list, init=False)
    _held: list[tuple[dict[str, Any], bytes | None]] = attrs.field(factory=list[Any], init=False)
    #: Output tokens the request had when this attempt began.
    _base: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        self._base = self.request.tokens_generated

    def __call__(self, piece: BackendChunk) -> None:
        request, progress = self.request, self.progress
        chunk, raw = piece.data, piece.raw
        text = chunk_text(chunk)
        if progress is not None:
            event = chunk.get("type") is not None and progress.api == MESSAGES
            if progress.resumed:
                stitched, raw, text = self._stitch_event(chunk, raw, text) if event else self._stitch(chunk, text)
                if stitched is None:
                    return
                chunk = stitched
            elif event:
                self._note_event(chunk)
            elif progress.chunk_id is None and "id" in chunk:
                progress.chunk_id, progress.created = chunk.get("id"), chunk.get("created")
            if progress.resumable and not _continues_safely(chunk):
                progress.resumable = False
                if self.on_unresumable is not None:
                    self.on_unresumable()
        tokens = piece.tokens if piece.tokens is not None else 1 if text else _delta_tokens(chunk)
        if tokens and request.started_at is None:
            self.started(request, self.now())
        if not request.open_ended and request.tokens_generated + tokens > request.tokens_requested:
            raise BackendError(502, "backend_failed", f"backend {self.backend} sent more tokens than the "
                               f"{request.tokens_requested} it was allowed (max_tokens)", retryable=False,
                               unhealthy=True)
        request.tokens_generated += tokens
        if piece.tokens is None and text:
            self.unsaid.append(text)
        if progress is not None and text:
            progress.parts.append(text)
        stream = request.stream
        if stream is None:
            return
        if chunk.get("usage") is not None and not self.wants_usage:
            chunk, raw = {k: v for k, v in chunk.items() if k != "usage"}, None
            if not chunk.get("choices"):
                return  # (a usage-only chunk the client did not ask for)
        now = self.now()
        if request.started_at is None:
            self._held.append((chunk, raw))  # (a role chunk: held until a token comes, so a retry elsewhere
            return                           # cannot send the client a second one)
        for early, early_raw in self._held:
            stream.push_nowait(TokenChunk(tokens=0, at=now, data=early, raw=early_raw))
        self._held.clear()
        stream.push_nowait(TokenChunk(tokens=tokens, text=text, at=now, data=chunk, raw=raw))

    def _stitch(self, chunk: dict[str, Any], text: str) -> tuple[dict[str, Any] | None, bytes | None, str]:
        """A resumed attempt's chunk as the first attempt's stream would have carried it (None: drop it)."""
        if self.echo and text:   # (a server that echoes the prefill first: that text was sent already)
            if text and self.echo.startswith(text):
                self.echo = self.echo[len(text):]
                return None, None, ""
            if text.startswith(self.echo):
                text = text[len(self.echo):]
                chunk = _with_text(chunk, text)
            self.echo = ""
        choices = chunk.get("choices")
        usage = chunk.get("usage")
        if not text and usage is None and not _finishes(choices) and _continues_safely(chunk):
            return None, None, ""   # (a role chunk, or an empty one: the client has had its start)
        progress = self.progress
        assert progress is not None
        chunk = dict(chunk)
        if progress.chunk_id is not None:
            chunk["id"], chunk["created"] = progress.chunk_id, progress.created
        if isinstance(usage, dict):   # (the whole request's: the client's prompt, and every output token)
            request = self.request
            completion = self._base + (usage.get("completion_tokens") or 0)
            prompt = progress.prompt_tokens if progress.prompt_tokens is not None else request.prompt_tokens
            chunk["usage"] = {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                              "total_tokens": prompt + completion}
        return chunk, None, text

    def _note_event(self, chunk: dict[str, Any]) -> None:
        """A first attempt's Anthropic event: what a resumed attempt needs of it (its usage, which
        counts the original prompt; the blocks the client has seen start)."""
        progress = self.progress
        assert progress is not None
        kind = chunk.get("type")
        if kind == "message_start":
            message = chunk.get("message")
            usage = message.get("usage") if type(message) is dict else None
            if type(usage) is dict:
                progress.message_usage = usage
                prompt = _anthropic_prompt(usage)
                if prompt:   # (0: the server did not say; the backend's count is asked if needed)
                    progress.prompt_tokens = prompt
        elif kind == "content_block_start" and type(chunk.get("index")) is int:
            progress.blocks.add(chunk["index"])

    def _stitch_event(self, chunk: dict[str, Any], raw: bytes | None,
                      text: str) -> tuple[dict[str, Any] | None, bytes | None, str]:
        """A resumed attempt's Anthropic event as the first attempt's stream would have carried it
        (None: drop it)."""
        progress = self.progress
        assert progress is not None
        kind = chunk.get("type")
        if kind in ("message_start", "ping"):
            return None, None, ""   # (the client has had its start; a ping says nothing it needs)
        if kind == "content_block_start" and chunk.get("index") in progress.blocks:
            return None, None, ""   # (the block in progress: the client has had its start)
        if self.echo and text:   # (a server that echoes the prefill first: that text was sent already)
            if self.echo.startswith(text):
                self.echo = self.echo[len(text):]
                return None, None, ""
            if text.startswith(self.echo):
                text = text[len(self.echo):]
                chunk, raw = {**chunk, "delta": {**chunk["delta"], "text": text}}, None
            self.echo = ""
        if kind == "content_block_start" and type(chunk.get("index")) is int:
            progress.blocks.add(chunk["index"])
        usage = chunk.get("usage")
        if kind == "message_delta" and type(usage) is dict:   # (the whole request's)
            first = progress.message_usage or {}
            output = usage.get("output_tokens")
            usage = {**usage, **{key: value for key, value in first.items() if key in usage and key != "output_tokens"}}
            if type(output) is int:
                usage["output_tokens"] = self._base + output
            chunk, raw = {**chunk, "usage": usage}, None
        return chunk, raw, text


def _anthropic_prompt(usage: dict[str, Any]) -> int:
    """The prompt tokens an Anthropic usage counts: ``input_tokens`` (which leaves out what was read
    from or written to the cache) and the cache's two figures; 0 when they are not whole numbers."""
    total = 0
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        value = usage.get(key)
        if value is None:
            continue
        if type(value) is not int or value < 0:
            return 0
        total += value
    return total


def _finishes(choices: object) -> bool:
    return type(choices) is list and any(type(c) is dict and c.get("finish_reason") for c in choices)


def _with_text(chunk: dict[str, Any], text: str) -> dict[str, Any]:
    """``chunk`` (one choice) with its text replaced."""
    choice = dict(chunk["choices"][0])
    if type(choice.get("delta")) is dict:
        choice["delta"] = {**choice["delta"], "content": text}
    else:
        choice["text"] = text
    return {**chunk, "choices": [choice]}
