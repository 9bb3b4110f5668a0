"""A stand-in OpenAI-compatible backend whose answers a test scripts: a real HTTP/1.1 server on
``127.0.0.1`` port 0, on raw trio sockets, so that it can send what no well-behaved server would
(bodies that are not JSON, nested 5000 deep, cut short; event streams without ``[DONE]``; absurd
``usage``; silence).

It serves ``GET /health`` (200, or 503 while :attr:`StandinBackend.healthy` is False),
``GET /v1/models`` (one model), and ``POST /v1/chat/completions`` and ``POST /v1/completions``,
whose answer is what its ``script`` returns for the request (a :class:`Reply`: a status, a raw
body or raw SSE events, a stall before the headers, gaps between events, an end cut short).
Everything else is 404 (``/metrics`` included: apsd then bounds it by ``max_concurrency`` alone).
:func:`well_behaved` is the default script: a valid answer, streamed when the request says
``stream``, with a small, believable ``usage``.

Resource handling: :func:`start_standin_backend` runs the server in the caller's nursery (the test's
``nursery`` fixture, which pytest-trio cancels when the test ends) and returns once it listens;
:func:`open_standin_backend` is the same as an ``async with`` block that stops it on exit. The
connections it accepted end with it. Every read is bounded (headers 64 KiB, bodies 16 MiB) and every
wait is the script's own (``stall_s``, ``gap_s``).

Error handling: a client that goes away mid-answer ends that connection only. An exception from the
script is a bug in the test: it propagates, and fails the test.
"""

from __future__ import annotations

import collections
import json
import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

__all__ = ["DONE", "Exchange", "Reply", "Script", "StandinBackend", "chat_answer", "json_reply", "open_standin_backend",
           "sse", "sse_reply", "start_standin_backend", "stream_chunks", "well_behaved"]

#: The end of an OpenAI event stream.
DONE = b"data: [DONE]\n\n"
_MAX_HEAD = 65_536
_MAX_BODY = 16 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 429: "Too Many Requests",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


@attrs.frozen
class Exchange:
    """A request the stand-in received: ``headers`` with lower-case names, ``body`` as sent."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        """The body as JSON (None when it is not)."""
        try:
            return json.loads(self.body)
        except ValueError:
            return None


@attrs.frozen
class Reply:
    """What the stand-in answers one completion request.

    ``body``: the raw body, sent with its Content-Length; or ``events``: raw pieces of an event
    stream (:func:`sse` makes one event), each sent as one HTTP chunk, ``gap_s`` apart. ``stall_s``:
    silence before the status line. ``cut``: the answer ends early (a body shorter than its
    Content-Length, a chunked stream without its last chunk) and the connection is closed.
    """

    status: int = 200
    body: bytes = b""
    events: Sequence[bytes] | None = None
    content_type: str | None = None
    stall_s: float = 0.0
    gap_s: float = 0.0
    cut: bool = False


#: Called with each completion request; returns the answer to send.
Script = Callable[[Exchange], Reply]


def sse(data: Any) -> bytes:
    """One event whose ``data`` is ``data`` as JSON (bytes and str: sent as they are)."""
    if isinstance(data, bytes):
        return b"data: " + data + b"\n\n"
    if isinstance(data, str):
        return b"data: " + data.encode("utf-8", "surrogatepass") + b"\n\n"
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


def json_reply(data: Any, status: int = 200, **options: Any) -> Reply:
    """A plain JSON answer."""
    return Reply(status=status, body=json.dumps(data).encode(), **options)


def sse_reply(events: Sequence[Any], **options: Any) -> Reply:
    """An event stream of ``events`` (objects become :func:`sse` events; bytes are sent raw)."""
    return Reply(events=[e if isinstance(e, bytes) else sse(e) for e in events], **options)


def _limit(request: Any) -> int | None:
    if not isinstance(request, dict):
        return None
    for name in ("max_tokens", "max_completion_tokens", "n_predict", "max_new_tokens"):
        value = request.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def chat_answer(request: dict, usage: Any, *, content: str = "standin says hi") -> dict:
    """A whole (not streamed) answer to ``request`` (chat or completion) with ``usage`` as given."""
    if "messages" in request:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content},
                                  "finish_reason": "length"}
        kind = "chat.completion"
    else:
        choice, kind = {"index": 0, "text": content, "finish_reason": "length"}, "text_completion"
    return {"id": "standin-1", "object": kind, "created": 1, "model": request.get("model"), "choices": [choice],
            "usage": usage}


def stream_chunks(request: dict, tokens: int, usage: Any = None) -> list[dict]:
    """The chunks of a streamed answer of ``tokens`` one-token pieces, then (if ``usage`` is not None)
    OpenAI's usage chunk: no choices, and ``usage``."""
    chat = "messages" in request
    model = request.get("model")

    def chunk(choices: list, **extra: Any) -> dict:
        return {"id": "standin-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
                "model": model, "choices": choices, **extra}

    chunks = []
    if chat:
        chunks.append(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]))
    for i in range(tokens):
        piece = f" t{i}"
        choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
        chunks.append(chunk([{**choice, "finish_reason": "length" if i == tokens - 1 else None}]))
    if usage is not None:
        chunks.append(chunk([], usage=usage))
    return chunks


