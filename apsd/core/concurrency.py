"""``max_concurrency``: a tenant's (and a key's) requests in flight at once; beyond, they wait in line.

A request is *in flight* from the moment it enters the scheduler's queue until it ends: queued for
dispatch (in the fair-share queue), running, or back in the queue after a preemption or a retry. A
tenant with ``max_concurrency = N`` has at most N requests in flight, and a key with its own at most
its own; a request beyond either limit is admitted (its tokens reserved, counted queued in the
books, answered 429 by nothing) and waits in its tenant's **line**, in arrival order, until one of its
tenant's (or key's) requests ends. It then enters the queue, and fair share and priority order it
there as usual. So an agent that fans out into more sub-agent streams than its limit gets them
served a few at a time, with no refusal to retry and no request lost; the queue's own limits
(``[queue] max_requests_per_tenant``, ``timeout_s``) count the waiting requests too, and a request that
waits past its queue timeout is answered 504 ``queue_timeout`` from the line.

Why a line rather than 429: clients retry a 429 after ``Retry-After`` with backoff, which for
requests held back by their own siblings only adds latency and refusals to the logs; the line gives
the next one the slot the moment it frees. Why before the fair-share queue rather than inside it:
the queue's order is a pluggable policy, and a request it may not dispatch would stall its head.

Ownership: the scheduler holds the one :class:`ConcurrencyGate` and calls :meth:`ConcurrencyGate.enter`
for each admitted request (:meth:`apsd.core.scheduler.Scheduler.enqueue`) and :meth:`ConcurrencyGate.leave`
when one ends (step 4 of :meth:`apsd.core.ledger.Ledger.finish`), queueing what that releases; a reload
that raises a limit releases what it allows (:meth:`ConcurrencyGate.release`). No clock, no I/O.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import attrs

from apsd.core.models import InferenceRequest

__all__ = ["ConcurrencyGate"]


def _no_limits(request: InferenceRequest) -> tuple[int, int]:
    return 0, 0


@attrs.define(eq=False)
class ConcurrencyGate:
    """Requests in flight per tenant and per key, and the lines of those waiting (see the module)."""

    #: (the tenant's max_concurrency, the key's) for a request; 0: no limit.
    limits: Callable[[InferenceRequest], tuple[int, int]] = _no_limits
    _tenants: collections.Counter[str] = attrs.field(factory=collections.Counter)
    _keys: collections.Counter[str] = attrs.field(factory=collections.Counter)
    #: The requests waiting, per tenant, in arrival order (answered ones are dropped when met).
    _lines: dict[str, collections.deque[InferenceRequest]] = attrs.field(factory=dict)
    _waiting: collections.Counter[str] = attrs.field(factory=collections.Counter)

    def in_flight(self, tenant_id: str) -> int:
        return self._tenants[tenant_id]

    def key_in_flight(self, key_id: str) -> int:
        return self._keys[key_id]

    def waiting(self, tenant_id: str) -> int:
        """The tenant's requests waiting in its line."""
        return self._waiting[tenant_id]

    def _room(self, request: InferenceRequest) -> bool:
        tenant_limit, key_limit = self.limits(request)
        if tenant_limit and self._tenants[request.tenant_id] >= tenant_limit:
            return False
        return not (key_limit and request.key_id is not None and self._keys[request.key_id] >= key_limit)

    def _count(self, request: InferenceRequest) -> None:
        request.in_flight = True
        self._tenants[request.tenant_id] += 1
        if request.key_id is not None:
            self._keys[request.key_id] += 1

    def enter(self, request: InferenceRequest) -> bool:
        """An admitted request arrives: True if it may enter the queue now (it is counted in flight),
        False if it waits in its tenant's line (:meth:`leave` or :meth:`release` lets it in later)."""
        if self._room(request):
            self._count(request)
            return True
        self._lines.setdefault(request.tenant_id, collections.deque()).append(request)
        self._waiting[request.tenant_id] += 1
        request.waiting_in_line = True
        return False

    def leave(self, request: InferenceRequest) -> list[InferenceRequest]:
        """``request`` ended (whatever its outcome, wherever it was): the requests this lets in, in
        arrival order (counted in flight; the caller queues them)."""
        if request.waiting_in_line:   # (it ended in the line: a timeout, a client that left)
            request.waiting_in_line = False
            self._waiting[request.tenant_id] -= 1
            line = self._lines.get(request.tenant_id)
            if line is not None:
                try:
                    line.remove(request)
                except ValueError:
                    pass
            return []
        if not request.in_flight:
            return []
        request.in_flight = False
        self._tenants[request.tenant_id] -= 1
        if not self._tenants[request.tenant_id]:
            del self._tenants[request.tenant_id]
        if request.key_id is not None:
            self._keys[request.key_id] -= 1
            if not self._keys[request.key_id]:
                del self._keys[request.key_id]
        return self._let_in(request.tenant_id)

    def _let_in(self, tenant_id: str) -> list[InferenceRequest]:
        """The first requests of the tenant's line that have room now, in order (a request held back
        by its own key's limit lets the next one of another key pass)."""
        line = self._lines.get(tenant_id)
        if not line:
            return []
        released = []
        for request in list(line):
            if request.answered:
                continue
            tenant_limit, _ = self.limits(request)
            if tenant_limit and self._tenants[tenant_id] >= tenant_limit:
                break
            if self._room(request):
                line.remove(request)
                request.waiting_in_line = False
                self._waiting[tenant_id] -= 1
                self._count(request)
                released.append(request)
        if not line:
            del self._lines[tenant_id]
        return released

    def release(self) -> list[InferenceRequest]:
        """What the limits in force now let in (after a reload raised or removed one)."""
        released = []
        for tenant_id in list(self._lines):
            released += self._let_in(tenant_id)
        return released
