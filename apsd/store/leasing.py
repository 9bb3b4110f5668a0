"""A replica's side of shared buckets and fair share: leases, optimistic admission, outages.

Nothing here is on a request's path. Admission decides against this replica's :class:`LeasedBucket`,
synchronously; one background task (:meth:`LeasingStore.run`) exchanges with the shared state
(:class:`SharedState`: Redis in a deployment, :mod:`apsd.store.redis`; in memory with a delay in the
simulator, :mod:`apsd.store.simulated`) every ``[store] sync_interval_s``:

* **Leases.** Each tenant's bucket lives in the shared state, refilled by its clock (Redis's
  ``TIME``: every replica reads time from one source). A replica leases slices of it: it asks for
  what its recent demand needs for the next two intervals, returns what it holds beyond that
  (everything once idle), and settles its refunds and debts, all in one exchange.
* **Service.** The fair-share queue's weighted service given here since the last exchange is added
  to the shared totals and the totals come back; what the other replicas gave is handed to the
  queue (:class:`~apsd.core.store.SharedService`). The same exchange counts the replicas seen in
  the last second.

Accuracy. A replica admits from its lease, and beyond it optimistically up to its share (1/N for N
replicas seen) of what the tenant's bucket held at its last exchange, charged at its next one. The
leases never grant more than the bucket holds, so over ``T`` seconds a tenant gets at most
``burst + rate * T`` plus the optimistic part: per exchange, at most what the bucket held when the
replicas last read it (the shares of N replicas add up to one bucket), which is near zero while
demand exceeds the rate (the bucket stays empty), and at most ``burst`` in one interval after a
pause. It loses what idle replicas hold: a lease is twice the last interval's demand (at least
``2 * rate * sync_interval_s`` while busy) and, for ``HOLD_S`` after a pause, the largest recent
interval's demand, so N replicas park at most N such slices (and a refused request's size, below).
Measured: three replicas, one tenant at twice its rate for 30 s, 6,360 tokens admitted against a
bound of 6,400 (``tests/backends/test_store.py``); ``apsd simulate --replicas`` compares sync intervals.

Refusals tell the shared truth. A request its lease and optimistic share cannot cover is refused
at once (nothing waits for the shared state), and the replica asks at its next exchange for a lease
sized for it (the lease's target is at least the request). Its ``Retry-After`` is computed from the
shared bucket's last known level: what the bucket held at the last exchange, refilled since at the
tenant's rate (capped at ``burst``), less what this replica admitted beyond its lease, plus what it
holds. If that covers the request, the wait is one sync interval (the next exchange brings the
lease; 1 s in the header); else one interval plus the shortfall at the tenant's rate. The estimate
does not know what the other replicas took since this replica's last read (they take from their
leases, two intervals of their demand); a retry that finds the tokens gone is told again from a
fresher level. So that the retry finds its tokens, the lease keeps room for the refused request
until its wait has passed plus ``HOLD_S`` (or until it is admitted): for that long it parks at most
that request's tokens, which the retry is to spend. None of this admits a token more than before:
the bound above holds as it was.

What a replica knows of the shared bucket (:meth:`LeasedBucket.view`, ``GET /tenants/<id>/status``)
is read at every exchange that leases for the tenant; an idle tenant's level is read at least every
:data:`READ_S` (at most :data:`READS_PER_EXCHANGE` tenants an exchange, by an ask for nothing, which
writes nothing to a bucket that exists), so a replica that serves a tenant no traffic still sees
what the others took, and its optimistic share is taken from a recent level.

Budgets. A budget (a tenant's or a key's, in tokens or dollars) is a hard cap across replicas: the
same exchange leases slices of each budget for the period and reports what this replica settled (its running
total, so a repeated report never counts twice); admission admits only from the lease, without
optimism (:mod:`apsd.core.budget` states the rule and the lease sizes). A replica not seen for
``LEASE_TTL_S`` loses its lease to the others. During an outage a replica admits from the lease it
holds, and no more.

Unavailable shared state (a failed or slow exchange): the store logs the switch and the recovery
(WARNING, once each), counts it (``apsd_store_available``, ``apsd_store_outages_total``) and
retries every interval. With ``on_unavailable = "local"`` each bucket keeps admitting at its share
of the tenant's rate (``rate / N`` for the N replicas last seen, starting from its share of what the
bucket held) until an exchange succeeds again (the one in flight included), and what it admits
beyond its lease is charged to the shared bucket at the next exchange, so every token is counted
once (unless the state lost the bucket meanwhile: a lost bucket starts full).
With ``"refuse"``, a request its lease cannot cover is answered 503 ``store_unavailable``.

Restarts: the buckets are in the shared state, so a replica that restarts finds them where they
were; on a clean stop it returns its leases (within a second), on a crash they are lost to the
tenant (at most a lease slice each).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol

import attrs
import trio

from apsd.core.bucket import TokenBucket
from apsd.core.budget import BudgetAsk, Budgets
from apsd.core.config import StoreConfig, TenantConfig
from apsd.core.models import Refusal
from apsd.core.store import Bucket, BucketView, SharedService, StoreStatistics

__all__ = ["LeaseAsk", "LeasedBucket", "LeasingStore", "SharedSession", "SharedState"]

log = logging.getLogger("apsd.store")

#: An exchange that takes longer than this (wall seconds) counts as failed.
EXCHANGE_TIMEOUT_S = 1.0
#: Seconds a lease keeps room for the largest demand it saw in one interval, after a pause (and for a
#: refused request, after its ``Retry-After``).
HOLD_S = 2.0
#: An idle tenant's shared level is read at least this often (seconds), by at most
#: ``READS_PER_EXCHANGE`` reads an exchange.
READ_S = 1.0
READS_PER_EXCHANGE = 100


@attrs.frozen
class LeaseAsk:
    """One tenant's part of an exchange: its contract, the tokens wanted, and those returned
    (negative: a debt charged to the shared bucket)."""

    tenant: str
    rate: float
    burst: float
    want: float
    returned: float


class SharedSession(Protocol):
    """An open connection to the shared state; each call is atomic on the shared side."""

    async def lease(self, asks: Sequence[LeaseAsk]) -> list[tuple[float, float]]:
        """Refill each bucket to now, add what is returned (capped at ``burst``; a bucket the state
        does not have starts full, with no debt), grant up to ``want`` of what it holds; per ask,
        (granted, tokens left in the shared bucket)."""

    async def service(self, replica: str, given: Mapping[str, float]) -> tuple[int, dict[str, float]]:
        """Add ``given`` (tenant -> weighted service) to the totals and mark ``replica`` seen now;
        (replicas seen in the last second, every tenant's total)."""

    async def budget(self, replica: str, asks: Sequence[BudgetAsk]) -> list[tuple[float, int, float, float]]:
        """For each ask, on the tenant's account for its period: count what ``replica`` settled that was
        not counted yet (its ``settled`` total against what the account last counted for it, else
        against ``acknowledged``), start from ``known_spent`` when it has no spend (a state that lost
        the account), drop the leases of replicas not seen for ``LEASE_TTL_S``, set ``replica``'s
        lease to ``holding``, grant up to ``want`` of what no replica spent or holds, and keep what
        ``replica`` is ``short`` of beyond the grant; per ask, (granted, the period's spend, what is left
        unleased after the grant, what the other replicas seen are short of)."""


class SharedState(Protocol):
    #: What the logs call it (its URL).
    name: str

    def session(self) -> AbstractAsyncContextManager[SharedSession]: ...


class LeasedBucket:
    """A tenant's bucket as one replica sees it: tokens leased from the shared state (``tokens``), plus an
    optimistic share of what the shared bucket held at the last exchange (see the module docstring).

    Times: ``now`` (admission's model seconds) times only the outage fallback; what concerns the shared
    bucket (its refill since the last read, holds) is timed by ``trio.current_time()``, the clock the
    exchanges run on (a shared store runs at ``gpu.time_scale = 1``: the two advance alike)."""

    def __init__(self, tenant: TenantConfig, store: LeasingStore) -> None:
        self.rate, self.burst = tenant.rate, float(tenant.burst)
        self._store = store
        #: Tokens this replica holds (leased, plus refunds; negative: a debt to settle).
        self.tokens = 0.0
        #: What the shared bucket held after the last exchange that read it, and when (trio seconds;
        #: None: never read, and assumed full); what this replica took from it optimistically since.
        self.shared_seen = self.burst
        self.shared_at: float | None = None
        self.optimistic = 0.0
        #: Demand since the last exchange: tokens taken, and the largest request refused.
        self.taken = 0.0
        self.refused = 0.0
        #: The largest interval's demand lately, and when (the lease keeps that much for HOLD_S).
        self.largest = 0.0
        self.largest_at = 0.0
        #: The largest refused request still waiting for its lease, and until when the lease keeps room
        #: for it (trio seconds: its Retry-After, plus HOLD_S).
        self.waiting = 0.0
        self.waiting_until = 0.0
        #: While Redis is unreachable ("local"): admit from a bucket refilling at this replica's share of
        #: the rate, made at the first request after the switch; what it admitted is charged later.
        self.falling_back = False
        self.fallback: TokenBucket | None = None
        self.outage_spent = 0.0

    # -- what admission calls --------------------------------------------------------------------
    def _optimistic_room(self) -> float:
        return max(0.0, self.shared_seen / self._store.replicas - self.optimistic)

    def _fallback(self, now: float) -> TokenBucket:
        if self.fallback is None:
            share = 1.0 / self._store.replicas
            # it starts with its share of what the shared bucket held at the last exchange
            self.fallback = TokenBucket(rate=self.rate * share, burst=self.burst * share,
                                        tokens=self._optimistic_room(), updated=now)
        return self.fallback

    def _shared_now(self) -> float:
        """The shared bucket now, as last known: its level at the last read, refilled since at the rate."""
        if self.shared_at is None:
            return self.shared_seen
        return min(self.burst, self.shared_seen + (trio.current_time() - self.shared_at) * self.rate)

    def reachable(self) -> float:
        """What this replica could hold after its next exchange, as far as it knows: what it holds, less
        what it admitted beyond its lease, plus the shared bucket now (the other replicas' takes since
        their last exchange unknown)."""
        return self.tokens - self.optimistic - self.outage_spent + self._shared_now()

    def level(self, now: float) -> float:
        if self.falling_back:
            return max(self.tokens, 0.0) + self._fallback(now).level(now)
        return self.tokens + self._optimistic_room()

    def try_take(self, amount: float, now: float) -> bool:
        if self.falling_back:
            self._fallback(now)
        if self.tokens >= amount:
            self.tokens -= amount
        elif self.fallback is not None:
            if not self.fallback.try_take(amount, now):
                self.refused = max(self.refused, amount)
                return False
            self.outage_spent += amount
        elif not self._store.available:
            self.refused = max(self.refused, amount)
            return False
        elif self.tokens + self._optimistic_room() >= amount:
            beyond = amount - max(self.tokens, 0.0)
            self.tokens -= amount - beyond
            self.optimistic += beyond
        else:
            # the next exchange asks for a lease that covers it; keep room for it until its client is back
            self.refused = max(self.refused, amount)
            clock = trio.current_time()
            if clock >= self.waiting_until or amount >= self.waiting:
                self.waiting = amount
                self.waiting_until = max(self.waiting_until, clock + self._shared_wait(amount) + HOLD_S)
            return False
        if amount >= self.waiting:
            self.waiting = 0.0
        self.taken += amount
        return True

    def give_back(self, amount: float, now: float) -> None:
        self.tokens += amount

    def _shared_wait(self, amount: float) -> float:
        """Seconds until ``amount`` can be leased: the next exchange, and the refill it lacks."""
        return self._store.sync_interval_s + max(0.0, amount - self.reachable()) / self.rate

    def seconds_until(self, amount: float, now: float) -> float:
        """How long until this replica can admit ``amount``: 0 if it can now; else from the shared
        bucket's last known level (one exchange if it has enough, see the module docstring), or, while
        the shared state is unreachable ("local"), at this replica's share of the rate."""
        if self.fallback is not None or self.falling_back:
            fallback = self._fallback(now)
            return max(0.0, amount - max(self.tokens, 0.0) - fallback.level(now)) / fallback.rate
        if self._store.available and self.tokens + self._optimistic_room() >= amount:
            return 0.0
        return self._shared_wait(amount)

    def view(self, now: float) -> BucketView:
        """What this replica knows of the tenant's bucket (``GET /tenants/<id>/status``)."""
        age = None if self.shared_at is None else max(0.0, trio.current_time() - self.shared_at)
        return BucketView(tokens=min(self.burst, self.reachable()), replica_tokens=self.level(now),
                          shared_tokens=self.shared_seen, shared_age_s=age)

    # -- what the exchange does ------------------------------------------------------------------
    def request(self, interval: float, now: float) -> tuple[float, float]:
        """(want, returned) for the next exchange at ``now``; clears the demand counters. It keeps
        twice the last interval's demand, and for :data:`HOLD_S` the largest request it saw, so a
        tenant's next request after a pause need not wait for an exchange; and room for a refused
        request until its client is back."""
        demand = max(self.taken, self.refused)
        if demand >= self.largest or now - self.largest_at > HOLD_S:
            self.largest, self.largest_at = demand if demand else 0.0, now
        if now >= self.waiting_until:
            self.waiting = 0.0
        target = min(self.burst, max(2.0 * demand, 2.0 * self.rate * interval if self.taken else 0.0, self.largest,
                                     self.waiting))
        returned = -self.optimistic
        self.optimistic = 0.0
        held = self.tokens
        if held < 0:  # a debt (refunds below zero): settle it
            returned += held
            held = 0.0
        want = max(0.0, target - held)
        if held > target:  # return what recent demand does not need (everything once idle)
            returned += held - target
            held = target
        self.tokens = held
        self.taken = self.refused = 0.0
        return want, returned

    def stale(self, now: float) -> bool:
        """Whether the shared level is due a read (:data:`READ_S`)."""
        return self.shared_at is None or now - self.shared_at >= READ_S

    def settle(self, granted: float, left: float) -> None:
        self.tokens += granted
        self.shared_seen, self.shared_at = left, trio.current_time()

    def outage_debt(self) -> float:
        """What was admitted beyond the lease while the shared state was unreachable, to charge to it
        at this exchange (and forget: a failed exchange keeps it as a debt, :meth:`unrequest`)."""
        spent, self.outage_spent = self.outage_spent, 0.0
        return spent

    def recover(self) -> None:
        """The shared state is back (an exchange succeeded): admit from the lease and share again. Until
        then, the fallback admits, even while the exchange that recovers is in flight."""
        self.fallback, self.falling_back = None, False

    def unrequest(self, returned: float) -> None:
        """The exchange failed: keep what was to be returned or settled (a debt stays a debt)."""
        self.tokens += returned


class LeasingStore:
    """A replica's side of shared buckets and fair share (see the module docstring), exchanging with
    ``state`` every ``[store] sync_interval_s``; :meth:`run` does every exchange."""

    def __init__(self, config: StoreConfig, state: SharedState, *, kind: str = "redis",
                 replica_id: str | None = None) -> None:
        self.config, self.state, self.kind = config, state, kind
        self.sync_interval_s = config.sync_interval_s
        self.replica_id = replica_id or secrets.token_hex(6)
        self.available = False  # until the first exchange succeeds
        self.replicas = 1
        self._buckets: dict[str, LeasedBucket] = {}
        self._policy: SharedService | None = None
        self._service_seen: dict[str, float] | None = None
        self._budgets: Budgets | None = None
        self._outages = 0
        self._syncs = 0
        self._failures = 0

    # -- the seam --------------------------------------------------------------------------------
    def bucket(self, tenant_id: str, tenant: TenantConfig, now: float) -> LeasedBucket:
        bucket = LeasedBucket(tenant, self)
        old = self._buckets.get(tenant_id)
        if old is not None:  # a reload re-rated it: keep what this replica holds and knows
            bucket.tokens, bucket.optimistic, bucket.shared_seen, bucket.shared_at = (
                old.tokens, old.optimistic, old.shared_seen, old.shared_at)
            bucket.waiting, bucket.waiting_until = old.waiting, old.waiting_until
            bucket.falling_back, bucket.outage_spent = old.falling_back, old.outage_spent
        elif not self.available and self._failures and self.config.on_unavailable == "local":
            bucket.falling_back = True  # (a tenant added during an outage)
        self._buckets[tenant_id] = bucket
        return bucket

    def refusal(self) -> Refusal | None:
        if self.available or self.config.on_unavailable == "local":
            return None
        return Refusal(503, "store_unavailable", f"the shared quota store ({self.kind}) cannot be reached and this "
                       "replica's leases cannot cover the request ([store] on_unavailable = \"refuse\")",
                       headers={"Retry-After": "1"})

    def bucket_view(self, bucket: Bucket, now: float) -> BucketView:
        if isinstance(bucket, LeasedBucket):
            return bucket.view(now)
        level = bucket.level(now)
        return BucketView(tokens=level, replica_tokens=level)

    def share(self, policy: object) -> None:
        if isinstance(policy, SharedService):
            policy.take_service()  # (starts its bookkeeping; it has given nothing shared yet)
            self._policy, self._service_seen = policy, None
        else:
            self._policy = None

    def share_budgets(self, budgets: Budgets) -> None:
        budgets.share(self.sync_interval_s)
        self._budgets = budgets

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(kind=self.kind, available=self.available, outages=self._outages, syncs=self._syncs,
                               sync_failures=self._failures, replicas=self.replicas,
                               leased_tokens=sum(max(b.tokens, 0.0) for b in self._buckets.values()))

    # -- the exchange task ---------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        started = False
        try:
            while True:
                try:
                    async with self.state.session() as session:
                        while True:
                            with trio.fail_after(EXCHANGE_TIMEOUT_S):
                                await self._exchange(session)
                            if not started:
                                task_status.started()
                                started = True
                            await trio.sleep(self.sync_interval_s)
                except Exception as exc:  # unreachable, refused, timed out (trio.TooSlowError): retry
                    self._unavailable(exc)
                    if not started:
                        task_status.started()
                        started = True
                    await trio.sleep(self.sync_interval_s)
        finally:
            with trio.CancelScope(shield=True):
                await self._return_leases()

    async def _exchange(self, session: SharedSession) -> None:
        recovering = not self.available
        asks: list[LeaseAsk] = []
        now = trio.current_time()
        reads = READS_PER_EXCHANGE  # idle tenants whose shared level is due a read (it writes nothing)
        for name, bucket in self._buckets.items():
            debt = bucket.outage_debt()
            want, returned = bucket.request(self.sync_interval_s, now)
            returned -= debt
            if want or returned or recovering:
                asks.append(LeaseAsk(name, bucket.rate, bucket.burst, want, returned))
            elif reads and bucket.stale(now):
                reads -= 1
                asks.append(LeaseAsk(name, bucket.rate, bucket.burst, 0.0, 0.0))
        try:
            if asks:
                for ask, (granted, left) in zip(asks, await session.lease(asks)):
                    self._buckets[ask.tenant].settle(granted, left)
                asks = []
            await self._exchange_service(session)
            await self._exchange_budgets(session)
        except BaseException:
            for ask in asks:  # (not sent, or no answer: nothing granted, keep the returns)
                self._buckets[ask.tenant].unrequest(ask.returned)
            raise
        self._syncs += 1
        if recovering:
            for bucket in self._buckets.values():
                bucket.recover()
            if self._outages:
                log.warning("shared store %s reachable again: buckets and fair share are shared (%d replicas)",
                            self.state.name, self.replicas)
            else:
                log.info("shared store %s: buckets and fair share are shared (%d replicas)", self.state.name,
                         self.replicas)
            self.available = True

    async def _exchange_service(self, session: SharedSession) -> None:
        given = self._policy.take_service() if self._policy is not None else {}
        self.replicas, totals = await session.service(self.replica_id, given)
        self.replicas = max(1, self.replicas)
        if self._policy is not None:
            seen = self._service_seen if self._service_seen is not None else {}
            remote = {t: total - seen.get(t, 0.0) - given.get(t, 0.0) for t, total in totals.items()}
            self._policy.add_service({t: v for t, v in remote.items() if v})
            self._service_seen = totals

    async def _exchange_budgets(self, session: SharedSession) -> None:
        """Lease budgets and report what was settled (after the service exchange: it counts the replicas)."""
        budgets = self._budgets
        if budgets is None:
            return
        budgets.replicas = self.replicas
        asks = budgets.asks(budgets.limits(), READS_PER_EXCHANGE)
        if asks:
            for ask, answer in zip(asks, await session.budget(self.replica_id, asks)):
                budgets.exchanged(ask, *answer)

    def _unavailable(self, exc: BaseException) -> None:
        """An exchange failed: switch to ``on_unavailable`` (logged once per outage)."""
        self._failures += 1
        if self.available or (self._syncs == 0 and self._failures == 1):
            self._outages += 1
            log.warning("shared store %s unreachable (%s): %s", self.state.name, _describe(exc),
                        "admitting at this replica's share of each tenant's rate"
                        if self.config.on_unavailable == "local" else "refusing what leases cannot cover")
        self.available = False
        if self.config.on_unavailable == "local":
            for bucket in self._buckets.values():
                bucket.falling_back = True

    async def _return_leases(self) -> None:
        """Give back what this replica holds of buckets and budgets (a clean stop), and report what it
        settled; best effort, within a second."""
        if not self.available:
            return
        asks = [LeaseAsk(name, b.rate, b.burst, 0.0, b.tokens - b.optimistic - b.outage_spent)
                for name, b in self._buckets.items() if b.tokens - b.optimistic - b.outage_spent]
        budget_asks = self._budgets.releases(self._budgets.limits()) if self._budgets is not None else []
        if not asks and not budget_asks:
            return
        with trio.move_on_after(1.0):
            try:
                async with self.state.session() as session:
                    if asks:
                        await session.lease(asks)
                    if budget_asks:
                        await session.budget(self.replica_id, budget_asks)
            except Exception as exc:
                log.warning("could not return leases to %s: %s", self.state.name, _describe(exc))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _describe(exc.exceptions[0])
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
