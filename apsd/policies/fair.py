"""Built-in aging policy ``fair``: weighted fair share between tenants, APS order inside each.

Two levels, both heaps, so every queue operation is O(log T + log N) for T backlogged
tenants and N queued requests:

* **Between tenants**, Virtual Token Counter fair queuing (Sheng et al., OSDI '24): each
  tenant ``c`` has a counter ``S_c`` of the service it has been given, divided by its weight
  (``[tenants.<c>] weight``). The next request comes from the backlogged tenant with the
  smallest counter; ties go to the tenant served least recently (round robin), then to the
  one backlogged first. A dispatched request charges ``(input_weight * prompt_tokens +
  output_weight * tokens_requested) / weight``; when it ends the charge is corrected to what
  it was served (its prompt if it started, the tokens it generated; nothing if it failed).
  A tenant whose queue goes from empty to non-empty has its counter lifted to the smallest
  counter of the backlogged tenants (or, with none, to that of the tenant served last), so an
  idle tenant cannot bank credit.
* **Inside a tenant**, APS: ``P_bid + alpha * wait``, which orders a tenant's own requests
  exactly with a heap keyed on ``alpha * arrival - P_bid`` (see :mod:`apsd.policies.aging`).
  Bids are the tenant's own (admission clamps them to its ``max_bid``), so a bid reorders
  that tenant's requests and never takes another tenant's share.

What a tenant is promised (``docs/architecture.md`` derives and measures it):

1. *Share.* While tenants stay backlogged, every dispatch goes to the one whose counter is
   smallest, so their counters stay within one request's charge of each other, plus the
   refunds of requests that generated less than they asked for: each gets service in
   proportion to its weight, whatever the others send.
2. *A returning tenant is next.* A request whose tenant had nothing queued is lifted to the
   smallest counter and wins the tie, so it leaves in the very next dispatch (behind at most
   one request of each other tenant that also just became backlogged).
3. *Aging bound inside a tenant.* A request with bid ``b`` of a tenant whose highest bid is
   ``B`` leaves before every request of its tenant that arrives more than ``(B - b) / alpha``
   seconds after it: at most the tenant's own earlier requests and that window's arrivals (its
   token bucket bounds them) go first, at the tenant's share of the engines.

Where priority and fairness trade: across tenants, fairness wins (a bid never buys another
tenant's share; give a tenant a larger weight instead); inside a tenant, priority with aging
decides.

The building block :class:`FairShareQueue` is public (``apsd.FairShareQueue``): the ``apsd-vtc``
plugin is the same fair share with first-come-first-served order inside a tenant.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from ..config import Config, between, parse_section
from ..hookspecs import hookimpl
from ..models import InferenceRequest, Outcome, Refusal

__all__ = ["ChargeWeights", "FairParams", "FairQueue", "FairShareQueue", "tenant_weights"]


@attrs.frozen
class ChargeWeights:
    """Service charged per token: VTC's ``w_p`` (prompt) and ``w_q`` (output)."""

    input_weight: float = 1.0
    output_weight: float = 2.0


_heappush, _heappop, _heapreplace = heapq.heappush, heapq.heappop, heapq.heapreplace

#: One tenant's entry in the heap of tenants: (counter, last served at, backlogged since, tenant, version).
TenantEntry = tuple[float, int, int, str, int]


