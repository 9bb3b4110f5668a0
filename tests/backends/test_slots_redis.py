"""Backends' slots shared between replicas through a real redis-server (apsd/store/redis_slots.py): claims
are atomic across replicas, a replica preempts another's request by an order through Redis and gets its
slot, a dead replica's slots come back within seconds, and without Redis each keeps to its share.
(tests/backends/test_isolation_llama.py runs two replicas in front of a real llama-server.)"""

from __future__ import annotations

import contextlib

import pytest
import trio

from apsd.core.clock import ModelClock
from apsd.core.config import StoreConfig
from apsd.core.slots import Lease
from apsd.store.redis_slots import LEASE_TTL_S, RedisSlots
from tests.helpers import forwarding_config, start_daemon, wait_until
from tests.redis_server import open_redis_server
from tests.standin_backend import start_standin_backend, well_behaved

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def replicas(url: str, n: int):
    """``n`` slot tables on the same Redis, their tasks running, and the preempt orders each received."""
    orders: list[list[str]] = [[] for _ in range(n)]
    async with trio.open_nursery() as nursery:
        tables = []
        for i in range(n):
            table = RedisSlots(StoreConfig(kind="redis", url=url, sync_interval_s=0.02), ModelClock(), replica=f"r{i}")
            table.attach(["b"], orders[i].append, lambda: None)
            await nursery.start(table.run)
            tables.append(table)
        yield tables, orders
        nursery.cancel_scope.cancel()


def lease(table: RedisSlots, lease_id: str, tenant: str = "t", **fields) -> Lease:
    return Lease(lease_id, "b", tenant, table.replica, since=table.clock.now(), **fields)


async def claim(table: RedisSlots, new: Lease, capacity: int = 2, victim: Lease | None = None) -> bool:
    table.hold(new, victim)
    return await table.confirm(new, capacity, victim)


async def claim_victims_slot(claimant: RedisSlots, victim_id: str, orders: list[str], owner_acts) -> bool:
    """``claimant`` claims the slot of the lease ``victim_id`` (another replica's); once that replica's
    ``orders`` name it, ``owner_acts()`` (release or refuse) runs. The claim's result."""
    victim = next(l for l in claimant.leases("b") if l.lease_id == victim_id)
    newcomer = lease(claimant, "steady-0", "steady")
    result = []
    async with trio.open_nursery() as nursery:
        async def wait_claim():
            result.append(await claim(claimant, newcomer, victim=victim))
        nursery.start_soon(wait_claim)
        await wait_until(lambda: orders == [victim_id])
        owner_acts()
    return result[0]


async def test_replicas_together_never_exceed_a_backends_slots():
    async with open_redis_server() as redis, replicas(redis.url, 3) as (tables, _):
        granted = []

        async def try_claim(table, i):
            if await claim(table, lease(table, f"{table.replica}-{i}")):
                granted.append(table.replica)

        async with trio.open_nursery() as nursery:
            for table in tables:
                for i in range(3):
                    nursery.start_soon(try_claim, table, i)
        assert len(granted) == 2
        await wait_until(lambda: all(len(t.leases("b")) == 2 for t in tables))   # (each sees both)


async def test_a_replica_preempts_anothers_request_through_redis_and_gets_its_slot():
    async with open_redis_server() as redis, replicas(redis.url, 2) as ((one, two), orders):
        held = [lease(one, f"flood-{i}", "flood", started=True) for i in range(2)]
        for h in held:
            assert await claim(one, h)
        await wait_until(lambda: len(two.leases("b")) == 2)
        assert two.free("b", 2) == 0
        assert await claim_victims_slot(two, "flood-1", orders[0], lambda: one.release(held[1]))
        await wait_until(lambda: sorted(l.lease_id for l in one.leases("b")) == ["flood-0", "steady-0"])


async def test_a_victim_that_may_not_be_preempted_refuses_and_the_claim_gives_way():
    async with open_redis_server() as redis, replicas(redis.url, 2) as ((one, two), orders):
        for i in range(2):
            assert await claim(one, lease(one, f"flood-{i}", "flood"))
        await wait_until(lambda: len(two.leases("b")) == 2)
        refuse = lambda: one.abandon(next(l for l in one.leases("b") if l.lease_id == "flood-0"))
        assert not await claim_victims_slot(two, "flood-0", orders[0], refuse)
        assert not any(l.lease_id == "steady-0" for l in two.leases("b"))


async def test_a_dead_replicas_slots_come_back_within_seconds():
    async with open_redis_server() as redis, replicas(redis.url, 1) as ((survivor,), _):
        async with trio.open_nursery() as nursery:
            dead = RedisSlots(StoreConfig(kind="redis", url=redis.url, sync_interval_s=0.02), ModelClock(),
                              replica="dead")
            await nursery.start(dead.run)
            for i in range(2):
                assert await claim(dead, lease(dead, f"dead-{i}"))
            dead._release = None          # (it dies: it neither renews nor returns its leases)
            nursery.cancel_scope.cancel()
        assert not await claim(survivor, lease(survivor, "early"))
        start = trio.current_time()
        await wait_until(lambda: survivor.free("b", 2) == 2, limit_s=LEASE_TTL_S + 5)
        assert await claim(survivor, lease(survivor, "late"))
        assert trio.current_time() - start <= LEASE_TTL_S + 5


async def test_without_redis_each_replica_keeps_to_its_share_and_its_leases_come_back():
    async with open_redis_server() as redis, replicas(redis.url, 2) as ((one, two), _):
        await wait_until(lambda: one.replicas == 2)
        assert await claim(one, lease(one, "one-0"), capacity=4)
        redis.kill()
        await wait_until(lambda: not one.available)
        assert one.free("b", 4) == 1                      # (4 slots, 2 replicas: 2 each, one in use)
        assert await claim(one, lease(one, "one-1"), capacity=4)
        assert not await claim(one, lease(one, "one-2"), capacity=4)
        await redis.start()
        await wait_until(lambda: one.available and two.available)
        await wait_until(lambda: sorted(l.lease_id for l in two.leases("b")) == ["one-0", "one-1"])


async def test_two_daemons_count_two_replicas_in_their_shared_buckets_and_slots(nursery):
    """A daemon's shared buckets and shared slots name it alike in Redis's set of replicas: two
    daemons are two replicas to both (each share of a bucket or of a backend's slots is a half), not
    four (each would keep to a quarter while Redis is unreachable)."""
    backend = await start_standin_backend(nursery, well_behaved)
    async with open_redis_server() as redis, trio.open_nursery() as daemons:
        sections = {"store": {"kind": "redis", "url": redis.url, "sync_interval_s": 0.05}}
        config = forwarding_config([backend.url], {}, sections=sections)
        running = [await start_daemon(daemons, config) for _ in range(2)]
        pipelines = [r.daemon.pipeline for r in running]
        await wait_until(lambda: all(p.store.statistics().replicas >= 2 and p.slots.replicas >= 2 for p in pipelines))
        await trio.sleep(0.5)   # (10 exchanges more each)
        assert [(p.store.statistics().replicas, p.slots.replicas) for p in pipelines] == [(2, 2), (2, 2)]
        daemons.cancel_scope.cancel()
