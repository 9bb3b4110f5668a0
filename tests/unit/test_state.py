"""The state: the SQLite store, the keeper's rules (who wins, admin operations, expiry), budgets and usage."""

from __future__ import annotations

import json
import sqlite3

import attrs
import pytest

from apsd.core.budget import Budgets, limits_for, period_end, period_key, tenant_limits
from apsd.core.config import AuthConfig, ConfigError, KeyConfig, KeyLimits, StateConfig, TenantConfig
from apsd.core.models import Completion, InferenceRequest, Refusal
from apsd.serve.auth import hash_key
from apsd.state.keeper import AdminError, open_keeper
from apsd.state.records import AuditEntry, KeyRecord, TenantRecord, UsageKey, histogram_bucket, percentile
from apsd.state.sqlite import SqliteState
from apsd.state.store import PutKey, PutTenant
from apsd.state.usage import CSV_COLUMNS, UsageRecorder, summarize, to_csv
from tests.helpers import make_config

ADMIN = "admin-key-" + "a" * 30
T0 = 1_795_700_000.0  # 2026-11-26T10:13:20Z


class Wall:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def config_with(tmp_path, tenants, **state):
    return make_config(state=StateConfig(path=str(tmp_path / "state.db"), **state),
                       auth=AuthConfig(admin_key_hashes=[hash_key(ADMIN)]), tenants=tenants)


# -- the SQLite store --------------------------------------------------------------------------------

async def test_sqlite_keeps_records_audit_usage_spend_and_buckets_across_a_reopen(tmp_path):
    path = tmp_path / "s.db"
    store = SqliteState(path)
    tenant = TenantRecord("a", TenantConfig(rate=5, burst=50, weight=2), "admin", None, T0, T0)
    key = KeyRecord("key_1", "a", "apsd_abcdefg", hash_key("k" * 30), "ci", T0)
    await store.write([PutTenant(tenant), PutKey(key)],
                      [AuditEntry(T0, "admin:x", "tenant.create", "a"),
                       AuditEntry(T0 + 1, "admin:x", "key.issue", "key:key_1")])
    row = UsageKey(int(T0) // 3600 * 3600, "a", "m", "b0")
    await store.add_usage({row: {"completed": 2, "ttft.10": 1}})
    await store.add_usage({row: {"completed": 3, "refused.rate_limited": 1}})
    assert await store.add_spend({("a", "2026-11-26"): 40}) == {("a", "2026-11-26"): 40}
    assert await store.add_spend({("a", "2026-11-26"): 2}) == {("a", "2026-11-26"): 42}
    await store.save_buckets({"a": (12.5, T0)})
    version = await store.version()
    await store.close()

    again = SqliteState(path)
    snapshot = await again.load()
    assert snapshot.tenants == {"a": tenant} and snapshot.keys == (key,) and snapshot.version == version
    entries = await again.audit()
    assert [e.action for e in entries] == ["key.issue", "tenant.create"] and entries[0].entry_id > entries[1].entry_id
    assert [e.action for e in await again.audit(target="a")] == ["tenant.create"]
    assert [e.action for e in await again.audit(before_id=entries[0].entry_id)] == ["tenant.create"]
    assert await again.usage(tenant="a", start=row.hour, end=row.hour + 3600) == {
        row: {"completed": 5, "ttft.10": 1, "refused.rate_limited": 1}}
    assert await again.usage(tenant="b", start=row.hour, end=row.hour + 3600) == {}
    assert await again.spend([("a", "2026-11-26"), ("a", "2026-11-27")]) == {("a", "2026-11-26"): 42,
                                                                           ("a", "2026-11-27"): 0}
    assert await again.load_buckets() == {"a": (12.5, T0)}
    await again.prune(usage_before=row.hour + 3600, audit_before=T0 + 0.5)
    assert await again.usage(tenant=None, start=0, end=2**40) == {}
    assert [e.action for e in await again.audit()] == ["key.issue"]
    await again.close()
    for made in (path, path.with_name("s.db-wal"), path.with_name("s.db-shm")):  # (no one else reads them)
        assert not made.exists() or (made.stat().st_mode & 0o777) == 0o600, made
    assert (path.stat().st_mode & 0o777) == 0o600


async def test_the_state_files_are_the_owners_only_whatever_the_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        store = SqliteState(tmp_path / "deep" / "s.db")
        await store.write([PutTenant(TenantRecord("a", TenantConfig(rate=1, burst=1), "admin", None, T0, T0))], [])
        modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "deep").iterdir()}
        await store.close()
    finally:
        os.umask(old)
    assert modes["s.db"] == 0o600 and modes["s.db-wal"] == 0o600, modes
    assert (tmp_path / "deep").stat().st_mode & 0o777 == 0o700


