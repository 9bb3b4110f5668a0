"""The state in Redis: what replicas sharing ``[store] kind = "redis"`` keep together.

The same Redis server and key prefix as the shared buckets (:mod:`apsd.store.redis`), which
already outlive a replica's restart there (so no bucket levels are saved here). Keys, under
``<prefix>:state:``:

* ``tenants`` and ``keys``: hashes of JSON records (by tenant name, by key id);
* ``audit``: a sorted set of JSON entries scored by their id, ``audit:seq`` the last id;
* ``version``: moved by every change to tenants or keys, which each replica polls;
* ``spend:<tenant>:<period>``: budget spend (expires 40 days after its last change);
* ``usage:<hour>:<row>``: a hash of usage fields per row (``<row>``: the JSON list of tenant, model,
  backend and, for requests with an issued key, its id), indexed by hour in ``usage:index``;
* ``alert:<account>:<period>:<threshold>``: a budget alert sent (set once by the first replica that
  sends it; expires after 40 days);
* ``restored``: set by the first replica that writes back what a Redis restarted without its data
  lost (the audit log and usage, from its copy: :mod:`apsd.state.keeper`).

Budgets' spend, with a shared store, is in the store's budget accounts (``<prefix>:budget:...``).

A change and its audit entries are written by one Lua script, atomically.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from coredis.tokens import PureToken

from apsd.core.store import redis_bucket_key, redis_budget_key
from apsd.state.dump import StateDump, audit_member
from apsd.state.records import (
    AuditEntry,
    UsageKey,
    audit_to_json,
    key_from_json,
    key_to_json,
    tenant_from_json,
    tenant_to_json,
)
from apsd.state.store import Change, DeleteTenant, PutKey, PutTenant, Snapshot, UsageRows

__all__ = ["RedisStateStore"]

WRITE_SCRIPT = """
local n = tonumber(ARGV[1])
local i = 2
for _ = 1, n do
  local op, name, record = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  if op == 'put_tenant' then redis.call('HSET', KEYS[1], name, record)
  elseif op == 'delete_tenant' then redis.call('HDEL', KEYS[1], name)
  else redis.call('HSET', KEYS[2], name, record) end
  i = i + 3
end
local entries = tonumber(ARGV[i])
i = i + 1
for _ = 1, entries do
  local id = redis.call('INCR', KEYS[4])
  redis.call('ZADD', KEYS[3], id, '{"entry_id": ' .. id .. string.sub(ARGV[i], 15))
  i = i + 1
end
return redis.call('INCR', KEYS[5])
"""

SPEND_TTL_S = 40 * 86_400
#: A shared budget account and a shared bucket live this long after their last change (as the shared
#: store keeps them: :mod:`apsd.store.redis`).
BUDGET_KEY_TTL_S = 40 * 86_400
BUCKET_KEY_TTL_S = 86_400

#: KEYS: a budget account; ARGV: tokens, TTL. Its spend is raised to ``tokens`` (never lowered).
RAISE_SPEND_SCRIPT = """
local spent = tonumber(redis.call('HGET', KEYS[1], 'spent') or '0')
if tonumber(ARGV[1]) > spent then redis.call('HSET', KEYS[1], 'spent', ARGV[1]) end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[2]))
return 1
"""

#: KEYS: the audit log, its last id. ARGV: the highest id about to be put back. Entries here at or
#: below it are renumbered after it, in order, and the last id moves past them.
MAKE_ROOM_SCRIPT = """
local top = tonumber(ARGV[1])
local seq = tonumber(redis.call('GET', KEYS[2]) or '0')
local here = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', top)
if seq < top then redis.call('SET', KEYS[2], top) end
for _, member in ipairs(here) do
  redis.call('ZREM', KEYS[1], member)
  local id = redis.call('INCR', KEYS[2])
  redis.call('ZADD', KEYS[1], id, '{"entry_id": ' .. id .. string.match(member, '^{"entry_id": %d+(.*)$'))
