"""Service classes: the order of the fair queue, admission's refusals, deadlines in the queue, attainment."""

import attrs
import pytest
import trio

from apsd.core.classes import DEADLINE_UNMEETABLE, ServiceClasses, class_result
from apsd.core.clock import ModelClock
from apsd.core.config import ConfigError, ServiceClassConfig, TenantConfig, parse_config
from apsd.core.models import Completion, InferenceRequest, Refusal
from apsd.pipeline import open_pipeline
from apsd.policies.fair import FairQueue
from apsd.serve.http.openai import CHAT, parse_openai_body
from tests.helpers import build_policies

TIGHT = ServiceClassConfig(ttft_s=1.0)
LOOSE = ServiceClassConfig(ttft_s=30.0, on_miss="best_effort")
_seq = iter(range(10**9))


def classed(tenant: str, arrival: float, ttft: float | None, best_effort: bool = False,
            tokens: int = 10) -> InferenceRequest:
    r = InferenceRequest(request_id=f"r{next(_seq)}", tenant_id=tenant, prompt_tokens=0, tokens_requested=tokens,
                         priority_bid=5, arrival=arrival, seq=next(_seq))
    if ttft is not None:
        r.service_class = "c"
        r.class_deadline = arrival + ttft
        r.class_best_effort = best_effort
    return r


def drain(queue: FairQueue, now: float) -> list[InferenceRequest]:
    out = []
    while len(queue):
        assert queue.peek(now) is queue.peek(now)
        peeked = queue.peek(now)
        assert queue.pop(now) is peeked
        out.append(peeked)
    return out


# -- the order ---------------------------------------------------------------------------------------

def test_inside_a_tenant_punctual_classed_first_tighter_class_first_then_by_deadline():
    q = FairQueue(alpha=1.0)
    unclassed = classed("a", 0.0, None)
    loose_old = classed("a", 0.0, 30.0, best_effort=True)
    tight_late_arrival = classed("a", 5.0, 1.0)
    tight_early_arrival = classed("a", 4.0, 1.0)
    for r in (unclassed, loose_old, tight_late_arrival, tight_early_arrival):
        q.push(r, 5.0)
    assert drain(q, 5.0) == [tight_early_arrival, tight_late_arrival, loose_old, unclassed]


def test_a_late_best_effort_request_goes_behind_the_punctual_ones_but_ahead_of_unclassed():
    q = FairQueue(alpha=1.0)
    unclassed = classed("a", 0.0, None)
    late = classed("a", 0.0, 1.0, best_effort=True)      # due at 1
    punctual = classed("a", 0.5, 30.0, best_effort=True)  # due at 30.5
    for r in (unclassed, late, punctual):
        q.push(r, 0.5)
    assert drain(q, 2.0) == [punctual, late, unclassed]


@pytest.mark.parametrize(("now", "demoted"), [(0.999, False), (1.0, True), (1.001, True)])
def test_a_best_effort_request_is_late_from_its_deadline_on(now, demoted):
    q = FairQueue(alpha=1.0)
    due = classed("a", 0.0, 1.0, best_effort=True)
    later = classed("a", 0.0, 2.0, best_effort=True)
    q.push(due, 0.0)
    q.push(later, 0.0)
    # just under its deadline it still goes first; at it (it can no longer be met) it is late
    assert drain(q, now) == ([later, due] if demoted else [due, later])


def test_across_tenants_the_earliest_deadline_goes_first_within_one_charge():
    q = FairQueue(alpha=1.0)
    a_loose = classed("a", 0.0, None)
    b_tight = classed("b", 0.1, 1.0)
    q.push(a_loose, 0.1)
    q.push(b_tight, 0.1)
    # both counters are equal: b's tight head goes first although a became backlogged first
    assert q.pop(0.2) is b_tight


