"""Budgets: the tokens a tenant may use per day or month (``budget_tokens``, ``budget_period``).

Ownership: :class:`Budgets` belongs to admission, which asks it before taking a request's tokens
from the bucket (:meth:`Budgets.refusal`), reserves the request's whole cost when it admits it
(:meth:`Budgets.reserve`) and settles what the request used when it ends (:meth:`Budgets.settle`).
The state keeper (:mod:`apsd.state.keeper`) is what makes a budget outlive a restart and hold
across replicas: it takes the spend settled here since its last visit (:meth:`Budgets.take_settled`),
adds it to the stored total, and hands back the total every replica spent (:meth:`Budgets.set_spent`).

The rule is reserve-then-settle, as for the bucket: a request is admitted only if what the
period has spent, plus what admitted requests have reserved and not yet settled, plus its own
whole cost (prompt estimate + requested output) fits the budget. So concurrent requests cannot
all slip under the limit at once (the race of gateways that check spend first and count it when
the request ends); one process exceeds a budget only by what its requests used beyond their
reservation (a backend's real prompt longer than the estimate). Replicas learn each other's spend
every ``[state] flush_interval_s``: together they may pass a budget by what the others admitted
within that interval.

Periods are UTC calendar days or months of the wall clock.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

import attrs

from apsd.core.clock import calendar_time
from apsd.core.config import TenantConfig
from apsd.core.models import Refusal

__all__ = ["Budgets", "period_end", "period_key"]


def _utc(wall: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(wall, datetime.UTC)


def period_key(period: str, wall: float) -> str:
    """The period ``wall`` (Unix seconds) falls in: ``2026-11-26`` (day) or ``2026-11`` (month)."""
    moment = _utc(wall)
    return moment.strftime("%Y-%m-%d" if period == "day" else "%Y-%m")


def period_end(period: str, wall: float) -> float:
    """Unix seconds at which the period ``wall`` falls in ends."""
    moment = _utc(wall)
    start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        end = start + datetime.timedelta(days=1)
    else:
        start = start.replace(day=1)
        end = (start + datetime.timedelta(days=32)).replace(day=1)
    return end.timestamp()


@attrs.define
class _Account:
    period: str
    key: str
    #: Settled spend of the period, every replica's, as of the keeper's last exchange with the store.
    spent: int = 0
    #: Settled here since the keeper last took it (not yet in ``spent``).
    settled_here: int = 0
    #: Admitted here and not settled yet: their whole cost.
    reserved: int = 0


@attrs.define(eq=False)
class Budgets:
    """Every budgeted tenant's account for its current period."""

    #: Unix seconds now (a test passes its own).
    wall: Callable[[], float] = calendar_time
    _accounts: dict[str, _Account] = attrs.field(factory=dict)

    def _account(self, tenant_id: str, tenant: TenantConfig) -> _Account:
        key = period_key(tenant.budget_period, self.wall())
        account = self._accounts.get(tenant_id)
        if account is None or account.key != key or account.period != tenant.budget_period:
            reserved = account.reserved if account is not None else 0  # (still to settle, in the new period)
            account = self._accounts[tenant_id] = _Account(tenant.budget_period, key, reserved=reserved)
        return account

    def used(self, tenant_id: str, tenant: TenantConfig) -> int:
        """Tokens of the current period spent or reserved, as far as this process knows."""
        account = self._account(tenant_id, tenant)
        return account.spent + account.settled_here + account.reserved

    def refusal(self, tenant_id: str, tenant: TenantConfig, cost: int) -> Refusal | None:
        """429 ``budget_exhausted`` if ``cost`` more tokens would pass the tenant's budget, else None."""
        if not tenant.budget_tokens:
            return None
        used = self.used(tenant_id, tenant)
        if used + cost <= tenant.budget_tokens:
            return None
        now = self.wall()
        retry = max(1, int(period_end(tenant.budget_period, now) - now) + 1)
        return Refusal(429, "budget_exhausted",
                       f"tenant {tenant_id!r} has used {used} of its {tenant.budget_tokens} tokens this "
                       f"{tenant.budget_period} (UTC) and this request reserves {cost}; the budget starts again "
                       f"in {retry} s", headers={"Retry-After": str(retry)})

    def reserve(self, tenant_id: str, tenant: TenantConfig, cost: int) -> None:
        if tenant.budget_tokens:
            self._account(tenant_id, tenant).reserved += cost

    def settle(self, tenant_id: str, tenant: TenantConfig | None, reserved: int, used: int) -> None:
        """A request that reserved ``reserved`` tokens ended having used ``used``."""
        account = self._accounts.get(tenant_id)
        if account is None:
            return
        if tenant is not None and tenant.budget_tokens:
            account = self._account(tenant_id, tenant)
        account.reserved = max(0, account.reserved - reserved)
        account.settled_here += used

    def take_settled(self) -> dict[tuple[str, str], int]:
        """Spend settled here since the last call, by (tenant, period key); forgets it."""
        taken = {}
        for tenant_id, account in self._accounts.items():
            if account.settled_here:
                taken[(tenant_id, account.key)] = account.settled_here
                account.spent += account.settled_here
                account.settled_here = 0
        return taken

    def untake(self, taken: dict[tuple[str, str], int]) -> None:
        """Spend :meth:`take_settled` gave that could not be stored: settled here again."""
        for (tenant_id, key), tokens in taken.items():
            account = self._accounts.get(tenant_id)
            if account is not None and account.key == key:
                account.spent -= tokens
                account.settled_here += tokens

    def periods(self) -> dict[str, str]:
        """The period key of each budgeted tenant's account."""
        return {tenant_id: account.key for tenant_id, account in self._accounts.items()}

    def set_spent(self, tenant_id: str, tenant: TenantConfig, key: str, spent: int) -> None:
        """The store's total for the tenant's period ``key`` (every replica's settled spend)."""
        account = self._account(tenant_id, tenant)
        if account.key == key:
            account.spent = spent
