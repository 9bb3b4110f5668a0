"""Reliability: queue timeouts (504 queue_timeout) and injected executor faults (502 executor_failed).

Virtual time (``autojump_clock``) except the one HTTP test against the ``live`` daemon. Every
scenario runs on one GPU with the ``fifo`` preset (10 ms fixed window, micro batches of 16), so
the model times below are exact: a request of 0 prompt and ``n`` tokens alone in a batch runs
``n / 128`` s.
"""

from __future__ import annotations

import json

import attrs
import pytest
import trio
import trio.testing

from apsd.core.config import ConfigError, GpuConfig, QueueConfig, TenantConfig
from apsd.core.models import Completion, InferenceRequest, Refusal
from apsd.engines.batch import FaultInjector
from apsd.pipeline import Pipeline, open_pipeline
from apsd.serve.http import metrics_document
from tests import helpers
from tests.helpers import build_policies, infer_body, make_config, submit

#: Burst 100 000 and a rate so low that the buckets do not refill during a test: what is missing
#: from a bucket at the end is exactly what the requests that were served took.
SLOW_REFILL = {"a": TenantConfig(rate=1e-6, burst=100_000), "b": TenantConfig(rate=1e-6, burst=100_000)}
BURST = 100_000


def config_with(*, queue_timeout_s: float = 0.0, **gpu: object):
    return make_config(queue=QueueConfig(timeout_s=queue_timeout_s), gpu=GpuConfig(**gpu), tenants=SLOW_REFILL)


async def submit_at(pipeline: Pipeline, at: float, **kwargs) -> InferenceRequest:
    """Submit at model time ``at`` and let admission and the scheduler take it in."""
    request = await helpers.submit_at(pipeline, at, **kwargs)
    await trio.testing.wait_all_tasks_blocked()
    return request


def level(pipeline: Pipeline, tenant: str = "a") -> float:
    return pipeline.admission.buckets[tenant].level(pipeline.clock.now())


