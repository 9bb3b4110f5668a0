"""apsd's HTTP server: hypercorn's trio worker, with its keep-alive race fixed and its writes bounded.

The race (pgjones/hypercorn#235, open in hypercorn 0.18.0). Hypercorn's trio ``TCPServer`` runs two
tasks per connection: a reader, and an idle timer started when an answer ends (and when the
connection opens). The timer is stopped only once a *complete* request head has been parsed. So
when the next request reaches a kept-alive connection just as the timer expires, the connection is
closed under it and the client gets no answer:

* bytes of the request were already read, but not yet a whole head (the timer does not know);
* the request's bytes and the timer's deadline are both due when the event loop next looks (a busy
  loop, or plain coincidence): trio runs the two woken tasks in either order, and if the timer goes
  first it closes the socket with the request unread in it. If the reader goes first, it reads the
  request, but it yields (taking a lock) before it stops the timer, which then closes the socket.

A client (or a proxy reusing its pooled connection) sees that as a failed request; it must not
retry a POST, which in apsd may have cost a tenant tokens.

The fix, :class:`KeepAliveTCPServer`: when the idle deadline passes, the timer closes the connection
only if no byte has arrived since the connection became idle, neither read by the reader (a counter
it keeps) nor waiting in the socket (a zero-timeout ``poll``). Both checks and the close happen with
no checkpoint in between, so the reader cannot slip in. A request that has begun gets another
``keep_alive_timeout`` for its head to arrive in full (when it does, hypercorn stops the timer as
usual); one that does not is closed then, so a client that sends a few bytes and stops holds the
connection at most twice the timeout. What remains is HTTP/1.1's own race, which no server can close:
a request sent after the server has already decided to close (its FIN is on the way). Clients retry
idempotent requests on that (RFC 9112 section 9.3.1); nginx's ``keepalive_timeout`` below apsd's
(``deploy/nginx/apsd.conf``) avoids it.

The send timeout (``[server] send_timeout_s``). Hypercorn writes each piece of an answer with
``send_all`` in a shielded cancel scope (a cancelled request must not leave half a chunk on the
wire). A client that stops reading therefore holds the writing task, its connection and what apsd
keeps for it for as long as it keeps its socket open, and a ``move_on_after`` around the app's ASGI
``send`` cannot end that write: the deadline passes inside the shield, and when the write returns (if
the client ever reads again) there is no checkpoint left before the scope ends, so nothing is
cancelled. :class:`KeepAliveTCPServer` bounds the write itself, inside the shield:

* it writes what the kernel takes, trying again every quarter of the timeout (a second at most):
  the kernel takes more soon after the client reads some, although it reports the socket writable
  only once a third of its buffer is free (measured on loopback: after a stall filled the buffer,
  a client reading 4 KB every 0.2 s waited 26 s for that). What the kernel takes restarts the
  timer, so a reader that keeps reading is not dropped, however slowly;
* once the kernel has taken nothing for ``send_timeout`` seconds, the connection is dropped: reset
  (``SO_LINGER`` 0, as nginx's ``reset_timedout_connection``: what the kernel still holds for the
  client is freed at once, not kept in FIN-WAIT), the request's stream is closed as hypercorn closes
  it when a client leaves (the app receives ``http.disconnect``, quart-trio cancels the request, and
  apsd cancels it in the pipeline), and one INFO line says so. The app's ``send`` returns and its
  next checkpoint is cancelled; writes that come before then find the socket closed, which is
  hypercorn's ordinary "client gone" path.

The timeout comes from the app, through the ASGI lifespan state under :data:`SEND_TIMEOUT_STATE`
(apsd's app puts ``[server] send_timeout_s`` there: :class:`apsd.serve.http.common.ShieldResponseEnd`);
without it writes are unbounded, as in hypercorn. A TLS connection's writes are bounded as a whole
(a cancelled TLS write cannot be resumed).

Why not ``hypercorn.trio.serve``: it builds hypercorn's own ``TCPServer`` by name, and the only way
to substitute another would be to monkeypatch ``hypercorn.trio.run``. :func:`serve_http` is instead
hypercorn's trio worker (``hypercorn.trio.run.worker_serve``) with that one class replaced, minus what
apsd does not use (QUIC, statsd, ``max_requests``). The subclass overrides private methods of
``TCPServer``, so hypercorn is pinned to :data:`HYPERCORN_VERSION` (``pyproject.toml``), and
``tests/daemon/test_keepalive.py`` checks both the version and the race. Before raising the pin, re-read
``hypercorn/trio/tcp_server.py`` and ``hypercorn/trio/run.py`` (and drop this if #235 is fixed there).

Ownership: :func:`serve_http` supports ``nursery.start`` (it hands back the bound URLs once it
listens) and owns everything it opens: the ASGI lifespan task, the listeners and one task per
connection. It returns after ``shutdown_trigger`` returns and the open connections have finished or
``config.graceful_timeout`` has passed (hypercorn's own shutdown: idle connections are closed at once;
a write under way is shielded, so a stalled client holds the shutdown at most ``send_timeout`` longer).
"""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Awaitable, Callable
from functools import partial
from math import inf

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState, Framework, LifespanState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

