"""The forward engine's upstream connections: HTTP/1.1 with keep-alive, pooled per server.

Every forwarded request and every chunk of its stream passes through here, so this is the
cheapest path that still speaks HTTP/1.1 strictly. It replaced httpx + httpcore + httpx-sse,
then h11, where each cost a large share of a relayed chunk or request (measured in
docs/explanation/performance.md):

* a request head is written in one piece, and a response head is read and checked by hand
  (:func:`_parse_head`: RFC 9112's rules, anything else is an error); trio's socket streams set
  ``TCP_NODELAY``;
* a body is read a socket read at a time (:meth:`UpstreamResponse.iter_bytes` yields everything a
  read brought, several SSE events at once when the server is fast), its chunked framing undone on
  bytes (:class:`_BodyDecoder`), and its events split on bytes (:class:`SseSplitter`), never
  decoded to text;
* a connection goes back to its server's pool once its response has been read to the end, and
  the pool never polls its idle connections: only the one taken is checked, with one
  non-blocking poll (a server that closed it is found out there, and a fresh one is opened).

Ownership: the :class:`~apsd.engines.backends.HttpBackendClient` owns one :class:`UpstreamPool`;
a response is read by the task that sent its request, inside ``async with pool.request(...)``,
which closes the connection unless the response was read to its end.

Plain ``http://`` and ``https://`` (the system's CA store); no proxies, no content codings (apsd
asks for none).
"""

from __future__ import annotations

import re
import select
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import attrs
import trio

__all__ = ["SseSplitter", "UpstreamError", "UpstreamPool", "UpstreamResponse"]

#: Bytes asked of the socket per read.
READ_SIZE = 65_536
#: An idle connection older than this is closed rather than reused: servers close theirs after a
#: few seconds (uvicorn 5 s), and a request sent as they do would fail.
IDLE_EXPIRY_S = 4.0
#: Idle connections kept per server.
MAX_IDLE_PER_SERVER = 256


class UpstreamError(Exception):
    """The exchange with a server failed (refused, closed, malformed HTTP); ``str()`` says how."""


def _origin(url: str) -> tuple[str, str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"not an http(s) URL: {url!r}")
    return parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


@attrs.define(eq=False)
class _Connection:
    stream: trio.abc.Stream
    #: The socket (for the liveness check); None over TLS, where records may be pending.
    sock: trio.socket.SocketType | None
    idle_since: float = 0.0

    def looks_alive(self, now: float) -> bool:
        """Fresh enough, and the server has neither closed it nor sent anything unasked."""
        if now - self.idle_since > IDLE_EXPIRY_S:
            return False
        if self.sock is None:
            return True
        poll = select.poll()   # (one non-blocking poll of this socket alone)
        poll.register(self.sock.fileno(), select.POLLIN | select.POLLPRI)
        return not poll.poll(0)   # (readable: closed, or bytes nobody asked for)

    def close_now(self) -> None:
        """Close without waiting (a connection found dead, or not wanted back)."""
        stream: Any = self.stream
        while not isinstance(stream, trio.SocketStream):
            stream = getattr(stream, "transport_stream", None)
            if stream is None:
                return
        stream.socket.close()


@attrs.define(eq=False)
class UpstreamResponse:
    """A server's answer: its status and headers, and its body to read (once)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    _connection: _Connection
    _body: _BodyDecoder
    #: The server keeps the connection open after this answer (HTTP/1.1 without ``Connection: close``).
    keep_alive: bool = True
    #: Read to its end: the connection can serve another request.
    complete: bool = False

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body, as it arrives: each item is all that one socket read brought."""
        body = self._body
        data = body.feed(b"")   # (what came with the headers)
        while True:
            if body.done:
                self.complete = True
                self.keep_alive = self.keep_alive and not body.overrun
                if data:
                    yield data
                return
            if data:
                yield data
            received = await self._connection.stream.receive_some(READ_SIZE)
            if not received:
                if body.until_close:
                    body.done = True
                    self.keep_alive = False
                    data = b""
                    continue
                raise UpstreamError("the server closed the connection in the middle of its answer")
            data = body.feed(received)

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([part async for part in self.iter_bytes()])


