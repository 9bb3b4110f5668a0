"""The scheduler (``apsd/core/scheduler.py``) on its own, in virtual time.

Each test builds a pipeline with :meth:`Pipeline.build` (the scheduler wired to its ledger,
admission and policies as the daemon wires them) without starting its stages: requests are
admitted and queued at once with :meth:`Pipeline.admit_now`, and the test plays the engine, a
:class:`StubEngine` whose free capacity it sets, asking :meth:`Scheduler.wait_next_dispatch`
directly or over the demand and answer channels of :meth:`Scheduler.serve_dispatch`. Every test
names ``autojump_clock``: windows and deadlines pass in virtual time, exactly.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing

from apsd.core.config import TenantConfig
from apsd.core.engine import Demand
from apsd.core.models import Capacity, Dispatch, InferenceRequest, Refusal
from apsd.core.queue import FifoQueue
from apsd.core.scheduler import Scheduler
from apsd.pipeline import Pipeline
from apsd.policies.governor import FixedGovernor
from tests.helpers import build_policies, make_config

#: Buckets that never limit: admission takes in everything the tests queue.
UNLIMITED = {"a": TenantConfig(rate=1e9, burst=10**12), "b": TenantConfig(rate=1e9, burst=10**12)}
#: The fixed governor's window in these tests (model seconds).
WINDOW_S = 0.05
#: An engine with room for anything the tests queue.
ROOMY = Capacity(sequences=1000, kv_tokens=10**9)


@attrs.define(eq=False)
class StubEngine:
    """What the scheduler reads of an engine: its id, its free capacity (set by the test), and
    ``ask_again`` (counted), which the scheduler calls after an empty dispatch once a request
    that fits it arrives."""

    engine_id: int = 0
    capacity: Capacity = ROOMY
    asked_again: int = 0

    def free(self) -> Capacity:
        return self.capacity

    def ask_again(self) -> None:
        self.asked_again += 1


def build(preset: str = "fifo", *, window_s: float = WINDOW_S, policy: dict[str, Any] | None = None,
          queue_timeout_s: float = 0.0, **policy_set: Any) -> Pipeline:
    """A pipeline not running (call inside the test): ``preset``'s aging and batching policies,
    the ``fixed`` governor with ``window_s``; ``policy``: more of the ``[policy]`` table;
    ``policy_set``: fields of the PolicySet replaced (e.g. ``new_aging``)."""
    config = make_config({"policy": {"governor": "fixed", "fixed": {"window_ms": window_s * 1000}, **(policy or {})},
                          "queue": {"timeout_s": queue_timeout_s}}, tenants=UNLIMITED)
    policies = build_policies(config, preset)
    if policy_set:
        policies = attrs.evolve(policies, **policy_set)
    return Pipeline.build(config, policies)


def admit(pipeline: Pipeline, *, tenant: str = "a", tokens: int = 10, bid: int = 5, prompt_tokens: int = 0,
          timeout_s: float | None = None) -> InferenceRequest:
    """Admit a request now and queue it (no ingress channel, no admission task)."""
    request = pipeline.new_request(tenant_id=tenant, prompt="", tokens_requested=tokens, priority_bid=bid,
                                   prompt_tokens=prompt_tokens, timeout_s=timeout_s)
    assert pipeline.admit_now(request)
    return request


async def admit_at(pipeline: Pipeline, at: float, **kwargs: Any) -> InferenceRequest:
    await pipeline.clock.sleep_until(at)
    return admit(pipeline, **kwargs)


def refusal(request: InferenceRequest) -> Refusal:
    outcome = request.reply.outcome
    assert isinstance(outcome, Refusal), outcome
    return outcome


async def one_at_a_time(scheduler: Scheduler, n: int) -> list[Dispatch]:
    """``n`` dispatches to an engine with one free sequence, asked for one after the other."""
    engine = StubEngine(capacity=Capacity(sequences=1, kv_tokens=10**9))
    return [await scheduler.wait_next_dispatch(engine) for _ in range(n)]


# -- queue order --------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,order,priorities", [
    ("fifo", "ABC", [1, 3, 10]),     # arrival order; the bid is reported as the priority
    ("static", "CBA", [10, 3, 1]),   # highest bid first
    ("aps", "CAB", [12, 9, 6]),      # bid + alpha * wait at t = 8: C 10+2, A 1+8, B 3+3
])
async def test_dispatch_order_follows_the_aging_policy(autojump_clock, preset, order, priorities):
    pipeline = build(preset, policy={"aps": {"alpha": 1.0}})
    requests = {"A": await admit_at(pipeline, 0.0, bid=1), "B": await admit_at(pipeline, 5.0, bid=3),
                "C": await admit_at(pipeline, 6.0, bid=10)}
    await pipeline.clock.sleep_until(8.0)
    dispatches = await one_at_a_time(pipeline.scheduler, 3)
    names = {id(r): name for name, r in requests.items()}
    assert "".join(names[id(d.requests[0])] for d in dispatches) == order
    # all cut at once (the backlog waited out its window long ago), each stamped with its priority then
    assert [d.formed_at for d in dispatches] == pytest.approx([8.0] * 3)
    assert [d.requests[0].effective_priority for d in dispatches] == pytest.approx(priorities)
    assert [d.dispatch_id for d in dispatches] == [1, 2, 3]


async def test_aps_ranks_by_the_time_of_each_cut(autojump_clock):
    """APS priorities age while requests wait: a low bid that lost to a higher one wins later
    against a newcomer with that same higher bid."""
    pipeline = build("aps", policy={"aps": {"alpha": 1.0}})
    low = await admit_at(pipeline, 0.0, bid=1)
    high = await admit_at(pipeline, 3.0, bid=5)
    engine = StubEngine(capacity=Capacity(sequences=1, kv_tokens=10**9))
    first = await pipeline.scheduler.wait_next_dispatch(engine)      # t = 3: low 1+3 < high 5+0
    assert first.requests == (high,) and high.effective_priority == pytest.approx(5.0)
    newcomer = await admit_at(pipeline, 8.0, bid=5)
    second = await pipeline.scheduler.wait_next_dispatch(engine)     # t = 8: low 1+8 > newcomer 5+0
    assert second.requests == (low,) and low.effective_priority == pytest.approx(9.0)
    assert newcomer.dispatched_at is None


async def test_a_requeued_request_keeps_its_place_in_queue_order(autojump_clock):
    pipeline = build("fifo")
    first, second = admit(pipeline), admit(pipeline)
    scheduler = pipeline.scheduler
    (dispatch,) = await one_at_a_time(scheduler, 1)
    assert dispatch.requests == (first,)
    scheduler.requeue(first, "its engine failed before its first token")
    assert first.dispatched_at is None and first.retries == 1 and pipeline.ledger.queued_total == 2
    again = await one_at_a_time(scheduler, 2)
    assert [d.requests for d in again] == [(first,), (second,)]


async def test_a_reload_moves_queued_requests_to_the_new_queue_in_admission_order(autojump_clock):
    pipeline = build("static")
    low, high = admit(pipeline, bid=1), admit(pipeline, bid=10)
    config = make_config({"policy": {"governor": "fixed"}}, tenants=UNLIMITED)
    pipeline.scheduler.use_policies(build_policies(config, "fifo"))
    assert isinstance(pipeline.scheduler.queue, FifoQueue)
    assert [d.requests for d in await one_at_a_time(pipeline.scheduler, 2)] == [(low,), (high,)]


# -- demand and capacity --------------------------------------------------------------------------------

async def test_an_engines_demand_is_answered_with_a_dispatch_that_fits_its_free_capacity(autojump_clock, nursery):
    pipeline = build("fifo", policy={"micro": {"max_batch_size": 16}})
    scheduler = pipeline.scheduler
    requests = [admit(pipeline, tokens=90, prompt_tokens=10) for _ in range(10)]   # 100 KV tokens each
    demand_send, demand_receive = trio.open_memory_channel[Demand](2)
    engines = [StubEngine(engine_id=0), StubEngine(engine_id=1)]
    answers = [trio.open_memory_channel[Dispatch](1) for _ in engines]
    nursery.start_soon(scheduler.serve_dispatch, demand_receive, {e.engine_id: a[0] for e, a in zip(engines, answers)})

    async def ask(engine: StubEngine, capacity: Capacity) -> Dispatch:
        engine.capacity = capacity
        await demand_send.send(Demand(engine))
        return await answers[engine.engine_id][1].receive()

    by_sequences = await ask(engines[1], Capacity(sequences=4, kv_tokens=10**6))
    assert by_sequences.requests == tuple(requests[:4]) and by_sequences.engine_id == 1
    by_kv = await ask(engines[0], Capacity(sequences=16, kv_tokens=250))       # 2 x 100 fit, 3 do not
    assert by_kv.requests == tuple(requests[4:6]) and by_kv.engine_id == 0
    for dispatch in (by_sequences, by_kv):
        assert all(r.engine_id == dispatch.engine_id and r.dispatch_id == dispatch.dispatch_id
                   and r.dispatch_size == len(dispatch.requests) and r.dispatched_at == dispatch.formed_at
                   for r in dispatch.requests)
    assert pipeline.ledger.queued_total == 4 and pipeline.ledger.running_total == 6
    # the rest: 4 left, while the batching policy's limit would take 16
    assert (await ask(engines[0], ROOMY)).requests == tuple(requests[6:])
    assert pipeline.ledger.queued_total == 0
    demand_send.close()


async def test_an_empty_dispatch_when_the_head_does_not_fit_and_no_smaller_request_overtakes_it(autojump_clock):
    pipeline = build("fifo")
    scheduler = pipeline.scheduler
    big = admit(pipeline, tokens=400, prompt_tokens=100)      # 500 KV tokens
    small = admit(pipeline, tokens=10)                        # would fit, but is behind the head
    engine = StubEngine(capacity=Capacity(sequences=16, kv_tokens=100))
    empty = await scheduler.wait_next_dispatch(engine)
    assert empty.requests == () and empty.dispatch_id == 0 and empty.engine_id == 0
    assert big.dispatched_at is None and small.dispatched_at is None and pipeline.ledger.queued_total == 2
    # a request that fits the engine arrives: the engine is told to ask again, once
    admit(pipeline, tokens=20)
    assert engine.asked_again == 1
    admit(pipeline, tokens=20)
    assert engine.asked_again == 1
    # still the head decides: with room for it, the dispatch takes it first
    engine.capacity = Capacity(sequences=16, kv_tokens=600)
    assert (await scheduler.wait_next_dispatch(engine)).requests[:2] == (big, small)


async def test_a_request_that_does_not_fit_an_engine_answered_empty_does_not_wake_it(autojump_clock):
    pipeline = build("fifo")
    admit(pipeline, tokens=500)
    engine = StubEngine(capacity=Capacity(sequences=16, kv_tokens=100))
    assert (await pipeline.scheduler.wait_next_dispatch(engine)).requests == ()
    admit(pipeline, tokens=200)                               # does not fit 100 either
    assert engine.asked_again == 0


# -- the governor's window ----------------------------------------------------------------------------

async def test_a_dispatch_waits_out_the_window_from_the_first_request_of_the_backlog(autojump_clock, nursery):
    pipeline = build("fifo", window_s=0.05)
    scheduler = pipeline.scheduler
    got: list[Dispatch] = []

    async def engine_asks() -> None:
        got.append(await scheduler.wait_next_dispatch(StubEngine()))

    nursery.start_soon(engine_asks)           # asks at t = 0, with nothing queued: waits for work
    first = await admit_at(pipeline, 1.0)
    second = await admit_at(pipeline, 1.03)   # inside the window: joins the same dispatch
    await trio.testing.wait_all_tasks_blocked()
    await pipeline.clock.sleep_until(2.0)
    (dispatch,) = got
    assert dispatch.requests == (first, second)
    assert dispatch.formed_at == pytest.approx(1.05) and dispatch.window_s == pytest.approx(0.05)
    assert first.dispatched_at == pytest.approx(1.05)


async def test_a_full_dispatch_is_cut_before_the_window_ends(autojump_clock, nursery):
    pipeline = build("fifo", window_s=0.05, policy={"micro": {"max_batch_size": 4}})
    scheduler = pipeline.scheduler
    got: list[Dispatch] = []

    async def engine_asks() -> None:
        got.append(await scheduler.wait_next_dispatch(StubEngine()))

    nursery.start_soon(engine_asks)
    for i in range(6):
        await admit_at(pipeline, 1.0 + 0.01 * i)
    assert got and len(got[0].requests) == 4
    assert got[0].formed_at == pytest.approx(1.03)         # full at the fourth arrival, not at 1.05
    # the two left over have waited already: the next ask takes them at once, not a window later
    await pipeline.clock.sleep_until(1.2)
    leftover = await scheduler.wait_next_dispatch(StubEngine())
    assert len(leftover.requests) == 2 and leftover.formed_at == pytest.approx(1.2)


async def test_a_late_request_joins_the_dispatch_cut_when_the_engine_asks(autojump_clock):
    """The dispatch is formed at the last moment: a high bid that arrives after the backlog's
    window has passed, but before any engine asked, leads it."""
    pipeline = build("static", window_s=0.05)
    low = [admit(pipeline, bid=1) for _ in range(3)]
    vip = await admit_at(pipeline, 5.0, bid=10)
    engine = StubEngine(capacity=Capacity(sequences=2, kv_tokens=10**9))
    dispatch = await pipeline.scheduler.wait_next_dispatch(engine)
    assert dispatch.requests == (vip, low[0]) and dispatch.formed_at == pytest.approx(5.0)


# -- requests answered while queued --------------------------------------------------------------------

async def test_requests_answered_while_queued_are_dropped_from_dispatches(autojump_clock):
    pipeline = build("fifo")
    a, b, c = admit(pipeline), admit(pipeline), admit(pipeline)
    assert pipeline.cancel(b)
    assert refusal(b).error == "client_disconnected" and pipeline.ledger.queued_total == 2
    dispatch = await pipeline.scheduler.wait_next_dispatch(StubEngine())
    assert dispatch.requests == (a, c) and a.dispatch_size == 2
    assert b.dispatched_at is None


async def test_a_dispatch_of_only_answered_requests_is_not_sent(autojump_clock, nursery):
    pipeline = build("fifo")
    gone = admit(pipeline)
    assert pipeline.cancel(gone)
    got: list[Dispatch] = []

    async def engine_asks() -> None:
        got.append(await pipeline.scheduler.wait_next_dispatch(StubEngine()))

    nursery.start_soon(engine_asks)
    await pipeline.clock.sleep_until(10.0)
    assert got == []                                  # nothing to send: the engine keeps waiting
    fresh = await admit_at(pipeline, 10.0)
    await pipeline.clock.sleep_until(11.0)
    assert [d.requests for d in got] == [(fresh,)] and got[0].dispatch_id == 1


async def test_a_queued_request_times_out_at_its_deadline_and_is_never_dispatched(autojump_clock, nursery):
    pipeline = build("fifo", queue_timeout_s=2.0)
    scheduler = pipeline.scheduler
    nursery.start_soon(scheduler.serve_timeouts)
    patient = admit(pipeline)
    hasty = await admit_at(pipeline, 0.5, timeout_s=0.25)       # its own, shorter timeout
    assert patient.deadline == pytest.approx(2.0) and hasty.deadline == pytest.approx(0.75)
    await hasty.reply.wait()
    assert pipeline.clock.now() == pytest.approx(0.75)
    assert (refusal(hasty).status, refusal(hasty).error) == (504, "queue_timeout")
    await patient.reply.wait()
    assert pipeline.clock.now() == pytest.approx(2.0) and refusal(patient).error == "queue_timeout"
    later = admit(pipeline)
    assert (await scheduler.wait_next_dispatch(StubEngine())).requests == (later,)


# -- policies that raise --------------------------------------------------------------------------------

class Boom(RuntimeError):
    pass


def raising(*args: Any, **kwargs: Any) -> Any:
    raise Boom("boom")


async def test_a_batching_policy_that_raises_fails_every_queued_request_and_the_scheduler_carries_on(
        autojump_clock, monkeypatch, caplog):
    pipeline = build("static")
    scheduler = pipeline.scheduler
    queued = [admit(pipeline, bid=b) for b in (1, 5, 9)]
    old_queue = scheduler.queue
    monkeypatch.setattr(scheduler.policies.batching, "is_full", raising)
    with trio.move_on_after(1.0):                 # nothing left to dispatch: the engine waits
        await scheduler.wait_next_dispatch(StubEngine())
    for request in queued:
        answer = refusal(request)
        assert (answer.status, answer.error, answer.kind) == (500, "policy_error", "failed")
        assert answer.message == "batching policy 'micro' raised Boom: boom"
    assert pipeline.ledger.queued_total == 0 and not pipeline.ledger.outstanding
    assert scheduler.queue is not old_queue and len(scheduler.queue) == 0   # a fresh aging policy
    assert scheduler.policy_names["aging"] == "static"
    assert "batching policy 'micro' raised" in caplog.text
    monkeypatch.undo()                            # the policy works again: so does the scheduler
    after = [admit(pipeline, bid=1), admit(pipeline, bid=9)]
    assert (await scheduler.wait_next_dispatch(StubEngine())).requests == (after[1], after[0])


async def test_a_policy_that_always_raises_cannot_make_the_dispatcher_spin(autojump_clock, monkeypatch):
    pipeline = build("fifo")
    scheduler = pipeline.scheduler
    monkeypatch.setattr(scheduler.policies.batching, "is_full", raising)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(scheduler.wait_next_dispatch, StubEngine())
        for t in range(1, 4):
            request = await admit_at(pipeline, float(t))
            await trio.testing.wait_all_tasks_blocked()
            assert refusal(request).error == "policy_error"
        await pipeline.clock.sleep_until(100.0)
        assert scheduler.decisions <= 10          # a decision per arrival, not a loop
        nursery.cancel_scope.cancel()


async def test_an_aging_policy_that_raises_on_push_fails_only_that_request(autojump_clock, monkeypatch):
    pipeline = build("fifo")
    kept = admit(pipeline)
    monkeypatch.setattr(pipeline.scheduler.queue, "push", raising)
    failed = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=10, priority_bid=5)
    pipeline.admit_now(failed)
    assert refusal(failed).message == "aging policy 'fifo' raised Boom: boom"
    monkeypatch.undo()
    assert (await pipeline.scheduler.wait_next_dispatch(StubEngine())).requests == (kept,)


async def test_when_even_a_fresh_aging_policy_cannot_be_built_the_queue_falls_back_to_fifo(
        autojump_clock, monkeypatch):
    pipeline = build("static", new_aging=raising)
    scheduler = pipeline.scheduler
    victims = [admit(pipeline, bid=1), admit(pipeline, bid=9)]
    monkeypatch.setattr(scheduler.policies.batching, "cut", raising)
    with trio.move_on_after(1.0):
        await scheduler.wait_next_dispatch(StubEngine())
    assert {refusal(r).message for r in victims} == {
        "cutting a batch (batching policy 'micro' from aging policy 'static') raised Boom: boom"}
    assert isinstance(scheduler.queue, FifoQueue) and scheduler.policy_names["aging"] == "fifo (fallback)"
    monkeypatch.undo()
    low, high = admit(pipeline, bid=1), admit(pipeline, bid=9)
    assert (await scheduler.wait_next_dispatch(StubEngine())).requests == (low, high)   # arrival order now


@pytest.mark.parametrize("window", [float("nan"), float("inf"), -0.01])
async def test_a_governor_window_that_is_not_a_finite_time_fails_the_queued_requests(
        autojump_clock, monkeypatch, window):
    pipeline = build("fifo")
    request = admit(pipeline)
    governor = pipeline.scheduler.policies.governor
    reading = governor.reading(0.0)
    monkeypatch.setattr(governor, "reading", lambda now: attrs.evolve(reading, window_s=window))
    with trio.move_on_after(1.0):
        await pipeline.scheduler.wait_next_dispatch(StubEngine())
    assert refusal(request).message == (f"governor policy 'fixed' returned window_s {window!r} "
                                        "(must be finite and >= 0)")


async def test_an_effective_priority_that_is_not_finite_fails_the_cut_requests(autojump_clock, monkeypatch):
    pipeline = build("fifo")
    request = admit(pipeline)
    monkeypatch.setattr(pipeline.scheduler.queue, "effective_priority", lambda r, now: float("nan"))
    with trio.move_on_after(1.0):
        await pipeline.scheduler.wait_next_dispatch(StubEngine())
    assert refusal(request).message == ("aging policy 'fifo' returned an effective priority that is not a "
                                        "finite number")
    assert request.dispatched_at is None and pipeline.ledger.running_total == 0


class HookedGovernor(FixedGovernor):
    """The fixed governor with an ``on_dispatch`` hook that raises the first time."""

    def __init__(self) -> None:
        super().__init__(WINDOW_S)
        self.calls: list[int] = []

    def on_dispatch(self, batch: Dispatch, now: float) -> None:
        self.calls.append(batch.dispatch_id)
        if len(self.calls) == 1:
            raise Boom("boom")


async def test_an_on_dispatch_hook_that_raises_fails_only_that_dispatch(autojump_clock):
    governor = HookedGovernor()
    pipeline = build("fifo", governor=governor)
    first, second = admit(pipeline), admit(pipeline)
    engine = StubEngine(capacity=Capacity(sequences=1, kv_tokens=10**9))
    dispatch = await pipeline.scheduler.wait_next_dispatch(engine)   # the first failed: the next is sent
    assert refusal(first).message == "governor policy 'fixed' raised Boom: boom"
    assert dispatch.requests == (second,) and governor.calls == [1, 2]
    assert not second.answered and pipeline.ledger.running_total == 1
