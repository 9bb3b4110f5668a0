"""Two replicas sharing a real Redis: a tenant, a key, a revocation and usage made on one are
live on the other, with no reload."""

from __future__ import annotations

import httpx
import trio

from apsd.serve.auth import hash_key
from tests.backends.test_store import replicas, store_config
from tests.helpers import infer_body, wait_until
from tests.redis_server import open_redis_server

ADMIN = "admin-key-" + "r" * 30
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}


async def test_two_replicas_share_tenants_keys_audit_and_usage_through_redis():
    async with open_redis_server() as redis:
        config = store_config(redis.url, {"team-a": {"rate": 1e4, "burst": 10_000}},
                              auth={"admin_key_hashes": [hash_key(ADMIN)]},
                              state={"poll_interval_s": 0.1, "flush_interval_s": 0.1})
        async with replicas(config, 2) as (first, second):
            assert first.daemon.keeper.store.kind == "redis"
            made = await first.client.post("/admin/tenants", headers=ADMIN_HEADERS,
                                            json={"name": "team-b", "rate": 1e4, "burst": 10_000})
            assert made.status_code == 201
            key = (await first.client.post("/admin/tenants/team-b/keys", headers=ADMIN_HEADERS, json={})).json()
            await wait_until(lambda: "team-b" in second.daemon.pipeline.config.tenants
                             and hash_key(key["key"]) in second.daemon.pipeline.config.tenants["team-b"].api_key_hashes,
                             limit_s=10)
            auth = {"Authorization": f"Bearer {key['key']}"}
            for daemon in (first, second, second):
                answer = await daemon.client.post("/infer", headers=auth, json=infer_body(None))
                assert answer.status_code == 200, answer.text

            async def usage_rows() -> list[dict]:
                answer = await first.client.get("/admin/usage", headers=ADMIN_HEADERS, params={"tenant": "team-b"})
                return answer.json()["rows"]

            with trio.fail_after(10):  # the second replica's usage reaches the first through Redis
                while sum(r["completed"] for r in await usage_rows()) != 3:
                    await trio.sleep(0.1)

            await second.client.delete(f"/admin/keys/{key['id']}", headers=ADMIN_HEADERS)  # revoked on the other
            await wait_until(lambda: hash_key(key["key"]) not in first.daemon.pipeline.config.tenants["team-b"]
                             .api_key_hashes, limit_s=10)
            assert (await first.client.post("/infer", headers=auth, json=infer_body(None))).status_code == 401
            audit = (await first.client.get("/admin/audit", headers=ADMIN_HEADERS)).json()["entries"]
            assert [e["action"] for e in audit[:3]] == ["key.revoke", "key.issue", "tenant.create"]
            async with httpx.AsyncClient() as client:  # (the same entries, whichever replica is asked)
                again = await client.get(second.url + "/admin/audit", headers=ADMIN_HEADERS)
            assert again.json()["entries"] == audit


async def test_a_replica_that_starts_while_redis_is_down_serves_the_file_then_seeds_the_state():
    async with open_redis_server() as redis:
        team_key = "team-a-key-" + "t" * 20
        tenants = {"team-a": {"rate": 1e4, "burst": 10_000, "api_key_hashes": [hash_key(team_key)]}}
        config = store_config(redis.url, tenants,
                              auth={"admin_key_hashes": [hash_key(ADMIN)]}, state={"poll_interval_s": 0.1})
        redis.kill()
        async with replicas(config, 1) as (only,):
            assert not only.daemon.keeper.seeded
            # the file's tenants are served meanwhile (admitted on the replica's share while the store is down)
            served = await only.client.post("/infer", json=infer_body(None),
                                            headers={"Authorization": f"Bearer {team_key}"})
            assert served.status_code == 200, served.text
            assert "team-a" in only.daemon.pipeline.config.tenants
            refused = await only.client.post("/admin/tenants", headers=ADMIN_HEADERS,
                                             json={"name": "team-b", "rate": 1, "burst": 10})
            assert (refused.status_code, refused.json()["error"]) == (503, "state_unavailable")
            await redis.restart()
            await wait_until(lambda: only.daemon.keeper.seeded, limit_s=10)
            made = await only.client.post("/admin/tenants", headers=ADMIN_HEADERS,
                                          json={"name": "team-b", "rate": 1, "burst": 10})
            assert made.status_code == 201
            assert sorted(only.daemon.pipeline.config.tenants) == ["team-a", "team-b"]


