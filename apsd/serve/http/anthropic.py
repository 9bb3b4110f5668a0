"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

What Claude-Code-shaped agents and the official ``anthropic`` client speak (``ANTHROPIC_BASE_URL``
pointed at apsd). A message goes through the same pipeline as a chat completion (admission, queue,
engines, ledger, Prometheus counters); this module only translates. docs/reference/http-api.md
("Anthropic Messages API") states the rules for clients; the contract with engines is:

* A request carries ``model``, ``api == "messages"`` and ``payload``: the client's body as sent, minus
  apsd's own ``priority`` and ``service_class``. ``tokens_requested`` is its ``max_tokens`` (required by
  the API, so always a limit: never ``open_ended``); ``prompt_tokens`` is apsd's estimate of ``system``,
  ``messages`` and ``tools`` (:func:`parse_messages_body`).
* Through the ``forward`` engine the backend's answer and events are relayed as they are (a resumed
  stream's stitched by :class:`apsd.engines.relay.StreamRelay`), each event under its ``type`` as the
  SSE event name, and the tenant is charged the backend's usage: ``input_tokens`` with
  ``cache_read_input_tokens`` and ``cache_creation_input_tokens`` as the prompt (cache reads at the
  cached-prompt discount), ``output_tokens`` as the output; in a stream, from ``message_start`` and
  ``message_delta``.
* On the simulated engines the answer is built here in Anthropic's shape (placeholder text of
  ``tokens_generated`` tokens, :func:`apsd.serve.http.openai.placeholder_text`), streams included.
* Until the first token nothing is sent, so a request refused or failed before it gets an ordinary
  HTTP error, which clients retry; after it, an ``error`` event ends the stream.
* ``count_tokens`` is answered by a backend's own ``/v1/messages/count_tokens`` when one serving the
  model has it, else by apsd's estimate; it is never charged (nothing runs), and answers the same
  refusals as a message would for the tenant (404 unknown tenant, 403 disabled or model not allowed).