def test_a_state_file_from_a_newer_apsd_is_refused(tmp_path):
    path = tmp_path / "s.db"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA user_version = 99")
    with pytest.raises(Exception, match=r"written by a newer apsd \(schema 99"):
        SqliteState(path)


# -- who wins for a tenant the file declares ---------------------------------------------------------

async def test_seed_the_latest_change_wins(tmp_path):
    wall = Wall()
    file_a = TenantConfig(rate=10, burst=100)
    config = config_with(tmp_path, {"a": file_a})
    async with open_keeper(config, wall=wall) as keeper:
        assert keeper.effective().tenants == {"a": file_a}
        await keeper.update_tenant("admin:x", "a", {"rate": 20})
        created = await keeper.create_tenant("admin:x", {"name": "b", "rate": 1, "burst": 10})
        assert created.origin == "admin"
    async with open_keeper(config, wall=wall) as keeper:  # the same file: the admin's change stands
        assert keeper.effective().tenants["a"].rate == 20 and "b" in keeper.effective().tenants
        changed = config_with(tmp_path, {"a": TenantConfig(rate=30, burst=100)})
        said = await keeper.reconcile(changed)  # the file's declaration changed: it wins
        assert said == ["tenant a updated from <test>"]
        assert keeper.effective().tenants["a"].rate == 30
        said = await keeper.reconcile(config_with(tmp_path, {"c": TenantConfig(rate=1, burst=5)}))
        assert "tenant a deleted: <test> no longer declares it" in said
        assert sorted(keeper.effective().tenants) == ["b", "c"]  # (b came from /admin: kept)
        actions = [(e.actor, e.action, e.target) for e in await keeper.store.audit(limit=10)]
        assert actions[:3] == [("file", "tenant.delete", "a"), ("file", "tenant.create", "c"),
                               ("file", "tenant.update", "a")]
        await keeper.delete_tenant("admin:x", "c")  # /admin deletes a tenant the file declares ...
    async with open_keeper(config_with(tmp_path, {"c": TenantConfig(rate=1, burst=5)}), wall=wall) as keeper:
        assert sorted(keeper.effective().tenants) == ["b"]  # ... the latest change: the file does not bring it back
        await keeper.create_tenant("admin:x", {"name": "c", "rate": 7, "burst": 7})  # nor after it is re-created
    async with open_keeper(config_with(tmp_path, {"c": TenantConfig(rate=1, burst=5)}), wall=wall) as keeper:
        assert keeper.effective().tenants["c"].rate == 7
        await keeper.delete_tenant("admin:x", "c")
        await keeper.reconcile(config_with(tmp_path, {"c": TenantConfig(rate=2, burst=5)}))  # the file changed it
        assert keeper.effective().tenants["c"].rate == 2


async def test_authoritative_the_file_always_wins_and_admin_may_not_change_its_tenants(tmp_path):
    config = config_with(tmp_path, {"a": TenantConfig(rate=10, burst=100)}, file_tenants="authoritative")
    async with open_keeper(config, wall=Wall()) as keeper:
        for operation in (keeper.update_tenant("admin:x", "a", {"rate": 20}), keeper.delete_tenant("admin:x", "a"),
                          keeper.create_tenant("admin:x", {"name": "a", "rate": 1, "burst": 1})):
            with pytest.raises(AdminError) as refused:
                await operation
            assert refused.value.error in ("declared_in_file", "tenant_exists")
        await keeper.create_tenant("admin:x", {"name": "b", "rate": 1, "burst": 10})  # others: allowed
        _, key = await keeper.issue_key("admin:x", "a", {})  # keys of the file's tenants: allowed
        assert hash_key(key) in keeper.effective().tenants["a"].api_key_hashes


