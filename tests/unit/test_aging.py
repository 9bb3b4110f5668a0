"""Queue order: fifo, static, and APS checked against brute-force P_eff at every pop."""

from hypothesis import given, settings
from hypothesis import strategies as st

from apsd.core.models import InferenceRequest
from apsd.policies.aging import ApsQueue, FifoQueue, StaticQueue


def make(seq, arrival, bid):
    return InferenceRequest(f"r{seq}", "t", 1, 1, bid, arrival=arrival, seq=seq)


def drain(queue, requests, now=100.0):
    for r in requests:
        queue.push(r, now)
    return [queue.pop(now).seq for _ in range(len(requests))]


def test_fifo_and_static_orders():
    requests = [make(0, 0.0, 1), make(1, 1.0, 10), make(2, 2.0, 5), make(3, 3.0, 10)]
    assert drain(FifoQueue(), requests) == [0, 1, 2, 3]
    assert drain(StaticQueue(), requests) == [1, 3, 2, 0]   # bid, then arrival


def test_aps_ages_and_reports_p_eff():
    queue = ApsQueue(alpha=1.0)
    old_low, new_high = make(0, 0.0, 1), make(1, 8.0, 10)
    # at any time: P_eff(old_low) = 1 + t, P_eff(new_high) = 10 + (t - 8) = 2 + t
    assert drain(queue, [old_low, new_high]) == [1, 0]
    queue = ApsQueue(alpha=1.0)
    older_low = make(0, -2.0, 1)   # P_eff = 3 + t beats 2 + t
    assert drain(queue, [older_low, new_high]) == [0, 1]
    assert queue.effective_priority(new_high, 10.0) == 12.0


def test_static_is_aps_with_zero_alpha():
    requests = [make(i, float(i), b) for i, b in enumerate([3, 7, 7, 1, 9, 3])]
    assert drain(ApsQueue(alpha=0.0), requests) == drain(StaticQueue(), requests)


events = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 5_000), st.integers(1, 10)),  # gap in ms, bid
        st.tuples(st.just("pop"), st.integers(0, 5_000), st.just(0)),
    ),
    min_size=1,
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(events=events, alpha=st.sampled_from([0.0, 0.01, 0.5, 1.0, 3.0, 250.0]))
def test_aps_pop_equals_brute_force(events, alpha):
    """At every pop the heap returns a request whose P_eff, evaluated now, is maximal."""
    queue = ApsQueue(alpha=alpha)
    waiting: list[InferenceRequest] = []
    now = 0.0
    for seq, (op, gap_ms, bid) in enumerate(events):
        now += gap_ms / 1000.0
        if op == "push":
            r = make(seq, now, bid)
            queue.push(r, now)
            waiting.append(r)
        elif waiting:
            popped = queue.pop(now)
            best = max(r.priority_bid + alpha * (now - r.arrival) for r in waiting)
            got = popped.priority_bid + alpha * (now - popped.arrival)
            assert got >= best - 1e-9 * max(1.0, abs(best))
            # among equals, the earliest admitted goes first
            ties = [r for r in waiting if abs(r.priority_bid + alpha * (now - r.arrival) - best)
                    <= 1e-9 * max(1.0, abs(best))]
            assert popped.seq == min(r.seq for r in ties) or len(ties) > 1 and popped in ties
            waiting.remove(popped)
        assert len(queue) == len(waiting)
