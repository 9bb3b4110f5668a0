"""``/admin`` over real HTTP: an operator's day two, bad input, access, secrets, budgets under
concurrency, and what survives ``kill -9``."""

from __future__ import annotations

import functools
import json
import logging
import signal
import sqlite3

import attrs
import httpx
import pytest
import trio

from apsd.core.config import AuthConfig, ServerConfig, StateConfig, TenantConfig
from apsd.serve.auth import hash_key
from apsd.serve.http import create_app
from apsd.serve.http.admin import openapi_document
from tests.helpers import FAST_GPU, infer_body, make_config, run_cli, start_apsd, start_daemon, stop_apsd, wait_until

ADMIN = "admin-key-" + "a" * 30
FILE_KEY = "file-tenant-key-" + "f" * 20
MODEL = "apsd-batch"


def admin_config(tmp_path, **state) -> object:
    return make_config(
        server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=5.0), gpu=FAST_GPU,
        auth=AuthConfig(admin_key_hashes=[hash_key(ADMIN)]),
        state=StateConfig(path=str(tmp_path / "apsd.db"), flush_interval_s=0.1, poll_interval_s=0.1, **state),
        tenants={"team-a": TenantConfig(rate=1e4, burst=10_000, api_key_hashes=[hash_key(FILE_KEY)])})


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


ADMIN_HEADERS = bearer(ADMIN)


@pytest.fixture
async def admin(nursery, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    running = await start_daemon(nursery, admin_config(tmp_path))
    async with running.client:
        yield running
    running.daemon.request_shutdown()


def chat(url: str, key: str) -> object:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5)


async def test_an_operator_adds_a_tenant_issues_and_rotates_its_key_and_reads_its_usage(admin, caplog):
    client, url = admin.client, admin.url
    made = await client.post("/admin/tenants", headers=ADMIN_HEADERS,
                             json={"name": "team-b", "rate": 5000, "burst": 5000, "weight": 2})
    assert made.status_code == 201 and made.headers["Location"] == "/admin/tenants/team-b"
    assert made.json()["source"] == "admin" and made.json()["weight"] == 2
    issued = await client.post("/admin/tenants/team-b/keys", headers=ADMIN_HEADERS, json={"label": "ci"})
    assert issued.status_code == 201 and issued.headers["Cache-Control"] == "no-store"
    first = issued.json()["key"]
    answer = await trio.to_thread.run_sync(chat, url, first)  # the official client, as team-b
    assert answer.usage.completion_tokens == 5

    rotated = (await client.post("/admin/tenants/team-b/keys", headers=ADMIN_HEADERS, json={})).json()
    revoked = await client.delete(f"/admin/keys/{issued.json()['id']}", headers=ADMIN_HEADERS)
    assert revoked.status_code == 200 and revoked.json()["active"] is False
    assert (await client.post("/infer", headers=bearer(first), json=infer_body(None))).status_code == 401
    for _ in range(3):
        await trio.to_thread.run_sync(chat, url, rotated["key"])
    listed = (await client.get("/admin/tenants/team-b/keys", headers=ADMIN_HEADERS)).json()["keys"]
    assert [(k["id"], k["active"]) for k in listed] == sorted([(issued.json()["id"], False), (rotated["id"], True)])
    assert all("key" not in k and "key_hash" not in k for k in listed)

    usage = (await client.get("/admin/usage", headers=ADMIN_HEADERS, params={"tenant": "team-b"})).json()
    assert [(r["tenant"], r["completed"], r["output_tokens"]) for r in usage["rows"]] == [("team-b", 4, 20)]
    assert usage["rows"][0]["period"].endswith(":00:00Z") and usage["rows"][0]["ttft_p99_ms"] is not None
    csv = await client.get("/admin/usage", headers=ADMIN_HEADERS, params={"format": "csv", "group_by": "day"})
    assert csv.headers["content-type"].startswith("text/csv") and ",team-b,*,*,4,4," in csv.text

    audit = (await client.get("/admin/audit", headers=ADMIN_HEADERS)).json()["entries"]
    assert [e["action"] for e in audit[:4]] == ["key.revoke", "key.issue", "key.issue", "tenant.create"]
    assert {e["actor"] for e in audit[:4]} == {"admin:" + hash_key(ADMIN)[7:15]}
    # no key, and no hash of one, in the log or the audit log; the state holds hashes only
    everything = caplog.text + json.dumps(audit) + json.dumps(listed)
    for secret in (first, rotated["key"], ADMIN, FILE_KEY):
        assert secret not in everything and hash_key(secret) not in everything
        assert hash_key(secret)[7:] not in everything
    with sqlite3.connect(admin.daemon.keeper.store.path) as db:
        dump = "\n".join(db.iterdump())
    assert first not in dump and rotated["key"] not in dump and hash_key(rotated["key"]) in dump


