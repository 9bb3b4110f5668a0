"""API keys: who may do what, through real HTTP, the config loader and the ``apsd`` command."""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import signal
import subprocess

import attrs
import httpx
import pytest

from apsd.core.config import AuthConfig, ConfigError, ServerConfig, TenantConfig, load_config, parse_config
from apsd.plugins import make_plugin_manager
from apsd.serve import auth
from apsd.serve.auth import METRICS_READER, Caller, KeyRing, check_exposure, hash_key, is_loopback, new_key
from apsd.serve.daemon import Daemon
from tests.helpers import (
    APSD,
    FAST_GPU,
    infer_body,
    make_config,
    run_cli,
    start_apsd,
    start_daemon,
    stop_apsd,
    wait_for_log,
)

KEY_A, KEY_A2, KEY_B, ADMIN, SCRAPER = (new_key() for _ in range(5))


def keyed_config(**server):
    return make_config(
        server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=5.0, **server),
        gpu=FAST_GPU,
        auth=AuthConfig(admin_key_hashes=[hash_key(ADMIN)], metrics_key_hashes=[hash_key(SCRAPER)]),
        tenants={"tenant_a": TenantConfig(rate=1e4, burst=10_000, api_key_hashes=[hash_key(KEY_A), hash_key(KEY_A2)]),
                 "tenant_b": TenantConfig(rate=1e4, burst=10_000, api_key_hashes=[hash_key(KEY_B)]),
                 "keyless": TenantConfig(rate=1e4, burst=10_000)},
    )


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


#: An ``/infer`` body naming no tenant (the key names it); ``job(tenant_id=...)`` names one.
job = functools.partial(infer_body, None, "Hello", 8)


@pytest.fixture
async def keyed(nursery, caplog):
    caplog.set_level(logging.DEBUG)
    running = await start_daemon(nursery, keyed_config())
    async with running.client:
        yield running
    running.daemon.request_shutdown()


# -- the key ring -----------------------------------------------------------------------------------

def test_hash_key_is_sha256_of_the_key():
    assert hash_key("k" * 30) == "sha256:" + hashlib.sha256(b"k" * 30).hexdigest()
    assert new_key() != new_key() and len(new_key()) > 40 and auth.is_usable_key(new_key())


def test_identify_names_the_owner_or_answers_401():
    ring = KeyRing.from_config(keyed_config())
    assert ring.identify(f"Bearer {KEY_A}") == Caller(tenant="tenant_a")
    assert ring.identify(f"bearer  {KEY_A2}") == Caller(tenant="tenant_a")
    assert ring.identify(f"Bearer {ADMIN}") == Caller(tenant=None, admin=True, actor="admin:" + hash_key(ADMIN)[7:15])
    assert ring.identify(f"Bearer {SCRAPER}") == METRICS_READER == Caller(tenant=None, metrics_only=True)
    for header, error in [(None, "missing_api_key"), ("", "missing_api_key"), (f"Basic {KEY_A}", "invalid_authorization"),
                          (f"Bearer {KEY_A} extra", "invalid_authorization"), ("Bearer é", "invalid_authorization"),
                          (f"Bearer {KEY_A}x", "invalid_api_key"), (f"Bearer {hash_key(KEY_A)[7:]}", "invalid_api_key")]:
        refusal = ring.identify(header)
        assert (refusal.status, refusal.error) == (401, error), header
        assert refusal.headers["WWW-Authenticate"].startswith('Bearer realm="apsd"')
    assert KeyRing.from_config(make_config()).identify(None) == auth.OPEN_ACCESS


@pytest.mark.parametrize("which", [0, 2])
def test_every_stored_hash_is_compared_whichever_matches(monkeypatch, which):
    """No early exit: the work done does not depend on which key (or how much of one) matched."""
    calls = []
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or a == b)
    ring = KeyRing.from_config(keyed_config())
    assert len(ring.entries) == 5
    ring.identify(f"Bearer {[KEY_A, KEY_B, ADMIN][which]}")
    assert len(calls) == 5
    calls.clear()
    ring.identify("Bearer " + "n" * 40)
    assert len(calls) == 5


