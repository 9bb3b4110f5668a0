"""Prometheus exposition of the books: what ``GET /metrics`` serves to a scraper.

Ownership: one :class:`PrometheusExporter` per pipeline (:func:`exporter_for`), with a
``CollectorRegistry`` of its own (never prometheus_client's global registry, so two
pipelines in one process never mix). Its collector reads the pipeline's frozen
:meth:`~apsd.pipeline.Pipeline.statistics` and the ledger's per-tenant counters when
scraped: every counter is the ledger's own, counted once. The state the exporter keeps is
its histograms, which need every observation since start (the ledger keeps only recent
samples; a :class:`HistogramObserver` subscribes to the ledger's event bus when the exporter
is made: the HTTP app makes it before it serves, so it sees every request), and each tenant's
lines as last rendered.

Scrapes and the event loop (:meth:`PrometheusExporter.scrape`, what ``GET /metrics`` uses):
at 10,000 tenants the exposition is about 48 MB (some 80 lines per tenant, most of them
histogram buckets), and prometheus_client takes seconds to render it. So a scrape copies its
moment in the trio thread, in time proportional to the tenants whose figures moved since the
last scrape (the ledger's and the observer's :class:`~apsd.core.ledger.ChangeLog`; histograms are
handed over copy-on-write), so one scrape still sees one consistent moment; then a worker
thread renders the lines of those tenants only, reuses every other tenant's from the last
scrape, and joins them (the service window's per-tenant lines, for the tenants with work in it,
are rendered there at every scrape: they are copied in time proportional to those tenants). The
event loop goes on serving meanwhile. The output is byte for byte prometheus_client's own
(:meth:`PrometheusExporter.collect`, kept as the reference; ``tests/daemon/test_prometheus.py``
compares them).

Metrics (``tenant`` is a configured tenant's name)::

    apsd_requests_total{tenant,outcome}       counter  outcome: admitted, rejected, completed,
                                                       failed, cancelled
    apsd_rejections_total{tenant,error}       counter  rejected, by error code
    apsd_requests_in_flight{tenant,state}     gauge    state: queued, running
    apsd_tokens_total{tenant,phase}           counter  tokens charged to the tenant (completed
                                                       requests, and those cancelled while running:
                                                       what they used); phase: prompt, generated
    apsd_tenant_cost_usd_total{tenant}        counter  cost of what the tenant was charged
    apsd_tenant_queue_depth{tenant}           gauge    the tenant's requests waiting for dispatch (its
                                                       apsd_requests_in_flight{state="queued"}, by itself)
    apsd_tenant_spend_usd_total{tenant}       counter  what the tenant spent at [prices] (US dollars)
    apsd_cost_usd_total                       counter  cost of every engine's busy time
    apsd_batches_total                        counter  micro-batches that finished running
    apsd_gpu_busy_seconds_total               counter  summed over engines
    apsd_gpu_busy_ratio                       gauge    busy / (engines * elapsed), since start
    apsd_gpus                                 gauge    GPUs behind the engines
    apsd_queue_depth                          gauge    requests waiting for dispatch
    apsd_queue_depth_band{band}               gauge    the same by band of their priority bid; band: 1-3,
                                                       4-6, 7-10 (always these three; they add up to
                                                       apsd_queue_depth)
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
    apsd_backend_failures_total{backend}      counter  waiting requests and KV cache use its
    apsd_backend_retries_total{backend}       counter  own metrics report (the last two: no
    apsd_backend_tokens_total{backend,phase}  counter  sample while it reports none)
    apsd_backend_cost_usd_total{backend}      counter
    apsd_backend_waiting{backend}             gauge
    apsd_backend_kv_usage_ratio{backend}      gauge
    apsd_route_decisions_total{target,reason} counter  requests the routing policy sent to a backend or
                                                       engine, and why (cache_match, no_match, imbalance,
                                                       spill, least_loaded, hash, hash_spill)
    apsd_class_requests_total{class,result}   counter  requests of each service class that met its
                                                       targets, missed them, or were refused for their
                                                       deadline (result: met, missed, refused)
    apsd_class_attainment{class}              gauge    met / (met + missed + refused); no sample
                                                       before a request of the class ended
    apsd_batch_window_seconds                 gauge    the governor's current batch window
    apsd_governor_entropy                     gauge    bits (no sample when the governor has none;
                                                       not ..._bits: promtool wants bytes)
    apsd_governor_state{state}                gauge    1 for the current state, 0 for every other
                                                       state the governor declares (``states``) or
                                                       reported before (ERROR when it raised)
    apsd_fairness_jain                        gauge    since start, over tenants with admitted work, of
                                                       output tokens / rate (no sample while there is
                                                       nothing to compare)
    apsd_fairness_jain_window                 gauge    over the service window, tenants with work in it, of
                                                       window tokens / weight (no sample: none was served)
    apsd_service_window_seconds               gauge    the window's length: 60 model seconds
    apsd_conservation_ok                      gauge    1 when admitted == completed + failed +
                                                       cancelled + queued + running, else 0
    apsd_store_info{kind}                     gauge    memory or redis (``[store]``)
    apsd_store_available                      gauge    1 while the shared store can be reached
    apsd_store_outages_total                  counter  times it became unreachable
    apsd_store_syncs_total                    counter  exchanges with it, succeeded and failed
    apsd_store_sync_failures_total            counter
    apsd_store_replicas                       gauge    replicas seen sharing it in the last second
    apsd_store_leased_tokens                  gauge    tokens this replica holds leased
    apsd_key_info{tenant,key,name,owner}      gauge    1 per issued key in force (key: its id)
    apsd_key_requests_total{tenant,key,outcome} counter requests that came with the key, by outcome
                                                       (admitted, completed, failed, cancelled)
    apsd_key_tokens_total{tenant,key,phase}   counter  tokens charged to the key's requests (prompt, generated)
    apsd_key_spend_usd_total{tenant,key}      counter  what they spent at [prices] (US dollars)
    apsd_budget_used_ratio{tenant,key,unit}   gauge    a budget's spend this period / its limit (key: "" for
                                                       the tenant's own; unit: tokens or usd)
    apsd_budget_alert_threshold{tenant,key,unit} gauge the highest [alerts] threshold that spend reached
                                                       this period (0: none): what the alerts said
    apsd_accepting                            gauge    1 while admitting, 0 once draining
    apsd_policy_info{aging,governor,batching,preset}  gauge 1: the policies in force
    apsd_tenant_service_window_tokens{tenant} gauge    output tokens served to the tenant in the window
    apsd_tenant_service_share{tenant}         gauge    its share of the window's tokens (0 to 1)
    apsd_tenant_weight_share{tenant}          gauge    its weight / the weights of tenants with work in the
                                                       window (what fair share promises it when backlogged)

The service window (:mod:`apsd.core.service_window`): output tokens of finished requests, counted
at the model second they finished, over the last 60 model seconds in one-second buckets. A tenant
has work in the window when it was served in it or has requests queued or running now; the three
per-tenant window families have samples for those tenants only (a tenant that stopped drops out a
window later), so their series come and go, bounded by the configured tenants. Compare
``apsd_tenant_service_share`` with ``apsd_tenant_weight_share``: under ``fair`` (or ``vtc``) they
match while the tenants stay backlogged.

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

import array
import bisect
import functools
import itertools
import math
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Literal

import attrs
import trio
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

from apsd.core.classes import ClassFigures
from apsd.core.events import EventBus
from apsd.core.ledger import ChangeLog
from apsd.core.models import Completion, Dispatch, InferenceRequest, Outcome
from apsd.core.service_window import WINDOW_S, WorkingRow, watch_for
from apsd.serve.alerts import reached

if TYPE_CHECKING:
    from apsd.core.engine import BackendStatistics, EngineStatistics
    from apsd.core.ledger import Ledger, TenantStats
    from apsd.pipeline import GovernorView, Pipeline, PipelineStatistics
    from apsd.store import StoreStatistics

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

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        return _cumulative(self.bounds, self.counts)


def _cumulative(bounds: Sequence[float], counts: Iterable[int]) -> list[tuple[str, int]]:
    """``(le, cumulative count)`` per bucket, +Inf last (what HistogramMetricFamily takes)."""
    return [(floatToGoString(bound), total) for bound, total in zip((*bounds, math.inf), itertools.accumulate(counts))]


class HistogramObserver:
    """The histograms' only input: listeners on the ledger's event bus (see :meth:`subscribe`)."""

    def __init__(self, tenants: Iterable[str] = ()) -> None:
        self.tenants = {tenant: _TenantHistograms() for tenant in tenants}
        self.batch_size = _Histogram(BATCH_SIZE_BUCKETS)
        #: The tenants whose histograms had an observation (see :class:`~apsd.core.ledger.ChangeLog`).
        self.changes = ChangeLog()
        self._sorted: list[str] = []

    def histograms_for(self, tenant: str) -> _TenantHistograms:
        # admission admits configured tenants only: no series per client-chosen name
        histograms = self.tenants.get(tenant)
        if histograms is None:
            histograms = self.tenants[tenant] = _TenantHistograms()
        return histograms

    def sorted_tenants(self) -> list[str]:
        """The tenants with histograms, sorted (sorted again only when one was added: none is removed)."""
        if len(self._sorted) != len(self.tenants):
            self._sorted = sorted(self.tenants)
        return self._sorted

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe("request_dispatched", self.request_dispatched, "the Prometheus histograms")
        bus.subscribe("request_started", self.request_started, "the Prometheus histograms")
        bus.subscribe("request_finished", self.request_finished, "the Prometheus histograms")
        bus.subscribe("batch_finished", self.batch_finished, "the Prometheus histograms")

    def request_dispatched(self, request: InferenceRequest) -> None:
        assert request.dispatched_at is not None
        self.histograms_for(request.tenant_id).observe(_QUEUE_WAIT, request.dispatched_at - request.arrival)
        self.changes.touch(request.tenant_id)

    def request_started(self, request: InferenceRequest, now: float) -> None:
        self.histograms_for(request.tenant_id).observe(_TTFT, now - request.arrival)
        self.changes.touch(request.tenant_id)

    def request_finished(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        if isinstance(outcome, Completion):
            histograms = self.histograms_for(request.tenant_id)
            histograms.observe(_LATENCY, now - request.arrival)
            if outcome.tpot_ms is not None:
                histograms.observe(_TPOT, outcome.tpot_ms / 1000.0)
            self.changes.touch(request.tenant_id)

    def batch_finished(self, batch: Dispatch) -> None:
        self.batch_size.observe(len(batch.requests))


# -- the families with a series per tenant --------------------------------------------------------
# (name, documentation) of the per-tenant counters and gauges, in exposition order.
_REQUESTS = ("apsd_requests_total", ("Requests by tenant and outcome: admitted or rejected when received; an "
                                    "admitted request later counts once as completed, failed or cancelled (empty "
                                    "tenant: no configured tenant named)"))
_REJECTIONS = ("apsd_rejections_total", "Requests refused before admission, by tenant and error code")
_IN_FLIGHT = ("apsd_requests_in_flight", "Admitted requests without an outcome yet, by tenant and state")
_TOKENS = ("apsd_tokens_total", ("Tokens charged to the tenant, by phase (prompt, generated): what its "
                                "completed requests, and those cancelled while running, used"))
_TENANT_COST = ("apsd_tenant_cost_usd_total", ("Cost in USD of what the tenant was charged (its share of its "
                                              "engines' time)"))
_TENANT_QUEUE = ("apsd_tenant_queue_depth", ("Requests of the tenant waiting for dispatch (its "
                                             "apsd_requests_in_flight with state queued, on its own)"))
_TENANT_SPEND = ("apsd_tenant_spend_usd_total", ("What the tenant's requests cost it at the [prices] of their "
                                                "models, in US dollars (what dollar budgets hold)"))
#: (name, documentation) of the per-tenant gauges of the service window, in exposition order (the last
#: families): samples only for tenants with work in the window (:mod:`apsd.core.service_window`).
_WINDOW_FAMILIES = (
    ("apsd_tenant_service_window_tokens", (f"Output tokens served to the tenant in the last {WINDOW_S:g} model "
                                           "seconds (tenants with work in the window: served in it, or with "
                                           "requests queued or running)")),
    ("apsd_tenant_service_share", "The tenant's share of the output tokens served in the window (0 to 1)"),
    ("apsd_tenant_weight_share", ("The tenant's weight / the sum of the weights of the tenants with work in the "
                                  "window: the share fair-share policies give it while it stays backlogged")),
)
#: (name, documentation, bucket bounds) of the per-tenant histograms, in exposition order.
_TENANT_HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("apsd_queue_wait_seconds", "Model seconds from admission to dispatch, per dispatch", QUEUE_WAIT_BUCKETS),
    ("apsd_ttft_seconds", "Model seconds from admission to the first token, per started request", LATENCY_BUCKETS),
    ("apsd_tpot_seconds", ("Mean model seconds per output token after the first, per completed request of two "
                           "tokens or more"), TPOT_BUCKETS),
    ("apsd_request_latency_seconds", "Model seconds from admission to the last token, per completed request",
     LATENCY_BUCKETS),
)
_QUEUE_WAIT, _TTFT, _TPOT, _LATENCY = range(len(_TENANT_HISTOGRAMS))
#: Where each per-tenant histogram's bucket counts (its +Inf bucket last) start in
#: ``_TenantHistograms.counts``, and where the last one ends.
_STARTS = (0, *itertools.accumulate(len(bounds) + 1 for _, _, bounds in _TENANT_HISTOGRAMS))


class _TenantHistograms:
    """One tenant's histograms (``_TENANT_HISTOGRAMS``' order): every bucket count in one array,
    the sums in another. A full garbage collection, which comes every few hundred milliseconds
    under load, visits every object the collector tracks and everything they refer to; arrays
    refer to nothing. So a tenant's histograms cost it three small objects (rather than nine, and
    66 list slots to follow), and the collector's pauses grow that much less with the tenants."""

    __slots__ = ("_shared", "counts", "sums")

    def __init__(self) -> None:
        self.counts = array.array("q", bytes(8 * _STARTS[-1]))
        self.sums = array.array("d", bytes(8 * len(_TENANT_HISTOGRAMS)))
        self._shared = False  # a scrape holds the arrays: the next change copies them first

    def observe(self, which: int, value: float) -> None:
        if self._shared:
            self.counts, self.sums, self._shared = self.counts[:], self.sums[:], False
        bounds = _TENANT_HISTOGRAMS[which][2]
        self.counts[_STARTS[which] + bisect.bisect_left(bounds, value)] += 1  # le: value <= bound
        self.sums[which] += value

    def share(self) -> _HistogramsRow:
        """The counts (not cumulative) and sums as of now, in O(1): the arrays are handed over as
        they are and the next observation changes copies (the holder may read them in another thread)."""
        self._shared = True
        return self.counts, self.sums

    def buckets(self, which: int) -> list[tuple[str, int]]:
        return _cumulative(_TENANT_HISTOGRAMS[which][2], self.counts[_STARTS[which]:_STARTS[which + 1]])


