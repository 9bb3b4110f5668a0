"""The store's interfaces: what admission and the fair-share queue ask of it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs
import trio

if TYPE_CHECKING:
    from apsd.core.budget import Budgets
    from apsd.core.config import TenantConfig
    from apsd.core.models import Refusal

__all__ = ["Bucket", "BucketView", "SharedService", "Store", "StoreStatistics", "redis_budget_key", "redis_bucket_key"]


def redis_bucket_key(prefix: str, tenant: str) -> str:
    """Where a shared store keeps a tenant's bucket in Redis (a hash: ``tokens``, ``updated``)."""
    return f"{prefix}:bucket:{tenant}"


def redis_budget_key(prefix: str, account: str, period: str) -> str:
    """Where a shared store keeps a budget's account (:func:`apsd.core.budget.budget_account`) for a
    period in Redis (a hash: ``spent``, and each replica's lease and settled total)."""
    return f"{prefix}:budget:{account}:{period}"


@runtime_checkable
class Bucket(Protocol):
    """One tenant's tokens as admission sees them, synchronously. ``now`` is model seconds.

    ``rate`` (tokens/s) and ``burst`` are the tenant's contract; ``tokens`` what this process may
    admit now. ``give_back`` refunds (or, negative, charges) tokens after a request ended.
    """

    rate: float
    burst: float
    tokens: float

    def level(self, now: float) -> float: ...

    def try_take(self, amount: float, now: float) -> bool: ...

    def give_back(self, amount: float, now: float) -> None: ...

    def seconds_until(self, amount: float, now: float) -> float: ...


@runtime_checkable
class SharedService(Protocol):
    """A fair-share policy whose service counters are shared between replicas (the built-in
    ``fair`` and ``apsd-vtc`` queues are): the store takes the service this replica gave since the
    last call and hands in what the other replicas gave, both as weighted service per tenant."""

    def take_service(self) -> dict[str, float]:
        """Weighted service given here since the last call (and forget it)."""

    def add_service(self, service: Mapping[str, float]) -> None:
        """Add weighted service the other replicas gave."""


@attrs.frozen
class BucketView:
    """A tenant's bucket as this process knows it (``GET /tenants/<id>/status``)."""

    #: The tenant's tokens now, as far as this process knows. This process's own bucket: its level.
    #: Shared: the shared bucket's level at the last read (``shared_tokens``), refilled since at the
    #: rate, plus what this replica holds, capped at ``burst``; the other replicas' unused leases (a
    #: couple of sync intervals of their demand each, returned within seconds of idling) are not in it.
    tokens: float
    #: What this process may admit now without waiting for the store (its lease and optimistic share).
    replica_tokens: float
    #: What the shared bucket held at this replica's last read of it, and how many seconds ago that was
    #: (None: not shared, or not read yet).
    shared_tokens: float | None = None
    shared_age_s: float | None = None


@attrs.frozen
class StoreStatistics:
    kind: str
    #: Whether the shared state can be reached now (always True in memory).
    available: bool
    #: Times it became unreachable since start.
    outages: int = 0
    #: Exchanges with the shared state that succeeded and failed.
    syncs: int = 0
    sync_failures: int = 0
    #: Replicas seen sharing the state (1 in memory).
    replicas: int = 1
    #: Tokens leased from the shared buckets and held by this replica now, summed over tenants.
    leased_tokens: float = 0.0


class Store(Protocol):
    """Buckets for admission, service sharing for the fair-share queue, one background task.

    Ownership: the daemon builds one store and runs :meth:`run` in its root nursery; admission asks
    it for buckets (:meth:`bucket`) and, before taking tokens, whether it refuses everything now
    (:meth:`refusal`); the pipeline hands it the scheduler's aging policy (:meth:`share`) whenever
    that changes, and asks what it knows of a tenant's bucket for the tenant's status and for a
    refusal's message (:meth:`bucket_view`).
    """

    kind: str

    def bucket(self, tenant_id: str, tenant: TenantConfig, now: float) -> Bucket:
        """The bucket of ``tenant_id`` (full, or where the shared state has it); called once per tenant
        at start and whenever a reload adds or re-rates one."""

    def refusal(self) -> Refusal | None:
        """The answer to every request while the store cannot decide (None: admit as usual)."""

    def bucket_view(self, bucket: Bucket, now: float) -> BucketView:
        """What this process knows of the tenant whose bucket (from :meth:`bucket`) is ``bucket``."""

    def share(self, policy: object) -> None:
        """Share the service counters of ``policy`` if it is a :class:`SharedService` (else nothing)."""

    def share_budgets(self, budgets: Budgets) -> None:
        """Hold the budgets in force (``budgets.limits()``: tenants' and keys') as leases of budgets
        shared by every replica (:meth:`Budgets.share`), if this store is shared (else nothing)."""

    def statistics(self) -> StoreStatistics: ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the shared state in step until cancelled; on cancellation return what this replica
        holds (unused leases) if it can, within a second."""
