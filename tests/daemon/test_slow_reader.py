"""A client that opens a streamed answer and then reads nothing is dropped after ``[server]
send_timeout_s`` (every client is answered in bounded time); one that reads slowly is not.

Through a real daemon on 127.0.0.1:0 and raw sockets whose receive buffer is kept small, so that
the answer outgrows what the kernels hold and apsd's writes wait for the client. The simulated GPU
decodes fast in model seconds and is slowed by ``time_scale``: each answer is generated in a few
wall seconds whatever the machine's speed (a CPU-bound simulation would make the test's timing the
machine's). Nothing asserts a tight timing: every wait is a bounded loop with a generous bound.
"""

from __future__ import annotations

import json
import logging
import select
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import h11
import pytest
import trio

from apsd.core.config import GpuConfig, ServerConfig, TenantConfig
from apsd.core.hookspecs import hookimpl
from tests.helpers import LiveDaemon, make_config, start_daemon

#: The daemon's [server] send_timeout_s here.
SEND_TIMEOUT_S = 1.0
#: How long past the send timeout a stalled reader may wait for the drop (a loaded machine's margin).
DROP_MARGIN_S = 14.0
#: Output tokens of the stalled stream: about 13 MB of events, far beyond what the kernels buffer.
STALLED_TOKENS = 2_000_000
#: Output tokens of the slow reader's answer: about 5 MB.
SLOW_TOKENS = 800_000
#: The slow reader's receive buffer, and what it takes at most every READ_EVERY_S (it reads far more
#: often than SEND_TIMEOUT_S, but far slower than apsd writes, so apsd's writes wait for it).
RECEIVE_BUFFER = 131_072
READ_BYTES = 262_144
READ_EVERY_S = 0.2
#: 128k tokens per model second for one sequence, a model second is 0.2 wall seconds: a stream of
#: 2M tokens lasts about 3 wall seconds (delivered in about 300 pieces).
GPU = GpuConfig(time_scale=0.2, decode_tokens_per_s=128_000.0, kv_cap_tokens=4_000_000)
TENANT = "t"
DROPPED = "send_timeout_s"   # (in the one line apsd logs for a dropped client)


class Admitted:
    """A plugin keeping the requests admitted."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    @hookimpl
    def request_admitted(self, request: Any, now: float) -> None:
        self.requests.append(request)


async def slow_reader_daemon(nursery: trio.Nursery, admitted: Admitted) -> LiveDaemon:
    config = make_config(server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=1.0,
                                             send_timeout_s=SEND_TIMEOUT_S),
                         gpu=GPU, tenants={TENANT: TenantConfig(rate=1e6, burst=10**7)})
    return await start_daemon(nursery, config, plugins=(admitted,))


def completion_request(url: str, max_tokens: int) -> bytes:
    """A streamed ``/v1/completions`` request (with its usage) on a connection to close after it."""
    body = json.dumps({"model": "apsd-batch", "prompt": "x", "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {urlsplit(url).netloc}\r\nX-Apsd-Tenant: {TENANT}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode() + body


def small_buffered_socket(url: str, receive_buffer: int) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)   # (before connecting: the window)
    sock.settimeout(10)
    sock.connect((parts.hostname, parts.port))
    return sock


def peer_gone(sock: socket.socket) -> bool:
    """Whether the server has closed or reset the connection, seen without reading anything."""
    poller = select.poll()
    poller.register(sock, select.POLLHUP | select.POLLERR | select.POLLRDHUP)
    return bool(poller.poll(0))


def connection_handlers() -> int:
    """Connections the daemon (in this process) still handles: trio's serve_listeners runs a task each."""
    count, nurseries = 0, list(trio.lowlevel.current_root_task().child_nurseries)
    while nurseries:
        for task in nurseries.pop().child_tasks:
            count += task.name.endswith("._run_handler")
            nurseries.extend(task.child_nurseries)
    return count


async def wait_for(predicate: Any, what: str, seconds: float) -> None:
    for _ in range(int(seconds / 0.1)):
        if predicate():
            return
        await trio.sleep(0.1)
    raise AssertionError(f"{what}: not within {seconds:g} s")


def untoward(caplog: pytest.LogCaptureFixture) -> list[str]:
    """apsd's log records with a traceback or an error, and the HTTP server's above INFO or saying that
    a connection broke (the daemon's own start-up warning about API keys is expected)."""
    return [f"{r.name} {r.levelname} {r.getMessage()}" for r in caplog.records
            if r.name.startswith("apsd") and (r.exc_info or r.exc_text or r.levelno >= logging.ERROR)
            or r.name == "apsd.hypercorn" and (r.levelno > logging.INFO or "connection broke" in r.getMessage())]


