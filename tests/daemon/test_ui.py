"""The status page (``/ui``) and ``/admin/status``: over real HTTP, and driven in a real headless Chromium.

The browser test drives Debian's ``chromium`` (``$APSD_CHROMIUM``, else ``chromium`` on PATH, else
``/usr/bin/chromium``) through Playwright's synchronous API, in a thread, while the daemon runs in
this process under trio. Playwright never downloads a browser here: it is given the binary. Without
Chromium or Playwright the test is skipped, or fails when ``APSD_REQUIRE_BACKENDS=1`` (CI sets it;
``.ci/run`` installs the package).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from apsd.core.config import AuthConfig, ServerConfig, StateConfig, TenantConfig
from apsd.serve.auth import hash_key
from apsd.serve.http import ui
from tests.helpers import FAST_GPU, infer_body, make_config, start_daemon, wait_until
from tests.llama_server import REQUIRE_ENV

ADMIN = "status-admin-key-" + "a" * 30
KEY_ALPHA = "alpha-tenant-key-" + "b" * 30
KEY_BETA = "beta-tenant-key-" + "c" * 30
KEY_GAMMA = "gamma-tenant-key-" + "d" * 30
#: Environment: the Chromium binary to drive, overriding PATH.
CHROMIUM_ENV = "APSD_CHROMIUM"
#: Playwright's limit on each step in the browser (a real second each; bounded waits, never sleeps).
STEP_MS = 20_000


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def status_config(tmp_path: Path) -> Any:
    return make_config(
        server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=5.0),  # (real time: a 60 s window)
        auth=AuthConfig(admin_key_hashes=[hash_key(ADMIN)]),
        state=StateConfig(path=str(tmp_path / "apsd.db"), flush_interval_s=0.2, poll_interval_s=0.2),
        tenants={"alpha": TenantConfig(rate=1e4, burst=10_000, weight=2.0, api_key_hashes=[hash_key(KEY_ALPHA)]),
                 "beta": TenantConfig(rate=1e4, burst=10_000, api_key_hashes=[hash_key(KEY_BETA)])})


@pytest.fixture
async def daemon(nursery, tmp_path):
    running = await start_daemon(nursery, status_config(tmp_path))
    async with running.client:
        yield running
    running.daemon.request_shutdown()


@pytest.fixture
def chromium() -> str:
    """The Chromium binary, with Playwright importable; skip (or fail under ``APSD_REQUIRE_BACKENDS=1``).
    (A synchronous fixture, named before the daemon's: the skip happens before anything starts.)"""
    reason = None
    binary = os.environ.get(CHROMIUM_ENV) or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.access(binary, os.X_OK):
        reason = (f"Chromium is not installed (Debian package 'chromium', or ${CHROMIUM_ENV}); "
                  ".ci/run installs it")
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            reason = "Playwright is not installed (pip install -e '.[test]')"
    if reason is not None:
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return binary


# -- /admin/status and the page's files over HTTP ----------------------------------------------------

async def test_the_page_is_served_without_a_key_with_a_strict_policy_and_holds_no_data(daemon):
    client = daemon.client
    page = await client.get("/ui")
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    csp = page.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert "frame-ancestors 'none'" in csp and page.headers["X-Content-Type-Options"] == "nosniff"
    html = page.text
    assert '<script src="/ui/app.js"' in html and "<script>" not in html and " style=" not in html
    assert "alpha" not in html and "http://" not in html.replace("http://www.w3.org", "")  # no data, nothing external
    script = await client.get("/ui/app.js")
    assert script.status_code == 200 and script.headers["Content-Type"].startswith("text/javascript")
    assert "innerHTML" not in script.text and "https://" not in script.text
    style = await client.get("/ui/style.css")
    assert style.status_code == 200 and style.headers["Content-Type"].startswith("text/css")
    assert "@import" not in style.text and "url(" not in style.text
    for missing in ("/ui/nothing.js", "/ui/..", "/ui/%2e%2e%2fhttp%2fui.py", "/ui/.hidden.js", "/ui/index.html",
                    "/ui/", "/ui/app.js/x"):
        answer = await client.get(missing)
        assert answer.status_code == 404 and answer.json()["error"] == "not_found", missing


async def test_admin_status_needs_the_admin_key(daemon):
    client = daemon.client
    assert (await client.get("/admin/status")).status_code == 401
    tenant = await client.get("/admin/status", headers=bearer(KEY_ALPHA))
    assert tenant.status_code == 403 and tenant.json()["error"] == "admin_only"
    assert (await client.get("/admin/status", headers=bearer("x" * 40))).status_code == 401


async def test_admin_status_reports_tenants_engine_fairness_and_usage(daemon):
    client = daemon.client
    for key in (KEY_ALPHA, KEY_ALPHA, KEY_BETA):
        assert (await client.post("/infer", json=infer_body(None, tokens=20), headers=bearer(key))).status_code == 200
    refused = await client.post("/infer", json=infer_body(None, tokens=10**6), headers=bearer(KEY_BETA))
    assert refused.status_code == 413
    answer = await client.get("/admin/status", headers=bearer(ADMIN))
    assert answer.status_code == 200 and answer.headers["Cache-Control"] == "no-store"
    status = answer.json()
    assert set(status) == {"at", "accepting", "engine", "tenants", "backends", "fairness", "usage"}
    tenants = {t["name"]: t for t in status["tenants"]}
    assert list(tenants) == ["alpha", "beta"]
    alpha, beta = tenants["alpha"], tenants["beta"]
    assert (alpha["rate"], alpha["burst"], alpha["weight"], alpha["disabled"]) == (1e4, 10_000, 2.0, False)
    assert alpha["completed"] == 2 and beta["completed"] == 1 and alpha["queued"] == alpha["running"] == 0
    assert beta["rejected"] == 1 and list(beta["rejected_by_error"]) == ["exceeds_batch_capacity"]
    assert alpha["window_tokens"] == 40 and beta["window_tokens"] == 20
    assert alpha["service_share"] == pytest.approx(2 / 3, abs=1e-4)
    assert alpha["weight_share"] == pytest.approx(2 / 3, abs=1e-4)
    assert alpha["ttft_p99_ms"] is not None and alpha["ttft_p99_ms"] >= 0 and 0 <= alpha["tokens_available"] <= 10_000
    assert status["backends"] == []  # a simulated engine
    engine = status["engine"]
    assert engine["kind"] == "batch" and engine["requests"]["completed"] == 3 and engine["queue_depth"] == 0
    assert set(engine["queue_depth_by_band"]) == {"1-3", "4-6", "7-10"}
    fairness = status["fairness"]
    assert fairness["jain_window"] == pytest.approx(1.0) and fairness["span_s"] == ui.SAMPLES * ui.SAMPLE_INTERVAL_S
    latest = fairness["history"][-1]
    assert latest["jain"] == pytest.approx(1.0) and set(latest["shares"]) == {"alpha", "beta"} and latest["age_s"] == 0
    assert fairness["history"][0]["age_s"] >= 0 and status["at"] > 1.7e9
    assert len(fairness["history"]) >= 2  # the daemon's sampler took one when it started; "now" is the last
    usage = status["usage"]
    assert usage["group_by"] == "day" and usage["days"] == ui.USAGE_DAYS

    def usage_rows(status: dict[str, Any]) -> dict[str, Any]:
        return {row["tenant"]: row for row in status["usage"]["rows"]}

    # (a reading taken while a flush writes may miss that flush's rows for one reading, as
    # GET /admin/usage may: wait, bounded, for one that has them)
    with trio.fail_after(30):
        while (rows := usage_rows(status)).keys() != {"alpha", "beta"}:
            await trio.sleep(0.5)
            status = (await client.get("/admin/status", headers=bearer(ADMIN))).json()
    assert rows["alpha"]["completed"] == 2 and rows["beta"]["completed"] == rows["beta"]["refused"] == 1


async def test_the_sampler_keeps_a_bounded_history_and_survives_a_failed_sample(daemon, monkeypatch):
    sampler = ui.sampler_for(daemon.daemon.pipeline)
    assert ui.sampler_for(daemon.daemon.pipeline) is sampler
    assert sampler.history.maxlen == ui.SAMPLES
    for _ in range(ui.SAMPLES + 5):
        sampler.record()
    assert len(sampler.history) == ui.SAMPLES
    fast = ui.StatusSampler(daemon.daemon.pipeline, interval_s=0.01, samples=3)
    calls = []

    def failing() -> dict[str, Any]:
        calls.append(1)
        raise RuntimeError("boom")

    monkeypatch.setattr(fast, "sample", failing)
    with trio.move_on_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fast.run)
            await wait_until(lambda: len(calls) >= 3, limit_s=5)
            nursery.cancel_scope.cancel()
    assert len(calls) >= 3 and not fast.history


