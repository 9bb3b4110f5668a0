"""One request of the data plane, below the web framework: its head, its body, and the answer to it.

The ``/v1`` API (:mod:`apsd.serve.http.dataplane`) is served straight from ASGI, not through Quart:
what a request costs there is apsd's own work, not the framework's. This module is the little of a
framework it needs:

* :class:`Headers`: the request's header fields, looked up by name in any case (``get``, ``getlist``:
  the same calls as werkzeug's, so the helpers that read headers serve both the data plane and the
  Quart app);
* :class:`Exchange`: the request's method, path, headers, the tenant its handler noted, and its body,
  read by :meth:`Exchange.pump` as it arrives (the same task notices the client leaving and cancels
  the handler) and handed over by :meth:`Exchange.body` within ``[server] max_body_bytes`` (413) and
  ``[server] body_timeout_s`` (408);
* :class:`Answer`: a status, header fields, and a body as bytes or as an async iterator of bytes
  (an event stream), written to ASGI by :func:`send_answer`.

Ownership: an :class:`Exchange` owns no task; :meth:`Exchange.pump` runs in the data plane's nursery
for the request and ends when the client leaves or the data plane cancels it after its answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable, Iterable
from contextlib import aclosing
from typing import Any

import attrs
import trio

from apsd.serve.http.common import UNREAD_BODY_WAIT_S, BodyError

__all__ = ["Answer", "Exchange", "Headers", "json_answer", "send_answer"]

class Headers:
    """A request's header fields, in the order they came, looked up by name in any case. Values are
    the bytes as Latin-1, as every Python web framework hands them over."""

    __slots__ = ("_fields",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        self._fields = [(name.decode("latin-1").lower(), value.decode("latin-1")) for name, value in raw]

    def getlist(self, name: str) -> list[str]:
        """Every value of the field ``name`` (one per field line), in order."""
        name = name.lower()
        return [value for field, value in self._fields if field == name]

    def get(self, name: str, default: str | None = None) -> str | None:
        """The first value of the field ``name``, or ``default``."""
        name = name.lower()
        for field, value in self._fields:
            if field == name:
                return value
        return default

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None


@attrs.define(eq=False)
class Exchange:
    """One HTTP request on the data plane (see the module docstring)."""

    method: str
    path: str
    headers: Headers
    max_body_bytes: int
    body_timeout_s: float
    #: The tenant the request is for, once its handler knows (its answer then carries the tenant's
    #: ``RateLimit`` fields).
    tenant_id: str | None = None
    _chunks: list[bytes] = attrs.field(factory=list)
    _size: int = 0
    _too_large: bool = False
    _complete: trio.Event = attrs.field(factory=trio.Event)

    @classmethod
    def from_scope(cls, scope: dict[str, Any], *, max_body_bytes: int, body_timeout_s: float) -> Exchange:
        return cls(method=scope["method"], path=scope["path"], headers=Headers(scope["headers"]),
                   max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)

    def content_length(self) -> int | None:
        """The announced ``Content-Length`` (None: none, or not a number: the server refuses those)."""
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.strip().isdigit() else None

    def has_body(self) -> bool:
        """Whether the request announced a body (a length above 0, or chunked)."""
        return bool(self.content_length()) or "chunked" in (self.headers.get("transfer-encoding") or "").lower()

    async def pump(self, receive: Callable[[], Any], client_left: Callable[[], None]) -> None:
        """Read the request's messages until the client leaves: the body's pieces (kept up to
        ``max_body_bytes``, dropped beyond), then ``http.disconnect``, on which ``client_left`` is called."""
        if not self.has_body():
            self._complete.set()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._complete.set()   # (whatever was missing will not come)
                client_left()
                return
            if message["type"] != "http.request":
                continue
            data = message.get("body", b"")
            self._size += len(data)
            if self._size > self.max_body_bytes:
                self._too_large, self._chunks = True, []
            elif data:
                self._chunks.append(data)
            if not message.get("more_body", False):
                self._complete.set()

    def _refuse_too_large(self) -> BodyError:
        return BodyError(413, "body_too_large", f"request body exceeds {self.max_body_bytes} bytes "
                         "(server.max_body_bytes)")

    async def body(self) -> bytes:
        """The whole body; BodyError 413 ``body_too_large`` beyond ``max_body_bytes`` (at once when its
        length says so), 408 ``request_timeout`` when it has not all arrived within ``body_timeout_s``."""
        length = self.content_length()
        if length is not None and length > self.max_body_bytes:
            raise self._refuse_too_large()
        with trio.move_on_after(self.body_timeout_s):
            await self._complete.wait()
        if not self._complete.is_set():
            raise BodyError(408, "request_timeout", f"the request body did not arrive within "
                            f"{self.body_timeout_s:g} s (server.body_timeout_s)", headers={"Connection": "close"})
        if self._too_large:
            raise self._refuse_too_large()
        return b"".join(self._chunks)

    async def body_drained(self) -> bool:
        """Whether the body, needed or not, has all arrived (waiting up to UNREAD_BODY_WAIT_S for it), so
        that the connection can be kept alive: an answer sent before its body was read leaves hypercorn a
        connection it does not read again. False: answer with ``Connection: close``."""
        if self._complete.is_set():   # (the usual case: the handler read it; no wait to set up)
            return not self._too_large
        length = self.content_length()
        if length is not None and length > self.max_body_bytes:
            return False
        with trio.move_on_after(UNREAD_BODY_WAIT_S):
            await self._complete.wait()
        return self._complete.is_set() and not self._too_large


@attrs.define
class Answer:
    """An answer: ``status``, ``headers``, and ``body`` (bytes) or ``stream`` (an async iterator of the
    pieces of an event stream, closed when the answer ends or the client leaves)."""

    status: int
    body: bytes = b""
    headers: dict[str, str] = attrs.field(factory=dict)
    content_type: str = "application/json"
    stream: AsyncGenerator[bytes, None] | None = None


def json_answer(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Answer:
    """``data`` as a JSON answer (floats as they are: a backend's numbers are relayed, not rounded)."""
    return Answer(status, json.dumps(data).encode(), headers or {})


async def send_answer(answer: Answer, send: Callable[[dict[str, Any]], Any], *, head: bool = False) -> None:
    """Write ``answer`` as ASGI messages (``head``: without its body, as a ``HEAD`` is answered)."""
    fields = [(b"content-type", answer.content_type.encode())]
    if answer.stream is None:
        fields.append((b"content-length", str(len(answer.body)).encode()))
    fields.extend((name.encode("latin-1"), value.encode("latin-1")) for name, value in answer.headers.items())
    await send({"type": "http.response.start", "status": answer.status, "headers": fields})
    if answer.stream is None:
        await send({"type": "http.response.body", "body": b"" if head else answer.body})
        return
    async with aclosing(answer.stream) as pieces:   # (closed at once when the client leaves)
        async for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b""})
