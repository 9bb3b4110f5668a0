"""The daemon: the pipeline's stages, the signal watcher and the HTTP server, under one owner.

Ownership: :meth:`Daemon.run` runs the pipeline with :func:`~apsd.pipeline.open_pipeline`
(whose nursery holds the stages: admission, the scheduler's loops, the engines, in a
nested nursery of their own so they can be stopped first) and, inside it, opens the
daemon's nursery: the signal watcher and the HTTP server (:func:`apsd.serve.server.serve_http`:
hypercorn's trio worker with its keep-alive race fixed; started with
``nursery.start`` so the bound address is known before anyone is told the daemon is
ready). A crash in any of them cancels the rest and propagates: the daemon stops loudly.

systemd (:mod:`apsd.serve.notify`, a no-op without ``$NOTIFY_SOCKET``): ``READY=1`` once
the HTTP socket listens; ``STATUS=`` lines and ``WATCHDOG=1`` pings from two more
root-nursery tasks; ``STOPPING=1`` when shutdown begins. :attr:`Daemon.notifier`
is there for the reload to send ``RELOADING=1`` and ``READY=1``.

Shutdown (SIGTERM/SIGINT or :meth:`request_shutdown`): new requests get 503 (so does ``/ready``);
queued and running requests get ``server.shutdown_grace_s`` wall seconds to
finish (a second SIGTERM/SIGINT ends the grace period at once); whatever is left
is answered 503 (tokens refunded) and the stages are cancelled; then hypercorn
stops after sending those answers and :meth:`run` returns normally. SIGHUP
re-reads the config file (:meth:`reload`).
"""

from __future__ import annotations

import functools
import gc
import logging
import signal
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import hypercorn.config
import pluggy
import trio

from apsd import engines
from apsd.core.bucket import TokenBucket
from apsd.core.config import Config, ConfigError, load_config
from apsd.core.policy import PolicyRegistry, PolicySet
from apsd.core.version import VERSION as __version__
from apsd.engines.profiles import ProfileRegistry
from apsd.pipeline import Pipeline, open_pipeline
from apsd.plugins import PluginError, load_policy_registry, load_profile_registry, make_plugin_manager
from apsd.policies.fair import tenant_weights
from apsd.serve import logs
from apsd.serve.alerts import BudgetAlerts
from apsd.serve.auth import KeyRing, check_exposure
from apsd.serve.http import create_app, create_asgi
from apsd.serve.http.ui import sampler_for
from apsd.serve.notify import ProgressProbe, SystemdNotifier, serve_status, serve_watchdog, status_line
from apsd.serve.server import serve_http
from apsd.serve.tracing import Tracing
from apsd.state.keeper import StateKeeper, open_keeper
from apsd.state.usage import UsageRecorder

__all__ = ["Daemon"]

#: The collector's thresholds while the daemon serves (the young generation's first): see _serve_http.
GC_THRESHOLDS = (20_000, 20, 100)

log = logging.getLogger("apsd")

#: Seconds hypercorn waits for responses still being written after we stop it.
HTTP_GRACEFUL_TIMEOUT_S = 2.0


class ClientTransportErrors(logging.Filter):
    """Turns hypercorn's "Error in ASGI Framework" tracebacks that are only a client's connection
    breaking under an answer into one INFO line without the traceback.

    A client that sends more on a connection hypercorn is closing (a pipelined request after a
    413 ``Connection: close``, then a hang-up) makes hypercorn 0.18 send twice on one socket, and
    trio raises ``BusyResourceError``; a vanished client gives ``BrokenResourceError``. Nothing in
    apsd failed and nothing is lost (the request was answered or never read), so an unauthenticated
    client must not be able to fill the log with ERROR tracebacks. Any other exception is untouched.
    """

    BENIGN = (trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError)

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is not None and _only(error, self.BENIGN):
            record.msg, record.args = "a client's connection broke while it was being answered (%s)", (
                type(_first_leaf(error)).__name__,)
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info = record.exc_text = None
        return True