async def test_admin_answers_503_state_unavailable_while_redis_is_down(caplog):
    """With Redis killed, every admin write and every read of the state answers 503 ``state_unavailable``
    in bounded time, naming the state; nothing answers 500 and nothing is logged at ERROR. The status
    page's data still answers (live figures). Once Redis is back, writes work again."""
    import logging

    async with open_redis_server() as redis:
        config = store_config(redis.url, {"team-a": {"rate": 1e4, "burst": 10_000}},
                              auth={"admin_key_hashes": [hash_key(ADMIN)]},
                              state={"poll_interval_s": 0.1, "flush_interval_s": 0.1})
        async with replicas(config, 1) as (first,):
            client = first.client
            assert (await client.post("/admin/tenants", headers=ADMIN_HEADERS,
                                      json={"name": "team-b", "rate": 1, "burst": 1})).status_code == 201
            redis.kill()
            with trio.fail_after(60):
                for method, path, body in [
                    ("POST", "/admin/tenants", {"name": "team-c", "rate": 1, "burst": 1}),
                    ("PATCH", "/admin/tenants/team-b", {"weight": 2}),
                    ("DELETE", "/admin/tenants/team-b", None),
                    ("POST", "/admin/tenants/team-b/keys", {}),
                    ("GET", "/admin/audit", None),
                    ("GET", "/admin/usage", None),
                ]:
                    answer = await client.request(method, path, headers=ADMIN_HEADERS, json=body)
                    assert (answer.status_code, answer.json()["error"]) == (503, "state_unavailable"), (path, answer.text)
                    assert "cannot be used now" in answer.json()["message"]
                assert (await client.get("/admin/status", headers=ADMIN_HEADERS)).status_code == 200
            await redis.start()
            with trio.fail_after(30):
                while (await client.post("/admin/tenants", headers=ADMIN_HEADERS,
                                         json={"name": "team-c", "rate": 1, "burst": 1})).status_code != 201:
                    await trio.sleep(0.2)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


async def test_a_redis_restarted_without_its_data_gets_back_the_audit_log_usage_and_budget_spend():
    """Two replicas; tenants, a key, requests (usage, a budget's spend) and their audit entries; then
    Redis is killed and started again empty. The replicas write back the tenants and keys, and the
    first to notice writes back the audit log (its ids kept) and the usage from its copy; the budget's
    spend comes back with the next lease exchange. Nothing made before the loss is missing."""
    async with open_redis_server() as redis:
        team_a_key = "team-a-key-" + "a" * 30
        config = store_config(redis.url, {"team-a": {"rate": 1e4, "burst": 10_000, "budget_tokens": 100_000,
                                                     "api_key_hashes": [hash_key(team_a_key)]}},
                              auth={"admin_key_hashes": [hash_key(ADMIN)]},
                              state={"poll_interval_s": 0.1, "flush_interval_s": 0.1})
        async with replicas(config, 2) as (first, second):
            made = await first.client.post("/admin/tenants", headers=ADMIN_HEADERS,
                                           json={"name": "team-b", "rate": 1e4, "burst": 10_000})
            assert made.status_code == 201
            key = (await first.client.post("/admin/tenants/team-b/keys", headers=ADMIN_HEADERS, json={})).json()
            await wait_until(lambda: "team-b" in second.daemon.pipeline.config.tenants, limit_s=10)
            for daemon in (first, second):
                for tenant_key in (team_a_key, key["key"]):
                    answer = await daemon.client.post("/infer", headers={"Authorization": f"Bearer {tenant_key}"},
                                                      json=infer_body(None))
                    assert answer.status_code == 200, answer.text

            async def views(daemon) -> tuple[list, list, int]:
                audit = (await daemon.client.get("/admin/audit", headers=ADMIN_HEADERS)).json()["entries"]
                usage = (await daemon.client.get("/admin/usage", headers=ADMIN_HEADERS)).json()["rows"]
                budget = (await daemon.client.get("/admin/tenants/team-a", headers=ADMIN_HEADERS)).json()
                return audit, usage, budget["live"]["budget"]["spent"]

            with trio.fail_after(20):  # (flushed, and followed by both replicas' copies)
                while True:
                    audit, usage, spent = await views(first)
                    if sum(r["completed"] for r in usage) == 4 and spent > 0 and all(
                            getattr(getattr(d.daemon.keeper, "copy", None), "followed", True) for d in (first, second)):
                        break
                    await trio.sleep(0.1)
            await trio.sleep(0.5)  # (the copies follow once more: they hold the last flush)
            audit, usage, spent = await views(first)

            await redis.restart()  # (SIGKILL, then started again: no persistence, nothing is left)
            with trio.fail_after(30):
                while True:
                    try:
                        again_audit, again_usage, again_spent = await views(second)
                    except (KeyError, TypeError):
                        again_audit, again_usage, again_spent = [], [], 0
                    if len(again_audit) > len(audit) and again_spent >= spent and again_usage:
                        break
                    await trio.sleep(0.2)
            restores = [e for e in again_audit if e["action"] == "state.restore"]  # (each replica's write-back)
            assert restores and again_audit[len(restores):] == audit   # (the ids kept; the write-backs after them)
            totals = {f: sum(r[f] for r in usage) for f in ("completed", "prompt_tokens", "output_tokens")}
            assert {f: sum(r[f] for r in again_usage) for f in totals} == totals
            assert again_spent == spent
            auth = {"Authorization": f"Bearer {key['key']}"}
            assert (await first.client.post("/infer", headers=auth, json=infer_body(None))).status_code == 200


