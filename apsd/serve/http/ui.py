"""The status page: ``GET /ui``, its script and style, and the one JSON document it reads, ``GET /admin/status``.

The page (:file:`apsd/serve/ui/`: plain HTML, JavaScript and CSS shipped in the package, no build
step, nothing fetched from elsewhere) shows the tenants (settings, bucket, budget spent of its
limit, queue, share of service beside weight share, TTFT p99, refusals in the last minute), the forward engine's backends, a plot of fairness over the
last minutes, usage per day and tenant, and the issued keys; it creates tenants, disables and
enables them, issues keys (showing a new key once) and revokes them, through the admin API
(:mod:`apsd.serve.http.admin`). It polls ``/admin/status`` every 2 seconds.

Access: the HTML, script and style hold no data and are served to anyone (a browser's navigation
cannot send a key). The data is behind the admin key: ``/admin/status`` and every ``/admin``
call the page makes need it (a tenant's key gets 403 ``admin_only``). The page asks for the key in
a form, keeps it in the tab's ``sessionStorage`` (gone when the tab closes; never in a cookie, a
URL or the page's address) and sends it as ``Authorization: Bearer`` on its ``fetch()`` calls. With
no keys configured (loopback only) everything is open and the page asks for nothing. Every answer
here carries a strict Content-Security-Policy (``default-src 'self'``, no inline script or style,
no framing), and the script inserts data only as text (``textContent``), never as HTML.

Ownership: :class:`StatusSampler`, one per pipeline (:func:`sampler_for`), keeps what the page
shows over time: a bounded history of fairness (:data:`SAMPLES` samples, one every
:data:`SAMPLE_INTERVAL_S` wall seconds: 10 minutes) and each configured tenant's recent TTFTs
(:data:`TTFT_SAMPLES`, from the ledger's ``request_started`` events) and their refusals per second
over the last :data:`REFUSAL_WINDOW_S` seconds (from ``request_rejected``). Its :meth:`StatusSampler.run`
task runs in the daemon's nursery; without it (an app made without a daemon) the history is only
what ``/admin/status`` adds on each call: the sample of now.
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import trio
from quart import Blueprint, Response
from werkzeug.exceptions import NotFound

from apsd.core.models import InferenceRequest
from apsd.pipeline import Pipeline
from apsd.serve.auth import Caller
from apsd.serve.http.admin import budgets_of
from apsd.serve.http.common import authenticated, http_state, json_response
from apsd.state.keeper import AdminError, StateKeeper
from apsd.state.usage import HOUR_S, summarize

__all__ = ["ASSETS", "CONTENT_SECURITY_POLICY", "SAMPLES", "SAMPLE_INTERVAL_S", "StatusSampler", "blueprint",
           "sampler_for", "status_document"]

log = logging.getLogger("apsd.serve.ui")

blueprint = Blueprint("ui", __name__)

#: The page's files, shipped in the package (``[tool.setuptools.package-data]``).
ASSETS = Path(__file__).resolve().parent.parent / "ui"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}

#: Everything the page loads comes from apsd itself; no inline script or style, no framing, no plugins.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                           "frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                 "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}

#: The fairness history: one sample every SAMPLE_INTERVAL_S wall seconds, the latest SAMPLES kept.
SAMPLE_INTERVAL_S = 5.0
SAMPLES = 120
#: Recent TTFTs kept per tenant for its p99.
TTFT_SAMPLES = 500
#: Wall seconds over which a tenant's refusals are counted for "refused in the last minute".
REFUSAL_WINDOW_S = 60
#: Days of usage ``/admin/status`` reports, and how long (wall seconds) one reading of it is reused.
USAGE_DAYS = 7
USAGE_CACHE_S = 5.0


class StatusSampler:
    """Fairness over time and recent TTFTs per tenant, for one pipeline; bounded in memory.

    The history holds at most ``samples`` samples; a sample names only the tenants served in the
    window (at most every configured tenant). A TTFT deque is kept per configured tenant, at most
    :data:`TTFT_SAMPLES` long, and dropped at the next sample once the tenant is no longer configured.
    """

    def __init__(self, pipeline: Pipeline, *, interval_s: float = SAMPLE_INTERVAL_S, samples: int = SAMPLES,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self._pipeline = weakref.ref(pipeline)  # (the registry is keyed by the pipeline: no cycle back to it)
        self.interval_s = interval_s
        #: When a sample is taken (trio's clock, seconds); a document gives each sample's age from it.
        self.clock = clock
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=samples)
        self._ttfts: dict[str, collections.deque[float]] = {}
        #: (when it was read, the rows) of the last usage reading
        self.usage_cache: tuple[float, list[dict[str, Any]]] | None = None
        #: Per tenant refused lately: [whole second (clock), error -> refusals that second], oldest first,
        #: at most REFUSAL_WINDOW_S + 1 of them.
        self._refusals: dict[str, collections.deque[tuple[int, collections.Counter[str]]]] = {}
        pipeline.ledger.events.subscribe("request_started", self.request_started, "the status page")
        pipeline.ledger.events.subscribe("request_rejected", self.request_rejected, "the status page")

    def request_rejected(self, request: InferenceRequest, refusal: Any, now: float) -> None:
        """Count an admission's refusal in its second (tenants a reload removed, or never had, are not counted)."""
        pipeline = self._pipeline()
        if pipeline is None or request.tenant_id not in pipeline.config.tenants:
            return
        second = int(self.clock())
        seconds = self._refusals.get(request.tenant_id)
        if seconds is None:
            seconds = self._refusals[request.tenant_id] = collections.deque(maxlen=REFUSAL_WINDOW_S + 1)
        if not seconds or seconds[-1][0] != second:
            seconds.append((second, collections.Counter()))
        seconds[-1][1][refusal.error] += 1

    def refused_lately(self, tenant: str) -> dict[str, int]:
        """``tenant``'s refusals in the last :data:`REFUSAL_WINDOW_S` seconds, by error."""
        seconds = self._refusals.get(tenant)
        if not seconds:
            return {}
        since = int(self.clock()) - REFUSAL_WINDOW_S
        total: collections.Counter[str] = collections.Counter()
        for second, counts in seconds:
            if second > since:
                total.update(counts)
        return dict(sorted(total.items()))

    def request_started(self, request: InferenceRequest, now: float) -> None:
        pipeline = self._pipeline()
        if pipeline is None or request.tenant_id not in pipeline.config.tenants:
            return
        samples = self._ttfts.get(request.tenant_id)
        if samples is None:
            samples = self._ttfts[request.tenant_id] = collections.deque(maxlen=TTFT_SAMPLES)
        samples.append(now - request.arrival)

    def ttft_p99_ms(self, tenant: str) -> float | None:
        """The p99 of ``tenant``'s recent TTFTs, model milliseconds (None before its first)."""
        samples = self._ttfts.get(tenant)
        if not samples:
            return None
        return float(np.percentile(np.fromiter(samples, dtype=float), 99)) * 1000.0

    def sample(self) -> dict[str, Any]:
        """Fairness now (not kept): when (``t``, :attr:`clock`), the window's Jain index and each
        served tenant's service share."""
        pipeline = self._pipeline()
        if pipeline is None:
            return {"t": self.clock(), "jain": None, "shares": {}}
        view = pipeline.fairness_view(idle=False)  # (only tenants with work: cheap with many tenants)
        return {"t": self.clock(), "jain": view.jain_window,
                "shares": {t.name: t.service_share for t in view.tenants if t.window_tokens}}

    def history_view(self) -> list[dict[str, Any]]:
        """The history and a sample of now, oldest first, each with its age (``age_s``, seconds)
        instead of its time."""
        samples = [*self.history, self.sample()]
        now = samples[-1]["t"]
        return [{"age_s": max(0.0, now - s["t"]), "jain": s["jain"], "shares": s["shares"]} for s in samples]

    def record(self) -> None:
        """Keep a sample in the history, and forget the TTFTs of tenants no longer configured."""
        self.history.append(self.sample())
        pipeline = self._pipeline()
        if pipeline is not None:
            for name in [name for name in self._ttfts if name not in pipeline.config.tenants]:
                del self._ttfts[name]
            since = int(self.clock()) - REFUSAL_WINDOW_S
            for name in [name for name, seconds in self._refusals.items()
                         if name not in pipeline.config.tenants or seconds[-1][0] <= since]:
                del self._refusals[name]

    async def run(self) -> None:
        """Sample every ``interval_s`` wall seconds until cancelled (a failed sample is logged, not fatal)."""
        while True:
            try:
                self.record()
            except Exception:
                log.exception("the status page's fairness sample failed; the next one is in %g s", self.interval_s)
            await trio.sleep(self.interval_s)


