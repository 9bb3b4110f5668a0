"""Money over real HTTP: prices, spend, dollar budgets held under 200 concurrent requests, budget alerts
that reach a real HTTP receiver (signed, retried, once per threshold and period across a restart), and
``apsd usage`` with spend and budgets. Daemons on 127.0.0.1:0, in front of the stand-in backend where a
request's answer must vary (tests/standin_backend.py)."""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging

import attrs
import httpx
import pytest
import trio

from apsd.core.config import ConfigError, ServerConfig, StateConfig, TenantConfig, parse_config
from apsd.serve.alerts import SIGNATURE_HEADER, sign
from tests.budget_spender import spend
from tests.helpers import (
    BUDGET_USD,
    FAST_GPU,
    PRICES,
    backends_up,
    forwarding_config,
    infer_body,
    make_config,
    run_cli,
    start_daemon,
    varied_length,
    wait_until,
)
from tests.standin_backend import start_standin_backend
from tests.webhook_receiver import open_webhook_receiver

pytestmark = pytest.mark.timeout(240)

async def test_a_dollar_budget_holds_within_1_percent_under_200_concurrent_requests(nursery, tmp_path):
    """One daemon, a $0.36 budget (about 600 requests), 200 clients sending at once until it is spent, answers of 20-100 tokens
    against max_tokens 100 (so most requests use less than their reservation, some more): what was
    spent is within 1% of the budget, and the daemon's own books (the budget, /admin/usage and its CSV,
    /metrics) say the same to the micro-dollar."""
    backend = await start_standin_backend(nursery, varied_length)
    config = attrs.evolve(
        forwarding_config([backend.url], {"team": TenantConfig(rate=1e9, burst=10**9, budget_usd=BUDGET_USD)},
                          max_concurrency=256, health_timeout_s=60.0),   # (a loaded machine's slow turn is no outage)
        prices=PRICES, state=StateConfig(path=str(tmp_path / "apsd.db")))
    running = await start_daemon(nursery, config)
    await wait_until(backends_up(running.daemon))
    spender = await spend([running.url], "team")
    print(f"${BUDGET_USD} budget, 200 concurrent clients on one daemon: {spender.served} served, "
          f"${spender.spent:.6f} spent ({spender.spent / BUDGET_USD - 1:+.3%}); refusals {spender.refusals}")
    assert BUDGET_USD * 0.99 <= spender.spent <= BUDGET_USD * 1.01
    async with httpx.AsyncClient(base_url=running.url, timeout=60) as http:
        live = (await http.get("/admin/tenants/team")).json()["live"]
        assert live["budget_usd"]["spent_usd"] == pytest.approx(spender.spent, abs=1e-6 * spender.served)
        assert live["budget_usd"]["reserved_usd"] == 0 and live["spend_usd"] == pytest.approx(spender.spent)
        rows = (await http.get("/admin/usage", params={"tenant": "team"})).json()["rows"]
        assert sum(r["spend_usd"] for r in rows) == pytest.approx(spender.spent, abs=1e-5)
        csv_lines = (await http.get("/admin/usage", params={"tenant": "team", "format": "csv"})).text.splitlines()
        header = csv_lines[0].split(",")
        assert sum(float(line.split(",")[header.index("spend_usd")]) for line in csv_lines[1:]) == pytest.approx(
            spender.spent, abs=1e-5)
        metrics = (await http.get("/metrics")).text
        line = next(m for m in metrics.splitlines() if m.startswith('apsd_tenant_spend_usd_total{tenant="team"}'))
        assert float(line.split()[-1]) == pytest.approx(spender.spent)
        ratio = next(m for m in metrics.splitlines() if m.startswith("apsd_budget_used_ratio{")
                     and 'unit="usd"' in m)
        assert float(ratio.split()[-1]) == pytest.approx(spender.spent / BUDGET_USD, abs=1e-3)
    running.daemon.request_shutdown()


