"""systemd integration: a small sd_notify(3) client, the watchdog and the status line.

No dependency: the protocol is one datagram of ``KEY=value`` lines sent to the
AF_UNIX socket named by ``$NOTIFY_SOCKET`` (a filesystem path, or an abstract
socket written ``@name``). Without ``$NOTIFY_SOCKET`` (not started by systemd)
every method is a no-op, so the daemon calls them unconditionally.

Ownership: :class:`SystemdNotifier` holds no open resource. Like libsystemd's
``sd_notify``, each message goes out on a fresh non-blocking ``trio.socket``
datagram socket that is closed at once (nothing to close at shutdown, and a
re-executed systemd that rebinds the socket is still reached).
:func:`serve_watchdog` and :func:`serve_status` are loops for the daemon's nursery;
they support ``nursery.start``, and run until cancelled (or return at once when systemd
is not listening, or has no watchdog).

Error handling: a message that cannot be sent (socket missing, nobody reading,
address invalid) is dropped; the first failure is logged as a warning, later
ones at DEBUG. Nothing here raises into the daemon, except the ``is_alive`` and
``describe`` callables given to the loops: their exceptions are bugs and
propagate (the daemon stops loudly).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import attrs
import trio

if TYPE_CHECKING:
    from apsd.pipeline import Health

__all__ = ["ProgressProbe", "SystemdNotifier", "serve_status", "serve_watchdog", "status_line"]

log = logging.getLogger("apsd.serve.notify")

#: A message not taken by the notify socket within this many seconds is dropped.
SEND_TIMEOUT_S = 1.0
#: How often :func:`serve_status` refreshes ``STATUS=`` (only sent when it changed).
STATUS_INTERVAL_S = 5.0


def _parse_address(value: str | None) -> str | None:
    """``$NOTIFY_SOCKET`` as a socket address: a path, or ``@name`` -> ``"\\0name"``."""
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    # e.g. systemd >= 254's "vsock:CID:PORT", or a relative path (sd_notify refuses those too)
    log.warning("sd_notify: unsupported NOTIFY_SOCKET=%r (need an absolute path or @abstract); "
                "not notifying systemd", value)
    return None


def _parse_watchdog(environ: Mapping[str, str]) -> float | None:
    """The watchdog timeout in seconds from ``$WATCHDOG_USEC``, like ``sd_watchdog_enabled``.

    None when it is unset or invalid, or when ``$WATCHDOG_PID`` names another process
    (the variables were inherited from a parent that is the one being watched).
    """
    usec_text = environ.get("WATCHDOG_USEC")
    if not usec_text:
        return None
    pid_text = environ.get("WATCHDOG_PID")
    if pid_text:
        try:
            pid = int(pid_text)
        except ValueError:
            pid = 0
        if pid != os.getpid():
            log.debug("sd_notify: WATCHDOG_PID=%s is not this process (%d); watchdog off", pid_text, os.getpid())
            return None
    try:
        usec = int(usec_text)
    except ValueError:
        usec = 0
    if usec <= 0:
        log.warning("sd_notify: invalid WATCHDOG_USEC=%r; watchdog off", usec_text)
        return None
    return usec / 1_000_000


@attrs.define(eq=False)
class SystemdNotifier:
    """Tells systemd about the daemon's state. ``SystemdNotifier()`` does nothing.

    Every method is a coroutine that returns whether the message was sent (False
    when disabled or on a failure, which is logged once). ``status`` is the
    optional text of a ``STATUS=`` line sent in the same datagram.
    """

    #: The socket address (``"\\0name"`` for an abstract socket); None: disabled.
    address: str | None = None
    #: The systemd watchdog timeout in seconds (``WatchdogSec=``); None: no watchdog.
    watchdog_timeout_s: float | None = None
    _warned: bool = attrs.field(default=False, init=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> SystemdNotifier:
        """A notifier for ``$NOTIFY_SOCKET`` and ``$WATCHDOG_USEC``/``$WATCHDOG_PID``."""
        environ = os.environ if environ is None else environ
        address = _parse_address(environ.get("NOTIFY_SOCKET"))
        return cls(address=address, watchdog_timeout_s=_parse_watchdog(environ) if address else None)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    async def ready(self, status: str | None = None) -> bool:
        """``READY=1``: startup (or a reload) is complete; the service is serving."""
        return await self.send("READY=1", status=status)

    async def reloading(self, status: str | None = None) -> bool:
        """``RELOADING=1``: a reload begins; send :meth:`ready` when it is done (even if it failed)."""
        # MONOTONIC_USEC must be CLOCK_MONOTONIC (systemd compares it with its own reload
        # timestamp), not the trio clock, which may be virtual. clock_gettime_ns reads no
        # wall time into the pipeline; tests/unit/test_codebase.py forbids time.time/monotonic/
        # perf_counter/sleep and must keep allowing this one call.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return await self.send("RELOADING=1", f"MONOTONIC_USEC={usec}", status=status)

    async def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: a graceful shutdown has begun."""
        return await self.send("STOPPING=1", status=status)

    async def status(self, text: str) -> bool:
        """``STATUS=text``: one line shown by ``systemctl status``."""
        return await self.send(status=text)

    async def watchdog(self) -> bool:
        """``WATCHDOG=1``: keep-alive ping (see :func:`serve_watchdog`)."""
        return await self.send("WATCHDOG=1")

    async def send(self, *assignments: str, status: str | None = None) -> bool:
        """Send ``KEY=value`` assignments (and ``STATUS=status``) in one datagram."""
        if self.address is None:
            return False
        lines = list(assignments)
        if status is not None:
            lines.append("STATUS=" + " ".join(status.split()))  # one line: newlines end a field
        if not lines:
            return False
        try:
            with trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                with trio.move_on_after(SEND_TIMEOUT_S) as scope:
                    await sock.sendto("\n".join(lines).encode(), self.address)
            if scope.cancelled_caught:
                raise TimeoutError(f"not taken within {SEND_TIMEOUT_S:g} s (is anyone reading?)")
        except OSError as exc:
            self._failed(exc, lines)
            return False
        return True

    def _failed(self, exc: OSError, lines: list[str]) -> None:
        where = "@" + self.address[1:] if self.address and self.address.startswith("\0") else self.address
        if self._warned:
            log.debug("sd_notify: %s not sent to %s: %s", ",".join(lines), where, exc)
            return
        self._warned = True
        log.warning("sd_notify: cannot notify systemd at NOTIFY_SOCKET=%s: %s (apsd keeps serving; "
                    "later failures are logged at DEBUG only)", where, exc)