@attrs.define
class _BodyDecoder:
    """An HTTP/1.1 response body's framing, undone as bytes arrive: ``chunked`` (RFC 9112 7.1),
    ``Content-Length``, or until the server closes."""

    #: Bytes still to come of a Content-Length body (None: chunked or until close).
    length: int | None
    chunked: bool
    #: (a TLS stream's reads are bytearrays: so may this be, in a chunked body)
    _buffer: bytes | bytearray = b""
    #: Chunked: bytes left of the current chunk's data (0: a size line comes next); -1: the
    #: CRLF after a chunk's data; -2: the trailers.
    _left: int = 0
    done: bool = False
    #: The server sent bytes past the body's end: the connection cannot be trusted with another request.
    overrun: bool = False

    @property
    def until_close(self) -> bool:
        return self.length is None and not self.chunked

    def feed(self, data: bytes | bytearray) -> bytes:
        """The body's bytes that ``data`` (received after what was fed before) completes."""
        if self.done:
            self.overrun = self.overrun or bool(data)
            return b""
        if not self.chunked:
            if self.length is None:
                return self._take_all(data)
            whole = self._take_all(data)
            piece = whole[:self.length]
            self.overrun = len(whole) > self.length   # (more than announced: not ours to read)
            self.length -= len(piece)
            self.done = self.length == 0
            return piece
        buffer = self._buffer + data if self._buffer else data
        out = []
        at = 0
        while True:
            if self._left > 0:
                chunk_bytes = buffer[at:at + self._left]
                out.append(chunk_bytes)
                self._left -= len(chunk_bytes)
                at += len(chunk_bytes)
                if self._left:
                    break
                self._left = -1
            if self._left == -1:
                if len(buffer) - at < 2:
                    break
                if buffer[at:at + 2] != b"\r\n":
                    raise UpstreamError("malformed chunked body from the server (no CRLF after a chunk)")
                at += 2
                self._left = 0
            if self._left == -2:   # (``at`` is on the CRLF that ended the last size line)
                end = buffer.find(b"\r\n\r\n", at)
                if end < 0:
                    break
                at = end + 4
                self.done = True
                self.overrun = at < len(buffer)
                break
            line_end = buffer.find(b"\r\n", at)
            if line_end < 0:
                if len(buffer) - at > MAX_CHUNK_LINE:
                    raise UpstreamError("malformed chunked body from the server (a size line too long)")
                break
            size_text = buffer[at:line_end].split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                size = -1
            if size < 0 or not size_text or len(size_text) > 16:
                raise UpstreamError(f"malformed chunked body from the server (chunk size {size_text[:20]!r})")
            at = line_end + 2
            if size == 0:
                self._left = -2
                at -= 2   # (the trailers' end may be this very CRLF: no trailers)
                continue
            self._left = size
        self._buffer = buffer[at:]
        return b"".join(out)

    def _take_all(self, data: bytes | bytearray) -> bytes:
        buffer, self._buffer = bytes(self._buffer) + data, b""
        return buffer


#: The longest chunk-size line accepted (a size and its extensions).
MAX_CHUNK_LINE = 4_096


