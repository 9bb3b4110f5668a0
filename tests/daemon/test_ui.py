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

import httpx
import pytest
import trio

from apsd.core.config import AuthConfig, ServerConfig, StateConfig, TenantConfig
from apsd.serve.auth import hash_key
from apsd.serve.http import ui

from tests.helpers import infer_body, make_config, start_daemon, wait_until
from tests.llama_server import REQUIRE_ENV

ADMIN = "status-admin-key-" + "a" * 30
KEY_ALPHA = "alpha-tenant-key-" + "b" * 30
KEY_BETA = "beta-tenant-key-" + "c" * 30
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
    assert beta["rejected"] == 1 and list(beta["rejected_by_error"]) == ["exceeds_tenant_burst"]
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
