"""The simulate report: figures checked against hand-computed answers, reproducible files."""

import json
import re
import subprocess
import sys

import attrs
import numpy as np
import pytest

from apsd.core.config import Config, EngineConfig, ServiceClassConfig, TenantConfig
from apsd.core.ledger import FAIRNESS_DEFINITION
from apsd.plugins import make_plugin_manager
from apsd.policies.fair import ChargeWeights
from apsd.sim.records import Arrival, BatchRecord, EngineRecord, GovernorSample, PolicyRun, RequestRecord, Workload
from apsd.sim.report import (
    PLOT_FILES,
    SERVICE_DIFFERENCE_DEFINITION,
    SERVICE_WEIGHTS,
    BatchSizes,
    LowestBidder,
    Percentiles,
    RunSummary,
    TimeInState,
    WorkloadSummary,
    build_figure,
    format_summary_table,
    service_difference_over_time,
    summarize,
    write_report,
)
from apsd.sim.report.markdown import report_markdown
from apsd.sim.report.timeline import busy_cumulative
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.workloads import UNTHROTTLED

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def tiny_workload(name="tiny", seed=7):
    return Workload(
        name=name,
        description="Two tenants, four requests",
        arrivals=(
            Arrival(at=0.0, tenant="a", prompt_tokens=5, output_tokens=10, bid=1),
            Arrival(at=0.2, tenant="b", prompt_tokens=5, output_tokens=20, bid=5),
            Arrival(at=1.0, tenant="a", prompt_tokens=5, output_tokens=30, bid=1),
            Arrival(at=1.1, tenant="b", prompt_tokens=5, output_tokens=40, bid=5),
        ),
        tenants={"a": TenantConfig(rate=10, burst=100), "b": TenantConfig(rate=20, burst=100)},
        params={"rps": 3.5, "tenants": 2},
        seed=seed,
    )


def tiny_run(label="aps", workload=None, **changes):
    """2 tenants, 4 requests (3 completed, 1 rejected), 2 batches on 2 GPUs (batch engines), 4 s.

    First tokens: a's at 0.6 and 2.55 s (TTFT 0.6, 1.55 s), b's at 0.55 s (TTFT 0.35 s); time per
    output token after the first: (1.5 - 0.6) / 9 = 100 ms, (1.5 - 0.55) / 19 = 50 ms,
    (4.0 - 2.55) / 29 = 50 ms.
    """
    requests = (
        RequestRecord("a", 1, 5, 10, arrival=0.0, outcome="completed", dispatched_at=0.5, finished_at=1.5,
                      batch_id=0, batch_size=2, cost_usd=0.001, started_at=0.6, tpot=0.1, engine_id=0),
        RequestRecord("b", 5, 5, 20, arrival=0.2, outcome="completed", dispatched_at=0.5, finished_at=1.5,
                      batch_id=0, batch_size=2, cost_usd=0.001, started_at=0.55, tpot=0.05, engine_id=0),
        RequestRecord("a", 1, 5, 30, arrival=1.0, outcome="completed", dispatched_at=2.0, finished_at=4.0,
                      batch_id=1, batch_size=1, cost_usd=0.003, started_at=2.55, tpot=0.05, engine_id=1),
        RequestRecord("b", 5, 5, 40, arrival=1.1, outcome="rejected", error="rate_limited"),
    )
    batches = (
        BatchRecord(0, executor_id=0, size=2, kv_tokens=40, formed_at=0.5, started_at=0.5, finished_at=1.5,
                    busy_s=1.0, cost_usd=0.002, window_s=0.01),
        BatchRecord(1, executor_id=1, size=1, kv_tokens=35, formed_at=2.0, started_at=2.0, finished_at=4.0,
                    busy_s=2.0, cost_usd=0.003, window_s=0.01),
    )
    states = ["STABLE"] * 5 + ["CRITICAL_BURST"] * 2 + ["TRANSITIONAL"]
    samples = tuple(
        GovernorSample(at=0.5 * i, state=s, entropy_bits=None if i == 0 else 0.25 * i,
                       window_s=0.010 - 0.001 * i, queue_depth=i % 3)
        for i, s in enumerate(states)
    )
    fields = dict(
        label=label,
        policy={"preset": "aps", "aging": "aps", "governor": "entropy", "batching": "micro"},
        workload=workload or tiny_workload(),
        requests=requests,
        batches=batches,
        samples=samples,
        sample_interval_s=0.5,
        duration_s=4.0,
        gpus=2,
        tenant_rates={"a": 10.0, "b": 20.0},
        engine={"kind": "batch", "count": 2},
        wall_s=0.123,
    )
    fields.update(changes)
    return PolicyRun(**fields)


CONTINUOUS = {"kind": "continuous", "gpu": "a100-80gb", "model": "llama-3-8b", "tp": 1, "count": 2}


def continuous_run(label="aps"):
    """tiny_run's requests on two continuous engines: no batches, the engines' own busy time and cost.

    Engine 0 ran a's requests ([0.5, 1.5] and [2, 4]: busy 3 s), engine 1 b's ([0.5, 1.5]: busy 1 s).
    """
    run = tiny_run(label)
    requests = tuple(attrs.evolve(r, engine_id=None if r.outcome == "rejected" else (0 if r.tenant == "a" else 1),
                                  batch_id=None, batch_size=None) for r in run.requests)
    engines = (
        EngineRecord(0, "continuous", busy_s=3.0, cost_usd=0.006, dispatches=2, tokens_generated=40, preemptions=1,
                     kv_tokens_capacity=1000, mfu=0.3, mbu=0.7),
        EngineRecord(1, "continuous", busy_s=1.0, cost_usd=0.002, dispatches=1, tokens_generated=20, preemptions=2,
                     kv_tokens_capacity=1000, mfu=0.1, mbu=0.5),
    )
    return attrs.evolve(run, requests=requests, batches=(), engines=engines, engine=CONTINUOUS)


