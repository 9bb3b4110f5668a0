"""Fairness now: each tenant's service over the sliding window, its share beside its weight's, the
window's Jain index and the queue by priority band, in virtual time (``Pipeline.fairness_view``
and the Prometheus families made from it)."""

from __future__ import annotations

import math

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from apsd.core.config import QueueConfig, TenantConfig
from apsd.core.models import InferenceRequest
from apsd.core.service_window import BANDS, WINDOW_S, ServiceWindow, TenantFairness, band_of
from apsd.pipeline import Pipeline
from apsd.serve.prometheus import exporter_for
from tests.helpers import make_config

WINDOW_FAMILIES = ("apsd_tenant_service_window_tokens", "apsd_tenant_service_share", "apsd_tenant_weight_share")


def samples(pipeline: Pipeline) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The pipeline's exposition (what GET /metrics serves), parsed: sample name -> [(labels, value)]."""
    text = exporter_for(pipeline).exposition().decode()
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        found.setdefault(family.name, [])
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def by_tenant(found: dict[str, list[tuple[dict[str, str], float]]], name: str) -> dict[str, float]:
    return {labels["tenant"]: value for labels, value in found[name]}


def admit(pipeline: Pipeline, tenant: str, tokens: int = 50, bid: int = 5) -> InferenceRequest:
    """Admit and queue a request now (no ingress channel, no task switch)."""
    request = pipeline.new_request(tenant_id=tenant, prompt="", tokens_requested=tokens, priority_bid=bid,
                                   prompt_tokens=10)
    assert pipeline.admit_now(request), request.reply.outcome
    return request


def in_window(requests: list[InferenceRequest], tenant: str, now: float) -> int:
    """The reference: output tokens of ``tenant``'s requests that finished in the whole seconds of the
    window ending at ``now`` (its second included)."""
    oldest = math.floor(now) - int(WINDOW_S) + 1
    return sum(r.tokens_generated for r in requests
               if r.tenant_id == tenant and r.finished_at is not None and math.floor(r.finished_at) >= oldest)


# -- the window itself -------------------------------------------------------------------------------

def test_the_window_holds_the_last_sixty_whole_seconds():
    window = ServiceWindow()
    assert window.length_s == WINDOW_S == 60.0
    window.add("a", 10, 0.5)
    window.add("a", 5, 30.2)
    window.add("b", 7, 59.9)
    window.add("b", 0, 59.9)                       # nothing served: no entry
    assert window.totals(59.99) == {"a": 15, "b": 7}
    assert window.totals(60.0) == {"a": 5, "b": 7}          # second 0 left: seconds 1 to 60
    assert window.totals(89.99) == {"a": 5, "b": 7}
    assert window.totals(90.0) == {"b": 7}                   # second 30 left at 90
    assert window.totals(118.5) == {"b": 7}
    assert window.totals(119.0) == {}                        # second 59 left at 119
    window.add("c", 1, 200.0)
    window.add("a", 3, 140.0)                                # its slot holds second 200: out of the window
    assert window.totals(200.5) == {"c": 1}
    window.add("a", 4, 141.5)                                # still in the window (seconds 141 to 200)
    assert window.totals(200.5) == {"a": 4, "c": 1}


@settings(max_examples=100, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 100), st.floats(0, 20)), max_size=200),
       reads=st.lists(st.floats(0, 400), max_size=5))
def test_the_window_agrees_with_a_sum_over_every_event(events, reads):
    """Requests finishing in time order (gaps up to 20 s), read now and then: the totals are the sum over
    every event of the window's seconds, and the buckets hold at most one entry per key each."""
    window = ServiceWindow()
    now, seen = 0.0, []
    reads = sorted(reads)
    for key, tokens, gap in events:
        now += gap
        window.add(key, tokens, now)
        seen.append((key, tokens, now))
        while reads and reads[0] <= now:
            reads.pop(0)
            oldest = math.floor(now) - 59
            expected: dict[str, int] = {}
            for k, t, at in seen:
                if t and math.floor(at) >= oldest:
                    expected[k] = expected.get(k, 0) + t
            assert window.totals(now) == expected
    assert window.entries <= 3 * window.buckets + 1


def test_a_burst_of_tenants_leaves_the_window_a_little_per_request_and_wholly_at_a_read():
    """10,000 tenants served in one second: a request finishing a window later takes two of their
    entries off (the request path does the same work whatever the number of tenants); a reader
    takes off the rest, and the totals are exact at once."""
    window = ServiceWindow()
    for index in range(10_000):
        window.add(f"t{index:05d}", 3, 5.5)
    assert window.entries == 10_000
    window.add("late", 1, 70.0)                      # second 5 left the window at 65
    assert window.entries == 10_000 + 1 - 2
    window.add("late", 1, 70.2)                      # (the same entry: nothing new, two more off)
    assert window.entries == 10_000 + 1 - 4
    assert window.totals(70.5) == {"late": 2}
    assert window.entries == 1


