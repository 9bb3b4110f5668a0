"""The OpenAI-compatible API: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``.

Requests go through the same pipeline as ``POST /infer`` (admission, queue, engines, ledger,
Prometheus counters); this module only translates. docs/reference/http-api.md ("OpenAI-compatible
API") states the rules for clients; the contract with engines is:

* A request carries ``model``, ``api`` (``"chat.completions"`` or ``"completions"``) and
  ``payload``: the client's body as sent, minus ``priority`` (apsd's to interpret: a backend
  such as vLLM refuses it unless it schedules by priority itself) and ``service_class`` (apsd's
  service class, :mod:`apsd.core.classes`; no backend knows it). Every other parameter,
  interpreted by apsd or not (``temperature``, ``tools``, ...), is in the payload untouched.
  ``tokens_requested`` is the client's output limit (``max_completion_tokens``, ``max_tokens``,
  or a backend's own name for it: :func:`_max_tokens` states the rule), or, when it set none,
  ``[gateway] default_max_tokens`` as an estimate (``open_ended``: no limit is sent upstream,
  and the tenant pays for what the backend generated).
* ``X-Request-Id``: a client's own id (1-128 characters of letters, digits and ``-_.:``) names
  the request in apsd's log and answers and is sent upstream; without one apsd numbers it.
* Not streaming: a :class:`~apsd.core.models.Completion` with a ``response`` (a forwarding engine's
  backend answer) is relayed as it is, the bytes the backend sent (``response_bytes``); without one (the simulated engines) the answer is built
  here, with placeholder text of ``tokens_generated`` tokens (:func:`placeholder_text`).
* Streaming: the handler sets ``request.stream`` before submitting. A chunk with ``data`` (a
  forwarding engine: the backend's SSE chunk, usage already stripped unless the client asked)
  is relayed as it is; a chunk without (the simulated engines) becomes an OpenAI chunk of
  ``tokens`` placeholder tokens (or its ``text``), and the finish chunk and, with
  ``stream_options.include_usage``, the usage chunk are built here. ``data: [DONE]`` ends a
  stream that completed. Until the first token nothing is sent, so a request refused or failed
  before it (429, 503, 504, ...) gets an ordinary HTTP error, which clients retry; after it, an
  error event in OpenAI's shape ends the stream, without ``[DONE]``.
* A client that leaves (before or during its answer) cancels its request
  (:meth:`~apsd.pipeline.Pipeline.cancel`): billed for what ran.

Every error answer is OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with apsd's
status codes; ``code`` is apsd's error code (:func:`error_response`).
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import AsyncGenerator
from typing import Any

import attrs

from apsd.core.admission import estimate_tokens
from apsd.core.config import DEFAULT_BID, AdmissionConfig, Config, TenantConfig, clamp_bid
from apsd.core.models import LENGTH_ALIASES, Completion, InferenceRequest, Refusal
from apsd.core.streams import TokenChunk
from apsd.pipeline import Pipeline
from apsd.serve.auth import Caller
from apsd.serve.http.common import (
    MAX_TENANT_ID_CHARS,
    MAX_TOKENS_REQUESTED,
    BodyError,
    HeaderFields,
    HttpState,
    check_field_types,
    check_prompt_length,
    client_request_id,
    finish_trace,
    is_int,
    parse_json_object,
    service_class,
    shown,
)
from apsd.serve.http.exchange import Answer, Exchange, json_answer
from apsd.serve.http.submission import answer_submitted

__all__ = ["CHAT", "COMPLETIONS", "EMBEDDINGS", "MEDIA_PART_TOKENS", "MESSAGE_OVERHEAD_TOKENS", "RESPONSES", "OpenAIBody",
           "PRIORITY_HEADER", "TENANT_HEADER", "complete", "error_body", "error_response", "error_type",
           "models", "parse_openai_body", "placeholder_text", "priority_bid", "priority_header", "route_header",
           "tenant_of", "unix_time"]

CHAT = "chat.completions"
COMPLETIONS = "completions"
EMBEDDINGS = "embeddings"
RESPONSES = "responses"
#: Without API keys (loopback only) this header names the tenant a request runs as.
TENANT_HEADER = "X-Apsd-Tenant"
#: apsd's own bid, 1-10, higher served sooner (clamped to the tenant's ``max_bid``); it takes
#: precedence over the body's vLLM-style ``priority``.
PRIORITY_HEADER = "X-Apsd-Priority"
#: The header Anthropic's clients send with every request (``GET /v1/models`` answers them in their shape).
ANTHROPIC_VERSION_HEADER = "anthropic-version"
#: The response header saying where the routing policy sent a request, and why.
ROUTE_HEADER = "X-Apsd-Route"
#: Tokens added per chat message to the estimate of its text (role and delimiters, as chat
#: templates add; OpenAI's own count is 3-4 per message).
MESSAGE_OVERHEAD_TOKENS = 4
#: Content parts other than text that a chat message may carry (images, audio, files): passed
#: through to the backend as they are; each is estimated at MEDIA_PART_TOKENS prompt tokens until
#: the backend's usage says what it cost.
MEDIA_PARTS = ("image_url", "input_audio", "file")
MEDIA_PART_TOKENS = 1_024
#: What a media part contributes to a prompt's text (the log's view of it; its estimate is above).
MEDIA_PLACEHOLDER = "[media]"
#: The words a simulated engine's placeholder answer cycles through, one per token.
_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit", "sed", "do",
          "eiusmod", "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua")
_INTEGER = re.compile(r"[+-]?[0-9]{1,18}")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
                499: "client_disconnected"}


def unix_time() -> int:
    """Seconds since the epoch, for OpenAI's ``created`` fields (never used to time anything)."""
    return int(time.time())


