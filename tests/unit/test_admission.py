"""Token buckets and admission decisions, in virtual time."""

import contextlib
import itertools
import math

import pytest
import trio

from apsd.core.admission import Admission
from apsd.core.bucket import TokenBucket
from apsd.core.clock import ModelClock
from apsd.core.config import TenantConfig
from apsd.core.ledger import Ledger
from apsd.core.models import InferenceRequest
from apsd.policies.batching import MicroBatching, MicroParams


def test_bucket_arithmetic():
    bucket = TokenBucket.full(TenantConfig(rate=500.0, burst=5000), now=0.0)
    assert bucket.try_take(4000, 0.0)
    assert bucket.level(0.0) == 1000
    assert not bucket.try_take(1001, 0.0)          # all or nothing
    assert bucket.level(0.0) == 1000
    assert bucket.seconds_until(2000, 0.0) == 2.0  # (2000 - 1000) / 500
    assert bucket.level(1.0) == 1500               # refills at rate...
    assert bucket.level(100.0) == 5000             # ...up to the burst cap
    assert bucket.level(50.0) == 5000              # time never runs backwards
    bucket.give_back(10_000, 100.0)
    assert bucket.level(100.0) == 5000             # refunds are capped too


_made = itertools.count(1)


def request(tenant="t", prompt=10, tokens=90, bid=5):
    return InferenceRequest(f"r{next(_made)}", tenant, prompt, tokens, bid)


def no_engine_limit(request):
    return None


def make_admission(clock, max_queued=100, per_tenant=100):
    admission = Admission(tenants={"t": TenantConfig(rate=100.0, burst=1000)},
                          batching=MicroBatching(MicroParams(max_batch_size=16, kv_cap_tokens=800)),
                          ledger=Ledger(tenant_names=["t"]), clock=clock, engine_refuse=no_engine_limit,
                          max_queued=max_queued, max_queued_per_tenant=per_tenant)
    admission.ledger.settle = admission.settle  # (as Pipeline.build wires it)
    return admission


async def test_bucket_refills_in_virtual_time(autojump_clock):
    clock = ModelClock(time_scale=1.0)
    admission = make_admission(clock)
    for _ in range(10):  # 10 x 100 tokens drains the 1000-token burst
        assert admission.decide(request()) is None
    refusal = admission.decide(request())
    assert refusal.status == 429
    assert refusal.headers["Retry-After"] == "1"  # 100 tokens at 100/s
    assert refusal.headers["RateLimit"] == '"tokens";r=0;t=10'
    assert refusal.headers["RateLimit-Policy"] == '"tokens";q=1000;w=10'
    await trio.sleep(0.999)
    assert admission.decide(request()).status == 429
    await trio.sleep(0.001)
    assert admission.decide(request()) is None


async def test_admitted_requests_are_stamped_in_order(autojump_clock):
    clock = ModelClock(time_scale=1.0)
    admission = make_admission(clock)
    first, second = request(), request()
    await trio.sleep(2.5)
    assert admission.decide(first) is None
    await trio.sleep(1.0)
    assert admission.decide(second) is None
    assert (first.arrival, second.arrival) == (2.5, 3.5)
    assert second.seq == first.seq + 1


async def test_retry_after_is_in_wall_seconds(autojump_clock):
    clock = ModelClock(time_scale=0.1)  # a model second lasts 0.1 wall seconds
    admission = make_admission(clock)
    assert admission.decide(request(prompt=0, tokens=800)) is None
    refusal = admission.decide(request(prompt=0, tokens=800))
    # 600 missing tokens at 100/s = 6 model s = 0.6 wall s -> rounded up to 1
    assert refusal.headers["Retry-After"] == "1"
    assert refusal.headers["RateLimit-Policy"] == '"tokens";q=1000;w=1'


async def test_refusal_order(autojump_clock):
    clock = ModelClock()
    admission = make_admission(clock, max_queued=1)
    assert admission.decide(request(tenant="nobody")).status == 404
    too_big = admission.decide(request(prompt=1001, tokens=10))
    assert (too_big.status, too_big.error) == (413, "exceeds_tenant_burst")
    assert "prompt alone is 1001 tokens" in too_big.message and "burst" in too_big.message
    over_kv = admission.decide(request(prompt=500, tokens=400))
    assert (over_kv.status, over_kv.error) == (413, "exceeds_batch_capacity")
    assert "kv_cap_tokens" in over_kv.message
    admitted = request()
    assert admission.decide(admitted) is None
    admission.ledger.admit(admitted)
    full = admission.decide(request())
    assert (full.status, full.error, full.headers["Retry-After"]) == (503, "queue_full", "1")
    admission.accepting = False
    assert admission.decide(request()).error == "shutting_down"


