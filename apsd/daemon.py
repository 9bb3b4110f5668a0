"""The daemon: one root nursery owning signals, the pipeline's stages and the HTTP server.

Ownership: :meth:`Daemon.run` opens the root nursery. Its children are the
signal watcher, the pipeline's stages (admission, the scheduler's loops, the
executors: in a nested nursery of their own, so they can be stopped first) and
``hypercorn.trio.serve`` (started with ``nursery.start`` so the bound address is
known before anyone is told the daemon is ready). A crash in any of them
cancels the rest and propagates: the daemon stops loudly.

Shutdown (SIGTERM/SIGINT or :meth:`request_shutdown`): new requests get 503;
queued and running requests get ``server.shutdown_grace_s`` wall seconds to
finish (a second SIGTERM/SIGINT ends the grace period at once); whatever is left
is answered 503 (tokens refunded) and the stages are cancelled; then hypercorn
stops after sending those answers and :meth:`run` returns normally. SIGHUP is
logged and ignored (configuration reload is not implemented yet).
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import attrs
import hypercorn.config
import hypercorn.trio
import pluggy
import trio

from .api import create_app
from .config import Config
from .pipeline import Pipeline
from .plugins import load_policy_registry, make_plugin_manager
from .policy import PolicyRegistry, PolicySet

__all__ = ["Daemon"]

log = logging.getLogger("apsd")

#: Seconds hypercorn waits for responses still being written after we stop it.
HTTP_GRACEFUL_TIMEOUT_S = 2.0


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@attrs.define(eq=False)
class Daemon:
    """Build with :meth:`from_config` (validates policies before anything runs)."""

    config: Config
    policies: PolicySet
    plugin_manager: pluggy.PluginManager
    registry: PolicyRegistry
    handle_signals: bool = True
    pipeline: Pipeline | None = None
    _stop: trio.Event = attrs.field(factory=trio.Event)
    _hurry: trio.Event = attrs.field(factory=trio.Event)

    @classmethod
    def from_config(cls, config: Config, *, preset: str | None = None, handle_signals: bool = True,
                    plugin_manager: pluggy.PluginManager | None = None) -> Daemon:
        """Load plugins and build the configured policies; raises ConfigError or PluginError."""
        pm = plugin_manager or make_plugin_manager()
        registry = load_policy_registry(pm)
        policies = registry.build(config, preset)
        return cls(config=config, policies=policies, plugin_manager=pm, registry=registry,
                   handle_signals=handle_signals)

    def request_shutdown(self) -> None:
        """Begin a graceful shutdown (what SIGTERM does); a second call ends the grace period now."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until shut down; ``task_status.started`` receives the bound URLs."""
        pipeline = self.pipeline = Pipeline.build(self.config, self.policies)
        async with trio.open_nursery() as nursery:
            if self.handle_signals:
                await nursery.start(self._watch_signals)
            await nursery.start(pipeline.run_stages)
            http_stop = trio.Event()
            http_done = trio.Event()
            binds = await nursery.start(self._serve_http, pipeline, http_stop, http_done)
            log.info("apsd listening on %s policy=%s tenants=%s gpus=%d",
                     ", ".join(binds), "/".join(f"{k}={v}" for k, v in self.policies.names.items()),
                     ",".join(sorted(self.config.tenants)), self.config.gpu.count)
            task_status.started(binds)

            await self._stop.wait()
            log.info("apsd shutting down: %d requests in flight, grace %.1f s",
                     len(pipeline.ledger.outstanding), self.config.server.shutdown_grace_s)
            pipeline.close_doors()
            with trio.move_on_after(self.config.server.shutdown_grace_s):
                async with trio.open_nursery() as drain:  # whichever comes first: idle, or a 2nd signal
                    async def finish_when(event_wait: Callable[[], Awaitable[object]]) -> None:
                        await event_wait()
                        drain.cancel_scope.cancel()
                    drain.start_soon(finish_when, pipeline.ledger.wait_idle)
                    drain.start_soon(finish_when, self._hurry.wait)
            aborted = pipeline.abort_outstanding()
            pipeline.stop_stages()  # nothing runs, or is billed, after the last answer
            if aborted:
                log.warning("answered %d unfinished requests with 503", aborted)
            http_stop.set()
            await http_done.wait()
            nursery.cancel_scope.cancel()
        log.info("apsd stopped")

    async def _serve_http(self, pipeline: Pipeline, stop: trio.Event, done: trio.Event,
                          *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        config = hypercorn.config.Config()
        config.bind = [_bind_address(self.config.server.host, self.config.server.port)]
        config.accesslog = None
        config.errorlog = logging.getLogger("apsd.hypercorn")
        config.graceful_timeout = HTTP_GRACEFUL_TIMEOUT_S
        try:
            await hypercorn.trio.serve(create_app(pipeline), config, shutdown_trigger=stop.wait,
                                       task_status=task_status)
        finally:
            done.set()

    async def _watch_signals(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:  # caught so it cannot kill the daemon mid-request
                    log.warning("received SIGHUP: configuration reload is not supported yet; ignored")
                    continue
                log.info("received %s%s", name, " again: grace period ends now" if self._stop.is_set() else "")
                self.request_shutdown()
