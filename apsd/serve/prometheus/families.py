"""The families of ``GET /metrics`` as prometheus_client builds them: the reference rendering
(:meth:`~apsd.serve.prometheus.exporter.PrometheusExporter.collect`) and, for the few dozen samples that are
not per tenant, the bytes every scrape serves. Each function reads the pipeline's frozen statistics
(or the histograms) and yields families; none changes anything but the governor states it remembers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Literal

import attrs
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from apsd.core.classes import ClassFigures
from apsd.core.service_window import WINDOW_S, WorkingRow, watch_for
from apsd.serve.alerts import reached
from apsd.serve.prometheus.histograms import TENANT_HISTOGRAMS, HistogramObserver

if TYPE_CHECKING:
    from apsd.core.engine import BackendStatistics, EngineStatistics
    from apsd.core.ledger import Ledger, TenantStats
    from apsd.pipeline import GovernorView, Pipeline, PipelineStatistics
    from apsd.store import StoreStatistics

#: The ``tenant`` label of refusals that name no configured tenant.
UNATTRIBUTED = ""
#: States remembered for ``apsd_governor_state`` (reported 0 once left); a bound, not a limit in practice.
_MAX_GOVERNOR_STATES = 32
OUTCOMES = ("admitted", "rejected", "completed", "failed", "cancelled")

#: (name, documentation) of the per-tenant counters and gauges, in exposition order.
REQUESTS = ("apsd_requests_total", ("Requests by tenant and outcome: admitted or rejected when received; an "
                                    "admitted request later counts once as completed, failed or cancelled (empty "
                                    "tenant: no configured tenant named)"))
REJECTIONS = ("apsd_rejections_total", "Requests refused before admission, by tenant and error code")
IN_FLIGHT = ("apsd_requests_in_flight", "Admitted requests without an outcome yet, by tenant and state")
TOKENS = ("apsd_tokens_total", ("Tokens charged to the tenant, by phase (prompt, generated): what its "
                                "completed requests, and those cancelled while running, used"))
TENANT_COST = ("apsd_tenant_cost_usd_total", ("Cost in USD of what the tenant was charged (its share of its "
                                              "engines' time)"))
TENANT_QUEUE = ("apsd_tenant_queue_depth", ("Requests of the tenant waiting for dispatch (its "
                                             "apsd_requests_in_flight with state queued, on its own)"))
TENANT_SPEND = ("apsd_tenant_spend_usd_total", ("What the tenant's requests cost it at the [prices] of their "
                                                "models, in US dollars (what dollar budgets hold)"))
#: (name, documentation) of the per-tenant gauges of the service window, in exposition order (the last
#: families): samples only for tenants with work in the window (:mod:`apsd.core.service_window`).
WINDOW_FAMILIES = (
    ("apsd_tenant_service_window_tokens", (f"Output tokens served to the tenant in the last {WINDOW_S:g} model "
                                           "seconds (tenants with work in the window: served in it, or with "
                                           "requests queued or running)")),
    ("apsd_tenant_service_share", "The tenant's share of the output tokens served in the window (0 to 1)"),
    ("apsd_tenant_weight_share", ("The tenant's weight / the sum of the weights of the tenants with work in the "
                                  "window: the share fair-share policies give it while it stays backlogged")),
)
#: Where each of ``WINDOW_FAMILIES``' values is in a :data:`~apsd.core.service_window.WorkingRow`.
WINDOW_FIELDS: tuple[Literal[2, 3, 4], ...] = (2, 3, 4)


class Families:
    """A collector of given families (what ``generate_latest`` renders)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


@attrs.frozen
class FairnessNow:
    """The service window's figures as a scrape shows them: the tenants with work only, in time
    proportional to their number (:meth:`~apsd.core.service_window.FairnessWatch.working`; the
    figures of :meth:`~apsd.pipeline.Pipeline.fairness_view`)."""

    window_s: float
    jain_window: float | None
    rows: list[WorkingRow]
    bands: dict[str, int]

    @classmethod
    def of(cls, pipeline: Pipeline) -> FairnessNow:
        watch = watch_for(pipeline.ledger)
        rows, jain = watch.working(pipeline.clock.now(), pipeline.config.tenants)
        return cls(window_s=watch.window.length_s, jain_window=jain, rows=rows, bands=watch.bands())


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


