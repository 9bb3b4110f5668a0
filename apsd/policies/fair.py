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

What a tenant is promised (``docs/explanation/architecture.md`` derives and measures it):

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

Service classes (:mod:`apsd.core.classes`): a request with a class carries a deadline (``class_deadline``,
its arrival plus its class's ``ttft_s``). The rule:

* *Inside a tenant*, classed requests that can still meet their deadline leave first: the tighter class
  (smaller ``ttft_s``) first, and inside a class earliest deadline first; then late ``best_effort`` ones (deadline passed), earliest deadline first; then unclassed ones
  in APS order. A late best-effort request moves behind the punctual ones when it reaches its tenant's
  head (each request at most once): without that, an overloaded loose class would have the earliest
  deadlines of all and take the tight class's turn (EDF's domino effect).
* *Between tenants*, VTC still picks, with one exception: the backlogged tenant whose head is the most
  urgent punctual request of all (tightest class, then earliest deadline) goes first when its counter is within its head's charge of the
  smallest counter (and the VTC tenant's own head is not as urgent). So inside a class, across tenants,
  deadlines are served earliest first, under fair share. (Plain EDF between classes would let a loose
  class's old requests, whose deadlines come first, take the tight class's turn under overload.)

Guarantee: a tenant goes ahead of VTC's choice only with its counter at most its head's charge above the
smallest, so its counter stays within two requests' charge of the smallest (VTC alone: one). Tight-class
requests cannot buy more than that share; a returning tenant waits behind at most one such jump. Every
operation stays O(log N + log T): a second heap holds backlogged tenants by their head's deadline (stale
entries dropped lazily); with no classed request ever pushed it is never touched.