#: One tenant's counters as a scrape shows them: admitted, rejected, completed, failed, cancelled
#: (``_OUTCOMES``' order), (error, count) pairs sorted, queued, running, prompt and generated tokens, cost,
#: spend.
_CounterRow = tuple[int, int, int, int, int, tuple[tuple[str, int], ...], int, int, int, int, float, float]
#: One tenant's histograms as a scrape shows them: its bucket counts and sums (``_TenantHistograms``).
#: Where each of ``_WINDOW_FAMILIES``' values is in a :data:`~apsd.core.service_window.WorkingRow`.
_WINDOW_FIELDS = (2, 3, 4)
_HistogramsRow = tuple["array.array[int]", "array.array[float]"]


def _counter_row(stats: TenantStats) -> _CounterRow:
    return (stats.admitted, stats.rejected, stats.completed, stats.failed, stats.cancelled,
            tuple(sorted(stats.rejected_by_error.items())), stats.queued, stats.running, stats.prompt_tokens,
            stats.generated_tokens, stats.cost_usd, stats.spend_usd)


class _Families:
    """A collector of given families (what ``generate_latest`` renders)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


@attrs.frozen
class _Scrape:
    """One scrape's moment, copied in the trio thread: all that rendering it reads."""

    #: Configured tenants, in the ledger's order; the rows of those whose lines must be rendered
    #: (every tenant, or those whose counters moved since the chunks' mark); the ledger's mark.
    tenants: list[str]
    counters: dict[str, _CounterRow]
    counters_mark: int
    unattributed: _CounterRow
    #: The same for the tenants with histograms, sorted, and the observer's mark.
    histogram_tenants: list[str]
    histograms: dict[str, _HistogramsRow]
    histograms_mark: int
    #: The families between the per-tenant counters and the per-tenant histograms, and those after
    #: (a few dozen samples: rendered by prometheus_client itself, in the trio thread).
    middle: bytes
    end: bytes
    #: The tenants with work in the service window (the last families, rendered with the others').
    window: list[WorkingRow]