def error_type(status: int) -> str:
    """OpenAI's error ``type`` for an HTTP status."""
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(refusal: Refusal) -> dict[str, Any]:
    """OpenAI's error object for ``refusal``: ``code`` is apsd's error code, ``param`` its field."""
    return {"error": {"message": refusal.message, "type": error_type(refusal.status), "param": refusal.field,
                      "code": refusal.error}}


def error_response(refusal: Refusal) -> Answer:
    """An error answer in OpenAI's shape, with the refusal's status and headers (``Retry-After``,
    ``RateLimit``, ``WWW-Authenticate``)."""
    return json_answer(error_body(refusal), refusal.status, dict(refusal.headers))


# -- request bodies ------------------------------------------------------------------------------

@attrs.frozen
class OpenAIBody:
    """A validated OpenAI request body: what apsd interprets, and the ``payload`` to relay."""

    api: str
    model: str
    #: The prompt's text (chat: every message's text, one per line): for the estimate and the log.
    prompt: str
    prompt_tokens: int
    max_tokens: int
    #: The client set no output limit: ``max_tokens`` is ``[gateway] default_max_tokens``, an estimate.
    open_ended: bool
    stream: bool
    include_usage: bool
    #: vLLM's ``priority`` (lower is served sooner; None: not given).
    priority: int | None
    payload: dict[str, Any] = attrs.field(repr=False)
    #: The body's ``service_class`` (None: not given); never relayed.
    service_class: Any = None


#: Body fields apsd interprets and keeps from the backend.
_NOT_RELAYED = ("priority", "service_class")


def _invalid(field: str, rule: str, status: int = 422, error: str = "invalid_field") -> BodyError:
    return BodyError(status, error, f"{field} {rule}", field=field)



