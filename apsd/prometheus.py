"""Prometheus exposition of the books: what ``GET /metrics`` serves to a scraper.

Ownership: one :class:`PrometheusExporter` per pipeline (:func:`exporter_for`), with a
``CollectorRegistry`` of its own (never prometheus_client's global registry, so two
pipelines in one process never mix). Its collector reads the pipeline's frozen
:meth:`~apsd.pipeline.Pipeline.statistics` and the ledger's per-tenant counters when
scraped: every counter is the ledger's own, counted once. The only state the exporter
keeps is its histograms, which need every observation since start (the ledger keeps only
recent samples); a :class:`HistogramObserver` subscribes to the ledger's event bus when the
exporter is made (the HTTP app makes it before it serves, so it sees every request). Scrapes
run in the pipeline's trio thread: one scrape sees one consistent moment.

Metrics (``tenant`` is a configured tenant's name)::

    apsd_requests_total{tenant,outcome}       counter  outcome: admitted, rejected, completed,
                                                       failed, cancelled
    apsd_rejections_total{tenant,error}       counter  rejected, by error code
    apsd_requests_in_flight{tenant,state}     gauge    state: queued, running
    apsd_tokens_total{tenant,phase}           counter  tokens charged to the tenant (completed
                                                       requests, and those cancelled while running:
                                                       what they used); phase: prompt, generated
    apsd_tenant_cost_usd_total{tenant}        counter  cost of what the tenant was charged
    apsd_cost_usd_total                       counter  cost of every engine's busy time
    apsd_batches_total                        counter  micro-batches that finished running
    apsd_gpu_busy_seconds_total               counter  summed over engines
    apsd_gpu_busy_ratio                       gauge    busy / (engines * elapsed), since start
    apsd_gpus                                 gauge    GPUs behind the engines
    apsd_queue_depth                          gauge    requests waiting for dispatch
    apsd_queue_tokens                         gauge    their prompt + requested tokens (queue.max_tokens)
    apsd_queue_wait_seconds{tenant}           histogram arrival to dispatch, per dispatch
    apsd_ttft_seconds{tenant}                 histogram arrival to first token, per started request
    apsd_tpot_seconds{tenant}                 histogram mean time per output token after the first,
                                                       per completed request of 2 tokens or more
    apsd_request_latency_seconds{tenant}      histogram arrival to last token, per completed request
    apsd_batch_size                           histogram requests per micro-batch that ran
    apsd_engine_running_sequences{engine}     gauge    sequences an engine runs now
    apsd_engine_waiting_sequences{engine}     gauge    preempted sequences waiting for KV cache
    apsd_engine_kv_usage_ratio{engine}        gauge    KV cache in use / capacity
    apsd_engine_preemptions_total{engine}     counter
    apsd_engine_busy_seconds_total{engine}    counter
    apsd_engine_mfu_ratio{engine}             gauge    model FLOPs / peak over busy time (continuous)
    apsd_engine_mbu_ratio{engine}             gauge    bytes read / peak bandwidth over busy time
    apsd_backend_up{backend}                  gauge    the forward engine's backends: health,
    apsd_backend_saturated{backend}           gauge    saturation, requests in flight, sent,
    apsd_backend_in_flight{backend}           gauge    failed and retried, tokens by phase
    apsd_backend_requests_total{backend}      counter  (prompt, completion), cost, and the
    apsd_backend_failures_total{backend}      counter  waiting requests its own metrics report
    apsd_backend_retries_total{backend}       counter
    apsd_backend_tokens_total{backend,phase}  counter
    apsd_backend_cost_usd_total{backend}      counter
    apsd_backend_waiting{backend}             gauge
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

from .events import EventBus
from .models import Completion, Dispatch, InferenceRequest, Outcome

if TYPE_CHECKING:
    from .engines.backends import BackendStatistics
    from .engines.base import EngineStatistics
    from .ledger import TenantStats
    from .pipeline import GovernorView, Pipeline

__all__ = [
    "BATCH_SIZE_BUCKETS",
    "LATENCY_BUCKETS",
    "QUEUE_WAIT_BUCKETS",
    "TPOT_BUCKETS",
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
#: Upper bounds (model seconds) of the TTFT and end-to-end latency histograms' buckets.
LATENCY_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                                      120.0, 300.0, 600.0)
#: Upper bounds (model seconds) of ``apsd_tpot_seconds``' buckets.
TPOT_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
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
    """The histograms' only input: listeners on the ledger's event bus (see :meth:`subscribe`)."""

    def __init__(self, tenants: Iterable[str] = ()) -> None:
        self.tenants = {tenant: _TenantHistograms() for tenant in tenants}
        self.batch_size = _Histogram(BATCH_SIZE_BUCKETS)

    def histograms_for(self, tenant: str) -> _TenantHistograms:
        # admission admits configured tenants only: no series per client-chosen name
        histograms = self.tenants.get(tenant)
        if histograms is None:
            histograms = self.tenants[tenant] = _TenantHistograms()
        return histograms

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe("request_dispatched", self.request_dispatched, "the Prometheus histograms")
        bus.subscribe("request_started", self.request_started, "the Prometheus histograms")
        bus.subscribe("request_finished", self.request_finished, "the Prometheus histograms")
        bus.subscribe("batch_finished", self.batch_finished, "the Prometheus histograms")

    def request_dispatched(self, request: InferenceRequest) -> None:
        assert request.dispatched_at is not None
        self.histograms_for(request.tenant_id).queue_wait.observe(request.dispatched_at - request.arrival)

    def request_started(self, request: InferenceRequest, now: float) -> None:
        self.histograms_for(request.tenant_id).ttft.observe(now - request.arrival)

    def request_finished(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        if isinstance(outcome, Completion):
            histograms = self.histograms_for(request.tenant_id)
            histograms.latency.observe(now - request.arrival)
            if outcome.tpot_ms is not None:
                histograms.tpot.observe(outcome.tpot_ms / 1000.0)

    def batch_finished(self, batch: Dispatch) -> None:
        self.batch_size.observe(len(batch.requests))


class _TenantHistograms:
    def __init__(self) -> None:
        self.queue_wait = _Histogram(QUEUE_WAIT_BUCKETS)
        self.ttft = _Histogram(LATENCY_BUCKETS)
        self.tpot = _Histogram(TPOT_BUCKETS)
        self.latency = _Histogram(LATENCY_BUCKETS)


class PrometheusExporter:
    """The registry, collector and histograms of one pipeline; build with :func:`exporter_for`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pipeline: Pipeline) -> None:
        # (a weak reference: the exporter lives in a WeakKeyDictionary keyed by the pipeline)
        self._pipeline = weakref.ref(pipeline)
        self.observer = HistogramObserver(pipeline.ledger.tenants)
        self.observer.subscribe(pipeline.ledger.events)
        self._states_seen: dict[str, None] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def exposition(self) -> bytes:
        """The text exposition format (``content_type``) of every metric, now."""
        return generate_latest(self.registry)

    # -- the collector -----------------------------------------------------------------------
    def collect(self) -> Iterator[Metric]:
        pipeline = self._pipeline()
        if pipeline is None:
            return
        ledger = pipeline.ledger
        statistics = pipeline.statistics()  # the JSON view's figures, so both views agree
        books = statistics.books
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
                            "Tokens charged to the tenant, by phase (prompt, generated): what its completed "
                            "requests, and those cancelled while running, used", ["tenant", "phase"])
        yield tenant_cost.family(CounterMetricFamily, "apsd_tenant_cost_usd_total",
                                 "Cost in USD of what the tenant was charged (its share of its engines' time)",
                                 ["tenant"])

        yield CounterMetricFamily("apsd_cost_usd_total", "Cost in USD of every engine's busy time",
                                  value=ledger.cost_usd)
        yield CounterMetricFamily("apsd_batches_total", "Micro-batches that finished running", value=ledger.batches)
        yield CounterMetricFamily("apsd_gpu_busy_seconds_total",
                                  "Model seconds the engines spent computing, summed over engines",
                                  value=ledger.gpu_busy_s)
        yield GaugeMetricFamily("apsd_gpu_busy_ratio",
                                "Engine busy time / (engines * model seconds since start)",
                                value=books.gpu_utilization)
        yield GaugeMetricFamily("apsd_gpus", "GPUs behind the engines", value=statistics.gpus)
        yield GaugeMetricFamily("apsd_queue_depth", "Requests waiting for dispatch",
                                value=statistics.queue_depth)
        yield GaugeMetricFamily("apsd_queue_tokens", "Prompt + requested tokens of the requests waiting "
                                "for dispatch (bounded by queue.max_tokens)", value=books.tokens.queued)

        for tenant in ledger.tenants:  # every configured tenant has its series from the start
            self.observer.histograms_for(tenant)
        histograms = sorted(self.observer.tenants.items())
        for name, attribute, documentation in (
                ("apsd_queue_wait_seconds", "queue_wait", "Model seconds from admission to dispatch, per dispatch"),
                ("apsd_ttft_seconds", "ttft", "Model seconds from admission to the first token, per started request"),
                ("apsd_tpot_seconds", "tpot", "Mean model seconds per output token after the first, per completed "
                 "request of two tokens or more"),
                ("apsd_request_latency_seconds", "latency", "Model seconds from admission to the last token, per "
                 "completed request")):
            family = HistogramMetricFamily(name, documentation, labels=["tenant"])
            for tenant, per_tenant_histograms in histograms:
                histogram = getattr(per_tenant_histograms, attribute)
                family.add_metric([tenant], histogram.buckets(), histogram.sum)
            yield family
        batch_size = HistogramMetricFamily("apsd_batch_size", "Requests per micro-batch, per batch that ran")
        batch_size.add_metric([], self.observer.batch_size.buckets(), self.observer.batch_size.sum)
        yield batch_size
        yield from self._engines(statistics.engines)
        yield from self._backends(statistics.backends)

        declared = getattr(pipeline.scheduler.policies.governor, "states", ())
        yield from self._governor(statistics.governor, declared if isinstance(declared, (tuple, list)) else ())
        jain = books.fairness.jain_index
        fairness = GaugeMetricFamily(
            "apsd_fairness_jain", "Jain's index over tenants with admitted work of output tokens / rate "
            "(1: service in proportion to rate; 1/n: one tenant got everything)")
        if jain is not None:
            fairness.add_metric([], jain)
        yield fairness
        yield GaugeMetricFamily("apsd_conservation_ok",
                                "1 when admitted == completed + failed + cancelled + queued + running",
                                value=1 if books.requests.conservation_ok else 0)
        yield GaugeMetricFamily("apsd_accepting", "1 while admitting requests, 0 once shutting down",
                                value=1 if pipeline.accepting else 0)
        policy = {kind: str(statistics.policy.get(kind) or "") for kind in ("aging", "governor", "batching",
                                                                            "preset")}
        info = GaugeMetricFamily("apsd_policy_info", "The policies in force (value always 1)",
                                 labels=list(policy))
        info.add_metric(list(policy.values()), 1)
        yield info

    @staticmethod
    def _engines(engines: Sequence[EngineStatistics]) -> Iterator[Metric]:
        gauges = {
            "running": GaugeMetricFamily("apsd_engine_running_sequences", "Sequences the engine runs now",
                                         labels=["engine"]),
            "waiting": GaugeMetricFamily("apsd_engine_waiting_sequences",
                                         "Preempted sequences waiting in the engine for KV cache", labels=["engine"]),
            "kv": GaugeMetricFamily("apsd_engine_kv_usage_ratio", "KV cache in use / its capacity", labels=["engine"]),
            "preemptions": CounterMetricFamily("apsd_engine_preemptions", "Sequences preempted for KV cache",
                                               labels=["engine"]),
            "busy": CounterMetricFamily("apsd_engine_busy_seconds", "Model seconds the engine spent computing",
                                        labels=["engine"]),
            "mfu": GaugeMetricFamily("apsd_engine_mfu_ratio", "Model FLOPs / the GPUs' peak, over the engine's busy "
                                     "time (engines with a hardware model)", labels=["engine"]),
            "mbu": GaugeMetricFamily("apsd_engine_mbu_ratio", "Bytes read / the GPUs' peak bandwidth, over the "
                                     "engine's busy time (engines with a hardware model)", labels=["engine"]),
        }
        for engine in engines:
            label = [str(engine.engine_id)]
            gauges["running"].add_metric(label, engine.running)
            gauges["waiting"].add_metric(label, engine.waiting)
            gauges["kv"].add_metric(label, engine.kv_tokens_used / engine.kv_tokens_capacity
                                    if engine.kv_tokens_capacity else 0.0)
            gauges["preemptions"].add_metric(label, engine.preemptions)
            gauges["busy"].add_metric(label, engine.busy_s)
            if engine.mfu is not None:
                gauges["mfu"].add_metric(label, engine.mfu)
            if engine.mbu is not None:
                gauges["mbu"].add_metric(label, engine.mbu)
        yield from gauges.values()

    @staticmethod
    def _backends(backends: Sequence[BackendStatistics]) -> Iterator[Metric]:
        """The forward engine's backends (no samples for the simulated engines)."""
        labels = ["backend"]
        families = {
            "up": GaugeMetricFamily("apsd_backend_up", "1 while the backend passes its health checks",
                                    labels=labels),
            "saturated": GaugeMetricFamily("apsd_backend_saturated", "1 while the backend takes no more work "
                                           "(its own queue or KV cache past the limits, or its metrics stale)",
                                           labels=labels),
            "in_flight": GaugeMetricFamily("apsd_backend_in_flight", "Requests apsd has at the backend now",
                                           labels=labels),
            "requests": CounterMetricFamily("apsd_backend_requests", "Requests sent to the backend", labels=labels),
            "failures": CounterMetricFamily("apsd_backend_failures", "Requests the backend failed", labels=labels),
            "retries": CounterMetricFamily("apsd_backend_retries", "Requests sent back to the queue after the "
                                           "backend failed before their first token", labels=labels),
            "tokens": CounterMetricFamily("apsd_backend_tokens", "Tokens the backend reported, by phase",
                                          labels=["backend", "phase"]),
            "cost": CounterMetricFamily("apsd_backend_cost_usd", "Cost in USD of the requests it ran", labels=labels),
            "waiting": GaugeMetricFamily("apsd_backend_waiting", "Requests waiting in the backend's own queue, as "
                                         "its metrics last said", labels=labels),
        }
        for b in backends:
            label = [b.name]
            families["up"].add_metric(label, 1 if b.healthy else 0)
            families["saturated"].add_metric(label, 1 if b.saturated else 0)
            families["in_flight"].add_metric(label, b.in_flight)
            families["requests"].add_metric(label, b.requests)
            families["failures"].add_metric(label, b.failures)
            families["retries"].add_metric(label, b.retries)
            families["tokens"].add_metric([b.name, "prompt"], b.prompt_tokens)
            families["tokens"].add_metric([b.name, "completion"], b.completion_tokens)
            families["cost"].add_metric(label, b.cost_usd)
            if b.waiting is not None:
                families["waiting"].add_metric(label, b.waiting)
        yield from families.values()

    def _governor(self, view: GovernorView, declared: Iterable[str]) -> Iterator[Metric]:
        state = view.state
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
        if view.window_ms is not None:
            window.add_metric([], view.window_ms / 1000.0)
        yield window
        # (not ..._entropy_bits: promtool's lint wants data sizes in bytes and fails on "bits")
        entropy = GaugeMetricFamily("apsd_governor_entropy",
                                    "Entropy in bits of recent inter-arrival times, as the governor measures it")
        if view.entropy_bits is not None:
            entropy.add_metric([], view.entropy_bits)
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
    (:func:`apsd.http.create_app` does, before the daemon serves a request).
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