def empty_run(label="empty"):
    return PolicyRun(
        label=label, policy={"preset": "fifo"},
        workload=Workload(name="nothing", description="", arrivals=(), tenants={}, params={}),
        requests=(), batches=(), samples=(), sample_interval_s=0.5, duration_s=0.0, gpus=1, tenant_rates={},
    )


# -- summarize --------------------------------------------------------------------------

def test_summary_top_level_and_workload():
    s = summarize(tiny_run())
    assert set(s.as_dict()) == {"label", "policy", "workload", "gpus", "engine", "duration_s", "tenants", "overall",
                                "isolation", "routing", "classes"}
    assert s.isolation == () and s.routing == {} and s.classes == ()
    assert s.label == "aps"
    assert s.policy["governor"] == "entropy"
    assert s.workload == WorkloadSummary(name="tiny", description="Two tenants, four requests",
                                         params={"rps": 3.5, "tenants": 2}, seed=7, arrivals=4, tenants=2)
    assert s.gpus == 2 and s.duration_s == 4.0
    assert list(s.tenants) == ["a", "b"]


def test_overall_figures_match_hand_computation():
    o = summarize(tiny_run()).overall
    assert (o.sent, o.completed, o.rejected, o.failed, o.cancelled) == (4, 3, 1, 0, 0)
    assert o.rejected_by_error == {"rate_limited": 1}
    assert o.output_tokens == 60
    assert o.throughput_tokens_per_s == 15.0            # 60 tokens / 4 s
    assert o.gpu_busy_s == 3.0
    assert o.gpu_utilization == 0.375                   # 3 s busy / (2 GPUs * 4 s)
    assert o.cost_usd == 0.005
    assert o.cost_per_1m_tokens_usd == pytest.approx(0.005 / 60 * 1e6, rel=1e-6)  # 83.3333
    assert o.batches == 2
    # Overall waits 0.5, 0.3, 1.0 s; latencies 1.5, 1.3, 3.0 s (the rejected request has neither).
    assert o.queue_wait_ms == Percentiles(500.0, 950.0, 990.0, 1000.0)
    assert o.latency_ms.p50 == 1500.0
    assert o.latency_ms.p99 == pytest.approx(2970.0)
    assert o.latency_ms.max == 3000.0
    # TTFTs 0.35, 0.6, 1.55 s: p95 at rank 1.9 is 600 + 0.9 * 950 ms, p99 at rank 1.98 is 600 + 0.98 * 950 ms.
    assert o.ttft_ms == Percentiles(600.0, 1455.0, 1531.0, 1550.0)
    # TPOTs 50, 50, 100 ms.
    assert o.tpot_ms == Percentiles(50.0, 95.0, 99.0, 100.0)


def test_cached_share_routes_and_class_attainment():
    """The cached share counts completed requests' prompt tokens; routes are counted by engine and reason
    for every request routed; a class's attainment is met / requests (a refused one counts against it)."""
    run = tiny_run()
    requests = list(run.requests)
    requests[0] = attrs.evolve(requests[0], cached_tokens=4, route="engine-0; reason=cache_match",
                               service_class="tight")
    requests[1] = attrs.evolve(requests[1], cached_tokens=1, route="engine-0; reason=no_match", service_class="tight")
    requests[2] = attrs.evolve(requests[2], route="engine-1; reason=no_match", service_class="loose")
    requests[3] = attrs.evolve(requests[3], error="deadline_unmeetable", service_class="tight")
    classes = {"tight": ServiceClassConfig(ttft_s=0.5), "loose": ServiceClassConfig(ttft_s=2.0, on_miss="best_effort")}
    s = summarize(attrs.evolve(run, requests=tuple(requests), classes=classes))
    assert s.overall.cached_prompt_share == pytest.approx(5 / 15)
    assert s.routing == {"engine-0": {"cache_match": 1, "no_match": 1}, "engine-1": {"no_match": 1}}
    tight, loose = s.classes[1], s.classes[0]
    assert (loose.name, loose.requests, loose.met, loose.attainment) == ("loose", 1, 1, 1.0)
    # TTFTs 0.6 (missed) and 0.35 (met), and a refusal: 1 of 3
    assert (tight.name, tight.requests, tight.met, tight.missed, tight.refused) == ("tight", 3, 1, 1, 1)
    assert tight.attainment == pytest.approx(1 / 3)
    report = report_markdown("T", [[s]], {})
    assert "found 33.3% of the completed requests' prompt tokens" in report
    assert "| `engine-0` | `cache_match` | 1 |" in report
    assert "| `tight` | 0.5 | refuse | 3 | 1 | 1 | 1 | 33.3 |" in report
    assert "#### Service classes" not in report_markdown("T", [[summarize(tiny_run())]], {})


