"""The histograms of ``GET /metrics``: every observation since start, per tenant, fed by the ledger's
event bus (:class:`HistogramObserver`, the histograms' only input; it observes, it decides nothing).

A tenant's four histograms live in two flat arrays (:class:`TenantHistograms`), handed to a scrape
copy-on-write, so that a scrape copies them in O(1) and the collector's pauses do not grow with them.
"""

from __future__ import annotations

import array
import bisect
import itertools
import math
from collections.abc import Iterable, Sequence

from prometheus_client.utils import floatToGoString

from apsd.core.events import EventBus
from apsd.core.ledger import ChangeLog
from apsd.core.models import Completion, Dispatch, InferenceRequest, Outcome

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


class Histogram:
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
        self.tenants = {tenant: TenantHistograms() for tenant in tenants}
        self.batch_size = Histogram(BATCH_SIZE_BUCKETS)
        #: The tenants whose histograms had an observation (see :class:`~apsd.core.ledger.ChangeLog`).
        self.changes = ChangeLog()
        self._sorted: list[str] = []

    def histograms_for(self, tenant: str) -> TenantHistograms:
        # admission admits configured tenants only: no series per client-chosen name
        histograms = self.tenants.get(tenant)
        if histograms is None:
            histograms = self.tenants[tenant] = TenantHistograms()
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


#: (name, documentation, bucket bounds) of the per-tenant histograms, in exposition order.
TENANT_HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("apsd_queue_wait_seconds", "Model seconds from admission to dispatch, per dispatch", QUEUE_WAIT_BUCKETS),
    ("apsd_ttft_seconds", "Model seconds from admission to the first token, per started request", LATENCY_BUCKETS),
    ("apsd_tpot_seconds", ("Mean model seconds per output token after the first, per completed request of two "
                           "tokens or more"), TPOT_BUCKETS),
    ("apsd_request_latency_seconds", "Model seconds from admission to the last token, per completed request",
     LATENCY_BUCKETS),
)
_QUEUE_WAIT, _TTFT, _TPOT, _LATENCY = range(len(TENANT_HISTOGRAMS))
#: Where each per-tenant histogram's bucket counts (its +Inf bucket last) start in
#: ``TenantHistograms.counts``, and where the last one ends.
STARTS = (0, *itertools.accumulate(len(bounds) + 1 for _, _, bounds in TENANT_HISTOGRAMS))


class TenantHistograms:
    """One tenant's histograms (``TENANT_HISTOGRAMS``' order): every bucket count in one array,
    the sums in another. A full garbage collection, which comes every few hundred milliseconds
    under load, visits every object the collector tracks and everything they refer to; arrays
    refer to nothing. So a tenant's histograms cost it three small objects (rather than nine, and
    66 list slots to follow), and the collector's pauses grow that much less with the tenants."""

    __slots__ = ("_shared", "counts", "sums")

    def __init__(self) -> None:
        self.counts = array.array("q", bytes(8 * STARTS[-1]))
        self.sums = array.array("d", bytes(8 * len(TENANT_HISTOGRAMS)))
        self._shared = False  # a scrape holds the arrays: the next change copies them first

    def observe(self, which: int, value: float) -> None:
        if self._shared:
            self.counts, self.sums, self._shared = self.counts[:], self.sums[:], False
        bounds = TENANT_HISTOGRAMS[which][2]
        self.counts[STARTS[which] + bisect.bisect_left(bounds, value)] += 1  # le: value <= bound
        self.sums[which] += value

    def share(self) -> HistogramsRow:
        """The counts (not cumulative) and sums as of now, in O(1): the arrays are handed over as
        they are and the next observation changes copies (the holder may read them in another thread)."""
        self._shared = True
        return self.counts, self.sums

    def buckets(self, which: int) -> list[tuple[str, int]]:
        return _cumulative(TENANT_HISTOGRAMS[which][2], self.counts[STARTS[which]:STARTS[which + 1]])


#: One tenant's histograms as a scrape shows them: its bucket counts and sums (``TenantHistograms``).
HistogramsRow = tuple["array.array[int]", "array.array[float]"]