async def test_a_request_that_ends_gives_back_what_it_did_not_use(autojump_clock):
    """Settlement when a request ends: nothing charged for a request that never started; prompt +
    generated tokens for one that ran, whatever its outcome (failed included)."""
    from apsd.core.models import Dispatch, Refusal

    admission = make_admission(ModelClock())
    ledger = admission.ledger
    bucket = admission.buckets["t"]

    def admitted(prompt, tokens):
        r = request(prompt=prompt, tokens=tokens)
        assert admission.decide(r) is None
        ledger.admit(r)
        return r

    def running(r, generated):
        r.dispatched_at = 0.0
        ledger.dispatched(Dispatch(1, (r,), formed_at=0.0, window_s=0.0, engine_id=0))
        ledger.started(r, 0.0)
        r.tokens_generated = generated
        return r

    queued = admitted(0, 700)
    assert bucket.level(0.0) == 300
    ledger.finish(queued, Refusal(504, "queue_timeout", "waited", kind="cancelled"))
    assert bucket.level(0.0) == 1000                     # never ran: everything back
    ran = running(admitted(100, 400), generated=150)
    ledger.finish(ran, Refusal(499, "client_disconnected", "left", kind="cancelled"))
    assert bucket.level(0.0) == 1000 - 250               # its prompt and 150 output tokens ran: charged
    failed = running(admitted(100, 100), generated=50)
    ledger.finish(failed, Refusal(502, "executor_failed", "boom", kind="failed"))
    assert bucket.level(0.0) == 750 - 150                # failed after its first token: what ran is charged
    assert ledger.tenants["t"].generated_tokens == 200 and ledger.tenants["t"].prompt_tokens == 200
    early = admitted(100, 100)                           # failed before its first token: nothing charged
    early.dispatched_at = 0.0
    ledger.dispatched(Dispatch(2, (early,), formed_at=0.0, window_s=0.0, engine_id=0))
    ledger.finish(early, Refusal(502, "executor_failed", "boom", kind="failed"))
    assert bucket.level(0.0) == 600


async def test_one_tenant_cannot_fill_the_shared_queue(autojump_clock):
    clock = ModelClock()
    admission = Admission(tenants={"hog": TenantConfig(rate=1e6, burst=10**6),
                                   "other": TenantConfig(rate=1e6, burst=10**6)},
                          batching=MicroBatching(MicroParams()), ledger=Ledger(tenant_names=["hog", "other"]),
                          clock=clock, engine_refuse=no_engine_limit, max_queued=10, max_queued_per_tenant=3)
    answers = []
    for tenant in ["hog"] * 5 + ["other"] * 3:
        r = request(tenant=tenant)
        refusal = admission.decide(r)
        if refusal is None:
            admission.ledger.admit(r)
        answers.append((tenant, refusal and (refusal.status, refusal.error)))
    assert answers == [("hog", None)] * 3 + [("hog", (429, "tenant_queue_full"))] * 2 + [("other", None)] * 3


async def test_queued_tokens_are_bounded_and_given_back(autojump_clock):
    """[queue] max_tokens: 503 queue_full once admitting would pass it; room returns as requests leave."""
    from apsd.core.models import Refusal

    admission = make_admission(ModelClock())
    admission.max_queued_tokens = 250
    first, second = request(prompt=10, tokens=90), request(prompt=10, tokens=90)   # 100 tokens each
    for r in (first, second):
        assert admission.decide(r) is None
        admission.ledger.admit(r)
    assert admission.ledger.queued_tokens == 200
    full = admission.decide(request(prompt=10, tokens=60))                        # 270 > 250
    assert (full.status, full.error, full.headers["Retry-After"]) == (503, "queue_full", "1")
    assert "queue.max_tokens" in full.message and "200 tokens" in full.message
    assert admission.decide(request(prompt=10, tokens=40)) is None               # 250: exactly fits
    admission.ledger.finish(first, Refusal(503, "shutting_down", "gone"))        # leaves the queue
    assert admission.ledger.queued_tokens == 100
    assert admission.decide(request(prompt=10, tokens=140)) is None
    never = admission.decide(request(prompt=10, tokens=241))                     # 251 > 250: never fits
    assert (never.status, never.error) == (413, "exceeds_queue_capacity") and "Retry-After" not in never.headers


