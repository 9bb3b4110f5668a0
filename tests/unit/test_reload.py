"""Live reconfiguration of a running pipeline, in virtual time."""

from __future__ import annotations

import trio

from apsd.core.config import EngineConfig, GpuConfig, ServerConfig, TenantConfig
from apsd.core.models import Completion
from apsd.pipeline import open_pipeline
from apsd.serve.http import metrics_document
from tests.helpers import build_policies, make_config

BIG = TenantConfig(rate=1e6, burst=10**6)


def submit(pipeline, tenant, tokens=100, bid=5):
    r = pipeline.new_request(tenant_id=tenant, prompt="", tokens_requested=tokens, priority_bid=bid, prompt_tokens=0)
    assert pipeline.submit_nowait(r) is None
    return r


async def test_reload_keeps_queued_and_running_requests_and_applies_the_new_order(autojump_clock):
    config = make_config({"policy": {"preset": "fifo", "micro": {"max_batch_size": 1}}}, tenants={"a": BIG})
    async with open_pipeline(config, build_policies(config)) as pipeline:
        running = submit(pipeline, "a", tokens=500)
        await trio.sleep(0.5)                                   # running on the GPU now
        queued = [submit(pipeline, "a", tokens=10, bid=b) for b in (1, 2, 10)]
        await trio.sleep(0.1)
        new = make_config({"policy": {"preset": "aps", "micro": {"max_batch_size": 1}}}, tenants={"a": BIG})
        changes = pipeline.reconfigure(new, build_policies(new))
        outcomes = [await r.reply.wait() for r in [running, *queued]]
        assert pipeline.health().policy["aging"] == "aps"
    assert any(c.startswith("policies: preset=aps") for c in changes)
    assert all(isinstance(o, Completion) for o in outcomes)
    # under fifo they would run in arrival order; after the reload, aps serves the bid-10 first
    assert [o.batch_id for o in outcomes] == [1, 4, 3, 2]


async def test_reload_adds_removes_and_rerates_tenants(autojump_clock):
    config = make_config(tenants={"keep": TenantConfig(rate=10.0, burst=1000), "gone": BIG})
    async with open_pipeline(config, build_policies(config)) as pipeline:
        submit(pipeline, "keep", tokens=600)                    # takes 600 of keep's 1000 tokens
        queued_for_gone = submit(pipeline, "gone", tokens=50)
        await trio.sleep(0.001)
        new = make_config(tenants={"keep": TenantConfig(rate=20.0, burst=300), "new": BIG})
        changes = pipeline.reconfigure(new, build_policies(new))
        assert set(changes) >= {"tenant gone removed", "tenant new added (rate 1e+06, burst 1000000)",
                                "tenant keep re-rated (rate 20, burst 300)"}
        bucket = pipeline.admission.buckets["keep"]
        assert (bucket.rate, bucket.burst, bucket.level(pipeline.clock.now())) == (20.0, 300.0, 300.0)
        assert isinstance(await queued_for_gone.reply.wait(), Completion)   # accepted work still runs
        assert pipeline.admission.rate_limit_headers("gone") == {}         # its 200 has no bucket to describe
        late = pipeline.new_request(tenant_id="gone", prompt="", tokens_requested=5, priority_bid=5, prompt_tokens=0)
        pipeline.submit_nowait(late)
        assert (await late.reply.wait()).status == 404
        assert isinstance(await submit(pipeline, "new", tokens=5).reply.wait(), Completion)
        assert pipeline.tenant_status("gone") is None and pipeline.tenant_status("new").completed == 1
        assert metrics_document(pipeline)["requests"]["conservation_ok"]


async def test_settings_that_need_a_restart_keep_their_old_values(autojump_clock):
    config = make_config(tenants={"a": BIG})
    async with open_pipeline(config, build_policies(config)) as pipeline:
        new = make_config({"queue": {"ingress_buffer": 7}, "store": {"key_prefix": "elsewhere"}}, tenants={"a": BIG},
                          server=ServerConfig(port=9999),
                          engine=EngineConfig(count=4), gpu=GpuConfig(time_scale=0.5, price_per_hour_usd=6.0))
        changes = pipeline.reconfigure(new, build_policies(new))
        assert "queue.ingress_buffer needs a restart to change (kept as before)" in changes
        assert pipeline.config.queue.ingress_buffer == config.queue.ingress_buffer
        assert "[server] needs a restart to change (kept as before)" in changes
        assert "[engine] needs a restart to change (kept as before)" in changes
        assert "[store] needs a restart to change (kept as before)" in changes
        assert pipeline.config.store.key_prefix == "apsd"
        assert (pipeline.config.server.port, pipeline.config.engine.count, len(pipeline.engines), pipeline.config.gpu.time_scale) == (
            config.server.port, 1, 1, 1.0)
        assert pipeline.config.gpu.price_per_hour_usd == 6.0 == pipeline.engines[0].model.gpu.price_per_hour_usd


async def test_reload_applies_the_new_limits_and_names_them(autojump_clock):
    config = make_config(tenants={"a": BIG})
    async with open_pipeline(config, build_policies(config)) as pipeline:
        new = make_config({"queue": {"max_tokens": 50}, "admission": {"max_prompt_tokens": 10}}, tenants={"a": BIG})
        changes = pipeline.reconfigure(new, build_policies(new))
        assert "admission.max_prompt_tokens 10" in changes and "admission.chars_per_token 4.0" not in changes
        assert any("50 tokens" in c for c in changes)
        r = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=51, priority_bid=5, prompt_tokens=0)
        pipeline.submit_nowait(r)
        assert (await r.reply.wait()).error == "exceeds_queue_capacity"


async def test_reload_names_bid_and_gateway_changes_and_keeps_the_backends(autojump_clock):
    config = make_config(tenants={"a": BIG})
    async with open_pipeline(config, build_policies(config)) as pipeline:
        new = make_config({"gateway": {"default_max_tokens": 64}, "forward": {"max_retries": 5},
                           "tenants": {"a": {"rate": BIG.rate, "burst": BIG.burst, "max_bid": 3, "default_bid": 2}}})
        changes = pipeline.reconfigure(new, build_policies(new))
        assert "tenant a: max_bid 3, default_bid 2" in changes
        assert "gateway.default_max_tokens 64" in changes
        assert "[forward] and [[backends]] need a restart to change (kept as before)" in changes
        assert pipeline.config.forward.max_retries == 2 and pipeline.config.tenants["a"].max_bid == 3