def _only(error: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    if isinstance(error, BaseExceptionGroup):
        return all(_only(inner, kinds) for inner in error.exceptions)
    return isinstance(error, kinds)


def _first_leaf(error: BaseException) -> BaseException:
    return _first_leaf(error.exceptions[0]) if isinstance(error, BaseExceptionGroup) else error


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files to the hard limit (each connection holds one).

    The usual soft limit, 1024, lets a thousand idle or slow clients lock everyone else out;
    the hard limit (systemd's ``LimitNOFILE=``, the unit sets 65536) is what the operator allows.
    """
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = 1 << 20 if hard == resource.RLIM_INFINITY else hard  # (an unlimited hard limit)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            log.info("open-file limit raised from %d to %d", soft, wanted)
    except (ImportError, ValueError, OSError) as exc:  # not POSIX, or not allowed: keep what we have
        log.warning("could not raise the open-file limit: %s", exc)


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _shared_port_bind(host: str, port: int) -> str:
    """An ``fd://`` bind for hypercorn: a socket bound to ``host:port`` with SO_REUSEPORT (hypercorn
    takes the descriptor over, listens on it and closes it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return f"fd://{sock.detach()}"


def bucket_levels(pipeline: Pipeline, wall: float) -> dict[str, tuple[float, float]]:
    """Each tenant's bucket level now, with the Unix time ``wall`` (this process's own buckets only:
    shared ones live in Redis)."""
    if pipeline.store.kind != "memory":
        return {}
    now = pipeline.clock.now()
    return {name: (bucket.level(now), wall) for name, bucket in pipeline.admission.buckets.items()}


def restore_buckets(pipeline: Pipeline, saved: Mapping[str, tuple[float, float]], wall: float) -> list[str]:
    """Set each tenant's bucket to its saved level plus what its rate refilled since (model seconds:
    wall seconds over ``gpu.time_scale``), capped at its burst; returns the tenants restored."""
    if pipeline.store.kind != "memory":
        return []
    now = pipeline.clock.now()
    restored = []
    for name, (tokens, at) in sorted(saved.items()):
        bucket = pipeline.admission.buckets.get(name)
        if not isinstance(bucket, TokenBucket):
            continue
        elapsed = max(0.0, wall - at) / pipeline.clock.time_scale
        bucket.tokens, bucket.updated = min(bucket.burst, tokens + elapsed * bucket.rate), now
        restored.append(name)
    return restored


@attrs.define(eq=False)
class Daemon:
    """Build with :meth:`from_config` (validates policies before anything runs)."""

    config: Config
    policies: PolicySet
    plugin_manager: pluggy.PluginManager
    registry: PolicyRegistry
    #: GPU and model profiles (built-ins and plugins') for the continuous engine.
    profiles: ProfileRegistry
    handle_signals: bool = True
    pipeline: Pipeline | None = None
    #: Tells systemd the daemon's state; replaced in :meth:`run` by one from the environment.
    notifier: SystemdNotifier = attrs.field(factory=SystemdNotifier)
    preset: str | None = None
    config_path: str | None = None
    overrides: dict[str, Any] = attrs.field(factory=dict)
    #: Why the last reload was refused (None after a successful one); shown in STATUS= until then.
    reload_error: str | None = None
    #: Tenants and keys managed through ``/admin``, and what outlives a restart (:mod:`apsd.state`).
    keeper: StateKeeper | None = None
    #: Budget alerts (:mod:`apsd.serve.alerts`), once the pipeline runs.
    alerts: BudgetAlerts | None = None
    #: Requests' traces (:mod:`apsd.serve.tracing`) while it runs; None: ``[tracing]`` is off.
    tracing: Tracing | None = None
    _ready: bool = False
    _stop: trio.Event = attrs.field(factory=trio.Event)
    _hurry: trio.Event = attrs.field(factory=trio.Event)

    @classmethod
    def from_config(cls, config: Config, *, preset: str | None = None, handle_signals: bool = True,
                    plugin_manager: pluggy.PluginManager | None = None, config_path: str | None = None,
                    overrides: dict[str, Any] | None = None) -> Daemon:
        """Load plugins and build the configured policies; raises ConfigError or PluginError.

        ``config_path`` and ``overrides`` (command-line ``host``/``port``) are what a reload
        re-reads and re-applies. Listening beyond loopback without API keys is a ConfigError.
        """
        check_exposure(config)
        Tracing.check(config.tracing)   # (the SDK is an extra: say so now, not once serving)
        pm = plugin_manager or make_plugin_manager()
        if not pm.is_registered(logs):   # (the daemon's own observer: its event log lines)
            pm.register(logs, name="apsd.serve.logs")
        registry = load_policy_registry(pm)
        policies = registry.build(config, preset)
        profiles = load_profile_registry(pm)
        engines.check(config, profiles)  # e.g. unknown profiles, or a model that does not fit: refuse now
        return cls(config=config, policies=policies, plugin_manager=pm, registry=registry, profiles=profiles,
                   handle_signals=handle_signals, preset=preset, config_path=config_path,
                   overrides=overrides or {})

    def request_shutdown(self) -> None:
        """Begin a graceful shutdown (what SIGTERM does); a second call ends the grace period now."""
        if self._stop.is_set():
            self._hurry.set()
        self._stop.set()

    async def run(self, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until shut down; ``task_status.started`` receives the bound URLs."""
        log.info("apsd %s starting: config %s", __version__, self.config_path or "<defaults>",
                 extra={"event": "start"})
        raise_open_file_limit()
        notifier = self.notifier = SystemdNotifier.from_environ()
        self.tracing = Tracing.start(self.config.tracing, __version__)
        try:
            await self._run(notifier, task_status)
        finally:
            if self.tracing is not None:   # (what is left is exported: bounded by its export timeout)
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.tracing.shutdown)
        log.info("apsd stopped", extra={"event": "stopped"})

    async def _run(self, notifier: SystemdNotifier, task_status: trio.TaskStatus[list[str]]) -> None:
        async with open_keeper(self.config) as keeper:
            self.keeper = keeper
            effective = keeper.effective()
            check_exposure(effective)
            self._log_access(effective)
            if effective.tenants != self.config.tenants:
                self.policies = self.registry.build(effective, self.preset)  # (tenants' weights from the state)
            async with open_pipeline(effective, self.policies, request_id_prefix=None,
                                     profiles=self.profiles) as pipeline, trio.open_nursery() as nursery:
                self.pipeline = pipeline
                await self._keep_state(keeper, pipeline, nursery)
                await self._serve(pipeline, nursery, notifier, task_status)

    async def _keep_state(self, keeper: StateKeeper, pipeline: Pipeline, nursery: trio.Nursery) -> None:
        """Restore what the state kept (bucket levels, budgets' spend), record usage, and run the
        keeper's flushes and polls; changes through ``/admin`` are applied by :meth:`apply_state`."""
        saved = await keeper.restore(pipeline.admission.budgets)
        restored = restore_buckets(pipeline, saved, keeper.wall())
        if restored:
            log.info("bucket levels restored for %s", ", ".join(restored), extra={"event": "state"})
        keeper.usage = UsageRecorder(lambda: pipeline.config.tenants, keeper.wall)
        pipeline.ledger.keep_books_with(keeper.usage)
        keeper.apply = self.apply_state
        self.alerts = BudgetAlerts(pipeline, keeper)
        await nursery.start(self.alerts.run)
        await nursery.start(functools.partial(keeper.run, buckets=lambda: bucket_levels(pipeline, keeper.wall())))

    def apply_state(self, effective: Config, why: str) -> None:
        """Apply an effective configuration the state keeper built (a change through ``/admin`` here
        or on another replica, a key's expiry): the tenants and keys change, nothing else."""
        pipeline = self.pipeline
        if pipeline is None:
            return
        effective = attrs.evolve(pipeline.config, tenants=effective.tenants, keys=effective.keys)
        policies = self.policies
        try:
            if tenant_weights(effective) != tenant_weights(pipeline.config):
                policies = self.registry.build(effective, self.preset)
        except (ConfigError, PluginError) as exc:
            log.error("state change not applied (%s): %s", why, exc, extra={"event": "state"})
            return
        changes = self._key_changes(pipeline.config, effective) + pipeline.reconfigure(effective, policies)
        self.policies = policies
        log.info("%s: %s", why, "; ".join(changes) or "no change", extra={"event": "state"})

    async def _serve(self, pipeline: Pipeline, nursery: trio.Nursery, notifier: SystemdNotifier,
                     task_status: trio.TaskStatus[list[str]]) -> None:
        """Serve HTTP until shut down, then drain (the stages' nursery is ``nursery``)."""
        if self.handle_signals:
            await nursery.start(self._watch_signals)
        http_stop = trio.Event()
        http_done = trio.Event()
        nursery.start_soon(sampler_for(pipeline).run)  # the status page's fairness history (/ui)
        binds = await nursery.start(self._serve_http, pipeline, http_stop, http_done)
        log.info("apsd listening on %s policy=%s tenants=%s engine=%s engines=%d",
                 ", ".join(binds), "/".join(f"{k}={v}" for k, v in self.policies.names.items()),
                 ",".join(sorted(pipeline.config.tenants)), engines.describe(pipeline.config).summary, len(pipeline.engines),
                 extra={"event": "ready"})
        self._ready = True
        await notifier.ready(status=self.status_text())  # the HTTP socket listens: ready
        if notifier.enabled:
            nursery.start_soon(serve_status, notifier, self.status_text)
            nursery.start_soon(serve_watchdog, notifier, self._watchdog_probe(pipeline))
        task_status.started(binds)

        await self._stop.wait()
        log.info("apsd shutting down: %d requests in flight, grace %.1f s",
                 len(pipeline.ledger.outstanding), self.config.server.shutdown_grace_s,
                 extra={"event": "shutdown"})
        pipeline.close_doors()
        await notifier.stopping(status=self.status_text())
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
            log.warning("answered %d unfinished requests with 503", aborted, extra={"event": "shutdown"})
        http_stop.set()
        await http_done.wait()
        nursery.cancel_scope.cancel()

    async def reload(self) -> bool:
        """Re-read the config file and apply it atomically (what SIGHUP does).

        The new file is validated completely (config and policies) before anything changes;
        if it does not validate, the old configuration stays in force, the error is logged and
        systemd's ``STATUS=`` says so. Queued and running requests are kept either way.
        Returns whether the new configuration was applied.
        """
        assert self.pipeline is not None, "the daemon is not running"
        if not self._ready or self._stop.is_set():
            log.warning("SIGHUP ignored: apsd is %s", "shutting down" if self._stop.is_set() else "not ready yet",
                        extra={"event": "reload_failed"})
            return False
        await self.notifier.reloading()
        try:
            config = load_config(self.config_path).with_overrides(**self.overrides)
            check_exposure(config)  # (what a restart would do) and what runs now: [server] needs a restart
            check_exposure(attrs.evolve(config, server=self.config.server))
            self._check_not_emptied(config)
            if config == attrs.evolve(self.config, source=config.source) and self.reload_error is None:
                log.info("reloaded %s: no change", self.config_path or "<defaults>", extra={"event": "reload"})
                await self.notifier.ready(status=self.status_text())
                return True  # same settings: keep the policies (and their state) as they are
            self.registry.build(config, self.preset)  # (the file's policies validate before anything changes)
            assert self.keeper is not None
            said = await self.keeper.reconcile(config)  # its tenants into the state, by [state] file_tenants
            effective = self.keeper.effective()
            policies = self.registry.build(effective, self.preset)
        except (ConfigError, PluginError, OSError, ConnectionError) as exc:
            self.reload_error = str(exc)
            log.error("reload refused, the running configuration stays: %s", exc,
                      extra={"event": "reload_failed"})
            await self.notifier.ready(status=self.status_text())
            return False
        self._log_access(effective)
        key_changes = self._key_changes(self.pipeline.config, effective)
        changes = said + self.pipeline.reconfigure(effective, policies) + key_changes
        self.config, self.policies, self.reload_error = config, policies, None
        log.info("reloaded %s: %s", self.config_path or "<defaults>", "; ".join(changes) or "no change",
                 extra={"event": "reload"})
        await self.notifier.ready(status=self.status_text())
        return True

    def _check_not_emptied(self, config: Config) -> None:
        """Refuse (ConfigError) a file that would switch authentication off, or put the embedded default
        tenants in place of the file's: what a truncated or half-written file looks like, and what an
        operator never means by a reload (a restart does either, on purpose). Whatever the listener:
        apsd on 127.0.0.1 behind a proxy is as exposed as the proxy. An empty file is refused by
        :func:`~apsd.core.config.load_config` itself."""
        assert self.pipeline is not None
        if KeyRing.from_config(self.pipeline.config).enabled and not KeyRing.from_config(config).enabled:
            raise ConfigError(f"{config.source}: the file configures no API key ([auth] admin_key_hashes, "
                              "admin_keys, metrics_key_hashes or any tenant's api_key_hashes) while keys are in force: a "
                              "reload never turns authentication off (a truncated file?); the keys stay. To run "
                              "without keys, restart apsd")
        if self.config.tenants_declared and not config.tenants_declared:
            raise ConfigError(f"{config.source}: tenants: the file declares no [tenants] (a truncated file?) and "
                              f"the running one declared {len(self.config.tenants)}: a reload does not replace them "
                              "with the embedded default tenants; declare them, or restart apsd")

    @staticmethod
    def _log_access(config: Config) -> None:
        """Say whether API keys are required, and which tenants no key can reach (never a key or hash)."""
        if not KeyRing.from_config(config).enabled:
            log.warning("no API keys configured: anyone who can reach %s may act as any tenant (fine on "
                        "loopback; see docs/how-to/api-keys.md)", config.server.host)
            return
        keyless = sorted(name for name, tenant in config.tenants.items() if not tenant.api_key_hashes)
        if keyless:
            log.warning("API keys are required, and tenants %s have none: nobody can submit as them",
                        ", ".join(keyless))

    @staticmethod
    def _key_changes(old: Config, new: Config) -> list[str]:
        """Whose API keys a reload changes, by name only (never a key or a hash)."""
        owners = sorted(set(old.tenants) | set(new.tenants))
        changed = [name for name in owners if name in old.tenants and name in new.tenants
                   and set(old.tenants[name].api_key_hashes) != set(new.tenants[name].api_key_hashes)]
        if set(old.auth.admin_hashes()) != set(new.auth.admin_hashes()) or old.auth.admin_keys != new.auth.admin_keys:
            changed.append("the admin")
        if set(old.auth.metrics_key_hashes) != set(new.auth.metrics_key_hashes):
            changed.append("the metrics scrapers")
        return [f"API keys changed for {', '.join(changed)}"] if changed else []

    def status_text(self) -> str:
        """The one-line state systemd shows (``STATUS=``): queue depth, governor state, ..."""
        assert self.pipeline is not None, "the daemon is not running"
        line = status_line(self.pipeline.health(), len(self.pipeline.ledger.outstanding))
        return f"{line} reload_failed" if self.reload_error else line

    @staticmethod
    def _watchdog_probe(pipeline: Pipeline) -> Callable[[], bool]:
        """The watchdog's ``is_alive``, called every WatchdogSec/2 by a root-nursery task.

        That the task runs at all proves the event loop is not blocked (a policy stuck in
        synchronous code stops the pings by itself). A dispatcher that waits for ever although it owes a decision is caught
        by the scheduler's heartbeat (``decisions``) standing still while ``dispatch_owed()``.
        """
        return ProgressProbe(lambda: pipeline.scheduler.decisions, pipeline.scheduler.dispatch_owed)

    async def _serve_http(self, pipeline: Pipeline, stop: trio.Event, done: trio.Event,
                          *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        config = hypercorn.config.Config()
        server = self.config.server
        config.bind = [_shared_port_bind(server.host, server.port) if server.reuse_port
                       else _bind_address(server.host, server.port)]
        config.accesslog = None
        errorlog = logging.getLogger("apsd.hypercorn")
        if not any(isinstance(f, ClientTransportErrors) for f in errorlog.filters):
            errorlog.addFilter(ClientTransportErrors())
        config.errorlog = errorlog
        config.graceful_timeout = HTTP_GRACEFUL_TIMEOUT_S
        config.keep_alive_timeout = self.config.server.keep_alive_timeout_s
        config.backlog = self.config.server.backlog
        app = create_app(pipeline, keeper=self.keeper, tracing=self.tracing)
        # What exists now (config, tenants' books, the app) lives as long as the daemon: leave it out of
        # full collections, whose pauses otherwise grow with the number of tenants. And collect the young
        # generation less often: a relayed chunk makes a few short-lived dicts, and with hundreds of
        # streams the default threshold (700) spent a fifth of the relay's CPU in the collector.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        try:
            await serve_http(create_asgi(app), config, shutdown_trigger=stop.wait, task_status=task_status)
        finally:
            done.set()

    async def _watch_signals(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                name = signal.Signals(signum).name
                if signum == signal.SIGHUP:
                    await self.reload()
                    continue
                log.info("received %s%s", name, " again: grace period ends now" if self._stop.is_set() else "")
                self.request_shutdown()