def _message_text(message: Any, i: int) -> str:
    """The text of chat message ``i`` (its content, name and tool calls), checking its shape."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _invalid(where, "must be an object with role and content")
    role = message.get("role")
    if not isinstance(role, str) or not role.strip():
        raise (_invalid(f"{where}.role", "is required", error="missing_field") if role is None
               else _invalid(f"{where}.role", "must be a non-empty string"))
    name = message.get("name")
    if name is not None and not isinstance(name, str):
        raise _invalid(f"{where}.name", "must be a string")
    parts = [name] if name else []
    content = message.get("content")
    if isinstance(content, str):
        parts.append(content)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            part_type = part.get("type") if isinstance(part, dict) else None
            if part_type == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif part_type in MEDIA_PARTS and isinstance(part.get(part_type), (dict, str)):
                parts.append(MEDIA_PLACEHOLDER)
            else:
                raise _invalid(f"{where}.content[{j}]", 'must be a content part: {"type": "text", "text": "..."}, or '
                               f"one of type {', '.join(MEDIA_PARTS)} carrying an object of that name")
    elif content is None and role == "assistant" and ("tool_calls" in message or "function_call" in message):
        pass  # an assistant turn that only called tools
    elif content is None:
        raise _invalid(f"{where}.content", "is required", error="missing_field")
    else:
        raise _invalid(f"{where}.content", "must be a string or a list of text parts")
    if "tool_calls" in message and not isinstance(message["tool_calls"], list):
        raise _invalid(f"{where}.tool_calls", "must be a list of tool calls")
    for key in ("tool_calls", "function_call"):
        if key in message:
            parts.append(json.dumps(message[key]))
    return "\n".join(parts)


def _prompt(data: dict[str, Any], api: str, settings: AdmissionConfig) -> tuple[str, int]:
    """The prompt's text and its estimated tokens."""
    if api == CHAT:
        messages = data.get("messages")
        if messages is None:
            raise _invalid("messages", "is required", error="missing_field")
        if not isinstance(messages, list) or not messages:
            raise _invalid("messages", "must be a non-empty list of messages")
        texts = [_message_text(message, i) for i, message in enumerate(messages)]
        joined = "".join(texts)   # (the estimate counts the texts, not the lines between them)
        media = joined.count(MEDIA_PLACEHOLDER)
        words = estimate_tokens(joined.replace(MEDIA_PLACEHOLDER, "") if media else joined, settings)
        return "\n".join(texts), words + MESSAGE_OVERHEAD_TOKENS * len(messages) + MEDIA_PART_TOKENS * media
    prompt = data.get("prompt")
    if prompt is None:
        raise _invalid("prompt", "is required", error="missing_field")
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise _invalid("prompt", "must be a string, or a list of exactly one string: several prompts are "
                           "several completions, which apsd schedules and bills as separate requests "
                           "(send one request per prompt)")
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise _invalid("prompt", "must be a string (token arrays are not supported)")
    return prompt, estimate_tokens(prompt, settings)


def _max_tokens(data: dict[str, Any], default: int) -> tuple[int, bool]:
    """The output limit the client set (under any name a backend reads it by), and whether it set
    one; ``default`` (an estimate to reserve) when it did not. The rule, so that no parameter lets
    a backend generate past what admission reserved: every name given must carry the same whole
    number, 1 or more (llama.cpp's ``n_predict: -1``, "until the context is full", cannot be
    reserved), and ``min_tokens`` may not exceed it."""
    given = {}
    for name in ("max_completion_tokens", "max_tokens", *LENGTH_ALIASES):
        value = data.get(name)
        if value is None:
            continue
        if not is_int(value) or not 1 <= value <= MAX_TOKENS_REQUESTED:
            got = shown(value) if is_int(value) else json.dumps(value)[:40]
            raise _invalid(name, f"must be an integer 1-{MAX_TOKENS_REQUESTED}, got {got}")
        given[name] = value
    if len(set(given.values())) > 1:
        raise _invalid("max_tokens", f"and {' and '.join(n for n in given if n != 'max_tokens')} differ; send one "
                       "output limit")
    limit = next(iter(given.values()), None)
    floor = data.get("min_tokens")
    if floor is not None and (not is_int(floor) or not 0 <= floor <= (limit or default)):
        raise _invalid("min_tokens", f"must be an integer from 0 to the output limit ({limit or default})")
    return (default, False) if limit is None else (limit, True)


#: Parameters apsd checks the type of although it does not interpret them: a backend refuses a
#: wrong type with a 4xx at best, and at worst with a 5xx that would be retried and blamed on it.
_NUMBERS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
_INTEGERS = ("seed", "top_k", "top_logprobs")
_BOOLEANS = ("logprobs", "ignore_eos", "echo", "parallel_tool_calls")


