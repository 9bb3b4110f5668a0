"""The benchmark table (apsd research --table): its metrics on hand-computed cases, its simulator-only
baselines, and docs/research/benchmark.md kept current.

The whole table takes minutes, so the page is checked by what defines it and by one workload run again:
its definition fingerprint (rows, workloads and their very arrivals, the metrics' constants) must be the
one the page states, and the ``proportional`` workload's section, rerun, must be in the page byte for
byte (a change to the scheduling code shows there)."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from apsd.core.config import Config, TenantConfig
from apsd.core.models import InferenceRequest
from apsd.sim.baselines import LeastCounterFirst, RequestsPerMinute, baseline_plugin_manager, fair_rpm_limits
from apsd.sim.records import Arrival, PolicyRun, RequestRecord, Workload
from apsd.sim.report.qoe import qoe
from apsd.sim.report.service import backlogged_service_shares, weighted_service_jain
from apsd.sim.research.table import run_workload
from apsd.sim.research.table_page import definition_fingerprint, workload_section
from apsd.sim.research.table_suite import WORKLOADS
from apsd.sim.runner import parse_policy_choice, run_policy

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "research" / "benchmark.md"


def test_the_benchmark_page_is_current():
    page = PAGE.read_text()
    fingerprint = definition_fingerprint(1)
    assert f"Definition fingerprint `{fingerprint}`" in page, (
        "docs/research/benchmark.md is stale (the table's definition changed): regenerate it with "
        "`apsd research --table`")
    spec = next(w for w in WORKLOADS if w.name == "proportional")
    section = workload_section(run_workload(spec, Config(), seed=1))
    assert section in page, ("docs/research/benchmark.md is stale (the proportional workload measures differently "
                             "now): regenerate it with `apsd research --table`")
    for label in ("FCFS", "static priority", "RPM limit (LiteLLM-style, baseline)", "LCF (VTC's baseline)",
                  "fair (VTC)", "fair + prefix routing", "fair + classes"):
        assert page.count(f"| {label}") >= len(WORKLOADS), label
    for name in (w.name for w in WORKLOADS):
        assert f"### `{name}`" in page


def record(ttft: float, tokens: int, tpot: float, arrival: float = 0.0, outcome: str = "completed") -> RequestRecord:
    start = arrival + ttft
    return RequestRecord("t", 1, 10, tokens, arrival=arrival, outcome=outcome, dispatched_at=arrival,
                         started_at=start if outcome == "completed" else None,
                         finished_at=start + (tokens - 1) * tpot if outcome == "completed" else None)


@pytest.mark.parametrize(("ttft", "tokens", "tpot", "expected"), [
    (0.5, 100, 0.02, 1.0),                  # early and faster than the reader: never behind
    (1.0, 100, 0.2, 1.0),                   # exactly the expected timeline
    # one second late at the reading pace: the expected area is 19.8 s x (1 + 100) / 2 + 1 s x 100 = 1,099.9,
    # the digested one the same timeline a second later, 999.9
    (2.0, 100, 0.02, 999.9 / 1099.9),
    # on time, at half the pace: digested 1 + 2.5 (t - 1) against 1 + 5 (t - 1); both reach 100 at 40.6 s
    (1.0, 100, 0.4, (39.6 * 101 / 2) / (19.8 * 101 / 2 + 19.8 * 100)),
])
def test_qoe_as_andes_defines_it(ttft, tokens, tpot, expected):
    assert qoe(record(ttft, tokens, tpot)) == pytest.approx(expected)


def test_qoe_of_a_request_not_served_is_zero():
    assert qoe(record(0.1, 10, 0.01, outcome="rejected")) == 0.0


def backlogged_run(services: dict[str, tuple[float, float]], weights: dict[str, float]) -> PolicyRun:
    """Each tenant waiting throughout 0-40 s (one request queued all along) while requests of its own are
    served at a steady rate: ``services``: tenant -> (output tokens per request, requests per second)."""
    requests = []
    for tenant, (tokens, rate) in services.items():
        requests.append(RequestRecord(tenant, 1, 0, 1, arrival=0.0, outcome="completed", dispatched_at=40.0,
                                      started_at=40.0, finished_at=40.0))
        for k in range(int(40 * rate)):
            at = k / rate
            requests.append(RequestRecord(tenant, 1, 0, tokens, arrival=at, outcome="completed", dispatched_at=at,
                                          started_at=at, finished_at=at + 1 / rate))
    workload = Workload(name="w", description="", arrivals=(), params={},
                        tenants={t: TenantConfig(rate=1e6, burst=10**9, weight=w) for t, w in weights.items()})
    return PolicyRun(label="x", policy={}, workload=workload, requests=tuple(requests), batches=(), samples=(),
                     sample_interval_s=1.0, duration_s=40.0, gpus=1, tenant_rates={})


def test_jain_and_shares_of_weighted_service_while_backlogged():
    even = backlogged_run({"a": (10, 2.0), "b": (10, 2.0)}, {"a": 1.0, "b": 1.0})
    assert weighted_service_jain(even) == pytest.approx(1.0, abs=1e-3)
    assert backlogged_service_shares(even) == pytest.approx({"a": 0.5, "b": 0.5}, abs=0.01)
    # served 4:1 at weights 4:1: weighted service equal
    weighted = backlogged_run({"a": (40, 2.0), "b": (10, 2.0)}, {"a": 4.0, "b": 1.0})
    assert weighted_service_jain(weighted) == pytest.approx(1.0, abs=1e-3)
    assert backlogged_service_shares(weighted) == pytest.approx({"a": 0.8, "b": 0.2}, abs=0.01)
    # served 4:1 at equal weights: (4 + 1)^2 / (2 (16 + 1)) = 0.735
    uneven = backlogged_run({"a": (40, 2.0), "b": (10, 2.0)}, {"a": 1.0, "b": 1.0})
    assert weighted_service_jain(uneven) == pytest.approx(25 / 34, abs=0.01)


def request(tenant: str, seq: int) -> InferenceRequest:
    r = InferenceRequest(request_id=str(seq), tenant_id=tenant, prompt_tokens=10, tokens_requested=10, priority_bid=5)
    r.seq, r.arrival = seq, float(seq)
    return r


def test_least_counter_first_lets_a_returning_tenant_use_its_banked_credit():
    """Tenant b is served alone for a while, then a comes back: fair share lifts a's counter to b's (a gets
    one request, then they alternate); least counter first does not, so a is served until it catches up."""
    from apsd.policies.fair import FairShareQueue

    orders = {}
    for name, queue in (("fair", FairShareQueue()), ("lcf", LeastCounterFirst())):
        for n in range(5):
            queue.push(request("b", n), 0.0)
            queue.pop(0.0)                         # b alone: its counter grows
        for n in range(5, 13):
            queue.push(request("b", n), 0.0)
            queue.push(request("a", n + 100), 0.0)
        orders[name] = [queue.pop(0.0).tenant_id for _ in range(8)]
    assert orders["fair"][:4] in (["a", "b", "a", "b"], ["b", "a", "b", "a"])
    assert orders["lcf"][:5] == ["a"] * 5


def test_the_rpm_baseline_refuses_at_the_door_beyond_a_tenants_minute():
    door = RequestsPerMinute({"a": 2})
    arrivals = [Arrival(at=t, tenant=tenant, prompt_tokens=10, output_tokens=10, bid=5)
                for t, tenant in ((0, "a"), (1, "a"), (2, "a"), (3, "b"), (61, "a"), (62, "a"), (63, "a"))]
    assert [door(a) is None for a in arrivals] == [True, True, False, True, True, True, False]
    assert fair_rpm_limits({"x": TenantConfig(rate=1, burst=1, weight=3.0), "y": TenantConfig(rate=1, burst=1)},
                           2.0) == {"x": 90, "y": 30}
    workload = Workload(name="w", description="", params={}, arrivals=tuple(arrivals),
                        tenants={t: TenantConfig(rate=1e6, burst=10**9) for t in ("a", "b")})
    config = attrs.evolve(Config(), engine=attrs.evolve(Config().engine, kind="continuous"))
    run = run_policy(workload, parse_policy_choice("lcf"), base_config=config,
                     plugin_manager=baseline_plugin_manager(), door=RequestsPerMinute({"a": 2}))
    assert [(r.outcome, r.error) for r in run.requests] == [("completed", None)] * 2 + [("rejected", "rpm_limited")] + \
        [("completed", None)] * 3 + [("rejected", "rpm_limited")]
