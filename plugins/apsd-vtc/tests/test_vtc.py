"""apsd-vtc through apsd's public API only: discovery, VTC rules, and the overload experiment."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

import apsd
from apsd_vtc import VtcParams, VtcQueue

APSD = str(Path(sys.executable).with_name("apsd"))


def request(seq, tenant, prompt=256, tokens=256):
    return apsd.InferenceRequest(f"r{seq}", tenant, prompt, tokens, 5, arrival=float(seq), seq=seq)


# -- discovery and selection ----------------------------------------------------------------------

def test_selected_by_name_or_preset():
    config = apsd.parse_config({"policy": {"aging": "vtc"}})
    assert isinstance(apsd.build_policies(config).aging, VtcQueue)
    assert apsd.build_policies(apsd.Config(), "vtc").names == {
        "preset": "vtc", "aging": "vtc", "governor": "fixed", "batching": "micro"}


def test_listed_by_apsd_plugins():
    listing = json.loads(subprocess.run([APSD, "plugins", "--json"], capture_output=True, text=True,
                                        check=True).stdout)
    (vtc,) = [p for p in listing if p["name"] == "vtc"]
    assert (vtc["distribution"], vtc["builtin"], vtc["provides"]) == (
        "apsd-vtc", False, {"aging": ["vtc"], "presets": ["vtc"]})


def test_allow_list_can_leave_it_out(monkeypatch):
    monkeypatch.setenv("APSD_PLUGINS", "")
    with pytest.raises(apsd.ConfigError, match="unknown aging policy 'vtc'"):
        apsd.build_policies(apsd.parse_config({"policy": {"aging": "vtc"}}))


def test_bad_parameters_name_the_key():
    with pytest.raises(apsd.ConfigError, match=r"policy\.vtc\.weights\.nobody: no such tenant"):
        apsd.build_policies(apsd.parse_config({"policy": {"aging": "vtc", "vtc": {"weights": {"nobody": 2.0}}}}))
    with pytest.raises(apsd.ConfigError, match=r"policy\.vtc\.output_weight: must be > 0"):
        apsd.build_policies(apsd.parse_config({"policy": {"aging": "vtc", "vtc": {"output_weight": 0}}}))


# -- the VTC rules -------------------------------------------------------------------------------

def test_least_served_backlogged_tenant_goes_first_and_pays():
    q = VtcQueue(VtcParams())
    for seq in range(4):
        q.push(request(seq, "a"), 0.0)
    q.push(request(4, "b"), 0.0)
    order = [q.pop(0.0).tenant_id for _ in range(5)]
    # a pays 256 + 2*256 = 768; then b (0) is least served; then a again
    assert order == ["a", "b", "a", "a", "a"]
    assert q.counters["a"] == 4 * 768 and q.counters["b"] == 768


def test_returning_tenant_is_lifted_and_cannot_bank_credit():
    q = VtcQueue(VtcParams())
    for seq in range(10):
        q.push(request(seq, "a"), 0.0)
    for _ in range(5):
        q.pop(0.0)                       # a has been served 5 * 768 while b was idle
    q.push(request(10, "b"), 0.0)
    assert q.counters["b"] == q.counters["a"] == 5 * 768
    # so b does not get five requests in a row; the tie goes to b, served less recently than a
    order = [q.pop(0.0).tenant_id for _ in range(3)]
    assert order == ["b", "a", "a"]


def test_weights_divide_the_charge_and_output_is_corrected_on_finish():
    q = VtcQueue(VtcParams(weights={"gold": 2.0}))
    r = request(0, "gold", prompt=100, tokens=50)
    q.push(r, 0.0)
    q.pop(0.0)
    assert q.counters["gold"] == (100 + 2 * 50) / 2
    r.dispatched_at, r.started_at, r.tokens_generated = 0.0, 0.5, 20
    done = apsd.Completion(request_id="r0", tenant_id="gold", prompt_tokens=100, tokens_generated=20,
                           queue_ms=0, ttft_ms=0, tpot_ms=None, prefill_ms=0, decode_ms=0, latency_ms=0, batch_id=1,
                           batch_size=1, engine_id=0, effective_priority=0, cost_usd=0)
    q.on_finish(r, done, 1.0)
    assert q.counters["gold"] == (100 + 2 * 20) / 2


def test_a_client_that_left_mid_stream_is_charged_what_it_was_served():
    q = VtcQueue(VtcParams())
    r = request(0, "a", prompt=100, tokens=50)
    q.push(r, 0.0)
    q.pop(0.0)
    r.dispatched_at, r.started_at, r.tokens_generated = 0.0, 0.5, 7
    q.on_finish(r, apsd.Refusal(499, "client_disconnected", "left", kind="cancelled"), 1.0)
    assert q.counters["a"] == 100 + 2 * 7


def test_work_conserving():
    q = VtcQueue(VtcParams())
    rng = random.Random(7)
    pushed = 0
    for seq in range(200):
        q.push(request(seq, rng.choice("abcde")), 0.0)
        pushed += 1
        if rng.random() < 0.5:
            q.pop(0.0)
            pushed -= 1
        assert len(q) == pushed == len(list(q))
    while q:
        q.pop(0.0)
    with pytest.raises(IndexError):
        q.pop(0.0)


# -- the paper's overload experiment, on apsd's simulated A100, in virtual time -------------------

RATES = {"slow": 1.5, "fast": 3.0}  # requests per second, 256 in / 256 out each: far beyond capacity
DURATION_S = 1200.0


def poisson_arrivals(seed=2024):
    rng = random.Random(seed)
    arrivals = []
    for tenant, rate in RATES.items():
        t = 0.0
        while (t := t + rng.expovariate(rate)) < DURATION_S:
            arrivals.append((t, tenant))
    return sorted(arrivals)


async def service_difference(preset):
    """Max |service(slow) - service(fast)| over the first half and over the whole run."""
    config = apsd.parse_config({
        "tenants": {t: {"rate": 1e9, "burst": 10**9} for t in RATES},
        "queue": {"max_requests": 100_000, "max_requests_per_tenant": 100_000},
    })
    async with apsd.open_pipeline(config, apsd.build_policies(config, preset)) as pipeline:
        requests = []
        for t, tenant in poisson_arrivals():
            await pipeline.clock.sleep_until(t)
            r = pipeline.new_request(tenant_id=tenant, prompt="", tokens_requested=256, priority_bid=5,
                                     prompt_tokens=256)
            assert pipeline.submit_nowait(r) is None
            requests.append(r)
        await pipeline.clock.sleep_until(DURATION_S)
        done = sorted((o.latency_ms / 1000 + r.arrival, o.tenant_id, o.prompt_tokens + 2 * o.tokens_generated)
                      for r in requests if isinstance(o := r.reply.outcome, apsd.Completion))
        backlog = {t: sum(1 for r in requests if r.tenant_id == t and r.reply.outcome is None) for t in RATES}
        assert pipeline.statistics().books.requests.rejected == 0      # everything sent was admitted
    assert min(backlog.values()) > 100, backlog        # both tenants stay backlogged: a real overload
    served = dict.fromkeys(RATES, 0.0)
    worst = {"half": 0.0, "whole": 0.0}
    for finished_at, tenant, service in done:
        served[tenant] += service
        gap = abs(served["slow"] - served["fast"])
        worst["whole"] = max(worst["whole"], gap)
        if finished_at <= DURATION_S / 2:
            worst["half"] = max(worst["half"], gap)
    return worst, served


async def test_vtc_keeps_the_service_difference_bounded_fifo_does_not(autojump_clock):
    fifo, fifo_served = await service_difference("fifo")
    vtc, vtc_served = await service_difference("vtc")
    one_batch = 16 * (256 + 2 * 256)
    # FIFO serves in proportion to demand: the gap grows with the run (about doubling)
    assert fifo["whole"] > 1.7 * fifo["half"] and fifo["whole"] > 20 * one_batch
    # VTC: bounded by a couple of batches' service, and no bigger over the longer run
    assert vtc["whole"] <= 2 * one_batch
    assert vtc["whole"] <= vtc["half"] + one_batch
    # and it is work-conserving: the same total service as FIFO, within one batch
    assert abs(sum(vtc_served.values()) - sum(fifo_served.values())) <= one_batch


async def test_weights_give_proportional_shares(autojump_clock):
    config = apsd.parse_config({
        "tenants": {t: {"rate": 1e9, "burst": 10**9} for t in ("gold", "bronze")},
        "policy": {"vtc": {"weights": {"gold": 2.0}}},
        "queue": {"ingress_buffer": 2000},
    })
    async with apsd.open_pipeline(config, apsd.build_policies(config, "vtc")) as pipeline:
        requests = []
        for i in range(600):   # both far beyond capacity, equal demand
            for tenant in ("gold", "bronze"):
                r = pipeline.new_request(tenant_id=tenant, prompt="", tokens_requested=64, priority_bid=5,
                                         prompt_tokens=64)
                assert pipeline.submit_nowait(r) is None
                requests.append(r)
        await pipeline.clock.sleep_until(120.0)   # about 500 of the 1200 served: both still backlogged
        assert pipeline.statistics().books.requests.rejected == 0
        assert all(any(r.tenant_id == t and r.reply.outcome is None for r in requests) for t in ("gold", "bronze"))
        tokens = {t: sum(r.reply.outcome.tokens_generated for r in requests
                         if r.tenant_id == t and isinstance(r.reply.outcome, apsd.Completion))
                  for t in ("gold", "bronze")}
    assert tokens["gold"] / tokens["bronze"] == pytest.approx(2.0, rel=0.05)


# -- selected in a real daemon, over HTTP ---------------------------------------------------------

async def test_daemon_runs_vtc_over_http(tmp_path):
    config = tmp_path / "vtc.toml"
    config.write_text('[policy]\naging = "vtc"\n[gpu]\ntime_scale = 0.001\n'
                      '[tenants.a]\nrate = 1000.0\nburst = 10000\n[tenants.b]\nrate = 1000.0\nburst = 10000\n')
    process = await trio.lowlevel.open_process([APSD, str(config), "--port", "0"], stderr=subprocess.PIPE)
    try:
        seen = b""
        with trio.fail_after(30):
            while not (match := re.search(rb"listening on (http://\S+)", seen)):
                seen += await process.stderr.receive_some()
        async with httpx.AsyncClient(base_url=match.group(1).decode(), timeout=30) as client:
            health = (await client.get("/health")).json()
            assert health["policy"]["aging"] == "vtc"
            answer = await client.post("/infer", json={"tenant_id": "a", "prompt": "hi", "tokens_requested": 8,
                                                       "priority_bid": 1})
            assert answer.status_code == 200
            # minus a's counter right after dispatch charged it: 1 prompt token + 2 x 8 output tokens
            assert answer.json()["effective_priority"] == -17.0
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0


def test_requests_that_are_not_served_are_refunded():
    q = VtcQueue(VtcParams())
    served, failed, cancelled = request(0, "a"), request(1, "a"), request(2, "a")
    for r in (served, failed, cancelled):
        q.push(r, 0.0)
    cancelled.reply.resolve(apsd.Refusal(499, "client_disconnected", "gone", kind="cancelled"))
    q.on_finish(cancelled, cancelled.reply.outcome, 0.0)   # answered while queued: nothing charged
    assert [q.pop(0.0) for _ in range(3)] == [served, failed, cancelled]
    assert q.counters["a"] == 2 * 768                      # the cancelled one was skipped, not charged
    q.on_finish(failed, apsd.Refusal(500, "policy_error", "boom", kind="failed"), 1.0)
    assert q.counters["a"] == 768                          # the failed one is refunded whole