end
return #here
"""
#: Wall seconds to connect, and for each answer: a Redis that hangs makes an operation fail (an admin
#: write answers 503 ``state_unavailable``) rather than wait for ever.
TIMEOUT_S = 10.0


class RedisStateStore:
    kind = "redis"

    def __init__(self, url: str, prefix: str) -> None:
        self._url = url
        self.where = url.split("@")[-1]  # (no credentials in logs)
        self._prefix = prefix
        self._p = f"{prefix}:state"

    @asynccontextmanager
    async def _redis(self) -> AsyncIterator[Any]:
        """A connection for one operation. (Each opens its own: the keeper's operations come from
        several tasks, the admin API's handlers among them, and a coredis client's connection pool
        belongs to the task that opened it. They are rare: a poll a second, a flush every few.)"""
        import coredis

        async with coredis.Redis.from_url(self._url, decode_responses=True, connect_timeout=TIMEOUT_S,
                                          stream_timeout=TIMEOUT_S) as client:
            yield client

    async def load(self) -> Snapshot:
        async with self._redis() as redis:
            # the version first: a change written while the records are read leaves it behind them, and
            # the next poll reads them again (read after, it could hide that change for good)
            version = int(await redis.get(f"{self._p}:version") or 0)
            tenants = await redis.hgetall(f"{self._p}:tenants")
            keys = await redis.hgetall(f"{self._p}:keys")
        return Snapshot({name: tenant_from_json(json.loads(v)) for name, v in tenants.items()},
                        tuple(sorted((key_from_json(json.loads(v)) for v in keys.values()), key=lambda k: k.key_id)),
                        version)

    async def version(self) -> int:
        async with self._redis() as redis:
            return int(await redis.get(f"{self._p}:version") or 0)

    async def write(self, changes: Sequence[Change], audit: Sequence[AuditEntry]) -> None:
        args: list[str] = [str(len(changes))]
        for change in changes:
            match change:
                case PutTenant(record):
                    args += ["put_tenant", record.name, json.dumps(tenant_to_json(record))]
                case DeleteTenant(name):
                    args += ["delete_tenant", name, ""]
                case PutKey(record):
                    args += ["put_key", record.key_id, json.dumps(key_to_json(record))]
        args.append(str(len(audit)))
        for entry in audit:  # (entry_id first, as the script expects: it writes the real one there)
            fields = audit_to_json(entry)
            fields.pop("entry_id")
            args.append('{"entry_id": 0, ' + json.dumps(fields)[1:])
        keys = [f"{self._p}:{k}" for k in ("tenants", "keys", "audit", "audit:seq", "version")]
        async with self._redis() as redis:
            await redis.eval(WRITE_SCRIPT, keys=keys, args=args)

    async def audit(self, *, target: str | None = None, limit: int = 100,
                    before_id: int | None = None) -> list[AuditEntry]:
        found: list[AuditEntry] = []
        top = f"({before_id}" if before_id is not None else "+inf"
        async with self._redis() as redis:
            while len(found) < limit:
                batch = await redis.zrange(f"{self._p}:audit", top, "-inf", sortby=PureToken.BYSCORE, rev=True,
                                           offset=0, count=500)
                if not batch:
                    break
                for member in batch:
                    entry = AuditEntry(**json.loads(member))
                    if target is None or entry.target == target:
                        found.append(entry)
                    top = f"({entry.entry_id}"
        return found[:limit]

    async def save_buckets(self, levels: Mapping[str, tuple[float, float]]) -> None:
        """Nothing: the shared buckets live in Redis already."""

    async def load_buckets(self) -> dict[str, tuple[float, float]]:
        return {}

    async def add_spend(self, deltas: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], int]:
        totals: dict[tuple[str, str], int] = {}
        if not deltas:
            return totals
        async with self._redis() as redis:
            for (tenant, period), tokens in deltas.items():
                key = f"{self._p}:spend:{tenant}:{period}"
                totals[(tenant, period)] = int(await redis.incrby(key, int(tokens)))
                await redis.expire(key, SPEND_TTL_S)
        return totals

    async def spend(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
        if not keys:
            return {}
        async with self._redis() as redis:
            return {(tenant, period): int(await redis.get(f"{self._p}:spend:{tenant}:{period}") or 0)
                    for tenant, period in keys}

    def _row_key(self, key: UsageKey) -> str:
        names = [key.tenant, key.model, key.backend] + ([key.key] if key.key else [])
        return f"{self._p}:usage:{key.hour}:{json.dumps(names)}"

    async def add_usage(self, rows: UsageRows) -> None:
        if not rows:
            return
        async with self._redis() as redis, redis.pipeline(transaction=True) as pipe:
            for key, fields in rows.items():
                row = self._row_key(key)
                for field, amount in fields.items():
                    pipe.hincrbyfloat(row, field, float(amount))
                pipe.zadd(f"{self._p}:usage:index", {row: key.hour})

    async def usage(self, *, tenant: str | None, start: int, end: int) -> dict[UsageKey, dict[str, float]]:
        found: dict[UsageKey, dict[str, float]] = {}
        prefix = f"{self._p}:usage:"
        async with self._redis() as redis:
            rows = await redis.zrange(f"{self._p}:usage:index", start, f"({end}", sortby=PureToken.BYSCORE)
            for row in rows:
                hour, names = row[len(prefix):].split(":", 1)
                name, model, backend, *key = json.loads(names)   # (a row of no issued key has three names)
                if tenant is not None and name != tenant:
                    continue
                fields = await redis.hgetall(row)
                found[UsageKey(int(hour), name, model, backend, key[0] if key else "")] = {
                    f: float(v) for f, v in fields.items()}
        return found

    async def prune(self, *, usage_before: int | None, audit_before: float | None) -> None:
        async with self._redis() as redis:
            if usage_before is not None:
                old = await redis.zrange(f"{self._p}:usage:index", "-inf", f"({usage_before}",
                                         sortby=PureToken.BYSCORE)
                if old:
                    await redis.delete(old)
                    await redis.zrem(f"{self._p}:usage:index", old)
            if audit_before is not None:
                while batch := await redis.zrange(f"{self._p}:audit", "-inf", "+inf", sortby=PureToken.BYSCORE,
                                                  offset=0, count=200):
                    stale = [m for m in batch if json.loads(m)["at"] < audit_before]
                    if stale:
                        await redis.zrem(f"{self._p}:audit", stale)
                    if len(stale) < len(batch):
                        break

    # -- the whole state (apsd state export / import), and writing back what Redis lost -------------
    async def dump(self) -> StateDump:
        snapshot = await self.load()
        audit = await self.audit_after(0)
        usage = await self.usage(tenant=None, start=0, end=2**62)
        spend: dict[tuple[str, str], int] = {}
        buckets: dict[str, tuple[float, float]] = {}
        async with self._redis() as redis:
            async for key in redis.scan_iter(match=f"{self._p}:spend:*"):
                tenant, period = key[len(self._p) + 7:].rsplit(":", 1)
                spend[(tenant, period)] = int(await redis.get(key) or 0)
            budgets = self._prefix + ":budget:"
            async for key in redis.scan_iter(match=budgets + "*"):
                tenant, period = key[len(budgets):].rsplit(":", 1)
                spent = int(float(await redis.hget(key, "spent") or 0))
                spend[(tenant, period)] = max(spend.get((tenant, period), 0), spent)
            bucket = self._prefix + ":bucket:"
            async for key in redis.scan_iter(match=bucket + "*"):
                tokens, updated = await redis.hmget(key, ["tokens", "updated"])
                if tokens is not None and updated is not None:
                    buckets[key[len(bucket):]] = (float(tokens), float(updated))
        return StateDump(tuple(snapshot.tenants.values()), snapshot.keys, tuple(audit), usage, spend, buckets)

    async def import_dump(self, dump: StateDump) -> None:
        """Add ``dump`` to this state: its tenants and keys (replacing those of the same name or id, in
        one change that replicas see), its audit entries with their ids (entries here that would
        collide move after them), its usage added, each budget's spend raised to the dump's (the
        shared budgets' accounts), and the bucket levels of tenants whose shared bucket does not exist."""
        await self.write([PutTenant(r) for r in dump.tenants] + [PutKey(k) for k in dump.keys], [])
        await self.restore_audit(dump.audit)
        await self.add_usage(dump.usage)
        async with self._redis() as redis:
            for (tenant, period), tokens in dump.spend.items():
                await redis.eval(RAISE_SPEND_SCRIPT, keys=[redis_budget_key(self._prefix, tenant, period)],
                                 args=[str(tokens), str(BUDGET_KEY_TTL_S)])
            for tenant, (level, at) in dump.buckets.items():
                key = redis_bucket_key(self._prefix, tenant)
                if not await redis.exists([key]):
                    await redis.hset(key, {"tokens": repr(level), "updated": repr(at)})
                    await redis.expire(key, BUCKET_KEY_TTL_S)

    async def audit_after(self, entry_id: int, limit: int | None = None) -> list[AuditEntry]:
        """Entries whose id is above ``entry_id``, oldest first (at most ``limit``)."""
        async with self._redis() as redis:
            members = await redis.zrange(f"{self._p}:audit", f"({entry_id}", "+inf", sortby=PureToken.BYSCORE,
                                         **({"offset": 0, "count": limit} if limit else {}))
        return [AuditEntry(**json.loads(member)) for member in members]

    async def restore_audit(self, entries: Sequence[AuditEntry]) -> None:
        """Put ``entries`` back with their ids; the entries already here whose ids they would take (a
        Redis that lost its data numbers from 1 again) are moved after them first, in order."""
        if not entries:
            return
        top = max(e.entry_id for e in entries)
        async with self._redis() as redis:
            await redis.eval(MAKE_ROOM_SCRIPT, keys=[f"{self._p}:audit", f"{self._p}:audit:seq"], args=[str(top)])
            for start in range(0, len(entries), 500):
                chunk = entries[start:start + 500]
                await redis.zadd(f"{self._p}:audit", {audit_member(e): e.entry_id for e in chunk})

    async def claim_alert(self, account: str, period: str, threshold: float, at: float) -> bool:
        """Whether this call is the first, of every replica's, to claim the alert of ``account`` at
        ``threshold`` in ``period`` (a key set once, kept 40 days)."""
        async with self._redis() as redis:
            return bool(await redis.set(f"{self._p}:alert:{account}:{period}:{threshold!r}", repr(at),
                                        condition=PureToken.NX, ex=SPEND_TTL_S))

    async def claim_restore(self) -> bool:
        """Whether this call is the first to write back into this Redis's data since it lost them (a
        marker no replica's write-back finds but the first)."""
        async with self._redis() as redis:
            return bool(await redis.set(f"{self._p}:restored", "1", condition=PureToken.NX))

    async def close(self) -> None:
        """Nothing: every operation closes its own connection."""