def alert_config(tmp_path, webhook: str, **alerts) -> object:
    """One tenant with a $0.104 daily budget on the simulated batch engine, priced so that each request
    of 4 prompt and 10 output tokens costs $0.0104: ten requests spend it exactly."""
    return make_config(
        {"prices": {"apsd-batch": {"input_per_1m_usd": 100.0, "output_per_1m_usd": 1000.0}},
         "alerts": {"webhook_url": webhook, "webhook_secret_env": "APSD_TEST_ALERT_SECRET", **alerts}},
        server=ServerConfig(host="127.0.0.1", port=0), gpu=FAST_GPU,
        state=StateConfig(path=str(tmp_path / "apsd.db")),
        tenants={"team": TenantConfig(rate=1e6, burst=10**6, budget_usd=0.104)})


async def test_budget_alerts_reach_a_real_receiver_at_80_and_100_percent_once_each_signed(
        nursery, tmp_path, monkeypatch, caplog):
    """A webhook receiver started here; its first answer is 503 (the delivery is retried). The 80%
    alert comes after the eighth request, the 100% after the tenth; each is delivered once, signed with
    the shared secret (HMAC-SHA256 of the body), logged, and shown by the gauge; refused requests
    after and a restart of the daemon on the same state send nothing more."""
    monkeypatch.setenv("APSD_TEST_ALERT_SECRET", "the-shared-secret")
    caplog.set_level(logging.WARNING, logger="apsd.alerts")
    async with open_webhook_receiver(answers=[503]) as receiver:
        async with trio.open_nursery() as first_daemon:   # (left once the first daemon stopped)
            running = await start_daemon(first_daemon, alert_config(tmp_path, receiver.url))
            body = infer_body("team", "x" * 16, 10)
            for _ in range(7):
                assert (await running.client.post("/infer", json=body)).status_code == 200
            await trio.sleep(2.5)   # (two checks: 70% is below every threshold)
            assert receiver.received == []
            assert (await running.client.post("/infer", json=body)).status_code == 200   # 80%
            first = await receiver.wait_for(2, 30)   # (503, then the retry after a second)
            assert [r.status for r in first] == [503, 200]
            for _ in range(2):
                assert (await running.client.post("/infer", json=body)).status_code == 200  # 100%
            received = await receiver.wait_for(3, 30)
            refused = await running.client.post("/infer", json=body)
            assert refused.status_code == 429 and refused.json()["error"] == "budget_exhausted"
            await trio.sleep(2.5)
            metrics = (await running.client.get("/metrics")).text
            await running.client.aclose()
            running.daemon.request_shutdown()
        assert len(receiver.received) == 3
        delivered = [r for r in received if r.status == 200]
        documents = [json.loads(r.body) for r in delivered]
        assert [(d["threshold"], d["unit"], d["tenant"], d["key"]) for d in documents] == [
            (0.8, "usd", "team", None), (1.0, "usd", "team", None)]
        assert documents[0]["spent"] == pytest.approx(0.0832) and documents[1]["spent"] == pytest.approx(0.104)
        assert all(d["limit"] == pytest.approx(0.104) and d["period"] == "day" for d in documents)
        for request in received:
            assert request.method == "POST" and request.path == "/hooks/apsd"
            assert request.headers["content-type"] == "application/json"
            expected = "sha256=" + hmac.new(b"the-shared-secret", request.body, hashlib.sha256).hexdigest()
            assert hmac.compare_digest(request.headers[SIGNATURE_HEADER.lower()], expected)
            assert request.headers["x-apsd-delivery"] == json.loads(request.body)["id"]
        assert received[0].body == received[1].body   # (the retry is the same delivery)
        logged = [r.getMessage() for r in caplog.records if r.name == "apsd.alerts" and "budget alert:" in r.getMessage()]
        assert len(logged) == 2 and "tenant 'team' has spent $0.0832 of its $0.1040 day budget" in logged[0]
        line = next(m for m in metrics.splitlines() if m.startswith("apsd_budget_alert_threshold{"))
        assert 'tenant="team"' in line and 'unit="usd"' in line and float(line.split()[-1]) == 1.0

        # a restart on the same state: the spend is still there, and the alerts are not sent again
        again = await start_daemon(nursery, alert_config(tmp_path, receiver.url))
        await trio.sleep(2.5)
        assert len(receiver.received) == 3
        live = (await again.client.get("/admin/tenants/team")).json()["live"]
        assert live["budget_usd"]["spent_usd"] == pytest.approx(0.104)
        assert (await again.client.post("/infer", json=body)).json()["error"] == "budget_exhausted"
        again.daemon.request_shutdown()