# -- in a real browser ---------------------------------------------------------------------------------

def browse(chromium: str, url: str, shots: Path) -> None:
    """The operator's session, in Chromium (runs in a thread: Playwright's sync API, sync httpx)."""
    from playwright.sync_api import expect, sync_playwright

    http = httpx.Client(base_url=url, timeout=30)
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.set_default_timeout(STEP_MS)
            expect.set_options(timeout=STEP_MS)
            # (the page's own 401 and 403, before and after the tenant's key, are expected: the browser logs them)
            page.on("console", lambda m: problems.append(m.text) if m.type == "error"
                    and not m.text.startswith("Failed to load resource") else None)
            page.on("response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400
                    and not (r.url == url + "/admin/status" and r.status in (401, 403)) else None)
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("request", lambda r: problems.append(f"fetched {r.url}") if not r.url.startswith(url) else None)

            # The page loads without data and asks for the key; a tenant's key is refused.
            loaded = page.goto(url + "/ui")
            assert loaded is not None and "default-src 'self'" in loaded.headers["content-security-policy"]
            expect(page.locator("#login")).to_be_visible()
            expect(page.locator("#dashboard")).to_be_hidden()
            page.fill("#key-input", KEY_ALPHA)
            page.click("#key-form button[type=submit]")
            expect(page.locator("#login-error")).to_contain_text("admin key")
            assert page.evaluate("sessionStorage.getItem('apsd-admin-key')") is None

            # The admin key opens it; the configured tenants are listed.
            page.fill("#key-input", ADMIN)
            page.click("#key-form button[type=submit]")
            expect(page.locator("#dashboard")).to_be_visible()
            expect(page.locator("#connection")).to_have_text("live")
            alpha = page.locator('#tenants tr[data-tenant="alpha"]')
            expect(alpha.locator(".name")).to_have_text("alpha")
            expect(alpha.locator(".weight")).to_have_text("2")
            expect(page.locator('#tenants tr[data-tenant="beta"] .state')).to_have_text("enabled")
            expect(page.locator("#no-backends")).to_be_visible()
            assert page.evaluate("sessionStorage.getItem('apsd-admin-key')") == ADMIN
            assert ADMIN not in page.url
            expect(alpha.locator(".completed")).to_have_text("0")

            # Load arrives: the page's figures follow (polled every 2 s; waited for, bounded).
            for _ in range(6):
                sent = http.post("/infer", json=infer_body(None, tokens=30), headers=bearer(KEY_ALPHA))
                assert sent.status_code == 200
            assert http.post("/infer", json=infer_body(None, tokens=10), headers=bearer(KEY_BETA)).status_code == 200
            expect(alpha.locator(".completed")).to_have_text("6")
            expect(alpha.locator(".share-label")).to_have_text("95% / 67%")
            expect(page.locator('#fairness-plot polyline[data-series="alpha"]')).to_have_count(1)
            expect(page.locator('#fairness-plot polyline[data-series="Jain index"]')).to_have_count(1)
            expect(page.locator('#usage tr[data-tenant="alpha"] td').nth(3)).to_have_text("6")

            # A key label that is HTML is shown as text, never run.
            labelled = http.post("/admin/tenants/beta/keys", headers=bearer(ADMIN),
                                 json={"label": '<img src=x onerror="window.hacked=1">'})
            assert labelled.status_code == 201

            # Create a tenant through the form: it is in the admin API at once.
            form = page.locator("#create-tenant")
            form.locator("input[name=name]").fill("gamma")
            form.locator("input[name=rate]").fill("5000")
            form.locator("input[name=burst]").fill("20000")
            form.locator("input[name=weight]").fill("3")
            form.locator("button[type=submit]").click()
            expect(page.locator("#notice")).to_have_text("Created tenant gamma")
            gamma = page.locator('#tenants tr[data-tenant="gamma"]')
            expect(gamma.locator(".weight")).to_have_text("3")
            listed = {t["name"]: t for t in http.get("/admin/tenants", headers=bearer(ADMIN)).json()["tenants"]}
            assert (listed["gamma"]["rate"], listed["gamma"]["burst"], listed["gamma"]["weight"]) == (5000, 20000, 3)

            # Issue a key: shown once, and it works.
            gamma.locator("button[data-action=issue-key]").click()
            expect(page.locator("#issued")).to_be_visible()
            expect(page.locator("#issued-tenant")).to_have_text("gamma")
            key = page.locator("#issued-key").text_content()
            assert key and len(key) > 20
            served = http.post("/infer", json=infer_body(None, tokens=5), headers=bearer(key))
            assert served.status_code == 200, served.text
            expect(gamma.locator(".completed")).to_have_text("1")
            expect(page.locator('#keys tr[data-tenant="beta"] td').nth(3)).to_have_text(
                '<img src=x onerror="window.hacked=1">')
            assert page.evaluate("window.hacked") is None
            page.click("#issued-dismiss")
            expect(page.locator("#issued")).to_be_hidden()
            assert key not in page.content()
            page.screenshot(path=str(shots / "status-page.png"), full_page=True)

            # Disable a tenant: its requests are refused; enable it again: served.
            alpha.locator("button[data-action=disable]").click()
            expect(alpha.locator(".state")).to_have_text("disabled")
            refused = http.post("/infer", json=infer_body(None, tokens=5), headers=bearer(KEY_ALPHA))
            assert refused.status_code == 403 and refused.json()["error"] == "tenant_disabled"
            expect(alpha.locator(".refusals")).to_contain_text("tenant_disabled: 1")
            alpha.locator("button[data-action=enable]").click()
            expect(alpha.locator(".state")).to_have_text("enabled")
            assert http.post("/infer", json=infer_body(None, tokens=5), headers=bearer(KEY_ALPHA)).status_code == 200

            # Revoke the issued key (two clicks): it no longer works.
            key_row = page.locator('#keys tr[data-tenant="gamma"]')
            key_row.locator("button[data-action=revoke]").click()
            key_row.locator("button[data-action=confirm-revoke]").click()
            expect(key_row.locator(".key-state")).to_have_text("revoked")
            assert http.post("/infer", json=infer_body(None, tokens=5), headers=bearer(key)).status_code == 401

            # Forgetting the key leaves nothing behind in the tab.
            page.click("#forget-key")
            expect(page.locator("#login")).to_be_visible()
            assert page.evaluate("sessionStorage.length") == 0
            assert not problems, problems
        finally:
            browser.close()
            http.close()