@attrs.frozen
class _FairnessNow:
    """The service window's figures as a scrape shows them: the tenants with work only, in time
    proportional to their number (:meth:`~apsd.core.service_window.FairnessWatch.working`; the
    figures of :meth:`~apsd.pipeline.Pipeline.fairness_view`)."""

    window_s: float
    jain_window: float | None
    rows: list[WorkingRow]
    bands: dict[str, int]

    @classmethod
    def of(cls, pipeline: Pipeline) -> _FairnessNow:
        watch = watch_for(pipeline.ledger)
        rows, jain = watch.working(pipeline.clock.now(), pipeline.config.tenants)
        return cls(window_s=watch.window.length_s, jain_window=jain, rows=rows, bands=watch.bands())


@attrs.define(eq=False)
class _Chunks:
    """Each tenant's rendered lines, one chunk per family, as of the ``ChangeLog`` marks.

    Read and written by one scrape at a time (the exporter's lock). A tenant not logged as
    changed after the mark keeps its chunks; the marks move only once a rendering finished,
    so a rendering that fails half-way is redone from the same marks.
    """

    counters: dict[str, tuple[bytes, ...]] = attrs.field(factory=dict)
    counters_mark: int = 0
    histograms: dict[str, tuple[bytes, ...]] = attrs.field(factory=dict)
    histograms_mark: int = 0


