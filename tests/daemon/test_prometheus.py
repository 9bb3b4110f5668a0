"""GET /metrics in the Prometheus text format, against a real daemon on 127.0.0.1:0."""

from __future__ import annotations

import functools
import math
import re
import shutil

import prometheus_client
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from apsd.core.config import ServerConfig, TenantConfig
from apsd.core.scheduler import Scheduler
from apsd.pipeline import open_pipeline
from apsd.serve.http import create_app
from apsd.serve.prometheus import exporter_for, negotiate
from tests.helpers import build_policies, infer_body, make_config, start_daemon

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
                     "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")   # what Prometheus 2.x/3.x sends
BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


#: An ``/infer`` body of 50 tokens (``body("trickle", prompt="", tokens=60)``: another).
body = functools.partial(infer_body, tokens=50)


class Scrape:
    """A parsed exposition: families by name, sample values by (sample name, labels)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = {(s.name, frozenset(s.labels.items())): s.value
                        for f in self.families.values() for s in f.samples}

    def value(self, name: str, **labels: str) -> float:
        return self.samples[(name, frozenset(labels.items()))]

    def values(self, name: str) -> list[tuple[dict[str, str], float]]:
        return [(dict(labels), v) for (n, labels), v in self.samples.items() if n == name]


async def scrape(client, **kwargs) -> Scrape:
    response = await client.get("/metrics", **kwargs)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    assert response.headers["vary"] == "Accept"
    return Scrape(response.text)


async def traffic(client) -> list[dict]:
    """3 completed (a, a, b), 1 completed + 1 rate-limited (trickle), 1 unknown tenant, 1 bad body."""
    completions = []
    for tenant in ("tenant_a", "tenant_a", "tenant_b"):
        response = await client.post("/infer", json=body(tenant))
        assert response.status_code == 200
        completions.append(response.json())
    ok = await client.post("/infer", json=body("trickle", prompt="", tokens=60))
    assert ok.status_code == 200
    completions.append(ok.json())
    assert (await client.post("/infer", json=body("trickle", prompt="", tokens=60))).status_code == 429
    assert (await client.post("/infer", json=body("nobody"))).status_code == 404
    assert (await client.post("/infer", content=b"{")).status_code == 400
    return completions


async def test_counters_per_tenant_and_outcome(live):
    completions = await traffic(live.client)
    m = await scrape(live.client, headers={"Accept": PROMETHEUS_ACCEPT})
    expected = {  # (tenant, outcome): count
        ("tenant_a", "admitted"): 2, ("tenant_a", "completed"): 2, ("tenant_a", "rejected"): 0,
        ("tenant_b", "admitted"): 1, ("tenant_b", "completed"): 1,
        ("trickle", "admitted"): 1, ("trickle", "completed"): 1, ("trickle", "rejected"): 1,
        ("big", "admitted"): 0, ("big", "failed"): 0, ("big", "cancelled"): 0,
        ("", "rejected"): 2,                         # unknown tenant and malformed body: unattributed
    }
    for (tenant, outcome), count in expected.items():
        assert m.value("apsd_requests_total", tenant=tenant, outcome=outcome) == count, (tenant, outcome)
    assert sorted((labels["tenant"], labels["error"], v) for labels, v in m.values("apsd_rejections_total")) == [
        ("", "invalid_json", 1), ("", "unknown_tenant", 1), ("trickle", "rate_limited", 1)]
    # unattributed refusals make one tenant="" series per outcome, never one per client-chosen name
    assert {labels["tenant"] for labels, _ in m.values("apsd_requests_total")} == {
        "tenant_a", "tenant_b", "trickle", "big", ""}
    assert [labels["outcome"] for labels, _ in m.values("apsd_requests_total") if labels["tenant"] == ""] == [
        "rejected"]

    assert m.value("apsd_tokens_total", tenant="tenant_a", phase="generated") == 100
    assert m.value("apsd_tokens_total", tenant="tenant_a", phase="prompt") == 2 * 3     # 11 characters: 3 tokens
    assert m.value("apsd_tokens_total", tenant="trickle", phase="generated") == 60
    for tenant in ("tenant_a", "tenant_b", "trickle", "big"):
        for state in ("queued", "running"):
            assert m.value("apsd_requests_in_flight", tenant=tenant, state=state) == 0
    assert m.value("apsd_tenant_cost_usd_total", tenant="tenant_a") == pytest.approx(
        sum(c["cost_usd"] for c in completions if c["tenant_id"] == "tenant_a"))

    # the same books as the JSON view
    data = (await live.client.get("/metrics.json")).json()
    for outcome in ("admitted", "rejected", "completed", "failed", "cancelled"):
        assert sum(v for labels, v in m.values("apsd_requests_total") if labels["outcome"] == outcome) == \
            data["requests"][outcome]
    assert m.value("apsd_batches_total") == data["batches"] >= 1
    assert m.value("apsd_cost_usd_total") > 0
    assert m.value("apsd_cost_usd_total") == pytest.approx(data["cost_usd"], abs=1e-9)
    assert m.value("apsd_cost_usd_total") == pytest.approx(sum(c["cost_usd"] for c in completions))
    assert m.value("apsd_gpu_busy_seconds_total") > 0
    assert 0 < m.value("apsd_gpu_busy_ratio") <= 1
    assert m.value("apsd_gpus") == data["gpus"] == 1
    assert m.value("apsd_queue_depth") == 0 and m.value("apsd_queue_tokens") == 0
    assert m.value("apsd_conservation_ok") == 1
    assert m.value("apsd_accepting") == 1
    assert m.value("apsd_fairness_jain") == pytest.approx(data["fairness"]["jain_index"], rel=1e-5)
    # (the governor's view ages with model time, 1000x faster than the wall here: compare within one scrape)
    assert m.value("apsd_batch_window_seconds") == pytest.approx(
        0.010 * math.exp(-m.value("apsd_governor_entropy") / 5.0), rel=1e-9)
    assert data["governor"]["window_ms"] == pytest.approx(10 * math.exp(-data["governor"]["entropy_bits"] / 5.0),
                                                          rel=1e-5)
    [(current, _)] = [(labels["state"], v) for labels, v in m.values("apsd_governor_state") if v == 1]
    assert current in ("STABLE", "TRANSITIONAL", "CRITICAL_BURST") and data["governor"]["state"] in (
        "STABLE", "TRANSITIONAL", "CRITICAL_BURST")
    assert m.value("apsd_policy_info", aging="fair", governor="entropy", batching="micro", preset="fair") == 1


async def test_histograms_count_every_dispatch(live):
    completions = await traffic(live.client)
    m = await scrape(live.client)
    for name, label_sets in (("apsd_queue_wait_seconds", [{"tenant": t} for t in ("tenant_a", "tenant_b",
                                                                                    "trickle", "big")]),
                             ("apsd_batch_size", [{}])):
        assert m.families[name].type == "histogram"
        for labels in label_sets:
            buckets = sorted(((float(bl["le"]), v) for bl, v in m.values(f"{name}_bucket")
                              if {k: x for k, x in bl.items() if k != "le"} == labels))
            counts = [v for _, v in buckets]
            assert buckets[-1][0] == math.inf and len(buckets) > 5
            assert counts == sorted(counts), f"{name}{labels} buckets are not cumulative"
            assert counts[-1] == m.value(f"{name}_count", **labels)

    for tenant in ("tenant_a", "tenant_b", "trickle", "big"):
        completed = sum(c["tenant_id"] == tenant for c in completions)
        assert m.value("apsd_queue_wait_seconds_count", tenant=tenant) == completed
        assert m.value("apsd_queue_wait_seconds_sum", tenant=tenant) == pytest.approx(
            sum(c["queue_ms"] for c in completions if c["tenant_id"] == tenant) / 1000)
    batches = len({c["batch_id"] for c in completions})
    assert m.value("apsd_batch_size_count") == m.value("apsd_batches_total") == batches
    assert m.value("apsd_batch_size_sum") == len(completions)
    # a batch of one is in every bucket from le="1"
    assert m.value("apsd_batch_size_bucket", le="1.0") == sum(c["batch_size"] == 1 for c in completions)


async def test_a_fresh_daemon_exposes_every_family_and_omits_unknown_values(live):
    m = await scrape(live.client)
    assert "apsd_fairness_jain" in m.families and not m.values("apsd_fairness_jain")   # nothing to compare yet
    assert m.value("apsd_requests_total", tenant="big", outcome="admitted") == 0
    assert m.value("apsd_queue_wait_seconds_count", tenant="big") == 0
    assert m.value("apsd_batch_size_count") == 0
    assert m.value("apsd_conservation_ok") == 1


@pytest.mark.parametrize(("path", "headers"), [
    ("/metrics", {"Accept": "application/json"}),
    ("/metrics", {"Accept": "text/plain;q=0.5, application/json"}),
    ("/metrics?format=json", {}),
    ("/metrics?format=json", {"Accept": PROMETHEUS_ACCEPT}),
    ("/metrics.json", {}),
    ("/metrics.json", {"Accept": PROMETHEUS_ACCEPT}),
])
async def test_json_view_on_request(live, path, headers):
    await live.client.post("/infer", json=body())
    response = await live.client.get(path, headers=headers)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    data = response.json()
    assert data["requests"]["completed"] == 1 and data["requests"]["conservation_ok"] is True


@pytest.mark.parametrize("accept", [PROMETHEUS_ACCEPT, "text/plain;version=0.0.4", "application/openmetrics-text",
                                    "*/*", BROWSER_ACCEPT, "application/json, text/plain", None])
async def test_prometheus_text_by_default(live, accept):
    request = live.client.build_request("GET", "/metrics", headers={} if accept is None else {"Accept": accept})
    if accept is None:
        del request.headers["Accept"]
    response = await live.client.send(request)
    assert response.status_code == 200
    assert response.headers["content-type"] == prometheus_client.exposition.CONTENT_TYPE_LATEST
    assert "# TYPE apsd_requests_total counter" in response.text


async def test_format_parameter(live):
    text = await live.client.get("/metrics?format=prometheus", headers={"Accept": "application/json"})
    assert text.headers["content-type"].startswith("text/plain") and "apsd_queue_depth 0.0" in text.text
    bad = await live.client.get("/metrics?format=xml")
    assert bad.status_code == 400 and (bad.json()["error"], bad.json()["field"]) == ("invalid_format", "format")


@pytest.mark.parametrize(("format_param", "accept", "view"), [
    (None, None, "prometheus"),
    (None, "", "prometheus"),
    (None, "*/*", "prometheus"),
    (None, "application/*", "prometheus"),
    (None, "application/json", "json"),
    (None, "Application/JSON; charset=utf-8", "json"),
    (None, "application/json;q=0", "prometheus"),
    (None, "text/plain, application/json", "prometheus"),            # a tie goes to Prometheus
    (None, "application/json, text/plain;q=0.9", "json"),
    (None, "application/openmetrics-text;q=0.2, application/json;q=0.1", "prometheus"),
    (None, "garbage;;q=x,,", "prometheus"),
    ("json", "text/plain", "json"),
    ("prometheus", "application/json", "prometheus"),
    ("JSON", None, None),
    ("", None, None),
])
def test_negotiate(format_param, accept, view):
    assert negotiate(format_param, accept) == view


async def test_names_follow_prometheus_conventions(live):
    await traffic(live.client)
    m = await scrape(live.client)
    assert m.families
    for name, family in m.families.items():
        assert re.fullmatch(r"apsd_[a-z][a-z0-9_]*[a-z0-9]", name), name
        assert family.documentation.strip(), f"{name} has no HELP"
        assert not re.search(r"_(ms|milliseconds|minutes|hours|percent|kilo\w*|mega\w*|cents)(_|$)", name), name
        for sample in family.samples:
            if family.type == "counter":
                assert sample.name == f"{name}_total", sample.name       # counters end in _total
            elif family.type == "histogram":
                assert sample.name in (f"{name}_bucket", f"{name}_count", f"{name}_sum"), sample.name
            else:
                assert not sample.name.endswith("_total"), sample.name   # only counters end in _total
    # units in the names, in base units
    for name in ("apsd_queue_wait_seconds", "apsd_batch_window_seconds", "apsd_gpu_busy_seconds", "apsd_cost_usd",
                 "apsd_tenant_cost_usd", "apsd_gpu_busy_ratio"):
        assert name in m.families, name


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian package 'prometheus'; .ci/run installs it)")
async def test_promtool_accepts_the_exposition(live):
    promtool = shutil.which("promtool")
    fresh = (await live.client.get("/metrics")).text
    await traffic(live.client)
    busy = (await live.client.get("/metrics")).text
    for text in (fresh, busy):
        result = await trio.run_process([promtool, "check", "metrics"], stdin=text.encode(), capture_stdout=True,
                                        capture_stderr=True, check=False)
        assert result.returncode == 0, (result.stdout + result.stderr).decode()
        assert not (result.stdout + result.stderr).strip(), (result.stdout + result.stderr).decode()


async def test_the_exposition_is_prometheus_clients_own_byte_for_byte(autojump_clock):
    """``scrape`` (what GET /metrics serves: per-tenant lines rendered by apsd, reused while a
    tenant's figures stay put) and ``exposition`` give exactly what prometheus_client renders from
    the collector, after every kind of step: completions, refusals (by a tenant's bucket, for an
    unknown tenant, before the pipeline), a tenant whose name needs escaping, a reload adding one."""
    odd = 'we"ird\\na\nme'
    tenants = {"a": TenantConfig(rate=1e6, burst=10**6), "b": TenantConfig(rate=1e6, burst=10**6),
               "trickle": TenantConfig(rate=0.001, burst=100), odd: TenantConfig(rate=1e6, burst=10**6)}
    config = make_config(tenants=tenants)
    policies = build_policies(config)
    async with open_pipeline(config, policies) as pipeline:
        exporter = exporter_for(pipeline)

        async def same_bytes() -> None:
            reference = prometheus_client.generate_latest(exporter.registry)
            assert await exporter.scrape() == reference     # (the moment is copied before the thread runs)
            reference = prometheus_client.generate_latest(exporter.registry)   # (virtual time moved meanwhile)
            assert exporter.exposition() == reference

        async def run(*tenant_tokens: tuple[str, int]) -> None:
            requests = []
            for tenant, tokens in tenant_tokens:
                request = pipeline.new_request(tenant_id=tenant, prompt="hello", tokens_requested=tokens,
                                               priority_bid=5)
                pipeline.submit_nowait(request)
                requests.append(request)
            for request in requests:
                await request.reply.wait()

        await same_bytes()                                   # nothing yet: every tenant rendered
        await run(("a", 10), ("a", 20), ("b", 30), (odd, 5), ("trickle", 60), ("trickle", 60), ("nobody", 5))
        pipeline.ledger.count_refusal(None, "invalid_json")
        await same_bytes()                                   # every tenant changed
        await run(("b", 7))
        await same_bytes()                                   # one changed, the others' lines reused
        await same_bytes()                                   # none changed
        added = make_config(tenants={**tenants, "late": TenantConfig(rate=1e6, burst=10**6)})
        pipeline.reconfigure(added, build_policies(added))
        await run(("late", 3), ("a", 4))
        await same_bytes()                                   # a tenant more: rendered whole again
        text = (await exporter.scrape()).decode()
        assert 'apsd_requests_total{outcome="rejected",tenant="trickle"} 1.0' in text
        assert 'apsd_rejections_total{error="unknown_tenant",tenant=""} 1.0' in text
        assert 'apsd_requests_total{outcome="completed",tenant="we\\"ird\\\\na\\nme"} 1.0' in text
        assert Scrape(text).value("apsd_request_latency_seconds_count", tenant="late") == 1


def test_the_global_registry_is_left_alone():
    assert b"apsd_" not in prometheus_client.generate_latest(prometheus_client.REGISTRY)


async def test_one_exporter_per_pipeline_observes_each_dispatch_once(autojump_clock):
    config = make_config(tenants={"a": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(config, build_policies(config)) as pipeline:
        exporter = exporter_for(pipeline)
        create_app(pipeline)                      # the app uses the same exporter: nothing counted twice
        assert exporter_for(pipeline) is exporter
        requests = []
        for _ in range(3):
            request = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=10, priority_bid=5,
                                           prompt_tokens=0)
            assert pipeline.submit_nowait(request) is None
            requests.append(request)
        for request in requests:
            await request.reply.wait()
        m = Scrape(exporter.exposition().decode())
        assert m.value("apsd_queue_wait_seconds_count", tenant="a") == 3
        assert m.value("apsd_batch_size_sum") == 3

        assert m.value("apsd_ttft_seconds_count", tenant="a") == 3
        assert m.value("apsd_request_latency_seconds_count", tenant="a") == 3
        assert m.value("apsd_tpot_seconds_count", tenant="a") == 3
        outcomes = [request.reply.outcome for request in requests]
        assert m.value("apsd_tpot_seconds_sum", tenant="a") == pytest.approx(sum(o.tpot_ms for o in outcomes) / 1000)
        assert m.value("apsd_ttft_seconds_sum", tenant="a") == pytest.approx(sum(o.ttft_ms for o in outcomes) / 1000)
        assert m.value("apsd_batch_size_count") == m.value("apsd_batches_total")
        assert m.value("apsd_engine_running_sequences", engine="0") == 0
        assert m.value("apsd_engine_busy_seconds_total", engine="0") == pytest.approx(
            m.value("apsd_gpu_busy_seconds_total"))

    other = make_config(tenants={"b": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(other, build_policies(other)) as second:   # a pipeline of its own: its own registry
        text = exporter_for(second).exposition().decode()
        assert 'tenant="b"' in text and 'tenant="a"' not in text


async def test_a_governor_that_raises_is_state_error_without_window_or_entropy(autojump_clock, monkeypatch):
    config = make_config(tenants={"a": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(config, build_policies(config)) as pipeline:
        exporter = exporter_for(pipeline)
        before = Scrape(exporter.exposition().decode())
        state = next(labels["state"] for labels, v in before.values("apsd_governor_state") if v == 1)

        def broken(self):
            raise RuntimeError("boom")

        monkeypatch.setattr(Scheduler, "governor_reading", broken)
        m = Scrape(exporter.exposition().decode())
        assert state == "STABLE"
        assert sorted(m.values("apsd_governor_state"), key=lambda s: s[0]["state"]) == [
            ({"state": "CRITICAL_BURST"}, 0), ({"state": "ERROR"}, 1), ({"state": "STABLE"}, 0),
            ({"state": "TRANSITIONAL"}, 0)]
        assert not m.values("apsd_batch_window_seconds") and not m.values("apsd_governor_entropy")
        assert "apsd_batch_window_seconds" in m.families


@pytest.mark.parametrize(("preset", "states"), [("aps", {"STABLE", "TRANSITIONAL", "CRITICAL_BURST"}),
                                                ("fifo", {"FIXED"})])
async def test_the_first_scrape_has_a_series_for_every_governor_state(preset, states):
    """Before any request, every state the governor can report is there, the current one at 1."""
    config = make_config(server=ServerConfig(host="127.0.0.1", port=0))
    async with trio.open_nursery() as nursery:
        running = await start_daemon(nursery, config, preset)
        async with running.client as client:
            m = Scrape((await client.get("/metrics")).text)
            series = dict((labels["state"], v) for labels, v in m.values("apsd_governor_state"))
            assert set(series) == states
            current = (await client.get("/health")).json()["governor"]["state"]
            assert series == {state: 1 if state == current else 0 for state in states}
        running.daemon.request_shutdown()