#: The prompt tokens :func:`well_behaved` reports (0 for an empty prompt): no more than apsd's
#: estimate of any prompt (4 per chat message at least, 1 per 4 characters), so a tenant is never
#: charged beyond its reservation by a truthful answer.
TRUE_PROMPT_TOKENS = 1
#: The output :func:`well_behaved` generates when the request sets no limit.
OPEN_ENDED_TOKENS = 3


def well_behaved(exchange: Exchange) -> Reply:
    """A valid answer: ``min(limit, 3)`` tokens (3 without a limit) and a believable ``usage``; streamed
    (with a usage chunk and ``[DONE]``) when the request says ``stream``. Like a strict server, it
    answers 500 for JSON it cannot read (``NaN``, lone surrogates, nesting past 10000 levels) and 400
    for a known field of the wrong type."""
    request = _strict_json(exchange.body)
    if not isinstance(request, dict):
        return json_reply({"error": {"message": "the body is not a JSON object", "type": "server_error"}}, 500)
    problem = _type_problem(request)
    if problem:
        return json_reply({"error": {"message": problem, "type": "invalid_request_error"}}, 400)
    limit = _limit(request)
    tokens = OPEN_ENDED_TOKENS if limit is None else max(0, min(limit, OPEN_ENDED_TOKENS))
    prompt = TRUE_PROMPT_TOKENS if request.get("messages") or request.get("prompt") not in ("", [""]) else 0
    usage = {"prompt_tokens": prompt, "completion_tokens": tokens, "total_tokens": prompt + tokens}
    if request.get("stream"):
        return sse_reply([*stream_chunks(request, tokens, usage), DONE])
    return json_reply(chat_answer(request, usage, content=" ".join(["tok"] * tokens)))


def _strict_json(body: bytes) -> Any:
    """JSON as a strict server reads it: None for NaN/Infinity, lone surrogates, or anything invalid."""
    def refuse(name: str) -> Any:
        raise ValueError(name)

    try:
        data = json.loads(body, parse_constant=refuse)
        json.dumps(data, ensure_ascii=False).encode("utf-8")   # (a lone surrogate cannot be encoded)
    except (ValueError, RecursionError, UnicodeError):
        return None
    return data


def _type_problem(request: dict) -> str | None:
    """What a strict server refuses with a 400 among the fields every server knows."""
    messages = request.get("messages")
    if messages is not None:
        if not isinstance(messages, list):
            return "messages must be a list"
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                return "a message must be an object with a role"
            if "name" in message and not isinstance(message["name"], str):
                return "a message's name must be a string"
    for name in ("temperature", "top_p"):
        value = request.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value)):
            return f"{name} must be a number"
    for name in ("max_tokens", "n_predict", "max_new_tokens", "max_completion_tokens"):
        value = request.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"{name} must be an integer"
    return None