def _escape(value: str) -> str:
    """A label value as prometheus_client's text format escapes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


_SMALL_NUMBERS = tuple(f"{n}.0" for n in range(100_000))


def _number(value: float) -> str:
    """``floatToGoString(value)``; small counts from a table (``repr(float(n))`` is ``"n.0"`` below 10**6)."""
    if type(value) is int and 0 <= value < 100_000:
        return _SMALL_NUMBERS[value]
    return floatToGoString(value)


def _header(kind: type[Metric], name: str, documentation: str) -> bytes:
    """A family's ``# HELP`` and ``# TYPE`` lines, as prometheus_client renders them."""
    return generate_latest(_Families([kind(name, documentation, labels=["tenant"])]))


_COUNTER_HEADERS = (_header(CounterMetricFamily, *_REQUESTS), _header(CounterMetricFamily, *_REJECTIONS),
                    _header(GaugeMetricFamily, *_IN_FLIGHT), _header(CounterMetricFamily, *_TOKENS),
                    _header(CounterMetricFamily, *_TENANT_COST), _header(GaugeMetricFamily, *_TENANT_QUEUE),
                    _header(CounterMetricFamily, *_TENANT_SPEND))
_WINDOW_HEADERS = tuple(_header(GaugeMetricFamily, name, documentation) for name, documentation in _WINDOW_FAMILIES)
_HISTOGRAM_HEADERS = tuple(_header(HistogramMetricFamily, name, documentation)
                           for name, documentation, _ in _TENANT_HISTOGRAMS)
#: Per histogram family: each ``_bucket`` line's start, up to the tenant label.
_BUCKET_PREFIXES = tuple(tuple(f'{name}_bucket{{le="{floatToGoString(bound)}",' for bound in (*bounds, math.inf))
                         for name, _, bounds in _TENANT_HISTOGRAMS)