async def test_the_ledger_keeps_totals_and_logs_who_changed(autojump_clock):
    """Figures over all tenants are running totals (read without a loop over tenants), equal to the
    sums over the tenants and the unattributed refusals; the change log names each configured
    tenant whose counters moved since a mark, once, and never a name nobody configured."""
    from apsd.core.models import Refusal

    admission = Admission(tenants={"a": TenantConfig(rate=1e6, burst=10**6), "b": TenantConfig(rate=1e6, burst=10**6)},
                          batching=MicroBatching(MicroParams()), ledger=Ledger(tenant_names=["a", "b"]),
                          clock=ModelClock(), engine_refuse=no_engine_limit, max_queued=10, max_queued_per_tenant=10)
    ledger = admission.ledger
    mark = ledger.changes.mark
    done = [request(tenant="a"), request(tenant="a"), request(tenant="b")]
    for r in done:
        assert admission.handle(r)
    assert not admission.handle(request(tenant="nobody"))                      # 404: unattributed
    ledger.count_refusal(None, "invalid_json")
    ledger.finish(done[0], Refusal(504, "queue_timeout", "waited", kind="cancelled"))
    ledger.finish(done[1], Refusal(502, "engine_failed", "boom", kind="failed"))
    assert ledger.changes.since(mark) == ["a", "b"]
    later = ledger.changes.mark
    ledger.finish(done[2], Refusal(499, "client_disconnected", "left", kind="cancelled"))
    assert ledger.changes.since(later) == ["b"]

    everyone = [*ledger.tenants.values(), ledger.unattributed]
    for name in ("admitted", "rejected", "completed", "failed", "cancelled", "prompt_tokens", "generated_tokens"):
        assert getattr(ledger.totals, name) == sum(getattr(s, name) for s in everyone), name
    assert ledger.totals.rejected_by_error == {"unknown_tenant": 1, "invalid_json": 1}
    books = ledger.statistics(1.0, 1, {"a": 1e6, "b": 1e6}).requests
    assert (books.admitted, books.rejected, books.failed, books.cancelled, books.in_flight) == (3, 2, 1, 2, 0)
    assert books.rejected_by_error == {"unknown_tenant": 1, "invalid_json": 1} and books.conservation_ok


# -- a shared bucket (replicas leasing from one simulated shared state, in virtual time) -----------

class FlakyState:
    """The simulator's shared state, which can be made unreachable (``down``) or slow (``slow_s``)."""

    def __init__(self) -> None:
        from apsd.store.simulated import SimulatedSharedState

        self.state = SimulatedSharedState(delay_s=0.001)
        self.name = self.state.name
        self.down = False
        self.slow_s = 0.0

    @contextlib.asynccontextmanager
    async def session(self):
        if self.down:
            raise OSError("connection refused")
        yield self

    async def lease(self, asks):
        await trio.sleep(self.slow_s)
        if self.down:
            raise OSError("connection lost")
        return await self.state.lease(asks)

    async def service(self, replica, given):
        return await self.state.service(replica, given)


@contextlib.asynccontextmanager
async def shared_admissions(count, tenant, state=None):
    """``count`` admissions over leasing stores sharing ``state`` (a :class:`FlakyState` by default),
    every store's exchange task running; (state, stores, admissions)."""
    from apsd.core.config import StoreConfig
    from apsd.store.leasing import LeasingStore

    state = state or FlakyState()
    stores = [LeasingStore(StoreConfig(sync_interval_s=0.05), state, kind="simulated", replica_id=f"r{i}")
              for i in range(count)]
    async with trio.open_nursery() as nursery:
        for store in stores:
            await nursery.start(store.run)
        yield state, stores, [
            Admission(tenants={"t": tenant}, batching=MicroBatching(MicroParams()), ledger=Ledger(tenant_names=["t"]),
                      clock=ModelClock(), engine_refuse=no_engine_limit, max_queued=100, max_queued_per_tenant=100,
                      store=store) for store in stores]
        nursery.cancel_scope.cancel()


def waited(refusal):
    """The seconds a 429's message says enough tokens accrue in."""
    return float(refusal.message.rsplit("enough accrue in ", 1)[1].removesuffix(" s"))