async def serve_watchdog(notifier: SystemdNotifier, is_alive: Callable[[], bool] = lambda: True,
                         *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Ping ``WATCHDOG=1`` every half watchdog timeout, but only while ``is_alive()``.

    The pings come from a trio task, so an event loop blocked by synchronous code
    (a policy stuck in a loop) stops them by itself; ``is_alive`` adds what only the
    pipeline knows (e.g. that the scheduler owes a decision it does not make). When a
    ping is withheld an error is logged once per stall; systemd kills (SIGABRT) and,
    with ``Restart=on-failure``, restarts the daemon after ``WatchdogSec=`` without one.

    Returns at once if the notifier has no watchdog; otherwise never returns.
    ``is_alive`` is called every half timeout, must be quick and synchronous; if it
    raises, the exception propagates.
    """
    task_status.started()
    if notifier.watchdog_timeout_s is None or not notifier.enabled:
        return
    period = notifier.watchdog_timeout_s / 2
    stalled = False
    while True:
        if is_alive():
            if stalled:
                log.warning("watchdog: the scheduler is alive again; pinging systemd again")
            stalled = False
            await notifier.watchdog()
        elif not stalled:
            stalled = True
            log.error("watchdog: the scheduler is stalled; withholding WATCHDOG=1 (systemd restarts "
                      "apsd %g s after the last ping)", notifier.watchdog_timeout_s)
        await trio.sleep(period)


@attrs.define(eq=False)
class ProgressProbe:
    """An ``is_alive`` for :func:`serve_watchdog` from a heartbeat counter and an "owed" test.

    ``progress()`` counts the loop's iterations (it only ever grows); ``owed()`` says
    whether the loop should be running now rather than waiting. The loop is stalled
    when two consecutive calls both find work owed and the counter unchanged: a whole
    watchdog period went by in which it owed a decision and made none. Legitimate
    waits (nothing owed) and busy loops (the counter moves) are alive.
    """

    progress: Callable[[], int]
    owed: Callable[[], bool]
    _last: int | None = attrs.field(default=None, init=False)

    def __call__(self) -> bool:
        count = self.progress()
        if not self.owed():
            self._last = None
            return True
        stalled = count == self._last
        self._last = count
        return not stalled


async def serve_status(notifier: SystemdNotifier, describe: Callable[[], str],
                       interval_s: float = STATUS_INTERVAL_S,
                       *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Send ``STATUS=describe()`` now and then every ``interval_s`` if it changed.

    Returns at once if the notifier is disabled; otherwise never returns.
    """
    task_status.started()
    if not notifier.enabled:
        return
    last = None
    while True:
        text = describe()
        if text != last and await notifier.status(text):
            last = text
        await trio.sleep(interval_s)


def status_line(health: Health, in_flight: int) -> str:
    """The ``STATUS=`` text, from :meth:`apsd.pipeline.Pipeline.health` and the requests in flight.

    ``queue=3 in_flight=5 governor=STABLE window=9.1ms state=serving``
    """
    governor = health.governor
    window = governor.window_ms
    window_text = f"{window:.1f}ms" if window is not None else "?"
    state = "serving" if health.status == "ok" else health.status
    return (f"queue={health.queue_depth} in_flight={in_flight} "
            f"governor={governor.state} window={window_text} state={state}")