def test_per_tenant_figures():
    t = summarize(tiny_run()).tenants
    a, b = t["a"], t["b"]
    assert (a.sent, a.completed, a.rejected, a.admitted) == (2, 2, 0, 2)
    assert (b.sent, b.completed, b.rejected, b.admitted) == (2, 1, 1, 1)
    assert b.rejected_by_error == {"rate_limited": 1} and a.rejected_by_error == {}
    assert a.bids == (1,) and b.bids == (5,)
    assert a.output_tokens == 40 and b.output_tokens == 20
    # a waited 0.5 and 1.0 s: linear percentiles between the two.
    assert a.queue_wait_ms == Percentiles(750.0, 975.0, 995.0, 1000.0)
    assert a.latency_ms == Percentiles(2250.0, 2925.0, 2985.0, 3000.0)
    # b's only completed request waited 0.3 s; its rejected one does not count.
    assert b.queue_wait_ms == Percentiles(300.0, 300.0, 300.0, 300.0)
    assert b.latency_ms.max == 1300.0
    assert a.service_per_rate == 4.0 and b.service_per_rate == 1.0
    # a's first tokens came 0.6 and 1.55 s after arrival, at 100 and 50 ms per later token.
    assert a.ttft_ms == Percentiles(1075.0, 1502.5, 1540.5, 1550.0)
    assert a.tpot_ms == Percentiles(75.0, 97.5, 99.5, 100.0)
    assert b.ttft_ms == Percentiles(350.0, 350.0, 350.0, 350.0)
    assert b.tpot_ms.max == 50.0


def test_ttft_and_tpot_skip_requests_without_them():
    run = tiny_run()
    # A one-token request has no TPOT; a request with no first token recorded has no TTFT.
    one_token = attrs.evolve(run.requests[0], output_tokens=1, tpot=None)
    unstamped = attrs.evolve(run.requests[2], started_at=None)
    s = summarize(attrs.evolve(run, requests=(one_token, run.requests[1], unstamped, run.requests[3])))
    assert s.tenants["a"].ttft_ms == Percentiles(600.0, 600.0, 600.0, 600.0)
    assert s.tenants["a"].tpot_ms == Percentiles(50.0, 50.0, 50.0, 50.0)
    assert s.tenants["a"].latency_ms.max == 3000.0  # latency still counts both


def test_batch_engine_block():
    assert summarize(tiny_run()).engine.as_dict() == {"kind": "batch", "count": 2, "preemptions": 0, "mfu": None,
                                               "mbu": None}


def test_continuous_engine_busy_time_and_cost_come_from_the_engines():
    s = summarize(continuous_run())
    o = s.overall
    assert o.batches == 0
    assert o.gpu_busy_s == 4.0                          # 3 s + 1 s
    assert o.gpu_utilization == 0.5                     # 4 s busy / (2 engines * 4 s)
    assert o.cost_usd == 0.008
    assert o.cost_per_1m_tokens_usd == 133.333          # 0.008 / 60 * 1e6, to 6 significant digits
    assert o.batch_sizes == BatchSizes(count=0, distribution={}, mean=None)
    # MFU and MBU over the engines' busy time: (0.3 * 3 + 0.1 * 1) / 4 and (0.7 * 3 + 0.5 * 1) / 4.
    assert s.engine.as_dict() == {**CONTINUOUS, "preemptions": 3, "mfu": 0.25, "mbu": 0.65}
    # The request figures do not depend on the engine kind.
    assert o.ttft_ms == summarize(tiny_run()).overall.ttft_ms


def test_engine_mfu_is_a_plain_mean_when_no_engine_was_busy():
    run = continuous_run()
    idle = tuple(attrs.evolve(e, busy_s=0.0) for e in run.engines)
    assert summarize(attrs.evolve(run, engines=idle)).engine.mfu == 0.2


def test_a_continuous_engine_run_has_utilization_cost_and_token_times():
    workload = Workload(name="two", description="", tenants={"t": UNTHROTTLED, "u": UNTHROTTLED}, params={},
                        arrivals=(Arrival(0.0, "t", 512, 64, 5), Arrival(0.5, "u", 128, 32, 5)))
    config = attrs.evolve(Config(), engine=EngineConfig(kind="continuous", gpu="a100-80gb", model="llama-3-8b"))
    run = run_policy(workload, parse_policy_choice("fifo"), base_config=config,
                     plugin_manager=make_plugin_manager(load_entry_points=False))
    s = summarize(run)
    o = s.overall
    assert run.batches == () and o.completed == 2
    assert 0 < o.gpu_utilization <= 1 and o.gpu_busy_s == pytest.approx(run.engines[0].busy_s, rel=1e-5)
    assert o.gpu_utilization == pytest.approx(run.engines[0].busy_s / run.duration_s, rel=1e-5)
    assert o.cost_usd > 0 and o.cost_usd == pytest.approx(run.engines[0].cost_usd, rel=1e-5)
    assert o.cost_per_1m_tokens_usd == pytest.approx(run.engines[0].cost_usd / 96 * 1e6, rel=1e-5)
    assert s.engine.kind == "continuous" and 0 < s.engine.mfu < s.engine.mbu < 1
    first = run.requests[0]
    assert o.ttft_ms.max >= 1000 * first.ttft > 0 and 0 < o.tpot_ms.p50 < 100
    # gpu_busy.png's curve (busy while a sequence is in the engine) adds up to the engine's busy time.
    total = busy_cumulative(run, np.array([0.0, run.duration_s]))[-1]
    assert total == pytest.approx(run.engines[0].busy_s, rel=1e-6)