async def test_a_request_beyond_the_lease_is_told_one_exchange_when_the_shared_bucket_has_enough(autojump_clock):
    """Issue 19: a replica's slice (its lease, and its optimistic half of the bucket) cannot cover 600
    tokens, but the shared bucket holds 1000. It was told to wait 3.4 s (4 s in the header) for what one
    exchange brings: now one sync interval (1 s in the header), and the retry is admitted."""
    async with shared_admissions(2, TenantConfig(rate=30.0, burst=1000)) as (_, stores, (a, _b)):
        await trio.sleep(0.2)  # both replicas seen: each may admit half the bucket beyond its lease
        assert [s.replicas for s in stores] == [2, 2]
        refusal = a.decide(request(prompt=0, tokens=600))
        assert (refusal.status, refusal.headers["Retry-After"]) == (429, "1"), refusal
        assert waited(refusal) == 0.05
        assert "on this replica (1000 in its shared bucket, as last known)" in refusal.message
        await trio.sleep(0.1)  # the next exchange leased for it
        assert a.decide(request(prompt=0, tokens=600)) is None


async def test_a_refusal_the_shared_bucket_cannot_cover_tells_the_refill_and_keeps_room_for_the_retry(autojump_clock):
    """The shared bucket is short: the wait is one exchange plus the shortfall at the tenant's rate, from
    its last known level; a retry after exactly that wait is admitted (the lease kept room for it past
    HOLD_S, rather than returning it and refusing the retry once more)."""
    from apsd.store.leasing import HOLD_S

    async with shared_admissions(2, TenantConfig(rate=30.0, burst=1000)) as (state, _, (a, b)):
        await trio.sleep(0.2)
        assert b.decide(request(prompt=0, tokens=900)) is not None
        await trio.sleep(0.1)
        assert b.decide(request(prompt=0, tokens=900)) is None      # b leased the bucket
        await trio.sleep(3.0)                                       # b idle: it returned the rest
        refusal = a.decide(request(prompt=0, tokens=600))
        shared = state.state.buckets["t"][0]
        assert 100 < shared < 400, shared
        expected = 0.05 + (600 - (shared + 30 * (trio.current_time() - state.state.buckets["t"][1]))) / 30
        assert waited(refusal) == pytest.approx(expected, abs=0.1)
        assert waited(refusal) > HOLD_S + 1 and refusal.headers["Retry-After"] == str(math.ceil(waited(refusal)))
        await trio.sleep(waited(refusal))
        assert a.decide(request(prompt=0, tokens=600)) is None


async def test_a_replica_admits_on_its_fallback_while_the_exchange_that_recovers_is_in_flight(autojump_clock):
    """Redis back but slow to answer the first exchange: the replica keeps admitting at its share of
    the rate until that exchange succeeds (it refused everything beyond its lease, with a 429 that said
    it had the tokens), and what it admitted meanwhile is charged to the shared bucket once."""
    async with shared_admissions(1, TenantConfig(rate=1e-3, burst=1000)) as (state, (store,), (a,)):
        await trio.sleep(0.2)
        assert a.decide(request(prompt=0, tokens=100)) is None
        state.down = True
        with trio.fail_after(5):
            while store.available:
                await trio.sleep(0.01)
        state.down, state.slow_s = False, 0.5
        await trio.sleep(0.2)                                     # the recovering exchange is in flight
        assert not store.available
        assert a.decide(request(prompt=0, tokens=200)) is None
        with trio.fail_after(5):
            while not store.available:
                await trio.sleep(0.01)
        state.slow_s = 0.0
        await trio.sleep(3.0)                                     # idle: the lease went back
        assert state.state.buckets["t"][0] + a.buckets["t"].tokens == pytest.approx(1000 - 300, abs=0.1)


@pytest.mark.parametrize(("prompt", "tokens"), [
    ("Explain token buckets in one paragraph.", 10),   # 33 letters / 4 + the full stop (the docs' example)
    ("1234567890", 10),                                 # digits: one each (tokenizers split numbers)
    ("!@#$%^&*()" * 3, 30),                             # symbols: one each
    ("a    b", 4),                                      # 2 letters / 4 + a run of spaces: each but the one before a word
    ("\n\t\r\n", 4),
    ("你好", 6),                                         # UTF-8 bytes beyond ASCII: one each
    ("x" * 16, 4),
    ("", 0),
])
def test_the_estimate_counts_letters_at_chars_per_token_and_everything_else_at_worst(prompt, tokens):
    from apsd.core.admission import estimate_tokens
    from apsd.core.config import AdmissionConfig

    assert estimate_tokens(prompt, AdmissionConfig()) == tokens