def test_only_a_metrics_key_is_a_metrics_key():
    ring = KeyRing.from_config(keyed_config())
    assert ring.is_metrics_key([f"Bearer {SCRAPER}"]) and ring.is_metrics_key([f"bearer  {SCRAPER}"])
    for values in ([], [f"Bearer {KEY_A}"], [f"Bearer {ADMIN}"], [f"Bearer {SCRAPER}x"], [f"Basic {SCRAPER}"],
                   [f"Bearer {SCRAPER}"] * 2, ["Bearer é"]):
        assert not ring.is_metrics_key(values), values
    unscraped = KeyRing.from_config(attrs.evolve(keyed_config(), auth=AuthConfig(admin_key_hashes=[hash_key(ADMIN)])))
    assert not unscraped.is_metrics_key([f"Bearer {SCRAPER}"])
    assert KeyRing.from_config(make_config(auth=AuthConfig(metrics_key_hashes=[hash_key(SCRAPER)]))).enabled
    assert not Caller(tenant="t").may_read_metrics() and METRICS_READER.may_read_metrics()
    assert not METRICS_READER.may_read_tenant("tenant_a") and not METRICS_READER.admin


# -- the config -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("data", "fragment"), [
    ({"tenants": {"a": {"rate": 1.0, "burst": 1, "api_key_hashes": [hash_key(KEY_B), KEY_A]}}},
     "tenants.a.api_key_hashes: must be an array of 'sha256:<64 hex digits>' strings, as 'apsd hash-key' "
     f"prints; entry [1] ({len(KEY_A)} characters, not shown) is not one"),
    ({"tenants": {"a": {"rate": 1.0, "burst": 1, "api_key_hashes": KEY_A}}},
     "tenants.a.api_key_hashes: must be an array of 'sha256:<64 hex digits>' strings"),
    ({"auth": {"admin_key_hashes": [{"key": KEY_A}]}}, "auth.admin_key_hashes: must be an array of"),
    ({"tenants": {"a": {"rate": 1.0, "burst": 1, "api_key_hashes": [7]}}},
     "tenants.a.api_key_hashes: must be an array of"),
    ({"tenants": {"a": {"rate": 1.0, "burst": 1, "api_key_hashes": [hash_key(KEY_A)]},
                  "b": {"rate": 1.0, "burst": 1, "api_key_hashes": [hash_key(KEY_A)]}}},
     "tenants.b.api_key_hashes: the same key hash is also in tenants.a.api_key_hashes"),
    ({"auth": {"admin_key_hashes": [hash_key(KEY_A)]},
      "tenants": {"a": {"rate": 1.0, "burst": 1, "api_key_hashes": [hash_key(KEY_A)]}}},
     "auth.admin_key_hashes: the same key hash is also in tenants.a"),
    ({"auth": {"admin_key_hashes": [hash_key(KEY_A)] * 2}}, "listed twice"),
    ({"auth": {"metrics_key_hashes": [KEY_A]}}, "auth.metrics_key_hashes: must be an array of 'sha256:<64 hex"),
    ({"auth": {"admin_key_hashes": [hash_key(KEY_A)], "metrics_key_hashes": [hash_key(KEY_A)]}},
     "auth.metrics_key_hashes: the same key hash is also in auth.admin_key_hashes"),
    ({"auth": {"metrics_key_hashes": [hash_key(KEY_A)]},
      "tenants": {"a": {"rate": 1.0, "burst": 1, "api_key_hashes": [hash_key(KEY_A)]}}},
     "auth.metrics_key_hashes: the same key hash is also in tenants.a"),
    ({"auth": {"admin_keys": []}}, "auth.admin_keys: must be a table of names and 'sha256:<64 hex digits>'"),
    ({"auth": {"admin_keys": {"alice": KEY_A}}}, "auth.admin_keys: alice: must be 'sha256:<64 hex digits>'"),
    ({"auth": {"admin_keys": {"al ice": hash_key(KEY_A)}}}, "auth.admin_keys: 'al ice': a key's name is 1-64"),
    ({"auth": {"admin_key_hashes": [hash_key(KEY_A)], "admin_keys": {"alice": hash_key(KEY_A)}}},
     "auth.admin_keys.alice: the same key hash is also in auth.admin_key_hashes"),
])
def test_bad_key_config_names_the_key(data, fragment):
    with pytest.raises(ConfigError) as error:
        parse_config(data, "k.toml")
    assert fragment in str(error.value) and str(error.value).startswith("k.toml: ")
    for secret in (KEY_A, KEY_A[:8], KEY_A[-8:]):  # a key pasted where its hash belongs is never echoed back
        assert secret not in str(error.value)


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True),
                                                ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                                ("::", False), ("10.0.0.1", False), ("example.com", False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_listening_beyond_loopback_needs_keys():
    open_config = make_config(server=ServerConfig(host="0.0.0.0"))
    with pytest.raises(ConfigError, match="refusing to listen on '0.0.0.0' without API keys"):
        check_exposure(open_config)
    with pytest.raises(ConfigError):
        Daemon.from_config(open_config, plugin_manager=make_plugin_manager(load_entry_points=False))
    check_exposure(attrs.evolve(keyed_config(), server=ServerConfig(host="0.0.0.0")))
    check_exposure(make_config())  # the quick start: 127.0.0.1, no keys


def test_the_command_refuses_an_open_wide_listener():
    result = run_cli("--host", "0.0.0.0", "--port", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "refusing to listen on '0.0.0.0' without API keys" in result.stderr
    assert "apsd hash-key --new" in result.stderr


# -- over HTTP --------------------------------------------------------------------------------------

async def test_missing_or_wrong_key_is_401_and_nothing_is_admitted(keyed):
    client = keyed.client
    missing = await client.post("/infer", json=job(tenant_id="tenant_a"))
    assert (missing.status_code, missing.json()["error"]) == (401, "missing_api_key")
    assert missing.headers["WWW-Authenticate"] == 'Bearer realm="apsd"'
    wrong = await client.post("/infer", json=job(), headers=bearer(KEY_A[:-1] + "Z"))
    assert (wrong.status_code, wrong.json()["error"]) == (401, "invalid_api_key")
    assert 'error="invalid_token"' in wrong.headers["WWW-Authenticate"]
    basic = await client.post("/infer", json=job(), headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert (basic.status_code, basic.json()["error"]) == (401, "invalid_authorization")
    metrics = (await client.get("/metrics.json", headers=bearer(ADMIN))).json()["requests"]
    assert metrics["admitted"] == 0
    assert metrics["rejected_by_error"] == {"missing_api_key": 1, "invalid_api_key": 1, "invalid_authorization": 1}


async def test_the_key_names_the_tenant(keyed):
    client = keyed.client
    for key, fields in [(KEY_A, {}), (KEY_A2, {}), (KEY_A, {"tenant_id": "tenant_a"}), (KEY_B, {})]:
        answer = await client.post("/infer", json=job(**fields), headers=bearer(key))
        assert answer.status_code == 200, answer.text
        assert answer.json()["tenant_id"] == ("tenant_b" if key == KEY_B else "tenant_a")
    other = await client.post("/infer", json=job(tenant_id="tenant_b"), headers=bearer(KEY_A))
    assert (other.status_code, other.json()["error"], other.json()["field"]) == (403, "tenant_mismatch", "tenant_id")
    admin = await client.post("/infer", json=job(tenant_id="tenant_a"), headers=bearer(ADMIN))
    assert (admin.status_code, admin.json()["error"]) == (403, "admin_cannot_submit")
    status = {t: (await client.get(f"/tenants/{t}/status", headers=bearer(ADMIN))).json()
              for t in ("tenant_a", "tenant_b")}
    assert (status["tenant_a"]["completed"], status["tenant_b"]["completed"]) == (3, 1)
    assert status["tenant_b"]["rejected"] == 0  # the mismatch was not charged to the tenant it named


async def test_a_tenant_reads_only_its_own_status_and_the_admin_reads_all(keyed):
    client = keyed.client
    assert (await client.get("/tenants/tenant_a/status", headers=bearer(KEY_A))).status_code == 200
    for path in ("/tenants/tenant_b/status", "/tenants/nobody/status"):  # existence is not revealed
        forbidden = await client.get(path, headers=bearer(KEY_A))
        assert (forbidden.status_code, forbidden.json()["error"]) == (403, "forbidden")
    assert (await client.get("/tenants/tenant_b/status")).status_code == 401
    assert (await client.get("/tenants/tenant_b/status", headers=bearer(ADMIN))).status_code == 200
    assert (await client.get("/tenants/nobody/status", headers=bearer(ADMIN))).status_code == 404


async def test_metrics_are_for_the_admin_and_health_is_open(keyed):
    client = keyed.client
    for path in ("/metrics", "/metrics.json"):
        assert (await client.get(path)).status_code == 401
        only = await client.get(path, headers=bearer(KEY_A))
        assert (only.status_code, only.json()["error"]) == (403, "admin_only")
        assert (await client.get(path, headers=bearer(ADMIN))).status_code == 200
    assert "apsd_conservation_ok" in (await client.get("/metrics", headers=bearer(ADMIN))).text
    health = await client.get("/health")
    assert health.status_code == 200 and "tenant" not in health.text


async def test_a_metrics_key_reads_the_metrics_and_nothing_else(keyed):
    """What a Prometheus server holds instead of the admin key: /metrics and /metrics.json only."""
    client = keyed.client
    scrape = await client.get("/metrics", headers=bearer(SCRAPER))
    assert scrape.status_code == 200 and "apsd_conservation_ok" in scrape.text
    assert scrape.headers["content-type"].startswith("text/plain")
    as_json = await client.get("/metrics", params={"format": "json"}, headers=bearer(SCRAPER))
    assert as_json.status_code == 200 and "requests" in as_json.json()
    assert (await client.get("/metrics.json", headers=bearer(SCRAPER))).json()["requests"]["admitted"] == 0
    for path in ("/metrics", "/metrics.json"):  # the admin key still reads them
        assert (await client.get(path, headers=bearer(ADMIN))).status_code == 200
    refused = [await client.post("/infer", json=job(), headers=bearer(SCRAPER)),
               await client.post("/infer", json=job(tenant_id="tenant_a"), headers=bearer(SCRAPER)),
               await client.get("/tenants/tenant_a/status", headers=bearer(SCRAPER)),
               await client.get("/tenants/nobody/status", headers=bearer(SCRAPER)),
               await client.get("/nowhere", headers=bearer(SCRAPER))]
    for answer in refused:
        assert (answer.status_code, answer.json()["error"]) == (403, "metrics_only"), answer.text
        assert answer.headers.get("connection") is None  # (the body was read: the connection stays)
    chat = await client.post("/v1/chat/completions", headers=bearer(SCRAPER), json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    models = await client.get("/v1/models", headers=bearer(SCRAPER))
    for answer in (chat, models):  # (OpenAI's error shape under /v1)
        assert (answer.status_code, answer.json()["error"]["code"]) == (403, "metrics_only"), answer.text
    for path in ("/health", "/ready", "/ui", "/ui/app.js", "/ui/style.css"):  # open stays open (the page's
        assert (await client.get(path, headers=bearer(SCRAPER))).status_code == 200, path  # files hold no data)
    status = await client.get("/admin/status", headers=bearer(SCRAPER))  # (its data is the admin's)
    assert (status.status_code, status.json()["error"]) == (403, "metrics_only")
    assert (await client.post("/infer", json=job(), headers=bearer(KEY_A))).status_code == 200  # (unaffected)
    metrics = (await client.get("/metrics.json", headers=bearer(SCRAPER))).json()["requests"]
    assert (metrics["admitted"], metrics["rejected_by_error"]) == (1, {"metrics_only": 8})
    assert (await client.get("/tenants/tenant_a/status", headers=bearer(ADMIN))).json()["rejected"] == 0


async def test_an_unauthenticated_body_is_never_parsed(keyed):
    """401 before the body is looked at; the body is then read and dropped so the connection stays
    usable, unless it is over max_body_bytes (then the answer says Connection: close)."""
    answer = await keyed.client.post("/infer", content=b"x" * 60_000)  # never parsed: 401, not 400
    assert (answer.status_code, answer.headers.get("connection")) == (401, None)
    too_big = await keyed.client.post("/infer", content=b"x" * 1_100_000)
    assert (too_big.status_code, too_big.headers["connection"]) == (401, "close")
    assert (await keyed.client.get("/health")).status_code == 200  # the client reconnects


async def test_answers_in_normal_operation_keep_the_connection_alive(keyed):
    """Only an unread body (or draining) closes a connection: GETs and served requests keep it."""
    answers = [await keyed.client.get("/health"),
               await keyed.client.get("/metrics", headers=bearer(ADMIN)),
               await keyed.client.get("/tenants/tenant_a/status", headers=bearer(KEY_A)),
               await keyed.client.post("/infer", json=job(), headers=bearer(KEY_A)),
               await keyed.client.get("/tenants/tenant_b/status", headers=bearer(KEY_A))]   # a 403, no body
    assert [a.status_code for a in answers] == [200, 200, 200, 200, 403]
    assert [a.headers.get("connection") for a in answers] == [None] * 5


async def test_two_authorization_headers_are_refused(keyed):
    for first, second in [(KEY_B, KEY_A), ("junk", ADMIN), (KEY_A, KEY_A)]:
        answer = await keyed.client.get("/tenants/tenant_a/status", headers=[
            ("Authorization", f"Bearer {first}"), ("Authorization", f"Bearer {second}")])
        assert (answer.status_code, answer.json()["error"]) == (401, "invalid_authorization")
        assert "more than one" in answer.json()["message"]


async def test_keys_never_reach_the_log_or_an_answer(keyed, caplog):
    client = keyed.client
    answers = [await client.post("/infer", json=job(), headers=bearer(KEY_A)),
               await client.post("/infer", json=job(tenant_id="tenant_b"), headers=bearer(KEY_A)),
               await client.post("/infer", json=job(), headers=bearer(KEY_A + "x")),
               await client.post("/infer", json=job(), headers={"Authorization": f"Token {KEY_B}"}),
               await client.get("/metrics", headers=bearer(ADMIN)),
               await client.get("/tenants/tenant_b/status", headers=bearer(KEY_A))]
    assert answers[0].status_code == 200
    await keyed.daemon.reload()  # (the config's hashes are not logged either)
    texts = [caplog.text, *(a.text for a in answers), *(str(a.headers) for a in answers)]
    for secret in (KEY_A, KEY_B, ADMIN, SCRAPER, hash_key(KEY_A)[7:], hash_key(ADMIN)[7:], hash_key(SCRAPER)[7:]):
        assert not any(secret in text for text in texts)
    assert "tenants keyless have none" in caplog.text


async def test_keys_rotate_on_reload(nursery, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    new = new_key()
    path = tmp_path / "apsd.toml"

    def write(*keys: str) -> None:
        hashes = ", ".join(f'"{hash_key(k)}"' for k in keys)
        path.write_text(f'[server]\nport = 0\n[gpu]\ntime_scale = 0.001\n'
                        f'[tenants.t]\nrate = 1e4\nburst = 10000\napi_key_hashes = [{hashes}]\n')

    write(KEY_A)
    daemon = Daemon.from_config(load_config(path), handle_signals=False, config_path=str(path),
                                plugin_manager=make_plugin_manager(load_entry_points=False))
    url = (await nursery.start(daemon.run))[0]
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        assert (await client.post("/infer", json=job(), headers=bearer(KEY_A))).status_code == 200
        write(KEY_A, new)                       # both work while clients move over...
        assert await daemon.reload()
        assert "API keys changed for t" in caplog.text   # (an operator can see the rotation took)
        for key in (KEY_A, new):
            assert (await client.post("/infer", json=job(), headers=bearer(key))).status_code == 200
        write(new)                              # ...then the old one is retired
        assert await daemon.reload()
        assert (await client.post("/infer", json=job(), headers=bearer(KEY_A))).status_code == 401
        assert (await client.post("/infer", json=job(), headers=bearer(new))).status_code == 200
    daemon.request_shutdown()


async def test_a_reload_that_would_drop_every_key_beyond_loopback_is_refused(nursery, tmp_path):
    path = tmp_path / "apsd.toml"
    keyed_text = (f'[server]\nhost = "0.0.0.0"\nport = 0\n[tenants.t]\nrate = 1e4\nburst = 10000\n'
                  f'api_key_hashes = ["{hash_key(KEY_A)}"]\n')
    path.write_text(keyed_text)
    daemon = Daemon.from_config(load_config(path), handle_signals=False, config_path=str(path),
                                plugin_manager=make_plugin_manager(load_entry_points=False))
    await nursery.start(daemon.run)
    path.write_text(keyed_text.replace(f'"{hash_key(KEY_A)}"', ""))
    assert not await daemon.reload()
    assert "without API keys" in daemon.reload_error
    assert KeyRing.from_config(daemon.pipeline.config).enabled
    daemon.request_shutdown()


async def test_an_emptied_or_truncated_config_on_reload_keeps_the_keys_and_the_tenants(tmp_path):
    """``: > apsd.toml; kill -HUP`` on a loopback daemon with keys (as behind nginx) must not switch
    authentication off, nor delete the file's tenants from the state and bring in the default ones;
    neither may a file truncated to ``[server]``, one that lost every key, or one that lost its
    ``[tenants]``. Each is refused with one ERROR line; a sound reload still applies afterwards."""
    path = tmp_path / "apsd.toml"
    server = f'[server]\nhost = "127.0.0.1"\nport = 0\n[state]\npath = "{tmp_path / "apsd.db"}"\n'
    auth = f'[auth]\nadmin_key_hashes = ["{hash_key(ADMIN)}"]\n'
    tenants = f'[tenants.team]\nrate = 1e4\nburst = 10000\napi_key_hashes = ["{hash_key(KEY_A)}"]\n'
    path.write_text(server + "[gpu]\ntime_scale = 0.001\n" + auth + tenants)
    process, url, seen = await start_apsd(str(path))
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async def still_guarded() -> None:
                assert (await client.get("/admin/tenants")).status_code == 401
                assert (await client.post("/infer", json=job(tenant_id="tenant_a"))).status_code == 401
                assert (await client.post("/infer", json=job(tenant_id="team"))).status_code == 401
                assert (await client.post("/infer", json=job(), headers=bearer(KEY_A))).status_code == 200
                listed = (await client.get("/admin/tenants", headers=bearer(ADMIN))).json()["tenants"]
                assert [t["name"] for t in listed] == ["team"]

            await still_guarded()
            for broken, why in [("", b"the file sets nothing"),
                                ("# the rest was lost\n\n", b"the file sets nothing"),
                                (server, b"configures no API key"),
                                (server + tenants.replace(f'"{hash_key(KEY_A)}"', ""), b"configures no API key"),
                                (server + auth, b"declares no [tenants]")]:
                path.write_text(broken)
                mark = len(b"".join(seen))
                process.send_signal(signal.SIGHUP)
                await wait_for_log(process, seen, why, after=mark)
                assert b"reload refused, the running configuration stays" in b"".join(seen)[mark:]
                await still_guarded()
            path.write_text(server + auth + tenants + "[tenants.more]\nrate = 10\nburst = 100\n")
            mark = len(b"".join(seen))
            process.send_signal(signal.SIGHUP)
            await wait_for_log(process, seen, b"reloaded", after=mark)
            names = [t["name"] for t in (await client.get("/admin/tenants", headers=bearer(ADMIN))).json()["tenants"]]
            assert names == ["more", "team"]
            audit = (await client.get("/admin/audit", headers=bearer(ADMIN))).json()["entries"]
            assert not any(entry["action"] == "tenant.delete" for entry in audit)
        log = await stop_apsd(process, seen)
    finally:
        if process.returncode is None:
            process.kill()
    assert "Traceback" not in log and "tenant_a" not in log


# -- the apsd command -------------------------------------------------------------------------------

def test_hash_key_command():
    made = run_cli("hash-key", "--new")
    assert made.returncode == 0, made.stderr
    key = made.stdout.split("key:")[1].split()[0]
    assert made.stdout.split("hash:")[1].split()[0] == hash_key(key)
    piped = subprocess.run([APSD, "hash-key"], input=key + "\n", capture_output=True, text=True, timeout=60)
    assert (piped.returncode, piped.stdout.strip()) == (0, hash_key(key))
    assert key not in piped.stdout + piped.stderr
    weak = subprocess.run([APSD, "hash-key"], input="hunter2\n", capture_output=True, text=True, timeout=60)
    assert weak.returncode == 2 and "at least 24 characters" in weak.stderr and "Traceback" not in weak.stderr


async def test_an_operator_sets_up_keys_with_the_command(tmp_path):
    """docs/how-to/api-keys.md's steps: hash a key, put the hash in the config, start apsd, call it with the key."""
    key = run_cli("hash-key", "--new").stdout.split("key:")[1].split()[0]
    hashed = subprocess.run([APSD, "hash-key"], input=key, capture_output=True, text=True, timeout=60).stdout.strip()
    path = tmp_path / "apsd.toml"
    path.write_text(f'[server]\nhost = "0.0.0.0"\nport = 0\n[gpu]\ntime_scale = 0.001\n'
                    f'[tenants.team]\nrate = 1e4\nburst = 10000\napi_key_hashes = ["{hashed}"]\n')
    process, url, seen = await start_apsd(str(path), "--log-level", "DEBUG")
    try:
        url = url.replace("0.0.0.0", "127.0.0.1")
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            answer = await client.post("/infer", json=job(), headers=bearer(key))
            assert answer.status_code == 200 and answer.json()["tenant_id"] == "team"
            assert (await client.post("/infer", json=job(tenant_id="team"))).status_code == 401
        # HTTP/2 (prior knowledge): hpack logs every header it decodes at DEBUG, so apsd keeps other
        # libraries' loggers at INFO even under --log-level DEBUG
        async with httpx.AsyncClient(base_url=url, timeout=30, http1=False, http2=True) as client:
            answer = await client.post("/infer", json=job(), headers=bearer(key))
            assert (answer.status_code, answer.http_version) == (200, "HTTP/2")
        log = await stop_apsd(process, seen)
    finally:
        if process.returncode is None:
            process.kill()
    assert key not in log and hashed[7:] not in log