@pytest.mark.timeout(240)
async def test_an_operator_uses_the_status_page_in_chromium(chromium, daemon, tmp_path):
    await trio.to_thread.run_sync(functools.partial(browse, chromium, daemon.url, tmp_path))
    assert (tmp_path / "status-page.png").stat().st_size > 10_000


# -- money and named keys, in a real browser ------------------------------------------------------------

ALICE = "alice-admin-key-" + "e" * 30


def money_config(tmp_path: Path) -> Any:
    """A named admin key (alice), the batch model priced so that a request of 4 prompt and 10 output
    tokens costs $0.0104, and a tenant with a dollar budget; state kept in ``tmp_path``."""
    return make_config(
        {"auth": {"admin_keys": {"alice": hash_key(ALICE)}},
         "prices": {"apsd-batch": {"input_per_1m_usd": 100.0, "output_per_1m_usd": 1000.0}}},
        server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=2.0), gpu=FAST_GPU,
        state=StateConfig(path=str(tmp_path / "apsd.db"), flush_interval_s=0.2, poll_interval_s=0.2),
        tenants={"team": TenantConfig(rate=1e6, burst=10**6, budget_usd=1.0)})


def issue_and_watch_keys(chromium: str, url: str, shots: Path) -> str:
    """Alice issues a named agent's key with limits of its own through the page's form, spends its
    budget, and watches the page show the key's name, owner, limits, budget and spend, and the tenant's
    spend. Returns the issued key."""
    from playwright.sync_api import expect, sync_playwright

    http = httpx.Client(base_url=url, timeout=30)
    problems: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1200})
            page.set_default_timeout(STEP_MS)
            expect.set_options(timeout=STEP_MS)
            page.on("pageerror", lambda e: problems.append(str(e)))
            # (the page asks /admin/status before it has a key: that 401 is expected)
            page.on("response", lambda r: problems.append(f"{r.status} {r.url}") if r.status >= 400
                    and not (r.url == url + "/admin/status" and r.status == 401) else None)
            page.goto(url + "/ui")
            page.fill("#key-input", ALICE)
            page.click("#key-form button[type=submit]")
            expect(page.locator("#dashboard")).to_be_visible()

            form = page.locator("#issue-key")
            expect(form.locator("select[name=tenant] option")).to_have_text(["team"])
            form.locator("input[name=name]").fill("reviewer")
            form.locator("input[name=owner]").fill("claude-code/reviewer")
            form.locator("select[name=owner_kind]").select_option("agent")
            form.locator("input[name=max_concurrency]").fill("1")
            form.locator("input[name=budget_usd]").fill("0.0208")
            form.locator("button[type=submit]").click()
            expect(page.locator("#notice")).to_have_text("Issued key reviewer for team")
            key = page.locator("#issued-key").text_content()
            assert key and len(key) > 20
            page.click("#issued-dismiss")

            # its own dollar budget holds it (two requests), not its tenant's other key
            body = infer_body(None, "x" * 16, 10)
            answers = [http.post("/infer", json=body, headers=bearer(key)) for _ in range(3)]
            assert [a.status_code for a in answers] == [200, 200, 429], answers[-1].text
            assert answers[2].json()["error"] == "budget_exhausted" and "key 'reviewer'" in answers[2].json()["message"]
            other = http.post("/admin/tenants/team/keys", headers=bearer(ALICE), json={"name": "alice-laptop",
                              "owner": "alice@example.com", "owner_kind": "person"}).json()["key"]
            assert http.post("/infer", json=body, headers=bearer(other)).status_code == 200

            row = page.locator("#keys tr", has_text="reviewer")
            expect(row.locator(".key-name")).to_have_text("reviewer")
            expect(row.locator(".key-owner")).to_have_text("claude-code/reviewer (agent)")
            expect(row.locator(".key-limits")).to_have_text("1 at once; $0.0208/day")
            expect(row.locator(".key-budget")).to_have_text("$0.0208 / $0.0208")
            expect(row.locator(".key-spend")).to_have_text("$0.0208")
            laptop = page.locator("#keys tr", has_text="alice-laptop")
            expect(laptop.locator(".key-owner")).to_have_text("alice@example.com (person)")
            expect(laptop.locator(".key-limits")).to_have_text("none")
            expect(laptop.locator(".key-spend")).to_have_text("$0.0104")
            team = page.locator('#tenants tr[data-tenant="team"]')
            expect(team.locator(".spend")).to_have_text("$0.0312")
            expect(team.locator(".budget")).to_have_text("$0.0312 / $1.00")
            page.screenshot(path=str(shots / "keys-and-spend.png"), full_page=True)
            assert not problems, problems
            return key
        finally:
            browser.close()
            http.close()


