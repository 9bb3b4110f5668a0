"""The keep-alive race (pgjones/hypercorn#235): a request that reaches a kept-alive connection as its
idle timer expires must be answered, not dropped with the connection.

The race is made deterministic rather than hoped for. The daemon runs in the test's own event loop,
so the test can stop that loop: it sends the next request's bytes on a raw socket and then blocks
the loop (``time.sleep``) until well past the idle deadline. When the loop runs again the bytes are
already there and the timer has already expired, both at once, which is what a loaded server sees
when a client reuses a connection just as the timer fires. Nothing here depends on wall-clock time
the test does not control: a slower machine only blocks the loop longer, which changes nothing.
"""

from __future__ import annotations

import inspect
import select
import socket
import time
from importlib.metadata import version
from urllib.parse import urlsplit

import h11
import trio
import trio.testing

from apsd.core.config import ServerConfig
from tests.helpers import FAST_GPU, ROOT, make_config, start_daemon

#: The daemon's [server] keep_alive_timeout_s in these tests.
KEEP_ALIVE_S = 0.3
#: Tries per test: trio runs the two tasks that wake together (the connection's reader and its idle
#: timer) in a random order, and every order must answer.
TRIES = 6


class Client:
    """HTTP/1.1 on one raw, non-blocking socket: async reads, and a synchronous send for while the
    event loop is held."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port))
        self.sock.setblocking(False)
        self.h11 = h11.Connection(h11.CLIENT)

    def request_bytes(self, path: str = "/health") -> bytes:
        return self.h11.send(h11.Request(method="GET", target=path, headers=[("Host", "localhost")])) + \
            self.h11.send(h11.EndOfMessage())

    def send_now(self, data: bytes) -> None:
        """Send without yielding to the event loop (the server does not run meanwhile)."""
        assert self.sock.send(data) == len(data)

    def closed_by_server(self) -> bool:
        """Whether the server has closed its end already (readable while no answer is owed: EOF)."""
        poller = select.poll()
        poller.register(self.sock, select.POLLIN | select.POLLHUP)
        return bool(poller.poll(0))

    async def answer(self) -> int | None:
        """The status of the answer to the request sent, or None if the connection closed without one."""
        status = None
        with trio.fail_after(10):
            while True:
                event = self.h11.next_event()
                if event is h11.NEED_DATA:
                    await trio.lowlevel.wait_readable(self.sock)
                    try:
                        data = self.sock.recv(65536)
                    except ConnectionResetError:
                        return None
                    self.h11.receive_data(data)
                    if not data:
                        try:
                            event = self.h11.next_event()
                        except h11.RemoteProtocolError:
                            return None
                        if isinstance(event, h11.ConnectionClosed) and status is None:
                            return None
                    continue
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.EndOfMessage):
                    self.h11.start_next_cycle()
                    return status
                elif isinstance(event, h11.ConnectionClosed):
                    return None

    def close(self) -> None:
        self.sock.close()


async def keep_alive_daemon(nursery):
    config = make_config(server=ServerConfig(host="127.0.0.1", port=0, keep_alive_timeout_s=KEEP_ALIVE_S),
                         gpu=FAST_GPU)
    return await start_daemon(nursery, config)


async def idle_connection(url: str) -> Client | None:
    """A connection that has had one answer and whose idle timer runs now; None if the server closed
    it already (only on a machine too slow to get here within KEEP_ALIVE_S: that try says nothing)."""
    client = Client(url)
    client.send_now(client.request_bytes())
    assert await client.answer() == 200
    await trio.testing.wait_all_tasks_blocked()   # the server has finished the answer: its idle timer runs
    if client.closed_by_server():
        client.close()
        return None
    return client


async def some_idle_connection(url: str) -> Client:
    """:func:`idle_connection`, tried up to ``TRIES`` times (a loaded machine may be too slow once)."""
    for _ in range(TRIES):
        client = await idle_connection(url)
        if client is not None:
            return client
    raise AssertionError(f"the server closed each of {TRIES} connections before its idle timer could run")


async def test_a_request_that_arrives_as_the_idle_timer_fires_is_answered(nursery):
    running = await keep_alive_daemon(nursery)
    answers = []
    for _ in range(TRIES):
        client = await idle_connection(running.url)
        if client is None:
            continue
        client.send_now(client.request_bytes())   # it reaches the server's socket now...
        time.sleep(KEEP_ALIVE_S * 1.5)            # ...and the idle deadline passes before the server looks
        answers.append(await client.answer())
        client.close()
    assert answers, "no try got as far as sending its second request"
    assert answers == [200] * len(answers)        # every request got an answer
    running.daemon.request_shutdown()


async def test_a_request_begun_before_the_idle_timer_fires_is_answered_when_it_completes(nursery):
    """Its first bytes came in time, the rest after the deadline: still answered."""
    running = await keep_alive_daemon(nursery)
    answers = []
    for _ in range(TRIES):
        client = await idle_connection(running.url)
        if client is None:
            continue
        request = client.request_bytes()
        client.send_now(request[:10])
        time.sleep(KEEP_ALIVE_S * 1.5)
        await trio.testing.wait_all_tasks_blocked()   # the server has seen the expired timer and the bytes
        try:
            client.send_now(request[10:])
        except (ConnectionResetError, BrokenPipeError):   # (dropped: the server closed on its first bytes)
            answers.append(None)
        else:
            answers.append(await client.answer())
        client.close()
    assert answers and answers == [200] * len(answers)
    running.daemon.request_shutdown()


async def test_a_request_that_never_completes_is_closed_in_bounded_time(nursery):
    """The grace a begun request gets is bounded: a client that sends a few bytes and stops (slowloris)
    does not keep its connection."""
    running = await keep_alive_daemon(nursery)
    client = await some_idle_connection(running.url)
    client.send_now(client.request_bytes()[:10])
    assert await client.answer() is None          # (closed, not answered: 10 s is far beyond the bound)
    client.close()
    fresh = Client(running.url)                   # a new connection that sends nothing: closed too
    assert await fresh.answer() is None
    fresh.close()
    running.daemon.request_shutdown()


async def test_an_idle_connection_is_still_closed_after_the_timeout(nursery):
    running = await keep_alive_daemon(nursery)
    client = await some_idle_connection(running.url)
    started = trio.current_time()
    assert await client.answer() is None
    assert trio.current_time() - started < KEEP_ALIVE_S + 5
    client.close()
    running.daemon.request_shutdown()


def test_the_hypercorn_that_serving_was_written_for():
    """apsd.serve.server overrides private methods of hypercorn's trio TCPServer: the installed hypercorn
    must be the release it was written against (pyproject.toml pins it), with those methods."""
    from hypercorn.trio.tcp_server import TCPServer

    from apsd.serve import server as serving

    assert version("hypercorn") == serving.HYPERCORN_VERSION
    for name in ("_read_data", "_idle_timeout", "_initiate_server_close", "protocol_send"):
        assert inspect.iscoroutinefunction(getattr(TCPServer, name)), name
    assert f'"hypercorn[trio]=={serving.HYPERCORN_VERSION}"' in (ROOT / "pyproject.toml").read_text()