def test_a_tenant_cannot_take_more_than_its_share_with_tight_requests():
    """Tenant b sends only tight requests, a only unclassed ones, both always backlogged: b's counter
    never gets more than two requests' charge above a's, so service stays shared."""
    q = FairQueue(alpha=1.0)
    now = 0.0
    for i in range(50):
        q.push(classed("a", now, None, tokens=10), now)
        q.push(classed("b", now, 1.0, tokens=10), now)
    served = {"a": 0, "b": 0}
    for _ in range(60):
        r = q.pop(now)
        served[r.tenant_id] += 1
        assert abs(q.counter("b") - q.counter("a")) <= 2 * 2 * 10 + 1e-9  # two requests' charge (output weight 2)
    assert abs(served["a"] - served["b"]) <= 2


def test_unclassed_order_is_unchanged():
    q = FairQueue(alpha=1.0)
    rs = [classed(t, float(i), None) for i, t in enumerate("ababab")]
    for r in rs:
        q.push(r, 6.0)
    assert [r.tenant_id for r in drain(q, 6.0)] == list("ababab")
    assert not q._edf and not q._classed


# -- admission, deadlines, attainment ----------------------------------------------------------------

def services(clock: ModelClock, finished: list) -> ServiceClasses:
    return ServiceClasses(classes={"tight": TIGHT, "loose": LOOSE}, clock=clock, queued_total=lambda: 1,
                          finish=lambda r, o: finished.append((r, o)), note_answered_in_queue=lambda: None)


async def test_a_class_the_tenant_may_not_use_is_403_an_unknown_one_400_the_default_applies(autojump_clock):
    s = services(ModelClock(), [])
    tenant = TenantConfig(rate=1, burst=10, classes=("loose",), default_class="loose")
    r = classed("a", 0.0, None)
    r.service_class = "tight"
    assert (s.resolve(r, tenant).status, s.resolve(r, tenant).error) == (403, "class_not_allowed")
    r.service_class = "nope"
    refusal = s.resolve(r, tenant)
    assert (refusal.status, refusal.error, refusal.field) == (400, "unknown_class", "service_class")
    r.service_class = None
    assert s.resolve(r, tenant) is None and r.service_class == "loose"


@pytest.mark.parametrize(("queued", "refused"), [(9, False), (10, False), (11, True)])
async def test_admission_refuses_when_the_estimated_wait_passes_the_target(autojump_clock, queued, refused):
    """Ten dispatches 0.1 s apart: a new tight request behind ``queued`` others waits queued * 0.1 s; at
    exactly its 1 s target it is admitted, just over it refused (503, Retry-After)."""
    clock = ModelClock()
    s = services(clock, [])
    for i in range(11):
        s.dispatched(classed("x", 0.0, None), now=i * 0.1)
    s._gap_sum = 0.1 * len(s._gaps)  # (exact figures: the test is about the comparison)
    for _ in range(queued):
        r = classed("a", 0.0, None)
        r.service_class, r.class_deadline = "tight", 100.0
        s.admitted(r, 0.0)
    new = classed("a", 0.0, None)
    new.service_class = "tight"
    refusal = s.refuse_unmeetable(new, 0.0)
    if not refused:
        assert refusal is None and new.class_deadline == 1.0
    else:
        assert (refusal.status, refusal.error) == (503, DEADLINE_UNMEETABLE)
        assert refusal.headers["Retry-After"] == "2" and "'tight'" in refusal.message and "1 s" in refusal.message
        s.rejected(new, refusal, 0.0)
        assert s.statistics()[1].refused == 1


async def test_best_effort_is_never_refused_for_its_deadline(autojump_clock):
    s = services(ModelClock(), [])
    s._gaps.extend([10.0] * 5)
    s._gap_sum = 50.0
    for _ in range(100):
        r = classed("a", 0.0, None)
        r.service_class = "loose"
        s.admitted(r, 0.0)
    new = classed("a", 0.0, None)
    new.service_class = "loose"
    assert s.refuse_unmeetable(new, 0.0) is None and new.class_best_effort


def completion(ttft_ms: float, tpot_ms: float | None = None) -> Completion:
    return Completion(request_id="r", tenant_id="a", prompt_tokens=1, tokens_generated=2, queue_ms=0.0,
                      ttft_ms=ttft_ms, tpot_ms=tpot_ms, prefill_ms=0.0, decode_ms=0.0, latency_ms=ttft_ms,
                      batch_id=1, batch_size=1, engine_id=0, effective_priority=0.0, cost_usd=0.0)


