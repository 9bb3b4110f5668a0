"""A tenant's token bucket: ``min(burst, tokens + elapsed * rate)``, taken whole or not at all.

A plain value with no I/O and no clock of its own (callers pass ``now``, model seconds). Admission
holds one per tenant when nothing is shared; the stores (:mod:`apsd.store`) build theirs from it.
"""

from __future__ import annotations

import attrs

from apsd.core.config import TenantConfig

__all__ = ["TokenBucket"]


@attrs.define(eq=False)
class TokenBucket:
    """``min(burst, tokens + elapsed * rate)``, taken whole or not at all."""

    rate: float
    burst: float
    tokens: float
    updated: float

    @classmethod
    def full(cls, tenant: TenantConfig, now: float) -> TokenBucket:
        return cls(rate=tenant.rate, burst=float(tenant.burst), tokens=float(tenant.burst), updated=now)

    def level(self, now: float) -> float:
        """Tokens available at ``now`` (refills lazily; time never runs backwards)."""
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
            self.updated = now
        return self.tokens

    def try_take(self, amount: float, now: float) -> bool:
        if self.level(now) >= amount:
            self.tokens -= amount
            return True
        return False

    def give_back(self, amount: float, now: float) -> None:
        """Refund ``amount`` tokens (capped at ``burst``), or charge ``-amount`` more (the level may
        then be negative: a debt that refills at ``rate`` like any other shortfall)."""
        self.tokens = min(self.burst, self.level(max(now, self.updated)) + amount)

    def seconds_until(self, amount: float, now: float) -> float:
        """How long until ``amount`` tokens are available (0 if they are now)."""
        return max(0.0, (amount - self.level(now)) / self.rate)
