"""Money and named keys across two replicas sharing a real ``redis-server``: a dollar budget held under
200 concurrent requests, keys with names, owners and limits made on one replica and used on both, their
usage per key, the audit log naming the admin key by name, and a budget alert sent once although both
replicas watch the budget. Daemons on 127.0.0.1:0 in this process; Redis and the stand-in backend and
webhook receiver started here, on free loopback ports."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio

from apsd.core.config import Config, TenantConfig
from apsd.serve.auth import hash_key
from tests.budget_spender import spend
from tests.helpers import (
    BUDGET_USD,
    FAST_GPU,
    PRICES,
    WAIT_S,
    LiveDaemon,
    backends_up,
    forwarding_config,
    infer_body,
    make_config,
    start_daemon,
    varied_length,
    wait_until,
)
from tests.redis_server import open_redis_server
from tests.standin_backend import start_standin_backend
from tests.webhook_receiver import open_webhook_receiver

# (on a loaded machine the replicas' exchanges with Redis time out now and then, and the clients wait for
# leases meanwhile: the budget holds all the same, the spending takes longer)
pytestmark = pytest.mark.timeout(480)

ADMIN = "alice-admin-key-" + "a" * 30


@contextlib.asynccontextmanager
async def two_replicas(config: Config) -> AsyncIterator[list[LiveDaemon]]:
    """Two daemons on ``config`` (which names the Redis store), both exchanging with it, stopped on exit."""
    async with trio.open_nursery() as nursery:
        running = [await start_daemon(nursery, config) for _ in range(2)]
        try:
            with trio.fail_after(WAIT_S):
                while any(d.daemon.pipeline.store.statistics().replicas < 2 for d in running):
                    await trio.sleep(0.02)
            yield running
        finally:
            for daemon in running:
                await daemon.client.aclose()
            nursery.cancel_scope.cancel()


def redis_sections(url: str) -> dict[str, Any]:
    return {"store": {"kind": "redis", "url": url, "key_prefix": "money"},
            "state": {"poll_interval_s": 0.1, "flush_interval_s": 0.1}}


async def test_two_replicas_hold_a_dollar_budget_within_2_percent_under_200_concurrent_requests(nursery):
    """200 clients at once, split between two replicas, spend a $0.36 budget leased through Redis (answers
    of 20-100 tokens against max_tokens 100): what was spent is within 2% of the budget, and both
    replicas report it."""
    backend = await start_standin_backend(nursery, varied_length)
    async with open_redis_server() as redis:
        # (two daemons, the stand-in and 200 clients share this process: on a loaded machine a health check
        # may wait long for its turn, which is not the backend being down)
        base = forwarding_config([backend.url], {}, max_concurrency=256, health_timeout_s=60.0)
        sections = redis_sections(redis.url)
        config = attrs.evolve(
            base, store=make_config(sections).store, state=make_config(sections).state, prices=PRICES,
            tenants={"team": TenantConfig(rate=1e9, burst=10**9, budget_usd=BUDGET_USD)})
        async with two_replicas(config) as daemons:
            for daemon in daemons:
                await wait_until(backends_up(daemon.daemon))
            spender = await spend([d.url for d in daemons], "team", limit_s=360)
            print(f"${BUDGET_USD} budget, 200 concurrent clients on two replicas sharing Redis: {spender.served} "
                  f"served, ${spender.spent:.6f} spent ({spender.spent / BUDGET_USD - 1:+.3%}); "
                  f"refusals {spender.refusals}")
            assert BUDGET_USD * 0.98 <= spender.spent <= BUDGET_USD * 1.02

            async def spent(daemon: LiveDaemon) -> float:
                return (await daemon.client.get("/admin/tenants/team")).json()["live"]["budget_usd"]["spent_usd"]

            with trio.fail_after(60):   # (each replica's next exchanges bring the other's spend)
                while any(abs(seen - spender.spent) > 1e-6 * spender.served for seen in [await spent(d) for d in daemons]):
                    await trio.sleep(0.1)


async def test_named_keys_with_limits_live_on_both_replicas_and_an_alert_is_sent_once(nursery):
    """An admin key named alice; a tenant with a dollar budget and a key named ci (owned by an agent,
    at most one request at a time, only the batch model) made through one replica: the key works on
    both, its usage per key is in Redis with its name, the audit log says alice did it, and the 80%
    alert reaches the webhook once, though both replicas watch the budget."""
    async with open_redis_server() as redis, open_webhook_receiver() as receiver:
        config = make_config({**redis_sections(redis.url), "auth": {"admin_keys": {"alice": hash_key(ADMIN)}},
                              "prices": {"apsd-batch": {"input_per_1m_usd": 100.0, "output_per_1m_usd": 1000.0}},
                              "alerts": {"webhook_url": receiver.url, "thresholds": [0.8]},
                              "server": {"port": 0}},
                             gpu=attrs.evolve(FAST_GPU, time_scale=1.0),
                             tenants={"from-the-file": TenantConfig(rate=1.0, burst=1)})
        admin = {"Authorization": f"Bearer {ADMIN}"}
        async with two_replicas(config) as (first, second):
            made = await first.client.post("/admin/tenants", headers=admin,
                                           json={"name": "team", "rate": 1e6, "burst": 10**6, "budget_usd": 0.104})
            assert made.status_code == 201, made.text
            issued = await first.client.post("/admin/tenants/team/keys", headers=admin, json={
                "name": "ci", "owner": "claude-code/ci", "owner_kind": "agent", "max_concurrency": 1,
                "models": ["apsd-batch"]})
            assert issued.status_code == 201, issued.text
            key = issued.json()
            assert (key["name"], key["owner"], key["owner_kind"], key["limits"]["max_concurrency"]) == (
                "ci", "claude-code/ci", "agent", 1)
            await wait_until(lambda: key["id"] in second.daemon.pipeline.config.keys, limit_s=10)
            assert second.daemon.pipeline.config.keys[key["id"]].limits.max_concurrency == 1
            auth = {"Authorization": f"Bearer {key['key']}"}
            served = 0
            for turn in range(30):   # (10 requests of $0.0104 spend the budget; leases may ask to wait)
                daemon = (first, second)[turn % 2]
                answer = await daemon.client.post("/infer", headers=auth, json=infer_body(None, "x" * 16, 10))
                if answer.status_code == 200:
                    served += 1
                    continue
                assert answer.status_code == 429, answer.text
                if answer.json()["error"] == "budget_exhausted":
                    break
                await trio.sleep(float(answer.headers["Retry-After"]))
            assert served == 10, answer.text
            (alert,) = await receiver.wait_for(1, 30)
            await trio.sleep(2.5)   # (both replicas checked again: no second delivery)
            assert len(receiver.received) == 1
            assert json.loads(alert.body)["threshold"] == 0.8 and json.loads(alert.body)["tenant"] == "team"

            async def key_rows(daemon: LiveDaemon) -> list[dict]:
                answer = await daemon.client.get("/admin/usage", headers=admin, params={"tenant": "team", "by": "key"})
                return answer.json()["rows"]

            with trio.fail_after(10):   # (both replicas' usage, through Redis)
                while sum(r["completed"] for r in await key_rows(second)) != 10:
                    await trio.sleep(0.1)
            rows = await key_rows(second)
            assert {(r["key"], r["key_name"]) for r in rows} == {(key["id"], "ci")}
            assert sum(r["spend_usd"] for r in rows) == pytest.approx(0.104)
            audit = (await second.client.get("/admin/audit", headers=admin)).json()["entries"]
            assert [(e["action"], e["actor"]) for e in audit[:2]] == [("key.issue", "admin:alice"),
                                                                      ("tenant.create", "admin:alice")]
            assert audit[0]["after"]["name"] == "ci" and audit[0]["after"]["owner"] == "claude-code/ci"
