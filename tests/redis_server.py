"""A real ``redis-server`` for tests: Debian's package, on a free loopback port, stopped by its PID.

:func:`open_redis_server` runs one for the body of an ``async with`` (no persistence: ``--save ""``,
``--appendonly no``); :meth:`RedisServer.kill` and :meth:`RedisServer.restart` stop it hard and
start it again on the same port, for outage tests. A missing binary skips the test, or fails it
when ``APSD_REQUIRE_BACKENDS=1`` (CI sets it; ``.ci/run`` installs the package).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import pytest
import trio

from .llama_server import REQUIRE_ENV

__all__ = ["RedisServer", "free_loopback_port", "open_redis_server", "require_redis_server"]


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def require_redis_server() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        reason = "redis-server is not installed (Debian package 'redis-server'; .ci/run installs it)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


@attrs.define
class RedisServer:
    binary: str
    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        with trio.fail_after(10):
            while True:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                        sock.sendall(b"PING\r\n")
                        if sock.recv(16).startswith(b"+PONG"):
                            return
                except OSError:
                    pass
                assert self.process.poll() is None, "redis-server exited at start"
                await trio.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: its data (no persistence) goes with it."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    async def restart(self) -> None:
        self.kill()
        await self.start()


@asynccontextmanager
async def open_redis_server() -> AsyncIterator[RedisServer]:
    server = RedisServer(require_redis_server(), free_loopback_port())
    await server.start()
    try:
        yield server
    finally:
        server.kill()
