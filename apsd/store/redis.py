"""``[store] kind = "redis"``: buckets and fair-share totals shared by every replica through Redis.

:class:`RedisState` is the :class:`~apsd.store.leasing.SharedState` of
:class:`~apsd.store.leasing.LeasingStore` (whose docstring says what is exchanged, how accurate it
is, and what happens when Redis cannot be reached): two Lua scripts, each atomic on the Redis side,
over one coredis connection (coredis runs under trio through anyio). The scripts run by their SHA1
(``EVALSHA``); a Redis that does not have them (restarted, or ``SCRIPT FLUSH``) is sent them again
(``SCRIPT LOAD``), logged at DEBUG.

Logs: the store reports an outage and a recovery at WARNING, once each (:mod:`apsd.store.leasing`).
coredis's own lines about the same events ("Connection closed unexpectedly!", retries) are
demoted to DEBUG (:class:`QuietCoredis`); coredis logs some of them with ``exc_info=True``
outside any ``except`` block, which printed a bare ``NoneType: None`` under them, and that is
dropped.

Keys, under ``[store] key_prefix``: ``<prefix>:bucket:<tenant>`` (a hash: ``tokens`` and
``updated``, Redis's ``TIME``; it expires a day after its last exchange, and a tenant idle for
longer starts full), ``<prefix>:service`` (a hash: tenant -> weighted service given by every
replica), ``<prefix>:replicas`` (a sorted set: replica -> last seen), ``<prefix>:budget:<account>:<period>``
(a hash: a budget's spend in the period, and each replica's lease and settled total: ``BUDGET_SCRIPT``).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from apsd.core.budget import LEASE_TTL_S, BudgetAsk
from apsd.core.config import StoreConfig
from apsd.core.store import redis_bucket_key, redis_budget_key
from apsd.store.leasing import LeaseAsk, LeasingStore

__all__ = ["BUDGET_SCRIPT", "LEASE_SCRIPT", "QuietCoredis", "RedisState", "SERVICE_SCRIPT", "redis_store"]

log = logging.getLogger("apsd.store")

#: KEYS: one bucket per tenant. ARGV: ttl_s, then per tenant rate, burst, want, returned.
#: Returns per tenant: granted, tokens left in the bucket (as strings: Lua numbers are doubles).
#: An ask with nothing wanted or returned only reads: it writes nothing to a bucket that exists (the
#: stored tokens and their time stay valid); one that does not is created full, so that a replica's
#: later charge to it is not taken for a debt to a lost bucket.
LEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = tonumber(ARGV[1])
local out = {}
for i, key in ipairs(KEYS) do
  local rate, burst = tonumber(ARGV[4 * i - 2]), tonumber(ARGV[4 * i - 1])
  local want, returned = tonumber(ARGV[4 * i]), tonumber(ARGV[4 * i + 1])
  local state = redis.call('HMGET', key, 'tokens', 'updated')
  local writes = want ~= 0 or returned ~= 0 or not state[1]
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
  if writes then
    redis.call('HSET', key, 'tokens', tostring(tokens), 'updated', tostring(updated))
    redis.call('EXPIRE', key, ttl)
  end
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

#: KEYS: one budget account per tenant and period. ARGV: replica, lease TTL (s), key TTL (s), then per
#: account budget, settled, acknowledged, known_spent, holding, want, short (the fields of BudgetAsk).
#: Returns per account: granted, the period's spend, what is left unleased, what the other replicas seen
#: are short of (as strings).
#: The account is a hash: ``spent``; per replica ``settled:<id>`` (its settled total last counted),
#: ``lease:<id>`` (what it holds), ``short:<id>`` (what its refused requests need beyond its lease and
#: this grant; absent: 0) and ``seen:<id>`` (Redis's TIME at its last exchange); a replica not seen
#: for the lease TTL loses its lease, counted as spent (``presumed:<id>``) until it reports what it spent.
BUDGET_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local replica, lease_ttl, key_ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local out = {}
for i, key in ipairs(KEYS) do
  local b = 4 + 7 * (i - 1)
  local budget, settled, acked = tonumber(ARGV[b]), tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2])
  local known, holding, want = tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
  local short = tonumber(ARGV[b + 6])
  local others_short = 0
  local fields = {}
  local all = redis.call('HGETALL', key)
  for j = 1, #all, 2 do fields[all[j]] = all[j + 1] end
  -- (a Redis that lost it: written back. Only then: what a replica heard may hold a presumption its
  -- replica has since replaced by what it really spent)
  local spent = tonumber(fields['spent'] or '') or known
  local base = tonumber(fields['settled:' .. replica] or acked)
  local presumed = tonumber(fields['presumed:' .. replica] or '0')
  if presumed > 0 then  -- back after its lease was presumed spent: what it reports replaces the presumption
    spent = math.max(0, spent - presumed)
    redis.call('HDEL', key, 'presumed:' .. replica)
  end
  if settled > base then spent = spent + (settled - base) end
  local others = 0
  for name, value in pairs(fields) do
    if string.sub(name, 1, 5) == 'seen:' then
      local other = string.sub(name, 6)
      if other ~= replica then
        if now - tonumber(value) > lease_ttl then
          -- (a replica not seen may have spent its lease unreported: presumed spent until it reports)
          local lease = tonumber(fields['lease:' .. other] or '0')
          spent = spent + lease
          redis.call('HDEL', key, name, 'lease:' .. other, 'short:' .. other)
          redis.call('HSET', key, 'presumed:' .. other, tostring(tonumber(fields['presumed:' .. other] or '0') + lease))
        else
          others = others + tonumber(fields['lease:' .. other] or '0')
          others_short = others_short + tonumber(fields['short:' .. other] or '0')
        end
      end
    end
  end
  local unleased = budget - spent - others - holding
  local grant = 0
  if want > 0 and unleased > 0 then grant = math.min(want, unleased) end
  redis.call('HSET', key, 'spent', tostring(spent), 'settled:' .. replica, tostring(math.max(settled, base)),
             'lease:' .. replica, tostring(holding + grant), 'seen:' .. replica, tostring(now))
  if short - grant > 0 then
    redis.call('HSET', key, 'short:' .. replica, tostring(short - grant))
  else
    redis.call('HDEL', key, 'short:' .. replica)
  end
  redis.call('EXPIRE', key, key_ttl)
  out[4 * i - 3] = tostring(grant)
  out[4 * i - 2] = tostring(spent)
  out[4 * i - 1] = tostring(unleased - grant)
  out[4 * i] = tostring(others_short)
end
return out
"""

