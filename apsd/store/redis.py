"""``[store] kind = "redis"``: buckets and fair-share counters shared by every replica through Redis.

Nothing here is on a request's path. Admission decides against this replica's :class:`LeasedBucket`,
synchronously; one background task (:meth:`RedisStore.run`) talks to Redis every
``sync_interval_s`` wall seconds, in two Lua scripts, each atomic on the Redis side:

* **Leases** (:data:`LEASE_SCRIPT`). Each tenant's bucket lives in Redis (``<prefix>:bucket:<tenant>``:
  ``tokens`` and ``updated``, refilled by Redis's own clock, ``TIME``, so every replica reads time
  from one source). A replica leases slices of it: it asks for what its recent demand needs for
  the next two intervals, returns what it holds beyond that (everything once idle), and settles its
  refunds and debts, all in one call for every tenant with something to say.
* **Service** (:data:`SERVICE_SCRIPT`). The fair-share queue's weighted service given here since
  the last exchange is added to ``<prefix>:service`` and the totals come back; what the other
  replicas gave is handed to the queue (:class:`~apsd.store.base.SharedService`). The same script
  keeps ``<prefix>:replicas``, a sorted set of replicas seen in the last second.

Accuracy. A replica admits from its lease, and beyond it optimistically up to its share (1/N for N
replicas seen) of what the tenant's bucket held at the last exchange, charged at the next one. The
tokens a tenant gets are therefore at most what its bucket grants (``burst + rate * T``) plus what
the other replicas leased between one replica's reading and its next exchange: at most one
interval's grants, one lease slice per replica (about ``2 * rate * sync_interval_s`` each once
demand is steady). It loses at most the slices idle replicas hold for an interval before returning
them. Both shrink with the interval.

Unavailable Redis (a failed or slow exchange): the store logs the switch, counts it
(``apsd_store_available``, ``apsd_store_outages_total``) and retries every interval. With
``on_unavailable = "local"`` each bucket keeps admitting at its share of the tenant's rate
(``rate / N`` for the N replicas last seen), and what it admits beyond its lease is charged to the
shared bucket when Redis is back, so every token is counted once. With ``"refuse"``, a request its
lease cannot cover is answered 503 ``store_unavailable``.

Restarts: the buckets are in Redis, so a replica that restarts finds them where they were; on a
clean stop it returns its leases (within a second), on a crash they are lost to the tenant (at
most a lease slice each).
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import trio

from ..admission import TokenBucket
from ..config import StoreConfig, TenantConfig
from ..models import Refusal
from .base import SharedService, StoreStatistics

__all__ = ["LEASE_SCRIPT", "LeasedBucket", "RedisStore", "SERVICE_SCRIPT"]

log = logging.getLogger("apsd.store")

#: KEYS: one bucket per tenant. ARGV: ttl_s, then per tenant rate, burst, want, returned.
#: Returns per tenant: granted, tokens left in the bucket (as strings: Lua numbers are doubles).
LEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
local out = {}
for i, key in ipairs(KEYS) do
  local rate, burst = tonumber(ARGV[4 * i - 2]), tonumber(ARGV[4 * i - 1])
  local want, returned = tonumber(ARGV[4 * i]), tonumber(ARGV[4 * i + 1])
  local state = redis.call('HMGET', key, 'tokens', 'updated')
  local tokens = tonumber(state[1]) or burst
  local updated = tonumber(state[2]) or now
  if not state[1] and returned < 0 then returned = 0 end  -- a bucket Redis lost starts full: no old debts
  if now > updated then
    tokens = math.min(burst, tokens + (now - updated) * rate)
    updated = now
  end
  tokens = math.min(burst, tokens + returned)
  local grant = 0
  if want > 0 and tokens > 0 then grant = math.min(want, tokens) end
  tokens = tokens - grant
  redis.call('HSET', key, 'tokens', tostring(tokens), 'updated', tostring(updated))
  redis.call('EXPIRE', key, ttl)
  out[2 * i - 1] = tostring(grant)
  out[2 * i] = tostring(tokens)
end
return out
"""