async def test_disabled_tenants_and_models_a_tenant_may_not_use_are_refused(admin):
    client = admin.client
    patched = await client.patch("/admin/tenants/team-a", headers=ADMIN_HEADERS, json={"models": ["other-model"]})
    assert patched.status_code == 200 and patched.json()["models"] == ["other-model"]
    refused = await client.post("/v1/chat/completions", headers=bearer(FILE_KEY),
                                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    await client.patch("/admin/tenants/team-a", headers=ADMIN_HEADERS, json={"models": [], "disabled": True})
    refused = await client.post("/infer", headers=bearer(FILE_KEY), json=infer_body(None))
    assert refused.status_code == 403 and refused.json()["error"] == "tenant_disabled"
    await client.patch("/admin/tenants/team-a", headers=ADMIN_HEADERS, json={"disabled": False})
    assert (await client.post("/infer", headers=bearer(FILE_KEY), json=infer_body(None))).status_code == 200


@pytest.mark.parametrize(("method", "path", "body", "status", "field"), [
    ("POST", "/admin/tenants", b"not json", 400, None),
    ("POST", "/admin/tenants", {"name": "x y", "rate": 1, "burst": 1}, 422, "name"),
    ("POST", "/admin/tenants", {"name": "b", "rate": 0, "burst": 1}, 422, "rate"),
    ("POST", "/admin/tenants", {"name": "b", "rate": 1, "burst": 1.5}, 422, "burst"),
    ("POST", "/admin/tenants", {"name": "b", "rate": 1, "burst": 1, "colour": 1}, 422, "colour"),
    ("POST", "/admin/tenants", {"name": "team-a", "rate": 1, "burst": 1}, 409, "name"),
    ("PATCH", "/admin/tenants/team-a", {"weight": -1}, 422, "weight"),
    ("PATCH", "/admin/tenants/team-a", {"disabled": "yes"}, 422, "disabled"),
    ("PATCH", "/admin/tenants/team-a", {"name": "renamed"}, 422, "name"),
    ("PATCH", "/admin/tenants/nobody", {"weight": 1}, 404, None),
    ("DELETE", "/admin/tenants/nobody", None, 404, None),
    ("POST", "/admin/tenants/team-a/keys", {"expires_in_s": 0}, 422, "expires_in_s"),
    ("POST", "/admin/tenants/team-a/keys", {"label": 5}, 422, "label"),
    ("POST", "/admin/tenants/nobody/keys", {}, 404, None),
    ("DELETE", "/admin/keys/key_nope", None, 404, None),
    ("GET", "/admin/audit?limit=0", None, 400, "limit"),
    ("GET", "/admin/audit?before=x", None, 400, "before"),
    ("GET", "/admin/usage?group_by=week", None, 400, "group_by"),
    ("GET", "/admin/usage?from=yesterday", None, 400, "from"),
    ("GET", "/admin/usage?from=2026-11-26&to=2026-11-25", None, 400, "from"),
    ("GET", "/admin/usage?format=xml", None, 400, "format"),
])
async def test_bad_input_to_every_admin_endpoint_is_a_4xx_naming_the_field(admin, method, path, body, status, field):
    kind, content = body if isinstance(body, tuple) else ("application/json", body)
    raw = isinstance(content, bytes)
    answer = await admin.client.request(method, path, headers={**ADMIN_HEADERS, "Content-Type": kind} if raw
                                        else ADMIN_HEADERS, content=content if raw else None,
                                        json=None if raw or content is None else content)
    assert answer.status_code == status, answer.text
    assert answer.json().get("field") == field and answer.json()["message"]


async def test_only_the_admin_key_reaches_admin(admin):
    client = admin.client
    team_key = (await client.post("/admin/tenants/team-a/keys", headers=ADMIN_HEADERS, json={})).json()["key"]
    paths = [("GET", "/admin/tenants"), ("POST", "/admin/tenants"), ("GET", "/admin/tenants/team-a"),
             ("PATCH", "/admin/tenants/team-a"), ("DELETE", "/admin/tenants/team-a"),
             ("GET", "/admin/tenants/team-a/keys"), ("POST", "/admin/tenants/team-a/keys"), ("GET", "/admin/keys"),
             ("DELETE", "/admin/keys/key_x"), ("GET", "/admin/audit"), ("GET", "/admin/usage"),
             ("GET", "/admin/openapi.json")]
    for method, path in paths:
        for key in (team_key, FILE_KEY):
            answer = await client.request(method, path, headers=bearer(key), json={"weight": 9})
            assert (answer.status_code, answer.json()["error"]) == (403, "admin_only"), (method, path)
        assert (await client.request(method, path)).status_code == 401
    assert (await client.get("/admin/tenants/team-a", headers=ADMIN_HEADERS)).json()["weight"] == 1.0


async def test_the_openapi_description_covers_every_admin_route(admin):
    served = (await admin.client.get("/admin/openapi.json", headers=ADMIN_HEADERS)).json()
    assert served == json.loads(json.dumps(openapi_document()))
    app = create_app(admin.daemon.pipeline, keeper=admin.daemon.keeper)
    routes = {rule.rule.replace("<", "{").replace(">", "}") for rule in app.url_map.iter_rules()
              if rule.rule.startswith("/admin/")}
    described = set(served["paths"])
    tenant = served["components"]["schemas"]["Tenant"]["properties"]
    assert {"rate", "burst", "weight", "models", "budget_tokens", "disabled"} <= set(tenant)
    assert tenant["rate"]["description"] and "api_key_hashes" not in tenant
    assert {"/admin/tenants", "/admin/tenants/{name}", "/admin/tenants/{name}/keys", "/admin/keys",
            "/admin/keys/{key_id}", "/admin/audit", "/admin/usage"} <= described
    assert routes == described


async def test_a_budget_is_never_passed_by_concurrent_requests(nursery, tmp_path):
    """200 requests at once against a 3,000-token budget with room for 100 of them: exactly 100
    admitted, the rest refused 429 budget_exhausted; what was used is the budget, to the token, and
    the tenant's budget says so (reserve-then-settle, one daemon)."""
    config = make_config(
        server=ServerConfig(host="127.0.0.1", port=0), gpu=FAST_GPU,
        state=StateConfig(path=str(tmp_path / "apsd.db")),
        tenants={"capped": TenantConfig(rate=1e6, burst=1_000_000, budget_tokens=3000)})
    running = await start_daemon(nursery, config)
    body = infer_body("capped", "x" * 16, 26)  # 4 prompt tokens + 26: 30 reserved each
    answers = []

    async def send() -> None:
        answers.append(await running.client.post("/infer", json=body))

    async with running.client, trio.open_nursery() as senders:
        for _ in range(200):
            senders.start_soon(send)
    statuses = sorted(a.status_code for a in answers)
    assert statuses.count(200) == 100 and statuses.count(429) == 100
    assert {a.json()["error"] for a in answers if a.status_code == 429} == {"budget_exhausted"}
    used = sum(a.json()["prompt_tokens"] + a.json()["tokens_generated"] for a in answers if a.status_code == 200)
    assert used == 3000
    async with httpx.AsyncClient(base_url=running.url) as client:
        budget = (await client.get("/admin/tenants/capped")).json()["live"]["budget"]
    assert (budget["spent"], budget["reserved"], budget["limit"], budget["period"]) == (3000, 0, 3000, "day")
    running.daemon.request_shutdown()


async def test_kill_9_then_restart_brings_back_tenants_keys_buckets_and_usage(tmp_path):
    state = tmp_path / "state.db"
    config = tmp_path / "apsd.toml"
    config.write_text(f"""
[server]
port = 0
[auth]
admin_key_hashes = ["{hash_key(ADMIN)}"]
[state]
path = "{state}"
flush_interval_s = 0.2
[tenants.team-a]
rate = 1000
burst = 10000
""")
    process, url, first_log = await start_apsd(str(config))
    try:
        async with httpx.AsyncClient(base_url=url, headers=ADMIN_HEADERS, timeout=30) as client:
            await client.post("/admin/tenants", json={"name": "slow", "rate": 0.01, "burst": 1000})
            key = (await client.post("/admin/tenants/slow/keys", json={"label": "kept"})).json()["key"]
            for _ in range(4):  # 4 x (3 + 200) of its 1000 tokens: 188 left, refilling 0.01 a second
                ok = await client.post("/infer", headers=bearer(key), json=infer_body(None, "x" * 12, 200))
                assert ok.status_code == 200, ok.text
            await wait_until(lambda: _flushed_usage(state) >= 4)
            await trio.sleep(0.5)  # (two flush intervals more: the bucket levels after the last request)
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
        while chunk := await process.stderr.receive_some():
            first_log.append(chunk)
    process, url, second_log = await start_apsd(str(config))
    try:
        async with httpx.AsyncClient(base_url=url, headers=ADMIN_HEADERS, timeout=30) as client:
            tenant = (await client.get("/admin/tenants/slow")).json()
            assert tenant["source"] == "admin" and tenant["keys"]["active"] == 1
            assert 180 <= tenant["live"]["tokens_available"] < 200  # not a full burst again
            refused = await client.post("/infer", headers=bearer(key), json=infer_body(None, "x" * 12, 200))
            assert refused.status_code == 429 and refused.json()["error"] == "rate_limited"  # the key works
            usage = (await client.get("/admin/usage", params={"tenant": "slow"})).json()["rows"]
            assert sum(r["completed"] for r in usage) == 4 and sum(r["refused"] for r in usage) == 1
            table = await trio.to_thread.run_sync(functools.partial(
                run_cli, "usage", "--url", url, "--tenant", "slow", "--group-by", "day", env={"APSD_ADMIN_KEY": ADMIN}))
            assert table.returncode == 0, table.stderr
            header, row = table.stdout.splitlines()
            assert header.split()[:6] == ["period", "tenant", "requests", "completed", "failed", "cancelled"]
            assert row.split()[1:4] == ["slow", "5", "4"]
            refused = await trio.to_thread.run_sync(functools.partial(
                run_cli, "usage", "--url", url, env={"APSD_ADMIN_KEY": "wrong-key-" + "w" * 20}))
            assert refused.returncode == 1 and "answered 401" in refused.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        await process.wait()
        while chunk := await process.stderr.receive_some():
            second_log.append(chunk)
    logged = b"".join(first_log + second_log).decode()
    assert "key key_" in logged and "issued to tenant slow" in logged  # (the log names keys by id ...)
    assert key not in logged and ADMIN not in logged and hash_key(key)[7:] not in logged  # (... never by value)


def _flushed_usage(path) -> int:
    try:
        with sqlite3.connect(path) as db:
            row = db.execute("SELECT SUM(value) FROM usage WHERE field = 'completed'").fetchone()
        return int(row[0] or 0)
    except sqlite3.Error:
        return 0


def test_a_state_file_that_cannot_be_opened_stops_the_daemon_with_one_line(tmp_path):
    config = tmp_path / "apsd.toml"
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    config.write_text(f'[server]\nport = 0\n[state]\npath = "{blocker}/apsd.db"\n')
    answer = run_cli(str(config))
    assert answer.returncode == 2 and "Traceback" not in answer.stderr
    assert f"apsd: error: {config}: state: {blocker}/apsd.db: cannot open the state file" in answer.stderr


async def test_deleting_tenants_keeps_the_connection_and_logs_no_error(admin, caplog):
    """Every tenant DELETE used to log an ASGI error (``RuntimeError: no running event loop``: quart's
    default body of a bodiless 204, driven by asyncio) and drop the keep-alive connection. Now three
    creations and deletions, then a read, go over one connection; the 204s carry no body headers."""
    host, port = admin.url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    received = b""

    async def exchange(head: str, body: bytes = b"") -> bytes:
        nonlocal received
        await stream.send_all(head.encode() + f"Host: localhost\r\nAuthorization: Bearer {ADMIN}\r\n"
                              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        with trio.fail_after(30):
            while b"\r\n\r\n" not in received:
                chunk = await stream.receive_some()
                assert chunk, f"the connection was closed after {head!r}"
                received += chunk
            answer_head, received = received.split(b"\r\n\r\n", 1)
            length = next((int(line.split(b":")[1]) for line in answer_head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(received) < length:
                received += await stream.receive_some()
        received = received[length:]
        return answer_head

    async with stream:
        for name in ("gone-1", "gone-2", "gone-3"):
            made = await exchange("POST /admin/tenants HTTP/1.1\r\n",
                                  json.dumps({"name": name, "rate": 1, "burst": 1}).encode())
            assert made.startswith(b"HTTP/1.1 201"), made
            deleted = await exchange(f"DELETE /admin/tenants/{name} HTTP/1.1\r\n")
            assert deleted.startswith(b"HTTP/1.1 204"), deleted
            assert b"content-length" not in deleted.lower() and b"content-type" not in deleted.lower(), deleted
        listed = await exchange("GET /admin/tenants HTTP/1.1\r\n")
        assert listed.startswith(b"HTTP/1.1 200"), listed
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records
                                                                            if r.levelno >= logging.ERROR]


async def test_a_full_disk_makes_admin_writes_answer_503_and_they_work_again_once_it_has_room(nursery, tmp_path,
                                                                                              caplog):
    """The state file on a 1 MB tmpfs filled to the last byte: admin writes answer 503
    ``state_unavailable`` (SQLite: "database or disk is full"), never 500, and change nothing; reads
    still answer. Once the disk has room, the same write is made."""
    from tests.helpers import fill, small_filesystem

    with small_filesystem(tmp_path / "disk") as disk:
        config = attrs.evolve(admin_config(tmp_path), state=StateConfig(path=str(disk / "apsd.db"),
                                                                        flush_interval_s=0.1, poll_interval_s=0.1))
        running = await start_daemon(nursery, config)
        async with running.client as client:
            filler = fill(disk)
            tenant = {"name": "team-b", "rate": 1, "burst": 1}
            for _ in range(3):  # (a few, so that SQLite must grow its file or its WAL)
                answer = await client.post("/admin/tenants", headers=ADMIN_HEADERS, json=tenant)
                assert (answer.status_code, answer.json()["error"]) == (503, "state_unavailable"), answer.text
            assert "disk is full" in answer.json()["message"] or "disk I/O" in answer.json()["message"]
            assert (await client.get("/admin/audit", headers=ADMIN_HEADERS)).status_code == 200
            assert [t["name"] for t in (await client.get("/admin/tenants", headers=ADMIN_HEADERS)).json()["tenants"]] \
                == ["team-a"]
            filler.unlink()
            made = await client.post("/admin/tenants", headers=ADMIN_HEADERS, json=tenant)
            assert made.status_code == 201, made.text
        running.daemon.request_shutdown()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("apsd")]


async def test_a_world_readable_state_file_is_made_the_owners_only_at_start(tmp_path):
    """A state file restored from a backup (or copied) as 0644 stayed readable by everyone: apsd now
    makes it 0600 when it opens it, and says so in its log."""
    import os
    import stat

    state = tmp_path / "apsd.db"
    with sqlite3.connect(state) as db:
        db.execute("CREATE TABLE t (x)")
    os.chmod(state, 0o644)
    config = tmp_path / "apsd.toml"
    config.write_text(f'[server]\nport = 0\n[gpu]\ntime_scale = 0.001\n[state]\npath = "{state}"\n')
    process, _, seen = await start_apsd(str(config))
    try:
        assert stat.S_IMODE(state.stat().st_mode) == 0o600
        log = await stop_apsd(process, seen)
    finally:
        if process.returncode is None:
            process.kill()
    assert f"state: {state} was readable by others (mode 0644): now 0600" in log