_samplers: weakref.WeakKeyDictionary[Pipeline, StatusSampler] = weakref.WeakKeyDictionary()


def sampler_for(pipeline: Pipeline) -> StatusSampler:
    """The pipeline's sampler, made (and subscribed to its ledger's events) on the first call; the
    daemon makes it, and runs it, when it starts serving."""
    sampler = _samplers.get(pipeline)
    if sampler is None:
        sampler = _samplers[pipeline] = StatusSampler(pipeline)
    return sampler


async def _usage(keeper: StateKeeper | None, sampler: StatusSampler) -> list[dict[str, Any]]:
    """Usage per day and tenant over the last :data:`USAGE_DAYS` days (UTC days, the oldest one whole),
    as ``GET /admin/usage?group_by=day`` reports it, counting what the next flush will add."""
    if keeper is None:
        return []
    now = keeper.wall()
    cached = sampler.usage_cache
    if cached is not None and 0 <= now - cached[0] < USAGE_CACHE_S:
        return cached[1]
    start = (int(now) // 86_400 - USAGE_DAYS + 1) * 86_400
    try:
        rows = await keeper.usage_rows(tenant=None, start=start, end=now + HOUR_S)
    except AdminError:  # (the state cannot be read now: the live figures are shown all the same)
        return cached[1] if cached is not None else []
    summaries = summarize(rows, group_by="day")
    sampler.usage_cache = (now, summaries)
    return summaries


async def status_document(pipeline: Pipeline, keeper: StateKeeper | None) -> dict[str, Any]:
    """What the page shows, now (see docs/how-to/status-page.md for the fields)."""
    sampler = sampler_for(pipeline)
    stats = pipeline.statistics()
    fairness = pipeline.fairness_view()
    shares = {t.name: t for t in fairness.tenants}
    tenants = []
    for name, tenant in pipeline.config.tenants.items():
        status = pipeline.tenant_status(name)
        share = shares.get(name)
        if status is None:
            continue
        budgets = budgets_of(name)
        refused_lately = sampler.refused_lately(name)
        tenants.append({
            "name": name, "rate": tenant.rate, "burst": tenant.burst, "weight": tenant.weight,
            "disabled": tenant.disabled,
            "source": keeper.tenant_source(name) if keeper is not None else "file",
            "tokens_available": status.tokens_available, "queued": status.queued, "running": status.running,
            "admitted": status.admitted, "completed": status.completed, "failed": status.failed,
            "cancelled": status.cancelled, "rejected": status.rejected,
            "rejected_by_error": dict(sorted(status.rejected_by_error.items())),
            "refused_last_minute": sum(refused_lately.values()), "refused_last_minute_by_error": refused_lately,
            **budgets, "spend_usd": status.spend_usd, "waiting_for_concurrency": status.waiting_for_concurrency,
            "max_concurrency": tenant.max_concurrency,
            "prompt_tokens": status.prompt_tokens, "generated_tokens": status.generated_tokens,
            "window_tokens": share.window_tokens if share else 0,
            "service_share": share.service_share if share else 0.0,
            "weight_share": share.weight_share if share else 0.0,
            "ttft_p99_ms": sampler.ttft_p99_ms(name)})
    books = stats.books
    return {
        "at": keeper.wall() if keeper is not None else None,
        "accepting": pipeline.accepting,
        "engine": {"kind": stats.engine_kind, "summary": pipeline.engine_description.summary,
                   "engines": len(stats.engines), "gpus": stats.gpus, "time_scale": stats.time_scale,
                   "policy": dict(stats.policy), "queue_depth": stats.queue_depth,
                   "queue_depth_by_band": dict(fairness.queue_depth_by_band),
                   "governor": stats.governor.state,
                   "requests": {"admitted": books.requests.admitted, "completed": books.requests.completed,
                                "rejected": books.requests.rejected, "failed": books.requests.failed,
                                "cancelled": books.requests.cancelled, "queued": books.requests.queued,
                                "running": books.requests.running},
                   "throughput_tokens_per_s": books.throughput_tokens_per_s,
                   "ttft_p99_ms": books.ttft_ms.p99},
        "tenants": tenants,
        "backends": [{"name": b.name, "healthy": b.healthy, "saturated": b.saturated, "in_flight": b.in_flight,
                      "max_concurrency": b.max_concurrency, "requests": b.requests, "failures": b.failures}
                     for b in stats.backends],
        "fairness": {"window_s": fairness.window_s, "jain_window": fairness.jain_window,
                     "interval_s": sampler.interval_s,
                     "span_s": sampler.interval_s * (sampler.history.maxlen or SAMPLES),
                     "history": sampler.history_view()},
        "usage": {"group_by": "day", "days": USAGE_DAYS, "rows": await _usage(keeper, sampler)},
    }


def _asset(name: str) -> Response:
    """A file of :data:`ASSETS` by its name (an unknown one: apsd's JSON 404)."""
    path = ASSETS / name
    content_type = _TYPES.get(path.suffix)
    if content_type is None or "/" in name or name.startswith(".") or not path.is_file():
        raise NotFound(f"no file {name[:64]!r} in the status page")
    return Response(path.read_bytes(), status=200, content_type=content_type, headers=_PAGE_HEADERS)


@blueprint.get("/ui")
async def page() -> Response:
    """The page: no data in it, so no key needed (it asks for one)."""
    return _asset("index.html")


@blueprint.get("/ui/<name>")
async def asset(name: str) -> Response:
    """The page's script, style and icon (a name in :data:`ASSETS`, nothing below it; the page itself is ``/ui``)."""
    if name.endswith(".html"):
        raise NotFound(f"no file {name[:64]!r} in the status page")
    return _asset(name)


@blueprint.get("/admin/status")
@authenticated(admin=True)
async def status(caller: Caller) -> Response:
    state = http_state()
    document = await status_document(state.pipeline, state.keeper)
    return json_response(document, headers={"Cache-Control": "no-store"})