Every error answer is Anthropic's ``{"type": "error", "error": {"type", "message", "details": {"error_code"}}}``
(``error_code``: apsd's error code), with apsd's status codes and headers (``Retry-After``), but for a
body field at fault: 400, as Anthropic answers it, where the OpenAI API says 422 (:func:`error_response`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any

import attrs

from apsd.core.admission import estimate_tokens
from apsd.core.config import AdmissionConfig, Config
from apsd.core.models import Completion, InferenceRequest, Refusal
from apsd.core.streams import TokenChunk
from apsd.pipeline import Pipeline
from apsd.serve.auth import Caller
from apsd.serve.http.common import (
    MAX_TOKENS_REQUESTED,
    BodyError,
    HttpState,
    check_field_types,
    check_prompt_length,
    client_request_id,
    finish_trace,
    invalid_field,
    is_int,
    parse_json_object,
    service_class,
    shown,
)
from apsd.serve.http.exchange import Answer, Exchange, json_answer
from apsd.serve.http.openai import (
    MEDIA_PART_TOKENS,
    MESSAGE_OVERHEAD_TOKENS,
    TENANT_HEADER,
    placeholder_text,
    priority_bid,
    priority_header,
    route_header,
    tenant_of,
)
from apsd.serve.http.submission import answer_submitted

__all__ = ["MESSAGES", "MessagesBody", "count_tokens", "error_body", "error_response", "error_type",
           "messages", "parse_messages_body"]

#: The API's name on a request (``request.api``).
MESSAGES = "messages"
#: The header Anthropic's client reads a request's id from (apsd also sends ``X-Request-Id``).
REQUEST_ID_HEADER = "request-id"

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 402: "billing_error",
                403: "permission_error", 404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 502: "api_error", 503: "overloaded_error",
                504: "timeout_error", 529: "overloaded_error"}


def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    return _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def _status(refusal: Refusal) -> int:
    """The status Anthropic's API answers where apsd's own says 422 (a body field at fault) is 400."""
    return 400 if refusal.status == 422 else refusal.status


def error_body(refusal: Refusal) -> dict[str, Any]:
    """Anthropic's error object for ``refusal``; ``details.error_code`` (where Anthropic's API puts its
    own codes) is apsd's error code (what ``/infer`` calls ``error``)."""
    return {"type": "error", "error": {"type": error_type(_status(refusal)), "message": refusal.message,
                                       "details": {"error_code": refusal.error}}}


def error_response(refusal: Refusal) -> Answer:
    """An error answer in Anthropic's shape, with the refusal's headers (``Retry-After``,
    ``WWW-Authenticate``); the tenant's ``RateLimit`` fields are added by the app."""
    if refusal.field == "tenant_id":   # (its tenant came from a header, not a field)
        refusal = attrs.evolve(refusal, field=TENANT_HEADER)
    return json_answer(error_body(refusal), _status(refusal), dict(refusal.headers))


# -- request bodies ------------------------------------------------------------------------------

@attrs.frozen
class MessagesBody:
    """A validated Messages API body: what apsd interprets, and the ``payload`` to relay."""

    model: str
    #: The prompt's text (``system`` and every message's text, one per line): for the log.
    prompt: str
    prompt_tokens: int
    #: ``max_tokens`` (0 for a ``count_tokens`` body, which has none).
    max_tokens: int
    stream: bool
    #: vLLM-style ``priority`` (lower is served sooner; None: not given); never relayed.
    priority: int | None
    payload: dict[str, Any] = attrs.field(repr=False)
    #: The body's ``service_class`` (None: not given); never relayed.
    service_class: Any = None


#: Body fields apsd interprets and keeps from the backend.
_NOT_RELAYED = ("priority", "service_class")
#: Content blocks whose tokens their JSON does not bound (an image is a URL or base64): estimated at
#: MEDIA_PART_TOKENS each until the backend's usage says.
_MEDIA_BLOCKS = ("image", "document")
_ROLES = ("user", "assistant")



@attrs.define
class _Prompt:
    """What a body's prompt holds, gathered as it is checked: its texts, its media blocks, and JSON
    counted as text (tool calls and their inputs, tool definitions, blocks apsd does not know)."""

    texts: list[str] = attrs.field(factory=list)
    media: int = 0

    def block(self, block: Any, where: str) -> None:
        """One content block (checked: an object with a ``type``; the known ones, their fields)."""
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            raise invalid_field(where, 'must be a content block: an object with a "type", e.g. {"type": "text", '
                           '"text": "..."}')
        if kind == "text":
            self.text(block.get("text"), f"{where}.text")
        elif kind in _MEDIA_BLOCKS:
            if not isinstance(block.get("source"), dict):
                raise invalid_field(f"{where}.source", "must be an object")
            self.media += 1
        elif kind == "thinking":
            self.text(block.get("thinking"), f"{where}.thinking")
        elif kind == "tool_use":
            for name in ("id", "name"):
                if not isinstance(block.get(name), str):
                    raise invalid_field(f"{where}.{name}", "must be a string")
            if not isinstance(block.get("input"), dict):
                raise invalid_field(f"{where}.input", "must be an object")
            self.texts.append(block["name"] + json.dumps(block["input"]))
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise invalid_field(f"{where}.tool_use_id", "must be a string")
            self.content(block.get("content", ""), f"{where}.content")
        else:   # (redacted thinking, server tools' blocks, ...: relayed as they are, counted by their JSON)
            self.texts.append(json.dumps(block))

    def text(self, value: Any, where: str) -> None:
        if not isinstance(value, str):
            raise invalid_field(where, "must be a string")
        self.texts.append(value)

    def content(self, content: Any, where: str) -> None:
        """A message's (or a tool result's) content: a string or a list of content blocks."""
        if isinstance(content, str):
            self.texts.append(content)
        elif isinstance(content, list):
            for j, block in enumerate(content):
                self.block(block, f"{where}[{j}]")
        else:
            raise invalid_field(where, "must be a string or a list of content blocks")


def _prompt(data: dict[str, Any], settings: AdmissionConfig) -> tuple[str, int]:
    """The prompt's text and its estimated tokens: ``system``, ``messages`` and ``tools`` (whose
    definitions a server renders into the prompt), estimated as a chat's are (the texts, 4 tokens per
    message, MEDIA_PART_TOKENS per image or document)."""
    found = _Prompt()
    system = data.get("system")
    if isinstance(system, list):
        for j, block in enumerate(system):
            if not (isinstance(block, dict) and block.get("type") == "text"):
                raise invalid_field(f"system[{j}]", 'must be a text block: {"type": "text", "text": "..."}')
            found.block(block, f"system[{j}]")
    elif system is not None and not isinstance(system, str):
        raise invalid_field("system", "must be a string or a list of text blocks")
    elif system:
        found.texts.append(system)
    messages = data.get("messages")
    if messages is None:
        raise invalid_field("messages", "is required", error="missing_field")
    if not isinstance(messages, list) or not messages:
        raise invalid_field("messages", "must be a non-empty list of messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid_field(where, "must be an object with role and content")
        role = message.get("role")
        if role is None:
            raise invalid_field(f"{where}.role", "is required", error="missing_field")
        if role not in _ROLES:
            raise invalid_field(f"{where}.role", 'must be "user" or "assistant" (the system prompt goes in system)')
        if "content" not in message:
            raise invalid_field(f"{where}.content", "is required", error="missing_field")
        found.content(message["content"], f"{where}.content")
    tools = data.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
            raise invalid_field("tools", "must be a list of tool definitions (objects)")
        if tools:
            found.texts.append(json.dumps(tools))
    turns = len(messages) + (1 if system else 0)
    tokens = estimate_tokens("".join(found.texts), settings) + MESSAGE_OVERHEAD_TOKENS * turns \
        + MEDIA_PART_TOKENS * found.media
    return "\n".join(found.texts), tokens


#: Parameters apsd checks the type of although it does not interpret them: a backend refuses a
#: wrong type with a 4xx at best, and at worst with a 5xx that would be retried and blamed on it.
_NUMBERS = ("temperature", "top_p")
_INTEGERS = ("top_k",)
_OBJECTS = ("tool_choice", "metadata", "thinking")


def _check_types(data: dict[str, Any]) -> None:
    check_field_types(data, numbers=_NUMBERS, integers=_INTEGERS, objects=_OBJECTS)
    stop = data.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(item, str) for item in stop)):
        raise invalid_field("stop_sequences", "must be a list of strings")
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid_field("stream", "must be true or false")
    priority = data.get("priority")
    if priority is not None and not is_int(priority):
        raise invalid_field("priority", "must be an integer (lower is served sooner, as in vLLM; default 0)")