def _check_types(data: dict[str, Any]) -> None:
    check_field_types(data, numbers=_NUMBERS, integers=_INTEGERS, booleans=_BOOLEANS)
    stop = data.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(item, str) for item in stop)):
        raise _invalid("stop", "must be a string or a list of strings")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise _invalid("user", "must be a string")
    for name in ("tools", "functions"):
        value = data.get(name)
        if value is not None and not isinstance(value, list):
            raise _invalid(name, "must be a list")


def _embedding_input(data: dict[str, Any], settings: AdmissionConfig) -> tuple[str, int]:
    """An embeddings request's ``input`` (a string, strings, a token array or token arrays): its
    text and estimated tokens (a token array counts its length)."""
    value = data.get("input")
    if value is None:
        raise _invalid("input", "is required", error="missing_field")
    if isinstance(value, str):
        value = [value]
    rule = "must be a string, a non-empty list of strings, or token arrays (lists of integers)"
    if not isinstance(value, list) or not value:
        raise _invalid("input", rule)
    if all(isinstance(item, str) for item in value):
        return "\n".join(value), sum(estimate_tokens(item, settings) for item in value)
    if all(is_int(item) for item in value):
        return "", len(value)
    if all(isinstance(item, list) and item and all(is_int(t) for t in item) for item in value):
        return "", sum(len(item) for item in value)
    raise _invalid("input", rule)


_RESPONSE_TEXT_PARTS = ("input_text", "output_text", "text")
_RESPONSE_MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def _response_input(data: dict[str, Any], settings: AdmissionConfig) -> tuple[str, int]:
    """A responses request's ``instructions`` and ``input`` (a string, or a list of items): its text
    and estimated tokens. Message items' text parts are counted, media parts at MEDIA_PART_TOKENS,
    any other item (a function call, its output) by its JSON."""
    instructions = data.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _invalid("instructions", "must be a string")
    value = data.get("input")
    if value is None:
        raise _invalid("input", "is required", error="missing_field")
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _invalid("input", "must be a string or a non-empty list of input items")
    texts = [instructions] if instructions else []
    media = 0
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise _invalid(f"input[{i}]", "must be an object (an input item)")
        content = item.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in _RESPONSE_TEXT_PARTS and isinstance(part.get("text"), str):
                    texts.append(part["text"])
                elif kind in _RESPONSE_MEDIA_PARTS:
                    media += 1
                else:
                    raise _invalid(f"input[{i}].content[{j}]", "must be a content part: input_text with its text, "
                                   f"or one of {', '.join(_RESPONSE_MEDIA_PARTS)}")
        elif content is None:
            texts.append(json.dumps(item))   # a function call, a function call's output, ...
        else:
            raise _invalid(f"input[{i}].content", "must be a string or a list of content parts")
    tokens = estimate_tokens("".join(texts), settings) + MESSAGE_OVERHEAD_TOKENS * len(value) \
        + MEDIA_PART_TOKENS * media
    return "\n".join(texts), tokens


def _max_output_tokens(data: dict[str, Any], default: int) -> tuple[int, bool]:
    """A responses request's ``max_output_tokens``, and whether it set one (``default``, an
    estimate to reserve, when it did not)."""
    value = data.get("max_output_tokens")
    if value is None:
        return default, False
    if not is_int(value) or not 1 <= value <= MAX_TOKENS_REQUESTED:
        got = shown(value) if is_int(value) else json.dumps(value)[:40]
        raise _invalid("max_output_tokens", f"must be an integer 1-{MAX_TOKENS_REQUESTED}, got {got}")
    return value, True