async def test_a_reader_that_stops_reading_is_dropped_and_its_request_cancelled(nursery, caplog):
    caplog.set_level(logging.INFO)
    admitted = Admitted()
    live = await slow_reader_daemon(nursery, admitted)
    sock = small_buffered_socket(live.url, 4096)
    sock.setblocking(False)
    with trio.socket.from_stdlib_socket(sock) as trio_sock:   # (closed whatever happens: never left stalled)
        await trio_sock.send(completion_request(live.url, STALLED_TOKENS))
        # read nothing until the server gives up on this client (at least 4 s, as a stalled reader would)
        await trio.sleep(4)
        await wait_for(lambda: peer_gone(sock), "a reader that reads nothing was not dropped",
                       SEND_TIMEOUT_S + DROP_MARGIN_S - 4)
        # then read what is left: the connection ends, without the answer's end
        received, ended = bytearray(), False
        with trio.move_on_after(10):
            for _ in range(10_000):
                try:
                    data = await trio_sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    ended = True
                    break
                received += data
    assert ended, f"the connection did not end once dropped ({len(received)} bytes read)"
    assert b"data: [DONE]" not in received

    # the request was cancelled (its stream abandoned: nothing kept for the client) or had ended;
    # nothing of the connection is left in the server, the daemon answers, the books close
    [request] = admitted.requests
    await wait_for(lambda: request.stream.abandoned or request.answered, "the request was kept", 10)
    await wait_for(lambda: connection_handlers() == 0, "the dropped connection's handler still runs", 10)
    async with live.client:
        assert (await live.client.get("/health")).status_code == 200
    pipeline = live.daemon.pipeline
    await wait_for(lambda: not pipeline.ledger.outstanding, "requests still outstanding", 30)

    # one line says what happened; no traceback, nothing above INFO
    assert sum(DROPPED in r.getMessage() for r in caplog.records) == 1, caplog.text
    assert untoward(caplog) == []
    live.daemon.request_shutdown()


def read_slowly(sock: socket.socket) -> tuple[bytes, bool]:
    """Read the whole response, ``READ_BYTES`` at most every ``READ_EVERY_S``, in a thread: its pace does
    not depend on the event loop. Returns the bytes and whether the server closed (EOF, not a reset)."""
    received = bytearray()
    deadline = time.monotonic() + 120
    for _ in range(int(120 / READ_EVERY_S)):
        if time.monotonic() > deadline:
            break
        try:
            data = sock.recv(READ_BYTES)
        except (ConnectionResetError, TimeoutError):
            return bytes(received), False
        if not data:
            return bytes(received), True
        received += data
        time.sleep(READ_EVERY_S)
    return bytes(received), False


def response_body(raw: bytes) -> tuple[int, bytes]:
    """The status and the (de-chunked) body of one HTTP/1.1 response, which must be complete."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/", headers=[("Host", "localhost"), ("Content-Length", "0")]))
    client.send(h11.EndOfMessage())
    client.receive_data(raw)
    status, body = 0, bytearray()
    for _ in range(10**6):
        event = client.next_event()
        if isinstance(event, h11.Response):
            status = event.status_code
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return status, bytes(body)
        else:
            raise AssertionError(f"the response is incomplete: {event!r} after {len(body)} bytes")
    raise AssertionError("the response never ends")


async def test_a_reader_that_reads_slowly_gets_the_whole_answer(nursery, caplog):
    caplog.set_level(logging.INFO)
    admitted = Admitted()
    live = await slow_reader_daemon(nursery, admitted)
    with small_buffered_socket(live.url, RECEIVE_BUFFER) as sock:
        sock.sendall(completion_request(live.url, SLOW_TOKENS))
        raw, closed = await trio.to_thread.run_sync(read_slowly, sock, abandon_on_cancel=True)
    assert closed, f"the slow reader's connection ended without the server closing it ({len(raw)} bytes)"
    status, body = response_body(raw)
    assert status == 200
    assert len(body) > 3 * 1024 * 1024   # (more than the kernels buffer: apsd's writes waited for the reader)
    events = [line.removeprefix(b"data: ") for line in body.split(b"\n\n") if line]
    assert events[-1] == b"[DONE]"
    usage = json.loads(events[-2])["usage"]
    assert usage["completion_tokens"] == SLOW_TOKENS
    assert not any(DROPPED in r.getMessage() for r in caplog.records)
    assert untoward(caplog) == []
    async with live.client:
        assert (await live.client.get("/health")).status_code == 200
    live.daemon.request_shutdown()