class FairShareQueue:
    """Weighted fair share between tenants (an :class:`~apsd.policy.OrderingPolicy`); see the
    module docstring for the rule and its guarantees.

    Inside a tenant, requests leave by ``alpha * arrival - bid_weight * priority_bid``, then
    admission order: ``alpha = bid_weight = 0`` is first come first served (VTC), ``bid_weight
    = 1`` is APS. ``weights`` maps a tenant to its share (1.0 for a tenant it does not name).
    The scheduler calls :meth:`on_finish` for every finished request (the charge correction).

    State: ``counters`` (tenant -> weighted service; public, read-only for others), one heap of
    requests per backlogged tenant, and a heap of :data:`TenantEntry`; an entry is stale once
    its tenant's version moved on (its counter changed, or its queue emptied). A pop moves the
    served tenant's entry with one ``heapreplace``; a finish that corrects a backlogged tenant's
    counter pushes a new entry, and stale ones are dropped when they reach the top (the heap is
    rebuilt when they outnumber the live ones).
    """

    def __init__(self, alpha: float = 0.0, bid_weight: float = 0.0, weights: Mapping[str, float] | None = None,
                 charges: ChargeWeights = ChargeWeights()) -> None:
        self.alpha, self.bid_weight = alpha, bid_weight
        self._weights = dict(weights or {})
        self.charges = charges
        self.counters: dict[str, float] = collections.defaultdict(float)
        #: Backlogged tenant -> heap of (order key, seq, charge before weighting, request).
        self._queues: dict[str, list[tuple[float, int, float, InferenceRequest]]] = {}
        self._heap: list[TenantEntry] = []
        self._version: dict[str, int] = {}
        self._since: dict[str, int] = {}
        self._served_at: dict[str, int] = {}
        self._pops = 0
        self._last_served: str | None = None
        self._charged: dict[InferenceRequest, float] = {}
        self._length = 0

    # -- service ---------------------------------------------------------------------------------
    def weight(self, tenant_id: str) -> float:
        return self._weights.get(tenant_id, 1.0)

    def charge(self, request: InferenceRequest, output_tokens: int) -> float:
        """The service ``request`` represents with ``output_tokens`` generated, before weighting."""
        c = self.charges
        return c.input_weight * request.prompt_tokens + c.output_weight * output_tokens

    def _served(self, request: InferenceRequest, outcome: Outcome) -> float:
        if isinstance(outcome, Refusal) and outcome.kind == "failed":
            return 0.0
        if request.started_at is None:
            return self.charges.output_weight * request.tokens_generated
        return self.charge(request, request.tokens_generated)

    # -- the tenant heap ---------------------------------------------------------------------------
    def _entry(self, tenant: str) -> TenantEntry:
        version = self._version[tenant] = self._version.get(tenant, 0) + 1
        return (self.counters[tenant], self._served_at.get(tenant, -1), self._since[tenant], tenant, version)

    def _enter(self, tenant: str) -> None:
        """(Re)insert ``tenant``'s entry with its current counter; older entries go stale."""
        _heappush(self._heap, self._entry(tenant))
        if len(self._heap) > 2 * len(self._queues) + 64:
            self._heap = [self._entry(t) for t in self._queues]
            heapq.heapify(self._heap)

    def _top(self) -> TenantEntry:
        """The live entry of the backlogged tenant served next, on top of the heap (stale entries
        above it are dropped); IndexError when no tenant is backlogged."""
        heap, version = self._heap, self._version
        entry = heap[0]
        while entry[4] != version[entry[3]]:
            _heappop(heap)
            entry = heap[0]
        return entry

    def _floor(self) -> float:
        """The counter a tenant becoming backlogged is lifted to."""
        try:
            return self._top()[0]
        except IndexError:
            return self.counters[self._last_served] if self._last_served is not None else 0.0

    # -- the ordering interface --------------------------------------------------------------------
    def push(self, request: InferenceRequest, now: float) -> None:
        tenant = request.tenant_id
        queue = self._queues.get(tenant)
        if queue is None:  # the tenant becomes backlogged: lift its counter
            counters = self.counters
            counters[tenant] = max(counters[tenant], self._floor())
            queue = self._queues[tenant] = []
            self._since[tenant] = request.seq
            self._enter(tenant)
        charges = self.charges  # (its charge is computed now, while the request is in the CPU's cache)
        _heappush(queue, (self.alpha * request.arrival - self.bid_weight * request.priority_bid, request.seq,
                          charges.input_weight * request.prompt_tokens + charges.output_weight * request.tokens_requested,
                          request))
        self._length += 1

    def peek(self, now: float) -> InferenceRequest:
        return self._queues[self._top()[3]][0][3]

    def pop(self, now: float) -> InferenceRequest:
        return self._serve(self._top(), on_top=True)

    def pop_first(self, accept: Callable[[InferenceRequest], bool], now: float) -> InferenceRequest | None:
        """Pop the head of the first tenant, in fair order, whose head ``accept`` takes (None: no
        tenant's). For an engine's headroom, which only some tenants may use: the tenants passed
        over keep their place. O(k log T) for the k tenants looked at."""
        heap, version, passed = self._heap, self._version, []
        found = None
        while heap:
            entry = _heappop(heap)
            if entry[4] != version[entry[3]]:
                continue  # stale: dropped
            if accept(self._queues[entry[3]][0][3]):
                found = entry
                break
            passed.append(entry)
        for entry in passed:
            _heappush(heap, entry)
        return None if found is None else self._serve(found, on_top=False)

    def _serve(self, entry: TenantEntry, on_top: bool) -> InferenceRequest:
        """Pop the head of ``entry``'s tenant and charge it; ``entry`` is the tenant's live entry,
        on top of the heap (``on_top``) or already out of it."""
        tenant = entry[3]
        queue = self._queues[tenant]
        _, _, charge, request = _heappop(queue)
        self._length -= 1
        moved = None
        if request.reply.outcome is None:  # (an answered request is skipped by the scheduler: no service)
            charged = self._charged
            charge /= self._weights.get(tenant, 1.0)
            earlier = charged.pop(request, None)  # popped again after a requeue: its first charge goes back
            counter = self.counters[tenant] = entry[0] + (charge if earlier is None else charge - earlier)
            charged[request] = charge
            self._last_served = tenant
            pops = self._pops = self._pops + 1
            self._served_at[tenant] = pops
            if queue:  # its entry moves (on top: one sift, instead of a push now and a stale pop later)
                moved = (counter, pops, entry[2], tenant, entry[4] + 1)
        elif queue:
            moved = entry
        if moved is None:  # its queue emptied
            del self._queues[tenant], self._since[tenant]
            self._version[tenant] += 1
            if on_top:
                _heappop(self._heap)
        else:
            self._version[tenant] = moved[4]
            if on_top:
                _heapreplace(self._heap, moved)
            else:
                _heappush(self._heap, moved)
        return request

    def effective_priority(self, request: InferenceRequest, now: float) -> float:
        """Minus the tenant's counter: higher means less served so far."""
        return -self.counters[request.tenant_id]

    def on_finish(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        """Correct the charge made at pop to the service received (nothing if it failed)."""
        charge = self._charged.pop(request, None)
        if charge is None:
            return  # never charged by this queue (not popped yet, or popped by a replaced one)
        tenant = request.tenant_id
        correction = self._served(request, outcome) / self._weights.get(tenant, 1.0) - charge
        if correction:
            self.counters[tenant] += correction
            if tenant in self._queues:
                self._enter(tenant)

    def discard_answered(self) -> None:
        """Drop requests answered while queued (their clients left); O(N)."""
        for tenant, queue in list(self._queues.items()):
            kept = [entry for entry in queue if not entry[3].answered]
            if kept:
                heapq.heapify(kept)
                self._queues[tenant] = kept
            else:
                del self._queues[tenant], self._since[tenant]
        self._length = sum(len(q) for q in self._queues.values())
        self._heap = [self._entry(t) for t in self._queues]
        heapq.heapify(self._heap)

    def backlogged(self) -> list[str]:
        """The tenants with requests queued."""
        return list(self._queues)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[InferenceRequest]:
        for queue in self._queues.values():
            for entry in queue:
                yield entry[3]


class FairQueue(FairShareQueue):
    """``fair``: :class:`FairShareQueue` with APS order inside each tenant; reports ``P_eff``."""

    def __init__(self, alpha: float, weights: Mapping[str, float] | None = None,
                 charges: ChargeWeights = ChargeWeights()) -> None:
        super().__init__(alpha, 1.0, weights, charges)

    def effective_priority(self, request: InferenceRequest, now: float) -> float:
        """``P_bid + alpha * wait``: the request's priority among its own tenant's requests."""
        return request.priority_bid + self.alpha * (now - request.arrival)


_MAX_WEIGHT = 1e6


@attrs.frozen
class FairParams:
    """``[policy.fair]``; tenants' weights are ``[tenants.<name>] weight``."""

    #: Priority points a request gains per model second of waiting, among its tenant's requests.
    alpha: float = attrs.field(default=1.0, validator=between(0, 1e6))
    #: Service charged per prompt token (VTC's w_p).
    input_weight: float = attrs.field(default=1.0, validator=between(1e-6, _MAX_WEIGHT))
    #: Service charged per generated token (VTC's w_q).
    output_weight: float = attrs.field(default=2.0, validator=between(1e-6, _MAX_WEIGHT))


def tenant_weights(config: Config) -> dict[str, float]:
    """Every configured tenant's ``weight``."""
    return {name: tenant.weight for name, tenant in config.tenants.items()}


def _fair(params: dict[str, Any], config: Config) -> FairQueue:
    parsed = parse_section(FairParams, params, "policy.fair")
    return FairQueue(parsed.alpha, tenant_weights(config), ChargeWeights(parsed.input_weight, parsed.output_weight))


@hookimpl
def register_policies(registry: Any) -> None:
    registry.aging("fair", _fair, "weighted fair share between tenants (VTC), APS order inside each "
                                  "[alpha, input_weight, output_weight; tenants' weight]")
    registry.preset("fair", aging="fair", governor="entropy", batching="micro")

