"""Prometheus exposition of the books: what ``GET /metrics`` serves to a scraper.

Ownership: one :class:`PrometheusExporter` per pipeline (:func:`exporter_for`), with a
``CollectorRegistry`` of its own (never prometheus_client's global registry, so two
pipelines in one process never mix). Its collector reads the ledger, the scheduler and
the governor when scraped: every counter is the ledger's own, counted once. The only
state the exporter keeps is the two histograms, which need every observation since
start (the ledger keeps only recent queue waits). They are fed by an observer with two
observation hooks (``request_dispatched``, ``batch_finished``), attached to the
ledger's event bus when the exporter is made; the HTTP app makes it before it serves,
so it sees every dispatch. Scrapes run in the pipeline's trio thread: one scrape sees
one consistent moment.

Metrics (``tenant`` is a configured tenant's name)::

    apsd_requests_total{tenant,outcome}       counter  outcome: admitted, rejected, completed,
                                                       failed, cancelled
    apsd_rejections_total{tenant,error}       counter  rejected, by error code
    apsd_requests_in_flight{tenant,state}     gauge    state: queued, running
    apsd_tokens_total{tenant,phase}           counter  completed requests' tokens; phase: prompt,
                                                       generated
    apsd_tenant_cost_usd_total{tenant}        counter  cost of the tenant's completed requests
    apsd_cost_usd_total                       counter  cost of every batch that ran
    apsd_batches_total                        counter  batches that finished running
    apsd_gpu_busy_seconds_total               counter  summed over GPUs
    apsd_gpu_busy_ratio                       gauge    busy / (gpus * elapsed), since start
    apsd_gpus                                 gauge
    apsd_queue_depth                          gauge    requests waiting for dispatch
    apsd_queue_tokens                         gauge    their prompt + requested tokens (queue.max_tokens)
    apsd_queue_wait_seconds{tenant}           histogram arrival to dispatch, per dispatched request
    apsd_batch_size                           histogram requests per batch that ran
    apsd_batch_window_seconds                 gauge    the governor's current batch window
    apsd_governor_entropy                     gauge    bits (no sample when the governor has none;
                                                       not ..._bits: promtool wants bytes)
    apsd_governor_state{state}                gauge    1 for the current state, 0 for every other
                                                       state the governor declares (``states``) or
                                                       reported before (ERROR when it raised)
    apsd_fairness_jain                        gauge    (no sample while there is nothing to compare)
    apsd_conservation_ok                      gauge    1 when admitted == completed + failed +
                                                       cancelled + queued + running, else 0
    apsd_accepting                            gauge    1 while admitting, 0 once draining
    apsd_policy_info{aging,governor,batching,preset}  gauge 1: the policies in force

``outcome`` mixes one entry and three exits: ``admitted`` and ``rejected`` split the
requests received, and an admitted request later adds one to ``completed``, ``failed``
or ``cancelled`` (or is still in flight), so never sum over ``outcome``.

Unattributed refusals: a refusal of a request that names no configured tenant (unknown
tenant, malformed or oversized body, internal error) is counted with ``tenant=""``: an
empty label value, which Prometheus treats as an absent label (select it with
``{tenant=""}``). Such requests never create a series per name. No request can be
admitted under a blank name (``POST /infer`` refuses a blank ``tenant_id``); if a
configured tenant is nevertheless named ``""`` its figures are added to these.

Time: seconds are model seconds, like every figure apsd reports (``gpu.time_scale``
wall seconds each; with the default ``time_scale = 1`` they are wall seconds).
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal

import pluggy
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString
from werkzeug.datastructures import MIMEAccept
from werkzeug.http import parse_accept_header

from . import hookspecs
from .events import EventBus
from .hookspecs import hookimpl

if TYPE_CHECKING:
    from .ledger import TenantStats
    from .models import Batch, InferenceRequest
    from .pipeline import Pipeline

__all__ = [
    "BATCH_SIZE_BUCKETS",
    "QUEUE_WAIT_BUCKETS",
    "UNATTRIBUTED",
    "HistogramObserver",
    "PrometheusExporter",
    "exporter_for",
    "negotiate",
]

#: The ``tenant`` label of refusals that name no configured tenant.
UNATTRIBUTED = ""
#: Upper bounds (model seconds) of ``apsd_queue_wait_seconds``' buckets (+Inf is added).
QUEUE_WAIT_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                         1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: Upper bounds of ``apsd_batch_size``'s buckets (+Inf is added).
BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: States remembered for ``apsd_governor_state`` (reported 0 once left); a bound, not a limit in practice.
_MAX_GOVERNOR_STATES = 32
_OUTCOMES = ("admitted", "rejected", "completed", "failed", "cancelled")


class _Histogram:
    """Bucket counts since start; ``le`` buckets are cumulative when read."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        cumulative, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            total += count
            cumulative.append((floatToGoString(bound), total))
        return cumulative


