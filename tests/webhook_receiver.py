"""A real HTTP server that receives webhooks, for tests: trio and h11 on a free loopback port.

:func:`open_webhook_receiver` runs one for the body of an ``async with``; it records every request
(method, path, headers, body) and answers each with the next status of ``answers`` (then 200). It
serves in a nursery of its own, closed on the way out: nothing outlives the test.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import attrs
import h11
import trio

__all__ = ["Received", "WebhookReceiver", "open_webhook_receiver"]

#: Bytes a request head and body may take, at most (a test's alerts are far smaller).
MAX_BYTES = 1 << 20


@attrs.frozen
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    #: The status it was answered with.
    status: int


@attrs.define(eq=False)
class WebhookReceiver:
    url: str
    #: Statuses to answer the first requests with, in order (then 200).
    answers: list[int] = attrs.field(factory=list)
    received: list[Received] = attrs.field(factory=list)
    #: The body (and its type) of every answer: an OTLP receiver answers an empty protobuf message.
    reply: bytes = b"ok"
    reply_type: str = "text/plain"
    _arrived: trio.Event = attrs.field(factory=trio.Event)

    async def wait_for(self, count: int, limit_s: float) -> list[Received]:
        """The requests received, once there are ``count`` (fails after ``limit_s`` wall seconds)."""
        with trio.fail_after(limit_s):
            while len(self.received) < count:
                await self._arrived.wait()
        return list(self.received)

    async def serve_one(self, stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_BYTES)
        with trio.move_on_after(30):
            async with stream:
                while True:
                    head: h11.Request | None = None
                    body = b""
                    while True:
                        event = connection.next_event()
                        if event is h11.NEED_DATA:
                            data = await stream.receive_some(65536)
                            connection.receive_data(data)
                            if not data and head is None:
                                return
                            continue
                        if isinstance(event, h11.Request):
                            head = event
                        elif isinstance(event, h11.Data):
                            body += event.data
                        elif isinstance(event, h11.EndOfMessage):
                            break
                        elif isinstance(event, h11.ConnectionClosed):
                            return
                    assert head is not None
                    status = self.answers.pop(0) if self.answers else 200
                    self.received.append(Received(
                        head.method.decode(), head.target.decode(),
                        {name.decode().lower(): value.decode() for name, value in head.headers}, body, status))
                    self._arrived.set()
                    self._arrived = trio.Event()
                    await stream.send_all(connection.send(h11.Response(status_code=status, headers=[
                        ("Content-Length", str(len(self.reply))), ("Content-Type", self.reply_type)])))
                    if self.reply:
                        await stream.send_all(connection.send(h11.Data(data=self.reply)))
                    await stream.send_all(connection.send(h11.EndOfMessage()))
                    if connection.our_state is h11.MUST_CLOSE:
                        return
                    connection.start_next_cycle()


@asynccontextmanager
async def open_webhook_receiver(answers: Sequence[int] = (), path: str = "/hooks/apsd", reply: bytes = b"ok",
                                reply_type: str = "text/plain") -> AsyncIterator[WebhookReceiver]:
    """A receiver listening on 127.0.0.1 (a free port) for the body of the ``async with``; its ``url``
    ends with ``path``; it answers ``reply`` (of ``reply_type``)."""
    receiver = WebhookReceiver(url="", answers=list(answers), reply=reply, reply_type=reply_type)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, receiver.serve_one, 0, host="127.0.0.1"))
        receiver.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}{path}"
        try:
            yield receiver
        finally:
            nursery.cancel_scope.cancel()