def test_bands_are_fixed_and_cover_every_bid():
    assert [label for label, _, _ in BANDS] == ["1-3", "4-6", "7-10"]
    assert [BANDS[band_of(bid)][0] for bid in range(1, 11)] == ["1-3"] * 3 + ["4-6"] * 3 + ["7-10"] * 4
    assert band_of(0) == 0 and band_of(11) == 2      # (out of range: the nearest band)


# -- in a pipeline -------------------------------------------------------------------------------------

def two_tenants(**weights: float) -> object:
    return make_config(queue=QueueConfig(max_requests=10_000, max_requests_per_tenant=5_000),
                       tenants={name: TenantConfig(rate=1e6, burst=10**9, weight=weights.get(name, 1.0))
                                for name in ("a", "b", "idle")})


async def test_a_tenant_that_stopped_drops_out_after_the_window(virtual_pipeline, autojump_clock):
    pipeline = await virtual_pipeline(two_tenants(), "fair")
    assert pipeline.fairness_view().window_s == WINDOW_S
    requests = [admit(pipeline, "a", tokens=40) for _ in range(5)]
    for at in range(0, 150, 5):                      # b: a request every 5 s until 145 s
        await pipeline.clock.sleep_until(at)
        requests.append(admit(pipeline, "b", tokens=20))
        view = pipeline.fairness_view()
        now = pipeline.clock.now()
        tenants = {t.name: t for t in view.tenants}
        assert [t.name for t in view.tenants] == ["a", "b", "idle"]
        for name in ("a", "b"):
            assert tenants[name].window_tokens == in_window(requests, name, now), (name, now)
        assert tenants["idle"] == TenantFairness("idle", 1.0, 0, 0.0, 0.0, 0, 0)
        served = tenants["a"].window_tokens + tenants["b"].window_tokens
        if served:
            assert tenants["a"].service_share == pytest.approx(tenants["a"].window_tokens / served)
    a_done = max(r.finished_at for r in requests if r.tenant_id == "a")
    assert a_done < 20.0                             # a was served early on ...
    assert pipeline.clock.now() > a_done + WINDOW_S + 1
    a, b, _ = pipeline.fairness_view().tenants       # ... and is gone from the window a minute later
    assert (a.window_tokens, a.service_share, a.weight_share, a.has_work) == (0, 0.0, 0.0, False)
    assert b.has_work and b.window_tokens > 0 and (b.service_share, b.weight_share) == (1.0, 1.0)
    assert pipeline.fairness_view().jain_window == 1.0
    assert pipeline.fairness_view(idle=False).tenants == (b,)           # the tenants with work only
    found = samples(pipeline)
    for name in WINDOW_FAMILIES:                     # no series for a (nor idle): b's only
        assert set(by_tenant(found, name)) == {"b"}, name
    assert by_tenant(found, "apsd_tenant_service_window_tokens")["b"] == b.window_tokens
    # the cumulative index still remembers a
    assert found["apsd_fairness_jain"][0][1] < 1.0


@pytest.mark.parametrize(("preset", "share_a", "jain"), [("fair", 0.25, 1.0), ("fifo", 0.5, 0.8)])
async def test_the_share_follows_the_weight_of_two_backlogged_tenants_under_fair(virtual_pipeline, autojump_clock,
                                                                                  preset, share_a, jain):
    """a (weight 1) and b (weight 3) stay backlogged with requests of one shape: under ``fair`` a gets a
    quarter of the window's tokens, its weight's share; first come first served splits them evenly,
    which the window's Jain index (over tokens / weight) shows: 0.8."""
    pipeline = await virtual_pipeline(two_tenants(a=1.0, b=3.0), preset)
    pipeline.fairness_view()
    for _ in range(1500):
        admit(pipeline, "a")
        admit(pipeline, "b")
    await pipeline.clock.sleep_until(90.0)
    view = pipeline.fairness_view()
    a, b, idle = view.tenants
    assert a.queued > 100 and b.queued > 100          # still backlogged: the window saw both all along
    assert (a.weight, b.weight) == (1.0, 3.0)
    assert (a.weight_share, b.weight_share, idle.weight_share) == (0.25, 0.75, 0.0)
    assert a.service_share == pytest.approx(share_a, abs=0.02)
    assert a.service_share + b.service_share == pytest.approx(1.0)
    assert view.jain_window == pytest.approx(jain, abs=0.02)
    found = samples(pipeline)
    assert by_tenant(found, "apsd_tenant_service_share") == {"a": a.service_share, "b": b.service_share}
    assert by_tenant(found, "apsd_tenant_weight_share") == {"a": 0.25, "b": 0.75}
    assert found["apsd_fairness_jain_window"] == [({}, view.jain_window)]