class HistogramObserver:
    """An apsd plugin with two observation hooks: the histograms' only input."""

    def __init__(self, tenants: Iterable[str] = ()) -> None:
        self.queue_wait = {tenant: _Histogram(QUEUE_WAIT_BUCKETS) for tenant in tenants}
        self.batch_size = _Histogram(BATCH_SIZE_BUCKETS)

    def histogram_for(self, tenant: str) -> _Histogram:
        histogram = self.queue_wait.get(tenant)
        if histogram is None:
            histogram = self.queue_wait[tenant] = _Histogram(QUEUE_WAIT_BUCKETS)
        return histogram

    @hookimpl
    def request_dispatched(self, request: InferenceRequest) -> None:
        assert request.dispatched_at is not None
        # as Ledger.queue_waits_s; admission admits configured tenants only: no series per client-chosen name
        self.histogram_for(request.tenant_id).observe(request.dispatched_at - request.arrival)

    @hookimpl
    def batch_finished(self, batch: Batch) -> None:
        self.batch_size.observe(len(batch.requests))


class _TeeBus(EventBus):
    """The pipeline's own bus first, then the exporter's: everything the ledger emits reaches both.

    When both are plain buses (an :class:`EventBus`, or a ``_TeeBus`` of plain buses) their
    listeners are fixed: the tee keeps them in one table, first's then second's, so one emit
    calls them all in that order. A bus of any other class keeps its own ``emit``, called as is.
    """

    def __init__(self, first: EventBus, second: EventBus) -> None:
        super().__init__()
        self.first, self.second = first, second
        if _plain(first) and _plain(second):
            for name in {*first._listeners, *second._listeners}:
                self._listeners[name] = [*first._listeners.get(name, ()), *second._listeners.get(name, ())]
        else:
            self.wants = self._tee_wants  # type: ignore[method-assign]
            self.emit = self._tee_emit  # type: ignore[method-assign]

    def _tee_wants(self, name: str) -> bool:
        return self.first.wants(name) or self.second.wants(name)

    def _tee_emit(self, name: str, **kwargs: object) -> None:
        self.first.emit(name, **kwargs)
        self.second.emit(name, **kwargs)


def _plain(bus: EventBus) -> bool:
    """Whether ``bus`` is an EventBus whose ``emit`` is exactly its listener table's."""
    return type(bus) is EventBus or (type(bus) is _TeeBus and "emit" not in vars(bus))


def _observer_bus(observer: HistogramObserver) -> EventBus:
    """An EventBus calling ``observer``'s hooks (validated and isolated like any plugin's)."""
    pm = pluggy.PluginManager("apsd")
    pm.add_hookspecs(hookspecs)
    pm.register(observer, name="apsd.prometheus")
    pm.check_pending()
    return EventBus(pm)


