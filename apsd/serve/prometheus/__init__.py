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

from apsd.serve.prometheus.exporter import PrometheusExporter, exporter_for
from apsd.serve.prometheus.families import UNATTRIBUTED
from apsd.serve.prometheus.histograms import (
    BATCH_SIZE_BUCKETS,
    LATENCY_BUCKETS,
    QUEUE_WAIT_BUCKETS,
    TPOT_BUCKETS,
    HistogramObserver,
)
from apsd.serve.prometheus.negotiation import negotiate

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