def test_jain_index_uses_tokens_over_rate():
    f = summarize(tiny_run()).overall.fairness
    # x_a = 40 / 10 = 4, x_b = 20 / 20 = 1: (4 + 1)^2 / (2 * (16 + 1)) = 25 / 34.
    assert f.jain_index == pytest.approx(25 / 34, rel=1e-6)
    assert f.tenants_counted == 2
    assert f.fairness_definition == FAIRNESS_DEFINITION
    assert "divided by its configured rate" in f.fairness_definition


def test_jain_index_skips_tenants_with_nothing_admitted():
    run = tiny_run()
    only_rejected = RequestRecord("c", 3, 5, 10, arrival=0.1, outcome="rejected", error="unknown_tenant")
    run = attrs.evolve(run, requests=run.requests + (only_rejected,),
                       tenant_rates={**run.tenant_rates, "c": 10.0})
    s = summarize(run)
    assert s.tenants["c"].rejected == 1
    assert s.overall.fairness.tenants_counted == 2
    assert s.overall.fairness.jain_index == pytest.approx(25 / 34, rel=1e-6)


def test_lowest_bidder():
    lb = summarize(tiny_run()).overall.lowest_bidder
    assert lb == LowestBidder(bid=1, tenants=("a",), requests=2, completed=2, max_queue_wait_ms=1000.0,
                              p99_queue_wait_ms=995.0)


def test_governor_time_in_state():
    g = summarize(tiny_run()).overall.governor
    assert g.samples == 8 and g.sample_interval_s == 0.5
    assert g.time_in_state == {
        "CRITICAL_BURST": TimeInState(seconds=1.0, fraction=0.25),
        "STABLE": TimeInState(seconds=2.5, fraction=0.625),
        "TRANSITIONAL": TimeInState(seconds=0.5, fraction=0.125),
    }
    # windows 10, 9, ..., 3 ms -> mean 6.5 ms; entropies 0.25..1.75 (the first sample has none) -> mean 1.0
    assert g.mean_window_ms == 6.5
    assert g.mean_entropy_bits == 1.0


def test_batch_size_distribution():
    b = summarize(tiny_run()).overall.batch_sizes
    assert b == BatchSizes(count=2, distribution={"1": 1, "2": 1}, mean=1.5)


def test_failed_and_cancelled_are_counted_but_not_timed():
    run = tiny_run()
    failed = RequestRecord("a", 1, 5, 99, arrival=0.1, outcome="failed", error="executor_error",
                           dispatched_at=3.0, finished_at=3.9, batch_id=9, batch_size=1)
    cancelled = RequestRecord("b", 5, 5, 99, arrival=0.3, outcome="cancelled", error="client_disconnected")
    s = summarize(attrs.evolve(run, requests=run.requests + (failed, cancelled)))
    o = s.overall
    assert (o.sent, o.completed, o.rejected, o.failed, o.cancelled) == (6, 3, 1, 1, 1)
    assert o.rejected_by_error == {"rate_limited": 1}
    assert s.tenants["a"].failed == 1 and s.tenants["b"].cancelled == 1
    # The failed request's 2.9 s wait and 3.8 s latency are in no percentile, and its tokens are not served.
    assert s.tenants["a"].queue_wait_ms.max == 1000.0
    assert o.latency_ms.max == 3000.0
    assert o.output_tokens == 60
    assert o.lowest_bidder.requests == 3 and o.lowest_bidder.completed == 2


def test_no_completions_gives_nulls():
    run = tiny_run()
    rejected = tuple(attrs.evolve(r, outcome="rejected", error="rate_limited", dispatched_at=None,
                                  finished_at=None, batch_id=None, batch_size=None, cost_usd=0.0)
                     for r in run.requests)
    s = summarize(attrs.evolve(run, requests=rejected, batches=(), samples=()))
    o = s.overall
    assert o.completed == 0 and o.rejected == 4
    assert o.throughput_tokens_per_s == 0.0
    assert o.gpu_utilization == 0.0
    assert o.cost_per_1m_tokens_usd is None
    assert o.fairness.jain_index is None
    assert o.queue_wait_ms == Percentiles(None, None, None, None)
    assert o.lowest_bidder.max_queue_wait_ms is None
    assert o.batch_sizes == BatchSizes(count=0, distribution={}, mean=None)
    assert o.governor.time_in_state == {}


def test_empty_run_does_not_crash(tmp_path):
    s = summarize(empty_run())
    o = s.overall
    assert o.sent == 0 and s.tenants == {}
    assert o.throughput_tokens_per_s is None and o.gpu_utilization is None
    assert o.ttft_ms.p99 is None and o.tpot_ms.p99 is None
    assert o.lowest_bidder.bid is None
    paths = write_report([empty_run()], tmp_path)
    assert {p.name for p in paths} == {"summary.json", "report.md", *PLOT_FILES}
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["runs"][0]["overall"]["latency_ms"]["p99"] is None
    md = (tmp_path / "report.md").read_text()
    assert "| `empty` | 0 | 0 | — |" in md and "No batches ran." in md


def test_floats_are_rounded_and_wall_time_is_not_reported():
    s = summarize(tiny_run())
    assert s.overall.cost_per_1m_tokens_usd == 83.3333
    assert "wall" not in s.to_json()
    assert summarize(tiny_run(wall_s=99.0)) == s