#: KEYS: the service hash, the replicas set. ARGV: replica id, then tenant, weighted service pairs.
#: Returns the replica count, then the service hash's tenant, total pairs.
SERVICE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for i = 2, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - 1)
local out = {tostring(redis.call('ZCARD', KEYS[2]))}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all do out[i + 1] = all[i] end
return out
"""

#: A bucket key lives this long after its last exchange (a tenant idle for longer starts full).
BUCKET_TTL_S = 86_400
#: An exchange that takes longer than this counts as failed.
EXCHANGE_TIMEOUT_S = 1.0


class LeasedBucket:
    """A tenant's bucket as one replica sees it: tokens leased from Redis (``tokens``), plus an
    optimistic share of what the shared bucket held at the last exchange (see the module docstring)."""

    def __init__(self, tenant: TenantConfig, store: RedisStore) -> None:
        self.rate, self.burst = tenant.rate, float(tenant.burst)
        self._store = store
        #: Tokens this replica holds (leased, plus refunds; negative: a debt to settle).
        self.tokens = 0.0
        #: What the shared bucket held after the last exchange, and what was taken from it since.
        self.shared_seen = self.burst
        self.optimistic = 0.0
        #: Demand since the last exchange: tokens taken, and the largest request refused.
        self.taken = 0.0
        self.refused = 0.0
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
            self.refused = max(self.refused, amount)
            return False
        self.taken += amount
        return True

    def give_back(self, amount: float, now: float) -> None:
        self.tokens += amount

    def seconds_until(self, amount: float, now: float) -> float:
        return max(self._store.sync_interval_s, (amount - self.level(now)) / self.rate)

    # -- what the exchange does ------------------------------------------------------------------
    def request(self, interval: float) -> tuple[float, float]:
        """(want, returned) for the next exchange; clears the demand counters."""
        demand = max(self.taken, self.refused)
        target = min(self.burst, max(2.0 * demand, 2.0 * self.rate * interval if self.taken else 0.0))
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

    def settle(self, granted: float, left: float) -> None:
        self.tokens += granted
        self.shared_seen = left

    def recover(self) -> float:
        """Redis is back: what was admitted beyond the lease meanwhile, to charge to it."""
        spent, self.outage_spent, self.fallback, self.falling_back = self.outage_spent, 0.0, None, False
        return spent

    def unrequest(self, returned: float) -> None:
        """The exchange failed: keep what was to be returned or settled (a debt stays a debt)."""
        self.tokens += returned


class RedisStore:
    """See the module docstring. Built from ``[store]``; :meth:`run` does every exchange."""

    kind = "redis"

    def __init__(self, config: StoreConfig, replica_id: str | None = None) -> None:
        self.config = config
        self.sync_interval_s = config.sync_interval_s
        self.replica_id = replica_id or secrets.token_hex(6)
        self.available = False  # until the first exchange succeeds
        self.replicas = 1
        self._buckets: dict[str, LeasedBucket] = {}
        self._policy: SharedService | None = None
        self._service_seen: dict[str, float] | None = None
        self._outages = 0
        self._syncs = 0
        self._failures = 0
        self._keys = _Keys(config.key_prefix)

    # -- the seam --------------------------------------------------------------------------------
    def bucket(self, tenant_id: str, tenant: TenantConfig, now: float) -> LeasedBucket:
        bucket = LeasedBucket(tenant, self)
        old = self._buckets.get(tenant_id)
        if old is not None:  # a reload re-rated it: keep what this replica holds
            bucket.tokens, bucket.optimistic, bucket.shared_seen = old.tokens, old.optimistic, old.shared_seen
        self._buckets[tenant_id] = bucket
        return bucket

    def refusal(self) -> Refusal | None:
        if self.available or self.config.on_unavailable == "local":
            return None
        return Refusal(503, "store_unavailable", "the shared quota store (Redis) cannot be reached and this "
                       "replica's leases cannot cover the request ([store] on_unavailable = \"refuse\")",
                       headers={"Retry-After": "1"})

    def share(self, policy: object) -> None:
        if isinstance(policy, SharedService):
            policy.take_service()  # (starts its bookkeeping; it has given nothing shared yet)
            self._policy, self._service_seen = policy, None
        else:
            self._policy = None

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(kind=self.kind, available=self.available, outages=self._outages, syncs=self._syncs,
                               sync_failures=self._failures, replicas=self.replicas,
                               leased_tokens=sum(max(b.tokens, 0.0) for b in self._buckets.values()))

    # -- the exchange task ---------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        import coredis

        started = False
        try:
            while True:
                try:
                    client = coredis.Redis.from_url(self.config.url, decode_responses=True,
                                                    retry_policy=coredis.retry.NoRetryPolicy())
                    async with client:
                        lease = client.register_script(LEASE_SCRIPT)
                        service = client.register_script(SERVICE_SCRIPT)
                        while True:
                            with trio.fail_after(EXCHANGE_TIMEOUT_S):
                                await self._exchange(lease, service)
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
                await self._return_leases(coredis)

    async def _exchange(self, lease: Any, service: Any) -> None:
        recovering = not self.available
        asked: list[tuple[str, LeasedBucket, float]] = []
        keys, args = [], [str(BUCKET_TTL_S)]
        for name, bucket in self._buckets.items():
            debt = bucket.recover() if recovering else 0.0
            want, returned = bucket.request(self.sync_interval_s)
            returned -= debt
            if want or returned or recovering:
                asked.append((name, bucket, returned))
                keys.append(self._keys.bucket(name))
                args += [repr(bucket.rate), repr(bucket.burst), repr(want), repr(returned)]
        try:
            if keys:
                result = await lease(keys=keys, args=args)
                for i, (_, bucket, _) in enumerate(asked):
                    bucket.settle(float(result[2 * i]), float(result[2 * i + 1]))
                asked = []
            await self._exchange_service(service)
        except BaseException:
            for _, bucket, returned in asked:  # (not sent, or no answer: nothing granted, keep the returns)
                bucket.unrequest(returned)
            raise
        self._syncs += 1
        if recovering:
            if self._outages:
                log.warning("shared store %s reachable again: buckets and fair share are shared (%d replicas)",
                            self.config.url, self.replicas)
            else:
                log.info("shared store %s: buckets and fair share are shared (%d replicas)", self.config.url,
                         self.replicas)
            self.available = True

    async def _exchange_service(self, service: Any) -> None:
        given = self._policy.take_service() if self._policy is not None else {}
        args = [self.replica_id]
        for tenant, amount in given.items():
            args += [tenant, repr(amount)]
        result = await service(keys=[self._keys.service, self._keys.replicas], args=args)
        self.replicas = max(1, int(result[0]))
        totals = {result[i]: float(result[i + 1]) for i in range(1, len(result), 2)}
        if self._policy is not None:
            seen = self._service_seen if self._service_seen is not None else {}
            remote = {t: total - seen.get(t, 0.0) - given.get(t, 0.0) for t, total in totals.items()}
            self._policy.add_service({t: v for t, v in remote.items() if v})
            self._service_seen = totals

    def _unavailable(self, exc: BaseException) -> None:
        """An exchange failed: switch to ``on_unavailable`` (logged once per outage)."""
        self._failures += 1
        if self.available or (self._syncs == 0 and self._failures == 1):
            self._outages += 1
            log.warning("shared store %s unreachable (%s): %s", self.config.url, _describe(exc),
                        "admitting at this replica's share of each tenant's rate"
                        if self.config.on_unavailable == "local" else "refusing what leases cannot cover")
        self.available = False
        if self.config.on_unavailable == "local":
            for bucket in self._buckets.values():
                bucket.falling_back = True

    async def _return_leases(self, coredis: Any) -> None:
        """Give back what this replica holds (a clean stop); best effort, within a second."""
        if not self.available:
            return
        keys, args = [], [str(BUCKET_TTL_S)]
        for name, bucket in self._buckets.items():
            held = bucket.tokens - bucket.optimistic
            if held:
                keys.append(self._keys.bucket(name))
                args += [repr(bucket.rate), repr(bucket.burst), "0", repr(held)]
        if not keys:
            return
        with trio.move_on_after(1.0):
            try:
                client = coredis.Redis.from_url(self.config.url, decode_responses=True,
                                                retry_policy=coredis.retry.NoRetryPolicy())
                async with client:
                    await client.register_script(LEASE_SCRIPT)(keys=keys, args=args)
            except Exception as exc:
                log.warning("could not return leases to %s: %s", self.config.url, _describe(exc))


class _Keys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.service = f"{prefix}:service"
        self.replicas = f"{prefix}:replicas"

    def bucket(self, tenant: str) -> str:
        return f"{self.prefix}:bucket:{tenant}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _describe(exc.exceptions[0])
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__