def parse_openai_body(raw: bytes, api: str, config: Config) -> OpenAIBody:
    """Validate the body of an OpenAI request to ``api`` (:data:`CHAT`, :data:`COMPLETIONS`,
    :data:`EMBEDDINGS` or :data:`RESPONSES`).

    BodyError names the field (OpenAI's ``param``) and the rule: 400 for JSON that is not one
    object or repeats a key, 422 for a field missing, of the wrong type or out of range. Does
    not check that the model exists (the pipeline's engines say which do). Parameters apsd does
    not interpret are kept in ``payload`` as they are.
    """
    data = parse_json_object(raw)
    model = data.get("model")
    if model is None:
        raise _invalid("model", "is required", error="missing_field")
    if not isinstance(model, str) or not model.strip():
        raise _invalid("model", "must be a non-empty string")
    if api == EMBEDDINGS:   # nothing to generate: charged on its input
        prompt, prompt_tokens = _embedding_input(data, config.admission)
        if data.get("stream") is not None:
            raise _invalid("stream", "is not a parameter of embeddings")
        payload = {key: value for key, value in data.items() if key not in _NOT_RELAYED}
        return OpenAIBody(api=api, model=model, prompt=prompt, prompt_tokens=prompt_tokens, max_tokens=0,
                          open_ended=False, stream=False, include_usage=False,
                          priority=_priority(data), payload=payload, service_class=data.get("service_class"))
    if api == RESPONSES:
        prompt, prompt_tokens = _response_input(data, config.admission)
        max_tokens, limited = _max_output_tokens(data, config.gateway.default_max_tokens)
    else:
        prompt, prompt_tokens = _prompt(data, api, config.admission)
        max_tokens, limited = _max_tokens(data, config.gateway.default_max_tokens)
    _check_types(data)
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _invalid("stream", "must be true or false")
    options = data.get("stream_options")
    if options is not None and api == RESPONSES:
        raise _invalid("stream_options", "is not a parameter of responses (their stream ends with their usage)")
    if options is not None:
        if not isinstance(options, dict):
            raise _invalid("stream_options", "must be an object")
        if not stream:
            raise _invalid("stream_options", "is only allowed with stream: true")
        if "include_usage" in options and not isinstance(options["include_usage"], bool):
            raise _invalid("stream_options.include_usage", "must be true or false")
    for name in ("n", "best_of", "n_cmpl"):
        value = data.get(name)
        if value is not None and (not is_int(value) or value != 1):
            raise _invalid(name, "must be 1: apsd schedules, reserves and bills one sequence per request "
                           "(send several requests for several choices)")
    payload = {key: value for key, value in data.items() if key not in _NOT_RELAYED}
    return OpenAIBody(api=api, model=model, prompt=prompt, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                      open_ended=not limited, stream=bool(stream),
                      include_usage=bool(options and options.get("include_usage")), priority=_priority(data),
                      payload=payload, service_class=data.get("service_class"))


def _priority(data: dict[str, Any]) -> int | None:
    priority = data.get("priority")
    if priority is not None and not is_int(priority):
        raise _invalid("priority", "must be an integer (lower is served sooner, as in vLLM; default 0)")
    return priority


def priority_bid(tenant: TenantConfig | None, *, priority: int | None = None, header: int | None = None) -> int:
    """apsd's bid (1-10, higher sooner) for a request, within the tenant's contract.

    ``header`` (``X-Apsd-Priority``, apsd's polarity) gives ``clamp(header, 1, max_bid)``;
    otherwise the body's ``priority`` (vLLM's polarity: lower sooner, default 0) gives
    ``clamp(default_bid - priority, 1, max_bid)``. An unknown tenant (None: admission will
    answer 404) is taken as the defaults' (:data:`~apsd.core.config.DEFAULT_BID`, :data:`~apsd.core.config.MAX_BID`).
    """
    default_bid = DEFAULT_BID if tenant is None else tenant.default_bid
    return clamp_bid(tenant, header if header is not None else default_bid - (priority or 0))


def tenant_of(caller: Caller, headers: HeaderFields) -> str:
    """The tenant a request with ``headers`` runs as: the key's, or (no keys) the one
    :data:`TENANT_HEADER` names."""
    named = headers.getlist(TENANT_HEADER)
    if len(named) > 1:
        raise BodyError(400, "invalid_header", f"more than one {TENANT_HEADER} header", field=TENANT_HEADER)
    name = _utf8(named[0]) if named else None
    if caller.anonymous:
        if name is None:
            raise BodyError(400, "missing_tenant", f"the {TENANT_HEADER} header must name the tenant "
                            "(no API keys are configured, so nothing else says who is calling)",
                            field=TENANT_HEADER)
        if not name.strip() or len(name) > MAX_TENANT_ID_CHARS:
            raise BodyError(400, "invalid_header", f"{TENANT_HEADER} must be 1-{MAX_TENANT_ID_CHARS} characters",
                            field=TENANT_HEADER)
        return name
    if name is not None and name != caller.tenant:
        raise BodyError(403, "tenant_mismatch", f"{TENANT_HEADER} names a tenant other than the API key's "
                        "(leave it out, or name the key's own tenant)", field=TENANT_HEADER)
    assert caller.tenant is not None  # (the admin key was refused by @authenticated(submits=True))
    return caller.tenant