# -- admin operations --------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "field"), [
    ({"rate": 1, "burst": 1}, "name"),
    ({"name": "bad name", "rate": 1, "burst": 1}, "name"),
    ({"name": "x" * 65, "rate": 1, "burst": 1}, "name"),
    ({"name": "b", "burst": 1}, "rate"),
    ({"name": "b", "rate": -1, "burst": 1}, "rate"),
    ({"name": "b", "rate": "5", "burst": 1}, "rate"),
    ({"name": "b", "rate": 1, "burst": 1, "weight": 0}, "weight"),
    ({"name": "b", "rate": 1, "burst": 1, "wieght": 2}, "wieght"),
    ({"name": "b", "rate": 1, "burst": 1, "budget_period": "week"}, "budget_period"),
    ({"name": "b", "rate": 1, "burst": 1, "models": ["m", "m"]}, "models"),
    ({"name": "b", "rate": 1, "burst": 1, "max_bid": 3, "default_bid": 4}, "default_bid"),
    ({"name": "b", "rate": 1, "burst": 1, "api_key_hashes": []}, "api_key_hashes"),
])
async def test_a_tenant_the_config_file_would_refuse_is_refused_naming_the_field(tmp_path, body, field):
    async with open_keeper(config_with(tmp_path, {"a": TenantConfig(rate=1, burst=1)}), wall=Wall()) as keeper:
        with pytest.raises(AdminError) as refused:
            await keeper.create_tenant("admin:x", body)
        assert refused.value.status == 422 and refused.value.field == field, refused.value


async def test_keys_are_issued_revoked_and_expire(tmp_path):
    wall = Wall()
    async with open_keeper(config_with(tmp_path, {"a": TenantConfig(rate=1, burst=1)}), wall=wall) as keeper:
        applied = []
        keeper.apply = lambda config, why: applied.append((config, why))
        forever, key1 = await keeper.issue_key("admin:x", "a", {"label": "ci"})
        _, key2 = await keeper.issue_key("admin:x", "a", {"expires_in_s": 60})
        hashes = applied[-1][0].tenants["a"].api_key_hashes
        assert {hash_key(key1), hash_key(key2)} <= set(hashes) and key1.startswith(forever.prefix)
        wall.now += 61
        await keeper.poll()  # (nothing else changed: the expiry alone rebuilds the keys)
        assert applied[-1][1] == "a key expired" and hash_key(key2) not in applied[-1][0].tenants["a"].api_key_hashes
        await keeper.revoke_key("admin:x", forever.key_id)
        assert hash_key(key1) not in keeper.effective().tenants["a"].api_key_hashes
        assert [k["active"] for k in keeper.key_views("a")] == [False, False]
        for body, field in (({"expires_in_s": -5}, "expires_in_s"), ({"expires_at": T0 - 1}, "expires_at"),
                            ({"expires_in_s": "soon"}, "expires_in_s"), ({"label": "x\n"}, "label"),
                            ({"colour": "red"}, "colour"), ({"expires_in_s": 5, "expires_at": T0 + 9}, "expires_at")):
            with pytest.raises(AdminError) as refused:
                await keeper.issue_key("admin:x", "a", body)
            assert refused.value.field == field
        with pytest.raises(AdminError, match="no key with id"):
            await keeper.revoke_key("admin:x", "key_nope")
        audit = json.dumps([e.view() for e in await keeper.store.audit(limit=100)])
        assert key1 not in audit and key2 not in audit and hash_key(key1) not in audit