def parse_messages_body(raw: bytes, config: Config, *, counting: bool = False) -> MessagesBody:
    """Validate a Messages API body (``counting``: a ``count_tokens`` body, which has no ``max_tokens``).

    BodyError names the field and the rule (400 for JSON that is not one object or repeats a key, 422,
    answered as 400, for a field missing, of the wrong type or out of range). Does not check that the
    model exists (the pipeline's engines say which do). Parameters apsd does not interpret are kept in
    ``payload`` as they are.
    """
    data = parse_json_object(raw)
    model = data.get("model")
    if model is None:
        raise invalid_field("model", "is required", error="missing_field")
    if not isinstance(model, str) or not model.strip():
        raise invalid_field("model", "must be a non-empty string")
    max_tokens = 0
    if not counting:
        value = data.get("max_tokens")
        if value is None:
            raise invalid_field("max_tokens", "is required (the most tokens to generate)", error="missing_field")
        if not is_int(value) or not 1 <= value <= MAX_TOKENS_REQUESTED:
            got = shown(value) if is_int(value) else json.dumps(value)[:40]
            raise invalid_field("max_tokens", f"must be an integer 1-{MAX_TOKENS_REQUESTED}, got {got}")
        max_tokens = value
    prompt, prompt_tokens = _prompt(data, config.admission)
    _check_types(data)
    payload = {key: value for key, value in data.items() if key not in _NOT_RELAYED}
    return MessagesBody(model=model, prompt=prompt, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                        stream=bool(data.get("stream")) and not counting, priority=data.get("priority"),
                        payload=payload, service_class=data.get("service_class"))


# -- answers --------------------------------------------------------------------------------------

def _stop_reason(tokens: int, requested: int) -> str:
    """``max_tokens`` when it generated all it could, else ``end_turn`` (the simulated engines always do)."""
    return "max_tokens" if tokens >= requested else "end_turn"


def _built_answer(body: MessagesBody, completion: Completion) -> dict[str, Any]:
    """A simulated engine's answer in Anthropic's shape: placeholder text, usage from apsd's counts."""
    return {"id": "msg_" + completion.request_id, "type": "message", "role": "assistant", "model": body.model,
            "content": [{"type": "text", "text": placeholder_text(0, completion.tokens_generated)}],
            "stop_reason": _stop_reason(completion.tokens_generated, body.max_tokens), "stop_sequence": None,
            "usage": {"input_tokens": completion.prompt_tokens, "output_tokens": completion.tokens_generated}}