def _utf8(value: str) -> str:
    """A header value as the UTF-8 its bytes usually are (a non-ASCII tenant name); the server hands
    them over as Latin-1, which it stays when it is not UTF-8."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def priority_header(headers: HeaderFields) -> int | None:
    """The bid :data:`PRIORITY_HEADER` in ``headers`` gives (None: none given); BodyError 400 if it is not one integer."""
    values = headers.getlist(PRIORITY_HEADER)
    if not values:
        return None
    if len(values) > 1 or not _INTEGER.fullmatch(values[0].strip()):
        raise BodyError(400, "invalid_header", f"{PRIORITY_HEADER} must be one integer bid, 1-10 "
                        "(higher is served sooner)", field=PRIORITY_HEADER)
    return int(values[0])


def _refused(refusal: Refusal) -> Answer:
    """The pipeline's refusal of a ``/v1`` request: its tenant came from a header, not a field."""
    if refusal.field == "tenant_id":
        refusal = attrs.evolve(refusal, field=TENANT_HEADER)
    return error_response(refusal)


# -- answers --------------------------------------------------------------------------------------

def placeholder_text(start: int, tokens: int) -> str:
    """Tokens ``start`` to ``start + tokens`` of a simulated engine's answer: one word per token,
    separated by spaces, so the pieces of a stream join into the whole answer."""
    words = (_WORDS[i % len(_WORDS)] for i in range(start, start + tokens))
    text = " ".join(words)
    return f" {text}" if start > 0 and text else text


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish_reason(tokens: int, requested: int) -> str:
    """``length`` when it generated all it could, else ``stop`` (the simulated engines always do)."""
    return "length" if tokens >= requested else "stop"


def _built_answer(body: OpenAIBody, completion: Completion) -> dict[str, Any]:
    """A simulated engine's answer in OpenAI's shape: placeholder text, usage from apsd's counts."""
    text = placeholder_text(0, completion.tokens_generated)
    reason = _finish_reason(completion.tokens_generated, body.max_tokens)
    if body.api == CHAT:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": reason}
        kind, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        kind, prefix = "text_completion", "cmpl-"
    return {"id": prefix + completion.request_id, "object": kind, "created": unix_time(), "model": body.model,
            "choices": [choice], "usage": _usage(completion.prompt_tokens, completion.tokens_generated)}


