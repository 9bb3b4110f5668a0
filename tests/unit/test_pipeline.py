"""The whole pipeline (admission -> scheduler -> engines) in virtual time."""

from __future__ import annotations

import math

import pytest
import trio

from apsd.core.config import EngineConfig, GpuConfig, TenantConfig
from apsd.core.models import Completion
from apsd.pipeline import open_pipeline
from apsd.serve.http import metrics_document
from tests.helpers import build_policies, make_config

UNLIMITED = {"vip": TenantConfig(rate=1e9, burst=10**9), "free": TenantConfig(rate=1e9, burst=10**9)}


def config_for(preset="aps", toml=None, **sections):
    sections.setdefault("tenants", UNLIMITED)
    return make_config(toml or {}, **sections), preset


async def run(config_preset, arrivals):
    """Feed ``arrivals`` [(t, tenant, prompt_tokens, tokens, bid)] in order; return the outcomes."""
    config, preset = config_preset
    async with open_pipeline(config, build_policies(config, preset)) as pipeline:
        requests = []
        for t, tenant, prompt, tokens, bid in sorted(arrivals, key=lambda a: a[0]):
            await pipeline.clock.sleep_until(t)
            request = pipeline.new_request(tenant_id=tenant, prompt="", tokens_requested=tokens,
                                           priority_bid=bid, prompt_tokens=prompt)
            assert pipeline.submit_nowait(request) is None
            requests.append(request)
        outcomes = [await r.reply.wait() for r in requests]
        metrics = metrics_document(pipeline)
    return outcomes, metrics


async def test_single_request_waits_one_window_then_runs_the_seed_model(autojump_clock):
    outcomes, metrics = await run(config_for("fifo"), [(0.0, "vip", 1024, 128, 5)])
    (done,) = outcomes
    assert isinstance(done, Completion)
    assert done.queue_ms == pytest.approx(10.0)       # the fixed 10 ms window
    assert done.prefill_ms == pytest.approx(1000.0)   # 1024 prompt tokens at 1024 tok/s
    assert done.decode_ms == pytest.approx(1000.0)    # 128 tokens at 128*(0.4+0.6*1) tok/s
    assert done.latency_ms == pytest.approx(2010.0)
    assert done.cost_usd == pytest.approx(2.0 * 3.0 / 3600)
    assert metrics["cost_per_1m_tokens_usd"] == pytest.approx(2.0 * 3.0 / 3600 / 128 * 1e6)
    assert metrics["gpu_utilization"] == pytest.approx(2.0 / 2.01)


async def test_full_batch_goes_without_waiting_and_decodes_faster(autojump_clock):
    outcomes, _ = await run(config_for("fifo"), [(0.0, "vip", 0, 100, 5)] * 20)
    first, rest = outcomes[:16], outcomes[16:]
    assert {o.batch_size for o in first} == {16} and {o.queue_ms for o in first} == {0.0}
    decode_s = 1600 / (128 * (0.4 + 0.6 * 4))
    assert first[0].decode_ms == pytest.approx(decode_s * 1000)
    # leftovers already waited, so they go as soon as the GPU is free
    assert {o.batch_size for o in rest} == {4}
    assert rest[0].queue_ms == pytest.approx(decode_s * 1000)
    assert sum(o.cost_usd for o in outcomes) == pytest.approx(
        (decode_s + 400 / (128 * (0.4 + 0.6 * 2))) * 3.0 / 3600)


async def test_batch_is_cut_when_an_executor_asks_so_a_late_vip_gets_in(autojump_clock):
    arrivals = [(0.0, "free", 0, 500, 1)]                    # occupies the GPU for 500/128 s
    arrivals += [(0.5, "free", 0, 10, 1)] * 20               # a backlog of low bids
    arrivals += [(3.0, "vip", 0, 10, 10)]                    # arrives while the GPU is busy
    outcomes, _ = await run(config_for("static"), arrivals)
    vip = outcomes[-1]
    assert vip.batch_id == 2                                 # the very next batch...
    assert vip.queue_ms == pytest.approx((500 / 128 + 0.010 - 3.0) * 1000)
    assert sum(o.batch_id == 2 for o in outcomes) == 16      # ...which had room for it


async def test_several_gpus_run_batches_at_once(autojump_clock):
    config = config_for("fifo", engine=EngineConfig(count=2))
    outcomes, metrics = await run(config, [(0.0, "vip", 0, 100, 5)] * 32)
    assert {o.batch_id for o in outcomes} == {1, 2}
    assert [o.latency_ms for o in outcomes] == [pytest.approx(1600 / (128 * 2.8) * 1000)] * 32
    assert metrics["gpus"] == 2 and metrics["gpu_utilization"] == pytest.approx(1.0)


