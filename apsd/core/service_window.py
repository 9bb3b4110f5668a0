"""Fairness as it is now: each tenant's service over a sliding window, and the queue by priority band.

Ownership: one :class:`FairnessWatch` per ledger (:func:`watch_for` makes it and subscribes it to
the ledger's :class:`~apsd.core.events.EventBus`; the Prometheus exporter does so when it is made,
before the daemon serves). It observes only: nothing on a request's way depends on it.
:meth:`apsd.pipeline.Pipeline.fairness_view` reads it into a :class:`FairnessView`, which
``GET /metrics`` exports and a status page may serialise.

Service in the window: a finished request's output tokens (``request.tokens_generated``, what the
ledger adds to the tenant's ``generated_tokens``: completed requests, and what cancelled or failed
ones produced) are counted at the model time it finished, in one-second buckets
(:class:`ServiceWindow`). The window is the last :data:`WINDOW_S` model seconds, in whole seconds
(the current second included), so a tenant that stopped being served drops out of it a minute
later. Each bucket holds ``tenant -> tokens`` beside running totals; a finished request costs O(1)
whatever the number of tenants (it takes at most two entries of expired buckets off the totals; a
reader takes off the rest), and the memory is at most one entry per tenant per bucket of the
window, and as many again waiting to be taken off. Only configured tenants (the ledger's) are
counted.

A tenant *has work in the window* when it was served in the window or has requests queued or
running now. Over those tenants:

* ``service_share``: its window tokens / all window tokens (0 when nothing was served);
* ``weight_share``: its ``[tenants.<name>] weight`` / the sum of their weights, the share the
  fair-share policies (``fair``, ``vtc``) promise it while it stays backlogged;
* ``jain_window``: Jain's index of window tokens / weight (1: service in proportion to weight;
  1/n: one tenant got everything; None when no tenant with work was served). The ledger's
  cumulative index (``apsd_fairness_jain``) divides by rate instead, since start.

Queue depth by band: requests queued now by the band of their ``priority_bid``
(:data:`BANDS`: ``1-3``, ``4-6``, ``7-10``, a fixed set), kept from the ledger's events
(admitted, dispatched, requeued, finished while queued) and started from the ledger's outstanding
requests when the watch is made; the bands add up to the ledger's ``queued_total``.

Reading: :meth:`FairnessWatch.working` finds the tenants with work among those served in the
window and those with requests in flight (also counted from the events), in time proportional to
their number, not to the tenants configured: what a scrape reads. :meth:`FairnessWatch.view`
(``Pipeline.fairness_view``) adds every idle configured tenant, unless asked not to.
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Mapping

import attrs

from apsd.core.config import MAX_BID, TenantConfig
from apsd.core.ledger import Ledger, billed_tokens, jain_index
from apsd.core.models import InferenceRequest, Outcome

__all__ = ["BANDS", "WINDOW_BUCKETS", "WINDOW_S", "FairnessView", "FairnessWatch", "ServiceWindow",
           "TenantFairness", "WorkingRow", "band_of", "watch_for"]

#: Model seconds of service the window holds, and its one-second buckets.
WINDOW_S = 60.0
WINDOW_BUCKETS = 60
#: Entries of expired buckets :meth:`ServiceWindow.add` takes off the totals, at most (more than the
#: one entry an add may create, so those waiting stay bounded).
_EXPIRED_PER_ADD = 2
#: A tenant with work, as :meth:`FairnessWatch.working` gives it: name, weight, window tokens, service
#: share, weight share, queued, running (:class:`TenantFairness`' fields).
WorkingRow = tuple[str, float, int, float, float, int, int]
#: The priority bands of ``apsd_queue_depth_band``: (label, lowest bid, highest bid), 1 to MAX_BID.
BANDS: tuple[tuple[str, int, int], ...] = (("1-3", 1, 3), ("4-6", 4, 6), ("7-10", 7, MAX_BID))


def band_of(bid: int) -> int:
    """The index in :data:`BANDS` of ``bid`` (bids outside 1..MAX_BID go to the nearest band)."""
    for index, (_, _, highest) in enumerate(BANDS):
        if bid <= highest:
            return index
    return len(BANDS) - 1


class ServiceWindow:
    """Tokens per key over the last ``buckets * bucket_s`` model seconds, in buckets of ``bucket_s``.

    :meth:`add` does a bounded amount of work whatever the number of keys: it counts the tokens in
    their bucket and in the running totals, and takes at most :data:`_EXPIRED_PER_ADD` entries of
    buckets that left the window off the totals (so a second in which thousands of keys were served
    never leaves all at once on one request's way, and the expired entries waiting never outnumber
    the live ones by more than one). :meth:`totals` takes off every entry left in expired buckets
    first: in time proportional to them, each removed once.
    """

    def __init__(self, buckets: int = WINDOW_BUCKETS, bucket_s: float = WINDOW_S / WINDOW_BUCKETS) -> None:
        if buckets < 1 or not bucket_s > 0:
            raise ValueError(f"a window needs at least one bucket of positive length, got {buckets} x {bucket_s}")
        self.buckets = buckets
        self.bucket_s = bucket_s
        #: bucket index (model time // bucket_s) -> tokens per key; the indices, oldest first, in a heap
        self._tokens: dict[int, dict[str, int]] = {}
        self._indices: list[int] = []
        self._totals: dict[str, int] = {}
        self._latest: int | None = None

    @property
    def length_s(self) -> float:
        return self.buckets * self.bucket_s

    @property
    def entries(self) -> int:
        """(key, bucket) entries held, those of expired buckets not yet taken off included."""
        return sum(len(bucket) for bucket in self._tokens.values())

    def _bucket(self, at: float) -> int:
        return math.floor(at / self.bucket_s)

    def _expire(self, oldest: int, limit: int | None) -> None:
        """Take entries of buckets before ``oldest`` off the totals: ``limit`` of them at most (None: all)."""
        indices, totals = self._indices, self._totals
        while indices and indices[0] < oldest:
            bucket = self._tokens[indices[0]]
            while bucket:
                if limit is not None:
                    if limit <= 0:
                        return
                    limit -= 1
                key, tokens = bucket.popitem()
                left = totals[key] - tokens
                if left:
                    totals[key] = left
                else:
                    del totals[key]
            del self._tokens[heapq.heappop(indices)]

    def add(self, key: str, tokens: int, at: float) -> None:
        """Count ``tokens`` served to ``key`` at model time ``at`` (a time a whole window or more
        before the latest one counted is out of the window: ignored)."""
        if tokens <= 0:
            return
        index = self._bucket(at)
        latest = self._latest
        if latest is None or index > latest:
            self._latest = latest = index
        elif index <= latest - self.buckets:
            return
        bucket = self._tokens.get(index)
        if bucket is None:
            bucket = self._tokens[index] = {}
            heapq.heappush(self._indices, index)
        bucket[key] = bucket.get(key, 0) + tokens
        self._totals[key] = self._totals.get(key, 0) + tokens
        self._expire(latest - self.buckets + 1, _EXPIRED_PER_ADD)

    def totals(self, now: float) -> dict[str, int]:
        """Tokens per key over the window ending at model time ``now`` (keys with none left out)."""
        self._expire(self._bucket(now) - self.buckets + 1, None)
        return dict(self._totals)


@attrs.frozen
class TenantFairness:
    """One configured tenant in :class:`FairnessView`."""

    name: str
    weight: float
    #: Output tokens served to it in the window.
    window_tokens: int
    #: Its share of the window's tokens, and its weight's share among tenants with work (both 0
    #: when it has none: no service in the window, nothing queued or running).
    service_share: float
    weight_share: float
    queued: int
    running: int

    @property
    def has_work(self) -> bool:
        """Served in the window, or with requests queued or running now."""
        return bool(self.window_tokens or self.queued or self.running)


@attrs.frozen
class FairnessView:
    """Fairness now (:meth:`apsd.pipeline.Pipeline.fairness_view`), in model time."""

    #: Model seconds the window spans (its one-second buckets: the current second included).
    window_s: float
    #: Jain's index over tenants with work of window tokens / weight (None: none of them was served).
    jain_window: float | None
    #: Every configured tenant, in the configuration's order (or, asked for without the idle ones,
    #: the tenants with work only, by name).
    tenants: tuple[TenantFairness, ...]
    #: Requests queued now per band of :data:`BANDS` (label -> count, in the bands' order).
    queue_depth_by_band: dict[str, int]


class FairnessWatch:
    """The window of service, the tenants with requests in flight and the queue by band, kept from a
    ledger's events (each O(1))."""

    def __init__(self, ledger: Ledger, window: ServiceWindow | None = None) -> None:
        self._tenants = ledger.tenants  # (the ledger's dict: tenants added later are seen)
        self.window = window if window is not None else ServiceWindow()
        self.queued_by_band = [0] * len(BANDS)
        #: Admitted requests without an outcome, per tenant that has any (so that a view finds the
        #: tenants with work without visiting every tenant).
        self.in_flight: dict[str, int] = {}
        for request in ledger.outstanding:  # what is in flight already
            self.request_admitted(request)
            if request.dispatched_at is not None:
                self.request_dispatched(request)
        events = ledger.events
        who = "the fairness window"
        events.subscribe("request_admitted", self.request_admitted, who)
        events.subscribe("request_dispatched", self.request_dispatched, who)
        events.subscribe("request_requeued", self.request_requeued, who)
        events.subscribe("request_finished", self.request_finished, who)

    def request_admitted(self, request: InferenceRequest) -> None:
        self.queued_by_band[band_of(request.priority_bid)] += 1
        tenant = request.tenant_id
        self.in_flight[tenant] = self.in_flight.get(tenant, 0) + 1

    def request_requeued(self, request: InferenceRequest) -> None:
        self.queued_by_band[band_of(request.priority_bid)] += 1

    def request_dispatched(self, request: InferenceRequest) -> None:
        self.queued_by_band[band_of(request.priority_bid)] -= 1

    def request_finished(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        if request.dispatched_at is None:  # it ended while queued (cancelled, timed out, shut down)
            self.queued_by_band[band_of(request.priority_bid)] -= 1
        tenant = request.tenant_id
        left = self.in_flight.get(tenant, 0) - 1
        if left > 0:
            self.in_flight[tenant] = left
        else:
            self.in_flight.pop(tenant, None)
        if tenant in self._tenants and billed_tokens(request, outcome):
            self.window.add(tenant, request.tokens_generated, now)

    def working(self, now: float, tenants: Mapping[str, TenantConfig]) -> tuple[list[WorkingRow], float | None]:
        """The configured ``tenants`` (by name: their weights) with work at model time ``now``, sorted
        by name, and the window's Jain index over them; in time proportional to their number."""
        served = self.window.totals(now)
        stats = self._tenants
        found = []
        for name in sorted(served.keys() | self.in_flight.keys()):
            config = tenants.get(name)
            if config is None:  # (removed from the configuration: its requests still finish)
                continue
            tokens = served.get(name, 0)
            tenant = stats.get(name)
            queued, running = (tenant.queued, tenant.running) if tenant is not None else (0, 0)
            if tokens or queued or running:
                found.append((name, config.weight, tokens, queued, running))
        total_tokens = sum(row[2] for row in found)
        total_weight = sum(row[1] for row in found)
        rows = [(name, weight, tokens, tokens / total_tokens if total_tokens else 0.0, weight / total_weight,
                 queued, running) for name, weight, tokens, queued, running in found]
        return rows, jain_index(tokens / weight for _, weight, tokens, _, _ in found)

    def bands(self) -> dict[str, int]:
        """Requests queued now per band of :data:`BANDS` (label -> count, in the bands' order)."""
        return {label: count for (label, _, _), count in zip(BANDS, self.queued_by_band)}

    def view(self, now: float, tenants: Mapping[str, TenantConfig], *, idle: bool = True) -> FairnessView:
        """Fairness at model time ``now`` over the configured ``tenants`` (their weights).

        ``idle``: every tenant of ``tenants``, in their order (a visit to each); otherwise only the
        tenants with work, sorted by name, in time proportional to their number.
        """
        rows, jain = self.working(now, tenants)
        entries = [TenantFairness(*row) for row in rows]
        if idle:
            by_name = {entry.name: entry for entry in entries}
            entries = [by_name.get(name) or TenantFairness(name=name, weight=config.weight, window_tokens=0,
                                                           service_share=0.0, weight_share=0.0, queued=0, running=0)
                       for name, config in tenants.items()]
        return FairnessView(window_s=self.window.length_s, jain_window=jain, tenants=tuple(entries),
                            queue_depth_by_band=self.bands())


_watches: weakref.WeakKeyDictionary[Ledger, FairnessWatch] = weakref.WeakKeyDictionary()


def watch_for(ledger: Ledger) -> FairnessWatch:
    """The ledger's watch, made (and subscribed to its events) on the first call: service counts
    from then on (the Prometheus exporter makes it when it is made)."""
    watch = _watches.get(ledger)
    if watch is None:
        watch = _watches[ledger] = FairnessWatch(ledger)
    return watch
