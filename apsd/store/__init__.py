"""Where tenants' token buckets and fair-share counters live: the store seam.

Admission and the fair-share queue decide synchronously, on the request's path, against state
that is local to this process; a store decides what that local state is and how it is shared.

* :class:`~apsd.store.memory.MemoryStore` (``[store] kind = "memory"``, the default, the
  simulator's): buckets are plain :class:`~apsd.core.admission.TokenBucket` objects; nothing is shared.
* The forward engine's backends' slots (:mod:`apsd.core.slots`): this process's own with the memory
  store, one table in Redis for every replica with the Redis store (:mod:`apsd.store.redis_slots`).
* :class:`~apsd.store.leasing.LeasingStore` over Redis (``kind = "redis"``,
  :mod:`apsd.store.redis`): every replica leases slices of each tenant's bucket and returns what it
  does not use, and pushes and pulls fair-share service, in one background task; Redis is never on
  a request's path. The simulator runs the same store over an in-memory shared state with a
  delay (:mod:`apsd.store.simulated`).

The interfaces (:class:`Store`, :class:`Bucket`, :class:`BucketView`, :class:`SharedService`) are
public for plugins and embedders: ``docs/explanation/architecture.md`` ("Many replicas") tells the story.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apsd.core.slots import LocalSlots, SlotTable
from apsd.core.store import Bucket, BucketView, SharedService, Store, StoreStatistics
from apsd.store.memory import MemoryStore

if TYPE_CHECKING:
    from apsd.core.clock import ModelClock
    from apsd.core.config import Config

__all__ = ["Bucket", "BucketView", "MemoryStore", "SharedService", "Store", "StoreStatistics", "build_slot_table",
           "build_store"]


def build_slot_table(config: Config, clock: ModelClock, store: Store) -> SlotTable:
    """The table of the forward engine's backends' slots: this process's own, or (``[store] kind =
    "redis"``) shared by every replica (:mod:`apsd.store.redis_slots`; not started: run its ``run``),
    under the replica name of ``store`` (the one :func:`build_store` made of the same config): both
    count the replicas in the same Redis set, where a replica must be one name."""
    if config.store.shared and config.engine.kind == "forward":
        from apsd.store.leasing import LeasingStore
        from apsd.store.redis_slots import RedisSlots

        assert isinstance(store, LeasingStore), "a shared [store] is leased"
        return RedisSlots(config.store, clock, replica=store.replica_id)
    return LocalSlots()


def build_store(config: Config) -> Store:
    """The store ``[store]`` asks for (not started: run :meth:`Store.run` in a nursery)."""
    if config.store.shared:
        from apsd.store.redis import redis_store

        return redis_store(config.store)
    return MemoryStore()