__all__ = ["HYPERCORN_VERSION", "SEND_TIMEOUT_STATE", "KeepAliveTCPServer", "serve_http"]

#: The hypercorn release whose ``TCPServer`` internals :class:`KeepAliveTCPServer` overrides.
HYPERCORN_VERSION = "0.18.0"
#: The ASGI lifespan state key under which the app gives the send timeout (seconds) to
#: :func:`serve_http` at startup.
SEND_TIMEOUT_STATE = "apsd.send_timeout_s"
#: The longest a waiting write waits before it tries again (a quarter of the send timeout if less).
SEND_RETRY_S = 1.0


class KeepAliveTCPServer(TCPServer):
    """Hypercorn's trio connection handler, except that a request whose first bytes arrived before the
    idle timer fired is answered, and a client that takes nothing of its answer for ``send_timeout``
    seconds (``None``: no limit) is dropped (see the module docstring)."""

    def __init__(self, *args: object, send_timeout: float | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        #: Bytes read from the client so far, and that count when the connection last became idle.
        self.received = 0
        self.received_when_idle = 0
        self.send_timeout = send_timeout

    async def protocol_send(self, event: Event) -> None:
        if isinstance(event, RawData) and self.send_timeout is not None:
            # hypercorn 0.18.0's TCPServer.protocol_send for RawData, with the write bounded
            async with self.send_lock:
                try:
                    with trio.CancelScope(shield=True):
                        if not await self._send_bounded(event.data):
                            await self._drop_stalled()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.protocol.handle(Closed())
            return
        if isinstance(event, Updated) and event.idle:
            self.received_when_idle = self.received  # (before the timer restarts: no checkpoint between)
        await super().protocol_send(event)

    async def _send_bounded(self, data: bytes) -> bool:
        """``self.stream.send_all(data)``, except that it gives up, returning False, once the client has
        taken nothing for ``send_timeout`` seconds (the stream is then in an unknown state: drop it).
        Raises what ``send_all`` raises when the connection is closed or broken."""
        timeout = self.send_timeout
        assert timeout is not None
        stream: trio.abc.Stream = self.stream   # (hypercorn declares the TLS kind; plain sockets come too)
        if not isinstance(stream, trio.SocketStream):   # TLS: the write as a whole
            with trio.move_on_after(timeout):
                await stream.send_all(data)
                return True
            return False
        sock = stream.socket
        if sock.did_shutdown_SHUT_WR:
            raise trio.ClosedResourceError("can't send data after sending EOF")
        if not data:   # (h11's end of a Content-Length body)
            if sock.fileno() == -1:
                raise trio.ClosedResourceError("the socket was already closed")
            await trio.lowlevel.checkpoint()
            return True
        # SocketStream.send_all's loop, with a deadline on each socket.send: cancelled, it has sent
        # nothing, so the loop goes on where it stopped, and the next call tries at once before it
        # waits for the socket to be reported writable (which may be long after the client read).
        remaining = memoryview(data)
        taken_at = trio.current_time()   # when the kernel last took bytes: the client is reading
        try:
            while remaining:
                sent = 0
                with trio.move_on_after(min(timeout / 4, SEND_RETRY_S)):
                    sent = await sock.send(remaining)
                if sent:
                    remaining, taken_at = remaining[sent:], trio.current_time()
                elif trio.current_time() - taken_at >= timeout:
                    return False
        except OSError as exc:   # (as trio's SocketStream translates them)
            if sock.fileno() == -1:
                raise trio.ClosedResourceError("the socket was already closed") from None
            raise trio.BrokenResourceError(f"socket connection broken: {exc}") from exc
        return True

    async def _drop_stalled(self) -> None:
        """Close the connection of a client that took nothing for ``send_timeout``: a reset (what the
        kernel still holds for it is freed), and its request's stream closed as if it had left."""
        stream = self.stream
        sock = getattr(stream, "socket", None) or getattr(getattr(stream, "transport_stream", None), "socket", None)
        client = "a client"
        try:
            if sock is not None:
                host, port, *_ = sock.getpeername()
                client = f"the client {host}:{port}"
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except (OSError, ValueError):
            pass
        await self.config.log.info("%s took nothing of its answer for %g s ([server] send_timeout_s): "
                                   "its connection is dropped", client, self.send_timeout)
        await self.protocol.handle(Closed())   # the request's stream ends: the app gets http.disconnect
        await trio.aclose_forcefully(stream)

    async def _read_data(self) -> None:
        # hypercorn 0.18.0's TCPServer._read_data, counting what arrives before handing it on
        while True:
            try:
                with trio.fail_after(self.config.read_timeout or inf):
                    data = await self.stream.receive_some(MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError, trio.TooSlowError):
                break
            else:
                self.received += len(data)
                await self.protocol.handle(RawData(bytes(data)))
                if data == b"":
                    break
        await self.protocol.handle(Closed())

    async def _idle_timeout(self) -> None:
        terminated = self.context.terminated
        with trio.move_on_after(self.config.keep_alive_timeout):
            await terminated.wait()
        if not terminated.is_set() and self._request_begun():
            # A request is on its way: hypercorn cancels this task once its head is in; give it that
            # long again (bounded: a client that sends a few bytes and stops is closed after it).
            with trio.move_on_after(self.config.keep_alive_timeout):
                await terminated.wait()
        with trio.CancelScope(shield=True):  # (no checkpoint since _request_begun: nothing slipped in)
            await self._initiate_server_close()

    def _request_begun(self) -> bool:
        """Whether bytes have arrived since the connection became idle: read, or waiting in the socket."""
        if self.received != self.received_when_idle:
            return True
        stream = self.stream
        sock = getattr(stream, "socket", None) or getattr(getattr(stream, "transport_stream", None), "socket", None)
        if sock is None:
            return False
        try:
            poller = select.poll()  # (not select.select: descriptors above 1024 are normal here)
            poller.register(sock.fileno(), select.POLLIN)
            return bool(poller.poll(0))  # (readable at EOF too: the reader then closes it itself)
        except (OSError, ValueError, AttributeError):
            return False


async def serve_http(app: Framework, config: Config, *, shutdown_trigger: Callable[[], Awaitable[object]],
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI ``app`` as ``hypercorn.trio.serve(app, config, shutdown_trigger=...)`` does, each
    connection handled by :class:`KeepAliveTCPServer` with the send timeout the app put in its lifespan
    state (:data:`SEND_TIMEOUT_STATE`); ``task_status.started`` receives the bound URLs."""
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: LifespanState = {}
    lifespan = Lifespan(wrapped, config, lifespan_state)
    context = WorkerContext(None)

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        send_timeout = lifespan_state.get(SEND_TIMEOUT_STATE)

        async with trio.open_nursery() as server_nursery:
            sockets = config.create_sockets()
            if sockets.quic_sockets:
                raise ValueError("apsd does not serve HTTP/3 (QUIC): leave quic_bind empty")
            listeners: list[trio.SSLListener[trio.SocketStream] | trio.SocketListener] = []
            binds = []
            ssl_context = config.create_ssl_context()
            for sock in sockets.secure_sockets:
                assert ssl_context is not None   # (hypercorn makes secure sockets only with a certificate)
                sock.listen(config.backlog)
                listeners.append(trio.SSLListener(trio.SocketListener(trio.socket.from_stdlib_socket(sock)),
                                                  ssl_context, https_compatible=True))
                binds.append(f"https://{repr_socket_addr(sock.family, sock.getsockname())}")
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
            for bind in binds:
                await config.log.info(f"Running on {bind}")

            task_status.started(binds)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(partial(
                        trio.serve_listeners,
                        partial(KeepAliveTCPServer, wrapped, config, context, ConnectionState(lifespan_state.copy()),
                                send_timeout=send_timeout),
                        listeners, handler_nursery=server_nursery))
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, others = error.split((ShutdownError, KeyboardInterrupt))
                if others is not None:
                    raise others from None
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout

        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