async def test_queue_depth_per_band_and_per_tenant(virtual_pipeline, autojump_clock):
    pipeline = await virtual_pipeline(two_tenants(), "aps")
    early = [admit(pipeline, "a", bid=bid) for bid in (1, 5, 9, 10)]      # queued before the watch exists
    view = pipeline.fairness_view()
    assert view.queue_depth_by_band == {"1-3": 1, "4-6": 1, "7-10": 2}
    assert [t.name for t in pipeline.fairness_view(idle=False).tenants] == ["a"]   # found without a visit to all
    requests = early + [admit(pipeline, tenant, bid=bid) for tenant, bid in
                        (("a", 2), ("a", 3), ("b", 4), ("b", 6), ("b", 7), ("b", 8), ("b", 3), ("b", 10))]
    assert pipeline.cancel(requests[-1])                                 # leaves the queue while queued
    view = pipeline.fairness_view()
    assert view.queue_depth_by_band == {"1-3": 4, "4-6": 3, "7-10": 4}
    assert [t.name for t in pipeline.fairness_view(idle=False).tenants] == ["a", "b"]
    assert {t.name: t.queued for t in view.tenants} == {"a": 6, "b": 5, "idle": 0}
    found = samples(pipeline)
    assert {labels["band"]: v for labels, v in found["apsd_queue_depth_band"]} == view.queue_depth_by_band
    assert by_tenant(found, "apsd_tenant_queue_depth") == {"a": 6, "b": 5, "idle": 0}
    assert found["apsd_queue_depth"] == [({}, 11)]
    for _ in range(400):                                                  # as they are dispatched and run
        await trio.sleep(0.05)
        view = pipeline.fairness_view()
        queued = [r for r in requests if r.dispatched_at is None and not r.answered]
        assert view.queue_depth_by_band == {label: sum(BANDS[band_of(r.priority_bid)][0] == label for r in queued)
                                            for label, _, _ in BANDS}
        assert sum(view.queue_depth_by_band.values()) == pipeline.ledger.queued_total
        assert {t.name: t.queued for t in view.tenants} == {
            name: stats.queued for name, stats in pipeline.ledger.tenants.items()}
        if all(r.answered for r in requests):
            break
    assert all(r.answered for r in requests)
    assert pipeline.fairness_view().queue_depth_by_band == {"1-3": 0, "4-6": 0, "7-10": 0}


async def test_the_exposition_has_every_new_family_with_bounded_labels(virtual_pipeline, autojump_clock):
    pipeline = await virtual_pipeline(two_tenants(a=2.0), "fair")
    exporter = exporter_for(pipeline)
    fresh = samples(pipeline)
    for name in (*WINDOW_FAMILIES, "apsd_fairness_jain_window"):
        assert fresh[name] == [], name                                        # nothing yet
    assert fresh["apsd_service_window_seconds"] == [({}, 60.0)]
    assert {labels["band"]: v for labels, v in fresh["apsd_queue_depth_band"]} == {"1-3": 0, "4-6": 0, "7-10": 0}
    requests = [admit(pipeline, "a", tokens=30), admit(pipeline, "b", tokens=60, bid=8)]
    unknown = pipeline.new_request(tenant_id="nobody", prompt="", tokens_requested=5, priority_bid=5)
    assert not pipeline.admit_now(unknown)                                   # 404: never a label
    queued = samples(pipeline)
    assert by_tenant(queued, "apsd_tenant_service_window_tokens") == {"a": 0, "b": 0}   # queued: work, no service
    assert by_tenant(queued, "apsd_tenant_weight_share") == {"a": pytest.approx(2 / 3), "b": pytest.approx(1 / 3)}
    assert not queued["apsd_fairness_jain_window"]                           # nobody served yet
    for request in requests:
        await request.reply.wait()
    found = samples(pipeline)
    assert by_tenant(found, "apsd_tenant_service_window_tokens") == {"a": 30, "b": 60}
    assert by_tenant(found, "apsd_tenant_service_share") == {"a": pytest.approx(1 / 3), "b": pytest.approx(2 / 3)}
    # tokens / weight: 15 and 60, Jain = 75^2 / (2 * (15^2 + 60^2))
    assert found["apsd_fairness_jain_window"] == [({}, pytest.approx(75 ** 2 / (2 * (15 ** 2 + 60 ** 2))))]
    for name in (*WINDOW_FAMILIES, "apsd_tenant_queue_depth"):
        assert {labels["tenant"] for labels, _ in found[name]} <= {"a", "b", "idle"}, name
    assert {labels["band"] for labels, _ in found["apsd_queue_depth_band"]} == {"1-3", "4-6", "7-10"}
    # what GET /metrics serves (rendered by apsd, in a worker thread) is prometheus_client's own rendering
    reference = generate_latest(exporter.registry)
    assert await exporter.scrape() == reference
    text = reference.decode()
    assert 'apsd_tenant_service_window_tokens{tenant="b"} 60.0\n' in text
    assert "# TYPE apsd_tenant_queue_depth gauge" in text and 'apsd_queue_depth_band{band="7-10"} 0.0' in text