def test_a_summary_is_typed_and_as_dict_is_what_summary_json_holds():
    s = summarize(tiny_run())
    assert isinstance(s, RunSummary) and s.tenants["a"].bids == (1,) and s.overall.lowest_bidder.tenants == ("a",)
    d = s.as_dict()
    # The counts and the engine's details sit beside the other keys, tuples become lists.
    assert list(d["overall"])[:7] == ["sent", "completed", "rejected", "failed", "cancelled", "rejected_by_error",
                                      "output_tokens"]
    assert list(d["tenants"]["a"])[:7] == ["sent", "completed", "rejected", "failed", "cancelled",
                                           "rejected_by_error", "admitted"]
    assert d["engine"] == {"count": 2, "kind": "batch", "preemptions": 0, "mfu": None, "mbu": None}
    assert summarize(continuous_run()).as_dict()["engine"] == {**CONTINUOUS, "preemptions": 3, "mfu": 0.25,
                                                               "mbu": 0.65}
    assert d["tenants"]["a"]["bids"] == [1] and d["overall"]["lowest_bidder"]["tenants"] == ["a"]
    assert d["overall"]["governor"]["time_in_state"]["STABLE"] == {"seconds": 2.5, "fraction": 0.625}
    assert json.loads(s.to_json()) == d
    # Numbers are rounded as a value is made; integers stay integers, a non-finite float is None.
    assert Percentiles(1 / 3, 2 / 3, float("inf"), 2).as_dict() == {"p50": 0.333333, "p95": 0.666667, "p99": None,
                                                                    "max": 2}
    assert '"cost_usd": 0,' in summarize(empty_run()).to_json()  # no engine ran: an integer 0, as summed


def test_the_report_restates_neither_fairness_nor_the_service_weights():
    assert summarize(tiny_run()).overall.fairness.fairness_definition is FAIRNESS_DEFINITION
    assert SERVICE_WEIGHTS == ChargeWeights()  # the fair-share policy's charge: VTC's 1 and 2
    d = summarize(backlog_run()).overall.service_difference
    assert (d.input_weight, d.output_weight) == (SERVICE_WEIGHTS.input_weight, SERVICE_WEIGHTS.output_weight)
    assert SERVICE_DIFFERENCE_DEFINITION.startswith(
        f"service = {SERVICE_WEIGHTS.input_weight:g} × prompt tokens + {SERVICE_WEIGHTS.output_weight:g} × output "
        "tokens")


# -- the GPU busy curve behind gpu_busy.png ---------------------------------------------

def test_busy_curve_spreads_busy_time_over_each_batch():
    edges = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    # Batch 0 is busy 1 s over [0.5, 1.5]; batch 1 is busy 2 s over [2, 4].
    assert busy_cumulative(tiny_run(), edges).tolist() == [0.0, 0.5, 1.0, 2.0, 3.0]
    instant = attrs.evolve(tiny_run(), batches=(BatchRecord(0, 0, 1, 1, 1.0, 1.0, 1.0, 0.25, 0.0, 0.0),))
    assert busy_cumulative(instant, edges).tolist() == [0.0, 0.25, 0.25, 0.25, 0.25]


def test_busy_curve_without_batches_is_each_engines_time_with_a_sequence():
    edges = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
    # Engine 0 holds a sequence over [0.5, 1.5] and [2, 4], engine 1 over [0.5, 1.5].
    assert busy_cumulative(continuous_run(), edges).tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    # Overlapping sequences on one engine count once: b's [0.5, 1.5] moved to engine 0 adds nothing.
    run = continuous_run()
    moved = attrs.evolve(run, requests=(run.requests[0], attrs.evolve(run.requests[1], engine_id=0),
                                        *run.requests[2:]))
    assert busy_cumulative(moved, edges).tolist() == [0.0, 0.5, 1.0, 2.0, 3.0]


# -- the service difference between backlogged tenants -----------------------------------

def served(tenant, arrival, dispatched, started, finished, prompt, output):
    return RequestRecord(tenant, 5, prompt, output, arrival=arrival, outcome="completed", dispatched_at=dispatched,
                         started_at=started, finished_at=finished, engine_id=0)


def backlog_run(label="fifo", weights=None):
    """Two tenants over 20 s, each with one request served and one waiting from t = 0.

    a: 10 + 2·20 = 50 service from 0 to 10 s, a request waiting until 15 s; b: 0 + 2·50 = 100 from
    2 to 12 s, a request waiting until 12 s; c: only rejected. Both a and b are backlogged throughout
    the 10 s windows from 0, 1 and 2 s (ending by 12 s), where a receives 50, 45, 40 and b 80, 90, 100.
    """
    tenants = {t: TenantConfig(rate=1e6, burst=10**9, weight=(weights or {}).get(t, 1.0)) for t in "abc"}
    workload = Workload(name="backlog", description="", arrivals=(), tenants=tenants, params={})
    requests = (
        served("a", 0.0, 0.0, 0.0, 10.0, 10, 20), served("a", 0.0, 15.0, 15.0, 20.0, 1, 1),
        served("b", 0.0, 0.0, 2.0, 12.0, 0, 50), served("b", 0.0, 12.0, 12.0, 20.0, 1, 1),
        RequestRecord("c", 5, 1, 1, arrival=0.0, outcome="rejected", error="rate_limited"),
    )
    return PolicyRun(label=label, policy={"preset": label}, workload=workload, requests=requests, batches=(),
                     samples=(), sample_interval_s=1.0, duration_s=20.0, gpus=1, tenant_rates={},
                     engine={"kind": "continuous", "count": 1})