def sse_event(data: dict[str, Any], raw: bytes | None = None) -> bytes:
    """One Server-Sent Event carrying ``data`` (or its ``raw`` JSON, as a backend sent it) under its
    ``type`` as the event's name, as Anthropic streams them."""
    kind = data.get("type")
    payload = raw if raw is not None else json.dumps(data, separators=(",", ":")).encode()
    event = b"data: " + payload + b"\n\n"
    if isinstance(kind, str) and kind.isascii() and kind.isprintable() and kind:
        return b"event: " + kind.encode() + b"\n" + event
    return event


@attrs.define
class _EventMaker:
    """Builds a simulated engine's stream events, in Anthropic's shape."""

    body: MessagesBody
    request_id: str
    prompt_tokens: int
    sent: int = 0

    def start(self) -> bytes:
        message: dict[str, Any] = {"id": "msg_" + self.request_id, "type": "message", "role": "assistant", "model": self.body.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0}}
        return sse_event({"type": "message_start", "message": message}) + sse_event(
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})

    def tokens(self, chunk: TokenChunk) -> bytes:
        text = chunk.text or placeholder_text(self.sent, chunk.tokens)
        self.sent += chunk.tokens
        return sse_event({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}})

    def finish(self, completion: Completion) -> bytes:
        delta = {"stop_reason": _stop_reason(completion.tokens_generated, self.body.max_tokens), "stop_sequence": None}
        return (sse_event({"type": "content_block_stop", "index": 0})
                + sse_event({"type": "message_delta", "delta": delta,
                             "usage": {"input_tokens": completion.prompt_tokens,
                                       "output_tokens": completion.tokens_generated}})
                + sse_event({"type": "message_stop"}))


async def _events(pipeline: Pipeline, inference: InferenceRequest, body: MessagesBody,
                  first: TokenChunk | None) -> AsyncGenerator[bytes, None]:
    """The SSE body of a streamed message, from its first chunk on; a client that leaves cancels the
    request (in ``finally``: quart closes this generator when its send is cancelled)."""
    stream = inference.stream
    assert stream is not None
    maker = _EventMaker(body, inference.request_id, inference.prompt_tokens)
    relayed = False  # (a forwarding engine's chunks carry the backend's own events: relayed, never built)
    try:
        chunk = first
        if chunk is None or chunk.data is None:
            yield maker.start()
        while chunk is not None:
            events = []
            for each in (chunk, *stream.receive_ready()):   # what is already there goes in one write
                if each.data is not None:
                    relayed = True
                    events.append(sse_event(each.data, each.raw))
                elif each.tokens or each.text:
                    events.append(maker.tokens(each))
            if events:
                yield b"".join(events)
            chunk = await stream.receive()
        outcome = inference.reply.outcome
        if not isinstance(outcome, Completion):
            refusal = outcome if isinstance(outcome, Refusal) else Refusal(
                500, "stream_error", stream.error or "the stream ended without an outcome", kind="failed")
            yield sse_event(error_body(refusal))
            return
        if not relayed:
            yield maker.finish(outcome)
    finally:
        if not inference.answered:
            pipeline.cancel(inference)
        finish_trace(inference)


def _headers(inference: InferenceRequest) -> dict[str, str]:
    return {"X-Request-Id": inference.request_id, REQUEST_ID_HEADER: inference.request_id, **route_header(inference)}


async def _stream_answer(pipeline: Pipeline, inference: InferenceRequest, body: MessagesBody) -> Answer:
    """Wait for the first token (or the outcome), then answer with the event stream; an outcome
    before any token is an ordinary HTTP error."""
    assert inference.stream is not None
    try:
        first = await inference.stream.receive()
    except BaseException:  # the client left while the request waited
        if not inference.answered:
            pipeline.cancel(inference)
        raise
    outcome = inference.reply.outcome
    if first is None and isinstance(outcome, Refusal):
        return error_response(outcome)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **_headers(inference)}
    return Answer(200, headers=headers, content_type="text/event-stream",
                  stream=_events(pipeline, inference, body, first))