async def test_issuing_a_key_without_an_admin_key_would_lock_the_operator_out_and_is_refused(tmp_path):
    config = attrs.evolve(config_with(tmp_path, {"a": TenantConfig(rate=1, burst=1)}), auth=AuthConfig())
    async with open_keeper(config, wall=Wall()) as keeper:
        with pytest.raises(AdminError) as refused:
            await keeper.issue_key("admin:open", "a", {})
        assert (refused.value.status, refused.value.error) == (409, "admin_key_required")


async def test_with_the_state_off_nothing_changes_and_the_file_is_the_configuration(tmp_path):
    config = config_with(tmp_path, {"a": TenantConfig(rate=1, burst=1)}, kind="off")
    async with open_keeper(config, wall=Wall()) as keeper:
        assert keeper.effective() is config
        with pytest.raises(AdminError) as refused:
            await keeper.create_tenant("admin:x", {"name": "b", "rate": 1, "burst": 1})
        assert refused.value.error == "state_off"
    assert not (tmp_path / "state.db").exists()


# -- budgets -----------------------------------------------------------------------------------------

def test_a_budget_reserves_whole_costs_and_settles_what_was_used():
    wall = Wall()
    budgets = Budgets(wall=wall)
    tenant = TenantConfig(rate=1, burst=1000, budget_tokens=100)
    (limit,) = tenant_limits("a", tenant)
    assert budgets.refusal(limit, 60) is None
    budgets.reserve(limit, 60)
    refused = budgets.refusal(limit, 60)  # 60 reserved + 60 > 100, though nothing is spent yet
    assert refused is not None and refused.status == 429 and refused.error == "budget_exhausted"
    assert int(refused.headers["Retry-After"]) == int(period_end("day", wall.now) - wall.now) + 1
    budgets.settle("a", 60, 20, limit)  # it used 20: 80 left
    assert budgets.used(limit) == 20 and budgets.refusal(limit, 80) is None
    assert budgets.take_settled() == {("a", period_key("day", wall.now)): 20}
    assert budgets.used(limit) == 20
    budgets.set_spent(limit, period_key("day", wall.now), 95)  # the other replicas spent too
    assert budgets.refusal(limit, 10) is not None and budgets.refusal(limit, 5) is None
    wall.now = period_end("day", wall.now) + 1  # a new day: a new budget
    assert budgets.used(limit) == 0 and budgets.refusal(limit, 100) is None
    assert tenant_limits("a", TenantConfig(rate=1, burst=1)) == []  # (no budget)


def test_a_tenant_and_its_key_have_a_budget_each_in_tokens_and_in_dollars():
    """A tenant's budgets and a key's own are separate accounts, named so; dollars are micro-dollars."""
    tenant = TenantConfig(rate=1, burst=1000, budget_tokens=100, budget_usd=2.5, budget_period="month")
    key = KeyConfig("key_1", "a", "sha256:" + "0" * 64, name="ci",
                    limits=KeyLimits(budget_usd=0.25))
    limits = {limit.account: limit for limit in limits_for("a", tenant, key)}
    assert limits.keys() == {"a", "a:usd", "a:key:key_1:usd"}
    assert (limits["a:usd"].limit, limits["a:usd"].unit, limits["a:usd"].period) == (2_500_000, "usd", "month")
    assert (limits["a:key:key_1:usd"].limit, limits["a:key:key_1:usd"].period) == (250_000, "day")
    budgets = Budgets(wall=Wall())
    budgets.reserve(limits["a:key:key_1:usd"], 200_000)
    refused = budgets.refusal(limits["a:key:key_1:usd"], 60_000)
    assert refused is not None and "key 'ci' of tenant 'a'" in refused.message and "$0.2000" in refused.message
    assert budgets.refusal(limits["a:usd"], 2_000_000) is None   # (the tenant's own budget is untouched)
    assert [l.account for l in limits_for("b", tenant, key)] == ["b", "b:usd"]  # (another tenant's key: ignored)