def test_service_difference_is_measured_among_tenants_backlogged_throughout_a_window():
    starts, difference = service_difference_over_time(backlog_run())
    assert starts.tolist() == list(range(11))  # 10 s windows from 0, 1, ..., 10 s: all end by 20 s
    assert difference[:3].tolist() == pytest.approx([30.0, 45.0, 60.0])
    assert np.isnan(difference[3:]).all()  # b's queue is empty from 12 s: only a is backlogged
    d = summarize(backlog_run()).overall.service_difference
    assert d.as_dict() == {"window_s": 10.0, "step_s": 1.0, "input_weight": 1.0, "output_weight": 2.0,
                           "windows": 3, "max": 60.0, "max_window_start_s": 2.0, "mean": 45.0,
                           "first_half_windows": 1, "first_half_max": 30.0, "first_half_max_window_start_s": 0.0}


def test_service_difference_divides_service_by_the_tenants_weight():
    # b's weight 2 halves its service: 40, 45, 50 against a's 50, 45, 40.
    _, difference = service_difference_over_time(backlog_run(weights={"b": 2.0}))
    assert difference[:3].tolist() == pytest.approx([10.0, 0.0, 10.0])


def test_no_service_difference_without_two_tenants_waiting_for_a_whole_window():
    run = backlog_run()
    never_waits = tuple(attrs.evolve(r, dispatched_at=r.arrival) if r.tenant == "b" else r for r in run.requests)
    d = summarize(attrs.evolve(run, requests=never_waits)).overall.service_difference
    assert (d.windows, d.max, d.first_half_max, d.mean) == (0, None, None, None)
    assert summarize(tiny_run()).overall.service_difference.windows == 0  # 4 s: shorter than a window