async def test_time_scale_changes_nothing_in_model_time(autojump_clock):
    arrivals = [(i * 0.37, "vip" if i % 3 else "free", 50 * (i % 4), 20 + i, 1 + i % 10) for i in range(60)]
    slow, _ = await run(config_for("aps"), arrivals)
    fast, _ = await run(config_for("aps", gpu=GpuConfig(time_scale=0.01)), arrivals)
    assert [o.batch_id for o in slow] == [o.batch_id for o in fast]
    for a, b in zip(slow, fast):
        for field in ("queue_ms", "latency_ms", "decode_ms", "cost_usd", "effective_priority"):
            assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-6, abs=1e-6), field


async def test_books_balance_and_costs_add_up(autojump_clock):
    arrivals = [(i * 0.05, ("vip", "free")[i % 2], 64 * (i % 5), 16 + 8 * (i % 7), 1 + (i * 7) % 10)
                for i in range(300)]
    outcomes, metrics = await run(config_for("aps"), arrivals)
    assert all(isinstance(o, Completion) for o in outcomes)
    requests = metrics["requests"]
    assert requests["admitted"] == requests["completed"] == 300
    assert requests["conservation_ok"] and requests["in_flight"] == 0
    assert sum(o.cost_usd for o in outcomes) == pytest.approx(metrics["cost_usd"])
    assert metrics["tokens"]["generated"] == sum(a[3] for a in arrivals)
    assert {o.request_id for o in outcomes} == {f"sim-{i}" for i in range(1, 301)}


# -- starvation: a flood of high bids against one low bidder ---------------------------------------

FLOOD_S = 60.0
FLOOD_GAP_S = 0.1            # 10 req/s of 100 tokens: far above what one GPU serves
LOW_AT_S = 1.0
ALPHA = 1.0


def flood():
    n = int(FLOOD_S / FLOOD_GAP_S)
    return [(i * FLOOD_GAP_S, "vip", 0, 100, 10) for i in range(n)] + [(LOW_AT_S, "free", 0, 100, 1)]


async def test_static_starves_the_low_bidder_for_the_whole_flood(autojump_clock):
    outcomes, _ = await run(config_for("static"), flood())
    low = next(o for o in outcomes if o.tenant_id == "free")
    vip_dispatch = [o for o in outcomes if o.tenant_id == "vip"]
    assert low.queue_ms / 1000 > FLOOD_S                             # waited out the whole flood...
    assert low.batch_id >= max(o.batch_id for o in vip_dispatch)     # ...and went after all of it


async def test_aps_serves_the_low_bidder_within_the_bound_alpha_implies(autojump_clock):
    config = config_for("aps", toml={"policy": {"aps": {"alpha": ALPHA}}})
    arrivals = flood()
    outcomes, _ = await run(config, arrivals)
    low = next(o for o in outcomes if o.tenant_id == "free")
    # P_eff(low) = 1 + a(t - 1) beats a flood request's 10 + a(t - t_f) once t_f > 1 + 9/a:
    # only requests that arrived before then can be ahead of it.
    overtaken_after = LOW_AT_S + (10 - 1) / ALPHA
    ahead = sum(1 for t, tenant, *_ in arrivals if tenant == "vip" and t <= overtaken_after)
    batch_s = 16 * 100 / (128 * (0.4 + 0.6 * 4))
    bound_s = (math.ceil((ahead + 1) / 16) + 1) * batch_s
    assert low.queue_ms / 1000 <= bound_s
    assert low.queue_ms / 1000 < FLOOD_S / 2                         # far from static's wait
    # exactness: nothing that arrived after the overtaking point ran before the low bidder
    by_id = {o.request_id: o for o in outcomes}
    for (t, tenant, *_), o in zip(sorted(arrivals, key=lambda a: a[0]), outcomes):
        if tenant == "vip" and t > overtaken_after + 1e-9:
            assert by_id[o.request_id].batch_id >= low.batch_id


async def test_abort_empties_the_queue_so_no_answered_request_runs(autojump_clock):
    config, preset = config_for("fifo")
    async with open_pipeline(config, build_policies(config, preset)) as pipeline:
        requests = []
        for _ in range(40):
            r = pipeline.new_request(tenant_id="vip", prompt="", tokens_requested=100, priority_bid=5,
                                     prompt_tokens=0)
            pipeline.submit_nowait(r)
            requests.append(r)
        await trio.sleep(1.0)                      # first batch running, 24 queued
        pipeline.close_doors()
        assert pipeline.abort_outstanding() == 40
        assert pipeline.scheduler.queue_depth == 0
        await trio.sleep(100.0)                    # the running batch ends; nothing else starts
        stats = pipeline.ledger.tenants["vip"]
        assert (stats.queued, stats.running, stats.cancelled, stats.completed) == (0, 0, 40, 0)
        assert pipeline.ledger.batches == 1
        assert {(await r.reply.wait()).status for r in requests} == {503}


