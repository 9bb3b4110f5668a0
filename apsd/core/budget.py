"""Budgets: what a tenant, or one of its keys, may use per day or month, in tokens or US dollars.

A **budget limit** (:class:`BudgetLimit`) is one account: a tenant's ``budget_tokens`` or
``budget_usd``, or an issued key's own (:class:`~apsd.core.config.KeyLimits`), each with its period.
A request is held to every limit of its tenant and of its key (:func:`limits_for`). Dollars are
counted in micro-dollars (:data:`MICRO`), so every account is an integer, and the prices of
``[prices]`` (:mod:`apsd.core.prices`) turn tokens into them.

Ownership: :class:`Budgets` belongs to admission, which asks it before taking a request's tokens
from the bucket (:meth:`Budgets.refusal`), reserves the request's reservation when it admits it
(:meth:`Budgets.reserve`) and settles what the request used when it ends (:meth:`Budgets.settle`).
The state keeper (:mod:`apsd.state.keeper`) is what makes a budget outlive a restart and hold
across replicas: it takes the spend settled here since its last visit (:meth:`Budgets.take_settled`),
adds it to the stored total, and hands back the total every replica spent (:meth:`Budgets.set_spent`).

The rule is reserve-then-settle, as for the bucket: a request is admitted only if what the
period has spent, plus what admitted requests have reserved and not yet settled, plus its own
reservation fits the budget. So concurrent requests cannot all slip under the limit at once (the
race of gateways that check spend first and count it when the request ends). A request reserves
what the bucket takes for it (its prompt estimate and its probable output, not its worst case:
:mod:`apsd.core.reservation`), priced for a dollar budget; so a process exceeds a budget only by what
its requests in flight when it ran out used beyond their reservations (docs/reference/accounting.md
states the bound). A tenant that needs a hard cap whatever the outputs sets ``output_estimate_tokens``
to its largest ``max_tokens``: every request then reserves its worst case.

**Across replicas a budget is a hard cap too** (:meth:`Budgets.share`, done by a shared store,
:mod:`apsd.store.leasing`): each replica admits only from its **lease** of the account, granted by the
shared store out of what no replica spent or holds, and the store counts what each replica settled.
A request the lease cannot cover is refused at once: 429 ``budget_exhausted`` when the budget, as
last known, cannot cover it either (``Retry-After``: the period's end), else 429 ``budget_leasing``
with ``Retry-After: 1``, and the next exchange (every ``[store] sync_interval_s``) leases for it. The
replicas together spend at most the budget plus what requests used beyond their reservation. What
the store counted is the period's spend every replica reports. A replica keeps a lease of a quarter
of its share of what is left while idle (``(budget - spent) / (4 * replicas)``), twice its last
interval's demand while busy, and room for the requests it refused until they are due back; it
returns the rest. While another replica's refused requests wait for more than is unleased (the store
tells every replica what they are short of), no replica keeps an idle share, and of two replicas each
short for its own refused requests, the one further from serving them gives back its lease (else two
replicas holding halves of a budget's last request would wait on each other until the period ends). A replica that is not seen for :data:`LEASE_TTL_S` loses its lease, which the store
counts as spent (it may have been, unreported) until that replica reports what it really spent: a replica
that never comes back strands at most its lease for the period, and a long outage never spends a lease
twice. A replica cut off from the store stops admitting from its lease :data:`LEASE_FRESH_S` after its
last exchange, and claims none of it when it is back.

Periods are UTC calendar days or months of the wall clock.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping

import attrs
import trio

from apsd.core.clock import calendar_time
from apsd.core.config import KeyConfig, TenantConfig
from apsd.core.models import Refusal

__all__ = ["BudgetAsk", "BudgetLimit", "BudgetView", "Budgets", "LEASE_FRESH_S", "LEASE_TTL_S", "MICRO", "TOKENS", "USD",
           "all_limits", "budget_account", "key_limits", "limits_for", "period_end", "period_key", "tenant_limits"]

#: The units of a budget, and micro-dollars per dollar (a dollar budget is counted in micro-dollars).
TOKENS, USD = "tokens", "usd"
MICRO = 1_000_000


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


#: Seconds a replica that has not exchanged with the shared store keeps its lease of a budget: then
#: the lease goes back to the budget (a replica that crashed gives it back this way).
LEASE_TTL_S = 30.0
#: Seconds after its last exchange that a replica stops admitting from its lease of a budget (a
#: replica cut off from the store holds nothing after this): well before :data:`LEASE_TTL_S`, when the
#: store may grant that lease to the others, so two replicas never spend the same lease.
LEASE_FRESH_S = LEASE_TTL_S / 2
#: Seconds a lease keeps room for refused requests after their ``Retry-After`` (the bucket's ``HOLD_S``).
HOLD_S = 2.0
#: The share of what a budget has left that an idle replica keeps leased, per replica.
IDLE_SHARE = 0.25
#: Seconds between two reads of an idle budget's account (its spend, what is left), at most.
READ_S = 1.0


def budget_account(tenant: str, key_id: str | None, unit: str) -> str:
    """The account name of a budget: ``team-a`` (the tenant's tokens: the name budgets always had),
    ``team-a:usd``, ``team-a:key:key_3f9a``, ``team-a:key:key_3f9a:usd``."""
    account = tenant if key_id is None else f"{tenant}:key:{key_id}"
    return account if unit == TOKENS else f"{account}:{USD}"


@attrs.frozen
class BudgetLimit:
    """One budget a request may be held to: whose (a tenant, or one of its keys), in what unit, how
    much per period."""

    account: str
    tenant: str
    #: The key's id (None: the tenant's own budget).
    key_id: str | None
    #: :data:`TOKENS` or :data:`USD` (then ``limit`` is in micro-dollars).
    unit: str
    limit: int
    period: str
    #: Whose it is, in words, for messages and logs: ``tenant 'team-a'``, ``key 'ci' of tenant 'team-a'``.
    who: str

    def amount(self, value: int) -> str:
        """``value`` of this budget's unit, in words (``1,234 tokens``, ``$1.2346``)."""
        return f"{value:,} tokens" if self.unit == TOKENS else f"${value / MICRO:,.4f}"


def tenant_limits(name: str, tenant: TenantConfig) -> list[BudgetLimit]:
    """The tenant's own budgets (tokens, dollars; none, one or both)."""
    who = f"tenant {name!r}"
    limits = []
    if tenant.budget_tokens:
        limits.append(BudgetLimit(budget_account(name, None, TOKENS), name, None, TOKENS, tenant.budget_tokens,
                                  tenant.budget_period, who))
    if tenant.budget_usd:
        limits.append(BudgetLimit(budget_account(name, None, USD), name, None, USD, round(tenant.budget_usd * MICRO),
                                  tenant.budget_period, who))
    return limits


def key_limits(key: KeyConfig) -> list[BudgetLimit]:
    """An issued key's own budgets (tokens, dollars; none, one or both)."""
    who = f"key {key.label!r} of tenant {key.tenant!r}"
    own = key.limits
    limits = []
    if own.budget_tokens:
        limits.append(BudgetLimit(budget_account(key.tenant, key.key_id, TOKENS), key.tenant, key.key_id, TOKENS,
                                  own.budget_tokens, own.budget_period, who))
    if own.budget_usd:
        limits.append(BudgetLimit(budget_account(key.tenant, key.key_id, USD), key.tenant, key.key_id, USD,
                                  round(own.budget_usd * MICRO), own.budget_period, who))
    return limits


def limits_for(tenant_id: str, tenant: TenantConfig, key: KeyConfig | None) -> list[BudgetLimit]:
    """Every budget a request of ``tenant_id`` (with ``key``, if it came with an issued key) is held to."""
    limits = tenant_limits(tenant_id, tenant)
    if key is not None and key.tenant == tenant_id:
        limits += key_limits(key)
    return limits


def all_limits(tenants: Mapping[str, TenantConfig], keys: Mapping[str, KeyConfig]) -> dict[str, BudgetLimit]:
    """Every budget in force, by account."""
    limits = {limit.account: limit for name, tenant in tenants.items() for limit in tenant_limits(name, tenant)}
    limits |= {limit.account: limit for key in keys.values() if key.tenant in tenants for limit in key_limits(key)}
    return limits


@attrs.frozen
class BudgetView:
    """A budget as this process knows it: its limit and period, what the period spent (every
    replica's, as of the last exchange when shared) and what requests in flight reserved here, in its
    unit (tokens, or micro-dollars for ``usd``)."""

    limit: int
    period: str
    spent: int
    reserved: int
    #: Unix seconds when the period (and so the budget) starts again.
    resets_at: float
    unit: str = TOKENS

    @property
    def used_ratio(self) -> float:
        """What the period spent, as a share of the limit."""
        return self.spent / self.limit if self.limit else 0.0


@attrs.frozen
class BudgetAsk:
    """One account's part of an exchange with the shared store (see :meth:`Budgets.asks`)."""

    #: The budget's account (:func:`budget_account`).
    account: str
    #: The period key (``2026-11-26``): the shared store keeps one account per tenant and period.
    period: str
    budget: int
    #: Tokens this replica settled in the period, all told, and how many of them the store counted
    #: (what it counted is kept per replica: sending the total again never counts it twice).
    settled: int
    acknowledged: int
    #: The period's spend as this replica last heard it (a store that lost it starts from there).
    known_spent: int
    #: What this replica holds of the budget after this exchange's return, before the grant.
    holding: float
    want: float
    #: What the requests this replica refused for want of a lease need beyond what it holds (0: none
    #: waits). The store tells the other replicas, which give back their idle leases for them.
    short: float = 0.0


@attrs.define
class _Account:
    period: str
    key: str
    #: Settled spend of the period, every replica's, as of the last exchange with a store.
    spent: int = 0
    #: Settled here since the keeper last took it (not yet in ``spent``; unshared budgets).
    settled_here: int = 0
    #: Admitted here and not settled yet: their whole cost.
    reserved: int = 0
    # -- shared budgets ----------------------------------------------------------------------------
    #: Tokens of the budget this replica holds: what it reserved and settled since the last exchange
    #: comes out of it.
    lease: float = 0.0
    #: Settled here in the period, all told; of which the shared store has counted ``acknowledged``.
    settled_total: int = 0
    acknowledged: int = 0
    #: Reserved since the last exchange (demand); refused for want of a lease since then.
    taken: int = 0
    refused: int = 0
    #: Room the lease keeps for refused requests, until (trio seconds) their clients are due back.
    waiting: float = 0.0
    waiting_until: float = 0.0
    #: What those requests need beyond the lease, as last told the store.
    short: float = 0.0
    #: Whether the shared store has answered for this account since it was made, and when (trio seconds).
    exchanged: bool = False
    exchanged_at: float = 0.0
    #: What no replica held or spent of the budget, at the last exchange.
    unleased: float = 0.0
    #: What the other replicas' refused requests were short of, at the last exchange (0: none waits).
    others_short: float = 0.0

    @property
    def unexchanged(self) -> int:
        return self.settled_total - self.acknowledged

    def held(self, now: float) -> float:
        """The lease, while the store still counts it this replica's (see :data:`LEASE_FRESH_S`); else 0."""
        return self.lease if self.exchanged and now - self.exchanged_at < LEASE_FRESH_S else 0.0


@attrs.define(eq=False)
class Budgets:
    """Every budget's account for its current period, by account name."""

    #: Unix seconds now (a test passes its own).
    wall: Callable[[], float] = calendar_time
    _accounts: dict[str, _Account] = attrs.field(factory=dict)
    #: Seconds between two exchanges with a shared store (None: budgets are this process's own).
    sync_interval_s: float | None = None
    #: Replicas seen sharing the store (for the idle lease).
    replicas: int = 1
    #: The budgets in force now, by account (admission sets it: :func:`all_limits` of its tenants and keys).
    limits: Callable[[], Mapping[str, BudgetLimit]] = dict

    @property
    def shared(self) -> bool:
        return self.sync_interval_s is not None

    def share(self, sync_interval_s: float) -> None:
        """Hold budgets as leases from a shared store that exchanges every ``sync_interval_s`` (see
        the module docstring); the store calls :meth:`asks` and :meth:`exchanged`."""
        self.sync_interval_s = sync_interval_s

    def _account(self, limit: BudgetLimit) -> _Account:
        key = period_key(limit.period, self.wall())
        account = self._accounts.get(limit.account)
        if account is None or account.key != key or account.period != limit.period:
            reserved = account.reserved if account is not None else 0  # (still to settle, in the new period)
            account = self._accounts[limit.account] = _Account(limit.period, key, reserved=reserved)
        return account

    def used(self, limit: BudgetLimit) -> int:
        """What the current period spent or reserved, as far as this process knows."""
        account = self._account(limit)
        return account.spent + account.settled_here + account.unexchanged + account.reserved

    def view(self, limit: BudgetLimit) -> BudgetView:
        """The budget now."""
        account = self._account(limit)
        return BudgetView(limit=limit.limit, period=limit.period,
                          spent=account.spent + account.settled_here + account.unexchanged,
                          reserved=account.reserved, resets_at=period_end(limit.period, self.wall()), unit=limit.unit)

    def refusal(self, limit: BudgetLimit, cost: int) -> Refusal | None:
        """429 ``budget_exhausted`` if ``cost`` more would pass the budget (shared: 429 ``budget_leasing``
        when the budget could cover it but this replica's lease cannot now), else None."""
        account = self._account(limit)
        used = self.used(limit)
        if self.shared:
            lease = account.held(trio.current_time())
            if cost <= lease - account.reserved - account.unexchanged:
                return None
            account.refused += cost
            if used + cost <= limit.limit:
                retry = max(1, math.ceil(self.sync_interval_s or 0))
                if account.waiting_until < trio.current_time() + retry + HOLD_S:
                    account.waiting_until = trio.current_time() + retry + HOLD_S
                held = max(0, int(lease - account.reserved - account.unexchanged))
                return Refusal(429, "budget_leasing",
                               f"{limit.who} has {limit.amount(limit.limit - used)} of its budget left as last known, "
                               f"but this replica holds {limit.amount(held)} of it and this request reserves "
                               f"{limit.amount(cost)}; it is leasing more from the shared budget: retry in {retry} s",
                               headers={"Retry-After": str(retry)})
        elif used + cost <= limit.limit:
            return None
        now = self.wall()
        retry = max(1, int(period_end(limit.period, now) - now) + 1)
        return Refusal(429, "budget_exhausted",
                       f"{limit.who} has used {limit.amount(used)} of its {limit.amount(limit.limit)} budget this "
                       f"{limit.period} (UTC) and this request reserves {limit.amount(cost)}; the budget starts "
                       f"again in {retry} s", headers={"Retry-After": str(retry)})

    def reserve(self, limit: BudgetLimit, cost: int) -> None:
        account = self._account(limit)
        account.reserved += cost
        account.taken += cost
        account.waiting = max(0.0, account.waiting - cost)

    def settle(self, account_name: str, reserved: int, used: int, limit: BudgetLimit | None) -> None:
        """A request that reserved ``reserved`` of account ``account_name`` ended having used ``used``;
        ``limit``: the budget as in force now (None: no longer configured; the account is settled all
        the same)."""
        account = self._accounts.get(account_name)
        if account is None:
            return
        if limit is not None:
            account = self._account(limit)
        account.reserved = max(0, account.reserved - reserved)
        if self.shared:
            account.settled_total += used
        else:
            account.settled_here += used

    # -- unshared budgets: the state keeper keeps the spend ------------------------------------------
    def take_settled(self) -> dict[tuple[str, str], int]:
        """Spend settled here since the last call, by (account, period key); forgets it. (Nothing for
        shared budgets: the shared store counts those.)"""
        taken = {}
        for name, account in self._accounts.items():
            if account.settled_here:
                taken[(name, account.key)] = account.settled_here
                account.spent += account.settled_here
                account.settled_here = 0
        return taken

    def untake(self, taken: dict[tuple[str, str], int]) -> None:
        """Spend :meth:`take_settled` gave that could not be stored: settled here again."""
        for (name, key), amount in taken.items():
            account = self._accounts.get(name)
            if account is not None and account.key == key:
                account.spent -= amount
                account.settled_here += amount

    def periods(self) -> dict[str, str]:
        """The period key of each account."""
        return {name: account.key for name, account in self._accounts.items()}

    def set_spent(self, limit: BudgetLimit, key: str, spent: int) -> None:
        """The store's total for the account's period ``key`` (every replica's settled spend). For a
        shared budget it only raises what this replica knows (the shared store's count wins)."""
        account = self._account(limit)
        if account.key == key:
            account.spent = max(account.spent, spent) if self.shared else spent

    # -- shared budgets: the store's exchange -------------------------------------------------------
    def asks(self, limits: Mapping[str, BudgetLimit], reads: int = 100) -> list[BudgetAsk]:
        """What the next exchange asks for each budget of ``limits`` whose lease changes, whose
        settlements the store has not counted, or that was never exchanged; and up to ``reads``
        others (a read: their spend and what is left), in turn."""
        now = trio.current_time()
        asks = []
        for name, limit in limits.items():
            account = self._account(limit)
            unexchanged = account.unexchanged
            # (a lease not renewed for LEASE_FRESH_S is no longer claimed: the store may have given it away)
            holding = max(0.0, account.held(now) - unexchanged)
            free = holding - account.reserved
            if now >= account.waiting_until:
                account.waiting = 0.0
            account.waiting = max(account.waiting, float(account.refused))
            left = max(0.0, limit.limit - account.spent - unexchanged)
            short = max(0.0, account.waiting - free)
            if account.others_short <= 0:
                target = max(2.0 * account.taken, account.waiting, IDLE_SHARE * left / max(1, self.replicas))
                # (slack on the way back: an idle lease is not trimmed at every exchange as the others'
                # spending shrinks its share a little)
                returned = free - target if free > 1.5 * target else 0.0
            else:
                # Another replica's refused requests wait for what is not leased: no idle share is kept
                # for them to wait on. A replica whose own refused requests are at least as far from
                # being served gives back all it holds and does not reserve, so that the closer one is
                # served (two replicas each holding part of what is left would otherwise wait on each
                # other); one that holds nothing to give asks, so that of two equally far one is served.
                yields = free > 0 and short >= account.others_short
                target = 0.0 if yields else max(2.0 * account.taken, account.waiting)
                returned = max(0.0, free - target)
            want = max(0.0, target - free)
            changes = want > 0 or returned > 0 or unexchanged or not account.exchanged or short != account.short
            if not changes and (reads <= 0 or now - account.exchanged_at < READ_S):
                continue
            reads -= 0 if changes else 1
            account.short = short
            asks.append(BudgetAsk(name, account.key, limit.limit, account.settled_total,
                                  account.acknowledged, account.spent, holding - returned, want, short))
        return asks

    def releases(self, limits: Mapping[str, BudgetLimit]) -> list[BudgetAsk]:
        """At a clean stop: asks that report what was settled and give back every lease but what
        requests still reserve."""
        asks = []
        for name, limit in limits.items():
            account = self._accounts.get(name)
            if account is None or not account.exchanged:
                continue
            asks.append(BudgetAsk(name, account.key, limit.limit, account.settled_total,
                                  account.acknowledged, account.spent, float(account.reserved), 0.0))
        return asks

    def exchanged(self, ask: BudgetAsk, granted: float, spent: int, unleased: float, others_short: float = 0.0) -> None:
        """The store's answer to ``ask``: the lease is what this replica said it holds plus the grant
        (what it reserved or settled since the ask comes out of it, as usual); ``others_short``: what
        the other replicas' refused requests were short of (their last ``short``)."""
        account = self._accounts.get(ask.account)
        if account is None or account.key != ask.period:
            return  # (the period ended meanwhile: the new one starts its own lease)
        account.lease = ask.holding + granted
        account.acknowledged = max(account.acknowledged, ask.settled)
        account.spent = spent
        account.unleased = unleased
        account.others_short = others_short
        account.taken = account.refused = 0
        account.exchanged, account.exchanged_at = True, trio.current_time()