def test_report_and_plot_show_the_service_difference(tmp_path):
    write_report([backlog_run("fifo"), backlog_run("fair", weights={"b": 2.0})], tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "| `fifo` | 3 (first half 1) | 30 | 60 | 2.000 | 45 |" in md
    assert "| `fair` | 3 (first half 1) | 10 | 10 | 0.000 | 7 |" in md  # (10 + 0 + 10) / 3
    assert SERVICE_DIFFERENCE_DEFINITION[1:] in md
    never = attrs.evolve(tiny_run("static"), workload=backlog_run().workload)
    (ax,) = build_figure("service_difference.png", [backlog_run("fifo"), backlog_run("aps"), never]).axes
    assert legend(ax) == ["fifo, aps"]  # identical curves share a line
    assert ax.get_lines()[0].get_ydata()[:3].tolist() == pytest.approx([30.0, 45.0, 60.0])
    assert ax.get_lines()[0].get_xdata()[:3].tolist() == [5.0, 6.0, 7.0]  # each window's middle
    assert "never two tenants backlogged throughout a window: static" in ax.get_title()


# -- files ------------------------------------------------------------------------------

def test_summary_json_is_byte_identical_and_sensitive(tmp_path):
    write_report([tiny_run(), tiny_run("fifo")], tmp_path / "one", title="T", plots=False)
    write_report([tiny_run(), tiny_run("fifo")], tmp_path / "two", title="T", plots=False)
    one = (tmp_path / "one" / "summary.json").read_bytes()
    assert one == (tmp_path / "two" / "summary.json").read_bytes()
    assert one.endswith(b"}\n")
    data = json.loads(one)
    assert data["title"] == "T" and [r["label"] for r in data["runs"]] == ["aps", "fifo"]
    assert data["runs"][0] == summarize(tiny_run()).as_dict() == json.loads(summarize(tiny_run()).to_json())

    changed = tiny_run()
    later = attrs.evolve(changed.requests[2], finished_at=4.5)
    changed = attrs.evolve(changed, requests=changed.requests[:2] + (later,) + changed.requests[3:])
    write_report([changed, tiny_run("fifo")], tmp_path / "three", title="T", plots=False)
    assert (tmp_path / "three" / "summary.json").read_bytes() != one


def test_plots_written_as_reproducible_pngs(tmp_path):
    runs = [tiny_run("aps"), tiny_run("fifo")]
    first = write_report(runs, tmp_path / "one")
    second = write_report(runs, tmp_path / "two")
    assert [p.name for p in first] == ["summary.json", "report.md", *PLOT_FILES]
    assert len(PLOT_FILES) == 8
    for p, q in zip(first, second):
        assert p.is_file() and p.stat().st_size > 0
        if p.suffix == ".png":
            data = p.read_bytes()
            assert data[:8] == PNG_MAGIC, p
            assert data == q.read_bytes(), p.name
            assert b"matplotlib" not in data  # no Software metadata


def test_no_plots_when_asked(tmp_path):
    paths = write_report([tiny_run()], tmp_path, plots=False)
    assert [p.name for p in paths] == ["summary.json", "report.md"]
    assert not list(tmp_path.glob("*.png"))
    assert ".png" not in (tmp_path / "report.md").read_text()


def test_report_markdown_holds_the_measured_numbers(tmp_path):
    write_report([tiny_run("aps"), tiny_run("static")], tmp_path, title="My comparison")
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# My comparison\n")
    assert ("| policy | completed | rejected | throughput (tok/s) | GPU util (%) | cost per 1M tokens (USD) | Jain | "
            "lowest bidder max wait (s) | p99 TTFT (s) | p99 TPOT (ms) | p99 latency (s) |") in md
    # One comparison row per run: 3 completed, 1 rejected, 15.0 tok/s, 37.5 %, $83.33 per 1M,
    # Jain 25/34, lowest bidder max wait 1 s, p99 TTFT 1.531 s, p99 TPOT 99 ms, p99 latency 2.97 s,
    # mean batch 1.5.
    row = "| `aps` | 3 | 1 | 15.0 | 37.5 | $83.33 | 0.735 | 1.000 | 1.531 | 99.00 | 2.970 | 1.50 |"
    assert row in md
    assert row.replace("`aps`", "`static`") in md
    assert "### `aps`" in md and "### `static`" in md
    # Per-tenant table: a's waits, TTFT and latencies in s, TPOT in ms, and b's rejection by error code.
    assert ("| `a` | 1 | 2 | 2 | 0 | 0 | 0 | 0.750 / 0.975 / 0.995 / 1.000 | 1.075 / 1.502 / 1.540 / 1.550 | "
            "75.00 / 97.50 / 99.50 / 100.00 | 2.250 / 2.925 / 2.985 / 3.000 | 40 | — |") in md
    # The engine it ran on; the batch engine has no MFU to report.
    assert "run on 2 `batch` engines (a simulated GPU, `[gpu]`);" in md
    assert "Engine: MFU" not in md
    assert "rate_limited: 1" in md
    assert "| `STABLE` | 2.500 | 62.5 |" in md
    assert "| 2 | 1 | 50.0 |" in md
    assert FAIRNESS_DEFINITION in md
    assert "seed 7" in md and '`rps=3.5`' in md and "4 arrivals from 2 tenants" in md
    for name in PLOT_FILES:
        assert f"]({name})" in md


def test_report_names_the_continuous_engine_and_its_figures(tmp_path):
    write_report([continuous_run("aps"), continuous_run("fifo")], tmp_path, plots=False)
    md = (tmp_path / "report.md").read_text()
    assert "run on 2 `continuous` engines (a100-80gb × llama-3-8b, tp 1);" in md
    # 4 s busy of 2 engines over 4 s; $0.008 for 60 tokens; no batch sizes.
    assert "| `aps` | 3 | 1 | 15.0 | 50.0 | $133.33 | 0.735 | 1.000 | 1.531 | 99.00 | 2.970 | — |" in md
    assert "Engine: MFU 25.0%, MBU 65.0% over its busy time; 3 preemptions." in md
    assert "No fixed batches: the `continuous` engine batches at the iteration level" in md


def test_summary_table_follows_the_summaries():
    s = summarize(tiny_run("x"))
    table = format_summary_table([s])
    assert table.count("\n") == 2  # header, rule, one row
    o = s.overall
    assert f"{o.throughput_tokens_per_s:.1f}" in table
    assert f"{o.fairness.jain_index:.3f}" in table
    faster = attrs.evolve(s, overall=attrs.evolve(o, throughput_tokens_per_s=1234.5678))
    assert "1234.6" in format_summary_table([faster])


def test_runs_on_several_workloads_are_grouped(tmp_path):
    other = tiny_workload(name="bursty", seed=8)
    runs = [tiny_run("aps"), tiny_run("aps", workload=other), tiny_run("fifo")]
    write_report(runs, tmp_path)
    md = (tmp_path / "report.md").read_text()
    tiny_at, bursty_at = md.index("## Workload `tiny`"), md.index("## Workload `bursty`")
    assert md.count("## Workload ") == 2
    tiny_section = md[tiny_at:bursty_at] if tiny_at < bursty_at else md[tiny_at:]
    assert "| `fifo` |" in tiny_section and "| `aps` |" in tiny_section
    assert "seed 8" in md[bursty_at:]


def markdown_tables(md):
    """Every table in ``md`` as (header cells, rows of cells)."""
    lines = md.splitlines()
    tables = []
    for i, line in enumerate(lines[:-1]):
        if line.startswith("| ") and re.fullmatch(r"\|(:?---:?\|)+", lines[i + 1]):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("| "):
                    break
                rows.append([c.strip() for c in row.strip("|").split(" | ")])
            tables.append(([c.strip() for c in line.strip("|").split(" | ")], rows))
    return tables


def test_report_gives_every_duration_in_seconds_and_every_unit_in_its_header(tmp_path):
    write_report([tiny_run("aps"), tiny_run("fifo")], tmp_path, plots=False)
    md = (tmp_path / "report.md").read_text()
    tables = markdown_tables(md)
    # the comparison, the service difference; per run tenants, governor states, batch sizes
    assert len(tables) == 2 + 3 * 2
    timed = per_token = 0
    for header, rows in tables:
        for col, name in enumerate(header):
            if "TPOT" in name:  # the one duration at millisecond scale in a table: ms, two decimals
                assert name.endswith("(ms)"), f"{name!r} names no unit"
                per_token += 1
                for row in rows:
                    for value in row[col].split(" / "):
                        assert re.fullmatch(r"\d+\.\d{2}", value), (name, row[col])
                continue
            assert "(ms)" not in name, header
            if re.search(r"wait|latency|time|TTFT", name):
                assert name.endswith("(s)"), f"{name!r} names no unit"
                timed += 1
                for row in rows:  # one unit, one precision: seconds with three decimals
                    for value in row[col].split(" / "):
                        assert re.fullmatch(r"\d+\.\d{3}", value), (name, row[col])
    # comparison: max wait, p99 TTFT, p99 latency; tenants: wait, TTFT, latency; governor: time
    assert timed == 3 + 2 * 3 + 2 * 1
    assert per_token == 1 + 2 * 1  # p99 TPOT in the comparison, TPOT in each tenants table
    # The lowest bidder's waits in the prose are seconds too (1.000 s, not 1000.0 ms).
    assert "queue wait p99 0.995 s, max 1.000 s." in md
    assert "mean window 6.5 ms" in md  # the governor's window, configured in ms, is the only thing in ms
    assert not re.search(r"\d ms\b", md.replace("mean window 6.5 ms", ""))


# -- figures ----------------------------------------------------------------------------

def slower_run(label="slow"):
    """tiny_run with a's second request dispatched at 5 s and finished at 9 s: longer waits and latencies."""
    run = tiny_run(label)
    late = attrs.evolve(run.requests[2], dispatched_at=5.0, finished_at=9.0)
    batch = attrs.evolve(run.batches[1], formed_at=5.0, started_at=5.0, finished_at=9.0, busy_s=4.0)
    return attrs.evolve(run, requests=run.requests[:2] + (late,) + run.requests[3:],
                        batches=(run.batches[0], batch), duration_s=9.0)


def fixed_window_run(label):
    """tiny_run under a fixed-window governor: the same requests, no entropy reading, a constant 10 ms."""
    run = tiny_run(label, policy={"preset": label, "aging": label, "governor": "fixed", "batching": "micro"})
    return attrs.evolve(run, samples=tuple(attrs.evolve(s, state="FIXED", entropy_bits=None, window_s=0.010)
                                           for s in run.samples))


def panels(fig):
    return [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]


def legend(ax):
    return [t.get_text() for t in ax.get_legend().get_texts()]


@pytest.mark.parametrize("name", ["latency_cdf.png", "ttft_cdf.png", "tpot_cdf.png", "queue_wait.png", "service.png"])
def test_panels_comparing_policies_share_their_axes(name):
    fig = build_figure(name, [tiny_run("aps"), slower_run("fifo"), tiny_run("static")])
    axes = panels(fig)
    assert len(axes) == 3
    fig.canvas.draw()
    assert len({ax.get_ylim() for ax in axes}) == 1, [ax.get_ylim() for ax in axes]
    assert len({ax.get_xlim() for ax in axes}) == 1, [ax.get_xlim() for ax in axes]
    assert len({(ax.get_xscale(), ax.get_yscale()) for ax in axes}) == 1


@pytest.mark.parametrize("name", list(PLOT_FILES))
def test_every_figure_names_its_workload(name):
    fig = build_figure(name, [tiny_run("aps"), tiny_run("fifo")])
    assert "workload tiny (4 arrivals, seed 7)" in fig.get_suptitle()
    assert PLOT_FILES[name] in fig.get_suptitle()
    fig = build_figure(name, [tiny_run("aps"), tiny_run("aps", workload=tiny_workload(name="bursty", seed=8))])
    assert "workloads tiny, bursty" in fig.get_suptitle()


def test_governor_figure_draws_the_arrivals_entropy_once_and_every_policys_window():
    runs = [fixed_window_run("fifo"), tiny_run("aps"), tiny_run("aps2"), fixed_window_run("static")]
    ax_h, ax_w = build_figure("governor.png", runs).axes
    # Entropy is read from the arrivals, which are the same: one curve, for the two policies that read it.
    assert len(ax_h.get_lines()) == 1
    assert legend(ax_h) == ["aps, aps2"]
    assert "the same for aps, aps2 (drawn once)" in ax_h.get_title()
    assert "not read by fifo, static (governor fixed)" in ax_h.get_title()
    # The window: every policy named once, one drawn line per legend entry.
    assert legend(ax_w) == ["fifo, static (constant 10 ms)", "aps, aps2"]
    assert len(ax_w.get_lines()) == 2


def test_governor_figure_draws_one_entropy_curve_per_distinct_arrivals():
    fewer = tiny_run("aps+reject")
    fewer = attrs.evolve(fewer, requests=fewer.requests[:1] + (
        attrs.evolve(fewer.requests[1], outcome="rejected", error="rate_limited"),) + fewer.requests[2:])
    ax_h, _ = build_figure("governor.png", [tiny_run("aps"), fewer]).axes
    assert legend(ax_h) == ["aps", "aps+reject"]
    assert "as each entropy-reading governor sees the arrivals" in ax_h.get_title()


def test_gpu_busy_draws_identical_curves_once_naming_every_policy():
    (ax,) = build_figure("gpu_busy.png", [tiny_run("aps"), tiny_run("fifo"), slower_run("static")]).axes
    assert legend(ax) == ["aps, fifo", "static"]
    assert len(ax.patches) == 2
    assert "identical curves share a line" in ax.get_title()


def test_importing_the_report_does_not_load_matplotlib():
    code = "import sys, apsd.sim.report; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_token_time_figures_draw_each_tenants_ttft_in_s_and_tpot_in_ms():
    (ax,) = build_figure("ttft_cdf.png", [tiny_run()]).axes
    assert [max(line.get_xdata()) for line in ax.get_lines()] == pytest.approx([1.55, 0.35])  # tenants a, b
    (ax,) = build_figure("tpot_cdf.png", [tiny_run()]).axes
    assert [max(line.get_xdata()) for line in ax.get_lines()] == pytest.approx([100.0, 50.0])
    assert ax.get_xlabel() == "time per output token (ms)"


def test_gpu_busy_says_how_a_continuous_engine_is_busy():
    (ax,) = build_figure("gpu_busy.png", [continuous_run()]).axes
    assert "busy while any sequence is in it" in ax.get_title()
    assert max(ax.patches[0].get_data().values) == pytest.approx(1.0)  # engine 0 over [2, 4]