class Books:
    """Checks ``conservation_ok``, and that ``queued_tokens`` (what ``[queue] max_tokens`` bounds) is the
    sum over the requests still waiting, every 50 model ms while the test runs (and counts the checks)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline, self.checks = pipeline, 0

    async def watch(self) -> None:
        while True:
            self.check()
            await self.pipeline.clock.sleep(0.05)

    def check(self) -> None:
        requests = metrics_document(self.pipeline)["requests"]
        assert requests["conservation_ok"], requests
        ledger = self.pipeline.ledger
        waiting = [r for r in ledger.outstanding if r.dispatched_at is None]
        assert ledger.queued_tokens == sum(r.cost_tokens for r in waiting), (ledger.queued_tokens, len(waiting))
        self.checks += 1


async def answer_time(pipeline: Pipeline, request: InferenceRequest) -> tuple[float, object]:
    outcome = await request.reply.wait()
    return pipeline.clock.now(), outcome


# -- queue timeouts ------------------------------------------------------------------------------

async def test_a_request_queued_past_its_timeout_gets_504_and_its_tokens_back(autojump_clock):
    config = config_with(queue_timeout_s=5.0)
    async with open_pipeline(config, build_policies(config, "fifo")) as pipeline, trio.open_nursery() as nursery:
        books = Books(pipeline)
        nursery.start_soon(books.watch)
        first = submit(pipeline, tokens=1000)                           # runs 0.01 .. 7.8225 s
        late = await submit_at(pipeline, 0.5, tenant="b", tokens=300)   # deadline 5.5: still queued then
        other = await submit_at(pipeline, 3.0, tokens=200)              # deadline 8.0: dispatched at 7.8225
        assert late.deadline == pytest.approx(5.5) and other.deadline == pytest.approx(8.0)
        assert level(pipeline, "b") == pytest.approx(BURST - 300)
        expired_at, expired = await answer_time(pipeline, late)
        assert expired_at == pytest.approx(5.5)
        assert expired == Refusal(504, "queue_timeout", "waited 5.000 s in the queue (timeout 5 s)",
                                  kind="cancelled")
        assert level(pipeline, "b") == pytest.approx(BURST)             # refunded at once
        assert pipeline.scheduler.queue_depth == 1                       # `other` is still waiting
        done = [await r.reply.wait() for r in (first, other)]
        assert all(isinstance(o, Completion) for o in done)
        assert done[1].queue_ms == pytest.approx((1000 / 128 + 0.01 - 3.0) * 1000)
        assert level(pipeline, "a") == pytest.approx(BURST - 1200)       # served requests keep theirs spent
        metrics = metrics_document(pipeline)
        nursery.cancel_scope.cancel()
    requests = metrics["requests"]
    assert (requests["admitted"], requests["completed"], requests["cancelled"], requests["in_flight"]) == (3, 2, 1, 0)
    assert requests["conservation_ok"] and books.checks > 100
    assert metrics["tokens"]["generated"] == 1200                         # the expired request never ran
    assert pipeline.tenant_status("b").cancelled == 1


async def test_a_request_may_shorten_the_timeout(autojump_clock):
    config = config_with(queue_timeout_s=5.0)
    async with open_pipeline(config, build_policies(config, "fifo")) as pipeline:
        first = submit(pipeline, tokens=1000)
        short = await submit_at(pipeline, 0.5, tokens=100, timeout_s=1.0)
        at, outcome = await answer_time(pipeline, short)
        assert short.deadline == pytest.approx(1.5) and at == pytest.approx(1.5)
        assert isinstance(outcome, Refusal) and outcome.status == 504
        assert outcome.message == "waited 1.000 s in the queue (timeout 1 s)"
        assert isinstance(await first.reply.wait(), Completion)


async def test_a_longer_request_timeout_is_clamped_to_the_config(autojump_clock):
    config = config_with(queue_timeout_s=5.0)
    async with open_pipeline(config, build_policies(config, "fifo")) as pipeline:
        submit(pipeline, tokens=1000)
        greedy = await submit_at(pipeline, 0.5, tokens=100, timeout_s=3600.0)
        at, outcome = await answer_time(pipeline, greedy)
        assert greedy.deadline == pytest.approx(5.5) and at == pytest.approx(5.5)
        assert outcome.error == "queue_timeout" and "(timeout 5 s)" in outcome.message


async def test_without_a_config_timeout_only_requests_that_ask_for_one_expire(autojump_clock):
    config = config_with()  # the default: queue.timeout_s = 0, no limit
    assert config.queue.timeout_s == 0
    async with open_pipeline(config, build_policies(config, "fifo")) as pipeline:
        first = submit(pipeline, tokens=1000)
        patient = await submit_at(pipeline, 0.5, tokens=100)
        hasty = await submit_at(pipeline, 0.5, tokens=100, timeout_s=2.0)
        assert patient.deadline is None and hasty.deadline == pytest.approx(2.5)
        assert (await hasty.reply.wait()).error == "queue_timeout"
        assert isinstance(await patient.reply.wait(), Completion)         # waited 7.3 s: no limit
        assert isinstance(await first.reply.wait(), Completion)


async def test_a_request_dispatched_just_before_its_deadline_runs_to_completion(autojump_clock):
    config = config_with(queue_timeout_s=5.0)
    busy_until = 0.01 + 1000 / 128                                       # when the GPU asks again
    async with open_pipeline(config, build_policies(config, "fifo")) as pipeline:
        submit(pipeline, tokens=1000)
        close = await submit_at(pipeline, busy_until - 5.0 + 0.001, tokens=1000)
        done = await close.reply.wait()
        assert isinstance(done, Completion)                              # it ran past its deadline: fine
        assert close.dispatched_at == pytest.approx(busy_until)
        assert close.dispatched_at < close.deadline
        assert pipeline.clock.now() > close.deadline
        assert metrics_document(pipeline)["requests"]["cancelled"] == 0


async def test_many_timeouts_in_one_overload_keep_the_books(autojump_clock):
    """A flood the GPU cannot keep up with: the oldest expire, the rest are served, all counted."""
    config = config_with(queue_timeout_s=2.0)
    async with open_pipeline(config, build_policies(config, "fifo")) as pipeline, trio.open_nursery() as nursery:
        books = Books(pipeline)
        nursery.start_soon(books.watch)
        requests = [await submit_at(pipeline, i * 0.05, tenant="ab"[i % 2], tokens=50) for i in range(400)]
        outcomes = [await r.reply.wait() for r in requests]
        books.check()
        nursery.cancel_scope.cancel()
        expired = [r for r, o in zip(requests, outcomes) if isinstance(o, Refusal)]
        served = [o for o in outcomes if isinstance(o, Completion)]
        assert expired and served
        assert all(o.error == "queue_timeout" for o in outcomes if isinstance(o, Refusal))
        assert all(o.queue_ms <= 2000.0 + 1e-6 for o in served)       # nobody dispatched after its deadline
        assert all(r.dispatched_at is None for r in expired)
        for tenant in "ab":
            spent = sum(o.prompt_tokens + o.tokens_generated for o in served if o.tenant_id == tenant)
            assert level(pipeline, tenant) == pytest.approx(BURST - spent)
        requests_view = metrics_document(pipeline)["requests"]
        assert requests_view["completed"] + requests_view["cancelled"] == requests_view["admitted"] == 400


async def test_the_deadline_heap_stays_small_when_requests_run_long_before_their_deadline(autojump_clock):
    config = config_with(queue_timeout_s=3600.0)
    async with open_pipeline(config, build_policies(config, "fifo")) as pipeline:
        for _ in range(3000):
            await submit(pipeline, tokens=1).reply.wait()
            assert len(pipeline.scheduler._deadlines) <= 1024              # swept when it reaches 1024
        assert metrics_document(pipeline)["requests"]["completed"] == 3000


def test_queue_timeout_config_range():
    assert make_config({"queue": {"timeout_s": 300}}).queue.timeout_s == 300.0
    assert make_config({"queue": {"timeout_s": 0}}).queue.timeout_s == 0.0
    for bad in (-1, 0.0001, 86_401):
        with pytest.raises(ConfigError, match=r"queue\.timeout_s: must be 0 \(off\) or between"):
            make_config({"queue": {"timeout_s": bad}})


# -- executor faults -----------------------------------------------------------------------------

async def run_batches(config, sizes: list[int], *, tokens: int = 100) -> tuple[list[list[object]], dict, Pipeline]:
    """Submit one batch's worth of requests per entry of ``sizes``, each when the previous batch
    is running (so batch k holds exactly group k); check the books all along."""
    async with open_pipeline(config, build_policies(config, "fifo")) as pipeline, trio.open_nursery() as nursery:
        books = Books(pipeline)
        nursery.start_soon(books.watch)
        groups = []
        for size in sizes:
            group = [submit(pipeline, tenant="ab"[i % 2], tokens=tokens) for i in range(size)]
            groups.append(group)
            while any(r.dispatched_at is None for r in group):  # the next group waits for the next batch
                await pipeline.clock.sleep(0.001)
        outcomes = [[await r.reply.wait() for r in group] for group in groups]
        books.check()
        metrics = metrics_document(pipeline)
        nursery.cancel_scope.cancel()
    assert books.checks > 10
    return outcomes, metrics, pipeline


async def test_every_second_batch_fails_with_502_and_the_others_complete(autojump_clock):
    config = config_with(fail_every_n_batches=2)
    outcomes, metrics, pipeline = await run_batches(config, [3, 4, 5, 2, 1, 6])
    for n, group in enumerate(outcomes, 1):
        if n % 2:
            assert all(isinstance(o, Completion) and o.batch_id == n for o in group), n
        else:
            assert all(o == Refusal(502, "executor_failed", f"simulated GPU 0 failed running batch {n}",
                                    kind="failed") for o in group), (n, group)
    requests = metrics["requests"]
    assert (requests["completed"], requests["failed"], requests["admitted"]) == (3 + 5 + 1, 4 + 2 + 6, 21)
    assert requests["completed"] + requests["failed"] == requests["admitted"] and requests["conservation_ok"]
    # the failed batches' tokens are back: only the completed requests' tokens are spent
    spent = {t: sum(o.tokens_generated for g in outcomes for o in g if isinstance(o, Completion) and o.tenant_id == t)
             for t in "ab"}
    assert {t: level(pipeline, t) for t in "ab"} == {t: pytest.approx(BURST - spent[t]) for t in "ab"}
    assert metrics["tokens"]["generated"] == 100 * 9
    # a failed batch still took its busy time and is booked (batch_finished, busy time, operator's cost)
    assert metrics["batches"] == 6
    busy = sum(size * 100 / (128 * (0.4 + 0.6 * size ** 0.5)) for size in (3, 4, 5, 2, 1, 6))
    assert pipeline.ledger.gpu_busy_s == pytest.approx(busy)
    assert sum(pipeline.tenant_status(t).cost_usd for t in "ab") < metrics["cost_usd"]
    assert pipeline.tenant_status("a").failed + pipeline.tenant_status("b").failed == 12


async def test_a_failing_gpu_still_answers_everything(autojump_clock):
    config = config_with(fail_probability=1.0)
    outcomes, metrics, pipeline = await run_batches(config, [2, 3, 1])
    assert all(o.status == 502 and o.error == "executor_failed" for g in outcomes for o in g)
    assert metrics["requests"]["failed"] == metrics["requests"]["admitted"] == 6
    assert {t: level(pipeline, t) for t in "ab"} == {"a": pytest.approx(BURST), "b": pytest.approx(BURST)}
    assert metrics["batches"] == 3                                       # it went on taking batches


def failed_batches(outcomes) -> list[int]:
    return [n for n, group in enumerate(outcomes, 1) if isinstance(group[0], Refusal)]


async def test_the_same_fault_seed_fails_the_same_batches(autojump_clock):
    sizes = [1] * 40
    runs = {}
    for seed in (7, 7, 8):
        outcomes, _, _ = await run_batches(config_with(fail_probability=0.5, fault_seed=seed), sizes, tokens=10)
        runs.setdefault(seed, []).append(failed_batches(outcomes))
    assert runs[7][0] == runs[7][1]
    assert 5 < len(runs[7][0]) < 35                                      # about half
    assert runs[8][0] != runs[7][0]


async def test_faults_are_off_by_default_and_draw_nothing(autojump_clock):
    config = config_with()
    outcomes, metrics, pipeline = await run_batches(config, [2, 2, 2])
    assert all(isinstance(o, Completion) for g in outcomes for o in g)
    assert metrics["requests"]["failed"] == 0 and pipeline.engines[0].faults.batches == 3
    untouched = FaultInjector(config.gpu)
    assert pipeline.engines[0].faults._rng.getstate() == untouched._rng.getstate()


async def test_fault_settings_follow_a_reload(autojump_clock):
    config = config_with()
    async with open_pipeline(config, build_policies(config, "fifo")) as pipeline:
        assert isinstance(await submit(pipeline, tokens=10).reply.wait(), Completion)
        failing = attrs.evolve(config, gpu=attrs.evolve(config.gpu, fail_every_n_batches=1),
                               queue=QueueConfig(timeout_s=60.0))
        changes = pipeline.reconfigure(failing, build_policies(failing, "fifo"))
        assert "gpu fault injection: fail_probability=0.0, fail_every_n_batches=1, fault_seed=0" in changes
        assert "queue.timeout_s 60 (for requests queued from now on)" in changes
        assert "gpu model constants" not in changes
        request = submit(pipeline, tokens=10)
        assert (await request.reply.wait()).error == "executor_failed"
        assert request.deadline == pytest.approx(request.arrival + 60.0)


def test_fault_config_ranges():
    for key, bad in (("fail_probability", 1.5), ("fail_probability", -0.1), ("fail_every_n_batches", -1)):
        with pytest.raises(ConfigError, match=rf"gpu\.{key}: must be between"):
            make_config({"gpu": {key: bad}})
    with pytest.raises(ConfigError, match=r"gpu\.fail_every_n_batches: must be an integer"):
        make_config({"gpu": {"fail_every_n_batches": 2.5}})


# -- HTTP ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1e999, float("nan")])
async def test_infinity_and_nan_are_not_json(live, value):
    # (json.dumps writes them as the tokens Infinity and NaN, which Python's parser accepts by default)
    body = json.dumps(infer_body(prompt="hi", tokens=10, timeout_s=value))
    response = await live.client.post("/infer", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"] == "invalid_json"
    assert "finite" in response.json()["message"]


@pytest.mark.parametrize("value", [-1, 0, -0.5, "5", True, None, [], {"s": 1}])
async def test_timeout_s_must_be_a_positive_number(live, value):
    body = json.dumps(infer_body(prompt="hi", tokens=10, timeout_s=value))
    response = await live.client.post("/infer", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["field"] == "timeout_s"
    assert response.json()["error"] == "invalid_field"
    assert "timeout_s" in response.json()["message"]


@pytest.mark.parametrize("value", [30, 0.5, 10**400])
async def test_a_valid_timeout_s_is_accepted(live, value):
    response = await live.client.post("/infer", json=infer_body(prompt="hi", tokens=10, timeout_s=value))
    assert response.status_code == 200, response.text
