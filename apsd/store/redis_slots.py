"""Backends' slots shared by every replica through Redis: the :class:`~apsd.core.slots.SlotTable` of
``[store] kind = "redis"``.

Each backend's slots are one Redis hash, ``<prefix>:slots:<backend>``: a field per lease (a running
request's hold on a slot), its value the lease's replica, tenant, start (Redis's ``TIME``), whether it
has a first token, may be preempted, how often it was, and its expiry. Every change is a Lua script,
atomic in Redis:

* **claim** a slot: granted if the hash holds fewer leases than the backend's ``max_concurrency``;
  else, naming a *victim* (a lease the engine chose to preempt, :mod:`apsd.engines.preemption`), the
  claim is recorded on the victim (its slot passes to the claimant when it is released) and the
  victim's replica is ordered to preempt it; else refused. A claim not granted reads back the
  backend's leases (a full table: the claimant chooses its next victim among them).
* **release** a lease: its slot is free, or passes to the lease recorded on it.
* **renew** this replica's leases (their expiry, and what the others need to choose victims: first
  token, preemptible, preemptions), every ``[store] sync_interval_s``, reading back every backend's
  leases: what this replica knows of the others' is at most that old, or as new as its last refused claim.

Leases expire :data:`LEASE_TTL_S` after their replica last renewed them: a replica that dies gives its
slots back within seconds (and a claim recorded on one of them is granted then). Orders (preempt this
lease; your claim is granted, or refused) go to each replica's list ``<prefix>:orders:<replica>``,
which it reads with a blocking pop on a connection of its own, so an order arrives within a round trip.

Redis unavailable: each replica keeps to its share of every backend's slots (``max_concurrency``
divided by the replicas last seen, at least one), and preempts only its own requests; its leases are
written back when Redis is reachable again. Logged as the store's outages are.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import trio

from apsd.core.clock import ModelClock
from apsd.core.config import StoreConfig
from apsd.core.slots import Lease
from apsd.store.redis import _quiet_coredis, _Script

__all__ = ["LEASE_TTL_S", "RedisSlots"]

log = logging.getLogger("apsd.store")

#: Seconds a lease outlives its replica's last renewal.
LEASE_TTL_S = 3.0
#: Seconds a claim waits for a preempted victim's slot before it gives up (the victim's lease expires
#: first if its replica died).
GRANT_TIMEOUT_S = 5.0
#: Seconds a Redis call may take before Redis counts as unavailable.
CALL_TIMEOUT_S = 1.0

_COMMON = """
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function grant(key, heir, t, ttl, orders)
  local id = heir.id
  heir.id = nil
  heir.s = t
  heir.x = t + ttl
  redis.call('HSET', key, id, cjson.encode(heir))
  redis.call('RPUSH', orders .. heir.r, cjson.encode({granted = id}))
  return id
end
local function sweep(key, t, ttl, orders)
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local rec = cjson.decode(all[i + 1])
    if rec.x < t then
      redis.call('HDEL', key, all[i])
      if rec.y then grant(key, rec.y, t, ttl, orders) end
    end
  end
