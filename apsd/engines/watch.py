"""Watching the forward engine's backends: health, load, and the models no backend serves.

One task per backend reads its health every ``[forward] health_interval_s`` (``/health``, else
``/v1/models``; the models it serves when it first becomes healthy, unless configured; what kind of
server it is, and whether it serves Anthropic's ``/v1/messages``) and its Prometheus ``/metrics`` every ``metrics_interval_s`` (its load: saturation).
A backend whose health check fails, or that a request found unreachable, is marked down: it takes
no work, and the engine hands back what it holds (:meth:`BackendWatch.mark_down` calls the engine's
``on_down``). It comes back by itself once a health check passes. A failed health check does not
mark down a backend that streams to clients (a chunk within the check's time): a server busy on
every core may answer ``/health`` late, and its streams show it alive (logged once). One that stops
answering stops streaming too, and is marked down at the next check.

One more task answers the requests queued for a model that has had no healthy backend for
``no_backend_wait_s`` with 503 ``no_backend`` (new ones are refused at once by the engine).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import attrs
import trio

from apsd.core.clock import ModelClock
from apsd.core.config import ForwardConfig
from apsd.core.ledger import Ledger
from apsd.core.models import Refusal
from apsd.engines.backends import Backend, BackendClient, BackendError

__all__ = ["BackendWatch"]

log = logging.getLogger("apsd.engines.forward")


@attrs.define(eq=False)
class BackendWatch:
    """The backends' health and load, kept up to date (see the module docstring)."""

    backends: list[Backend]
    client: BackendClient
    ledger: Ledger
    clock: ModelClock
    settings: ForwardConfig
    #: Called with a backend just marked down (the engine hands back what it holds there).
    on_down: Callable[[Backend], None]
    #: Called when capacity may have grown (a backend came back, or stopped being saturated).
    on_change: Callable[[], None]
    #: Models no healthy backend serves now, and since when (model time); "" stands for "any model".
    _unserved_since: dict[str, float] = attrs.field(factory=dict, init=False)
    #: Set when a model loses its last healthy backend (the watchdog then has a deadline to keep).
    _unserved_changed: trio.Event = attrs.field(factory=trio.Event, init=False)

    def start(self, nursery: trio.Nursery) -> None:
        """Start a watch per backend and the unserved models' watchdog in ``nursery``."""
        for backend in self.backends:
            nursery.start_soon(self._watch, backend)
        nursery.start_soon(self._serve_unserved)

    def serves(self, model: str | None) -> bool:
        """Whether a healthy backend serves ``model`` (None: any model) now."""
        return any(b.healthy and b.models and (model is None or model in b.models) for b in self.backends)

    async def _watch(self, backend: Backend) -> None:
        """Health every ``health_interval_s``, metrics every ``metrics_interval_s``; forever."""
        settings = self.settings
        next_health = next_metrics = self.clock.now()
        while True:
            now = self.clock.now()
            if self.clock.reached(next_health):   # (not now >= ...: a rounding error would spin)
                next_health = now + settings.health_interval_s
                await self._check_health(backend)
            reads_metrics = backend.healthy and backend.has_metrics is not False
            if reads_metrics and self.clock.reached(next_metrics):
                next_metrics = self.clock.now() + settings.metrics_interval_s
                await self._read_metrics(backend)
            await self.clock.sleep_until(min(next_health, next_metrics) if reads_metrics else next_health)

    async def _check_health(self, backend: Backend) -> None:
        failure = await self.client.check_health(backend)
        healthy = failure is None
        if healthy and not backend.models:
            try:
                backend.models = tuple(await self.client.list_models(backend))
            except BackendError as error:
                log.warning("backend %s: cannot list its models: %s", backend.name, error.message)
                healthy = False
        if healthy and backend.server is None:
            backend.server = backend.config.server if backend.config.server != "auto" else \
                await self.client.server_kind(backend)
        if healthy and backend.messages is None:
            backend.messages = await self.client.serves_messages(backend)
            if backend.messages is False:
                log.info("backend %s does not serve Anthropic's /v1/messages: requests there go to others", backend.name)
        if healthy and not backend.healthy:
            backend.healthy = True
            if backend.was_down:   # (a recovery the log reported the outage of: as loud as the outage)
                log.warning("backend %s is up again", backend.name)
            else:
                log.info("backend %s is up", backend.name)
            backend.was_down = False
            self._note_served()
            self.on_change()
        elif not healthy and backend.healthy:
            if self.streaming(backend):   # (alive: a busy server may answer /health late, not be down)
                if not backend.health_failing:
                    log.warning("backend %s failed its health check (%s) while it streams to clients: kept up "
                                "while it streams", backend.name, failure)
                backend.health_failing = True
                return
            self.mark_down(backend, f"its health check failed: {failure}")
        if healthy:
            backend.health_failing = False

    def streaming(self, backend: Backend) -> bool:
        """Whether requests run on ``backend`` and one received a chunk within the last health check's
        time (``health_timeout_s``) and interval."""
        settings = self.settings
        return bool(backend.in_flight) and backend.streamed_at is not None and \
            self.clock.now() - backend.streamed_at <= settings.health_timeout_s + settings.health_interval_s

    def mark_down(self, backend: Backend, why: str) -> None:
        """Take ``backend`` out of service until its health check passes; the engine hands back what
        it holds there (``on_down``)."""
        backend.healthy = False
        backend.was_down = True
        log.warning("backend %s is down (%s)", backend.name, why)
        self.on_down(backend)
        self._note_served()
        self.on_change()

    async def _read_metrics(self, backend: Backend) -> None:
        try:
            load = await self.client.read_load(backend)
        except BackendError:
            return  # (stale metrics bound it by max_concurrency alone; the health check decides whether it is down)
        was = backend.saturated(self.clock.now(), self.settings)
        if load is None:
            if backend.has_metrics is None:
                log.info("backend %s exports no known load metrics: max_concurrency alone bounds it", backend.name)
            backend.has_metrics = False
        else:
            backend.has_metrics, backend.load, backend.load_at = True, load, self.clock.now()
        if was and not backend.saturated(self.clock.now(), self.settings):
            self.on_change()

    # -- models no backend serves ------------------------------------------------------------------
    def _models(self) -> list[str]:
        return list(dict.fromkeys(name for backend in self.backends for name in backend.models))

    def _note_served(self) -> None:
        """Track which models have lost every healthy backend (and since when)."""
        now = self.clock.now()
        for model in ["", *self._models()]:
            if self.serves(model or None):
                self._unserved_since.pop(model, None)
            elif model not in self._unserved_since:
                self._unserved_since[model] = now
                self._unserved_changed.set()

    async def _serve_unserved(self) -> None:
        """Answer 503 ``no_backend`` to the requests queued for a model that has had no healthy
        backend for ``[forward] no_backend_wait_s``. Runs until cancelled."""
        wait = self.settings.no_backend_wait_s
        while True:
            now = self.clock.now()
            for model, since in list(self._unserved_since.items()):
                if now >= since + wait:
                    self._answer_unserved(model or None, now - since)
            self._unserved_changed = trio.Event()
            due = [since + wait for since in self._unserved_since.values() if since + wait > now]
            with trio.move_on_at(self.clock.deadline(min(due)) if due else math.inf):
                await self._unserved_changed.wait()

    def _answer_unserved(self, model: str | None, for_s: float) -> None:
        what = f"the model {model!r}" if model is not None else "any model"
        queued = [r for r in self.ledger.outstanding if r.dispatched_at is None and not r.answered
                  and r.model == model]   # (None: the requests for any model, POST /infer's)
        if not queued:
            return
        log.warning("%d queued requests for %s answered 503 no_backend: no backend up for %.0f s",
                    len(queued), what, for_s)
        for request in queued:
            self.ledger.finish(request, Refusal(
                503, "no_backend", f"no backend serving {what} has been up for {for_s:.0f} s "
                "([forward] no_backend_wait_s); retry later",
                headers={"Retry-After": str(max(1, math.ceil(self.settings.health_interval_s)))}, kind="failed"))