async def test_a_single_daemons_sqlite_state_moves_into_redis_for_replicas(nursery, tmp_path):
    """The move from one daemon to replicas (docs/how-to/replicas.md): a daemon on SQLite has a tenant
    made through /admin, an issued key, usage, a budget's spend and their audit log; ``apsd state
    export`` (beside the live daemon) and ``apsd state import`` (into a real Redis) move it, and a
    replica started on Redis has the same tenants, a key that works, the same audit log (ids and all),
    usage and spend."""
    from apsd.core.config import AuthConfig, ServerConfig, StateConfig
    from tests.helpers import FAST_GPU, make_config, run_cli, start_daemon

    state = tmp_path / "apsd.db"
    single = tmp_path / "single.toml"
    single.write_text(f'[state]\npath = "{state}"\n')
    team_a_key = "team-a-key-" + "m" * 30
    tenants = {"team-a": {"rate": 1e4, "burst": 10_000, "budget_tokens": 1_000_000,
                          "api_key_hashes": [hash_key(team_a_key)]}}
    running = await start_daemon(nursery, make_config(
        {"tenants": tenants}, server=ServerConfig(host="127.0.0.1", port=0), gpu=FAST_GPU,
        auth=AuthConfig(admin_key_hashes=[hash_key(ADMIN)]),
        state=StateConfig(path=str(state), flush_interval_s=0.1, poll_interval_s=0.1)))
    async with running.client as client:
        made = await client.post("/admin/tenants", headers=ADMIN_HEADERS,
                                 json={"name": "team-b", "rate": 1e4, "burst": 10_000, "weight": 3})
        assert made.status_code == 201
        key = (await client.post("/admin/tenants/team-b/keys", headers=ADMIN_HEADERS, json={"label": "ci"})).json()
        for tenant_key in (team_a_key, key["key"], key["key"]):
            answer = await client.post("/infer", headers={"Authorization": f"Bearer {tenant_key}"},
                                       json=infer_body(None))
            assert answer.status_code == 200, answer.text

        async def views(client) -> tuple:
            audit = (await client.get("/admin/audit", headers=ADMIN_HEADERS)).json()["entries"]
            usage = (await client.get("/admin/usage", headers=ADMIN_HEADERS)).json()["rows"]
            listed = (await client.get("/admin/tenants", headers=ADMIN_HEADERS)).json()["tenants"]
            settings = {t["name"]: (t["rate"], t["burst"], t["weight"], t["budget_tokens"], t["source"]) for t in listed}
            budget = next(t for t in listed if t["name"] == "team-a")["live"]["budget"]["spent"]
            keys = [(k["id"], k["label"], k["active"]) for k in
                    (await client.get("/admin/keys", headers=ADMIN_HEADERS)).json()["keys"]]
            return audit, usage, settings, budget, keys

        await trio.sleep(0.5)  # (flushed: usage and spend are in the file)
        before = await views(client)
        exported = tmp_path / "state.json"
        done = await trio.to_thread.run_sync(lambda: run_cli("state", "export", str(single), "--output", str(exported)))
        assert done.returncode == 0, done.stderr
        assert "2 tenants, 1 keys" in done.stderr and (exported.stat().st_mode & 0o777) == 0o600
    running.daemon.request_shutdown()

    async with open_redis_server() as redis:
        replica_file = tmp_path / "replicas.toml"
        replica_file.write_text(f'[store]\nkind = "redis"\nurl = "{redis.url}"\n')
        done = await trio.to_thread.run_sync(lambda: run_cli("state", "import", str(replica_file), str(exported)))
        assert done.returncode == 0, done.stderr
        again = await trio.to_thread.run_sync(lambda: run_cli("state", "import", str(replica_file), str(exported)))
        assert again.returncode == 1 and "is not empty" in again.stderr   # (twice would count usage twice)
        config = store_config(redis.url, tenants,   # (the same file's tenants, now on Redis)
                              auth={"admin_key_hashes": [hash_key(ADMIN)]},
                              state={"poll_interval_s": 0.1, "flush_interval_s": 0.1})
        async with replicas(config, 1) as (replica,):
            with trio.fail_after(20):  # (the budget's spend comes with the first lease exchanges)
                while (after := await views(replica.client))[3] != before[3]:
                    await trio.sleep(0.1)
            assert after[0] == before[0]                  # the audit log, ids and all
            assert after[1] == before[1]                  # usage
            assert after[2] == before[2] and after[4] == before[4]   # tenants (and where they come from), keys
            answer = await replica.client.post("/infer", headers={"Authorization": f"Bearer {key['key']}"},
                                               json=infer_body(None))
            assert answer.status_code == 200, answer.text