class PrometheusExporter:
    """The registry, collector and histograms of one pipeline; build with :func:`exporter_for`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pipeline: Pipeline) -> None:
        # (a weak reference: the exporter lives in a WeakKeyDictionary keyed by the pipeline)
        self._pipeline = weakref.ref(pipeline)
        self.observer = HistogramObserver(pipeline.ledger.tenants)
        self._observer_bus = _observer_bus(self.observer)
        self.attach(pipeline)
        self._states_seen: dict[str, None] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def attach(self, pipeline: Pipeline) -> None:
        """Make the ledger's event bus also feed the histograms (a no-op if it already does).

        Code that replaces ``pipeline.ledger.events`` (say, a reload with new plugins)
        should call this right after: dispatches until then are not observed. (A scrape
        also re-attaches to a bus replaced by a plain :class:`EventBus`, so at worst the
        dispatches between the replacement and the next scrape are missed.)
        """
        bus = pipeline.ledger.events
        while isinstance(bus, _TeeBus):
            if bus.second is self._observer_bus:
                return
            bus = bus.first
        pipeline.ledger.events = _TeeBus(pipeline.ledger.events, self._observer_bus)

    def exposition(self) -> bytes:
        """The text exposition format (``content_type``) of every metric, now."""
        return generate_latest(self.registry)

    # -- the collector -----------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        pipeline = self._pipeline()
        if pipeline is None:
            return
        ledger = pipeline.ledger
        if type(ledger.events) is EventBus:  # replaced since: see attach()
            self.attach(pipeline)
        figures = pipeline.metrics()  # the JSON view's figures, so both views agree
        per_tenant: list[tuple[str, TenantStats]] = [*ledger.tenants.items(),
                                                     (UNATTRIBUTED, ledger.unattributed)]

        requests = _Samples()
        rejections = _Samples()
        in_flight = _Samples()
        tokens = _Samples()
        tenant_cost = _Samples()
        for tenant, stats in per_tenant:
            attributed = stats is not ledger.unattributed
            for outcome in _OUTCOMES:
                value = getattr(stats, outcome)
                if attributed or value or outcome == "rejected":
                    requests.add((tenant, outcome), value)
            for error, count in sorted(stats.rejected_by_error.items()):
                rejections.add((tenant, error), count)
            if attributed:
                in_flight.add((tenant, "queued"), stats.queued)
                in_flight.add((tenant, "running"), stats.running)
                tokens.add((tenant, "prompt"), stats.prompt_tokens)
                tokens.add((tenant, "generated"), stats.generated_tokens)
                tenant_cost.add((tenant,), stats.cost_usd)

        yield requests.family(CounterMetricFamily, "apsd_requests_total", (
            "Requests by tenant and outcome: admitted or rejected when received; an admitted request "
            "later counts once as completed, failed or cancelled (empty tenant: no configured tenant named)"),
            ["tenant", "outcome"])
        yield rejections.family(CounterMetricFamily, "apsd_rejections_total",
                                "Requests refused before admission, by tenant and error code",
                                ["tenant", "error"])
        yield in_flight.family(GaugeMetricFamily, "apsd_requests_in_flight",
                               "Admitted requests without an outcome yet, by tenant and state",
                               ["tenant", "state"])
        yield tokens.family(CounterMetricFamily, "apsd_tokens_total",
                            "Tokens of completed requests, by tenant and phase (prompt, generated)",
                            ["tenant", "phase"])
        yield tenant_cost.family(CounterMetricFamily, "apsd_tenant_cost_usd_total",
                                 "Cost in USD of the tenant's completed requests (their share of each batch)",
                                 ["tenant"])

        yield CounterMetricFamily("apsd_cost_usd_total", "Cost in USD of every batch that ran",
                                  value=ledger.cost_usd)
        yield CounterMetricFamily("apsd_batches_total", "Batches that finished running", value=ledger.batches)
        yield CounterMetricFamily("apsd_gpu_busy_seconds_total",
                                  "Model seconds the GPUs spent running batches, summed over GPUs",
                                  value=ledger.gpu_busy_s)
        yield GaugeMetricFamily("apsd_gpu_busy_ratio",
                                "GPU busy time / (GPUs * model seconds since start)",
                                value=figures["gpu_utilization"])
        yield GaugeMetricFamily("apsd_gpus", "Simulated GPUs (executors)", value=figures["gpus"])
        yield GaugeMetricFamily("apsd_queue_depth", "Requests waiting for dispatch",
                                value=figures["queue_depth"])
        yield GaugeMetricFamily("apsd_queue_tokens", "Prompt + requested tokens of the requests waiting "
                                "for dispatch (bounded by queue.max_tokens)", value=figures["tokens"]["queued"])

        queue_wait = HistogramMetricFamily(
            "apsd_queue_wait_seconds", "Model seconds from admission to dispatch, per dispatched request",
            labels=["tenant"])
        for tenant in ledger.tenants:  # every configured tenant has its series from the start
            self.observer.histogram_for(tenant)
        for tenant, histogram in sorted(self.observer.queue_wait.items()):
            queue_wait.add_metric([tenant], histogram.buckets(), histogram.sum)
        yield queue_wait
        batch_size = HistogramMetricFamily("apsd_batch_size", "Requests per batch, per batch that ran")
        batch_size.add_metric([], self.observer.batch_size.buckets(), self.observer.batch_size.sum)
        yield batch_size

        declared = getattr(pipeline.scheduler.policies.governor, "states", ())
        yield from self._governor(figures["governor"], declared if isinstance(declared, (tuple, list)) else ())
        jain = figures["fairness"]["jain_index"]
        fairness = GaugeMetricFamily(
            "apsd_fairness_jain", "Jain's index over tenants with admitted work of output tokens / rate "
            "(1: service in proportion to rate; 1/n: one tenant got everything)")
        if jain is not None:
            fairness.add_metric([], jain)
        yield fairness
        yield GaugeMetricFamily("apsd_conservation_ok",
                                "1 when admitted == completed + failed + cancelled + queued + running",
                                value=1 if figures["requests"]["conservation_ok"] else 0)
        yield GaugeMetricFamily("apsd_accepting", "1 while admitting requests, 0 once shutting down",
                                value=1 if pipeline.accepting else 0)
        policy = {kind: str(figures["policy"].get(kind) or "") for kind in ("aging", "governor", "batching",
                                                                            "preset")}
        info = GaugeMetricFamily("apsd_policy_info", "The policies in force (value always 1)",
                                 labels=list(policy))
        info.add_metric(list(policy.values()), 1)
        yield info

    def _governor(self, view: dict, declared: Iterable[str]) -> Iterator[Metric]:
        state = str(view["state"])
        for name in (*declared, state):
            if name not in self._states_seen and len(self._states_seen) < _MAX_GOVERNOR_STATES:
                self._states_seen[name] = None
        states = GaugeMetricFamily("apsd_governor_state",
                                   "1 for the governor's current state (ERROR: it raised), 0 for earlier ones",
                                   labels=["state"])
        for seen in sorted({*self._states_seen, state}):
            states.add_metric([seen], 1 if seen == state else 0)
        yield states
        window = GaugeMetricFamily("apsd_batch_window_seconds", "The governor's current batch window")
        if view.get("window_ms") is not None:
            window.add_metric([], view["window_ms"] / 1000.0)
        yield window
        # (not ..._entropy_bits: promtool's lint wants data sizes in bytes and fails on "bits")
        entropy = GaugeMetricFamily("apsd_governor_entropy",
                                    "Entropy in bits of recent inter-arrival times, as the governor measures it")
        if view.get("entropy_bits") is not None:
            entropy.add_metric([], view["entropy_bits"])
        yield entropy


class _Samples:
    """Samples of one family by label values; equal label values add up (see ``tenant=""``)."""

    def __init__(self) -> None:
        self.values: dict[tuple[str, ...], float] = {}

    def add(self, labels: tuple[str, ...], value: float) -> None:
        self.values[labels] = self.values.get(labels, 0) + value

    def family(self, kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, documentation: str,
               labels: list[str]) -> Metric:
        family = kind(name, documentation, labels=labels)
        for label_values, value in self.values.items():
            family.add_metric(list(label_values), value)
        return family


_exporters: weakref.WeakKeyDictionary[Pipeline, PrometheusExporter] = weakref.WeakKeyDictionary()


def exporter_for(pipeline: Pipeline) -> PrometheusExporter:
    """The pipeline's exporter, made (and its histograms attached) on the first call.

    Call it before the pipeline dispatches anything you want in the histograms
    (:func:`apsd.api.create_app` does, before the daemon serves a request).
    """
    exporter = _exporters.get(pipeline)
    if exporter is None:
        exporter = _exporters[pipeline] = PrometheusExporter(pipeline)
    return exporter


#: Media types a Prometheus scraper asks for.
PROMETHEUS_TYPES = frozenset({"text/plain", "application/openmetrics-text"})


def negotiate(format_param: str | None, accept: str | None) -> Literal["json", "prometheus"] | None:
    """Which view of ``GET /metrics`` a client gets (None: ``format`` names neither).

    ``?format=json`` or ``?format=prometheus`` decides. Otherwise JSON only when the
    Accept header names ``application/json`` with a higher quality than every
    Prometheus type it names (``text/plain``, ``application/openmetrics-text``);
    Prometheus text in every other case: no Accept header, a scraper's header,
    wildcards only (curl's ``*/*``), a browser's, or a tie.
    """
    if format_param is not None:
        return "json" if format_param == "json" else "prometheus" if format_param == "prometheus" else None
    quality = {"application/json": 0.0}
    for value, q in parse_accept_header(accept or "", MIMEAccept):
        media_type = value.split(";", 1)[0].strip().lower()
        if media_type == "application/json" or media_type in PROMETHEUS_TYPES:
            quality[media_type] = max(quality.get(media_type, 0.0), q)
    json_q = quality.pop("application/json")
    return "json" if json_q > 0 and json_q > max(quality.values(), default=0.0) else "prometheus"