def _counter_chunks(tenant: str, row: _CounterRow, attributed: bool = True) -> tuple[bytes, ...]:
    """One tenant's lines of each per-tenant counter family (``_COUNTER_HEADERS``' order); the
    unattributed row has only its non-zero outcomes (and ``rejected``) and its rejections."""
    label = f'tenant="{_escape(tenant)}"'
    requests = "".join([f'apsd_requests_total{{outcome="{outcome}",{label}}} {_number(value)}\n'
                        for outcome, value in zip(_OUTCOMES, row) if attributed or value or outcome == "rejected"])
    rejections = "".join([f'apsd_rejections_total{{error="{_escape(error)}",{label}}} {_number(count)}\n'
                          for error, count in row[5]])
    if not attributed:
        return requests.encode(), rejections.encode(), b"", b"", b"", b"", b""
    _, _, _, _, _, _, queued, running, prompt, generated, cost, spend = row
    return (requests.encode(), rejections.encode(),
            (f'apsd_requests_in_flight{{state="queued",{label}}} {_number(queued)}\n'
             f'apsd_requests_in_flight{{state="running",{label}}} {_number(running)}\n').encode(),
            (f'apsd_tokens_total{{phase="prompt",{label}}} {_number(prompt)}\n'
             f'apsd_tokens_total{{phase="generated",{label}}} {_number(generated)}\n').encode(),
            f'apsd_tenant_cost_usd_total{{{label}}} {_number(cost)}\n'.encode(),
            f'apsd_tenant_queue_depth{{{label}}} {_number(queued)}\n'.encode(),
            f'apsd_tenant_spend_usd_total{{{label}}} {_number(spend)}\n'.encode())


def _window_chunks(rows: Sequence[WorkingRow]) -> list[bytes]:
    """The lines of each ``_WINDOW_FAMILIES`` family, headers included."""
    chunks = []
    for (name, _), header, field in zip(_WINDOW_FAMILIES, _WINDOW_HEADERS, _WINDOW_FIELDS):
        lines = [f'{name}{{tenant="{_escape(row[0])}"}} {_number(row[field])}\n' for row in rows]
        chunks += [header, "".join(lines).encode()]
    return chunks


def _histogram_chunks(tenant: str, row: _HistogramsRow) -> tuple[bytes, ...]:
    """One tenant's lines of each per-tenant histogram family (``_HISTOGRAM_HEADERS``' order)."""
    label = f'tenant="{_escape(tenant)}"'
    counts, sums = row
    chunks = []
    for which, ((name, _, _), prefixes) in enumerate(zip(_TENANT_HISTOGRAMS, _BUCKET_PREFIXES)):
        cumulative = list(itertools.accumulate(counts[_STARTS[which]:_STARTS[which + 1]]))
        lines = [f"{prefix}{label}}} {_number(count)}\n" for prefix, count in zip(prefixes, cumulative)]
        lines.append(f"{name}_count{{{label}}} {_number(cumulative[-1])}\n"
                     f"{name}_sum{{{label}}} {_number(sums[which])}\n")
        chunks.append("".join(lines).encode())
    return tuple(chunks)


#: Tenants a worker thread renders between two offers of the GIL (about 0.5 ms of work).
_TENANTS_PER_GIL_RELEASE = 16
#: Held for ever: a worker thread waits a microsecond on it to hand the GIL to the event loop.
_NEVER_RELEASED = threading.Lock()
_NEVER_RELEASED.acquire()


def _offer_gil() -> None:
    """Let the event loop's thread take the GIL if it wants it, in a worker thread.

    A call that merely drops the GIL for an instant (``select`` with no timeout, ``os.sched_yield``)
    takes it back before the waiting thread wakes; blocking for a moment on a lock hands it over,
    as ``time.sleep(0)`` would (apsd keeps ``time`` for trio's clock: tests/unit/test_codebase.py). It
    reads no clock and waits for nothing but the handover.
    """
    _NEVER_RELEASED.acquire(timeout=1e-6)


def _render(scrape: _Scrape, chunks: _Chunks, *, in_worker: bool = False) -> bytes:
    """The exposition of ``scrape``: the tenants it carries rendered into ``chunks``, the others'
    lines taken from there. Reads nothing but its arguments (it may run in a worker thread).

    ``in_worker``: offer the GIL to the event loop every few tenants (:func:`_offer_gil`). Left to
    itself a busy thread keeps the GIL for the 5 ms switch interval, and the event loop, which
    gives it up at every socket call, would wait that long after each one (the convoy effect).
    The final join of the chunks holds no GIL at all (``bytes.join`` lets go above 1 MB).
    """
    rendered_since_pause = 0

    def pause() -> None:
        nonlocal rendered_since_pause
        rendered_since_pause += 1
        if in_worker and rendered_since_pause >= _TENANTS_PER_GIL_RELEASE:
            rendered_since_pause = 0
            _offer_gil()

    for tenant, row in scrape.counters.items():
        chunks.counters[tenant] = _counter_chunks(tenant, row)
        pause()
    for tenant, histograms in scrape.histograms.items():
        chunks.histograms[tenant] = _histogram_chunks(tenant, histograms)
        pause()
    chunks.counters_mark, chunks.histograms_mark = scrape.counters_mark, scrape.histograms_mark
    unattributed = _counter_chunks(UNATTRIBUTED, scrape.unattributed, attributed=False)
    rendered = [chunks.counters[tenant] for tenant in scrape.tenants]
    parts: list[bytes] = []
    for index, header in enumerate(_COUNTER_HEADERS):
        parts.append(header)
        parts.extend([tenant_chunks[index] for tenant_chunks in rendered])
        parts.append(unattributed[index])
    parts.append(scrape.middle)
    rendered = [chunks.histograms[tenant] for tenant in scrape.histogram_tenants]
    for index, header in enumerate(_HISTOGRAM_HEADERS):
        parts.append(header)
        parts.extend([tenant_chunks[index] for tenant_chunks in rendered])
    parts.append(scrape.end)
    parts += _window_chunks(scrape.window)
    return b"".join(parts)