#: A budget account lives this long after its last exchange (longer than any period).
BUDGET_TTL_S = 40 * 86_400

#: A bucket key lives this long after its last exchange (a tenant idle for longer starts full).
BUCKET_TTL_S = 86_400


class QuietCoredis(logging.Filter):
    """On the ``coredis`` logger: every record at DEBUG (kept only when ``apsd.store`` logs DEBUG),
    without the empty traceback of an ``exc_info=True`` logged outside an ``except`` block. The store
    says what matters: an outage and a recovery, at WARNING, once each."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is None:
            record.exc_info, record.exc_text = None, None
        if record.levelno > logging.DEBUG:
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return log.isEnabledFor(logging.DEBUG)


_quiet_coredis = QuietCoredis()


class RedisState:
    """Redis at ``url``, keys under ``prefix``. Making one quiets the ``coredis`` logger
    (:class:`QuietCoredis`)."""

    def __init__(self, url: str, prefix: str) -> None:
        self.name = url
        self.prefix = prefix
        logging.getLogger("coredis").addFilter(_quiet_coredis)  # (once: a filter is added only once)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[_RedisSession]:
        import coredis  # (imported only when a Redis store is asked for)

        client = coredis.Redis.from_url(self.name, decode_responses=True, retry_policy=coredis.retry.NoRetryPolicy())
        async with client:
            yield _RedisSession(self.prefix, _Script(client, LEASE_SCRIPT), _Script(client, SERVICE_SCRIPT),
                                _Script(client, BUDGET_SCRIPT))


class _Script:
    """A Lua script run by its SHA1, and sent again to a Redis that lacks it (restarted, flushed)."""

    def __init__(self, client: Any, source: str) -> None:
        self._client, self._source = client, source
        self._sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, *, keys: Sequence[str], args: Sequence[str]) -> Any:
        from coredis.exceptions import NoScriptError

        try:
            return await self._client.evalsha(self._sha, keys=keys, args=args)
        except NoScriptError:
            log.debug("Redis does not have script %s (restarted or flushed): loading it", self._sha[:12])
        await self._client.script_load(self._source)
        return await self._client.evalsha(self._sha, keys=keys, args=args)


class _RedisSession:
    def __init__(self, prefix: str, lease: _Script, service: _Script, budget: _Script) -> None:
        self._prefix, self._lease, self._service, self._budget = prefix, lease, service, budget

    async def budget(self, replica: str, asks: Sequence[BudgetAsk]) -> list[tuple[float, int, float, float]]:
        args = [replica, repr(LEASE_TTL_S), str(BUDGET_TTL_S)]
        for ask in asks:
            args += [str(ask.budget), str(ask.settled), str(ask.acknowledged), str(ask.known_spent),
                     repr(ask.holding), repr(ask.want), repr(ask.short)]
        result = await self._budget(keys=[redis_budget_key(self._prefix, ask.account, ask.period) for ask in asks],
                                    args=args)
        return [(float(result[4 * i]), int(float(result[4 * i + 1])), float(result[4 * i + 2]),
                 float(result[4 * i + 3])) for i in range(len(asks))]

    async def lease(self, asks: Sequence[LeaseAsk]) -> list[tuple[float, float]]:
        args = [str(BUCKET_TTL_S)]
        for ask in asks:
            args += [repr(ask.rate), repr(ask.burst), repr(ask.want), repr(ask.returned)]
        result = await self._lease(keys=[redis_bucket_key(self._prefix, ask.tenant) for ask in asks], args=args)
        return [(float(result[2 * i]), float(result[2 * i + 1])) for i in range(len(asks))]

    async def service(self, replica: str, given: Mapping[str, float]) -> tuple[int, dict[str, float]]:
        args = [replica]
        for tenant, amount in given.items():
            args += [tenant, repr(amount)]
        result = await self._service(keys=[f"{self._prefix}:service", f"{self._prefix}:replicas"], args=args)
        return int(result[0]), {result[i]: float(result[i + 1]) for i in range(1, len(result), 2)}


def redis_store(config: StoreConfig) -> LeasingStore:
    """The store of ``[store] kind = "redis"``."""
    return LeasingStore(config, RedisState(config.url, config.key_prefix), kind="redis")