@pytest.mark.timeout(240)
async def test_named_keys_with_limits_are_issued_shown_and_kept_across_a_restart(chromium, nursery, tmp_path):
    """Through /admin and /ui (Chromium): a named key with an owner and limits of its own; its usage per
    key in /admin/usage (JSON and CSV, with its name and spend); the audit log names alice, the admin
    key that did it; and after a restart on the same state the key, its limits and its spend are there."""
    async with trio.open_nursery() as first:
        running = await start_daemon(first, money_config(tmp_path))
        key = await trio.to_thread.run_sync(functools.partial(issue_and_watch_keys, chromium, running.url, tmp_path))
        await trio.sleep(0.5)   # (the usage flush: every 0.2 s)
        await running.client.aclose()
        running.daemon.request_shutdown()
    assert (tmp_path / "keys-and-spend.png").stat().st_size > 10_000

    again = await start_daemon(nursery, money_config(tmp_path))
    admin = bearer(ALICE)
    rows = (await again.client.get("/admin/usage", headers=admin, params={"tenant": "team", "by": "key"})).json()["rows"]
    by_name = {r["key_name"]: r for r in rows}
    assert set(by_name) == {"reviewer", "alice-laptop"}
    assert by_name["reviewer"]["completed"] == 2 and by_name["reviewer"]["spend_usd"] == pytest.approx(0.0208)
    assert by_name["alice-laptop"]["completed"] == 1 and by_name["alice-laptop"]["spend_usd"] == pytest.approx(0.0104)
    csv_lines = (await again.client.get("/admin/usage", headers=admin, params={"tenant": "team", "by": "key",
                                                                                  "format": "csv"})).text.splitlines()
    header = csv_lines[0].split(",")
    cells = {line.split(",")[header.index("key_name")]: line.split(",") for line in csv_lines[1:]}
    assert float(cells["reviewer"][header.index("spend_usd")]) == pytest.approx(0.0208)
    audit = (await again.client.get("/admin/audit", headers=admin)).json()["entries"]
    issued = [e for e in audit if e["action"] == "key.issue"]
    assert [(e["actor"], e["after"]["name"]) for e in issued] == [("admin:alice", "alice-laptop"),
                                                                 ("admin:alice", "reviewer")]
    keys = (await again.client.get("/admin/tenants/team/keys", headers=admin)).json()["keys"]
    reviewer = next(k for k in keys if k["name"] == "reviewer")
    assert (reviewer["owner"], reviewer["owner_kind"], reviewer["limits"]["max_concurrency"],
            reviewer["limits"]["budget_usd"]) == ("claude-code/reviewer", "agent", 1, 0.0208)
    refused = await again.client.post("/infer", json=infer_body(None, "x" * 16, 10), headers=bearer(key))
    assert refused.status_code == 429 and refused.json()["error"] == "budget_exhausted"   # (its spend was kept)
    again.daemon.request_shutdown()