class PrometheusExporter:
    """The registry, collector and histograms of one pipeline; build with :func:`exporter_for`.

    Two ways to the same bytes: :meth:`collect` (the registry's collector, rendered by
    prometheus_client's ``generate_latest``) is the reference; :meth:`scrape` and
    :meth:`exposition` render the per-tenant families themselves, line for line the same,
    and the other families with prometheus_client (see the module docstring).
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, pipeline: Pipeline) -> None:
        # (a weak reference: the exporter lives in a WeakKeyDictionary keyed by the pipeline)
        self._pipeline = weakref.ref(pipeline)
        self.observer = HistogramObserver(pipeline.ledger.tenants)
        self.observer.subscribe(pipeline.ledger.events)
        watch_for(pipeline.ledger)  # (the service window counts from now: before the daemon serves)
        self._states_seen: dict[str, None] = {}
        self._tenants_with_histograms = 0
        self._chunks = _Chunks()
        self._scrape_lock = trio.Lock()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    async def scrape(self) -> bytes:
        """The text exposition format (``content_type``) of every metric, now, without holding up
        the event loop: what ``GET /metrics`` serves.

        The moment is copied in the trio thread (the figures of the tenants whose figures moved
        since the last scrape: nothing is summed over tenants); the lines are rendered from that
        copy in a worker thread (``trio.to_thread.run_sync``), each tenant's only when its
        figures moved, offering the GIL back every few tenants. One scrape at a time: a second
        waits for the first. Cancelled, it still waits for its worker thread (which touches
        nothing but the copy and the exporter's chunks).
        """
        async with self._scrape_lock:
            pipeline = self._pipeline()
            if pipeline is None or UNATTRIBUTED in pipeline.ledger.tenants:
                return generate_latest(self.registry)
            scrape = self._take(pipeline, self._chunks)
            return await trio.to_thread.run_sync(functools.partial(_render, scrape, self._chunks, in_worker=True))

    def exposition(self) -> bytes:
        """The same bytes as :meth:`scrape`, rendered whole in the calling thread (it blocks it).

        A tenant configured with the blank name (whose figures are added to the unattributed
        refusals') is left to prometheus_client, which adds the samples up.
        """
        pipeline = self._pipeline()
        if pipeline is None or UNATTRIBUTED in pipeline.ledger.tenants:
            return generate_latest(self.registry)
        chunks = _Chunks()
        return _render(self._take(pipeline, chunks), chunks)

    def _take(self, pipeline: Pipeline, chunks: _Chunks) -> _Scrape:
        """Copy what a scrape shows (in the trio thread: one consistent moment): the figures of the
        tenants that changed since ``chunks``' marks (or have no chunks yet), and the other
        families rendered. Time: proportional to the tenants that changed, not to all of them."""
        ledger, observer = pipeline.ledger, self.observer
        statistics = pipeline.statistics()  # the JSON view's figures, so both views agree
        fairness = _FairnessNow.of(pipeline)
        middle = generate_latest(_Families(self._middle_families(pipeline, statistics, fairness)))
        self._histograms_for_every_tenant(ledger.tenants)
        histogram_tenants = observer.sorted_tenants()
        end = generate_latest(_Families(self._end_families(pipeline, statistics, fairness)))
        stats = ledger.tenants
        # (tenants are only ever added, to both: a count that differs means some have no chunks yet)
        changed = stats if len(chunks.counters) != len(stats) else ledger.changes.since(chunks.counters_mark)
        counters = {tenant: _counter_row(stats[tenant]) for tenant in changed if tenant in stats}
        every = observer.tenants
        changed = every if len(chunks.histograms) != len(every) else observer.changes.since(chunks.histograms_mark)
        histograms = {tenant: every[tenant].share() for tenant in changed}
        return _Scrape(tenants=list(stats), counters=counters, counters_mark=ledger.changes.mark,
                       unattributed=_counter_row(ledger.unattributed), histogram_tenants=list(histogram_tenants),
                       histograms=histograms, histograms_mark=observer.changes.mark, middle=middle, end=end,
                       window=fairness.rows)

    def _histograms_for_every_tenant(self, tenants: Mapping[str, object]) -> None:
        """Every configured tenant has its histogram series from the start (the ledger only ever
        adds tenants: a loop only when their number changed)."""
        if len(tenants) != self._tenants_with_histograms:
            for tenant in tenants:
                self.observer.histograms_for(tenant)
            self._tenants_with_histograms = len(tenants)

    # -- the collector (the reference rendering) ---------------------------------------------
    def collect(self) -> Iterator[Metric]:
        pipeline = self._pipeline()
        if pipeline is None:
            return
        statistics = pipeline.statistics()  # the JSON view's figures, so both views agree
        fairness = _FairnessNow.of(pipeline)
        yield from self._tenant_counter_families(pipeline.ledger)
        yield from self._middle_families(pipeline, statistics, fairness)
        for tenant in pipeline.ledger.tenants:  # every configured tenant has its series from the start
            self.observer.histograms_for(tenant)
        yield from self._tenant_histogram_families()
        yield from self._end_families(pipeline, statistics, fairness)
        yield from self._window_families(fairness)

    @staticmethod
    def _tenant_counter_families(ledger: Ledger) -> Iterator[Metric]:
        per_tenant: list[tuple[str, TenantStats]] = [*ledger.tenants.items(), (UNATTRIBUTED, ledger.unattributed)]
        requests = _Samples()
        rejections = _Samples()
        in_flight = _Samples()
        tokens = _Samples()
        tenant_cost = _Samples()
        tenant_queue = _Samples()
        tenant_spend = _Samples()
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
                tenant_queue.add((tenant,), stats.queued)
                tenant_spend.add((tenant,), stats.spend_usd)

        yield requests.family(CounterMetricFamily, *_REQUESTS, ["tenant", "outcome"])
        yield rejections.family(CounterMetricFamily, *_REJECTIONS, ["tenant", "error"])
        yield in_flight.family(GaugeMetricFamily, *_IN_FLIGHT, ["tenant", "state"])
        yield tokens.family(CounterMetricFamily, *_TOKENS, ["tenant", "phase"])
        yield tenant_cost.family(CounterMetricFamily, *_TENANT_COST, ["tenant"])
        yield tenant_queue.family(GaugeMetricFamily, *_TENANT_QUEUE, ["tenant"])
        yield tenant_spend.family(CounterMetricFamily, *_TENANT_SPEND, ["tenant"])

    def _tenant_histogram_families(self) -> Iterator[Metric]:
        histograms = sorted(self.observer.tenants.items())
        for which, (name, documentation, _) in enumerate(_TENANT_HISTOGRAMS):
            family = HistogramMetricFamily(name, documentation, labels=["tenant"])
            for tenant, tenant_histograms in histograms:
                family.add_metric([tenant], tenant_histograms.buckets(which), tenant_histograms.sums[which])
            yield family

    @staticmethod
    def _window_families(fairness: _FairnessNow) -> Iterator[Metric]:
        """The per-tenant gauges of the service window (the last families)."""
        for (name, documentation), field in zip(_WINDOW_FAMILIES, _WINDOW_FIELDS):
            family = GaugeMetricFamily(name, documentation, labels=["tenant"])
            for row in fairness.rows:
                family.add_metric([row[0]], row[field])
            yield family

    @staticmethod
    def _middle_families(pipeline: Pipeline, statistics: PipelineStatistics,
                         fairness: _FairnessNow) -> Iterator[Metric]:
        """The totals and queue families (between the per-tenant counters and histograms)."""
        ledger = pipeline.ledger
        books = statistics.books
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
        bands = GaugeMetricFamily("apsd_queue_depth_band", "Requests waiting for dispatch, by the band of their "
                                  "priority bid (always the three bands; they add up to apsd_queue_depth)",
                                  labels=["band"])
        for band, count in fairness.bands.items():
            bands.add_metric([band], count)
        yield bands
        yield GaugeMetricFamily("apsd_queue_tokens", "Prompt + requested tokens of the requests waiting "
                                "for dispatch (bounded by queue.max_tokens)", value=books.tokens.queued)


    @staticmethod
    def _classes(figures: tuple[ClassFigures, ...]) -> Iterator[Metric]:
        """The service classes' attainment (:mod:`apsd.core.classes`)."""
        requests = CounterMetricFamily("apsd_class_requests", "Requests of each service class by result: met "
                                       "its targets, missed them, or refused for its deadline",
                                       labels=["class", "result"])
        attainment = GaugeMetricFamily("apsd_class_attainment", "Share of a service class's requests that met "
                                       "its targets: met / (met + missed + refused)", labels=["class"])
        for row in figures:
            for result in ("met", "missed", "refused"):
                requests.add_metric([row.name, result], getattr(row, result))
            if row.attainment is not None:
                attainment.add_metric([row.name], row.attainment)
        yield requests
        yield attainment
    def _end_families(self, pipeline: Pipeline, statistics: PipelineStatistics,
                      fairness_now: _FairnessNow) -> Iterator[Metric]:
        """Every family after the per-tenant histograms."""
        books = statistics.books
        batch_size = HistogramMetricFamily("apsd_batch_size", "Requests per micro-batch, per batch that ran")
        batch_size.add_metric([], self.observer.batch_size.buckets(), self.observer.batch_size.sum)
        yield batch_size
        yield from self._engines(statistics.engines)
        yield from self._backends(statistics.backends)
        routes = CounterMetricFamily("apsd_route_decisions", "Requests the routing policy sent to a backend or "
                                     "engine, by the reason for its choice", labels=["target", "reason"])
        for (target, reason), count in sorted(statistics.routes.items()):
            routes.add_metric([target, reason], count)
        yield routes
        yield from self._classes(pipeline.class_statistics())

        declared = getattr(pipeline.scheduler.policies.governor, "states", ())
        yield from self._governor(statistics.governor, declared if isinstance(declared, (tuple, list)) else ())
        jain = books.fairness.jain_index
        fairness = GaugeMetricFamily(
            "apsd_fairness_jain", "Jain's index over tenants with admitted work of output tokens / rate "
            "(1: service in proportion to rate; 1/n: one tenant got everything)")
        if jain is not None:
            fairness.add_metric([], jain)
        yield fairness
        window = GaugeMetricFamily(
            "apsd_fairness_jain_window", "Jain's index over the tenants with work in the service window of output "
            "tokens served in it / weight (1: service in proportion to weight; 1/n: one tenant got everything)")
        if fairness_now.jain_window is not None:
            window.add_metric([], fairness_now.jain_window)
        yield window
        yield GaugeMetricFamily("apsd_service_window_seconds", "Model seconds the service window spans (of the "
                                "apsd_tenant_service_*, apsd_tenant_weight_share and apsd_fairness_jain_window "
                                "families)",
                                value=fairness_now.window_s)
        yield GaugeMetricFamily("apsd_conservation_ok",
                                "1 when admitted == completed + failed + cancelled + queued + running",
                                value=1 if books.requests.conservation_ok else 0)
        yield from self._keys(pipeline)
        yield from self._budgets(pipeline)
        yield GaugeMetricFamily("apsd_accepting", "1 while admitting requests, 0 once shutting down",
                                value=1 if pipeline.accepting else 0)
        yield from self._store(pipeline.store.statistics())
        policy = {kind: str(statistics.policy.get(kind) or "") for kind in ("aging", "governor", "batching",
                                                                            "preset")}
        info = GaugeMetricFamily("apsd_policy_info", "The policies in force (value always 1)",
                                 labels=list(policy))
        info.add_metric(list(policy.values()), 1)
        yield info

    @staticmethod
    def _keys(pipeline: Pipeline) -> Iterator[Metric]:
        """Issued keys: who they are (in force), and their requests' counters (since start, keys with
        requests; :attr:`apsd.core.ledger.Ledger.keys`)."""
        info = GaugeMetricFamily("apsd_key_info", "An issued API key in force (value always 1): its tenant, id, "
                                 "name and owner", labels=["tenant", "key", "name", "owner"])
        for key in sorted(pipeline.config.keys.values(), key=lambda k: (k.tenant, k.key_id)):
            info.add_metric([key.tenant, key.key_id, key.label, key.owner], 1)
        yield info
        requests = CounterMetricFamily("apsd_key_requests", "Requests that came with an issued key, by outcome "
                                       "(admitted, then completed, failed or cancelled)",
                                       labels=["tenant", "key", "outcome"])
        tokens = CounterMetricFamily("apsd_key_tokens", "Tokens charged to the requests of an issued key, by phase",
                                     labels=["tenant", "key", "phase"])
        spend = CounterMetricFamily("apsd_key_spend_usd", "What the requests of an issued key cost at [prices], "
                                    "in US dollars", labels=["tenant", "key"])
        for key_id, stats in sorted(pipeline.ledger.keys.items()):
            for outcome in ("admitted", "completed", "failed", "cancelled"):
                requests.add_metric([stats.tenant, key_id, outcome], getattr(stats, outcome))
            tokens.add_metric([stats.tenant, key_id, "prompt"], stats.prompt_tokens)
            tokens.add_metric([stats.tenant, key_id, "generated"], stats.generated_tokens)
            spend.add_metric([stats.tenant, key_id], stats.spend_usd)
        yield requests
        yield tokens
        yield spend

    @staticmethod
    def _budgets(pipeline: Pipeline) -> Iterator[Metric]:
        """Every budget in force: its spend this period as a share of its limit, and the highest
        ``[alerts]`` threshold that spend reached (what :mod:`apsd.serve.alerts` said)."""
        labels = ["tenant", "key", "unit"]
        used = GaugeMetricFamily("apsd_budget_used_ratio", "A budget's spend this period (every replica's, as last "
                                 "known) / its limit; key is empty for the tenant's own", labels=labels)
        alerted = GaugeMetricFamily("apsd_budget_alert_threshold", "The highest [alerts] threshold a budget's spend "
                                    "reached this period (0: none)", labels=labels)
        budgets = pipeline.admission.budgets
        thresholds = sorted(pipeline.config.alerts.thresholds)
        for account, limit in sorted(budgets.limits().items()):
            view = budgets.view(limit)
            values = [limit.tenant, limit.key_id or "", limit.unit]
            used.add_metric(values, view.used_ratio)
            alerted.add_metric(values, max((t for t in thresholds if reached(view.spent, limit.limit, t)), default=0.0))
        yield used
        yield alerted

    @staticmethod
    def _store(store: StoreStatistics) -> Iterator[Metric]:
        info = GaugeMetricFamily("apsd_store_info", "Where buckets and fair share live (value always 1)",
                                 labels=["kind"])
        info.add_metric([store.kind], 1)
        yield info
        yield GaugeMetricFamily("apsd_store_available", "1 while the shared store can be reached (always 1 in memory)",
                                value=1 if store.available else 0)
        yield CounterMetricFamily("apsd_store_outages", "Times the shared store became unreachable",
                                  value=store.outages)
        yield CounterMetricFamily("apsd_store_syncs", "Exchanges with the shared store that succeeded",
                                  value=store.syncs)
        yield CounterMetricFamily("apsd_store_sync_failures", "Exchanges with the shared store that failed",
                                  value=store.sync_failures)
        yield GaugeMetricFamily("apsd_store_replicas", "Replicas seen sharing the store in the last second",
                                value=store.replicas)
        yield GaugeMetricFamily("apsd_store_leased_tokens", "Tokens this replica holds leased from shared buckets",
                                value=store.leased_tokens)

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
            "kv_usage": GaugeMetricFamily("apsd_backend_kv_usage_ratio", "Share of the backend's KV cache in use "
                                          "(0 to 1), as its metrics last said", labels=labels),
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
            if b.kv_usage is not None:
                families["kv_usage"].add_metric(label, b.kv_usage)
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
    (:func:`apsd.serve.http.create_app` does, before the daemon serves a request).
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