@pytest.mark.parametrize(("ttft_ms", "result"), [(999.999, "met"), (1000.0, "met"), (1000.001, "missed")])
def test_met_at_and_under_the_target_missed_over_it(ttft_ms, result):
    assert class_result(TIGHT, completion(ttft_ms)) == result


def test_tpot_counts_when_set():
    spec = ServiceClassConfig(ttft_s=1.0, tpot_s=0.05)
    assert class_result(spec, completion(10.0, 50.0)) == "met"
    assert class_result(spec, completion(10.0, 50.1)) == "missed"
    assert class_result(spec, Refusal(503, DEADLINE_UNMEETABLE, "x")) == "refused"
    assert class_result(spec, Refusal(499, "client_disconnected", "x")) is None


async def test_a_queued_request_of_a_refuse_class_is_answered_at_its_deadline_a_best_effort_one_waits(
        autojump_clock):
    """One batch engine busy for a long time: the tight request queued behind it gets 503 at exactly its
    deadline (never a truncated 200); the best-effort one stays queued and completes, counted missed."""
    config = parse_config({
        "classes": {"tight": {"ttft_s": 1.0}, "loose": {"ttft_s": 1.0, "on_miss": "best_effort"}},
        "tenants": {"a": {"rate": 1e6, "burst": 10**9, "classes": ["tight", "loose"]}},
        "gpu": {"decode_tokens_per_s": 100.0}, "policy": {"micro": {"max_batch_size": 1}}})
    async with open_pipeline(config, build_policies(config)) as pipeline:
        hog = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=500, priority_bid=5, prompt_tokens=1)
        assert pipeline.admit_now(hog)
        await trio.sleep(0.5)
        start = pipeline.clock.now()
        tight = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=5, priority_bid=5, prompt_tokens=1,
                                     service_class="tight")
        loose = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=5, priority_bid=5, prompt_tokens=1,
                                     service_class="loose")
        assert pipeline.admit_now(tight) and pipeline.admit_now(loose)
        outcome = await tight.reply.wait()
        assert isinstance(outcome, Refusal) and (outcome.status, outcome.error) == (503, DEADLINE_UNMEETABLE)
        assert outcome.headers["Retry-After"] == "1"
        assert pipeline.clock.now() - start == pytest.approx(1.0)
        assert isinstance(await loose.reply.wait(), Completion)
        figures = {f.name: f for f in pipeline.class_statistics()}
        assert (figures["tight"].refused, figures["loose"].missed, figures["loose"].met) == (1, 1, 0)
        assert figures["tight"].attainment == 0.0 and figures["tight"].queued == 0


# -- configuration and the body ---------------------------------------------------------------------

def test_tenants_name_configured_classes_and_their_default_among_them():
    with pytest.raises(ConfigError, match=r"tenants.a.classes\[0\]: no class named 'x'"):
        parse_config({"tenants": {"a": {"rate": 1, "burst": 1, "classes": ["x"]}}})
    with pytest.raises(ConfigError, match="tenants.a.default_class"):
        parse_config({"classes": {"x": {"ttft_s": 1}},
                      "tenants": {"a": {"rate": 1, "burst": 1, "classes": ["x"], "default_class": "y"}}})
    with pytest.raises(ConfigError, match="classes.x.on_miss"):
        parse_config({"classes": {"x": {"ttft_s": 1, "on_miss": "sometimes"}}})


def test_the_body_field_is_not_relayed():
    config = parse_config({})
    body = parse_openai_body(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '
                             b'"service_class": "tight", "temperature": 0.5}', CHAT, config)
    assert body.service_class == "tight"
    assert "service_class" not in body.payload and body.payload["temperature"] == 0.5


def test_tenants_with_classes_round_trip_through_the_state_records():
    from apsd.state.records import settings_dict, tenant_from_settings

    tenant = TenantConfig(rate=1, burst=10, classes=("tight", "loose"), default_class="tight")
    settings = settings_dict(tenant)
    assert settings["classes"] == ["tight", "loose"]
    assert tenant_from_settings(settings) == tenant
    assert attrs.evolve(tenant, classes=("tight",)) != tenant