def tenant_counter_families(ledger: Ledger) -> Iterator[Metric]:
    """The per-tenant counters and gauges, the refusals that name no configured tenant last (``tenant=""``:
    equal label values add up, so a tenant configured with the blank name is added to them)."""
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
        for outcome in OUTCOMES:
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

    yield requests.family(CounterMetricFamily, *REQUESTS, ["tenant", "outcome"])
    yield rejections.family(CounterMetricFamily, *REJECTIONS, ["tenant", "error"])
    yield in_flight.family(GaugeMetricFamily, *IN_FLIGHT, ["tenant", "state"])
    yield tokens.family(CounterMetricFamily, *TOKENS, ["tenant", "phase"])
    yield tenant_cost.family(CounterMetricFamily, *TENANT_COST, ["tenant"])
    yield tenant_queue.family(GaugeMetricFamily, *TENANT_QUEUE, ["tenant"])
    yield tenant_spend.family(CounterMetricFamily, *TENANT_SPEND, ["tenant"])


def tenant_histogram_families(observer: HistogramObserver) -> Iterator[Metric]:
    """The per-tenant histograms, tenants sorted."""
    histograms = sorted(observer.tenants.items())
    for which, (name, documentation, _) in enumerate(TENANT_HISTOGRAMS):
        family = HistogramMetricFamily(name, documentation, labels=["tenant"])
        for tenant, tenant_histograms in histograms:
            family.add_metric([tenant], tenant_histograms.buckets(which), tenant_histograms.sums[which])
        yield family


def window_families(fairness: FairnessNow) -> Iterator[Metric]:
    """The per-tenant gauges of the service window (the last families)."""
    for (name, documentation), field in zip(WINDOW_FAMILIES, WINDOW_FIELDS):
        family = GaugeMetricFamily(name, documentation, labels=["tenant"])
        for row in fairness.rows:
            family.add_metric([row[0]], row[field])
        yield family


def middle_families(pipeline: Pipeline, statistics: PipelineStatistics, fairness: FairnessNow) -> Iterator[Metric]:
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
def end_families(pipeline: Pipeline, statistics: PipelineStatistics, fairness_now: FairnessNow,
                 observer: HistogramObserver, states_seen: dict[str, None]) -> Iterator[Metric]:
    """Every family after the per-tenant histograms."""
    books = statistics.books
    batch_size = HistogramMetricFamily("apsd_batch_size", "Requests per micro-batch, per batch that ran")
    batch_size.add_metric([], observer.batch_size.buckets(), observer.batch_size.sum)
    yield batch_size
    yield from _engines(statistics.engines)
    yield from _backends(statistics.backends)
    routes = CounterMetricFamily("apsd_route_decisions", "Requests the routing policy sent to a backend or "
                                 "engine, by the reason for its choice", labels=["target", "reason"])
    for (target, reason), count in sorted(statistics.routes.items()):
        routes.add_metric([target, reason], count)
    yield routes
    yield from _classes(pipeline.class_statistics())

    declared = getattr(pipeline.scheduler.policies.governor, "states", ())
    yield from _governor(statistics.governor, declared if isinstance(declared, (tuple, list)) else (), states_seen)
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
    yield from _keys(pipeline)
    yield from _budgets(pipeline)
    yield GaugeMetricFamily("apsd_accepting", "1 while admitting requests, 0 once shutting down",
                            value=1 if pipeline.accepting else 0)
    yield from _store(pipeline.store.statistics())
    policy = {kind: str(statistics.policy.get(kind) or "") for kind in ("aging", "governor", "batching",
                                                                        "preset")}
    info = GaugeMetricFamily("apsd_policy_info", "The policies in force (value always 1)",
                             labels=list(policy))
    info.add_metric(list(policy.values()), 1)
    yield info


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


def _engines(engines: Sequence[EngineStatistics]) -> Iterator[Metric]:
    gauges: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
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


def _backends(backends: Sequence[BackendStatistics]) -> Iterator[Metric]:
    """The forward engine's backends (no samples for the simulated engines)."""
    labels = ["backend"]
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
        "up": GaugeMetricFamily("apsd_backend_up", "1 while the backend passes its health checks",
                                labels=labels),
        "saturated": GaugeMetricFamily("apsd_backend_saturated", "1 while the backend takes no more work "
                                       "(its own queue or KV cache past the limits, by a reading younger than metrics_max_age_s)",
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


def _governor(view: GovernorView, declared: Iterable[str], seen: dict[str, None]) -> Iterator[Metric]:
    """The governor's state (every state seen so far is remembered in ``seen``, up to a bound), window and entropy."""
    state = view.state
    for name in (*declared, state):
        if name not in seen and len(seen) < _MAX_GOVERNOR_STATES:
            seen[name] = None
    states = GaugeMetricFamily("apsd_governor_state",
                               "1 for the governor's current state (ERROR: it raised), 0 for earlier ones",
                               labels=["state"])
    for name in sorted({*seen, state}):
        states.add_metric([name], 1 if name == state else 0)
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
