"""``[store] kind = "memory"``: this process's own buckets, nothing shared."""

from __future__ import annotations

import trio

from apsd.core.bucket import TokenBucket
from apsd.core.config import TenantConfig
from apsd.core.models import Refusal
from apsd.core.store import Bucket, BucketView, StoreStatistics

__all__ = ["MemoryStore"]


class MemoryStore:
    """Buckets start full at every start; fair-share counters stay in the queue."""

    kind = "memory"

    def bucket(self, tenant_id: str, tenant: TenantConfig, now: float) -> TokenBucket:
        return TokenBucket.full(tenant, now)

    def refusal(self) -> Refusal | None:
        return None

    def bucket_view(self, bucket: Bucket, now: float) -> BucketView:
        level = bucket.level(now)
        return BucketView(tokens=level, replica_tokens=level)

    def share(self, policy: object) -> None:
        pass

    def share_budgets(self, budgets: object) -> None:
        pass  # (this process's budgets are its own: the state keeper keeps their spend)

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(kind=self.kind, available=True)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()