def test_the_signature_is_hmac_sha256_of_the_body():
    body = b'{"type":"budget_alert"}'
    assert sign("k", body) == "sha256=" + hmac.new(b"k", body, hashlib.sha256).hexdigest()
    assert sign("k", body) != sign("other", body)


def test_prices_and_alerts_are_checked_at_load():
    with pytest.raises(ConfigError, match=r'prices.m.input_per_1m_usd: required key is missing'):
        parse_config({"prices": {"m": {"output_per_1m_usd": 1.0}}})
    with pytest.raises(ConfigError, match=r"prices.m.cached_input_per_1m_usd: must be between 0 and 1e\+06"):
        parse_config({"prices": {"m": {"input_per_1m_usd": 1.0, "output_per_1m_usd": 1.0,
                                       "cached_input_per_1m_usd": -1.0}}})
    with pytest.raises(ConfigError, match=r"alerts.thresholds: entry \[1\]: a share of the budget above 0"):
        parse_config({"alerts": {"thresholds": [0.5, 0.0]}})
    with pytest.raises(ConfigError, match=r"alerts.webhook_url: must be an http:// or https:// URL"):
        parse_config({"alerts": {"webhook_url": "ftp://x"}})
    with pytest.raises(ConfigError, match=r"alerts.webhook_secret: must be a string \(the value given is not shown\)"):
        parse_config({"alerts": {"webhook_secret": 12345}})
    price = parse_config({"prices": {"m": {"input_per_1m_usd": 3.0, "output_per_1m_usd": 15.0}}}).prices["m"]
    assert price.cached_input == 3.0


async def test_apsd_usage_prints_spend_and_the_budgets_in_force(nursery, tmp_path):
    """``apsd usage`` shows each row's spend in dollars, and the budgets in force now: the tenant's
    (tokens and dollars) and its key's."""
    config = make_config(
        {"prices": {"apsd-batch": {"input_per_1m_usd": 100.0, "output_per_1m_usd": 1000.0}}},
        server=ServerConfig(host="127.0.0.1", port=0), gpu=FAST_GPU,
        state=StateConfig(path=str(tmp_path / "apsd.db")),
        tenants={"team": TenantConfig(rate=1e6, burst=10**6, budget_usd=1.0, budget_tokens=10_000)})
    running = await start_daemon(nursery, config)
    for _ in range(3):
        assert (await running.client.post("/infer", json=infer_body("team", "x" * 16, 10))).status_code == 200
    table = await trio.to_thread.run_sync(functools.partial(run_cli, "usage", "--url", running.url,
                                                            "--group-by", "day"))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    header, row = lines[0].split(), lines[1].split()
    assert row[header.index("spend_usd")] == "0.0312" and row[header.index("completed")] == "3"
    budgets = lines[lines.index("budgets this period (spent of limit, as this daemon knows it now):") + 1:]
    assert budgets[0].split()[:3] == ["tenant", "key", "unit"]
    cells = {line.split()[1]: line.split() for line in budgets[1:]}
    assert cells["tokens"][2:5] == ["42", "10,000", "0.4%"]
    assert cells["usd"][2:5] == ["$0.0312", "$1.0000", "3.1%"]
    running.daemon.request_shutdown()
