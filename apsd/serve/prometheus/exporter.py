"""The exporter of one pipeline: its registry, its histograms and its scrapes (see the package docstring)."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import trio
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from apsd.core.service_window import watch_for
from apsd.serve.prometheus import families, lines
from apsd.serve.prometheus.families import UNATTRIBUTED, FairnessNow, Families
from apsd.serve.prometheus.histograms import HistogramObserver
from apsd.serve.prometheus.lines import Chunks, Scrape, counter_row

if TYPE_CHECKING:
    from apsd.pipeline import Pipeline, PipelineStatistics


class PrometheusExporter:
    """The registry, collector and histograms of one pipeline; build with :func:`exporter_for`.

    Two ways to the same bytes: :meth:`collect` (the registry's collector, rendered by
    prometheus_client's ``generate_latest``) is the reference; :meth:`scrape` and
    :meth:`exposition` render the per-tenant families themselves, line for line the same,
    and the other families with prometheus_client (see the package docstring).
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
        self._chunks = Chunks()
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
            return await trio.to_thread.run_sync(functools.partial(lines.render, scrape, self._chunks, in_worker=True))

    def exposition(self) -> bytes:
        """The same bytes as :meth:`scrape`, rendered whole in the calling thread (it blocks it).

        A tenant configured with the blank name (whose figures are added to the unattributed
        refusals') is left to prometheus_client, which adds the samples up.
        """
        pipeline = self._pipeline()
        if pipeline is None or UNATTRIBUTED in pipeline.ledger.tenants:
            return generate_latest(self.registry)
        chunks = Chunks()
        return lines.render(self._take(pipeline, chunks), chunks)

    def _take(self, pipeline: Pipeline, chunks: Chunks) -> Scrape:
        """Copy what a scrape shows (in the trio thread: one consistent moment): the figures of the
        tenants that changed since ``chunks``' marks (or have no chunks yet), and the other
        families rendered. Time: proportional to the tenants that changed, not to all of them."""
        ledger, observer = pipeline.ledger, self.observer
        statistics = pipeline.statistics()  # the JSON view's figures, so both views agree
        fairness = FairnessNow.of(pipeline)
        middle = generate_latest(Families(families.middle_families(pipeline, statistics, fairness)))
        self._histograms_for_every_tenant(ledger.tenants)
        histogram_tenants = observer.sorted_tenants()
        end = generate_latest(Families(self._end_families(pipeline, statistics, fairness)))
        stats = ledger.tenants
        # (tenants are only ever added, to both: a count that differs means some have no chunks yet)
        changed = stats if len(chunks.counters) != len(stats) else ledger.changes.since(chunks.counters_mark)
        counters = {tenant: counter_row(stats[tenant]) for tenant in changed if tenant in stats}
        every = observer.tenants
        moved = every if len(chunks.histograms) != len(every) else observer.changes.since(chunks.histograms_mark)
        histograms = {tenant: every[tenant].share() for tenant in moved}
        return Scrape(tenants=list(stats), counters=counters, counters_mark=ledger.changes.mark,
                      unattributed=counter_row(ledger.unattributed), histogram_tenants=list(histogram_tenants),
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
        fairness = FairnessNow.of(pipeline)
        yield from families.tenant_counter_families(pipeline.ledger)
        yield from families.middle_families(pipeline, statistics, fairness)
        for tenant in pipeline.ledger.tenants:  # every configured tenant has its series from the start
            self.observer.histograms_for(tenant)
        yield from families.tenant_histogram_families(self.observer)
        yield from self._end_families(pipeline, statistics, fairness)
        yield from families.window_families(fairness)

    def _end_families(self, pipeline: Pipeline, statistics: PipelineStatistics,
                      fairness: FairnessNow) -> Iterator[Metric]:
        """Every family after the per-tenant histograms (the governor states seen are the exporter's)."""
        return families.end_families(pipeline, statistics, fairness, self.observer, self._states_seen)


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