# -- no keys: a page of another origin cannot act through the operator's browser ---------------------

def attack(chromium: str, apsd: str, attacker: str) -> list[str]:
    """Open the attacker's page (another origin: another port of 127.0.0.1, and a name of its own that
    resolves to 127.0.0.1) and let it try what the outside tester's page did; then a DNS-rebinding
    page (a name of the attacker's that resolves to apsd itself). Returns the rebinding page's text."""
    from playwright.sync_api import sync_playwright

    port = apsd.rsplit(":", 1)[1]
    script = """async ([target, name]) => {
        const body = JSON.stringify({name: name, rate: 1000, burst: 1000});
        const tries = [
          fetch(target + "/admin/tenants", {method: "POST", mode: "no-cors", body: body,
                                             headers: {"Content-Type": "text/plain"}}),
          fetch(target + "/admin/tenants", {method: "POST", body: body,
                                             headers: {"Content-Type": "application/json"}}),
          fetch(target + "/infer", {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
                body: JSON.stringify({tenant_id: "victim", prompt: "x", tokens_requested: 500, priority_bid: 5})}),
          fetch(target + "/admin/tenants/victim", {method: "DELETE", mode: "no-cors"}),
        ];
        const form = document.createElement("form");
        form.method = "POST"; form.action = target + "/infer"; form.enctype = "text/plain";
        const field = document.createElement("input");
        field.name = '{"tenant_id": "victim", "prompt": "x", "tokens_requested": 500, "priority_bid": 5, "x": "';
        field.value = '"}';
        form.appendChild(field); document.body.appendChild(form);
        const frame = document.createElement("iframe"); frame.name = "sink"; document.body.appendChild(frame);
        form.target = "sink"; form.submit();
        const settled = await Promise.allSettled(tries);
        await new Promise(done => frame.onload = done);
        return settled.map(s => s.status);
    }"""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--host-resolver-rules=MAP attacker.test 127.0.0.1, MAP rebind.test 127.0.0.1"])
        try:
            page = browser.new_page()
            page.set_default_timeout(STEP_MS)
            for origin, name in ((attacker, "evil-port"), (attacker.replace("127.0.0.1", "attacker.test"), "evil-site")):
                page.goto(origin + "/")
                page.evaluate(script, [apsd, name])
            rebound = page.goto(f"http://rebind.test:{port}/admin/tenants")
            assert rebound is not None
            return [str(rebound.status), page.content()]
        finally:
            browser.close()