@attrs.define
class _ChunkMaker:
    """Builds a simulated engine's stream chunks, in OpenAI's shape."""

    body: OpenAIBody
    request_id: str
    created: int
    sent: int = 0

    def chunk(self, choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> bytes:
        """A chunk with ``choice`` (None: no choice, the usage chunk); with ``include_usage`` every
        chunk has a ``usage`` field, null but in the last (as OpenAI sends them)."""
        chat = self.body.api == CHAT
        data: dict[str, Any] = {"id": ("chatcmpl-" if chat else "cmpl-") + self.request_id,
                                "object": "chat.completion.chunk" if chat else "text_completion",
                                "created": self.created, "model": self.body.model,
                                "choices": [] if choice is None else [choice]}
        if self.body.include_usage:
            data["usage"] = usage
        return sse(data)

    def _choice(self, text: str, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.body.api == CHAT:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else \
                {"content": text} if text or finish_reason is None else {}
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def start(self) -> bytes | None:
        """The chat role chunk (OpenAI sends it first, with empty content); None for completions."""
        return self.chunk(self._choice("", None, role=True)) if self.body.api == CHAT else None

    def tokens(self, chunk: TokenChunk) -> bytes:
        text = chunk.text or placeholder_text(self.sent, chunk.tokens)
        self.sent += chunk.tokens
        return self.chunk(self._choice(text, None))

    def finish(self, reason: str) -> bytes:
        return self.chunk(self._choice("", reason))

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self.chunk(None, _usage(prompt_tokens, completion_tokens))


def sse(data: dict[str, Any], named: bool = False) -> bytes:
    """One Server-Sent Event carrying ``data`` as JSON; ``named``: with its ``type`` as the event's
    name (the Responses API's events)."""
    event = b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
    kind = data.get("type") if named else None
    return b"event: " + kind.encode() + b"\n" + event if isinstance(kind, str) and kind.isascii() else event


DONE = b"data: [DONE]\n\n"


async def _first_chunk(inference: InferenceRequest) -> TokenChunk | None:
    """The stream's first chunk, or None once the request has its outcome without one (refused,
    failed or cancelled before its first token; or a completion that streamed nothing): the ledger
    closes a request's stream with its outcome, refusals before admission included."""
    stream = inference.stream
    assert stream is not None
    return await stream.receive()


async def _events(pipeline: Pipeline, inference: InferenceRequest, body: OpenAIBody,
                  first: TokenChunk | None) -> AsyncGenerator[bytes, None]:
    """The SSE body of a streamed answer, from its first chunk on; a client that leaves cancels
    the request (in ``finally``: quart closes this generator when its send is cancelled)."""
    stream = inference.stream
    assert stream is not None
    maker = _ChunkMaker(body, inference.request_id, unix_time())
    named = body.api == RESPONSES   # (its events carry their type as the SSE event name, and no [DONE])
    relayed = False  # (a forwarding engine's chunks carry the backend's own JSON: relayed, never built)
    try:
        chunk = first
        if chunk is None or chunk.data is None:
            if (start := maker.start()) is not None:
                yield start
        while chunk is not None:
            events = []
            for each in (chunk, *stream.receive_ready()):   # what is already there goes in one write
                if each.raw is not None and not named:
                    relayed = True
                    events.append(b"data: " + each.raw + b"\n\n")
                elif each.data is not None:
                    relayed = True
                    events.append(sse(each.data, named))
                elif each.tokens or each.text:
                    events.append(maker.tokens(each))
            if events:
                yield b"".join(events)
            chunk = await stream.receive()
        outcome = inference.reply.outcome
        if not isinstance(outcome, Completion):
            refusal = outcome if isinstance(outcome, Refusal) else Refusal(
                500, "stream_error", stream.error or "the stream ended without an outcome", kind="failed")
            yield sse(error_body(refusal))
            return
        if not relayed:
            yield maker.finish(_finish_reason(outcome.tokens_generated, inference.tokens_requested))
            if body.include_usage:
                yield maker.usage(outcome.prompt_tokens, outcome.tokens_generated)
        if not named:
            yield DONE
    finally:
        if not inference.answered:
            pipeline.cancel(inference)
        finish_trace(inference)


async def _stream_answer(pipeline: Pipeline, inference: InferenceRequest, body: OpenAIBody) -> Answer:
    """Wait for the first token (or the outcome), then answer with the event stream; an outcome
    before any token is an ordinary HTTP error."""
    try:
        first = await _first_chunk(inference)
    except BaseException:  # the client left while the request waited
        if not inference.answered:
            pipeline.cancel(inference)
        raise
    outcome = inference.reply.outcome
    if first is None and isinstance(outcome, Refusal):
        return _refused(outcome)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": inference.request_id,
               **pipeline.admission.rate_limit_headers(inference.tenant_id), **route_header(inference)}
    return Answer(200, headers=headers, content_type="text/event-stream",
                  stream=_events(pipeline, inference, body, first))


async def complete(state: HttpState, exchange: Exchange, caller: Caller, api: str) -> Answer:
    """``POST /v1/<api>`` (chat completions, completions, embeddings, responses) for ``caller``: the
    body checked, submitted, answered whole or streamed (see the module docstring)."""
    pipeline = state.pipeline
    headers = exchange.headers
    try:
        tenant_id = exchange.tenant_id = tenant_of(caller, headers)
        header_bid = priority_header(headers)
        request_id = client_request_id(headers)
        if api not in pipeline.apis():
            raise BodyError(404, "unsupported_api", f"/v1/{api} needs an engine that relays to inference servers "
                            f"([[backends]]); this daemon's engines run {' and '.join(pipeline.apis())}")
        body = parse_openai_body(await exchange.body(), api, pipeline.config)
        models = pipeline.models()
        if body.model not in models:
            raise BodyError(404, "model_not_found", f"the model {body.model[:256]!r} is not served here "
                            f"(GET /v1/models lists them: {', '.join(models)})", field="model")
        check_prompt_length(body.prompt_tokens, len(body.prompt), pipeline,
                            field={CHAT: "messages", COMPLETIONS: "prompt"}.get(api, "input"))
        class_name = service_class(body.service_class, headers)
    except BodyError as exc:
        pipeline.ledger.count_refusal(None, exc.refusal.error)
        return error_response(exc.refusal)
    bid = priority_bid(pipeline.config.tenants.get(tenant_id), priority=body.priority, header=header_bid)
    inference = pipeline.new_request(tenant_id=tenant_id, prompt=body.prompt, tokens_requested=body.max_tokens,
                                     priority_bid=bid, prompt_tokens=body.prompt_tokens, model=body.model,
                                     api=api, payload=body.payload, open_ended=body.open_ended,
                                     request_id=request_id, service_class=class_name, key_id=caller.key_id)

    def whole(outcome: Completion) -> Answer:
        fields = {"X-Request-Id": outcome.request_id, **pipeline.admission.rate_limit_headers(outcome.tenant_id),
                  **route_header(inference)}
        if outcome.response_bytes is not None:   # (a backend's answer, relayed as it sent it)
            return Answer(200, outcome.response_bytes, fields)
        return json_answer(outcome.response if outcome.response is not None else _built_answer(body, outcome), 200,
                           fields)

    return await answer_submitted(state, inference, headers, stream=body.stream, refused=_refused,
                                  streamed=lambda: _stream_answer(pipeline, inference, body), whole=whole)


def route_header(inference: InferenceRequest) -> dict[str, str]:
    """``X-Apsd-Route: <backend or engine>; reason=<why>``: where the routing policy sent the request
    (nothing when there was no choice to make)."""
    return {ROUTE_HEADER: inference.route} if inference.route else {}


async def models(state: HttpState, exchange: Exchange, caller: Caller) -> Answer:
    """The models the engines serve that the caller may use, in OpenAI's list shape (Anthropic's for a
    request with the ``anthropic-version`` header, which Anthropic's clients send): a tenant's key
    (or, without keys, the tenant ``X-Apsd-Tenant`` names) sees only its tenant's ``models`` when it
    has a list, and an issued key with a ``models`` list of its own only those; the admin key, and a
    keyless caller naming no tenant, see every model."""
    names = state.pipeline.models()
    if caller.anonymous:
        named = exchange.headers.getlist(TENANT_HEADER)
        tenant_id = _utf8(named[0]) if len(named) == 1 else None
    else:
        tenant_id = caller.tenant
    tenant = state.pipeline.config.tenants.get(tenant_id) if tenant_id is not None else None
    if tenant is not None and tenant.models:
        names = [name for name in names if name in tenant.models]
    key = state.pipeline.config.keys.get(caller.key_id) if caller.key_id is not None else None
    if key is not None and key.limits.models:
        names = [name for name in names if name in key.limits.models]
    if exchange.headers.get(ANTHROPIC_VERSION_HEADER) is not None:   # (an Anthropic client: its list's shape)
        created = datetime.datetime.fromtimestamp(state.created, datetime.UTC).isoformat()
        return json_answer({"data": [{"type": "model", "id": name, "display_name": name, "created_at": created}
                                 for name in names],
                        "has_more": False, "first_id": names[0] if names else None,
                        "last_id": names[-1] if names else None})
    return json_answer({"object": "list", "data": [{"id": name, "object": "model", "created": state.created,
                                                "owned_by": "apsd"} for name in names]})