@attrs.define(eq=False)
class StandinBackend:
    """The stand-in's state: where it listens, what it answers, and what it received (the latest
    :attr:`keep` requests, every path)."""

    script: Script = well_behaved
    model: str = "standin"
    #: While False, ``GET /health`` answers 503.
    healthy: bool = True
    keep: int = 1000
    url: str = ""
    received: collections.deque[Exchange] = attrs.field(init=False)
    #: Completion requests answered so far (health checks and model lists not counted), and the last.
    completions: int = 0
    last_completion: Exchange | None = None

    def __attrs_post_init__(self) -> None:
        self.received = collections.deque(maxlen=self.keep)

    async def serve(self, *, task_status: trio.TaskStatus[StandinBackend] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on 127.0.0.1 port 0 and serve until cancelled; supports ``nursery.start``, which
        hands back this backend with its :attr:`url` set."""
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._serve_connection, listeners)
            task_status.started(self)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        buffer = bytearray()
        try:
            async with stream:
                while True:   # (keep-alive: one request after another until the client closes)
                    exchange = await _read_request(stream, buffer)
                    if exchange is None:
                        return
                    self.received.append(exchange)
                    if not await self._answer(stream, exchange):
                        return
        except (trio.BrokenResourceError, trio.ClosedResourceError, _BadRequest):
            pass  # (the client left, or sent what no HTTP client sends: that connection ends)

    async def _answer(self, stream: trio.SocketStream, exchange: Exchange) -> bool:
        """Send the answer to ``exchange``; whether the connection stays open."""
        path = exchange.path.split("?", 1)[0]
        if exchange.method == "GET" and path == "/health":
            ok = self.healthy
            return await _send(stream, json_reply({"status": "ok" if ok else "down"}, 200 if ok else 503))
        if exchange.method == "GET" and path == "/v1/models":
            return await _send(stream, json_reply({"object": "list", "data": [
                {"id": self.model, "object": "model", "created": 1, "owned_by": "standin"}]}))
        if exchange.method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            self.completions += 1
            self.last_completion = exchange
            return await _send(stream, self.script(exchange))
        return await _send(stream, json_reply({"error": {"message": f"no {path} here"}}, 404))


class _BadRequest(Exception):
    pass


async def _read_request(stream: trio.SocketStream, buffer: bytearray) -> Exchange | None:
    """The next request on the connection (None: the client closed it between two requests)."""
    while (end := buffer.find(b"\r\n\r\n")) < 0:
        if len(buffer) > _MAX_HEAD:
            raise _BadRequest
        data = await stream.receive_some(65_536)
        if not data:
            if buffer:
                raise _BadRequest
            return None
        buffer += data
    head = bytes(buffer[:end]).decode("latin-1").split("\r\n")
    del buffer[:end + 4]
    try:
        method, target, _ = head[0].split(" ", 2)
    except ValueError:
        raise _BadRequest from None
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise _BadRequest   # (httpx sends a body of known length with Content-Length)
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise _BadRequest from None
    if not 0 <= length <= _MAX_BODY:
        raise _BadRequest
    while len(buffer) < length:
        data = await stream.receive_some(65_536)
        if not data:
            raise _BadRequest
        buffer += data
    body = bytes(buffer[:length])
    del buffer[:length]
    return Exchange(method=method, path=target, headers=headers, body=body)


async def _send(stream: trio.SocketStream, reply: Reply) -> bool:
    """Write ``reply``; whether the connection may serve another request."""
    if reply.stall_s:
        await trio.sleep(reply.stall_s)
    status = f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Whatever')}\r\n"
    if reply.events is None:
        length = len(reply.body) + (64 if reply.cut else 0)
        head = (status + f"Content-Type: {reply.content_type or 'application/json'}\r\n"
                f"Content-Length: {length}\r\n" + ("Connection: close\r\n" if reply.cut else "") + "\r\n")
        await stream.send_all(head.encode("latin-1") + reply.body)
        return not reply.cut
    head = (status + f"Content-Type: {reply.content_type or 'text/event-stream'}\r\nCache-Control: no-cache\r\n"
            "Transfer-Encoding: chunked\r\n" + ("Connection: close\r\n" if reply.cut else "") + "\r\n")
    await stream.send_all(head.encode("latin-1"))
    for i, event in enumerate(reply.events):
        if i and reply.gap_s:
            await trio.sleep(reply.gap_s)
        if event:
            await stream.send_all(b"%x\r\n%s\r\n" % (len(event), event))
    if reply.cut:
        return False
    await stream.send_all(b"0\r\n\r\n")
    return True


async def start_standin_backend(nursery: trio.Nursery, script: Script = well_behaved, **options: Any
                                ) -> StandinBackend:
    """A :class:`StandinBackend` serving in ``nursery`` (until it is cancelled), listening already."""
    return await nursery.start(StandinBackend(script, **options).serve)


@asynccontextmanager
async def open_standin_backend(script: Script = well_behaved, **options: Any) -> AsyncIterator[StandinBackend]:
    """A :class:`StandinBackend` for the ``async with`` block; it stops listening, and closes its
    connections, on exit."""
    async with trio.open_nursery() as nursery:
        backend = await start_standin_backend(nursery, script, **options)
        try:
            yield backend
        finally:
            nursery.cancel_scope.cancel()
