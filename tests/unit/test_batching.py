from apsd.core.models import Capacity, InferenceRequest
from apsd.policies.aging import StaticQueue
from apsd.policies.batching import MicroBatching, MicroParams

#: An idle micro engine far larger than these tests' requests: the policy's own limits decide.
IDLE = Capacity(sequences=10**9, kv_tokens=10**9)


def queue_of(*specs):
    q = StaticQueue()
    for seq, (prompt, tokens, bid) in enumerate(specs):
        q.push(InferenceRequest(f"r{seq}", "t", prompt, tokens, bid, seq=seq), 0.0)
    return q


def test_max_batch_size():
    q = queue_of(*[(1, 1, 5)] * 40)
    batching = MicroBatching(MicroParams(max_batch_size=16))
    assert batching.is_full(q, 0.0, IDLE)
    sizes = []
    while q:
        sizes.append(len(batching.cut(q, 0.0, IDLE)))
    assert sizes == [16, 16, 8]
    assert not batching.is_full(queue_of((1, 1, 5)), 0.0, IDLE)


def test_kv_cap_closes_the_batch_in_priority_order():
    q = queue_of((100, 400, 9), (100, 300, 8), (50, 50, 7), (10, 10, 1))
    batching = MicroBatching(MicroParams(max_batch_size=16, kv_cap_tokens=1000))
    first = batching.cut(q, 0.0, IDLE)
    assert [r.seq for r in first] == [0, 1, 2]            # 500 + 400 + 100 = 1000 fits exactly
    assert sum(r.cost_tokens for r in first) == 1000
    assert [r.seq for r in batching.cut(q, 0.0, IDLE)] == [3]   # 20 more would exceed the cap


def test_request_that_does_not_fit_leads_the_next_batch():
    q = queue_of((0, 600, 9), (0, 500, 8), (0, 100, 7))
    batching = MicroBatching(MicroParams(kv_cap_tokens=1000))
    assert [r.seq for r in batching.cut(q, 0.0, IDLE)] == [0]      # 600 + 500 > 1000: stop, no skipping
    assert [r.seq for r in batching.cut(q, 0.0, IDLE)] == [1, 2]


def test_refuse_reason_for_requests_larger_than_the_cap():
    batching = MicroBatching(MicroParams(kv_cap_tokens=1000))
    assert batching.refuse_reason(InferenceRequest("r", "t", 500, 500, 1)) is None
    reason = batching.refuse_reason(InferenceRequest("r", "t", 500, 501, 1))
    assert "1001 KV tokens" in reason and "1000" in reason


def test_full_when_the_queue_reaches_the_kv_cap():
    batching = MicroBatching(MicroParams(max_batch_size=16, kv_cap_tokens=1000))
    assert not batching.is_full(queue_of((0, 999, 5)), 0.0, IDLE)
    assert batching.is_full(queue_of((0, 999, 5), (0, 1, 5)), 0.0, IDLE)    # exactly the cap
    assert batching.is_full(queue_of((0, 600, 5), (0, 600, 5)), 0.0, IDLE)  # cut now closes early


def test_a_dispatch_fits_the_engine_that_asks():
    """The engine's free sequences and KV tokens bound a dispatch; a continuous engine sizes a request
    by its prompt (reserve_output=False), a micro one by prompt + requested."""
    batching = MicroBatching(MicroParams(max_batch_size=16))
    q = queue_of(*[(100, 400, 5)] * 10)
    assert len(batching.cut(q, 0.0, Capacity(sequences=3, kv_tokens=10**9))) == 3
    assert len(batching.cut(q, 0.0, Capacity(sequences=99, kv_tokens=1200))) == 2          # 500 each
    assert len(batching.cut(q, 0.0, Capacity(sequences=99, kv_tokens=1200, reserve_output=False))) == 5  # 101 each: the 5 left
    assert batching.cut(q, 0.0, Capacity(sequences=99, kv_tokens=100, reserve_output=False)) == []  # the head needs 101
    assert batching.is_full(q, 0.0, Capacity(sequences=0, kv_tokens=10**9))