def _parsed(pipeline: Pipeline, raw: bytes, *, counting: bool) -> MessagesBody:
    """The body, checked against what this daemon serves (BodyError otherwise)."""
    if MESSAGES not in pipeline.apis():
        raise BodyError(404, "unsupported_api", f"/v1/messages needs an engine that runs Anthropic's Messages API; "
                        f"this daemon's engines run {', '.join(pipeline.apis())}")
    body = parse_messages_body(raw, pipeline.config, counting=counting)
    models = pipeline.models()
    if body.model not in models:
        raise BodyError(404, "model_not_found", f"the model {body.model[:256]!r} is not served here "
                        f"(GET /v1/models lists them: {', '.join(models)})", field="model")
    check_prompt_length(body.prompt_tokens, len(body.prompt), pipeline, field="messages")
    return body


async def messages(state: HttpState, exchange: Exchange, caller: Caller) -> Answer:
    """``POST /v1/messages`` for ``caller``: one message, streamed or whole (see the module docstring)."""
    pipeline = state.pipeline
    headers = exchange.headers
    try:
        tenant_id = exchange.tenant_id = tenant_of(caller, headers)
        header_bid = priority_header(headers)
        request_id = client_request_id(headers)
        body = _parsed(pipeline, await exchange.body(), counting=False)
        class_name = service_class(body.service_class, headers)
    except BodyError as exc:
        pipeline.ledger.count_refusal(None, exc.refusal.error)
        return error_response(exc.refusal)
    bid = priority_bid(pipeline.config.tenants.get(tenant_id), priority=body.priority, header=header_bid)
    inference = pipeline.new_request(tenant_id=tenant_id, prompt=body.prompt, tokens_requested=body.max_tokens,
                                     priority_bid=bid, prompt_tokens=body.prompt_tokens, model=body.model,
                                     api=MESSAGES, payload=body.payload, request_id=request_id,
                                     service_class=class_name, key_id=caller.key_id)

    def whole(outcome: Completion) -> Answer:
        if outcome.response_bytes is not None:   # (a backend's answer, relayed as it sent it)
            return Answer(200, outcome.response_bytes, _headers(inference))
        answer = outcome.response if outcome.response is not None else _built_answer(body, outcome)
        return json_answer(answer, 200, _headers(inference))

    return await answer_submitted(state, inference, headers, stream=body.stream, refused=error_response,
                                  streamed=lambda: _stream_answer(pipeline, inference, body), whole=whole)


async def count_tokens(state: HttpState, exchange: Exchange, caller: Caller) -> Answer:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``, by a backend serving the model when
    one can count (its own ``/v1/messages/count_tokens``), else apsd's estimate; never charged."""
    pipeline = state.pipeline
    try:
        tenant_id = exchange.tenant_id = tenant_of(caller, exchange.headers)
        body = _parsed(pipeline, await exchange.body(), counting=True)
        refusal = _tenant_refusal(pipeline, tenant_id, body.model)
    except BodyError as exc:
        pipeline.ledger.count_refusal(None, exc.refusal.error)
        return error_response(exc.refusal)
    if refusal is not None:
        pipeline.ledger.count_refusal(tenant_id, refusal.error)
        return error_response(refusal)
    counted = None
    for engine in pipeline.engines:
        if body.model in engine.models():
            counted = await engine.count_message_tokens(body.model, body.payload)
            break
    tokens = counted if counted is not None else body.prompt_tokens
    return json_answer({"input_tokens": tokens})


def _tenant_refusal(pipeline: Pipeline, tenant_id: str, model: str) -> Refusal | None:
    """What admission would answer a message of ``tenant_id`` for ``model`` before looking at its cost:
    an unknown tenant, a disabled one, a model it may not use."""
    tenant = pipeline.config.tenants.get(tenant_id)
    if tenant is None:
        return Refusal(404, "unknown_tenant", f"no tenant named {tenant_id!r}", field=TENANT_HEADER)
    if tenant.disabled:
        return Refusal(403, "tenant_disabled", f"tenant {tenant_id!r} is disabled; ask the operator")
    if tenant.models and model not in tenant.models:
        return Refusal(403, "model_not_allowed", f"tenant {tenant_id!r} may not use model {model!r} "
                       f"(it may use: {', '.join(tenant.models)})", field="model")
    return None