class UpstreamPool:
    """Keep-alive connections per server (``scheme://host:port``), most recently used first."""

    def __init__(self, connect_timeout_s: float, ssl_context: ssl.SSLContext | None = None) -> None:
        """``ssl_context``: what ``https://`` servers are checked against (default: the system's CA store)."""
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._ssl = ssl_context
        #: Connections opened since the pool was made (how well keep-alive works).
        self.opened = 0

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for connection in idle:
                await trio.aclose_forcefully(connection.stream)
        self._idle.clear()

    async def _connect(self, origin: tuple[str, str, int]) -> _Connection:
        scheme, host, port = origin
        with trio.fail_after(self.connect_timeout_s):
            stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
            sock = stream.socket if isinstance(stream, trio.SocketStream) else None
            if scheme == "https":
                if self._ssl is None:
                    self._ssl = ssl.create_default_context()
                stream = trio.SSLStream(stream, self._ssl, server_hostname=host, https_compatible=True)
                await stream.do_handshake()
                sock = None
        self.opened += 1
        return _Connection(stream=stream, sock=sock)

    def _take_idle(self, origin: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(origin)
        now = trio.current_time()
        while idle:
            connection = idle.pop()
            if connection.looks_alive(now):
                return connection
            connection.close_now()
        return None

    def _give_back(self, origin: tuple[str, str, int], connection: _Connection) -> bool:
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= MAX_IDLE_PER_SERVER:
            return False
        connection.idle_since = trio.current_time()
        idle.append(connection)
        return True

    @asynccontextmanager
    async def request(self, method: str, url: str, content: bytes,
                      headers: list[tuple[str, str]]) -> AsyncIterator[UpstreamResponse]:
        """Send a request and give its response once its status and headers are in; its body is
        the caller's to read. A connection reused from the pool that the server had closed in
        the meantime (nothing of the answer came back) is replaced by a fresh one, once.
        Raises :class:`UpstreamError` (and ``OSError``/``trio`` stream errors, wrapped) for a
        failed exchange."""
        scheme, host, port = origin = _origin(url)
        parts = urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        default_port = 443 if scheme == "https" else 80
        head = [("Host", host if port == default_port else f"{host}:{port}"),
                ("Content-Length", str(len(content))), *headers]
        connection = self._take_idle(origin)
        reused = connection is not None
        response: UpstreamResponse | None = None
        try:
            while response is None:
                if connection is None:
                    connection = await self._connect(origin)
                try:
                    response = await self._send(connection, method, target, head, content)
                except (UpstreamError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    await trio.aclose_forcefully(connection.stream)
                    if not reused or isinstance(exc, _AnswerStarted):
                        raise
                    connection, reused = None, False   # (the server closed it while idle: once more)
            yield response
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise UpstreamError(_describe(exc)) from None
        finally:
            if connection is not None and not (response is not None and response.complete and response.keep_alive
                                               and self._give_back(origin, connection)):
                await trio.aclose_forcefully(connection.stream)

    @staticmethod
    async def _send(connection: _Connection, method: str, target: str, head: list[tuple[str, str]],
                    content: bytes) -> UpstreamResponse:
        await connection.stream.send_all(_request_head(method, target, head) + content)
        buffer = b""
        while True:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(buffer) > MAX_HEAD_BYTES:
                    raise _AnswerStarted(f"the server's answer has no end of headers in its first "
                                         f"{MAX_HEAD_BYTES} bytes")
                received = await connection.stream.receive_some(READ_SIZE)
                if not received:
                    if buffer:
                        raise _AnswerStarted("the server closed the connection in the middle of its headers")
                    raise UpstreamError("the server closed the connection without answering")
                buffer += received
                continue
            status, version, headers = _parse_head(buffer[:end])
            buffer = buffer[end + 4:]
            if 100 <= status < 200:   # (an interim answer, 103 Early Hints: the real one follows)
                continue
            return _response(connection, status, version, headers, method, buffer)


#: The longest response head accepted (status line and headers).
MAX_HEAD_BYTES = 65_536
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: [^\r\n]*)?")
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_UNSAFE = re.compile(r"[\r\n\x00]")


def _request_head(method: str, target: str, headers: list[tuple[str, str]]) -> bytes:
    """An HTTP/1.1 request head. apsd writes every header itself (its own, a backend's configured
    key, a request id already checked): one with a line break or NUL in it is refused all the same."""
    lines = [f"{method} {target} HTTP/1.1"]
    for name, value in headers:
        if _UNSAFE.search(name) or _UNSAFE.search(value):
            raise UpstreamError(f"the header {name[:40]!r} has a line break or NUL in it")
        lines.append(f"{name}: {value}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _parse_head(head: bytes) -> tuple[int, int, list[tuple[bytes, bytes]]]:
    """(status, minor version, headers with lowercased names) of a response head, checked as strictly
    as an HTTP/1.1 client must (RFC 9112: no folded lines, names are tokens, no whitespace before
    the colon); :class:`UpstreamError` otherwise."""
    lines = head.split(b"\r\n")
    status_line = _STATUS_LINE.fullmatch(lines[0])
    if status_line is None:
        raise _AnswerStarted(f"the server answered something other than HTTP/1.x: {lines[0][:60]!r}")
    headers = []
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name) or b"\n" in value or b"\x00" in value:
            raise _AnswerStarted(f"the server sent a malformed header line: {line[:60]!r}")
        headers.append((name.lower(), value.strip(b" \t")))
    return int(status_line[2]), int(status_line[1]), headers


def _response(connection: _Connection, status: int, minor: int, headers: list[tuple[bytes, bytes]], method: str,
              leftover: bytes) -> UpstreamResponse:
    """The response whose head is read; its body is framed by :class:`_BodyDecoder` from here."""
    lengths = {value for name, value in headers if name == b"content-length"}
    codings = [value.lower() for name, value in headers if name == b"transfer-encoding"]
    keep_alive = minor == 1 and not any(name == b"connection" and b"close" in value.lower() for name, value in headers)
    length: int | None = None
    chunked = False
    if codings:   # (it takes precedence over any Content-Length: RFC 9112 6.3)
        if codings != [b"chunked"]:
            raise _AnswerStarted(f"the server used a transfer coding apsd does not read: {b', '.join(codings)[:60]!r}")
        chunked = True
    elif lengths:
        if len(lengths) > 1 or not next(iter(lengths)).isdigit() or len(next(iter(lengths))) > 18:
            raise _AnswerStarted(f"the server sent an invalid Content-Length: {sorted(lengths)[:2]!r}")
        length = int(next(iter(lengths)))
    if method == "HEAD" or status in (204, 304):
        length, chunked = 0, False
    body = _BodyDecoder(length=length, chunked=chunked, buffer=leftover)
    if body.until_close:
        keep_alive = False
    return UpstreamResponse(status=status, headers=headers, connection=connection, body=body, keep_alive=keep_alive)


def _describe(exc: BaseException) -> str:
    """What went wrong, for an operator: the exception and its cause (trio's BrokenResourceError says
    nothing itself: the socket's or TLS's error is its cause)."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    cause = exc.__cause__
    return f"{text} ({type(cause).__name__}: {cause})" if cause is not None and str(cause) else text


class _AnswerStarted(UpstreamError):
    """The server answered something, but not a response: never retried."""


@attrs.define
class SseSplitter:
    """Splits a Server-Sent Events body, fed as it arrives, into its events' data (bytes).

    Follows the event stream format's rules for what apsd reads: lines end in LF, CRLF or CR;
    an empty line ends an event; ``data:`` lines (one leading space dropped) are joined with LF;
    comments (``:``) and other fields are skipped; an event without data yields nothing.
    """

    _pending: bytes = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The data of every event that ``data`` completes."""
        buffer = self._pending + data
        if b"\r" in buffer:
            if buffer.endswith(b"\r"):   # (a CR that may be half of a CRLF: wait for the next byte)
                self._pending = buffer
                return []
            buffer = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        events = buffer.split(b"\n\n")
        self._pending = events.pop()
        out = []
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:   # (one data line: nearly always)
                out.append(event[6:])
                continue
            values = [line[5:].removeprefix(b" ") if line != b"data" else b""
                      for line in event.split(b"\n") if line == b"data" or line.startswith(b"data:")]
            if values:
                out.append(b"\n".join(values))
        return out
