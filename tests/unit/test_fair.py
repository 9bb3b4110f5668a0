"""The ``fair`` policy: every pop checked against a brute-force reference, and its promises."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import apsd
from apsd.core.models import InferenceRequest, Refusal
from apsd.policies.fair import ChargeWeights, FairQueue
from tests.helpers import make_config


class Reference:
    """The rule written the slow, obvious way: scan every tenant and every request at each pop."""

    def __init__(self, alpha: float, weights: dict[str, float], charges: ChargeWeights) -> None:
        self.alpha, self.weights, self.charges = alpha, weights, charges
        self.counters: dict[str, float] = collections.defaultdict(float)
        self.queued: list[InferenceRequest] = []
        self.since: dict[str, int] = {}
        self.served_at: dict[str, int] = {}
        self.pops = 0
        self.last_served: str | None = None
        self.charged: dict[int, float] = {}

    def charge(self, r: InferenceRequest, output: int) -> float:
        return self.charges.input_weight * r.prompt_tokens + self.charges.output_weight * output

    def backlogged(self) -> set[str]:
        return {r.tenant_id for r in self.queued}

    def push(self, r: InferenceRequest) -> None:
        tenant = r.tenant_id
        if tenant not in self.backlogged():
            others = [self.counters[t] for t in self.backlogged()]
            floor = min(others) if others else (self.counters[self.last_served] if self.last_served else 0.0)
            self.counters[tenant] = max(self.counters[tenant], floor)
            self.since[tenant] = r.seq
        self.queued.append(r)

    def pop(self, now: float) -> InferenceRequest:
        tenant = min(self.backlogged(), key=lambda t: (self.counters[t], self.served_at.get(t, -1), self.since[t]))
        mine = [r for r in self.queued if r.tenant_id == tenant]
        r = max(mine, key=lambda r: (r.priority_bid + self.alpha * (now - r.arrival), -r.seq))
        self.queued.remove(r)
        charge = self.charge(r, r.tokens_requested) / self.weights.get(tenant, 1.0)
        self.counters[tenant] += charge - self.charged.pop(r.seq, 0.0)
        self.charged[r.seq] = charge
        self.pops += 1
        self.served_at[tenant], self.last_served = self.pops, tenant
        return r

    def finish(self, r: InferenceRequest, failed: bool) -> None:
        # (whatever the outcome, what ran is service: a failed request that streamed tokens used them)
        if r.started_at is None:
            served = self.charges.output_weight * r.tokens_generated
        else:
            served = self.charge(r, r.tokens_generated)
        self.counters[r.tenant_id] += served / self.weights.get(r.tenant_id, 1.0) - self.charged.pop(r.seq)


def outcome(r: InferenceRequest, failed: bool):
    if failed:
        return Refusal(502, "executor_failed", "failed", kind="failed")
    return apsd.Completion(request_id=r.request_id, tenant_id=r.tenant_id, prompt_tokens=r.prompt_tokens,
                           tokens_generated=r.tokens_generated, queue_ms=0.0, ttft_ms=0.0, tpot_ms=None,
                           prefill_ms=0.0, decode_ms=0.0, latency_ms=0.0, batch_id=1, batch_size=1, engine_id=0,
                           effective_priority=0.0, cost_usd=0.0)


operations = st.lists(st.tuples(st.sampled_from(["push", "push", "pop", "finish", "requeue"]),
                                st.integers(0, 4), st.integers(1, 10), st.integers(1, 300), st.integers(0, 300),
                                st.booleans()), min_size=1, max_size=150)


@settings(max_examples=150, deadline=None)
@given(ops=operations, alpha=st.sampled_from([0.0, 0.5, 1.0, 4.0]), weighted=st.booleans())
def test_every_pop_matches_the_brute_force_reference(ops, alpha, weighted):
    weights = {"t0": 2.0, "t3": 0.5} if weighted else {}
    charges = ChargeWeights(1.0, 2.0)
    fair, ref = FairQueue(alpha, weights, charges), Reference(alpha, weights, charges)
    running: list[InferenceRequest] = []
    now, seq = 0.0, 0
    for op, tenant, bid, size, generated, flag in ops:
        now += 0.25
        if op == "push":
            r = InferenceRequest(f"r{seq}", f"t{tenant}", size, size, bid, arrival=now, seq=seq)
            seq += 1
            fair.push(r, now)
            ref.push(r)
        elif op == "pop" and ref.queued:
            expected = ref.pop(now)
            assert fair.peek(now) is expected
            assert fair.pop(now) is expected
            running.append(expected)
        elif op == "finish" and running:
            r = running.pop(tenant % len(running))
            r.tokens_generated = min(generated, r.tokens_requested)
            r.started_at = now if r.tokens_generated and flag else None
            fair.on_finish(r, outcome(r, failed=not flag and generated % 2 == 0), now)
            ref.finish(r, failed=not flag and generated % 2 == 0)
        elif op == "requeue" and running:  # its engine failed before its first token: back in place
            r = running.pop(tenant % len(running))
            fair.push(r, now)
            ref.push(r)
        assert len(fair) == len(ref.queued)
        for t, counter in ref.counters.items():
            assert fair.counters[t] == pytest.approx(counter, abs=1e-6)
    while ref.queued:  # and the rest drains in the same order
        now += 0.25
        assert fair.pop(now) is ref.pop(now)


def test_backlogged_tenants_counters_stay_within_one_charge_weights_apart():
    """Three tenants, weights 1:2:4, all backlogged with mixed sizes: served in proportion."""
    weights = {"a": 1.0, "b": 2.0, "c": 4.0}
    fair = FairQueue(1.0, weights)
    seq = 0
    for i in range(3000):
        for tenant in weights:
            size = 50 + (i * 37 + seq) % 400
            fair.push(InferenceRequest(f"r{seq}", tenant, size, size, 1 + seq % 10, arrival=i, seq=seq), float(i))
            seq += 1
    served = collections.Counter()
    largest = max(r.prompt_tokens + 2 * r.tokens_requested for r in fair)
    for _ in range(4000):
        r = fair.pop(5000.0)
        served[r.tenant_id] += r.prompt_tokens + 2 * r.tokens_requested
        counters = [fair.counters[t] for t in weights]
        assert max(counters) - min(counters) <= largest  # ... / weight <= largest
    total = sum(served.values())
    for tenant, weight in weights.items():
        assert served[tenant] / total == pytest.approx(weight / 7, rel=0.02)


def test_a_returning_tenant_leaves_in_the_next_pop():
    fair = FairQueue(1.0)
    for seq in range(100):
        fair.push(InferenceRequest(f"r{seq}", "flood", 64, 128, 10, arrival=0.0, seq=seq), 0.0)
    for _ in range(10):
        fair.pop(1.0)
    quiet = InferenceRequest("q", "quiet", 64, 64, 1, arrival=1.0, seq=100)
    fair.push(quiet, 1.0)
    assert fair.pop(1.0) is quiet  # bid 1 against bid 10, and still next: bids do not cross tenants


def test_aging_inside_a_tenant_bounds_a_low_bid_wait():
    """A bid-1 request leaves before its tenant's bid-10 requests that arrive more than 9/alpha later."""
    alpha = 2.0
    fair = FairQueue(alpha)
    low = InferenceRequest("low", "t", 1, 1, 1, arrival=0.0, seq=0)
    fair.push(low, 0.0)
    highs = [InferenceRequest(f"h{i}", "t", 1, 1, 10, arrival=0.5 * i, seq=1 + i) for i in range(1, 40)]
    for h in highs:
        fair.push(h, h.arrival)
    order = [fair.pop(20.0) for _ in range(len(highs) + 1)]
    ahead = order[:order.index(low)]
    assert ahead and all(h.arrival <= 9 / alpha for h in ahead)
    assert all(h in ahead for h in highs if h.arrival < 9 / alpha)


def test_weights_come_from_the_tenants_config():
    config = make_config({"tenants": {"gold": {"rate": 100.0, "burst": 100, "weight": 3.0},
                                      "lead": {"rate": 100.0, "burst": 100}}})
    queue = apsd.build_policies(config).aging
    assert isinstance(queue, FairQueue)
    assert (queue.weight("gold"), queue.weight("lead")) == (3.0, 1.0)


def test_fair_is_the_default_preset():
    assert apsd.build_policies(apsd.Config()).names == {
        "preset": "fair", "aging": "fair", "governor": "entropy", "batching": "micro"}