@pytest.fixture
def attacker_site():
    """A real web server of another origin (127.0.0.1, another port) serving the attacker's empty page."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>a page from elsewhere</title><body></body>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.mark.timeout(240)
async def test_without_keys_a_page_of_another_origin_cannot_act_through_the_browser(chromium, attacker_site,
                                                                                    nursery, tmp_path):
    """The quick start (no keys, loopback) in front of the operator's own browser: a page from another
    origin sends ``no-cors`` text/plain JSON (no preflight), a CORS JSON request, a ``text/plain`` form
    and a DELETE; nothing is created, deleted or submitted. A DNS-rebinding page (its own name, apsd's
    address) is refused before it can read anything."""
    running = await start_daemon(nursery, make_config(
        server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=5.0),
        state=StateConfig(path=str(tmp_path / "apsd.db"), flush_interval_s=0.2, poll_interval_s=0.2),
        tenants={"victim": TenantConfig(rate=1e4, burst=10_000)}))
    async with running.client as client:
        rebound = await trio.to_thread.run_sync(functools.partial(attack, chromium, running.url, attacker_site))
        names = [t["name"] for t in (await client.get("/admin/tenants")).json()["tenants"]]
        assert names == ["victim"]
        status = (await client.get("/tenants/victim/status")).json()
        assert status["admitted"] == 0, status
        assert rebound[0] == "403" and "host_not_allowed" in rebound[1] and "victim" not in rebound[1]
        refused = (await client.get("/metrics.json")).json()["requests"]["rejected_by_error"]
        assert refused.get("cross_site_request", 0) >= 6 and refused.get("host_not_allowed", 0) >= 1, refused
    running.daemon.request_shutdown()


async def test_without_keys_cross_site_and_foreign_host_requests_are_refused_over_plain_http(nursery, tmp_path):
    running = await start_daemon(nursery, make_config(
        server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=5.0),
        state=StateConfig(path=str(tmp_path / "apsd.db"), flush_interval_s=0.2, poll_interval_s=0.2),
        tenants={"victim": TenantConfig(rate=1e4, burst=10_000)}))
    here = running.url.split("://", 1)[1]
    body = {"name": "evil", "rate": 1, "burst": 1}
    async with running.client as client:
        for headers, path, expected in [
            ({"Host": "rebind.example:8002"}, "/admin/tenants", "host_not_allowed"),
            ({"Host": "rebind.example"}, "/health", "host_not_allowed"),
            ({"Origin": "http://attacker.example"}, "/admin/tenants", "cross_site_request"),
            ({"Origin": "null"}, "/admin/tenants", "cross_site_request"),
            ({"Origin": "http://127.0.0.1:1"}, "/admin/tenants", "cross_site_request"),
            ({"Sec-Fetch-Site": "cross-site"}, "/admin/tenants", "cross_site_request"),
            ({"Sec-Fetch-Site": "same-site"}, "/admin/tenants", "cross_site_request"),
        ]:
            answer = await client.post(path, json=body, headers=headers) if path != "/health" else \
                await client.get(path, headers=headers)
            assert (answer.status_code, answer.json()["error"]) == (403, expected), (headers, answer.text)
        openai = await client.post("/v1/chat/completions", headers={"Origin": "http://attacker.example",
                                                                    "X-Apsd-Tenant": "victim"},
                                   json={"model": "apsd-batch", "messages": [{"role": "user", "content": "x"}]})
        assert openai.status_code == 403 and openai.json()["error"]["code"] == "cross_site_request"
        plain = await client.post("/admin/tenants", content=b'{"name": "evil", "rate": 1, "burst": 1}',
                                  headers={"Content-Type": "text/plain"})
        assert (plain.status_code, plain.json()["error"]) == (415, "unsupported_media_type")
        # what is not a browser's cross-site request passes: no Origin (curl, SDKs), the same origin, a
        # browser's own navigation, a read from elsewhere (answered, but unreadable without CORS), localhost
        assert (await client.get("/health", headers={"Origin": "http://attacker.example"})).status_code == 200
        assert (await client.get("/health", headers={"Host": "localhost:8002"})).status_code == 200
        for headers, name in [({}, "ok-1"), ({"Origin": f"http://{here}", "Sec-Fetch-Site": "same-origin"}, "ok-2"),
                              ({"Sec-Fetch-Site": "none"}, "ok-3")]:
            made = await client.post("/admin/tenants", json={**body, "name": name}, headers=headers)
            assert made.status_code == 201, made.text
        names = [t["name"] for t in (await client.get("/admin/tenants")).json()["tenants"]]
        assert "evil" not in names and {"ok-1", "ok-2", "ok-3"} <= set(names)
    running.daemon.request_shutdown()


async def test_with_keys_other_origins_are_left_to_the_keys(daemon):
    """With keys, the key decides: a browser cannot send one cross-site without a preflight apsd never
    grants, and a proxy may present apsd under any name."""
    answer = await daemon.client.post("/infer", json=infer_body(None, tokens=5),
                                      headers={**bearer(KEY_ALPHA), "Origin": "http://elsewhere.example",
                                               "Host": "apsd.example.com"})
    assert answer.status_code == 200, answer.text
    curl = await daemon.client.post("/admin/tenants", content=b'{"name": "by-curl", "rate": 1, "burst": 1}',
                                    headers={**bearer(ADMIN), "Content-Type": "application/x-www-form-urlencoded"})
    assert curl.status_code == 201, curl.text  # (curl -d's default type, with the admin key)


# -- the tenants' table: its width, budgets, refusals now -------------------------------------------------

def measure_tenants_table(chromium: str, url: str, widths: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """At each window width, the tenants' card and table boxes, and what the budget and refusal
    cells say (in Chromium; the page opened with the admin key)."""
    from playwright.sync_api import expect, sync_playwright

    found: dict[int, dict[str, Any]] = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": widths[0], "height": 1000})
            page.set_default_timeout(STEP_MS)
            expect.set_options(timeout=STEP_MS)
            page.goto(url + "/ui")
            page.fill("#key-input", ADMIN)
            page.click("#key-form button[type=submit]")
            expect(page.locator("#connection")).to_have_text("live")
            expect(page.locator('#tenants tr[data-tenant="analytics-batch-team"] .refusals')).to_contain_text(
                "rate_limited")
            for width in widths:
                page.set_viewport_size({"width": width, "height": 1000})
                found[width] = page.evaluate("""() => {
                    const card = document.getElementById("tenants-section").getBoundingClientRect();
                    const table = document.getElementById("tenants").getBoundingClientRect();
                    const scroll = document.querySelector("#tenants-section .table-scroll");
                    const style = getComputedStyle(document.getElementById("tenants-section"));
                    const row = (name) => document.querySelector(`#tenants tr[data-tenant="${name}"]`);
                    return {card_left: card.left, card_right: card.right - parseFloat(style.paddingRight),
                            table_left: table.left, table_right: table.right,
                            scroll_width: scroll.scrollWidth, client_width: scroll.clientWidth,
                            page_width: document.documentElement.scrollWidth, viewport: window.innerWidth,
                            budget: row("analytics-batch-team").querySelector(".budget").textContent,
                            no_budget: row("beta").querySelector(".budget").textContent,
                            refusals: row("analytics-batch-team").querySelector(".refusals").textContent,
                            columns: [...document.querySelectorAll("#tenants th")].map(
                              (th) => [th.textContent, Math.round(th.getBoundingClientRect().width)])};
                }""")
        finally:
            browser.close()
    return found


@pytest.mark.timeout(240)
async def test_the_tenants_table_fits_its_card_and_shows_budgets_and_refusals_now(chromium, nursery, tmp_path):
    """At 1280, 1440, 1600 and 1920 px the tenants' table stays inside its card (no scrolling needed),
    each tenant's budget reads "spent / limit", and refusals are those of the last minute (a count
    since start, shown before, never went down)."""
    config = attrs.evolve(status_config(tmp_path), tenants={
        **status_config(tmp_path).tenants,
        "analytics-batch-team": TenantConfig(rate=1e-6, burst=100, budget_tokens=3000, weight=1.5,
                                             api_key_hashes=[hash_key(KEY_GAMMA)]),
        "a-tenant-with-a-long-name-and-large-figures": TenantConfig(  # (what widens columns)
            rate=123456.789, burst=987_654_321, weight=12.345, budget_tokens=98_765_432_100)})
    running = await start_daemon(nursery, config)
    async with running.client as client:
        body = infer_body(None, "x" * 16, 26)  # 30 tokens: 3 fit the bucket of 100
        answers = [await client.post("/infer", json=body, headers=bearer(KEY_GAMMA)) for _ in range(5)]
        assert [a.status_code for a in answers] == [200, 200, 200, 429, 429]
        too_big = await client.post("/infer", json=infer_body(None, "1" * 101, 5), headers=bearer(KEY_GAMMA))
        assert too_big.status_code == 413
        sampler = ui.sampler_for(running.daemon.pipeline)
        widths = (1280, 1440, 1600, 1920)
        found = await trio.to_thread.run_sync(functools.partial(measure_tenants_table, chromium, running.url, widths))
        for width in widths:
            box = found[width]
            assert box["page_width"] <= box["viewport"], (width, box)           # nothing spills off the page
            assert box["scroll_width"] <= box["client_width"], (width, box["columns"], box)  # the table needs no scrolling
            assert box["card_left"] <= box["table_left"] and box["table_right"] <= box["card_right"] + 0.5, box
            assert box["budget"] == "90 / 3,000" and box["no_budget"] == "none"
            assert box["refusals"].startswith("3 (") and "rate_limited: 2" in box["refusals"], box["refusals"]
        # a minute later, the same refusals no longer count as now
        sampler.clock = lambda real=sampler.clock: real() + ui.REFUSAL_WINDOW_S + 1
        tenant = next(t for t in (await client.get("/admin/status", headers=bearer(ADMIN))).json()["tenants"]
                      if t["name"] == "analytics-batch-team")
        assert (tenant["refused_last_minute"], tenant["refused_last_minute_by_error"]) == (0, {})
        assert tenant["rejected"] == 3 and tenant["budget"]["spent"] == 90
    running.daemon.request_shutdown()