Where priority and fairness trade: across tenants, fairness wins (a bid never buys another
tenant's share; give a tenant a larger weight instead); inside a tenant, priority with aging
decides.

The building block :class:`FairShareQueue` is public (``apsd.FairShareQueue``): the ``apsd-vtc``
plugin is the same fair share with first-come-first-served order inside a tenant.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs

from apsd.core.classes import urgency
from apsd.core.config import Config, between, parse_section
from apsd.core.hookspecs import hookimpl
from apsd.core.models import InferenceRequest, Outcome

__all__ = ["ChargeWeights", "FairParams", "FairQueue", "FairShareQueue", "tenant_weights"]


@attrs.frozen
class ChargeWeights:
    """Service charged per token: VTC's ``w_p`` (prompt) and ``w_q`` (output)."""

    input_weight: float = 1.0
    output_weight: float = 2.0


_heappush, _heappop, _heapreplace = heapq.heappush, heapq.heappop, heapq.heapreplace

#: Keys inside a tenant: a punctual classed request's is its urgency (:func:`apsd.core.classes.urgency`) minus
#: ``2 ** 51`` (below ``_PUNCTUAL``), a late best-effort one's ``deadline - _TIER`` (below 0), an
#: unclassed one's its APS key (about ``-bid`` and up). Model times stay far below ``_TIER`` (272 years).
_TIER = 2.0 ** 34
_PUNCTUAL_BASE = 2.0 ** 51
_PUNCTUAL = -(2.0 ** 50)


class _Tenant:
    """One tenant's fair-share state. It is backlogged while ``queue`` holds requests: a heap of
    (order key, seq, charge before weighting, request)."""

    __slots__ = ("name", "weight", "counter", "queue", "version", "since", "served_at")

    def __init__(self, name: str, weight: float) -> None:
        self.name, self.weight = name, weight
        self.counter = 0.0
        self.queue: list[tuple[float, int, float, InferenceRequest]] = []
        self.version = 0
        self.since = 0
        self.served_at = -1

    def entry(self) -> TenantEntry:
        """A new entry for the heap of tenants (the older ones go stale)."""
        self.version += 1
        return (self.counter, self.served_at, self.since, self.version, self)


#: A backlogged tenant's place in the heap of tenants: (counter, last served at, backlogged since,
#: version, tenant). ``since`` differs between backlogged tenants, so tuples never compare tenants.
TenantEntry = tuple[float, int, int, int, _Tenant]


class FairShareQueue:
    """Weighted fair share between tenants (an :class:`~apsd.core.policy.OrderingPolicy`); see the
    module docstring for the rule and its guarantees.

    Inside a tenant, requests leave by ``alpha * arrival - bid_weight * priority_bid``, then
    admission order: ``alpha = bid_weight = 0`` is first come first served (VTC), ``bid_weight
    = 1`` is APS. ``weights`` maps a tenant to its share (1.0 for a tenant it does not name).
    The scheduler calls :meth:`on_finish` for every finished request (the charge correction).

    State: every tenant seen (its counter, weight and queue), and a heap of :data:`TenantEntry`
    for the backlogged ones; an entry is stale once its tenant's version moved on (its counter
    changed, or its queue emptied). A pop moves the served tenant's entry with one
    ``heapreplace``; a finish that corrects a backlogged tenant's counter pushes a new entry, and
    stale ones are dropped when they reach the top (the heap is rebuilt when they outnumber the
    live ones).
    """

    def __init__(self, alpha: float = 0.0, bid_weight: float = 0.0, weights: Mapping[str, float] | None = None,
                 charges: ChargeWeights = ChargeWeights()) -> None:
        self.alpha, self.bid_weight = alpha, bid_weight
        self._weights = dict(weights or {})
        self.charges = charges
        self._tenants: dict[str, _Tenant] = {}
        self._heap: list[TenantEntry] = []
        #: The tenants with requests queued (so that nothing per operation visits every tenant seen).
        self._backlogged: dict[str, _Tenant] = {}
        self._pops = 0
        self._last_served: _Tenant | None = None
        self._charged: dict[InferenceRequest, float] = {}
        self._length = 0
        #: Weighted service given since the store last took it (None: not shared, not kept).
        self._given: dict[str, float] | None = None
        #: A classed request was pushed once: deadlines are looked at from then on.
        self._classed = False
        #: (deadline, seq, request, tenant) of backlogged tenants whose head is a punctual classed request;
        #: an entry is live while its request is its tenant's head.
        self._edf: list[tuple[float, int, InferenceRequest, _Tenant]] = []

    # -- service ---------------------------------------------------------------------------------
    @property
    def counters(self) -> dict[str, float]:
        """Tenant -> weighted service so far (a copy; O(T))."""
        return {name: tenant.counter for name, tenant in self._tenants.items()}

    def counter(self, tenant_id: str) -> float:
        tenant = self._tenants.get(tenant_id)
        return tenant.counter if tenant is not None else 0.0

    def weight(self, tenant_id: str) -> float:
        return self._weights.get(tenant_id, 1.0)

    def charge(self, request: InferenceRequest, output_tokens: int) -> float:
        """The service ``request`` represents with ``output_tokens`` generated, before weighting."""
        c = self.charges
        return c.input_weight * request.prompt_tokens + c.output_weight * output_tokens

    def _served(self, request: InferenceRequest, outcome: Outcome) -> float:
        if request.started_at is None:
            return self.charges.output_weight * request.tokens_generated
        return self.charge(request, request.tokens_generated)

    # -- the tenant heap ---------------------------------------------------------------------------
    def _enter(self, tenant: _Tenant) -> None:
        """(Re)insert ``tenant``'s entry with its current counter; older entries go stale."""
        _heappush(self._heap, tenant.entry())
        if len(self._heap) > 2 * len(self._backlogged) + 64:
            self._heap = [t.entry() for t in self._backlogged.values()]
            heapq.heapify(self._heap)

    def _top(self) -> TenantEntry:
        """The live entry of the backlogged tenant served next, on top of the heap (stale entries
        above it are dropped); IndexError when no tenant is backlogged."""
        heap = self._heap
        entry = heap[0]
        while entry[3] != entry[4].version:
            _heappop(heap)
            entry = heap[0]
        return entry

    def _floor(self) -> float:
        """The counter a tenant becoming backlogged is lifted to."""
        try:
            return self._top()[0]
        except IndexError:
            return self._last_served.counter if self._last_served is not None else 0.0

    # -- the ordering interface --------------------------------------------------------------------
    def push(self, request: InferenceRequest, now: float) -> None:
        name = request.tenant_id
        tenant = self._tenants.get(name)
        if tenant is None:
            tenant = self._tenants[name] = _Tenant(name, self._weights.get(name, 1.0))
        queue = tenant.queue
        item = self._item(request, now)
        if not queue:  # the tenant becomes backlogged: lift its counter
            tenant.counter = max(tenant.counter, self._floor())
            tenant.since = request.seq
            self._backlogged[name] = tenant
            queue.append(item)
            self._enter(tenant)
        else:
            _heappush(queue, item)
        self._length += 1
        if item[0] < _PUNCTUAL and queue[0] is item:
            self._head_changed(tenant)

    def _item(self, request: InferenceRequest, now: float) -> tuple[float, int, float, InferenceRequest]:
        charges = self.charges  # (the charge is computed now, while the request is in the CPU's cache)
        deadline = request.class_deadline if request.started_at is None else None   # (a paused one is past it)
        if deadline is None:
            key = self.alpha * request.arrival - self.bid_weight * request.priority_bid
        else:
            self._classed = True
            key = deadline - _TIER if request.class_best_effort and deadline <= now \
                else urgency(request) - _PUNCTUAL_BASE
        return (key, request.seq,
                charges.input_weight * request.prompt_tokens + charges.output_weight * request.tokens_requested,
                request)

    # -- deadlines (service classes) ---------------------------------------------------------------
    def _head_changed(self, tenant: _Tenant) -> None:
        """``tenant``'s head is now a punctual classed request: enter it in the deadline heap."""
        key, seq, _, request = tenant.queue[0]
        edf = self._edf
        if len(edf) > 2 * len(self._backlogged) + 64:
            edf[:] = [(t.queue[0][0], t.queue[0][1], t.queue[0][3], t)
                      for t in self._backlogged.values() if t.queue[0][0] < _PUNCTUAL]
            heapq.heapify(edf)
        _heappush(edf, (key, seq, request, tenant))

    def _demote_late(self, tenant: _Tenant, now: float) -> None:
        """Move late best-effort requests at ``tenant``'s head behind its punctual ones (once each)."""
        queue = tenant.queue
        while queue:
            key, seq, charge, request = queue[0]
            deadline = request.class_deadline
            if key >= _PUNCTUAL or not request.class_best_effort or deadline is None or deadline > now:
                break
            _heapreplace(queue, (deadline - _TIER, seq, charge, request))
        if queue and queue[0][0] < _PUNCTUAL:
            self._head_changed(tenant)

    def _choose(self, now: float) -> tuple[TenantEntry, _Tenant | None]:
        """VTC's entry on top of the heap of tenants, and the tenant to serve instead (None: VTC's),
        by the deadline rule of the module docstring."""
        entry = self._top()
        if not self._classed:
            return entry, None
        tenant = entry[4]
        self._demote_late(tenant, now)
        edf = self._edf
        while edf:
            _, _, request, other = edf[0]
            queue = other.queue
            if not queue or queue[0][3] is not request or queue[0][0] >= _PUNCTUAL:
                _heappop(edf)  # stale: no longer its tenant's punctual head
            elif request.class_best_effort and request.class_deadline is not None and request.class_deadline <= now:
                _heappop(edf)
                self._demote_late(other, now)
            else:
                break
        else:
            return entry, None
        if other is tenant or tenant.queue[0][0] <= other.queue[0][0]:
            return entry, None
        if other.counter <= tenant.counter + other.queue[0][2] / other.weight:
            return entry, other
        return entry, None

    def peek(self, now: float) -> InferenceRequest:
        if not self._classed:
            return self._top()[4].queue[0][3]
        entry, other = self._choose(now)
        return (entry[4] if other is None else other).queue[0][3]

    def pop(self, now: float) -> InferenceRequest:
        if not self._classed:  # (the path without classes, as it was)
            return self._serve(self._top(), on_top=True)
        entry, other = self._choose(now)
        if other is None:
            return self._serve(entry, on_top=True)
        return self._serve(other.entry(), on_top=False)  # (its entry in the heap goes stale)

    def pop_first(self, accept: Callable[[InferenceRequest], bool], now: float) -> InferenceRequest | None:
        """Pop the head of the first tenant, in fair order, whose head ``accept`` takes (None: no
        tenant's). For an engine's headroom, which only some tenants may use: the tenants passed
        over keep their place. O(k log T) for the k tenants looked at."""
        heap, passed = self._heap, []
        found = None
        while heap:
            entry = _heappop(heap)
            if entry[3] != entry[4].version:
                continue  # stale: dropped
            if accept(entry[4].queue[0][3]):
                found = entry
                break
            passed.append(entry)
        for entry in passed:
            _heappush(heap, entry)
        return None if found is None else self._serve(found, on_top=False)

    def _serve(self, entry: TenantEntry, on_top: bool) -> InferenceRequest:
        """Pop the head of ``entry``'s tenant and charge it; ``entry`` is the tenant's live entry,
        on top of the heap (``on_top``) or already out of it."""
        tenant = entry[4]
        queue = tenant.queue
        _, _, charge, request = _heappop(queue)
        self._length -= 1
        if request.reply.outcome is None:  # (an answered request is skipped by the scheduler: no service)
            charged = self._charged
            charge /= tenant.weight
            earlier = charged.pop(request, None)  # popped again after a requeue: its first charge goes back
            service = charge if earlier is None else charge - earlier
            tenant.counter += service
            charged[request] = charge
            if self._given is not None:
                self._given[tenant.name] = self._given.get(tenant.name, 0.0) + service
            self._last_served = tenant
            self._pops += 1
            tenant.served_at = self._pops
            moved = tenant.entry() if queue else None  # (on top: one sift, not a push now and a stale pop later)
        else:
            moved = entry if queue else None
        if self._classed and queue and queue[0][0] < _PUNCTUAL:
            self._head_changed(tenant)
        if moved is None:  # its queue emptied
            tenant.version += 1
            del self._backlogged[tenant.name]
            if on_top:
                _heappop(self._heap)
        elif on_top:
            _heapreplace(self._heap, moved)
        else:
            _heappush(self._heap, moved)
        return request

    def effective_priority(self, request: InferenceRequest, now: float) -> float:
        """Minus the tenant's counter: higher means less served so far."""
        return -self.counter(request.tenant_id)

    def on_finish(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        """Correct the charge made at pop to the service received (nothing if it failed)."""
        charge = self._charged.pop(request, None)
        if charge is None:
            return  # never charged by this queue (not popped yet, or popped by a replaced one)
        tenant = self._tenants[request.tenant_id]
        correction = self._served(request, outcome) / tenant.weight - charge
        if correction:
            tenant.counter += correction
            if self._given is not None:
                self._given[tenant.name] = self._given.get(tenant.name, 0.0) + correction
            if tenant.queue:
                self._enter(tenant)

    # -- shared between replicas (apsd.store.SharedService) ---------------------------------------
    def take_service(self) -> dict[str, float]:
        """Weighted service given here since the last call (the first call starts the bookkeeping)."""
        given, self._given = self._given or {}, {}
        return given

    def add_service(self, service: Mapping[str, float]) -> None:
        """Add the weighted service other replicas gave: their tenants' counters move, so this
        replica orders its own backlog by what every replica served."""
        for name, amount in service.items():
            tenant = self._tenants.get(name)
            if tenant is None:
                tenant = self._tenants[name] = _Tenant(name, self._weights.get(name, 1.0))
            tenant.counter += amount
            if tenant.queue:
                self._enter(tenant)

    def discard_answered(self) -> None:
        """Drop requests answered while queued (their clients left); O(N)."""
        backlogged, self._heap, self._backlogged, self._length = self._backlogged, [], {}, 0
        for tenant in backlogged.values():
            tenant.queue = [item for item in tenant.queue if not item[3].answered]
            heapq.heapify(tenant.queue)
            if tenant.queue:
                self._backlogged[tenant.name] = tenant
                self._length += len(tenant.queue)
                self._heap.append(tenant.entry())
            else:
                tenant.version += 1
        heapq.heapify(self._heap)
        self._edf = []
        for tenant in self._backlogged.values():
            if tenant.queue[0][0] < _PUNCTUAL:
                self._head_changed(tenant)

    def backlogged(self) -> list[str]:
        """The tenants with requests queued."""
        return list(self._backlogged)

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[InferenceRequest]:
        for tenant in self._backlogged.values():
            for item in tenant.queue:
                yield item[3]


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