async def test_a_request_cannot_be_submitted_twice(autojump_clock):
    config, preset = config_for("fifo")
    async with open_pipeline(config, build_policies(config, preset)) as pipeline:
        r = pipeline.new_request(tenant_id="vip", prompt="", tokens_requested=5, priority_bid=5, prompt_tokens=0)
        assert pipeline.submit_nowait(r) is None
        await trio.sleep(0.001)          # admitted
        with pytest.raises(ValueError, match="already submitted"):
            pipeline.submit_nowait(r)
        await r.reply.wait()
        with pytest.raises(ValueError, match="already submitted"):
            pipeline.submit_nowait(r)


async def test_cancelled_requests_do_not_pile_up_in_the_queue(autojump_clock):
    config, preset = config_for("static")
    async with open_pipeline(config, build_policies(config, preset)) as pipeline:
        blocker = pipeline.new_request(tenant_id="vip", prompt="", tokens_requested=10_000, priority_bid=10,
                                       prompt_tokens=0)
        pipeline.admit_now(blocker)                 # keeps the GPU busy for a long while
        await trio.sleep(1.0)
        live = [pipeline.new_request(tenant_id="vip", prompt="", tokens_requested=5, priority_bid=10,
                                     prompt_tokens=0) for _ in range(10)]
        for r in live:
            pipeline.admit_now(r)
        for _ in range(3000):                      # low bids whose clients give up at once
            r = pipeline.new_request(tenant_id="free", prompt="x" * 1000, tokens_requested=5, priority_bid=1,
                                     prompt_tokens=0)
            pipeline.admit_now(r)
            assert pipeline.cancel(r) and r.prompt == ""
        assert len(pipeline.scheduler.queue) < 1024 + 10 + 2   # compacted, not 3010
        assert pipeline.scheduler.queue_depth == 10
        outcomes = [await r.reply.wait() for r in live]
    assert all(isinstance(o, Completion) for o in outcomes)


async def test_ingress_duplicates_and_early_disconnects(autojump_clock):
    config, preset = config_for("fifo")
    async with open_pipeline(config, build_policies(config, preset)) as pipeline:
        r = pipeline.new_request(tenant_id="vip", prompt="", tokens_requested=5, priority_bid=5, prompt_tokens=0)
        assert pipeline.submit_nowait(r) is None           # waits in the ingress buffer...
        with pytest.raises(ValueError, match="already submitted"):
            pipeline.submit_nowait(r)                      # ...so a second submission is refused at once
        gone = pipeline.new_request(tenant_id="vip", prompt="", tokens_requested=5, priority_bid=5,
                                    prompt_tokens=0)
        pipeline.submit_nowait(gone)
        assert pipeline.cancel(gone)                       # its client left before admission
        assert isinstance(await r.reply.wait(), Completion)
        refusal = await gone.reply.wait()
        counts = metrics_document(pipeline)["requests"]
    assert (refusal.status, refusal.error) == (499, "client_disconnected")
    assert (counts["admitted"], counts["rejected"], counts["conservation_ok"]) == (1, 1, True)


@pytest.mark.parametrize(("preset", "policy", "waits_ms", "governor"), [
    ("fair", {}, 0.0, "none"),                                          # no window unless asked for
    ("fifo", {}, 0.0, "none"),
    ("fifo", {"fixed": {"window_ms": 10.0}}, 10.0, "fixed"),           # its governor's table asks for one
    ("aps", {"governor": "fixed"}, 10.0, "fixed"),                      # so does naming a governor
])
async def test_an_engine_that_batches_itself_waits_out_no_window_unless_one_is_configured(
        autojump_clock, preset, policy, waits_ms, governor):
    config, _ = config_for(preset, {"engine": {"kind": "continuous"}, "policy": policy})
    assert build_policies(config, preset).names["governor"] == governor
    outcomes, _ = await run((config, preset), [(0.0, "vip", 512, 16, 5)])
    assert outcomes[0].queue_ms == pytest.approx(waits_ms)


async def test_the_batch_engine_keeps_its_governors_window():
    config, preset = config_for("fair")
    policies = build_policies(config, preset)
    assert policies.names["governor"] == "entropy" and policies.governor.reading(0.0).window_s == pytest.approx(0.010)