end
local function view(key, t)
  local all = redis.call('HGETALL', key)
  local out = {}
  for i = 1, #all, 2 do
    local r = cjson.decode(all[i + 1])
    for _, v in ipairs({all[i], r.r, r.t, tostring(t - r.s), tostring(r.st), tostring(r.p), tostring(r.n),
                        r.y and '1' or '0', tostring(r.c or 0)}) do
      out[#out + 1] = v
    end
  end
  return out
end
"""

#: KEYS: the backend's hash. ARGV: capacity, ttl, orders prefix, lease id, record, victim id ('' none).
#: Returns the status (granted, pending, refused), then, unless granted, the hash's leases (9 fields a
#: lease, as RENEW_SCRIPT's): what the claimant needs to choose a victim next time. A granted claim
#: reads nothing back: under hundreds of concurrent claims, sending every one the whole table made each
#: answer O(leases) to parse, and the exchanges timed out. Expired leases are swept only from a full hash.
CLAIM_SCRIPT = _COMMON + """
local key, t = KEYS[1], now()
local cap, ttl, orders = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
if redis.call('HLEN', key) >= cap then sweep(key, t, ttl, orders) end
local rec = cjson.decode(ARGV[5])
local status = 'refused'
if redis.call('HEXISTS', key, ARGV[4]) == 1 then
  status = 'granted'
elseif redis.call('HLEN', key) < cap then
  rec.s = t
  rec.x = t + ttl
  redis.call('HSET', key, ARGV[4], cjson.encode(rec))
  status = 'granted'
elseif ARGV[6] ~= '' then
  local v = redis.call('HGET', key, ARGV[6])
  if v then
    local victim = cjson.decode(v)
    if not victim.y then
      rec.id = ARGV[4]
      victim.y = rec
      redis.call('HSET', key, ARGV[6], cjson.encode(victim))
      if victim.r ~= rec.r then redis.call('RPUSH', orders .. victim.r, cjson.encode({preempt = ARGV[6]})) end
      status = 'pending'
    end
  end
end
if status == 'granted' then return {status} end
local out = view(key, t)
table.insert(out, 1, status)
return out
"""

#: KEYS: the backend's hash. ARGV: ttl, orders prefix, lease id. Returns the id of the lease its slot
#: passed to ('' none). (Expired leases are swept by claims on a full hash and by every renewal.)
RELEASE_SCRIPT = _COMMON + """
local key, t = KEYS[1], now()
local ttl, orders = tonumber(ARGV[1]), ARGV[2]
local heir = ''
local v = redis.call('HGET', key, ARGV[3])
if v then
  redis.call('HDEL', key, ARGV[3])
  local rec = cjson.decode(v)
  if rec.y then heir = grant(key, rec.y, t, ttl, orders) end
end
return heir
"""

#: KEYS: the backends' hashes, then the replicas' sorted set. ARGV: replica, ttl, orders prefix, then per
#: lease of this replica: its backend's index (1-based), id, record (with ``a``: its age in seconds).
#: Returns the replicas seen in the last LEASE_TTL_S, then per backend the count of its fields, then them
#: (9 a lease: id, replica, tenant, age, started, preemptible, preemptions, claimed, class ttft_s or 0).
RENEW_SCRIPT = _COMMON + """
local t = now()
local replica, ttl, orders = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local n = #KEYS - 1
for i = 4, #ARGV, 3 do
  local key = KEYS[tonumber(ARGV[i])]
  local rec = cjson.decode(ARGV[i + 2])
  local v = redis.call('HGET', key, ARGV[i + 1])
  if v then
    local old = cjson.decode(v)
    old.x, old.st, old.p, old.n = t + ttl, rec.st, rec.p, rec.n
    redis.call('HSET', key, ARGV[i + 1], cjson.encode(old))
  else
    rec.s = t - rec.a
    rec.a = nil
    rec.x = t + ttl
    redis.call('HSET', key, ARGV[i + 1], cjson.encode(rec))
  end
end
local replicas = KEYS[#KEYS]
redis.call('ZADD', replicas, t, replica)
redis.call('ZREMRANGEBYSCORE', replicas, '-inf', t - ttl)
local out = {tostring(redis.call('ZCARD', replicas))}
for k = 1, n do
  sweep(KEYS[k], t, ttl, orders)
  local leases = view(KEYS[k], t)
  out[#out + 1] = tostring(#leases)
  for _, v in ipairs(leases) do out[#out + 1] = v end
end
return out
"""

#: KEYS: the backend's hash. ARGV: orders prefix, victim id, heir id ('' any). The claim recorded on the
#: victim is dropped (and its claimant told so, when the victim refuses: heir ''); a granted heir's lease
#: is released too. Returns 1 if a claim was dropped.
WITHDRAW_SCRIPT = _COMMON + """
local key = KEYS[1]
local v = redis.call('HGET', key, ARGV[2])
local dropped = 0
if v then
  local victim = cjson.decode(v)
  if victim.y and (ARGV[3] == '' or victim.y.id == ARGV[3]) then
    if ARGV[3] == '' then redis.call('RPUSH', ARGV[1] .. victim.y.r, cjson.encode({refused = victim.y.id})) end
    victim.y = nil
    redis.call('HSET', key, ARGV[2], cjson.encode(victim))
    dropped = 1
  end
end
if ARGV[3] ~= '' then redis.call('HDEL', key, ARGV[3]) end
return dropped
"""

#: A remote lease whose slot is already claimed (it is no victim for anyone else).
_CLAIMED = Lease("", "", "", "", 0.0)


def _record(lease: Lease) -> dict[str, Any]:
    return {"r": lease.replica, "t": lease.tenant, "st": int(lease.started), "p": int(lease.preemptible),
            "n": lease.preemptions, "c": lease.ttft_s if math.isfinite(lease.ttft_s) else 0}


@attrs.define(eq=False)
class RedisSlots:
    """A :class:`~apsd.core.slots.SlotTable` in Redis (see the module docstring)."""

    config: StoreConfig
    clock: ModelClock
    replica: str = attrs.field(factory=lambda: f"replica-{secrets.token_hex(4)}")
    #: This replica's leases by backend (held, and confirmed once ``granted`` is set).
    _own: dict[str, dict[str, Lease]] = attrs.field(factory=dict, init=False)
    #: The others' leases by backend, as last read.
    _remote: dict[str, list[Lease]] = attrs.field(factory=dict, init=False)
    #: Backends this replica has seen (renewed and read every interval).
    _backends: dict[str, None] = attrs.field(factory=dict, init=False)
    available: bool = attrs.field(default=False, init=False)
    replicas: int = attrs.field(default=1, init=False)
    outages: int = attrs.field(default=0, init=False)
    _claim: Any = attrs.field(default=None, init=False)
    _release: Any = attrs.field(default=None, init=False)
    _renew: Any = attrs.field(default=None, init=False)
    _withdraw: Any = attrs.field(default=None, init=False)
    _ops_send: trio.MemorySendChannel[tuple[str, Lease]] | None = attrs.field(default=None, init=False)
    _on_preempt: Callable[[str], None] = attrs.field(default=lambda lease_id: None, init=False)
    _on_change: Callable[[], None] = attrs.field(default=lambda: None, init=False)

    def __attrs_post_init__(self) -> None:
        logging.getLogger("coredis").addFilter(_quiet_coredis)

    @property
    def name(self) -> str:
        return self.config.url.split("@")[-1]

    def _key(self, backend: str) -> str:
        return f"{self.config.key_prefix}:slots:{backend}"

    @property
    def _orders(self) -> str:
        return f"{self.config.key_prefix}:orders:"

    def attach(self, backends: Sequence[str], on_preempt: Callable[[str], None], on_change: Callable[[], None]) -> None:
        for backend in backends:
            self._backends.setdefault(backend, None)
        self._on_preempt, self._on_change = on_preempt, on_change

    # -- the view (synchronous) ------------------------------------------------------------------
    def leases(self, backend: str) -> Sequence[Lease]:
        own = self._own.get(backend)
        remote = self._remote.get(backend, []) if self.available else []
        return [*own.values(), *remote] if own else list(remote)

    def free(self, backend: str, capacity: int) -> int:
        self._backends.setdefault(backend, None)
        own = len(self._own.get(backend, ()))
        if not self.available:   # (its share of the slots, alone)
            return max(0, max(1, capacity // max(1, self.replicas)) - own)
        return max(0, capacity - own - len(self._remote.get(backend, ())))

    def hold(self, lease: Lease, victim: Lease | None = None) -> None:
        self._backends.setdefault(lease.backend, None)
        self._own.setdefault(lease.backend, {})[lease.lease_id] = lease
        if victim is not None:
            victim.yield_to = lease

    def update(self, lease: Lease) -> None:
        pass   # (sent with the next renewal)

    def release(self, lease: Lease) -> None:
        held = self._own.get(lease.backend)
        if held is not None:
            held.pop(lease.lease_id, None)
        heir, lease.yield_to = lease.yield_to, None
        if not lease.granted.is_set():   # (never the slot's: nothing to give back in Redis)
            lease.granted.set()
            lease.refused = True
            return
        if self.available and self._ops_send is not None:
            self._ops_send.send_nowait(("release", lease))
        elif heir is not None:   # (Redis unavailable: a slot of this replica's share passes at once)
            heir.granted.set()

    def abandon(self, lease: Lease) -> None:
        heir, lease.yield_to = lease.yield_to, None
        if heir is not None and not heir.granted.is_set():   # (a claim of this replica's)
            heir.refused = True
            heir.granted.set()
        if self.available and self._ops_send is not None:
            self._ops_send.send_nowait(("abandon", lease))

    # -- claims --------------------------------------------------------------------------------
    async def confirm(self, lease: Lease, capacity: int, victim: Lease | None = None) -> bool:
        if not self.available:
            return await self._confirm_alone(lease, capacity, victim)
        try:
            with trio.fail_after(CALL_TIMEOUT_S):
                result = await self._claim(keys=[self._key(lease.backend)], args=[
                    str(capacity), repr(LEASE_TTL_S), self._orders, lease.lease_id, json.dumps(_record(lease)),
                    victim.lease_id if victim is not None else ""])
        except Exception as exc:   # (unreachable, timed out: this replica goes on alone)
            self._unavailable(exc)
            return await self._confirm_alone(lease, capacity, victim)
        status = result[0]
        if status != "granted":   # (the table as it is: the others hold every slot)
            self._read(lease.backend, result[1:])
        if status == "granted":
            lease.granted.set()
        elif status == "refused":
            self._drop(lease)
            return False
        with trio.move_on_after(GRANT_TIMEOUT_S) as waited:
            await lease.granted.wait()
        if waited.cancelled_caught or lease.refused:
            self._drop(lease)
            if waited.cancelled_caught and victim is not None and self._ops_send is not None:
                self._ops_send.send_nowait(("withdraw", attrs.evolve(lease, yield_to=victim)))
            return False
        return True

    async def _confirm_alone(self, lease: Lease, capacity: int, victim: Lease | None) -> bool:
        """Redis unavailable: this replica's share of the slots, and its own victims only."""
        if victim is not None and victim.replica == self.replica:
            with trio.move_on_after(GRANT_TIMEOUT_S):
                await lease.granted.wait()
            if lease.granted.is_set() and not lease.refused:
                return True
        elif victim is None and len(self._own.get(lease.backend, ())) <= max(1, capacity // max(1, self.replicas)):
            lease.granted.set()
            return True
        self._drop(lease)
        return False

    def _drop(self, lease: Lease) -> None:
        held = self._own.get(lease.backend)
        if held is not None:
            held.pop(lease.lease_id, None)
        lease.refused = True
        lease.granted.set()

    # -- reading Redis's answers -------------------------------------------------------------------
    def _read(self, backend: str, flat: Sequence[str]) -> None:
        """The others' leases on ``backend`` from a script's answer (9 fields a lease)."""
        now = self.clock.now()
        remote = []
        for i in range(0, len(flat), 9):
            lease_id, replica, tenant, age, started, preemptible, preemptions, claimed, ttft = flat[i:i + 9]
            if replica == self.replica:
                continue
            lease = Lease(lease_id, backend, tenant, replica, since=now - float(age), started=started == "1",
                          preemptible=preemptible == "1", preemptions=int(preemptions),
                          ttft_s=float(ttft) if float(ttft) > 0 else math.inf)
            if claimed == "1":
                lease.yield_to = _CLAIMED
            remote.append(lease)
        before = len(self._remote.get(backend, ()))
        self._remote[backend] = remote
        if len(remote) < before:
            self._on_change()   # (slots another replica held are free now)

    # -- the background task -------------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew and read the table every ``sync_interval_s``, carry out releases, read this replica's
        orders; reconnect after an outage. Until cancelled; then this replica's leases are released."""
        import coredis  # (imported only when a Redis store is asked for)

        send, receive = trio.open_memory_channel[tuple[str, Lease]](math.inf)   # (never blocks a request's end)
        self._ops_send = send
        started = False
        while True:
            try:
                client = coredis.Redis.from_url(self.config.url, decode_responses=True,
                                                retry_policy=coredis.retry.NoRetryPolicy())
                listener = coredis.Redis.from_url(self.config.url, decode_responses=True,
                                                  retry_policy=coredis.retry.NoRetryPolicy())
                async with client, listener:
                    try:
                        self._claim, self._release = _Script(client, CLAIM_SCRIPT), _Script(client, RELEASE_SCRIPT)
                        self._renew, self._withdraw = _Script(client, RENEW_SCRIPT), _Script(client, WITHDRAW_SCRIPT)
                        with trio.fail_after(CALL_TIMEOUT_S):
                            await self._renew_now()
                        self._recovered()
                        if not started:
                            task_status.started()
                            started = True
                        async with trio.open_nursery() as nursery:
                            nursery.start_soon(self._serve_ops, receive)
                            nursery.start_soon(self._serve_orders, listener)
                            while True:
                                await trio.sleep(self.config.sync_interval_s)
                                with trio.fail_after(CALL_TIMEOUT_S):
                                    await self._renew_now()
                    finally:
                        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                            await self._release_all()
            except Exception as exc:
                self._unavailable(exc)
                if not started:
                    task_status.started()
                    started = True
                await trio.sleep(self.config.sync_interval_s)

    async def _renew_now(self) -> None:
        backends = list(self._backends)
        index = {name: i for i, name in enumerate(backends, start=1)}
        now = self.clock.now()
        args = [self.replica, repr(LEASE_TTL_S), self._orders]
        for backend, held in self._own.items():
            for lease in held.values():
                if lease.granted.is_set() and not lease.refused:
                    args += [str(index[backend]), lease.lease_id,
                             json.dumps({**_record(lease), "a": max(0.0, now - lease.since)})]
        keys = [*(self._key(b) for b in backends), f"{self.config.key_prefix}:replicas"]
        result = await self._renew(keys=keys, args=args)
        self.replicas = max(1, int(result[0]))
        at = 1
        for backend in backends:
            count = int(result[at])
            self._read(backend, result[at + 1:at + 1 + count])
            at += 1 + count

    async def _serve_ops(self, receive: trio.MemoryReceiveChannel[tuple[str, Lease]]) -> None:
        async for op, lease in receive:
            key = self._key(lease.backend)
            with trio.fail_after(CALL_TIMEOUT_S):
                if op == "release":
                    self._granted(await self._release(keys=[key], args=[repr(LEASE_TTL_S), self._orders,
                                                                         lease.lease_id]))
                elif op == "abandon":
                    await self._withdraw(keys=[key], args=[self._orders, lease.lease_id, ""])
                else:   # withdraw: a claimant that gave up waiting
                    assert lease.yield_to is not None
                    await self._withdraw(keys=[key], args=[self._orders, lease.yield_to.lease_id, lease.lease_id])

    async def _serve_orders(self, listener: Any) -> None:
        key = f"{self._orders}{self.replica}"
        while True:
            popped = await listener.blpop([key], timeout=1)
            if not popped:
                continue
            order = json.loads(popped[1])
            if "preempt" in order:
                self._on_preempt(order["preempt"])
            elif "granted" in order:
                self._granted(order["granted"])
            elif "refused" in order:
                for held in self._own.values():
                    lease = held.get(order["refused"])
                    if lease is not None and not lease.granted.is_set():
                        lease.refused = True
                        lease.granted.set()

    def _granted(self, lease_id: str) -> None:
        if not lease_id:
            return
        for held in self._own.values():
            lease = held.get(lease_id)
            if lease is not None:
                lease.granted.set()

    async def _release_all(self) -> None:
        """On the way out (cancelled, or Redis failed): return this replica's leases, if Redis answers."""
        if self._release is None or not self.available:
            return
        try:
            for backend, held in list(self._own.items()):
                for lease in list(held.values()):
                    if lease.granted.is_set() and not lease.refused:
                        await self._release(keys=[self._key(backend)], args=[repr(LEASE_TTL_S), self._orders,
                                                                             lease.lease_id])
        except Exception:
            pass   # (they expire within LEASE_TTL_S)

    def _unavailable(self, exc: BaseException) -> None:
        if self.available or not self.outages:
            log.warning("shared slots in %s unreachable (%s): each replica keeps to its share of every "
                        "backend's slots", self.name, type(exc).__name__)
            self.outages += 1
        self.available = False
        for held in self._own.values():   # (claims waiting on Redis are refused: their requests go back)
            for lease in held.values():
                if not lease.granted.is_set():
                    lease.refused = True
                    lease.granted.set()

    def _recovered(self) -> None:
        if not self.available and self.outages:
            log.warning("shared slots in %s reachable again (%d replicas)", self.name, self.replicas)
        self.available = True
        self._on_change()