def test_periods_are_utc_days_and_months():
    assert period_key("day", T0) == "2026-11-26" and period_key("month", T0) == "2026-11"
    assert period_end("month", T0) == 1_796_083_200.0  # 2026-12-01T00:00Z
    assert period_end("day", 1_796_083_199.0) == 1_796_083_200.0


# -- usage -------------------------------------------------------------------------------------------

def _request(tenant="a", *, prompt=10, generated=5, ttft=0.1, latency=0.5, model="m") -> InferenceRequest:
    request = InferenceRequest("r", tenant, prompt, generated, 5, model=model)
    request.arrival, request.started_at, request.finished_at = 100.0, 100.0 + ttft, 100.0 + latency
    request.tokens_generated, request.cost_usd = generated, 0.25
    return request


def _done(request: InferenceRequest) -> Completion:
    return Completion(request.request_id, request.tenant_id, request.prompt_tokens, request.tokens_generated,
                      0.0, 0.0, None, 0.0, 0.0, 0.0, 0, 1, 0, 5.0, request.cost_usd)


def test_usage_is_counted_per_hour_tenant_and_model_and_summarised_with_percentiles():
    wall = Wall()
    recorder = UsageRecorder(lambda: {"a": None, "b": None}, wall)
    for ttft in [0.1] * 98 + [2.0] * 2:  # (the 99th percentile of 100 is the 99th: a slow one)
        recorder.finished(r := _request(ttft=ttft), _done(r))
    recorder.finished(_request("b", model="n"), Refusal(502, "backend_failed", "x", kind="failed"))
    recorder.rejected(_request("a"), Refusal(429, "rate_limited", "x"))
    recorder.rejected(_request("stranger"), Refusal(404, "unknown_tenant", "x"))  # not a row
    wall.now += 3600
    recorder.finished(r := _request(), _done(r))
    rows = recorder.take()
    assert recorder.take() == {} and {k.tenant for k in rows} == {"a", "b"}
    hourly = summarize(rows, group_by="hour")
    first = hourly[0]
    assert (first["tenant"], first["completed"], first["refused"], first["requests"]) == ("a", 100, 1, 101)
    assert first["prompt_tokens"] == 1000 and first["output_tokens"] == 500 and first["cost_usd"] == 25.0
    assert 89 <= first["ttft_p50_ms"] <= 112 and 1790 <= first["ttft_p99_ms"] <= 2240
    assert first["refused_by_error"] == {"rate_limited": 1}
    assert [(r["tenant"], r["failed"]) for r in hourly[1:2]] == [("b", 1)]
    daily = summarize(rows, group_by="day")
    assert [(r["period"], r["tenant"], r["completed"]) for r in daily] == [("2026-11-26", "a", 101),
                                                                            ("2026-11-26", "b", 0)]
    lines = to_csv(daily).splitlines()
    assert lines[0].split(",") == list(CSV_COLUMNS) and lines[1].startswith("2026-11-26,a,*,*,102,101,")


def test_histogram_percentiles_are_within_an_eighth_of_the_truth():
    for ms in (0.5, 1.0, 3.0, 47.0, 999.0, 123_456.0):
        estimate = percentile({histogram_bucket(ms): 1}, 0.5)
        assert ms <= 1.0 and estimate == 1.0 or abs(estimate - ms) / ms <= 0.125
    assert percentile({}, 0.5) is None


def test_a_state_section_that_names_redis_needs_the_redis_store():
    from apsd.core.config import parse_config

    with pytest.raises(ConfigError, match=r"state.kind: \"redis\" keeps the state in \[store\]'s Redis"):
        parse_config({"state": {"kind": "redis"}})
    assert StateConfig().sqlite_path({"STATE_DIRECTORY": "/var/lib/apsd:/x", "HOME": "/h"}).as_posix() == (
        "/var/lib/apsd/apsd.db")
    assert StateConfig().sqlite_path({"HOME": "/h"}).as_posix() == "/h/.local/state/apsd/apsd.db"
    assert StateConfig(path="~/s.db").sqlite_path({}).name == "s.db"
