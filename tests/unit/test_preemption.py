"""Work-conserving dispatch and gateway preemption in the forward engine, in virtual time against
simulated servers (which check every continuation they are asked for: their token ``i`` reads `` t<i>``).

The choice of a victim is tested against a brute-force reference of the rule; the mechanism through the
pipeline: no slot idles while a request waits (a property over many tenants, 1 to 8 slots, arrivals after
idleness, several backends), a tenant below its share gets a slot at once, preempted streams resume with
no text lost or repeated and their tenant charged once, and churn stays within its limits."""

from __future__ import annotations

import collections
import contextlib
import math

import attrs
import hypothesis
import hypothesis.strategies as st
import pytest
import trio
import trio.testing

from apsd.core.clock import ModelClock
from apsd.core.config import ForwardConfig, TenantConfig, parse_config
from apsd.core.models import Completion, Refusal
from apsd.core.slots import Lease
from apsd.core.streams import TokenStream
from apsd.engines.backends import SimulatedBackendClient, SimulatedServer
from apsd.engines.preemption import (
    PreemptionRules,
    Shares,
    choose_victim,
    eligible,
    resumable,
)
from apsd.pipeline import open_pipeline
from tests.helpers import build_policies

RULES = PreemptionRules(min_run_s=1.0, max_preemptions=4)


def config_for(servers, *, tenants=("flood", "steady"), weights=None, isolation=True, classes=None, **forward):
    config = parse_config({"policy": {"preset": "fair"}, "engine": {"isolation": isolation},
                           "backends": [{"url": f"http://{name}.test", "name": name,
                                         "max_concurrency": server.slots} for name, server in servers.items()],
                           "classes": classes or {}}, "<test>")
    weights = weights or {}
    settings = {"health_interval_s": 1.0, "metrics_interval_s": 0.1, **forward}
    return attrs.evolve(config, forward=ForwardConfig(**settings),
                        tenants={t: TenantConfig(rate=1e9, burst=10**9, weight=weights.get(t, 1.0),
                                                 classes=tuple(classes or ())) for t in tenants})


@contextlib.asynccontextmanager
async def forwarding(servers, **settings):
    config = config_for(servers, **settings)
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), servers)) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        await pipeline.clock.sleep(0.01)
        yield pipeline


def chat(pipeline, tenant, tokens, *, stream=True, service_class=None, **body):
    r = pipeline.new_request(tenant_id=tenant, prompt="hello", tokens_requested=tokens, priority_bid=5, model="sim",
                             api="chat.completions", service_class=service_class,
                             payload={"model": "sim", "messages": [{"role": "user", "content": "hello"}], **body})
    if stream:
        r.stream = TokenStream(max_chunks=10**6)
    assert pipeline.admit_now(r)
    return r


def text_of(request) -> str:
    """What the request's client received, drained from its stream."""
    parts = []
    for chunk in request.stream.receive_ready():
        if chunk.text:
            parts.append(chunk.text)
    return "".join(parts)


def expected(tokens: int) -> str:
    return "".join(f" t{i}" for i in range(tokens))


# -- the rule, against a reference -------------------------------------------------------------------

def reference_victim(leases, slots, weights, tenant, now, rules, ttft=math.inf):
    """The rule written out plainly: a classed request (``ttft`` finite) takes its own tenant's eligible
    request of a looser class (or of its own class, started) first, unstarted first, then the loosest, the least preempted, the newest.
    Otherwise (and a classed request at or above its share may borrow one slot beyond it, from a looser
    request of a tenant holding at least its share): the tenant must hold fewer slots than slots * w / W (W over the
    tenants holding slots and itself); victims are eligible leases of tenants holding more than their
    share and at least as many per weight, less one, as the tenant will hold; unstarted first, then the largest held / weight, then the fewest preemptions, then the newest,
    then the id."""
    if ttft < math.inf:
        own = [lease for lease in leases if lease.tenant == tenant and eligible(lease, math.inf, rules)
               and (lease.ttft_s > ttft or lease.ttft_s == ttft and lease.started)]
        if own:
            return min(own, key=lambda l: (l.started, -l.ttft_s, l.preemptions, -l.since, l.lease_id))
    held = collections.Counter(lease.tenant for lease in leases)
    tenants = set(held) | {tenant}
    total = sum(weights.get(t, 1.0) for t in tenants)
    share = {t: slots * weights.get(t, 1.0) / total for t in tenants}
    w = lambda t: weights.get(t, 1.0)
    base = [lease for lease in leases if lease.tenant != tenant and lease.preemptible and lease.yield_to is None
            and lease.preemptions < rules.max_preemptions
            and (not lease.started or not lease.preemptions or now - lease.since >= rules.min_run_s)]
    if held[tenant] < share[tenant] - 1e-12:
        candidates = [lease for lease in base if held[lease.tenant] > share[lease.tenant] + 1e-12
                      and (held[lease.tenant] - 1) / w(lease.tenant) >= (held[tenant] + 1) / w(tenant) - 1e-12]
    elif ttft < math.inf and held[tenant] < share[tenant] + 1 - 1e-12:   # (borrowing one slot for a tight class)
        candidates = [lease for lease in base if lease.ttft_s > ttft and held[lease.tenant] >= share[lease.tenant] - 1e-12]
    else:
        return None
    if not candidates:
        return None
    return min(candidates, key=lambda l: (l.started, -held[l.tenant] / w(l.tenant), -l.ttft_s, l.preemptions,
                                          -l.since, l.lease_id))


classes = st.sampled_from([math.inf, math.inf, 0.5, 1.0, 30.0])
leases_strategy = st.lists(st.tuples(st.sampled_from("abcde"), st.floats(0, 5), st.booleans(), st.booleans(),
                                     st.integers(0, 5), classes), max_size=12)


@hypothesis.given(leases_strategy, st.integers(1, 12), st.sampled_from("abcdef"),
                  st.dictionaries(st.sampled_from("abcdef"), st.sampled_from([0.5, 1.0, 2.0, 4.0])), classes)
@hypothesis.settings(max_examples=400, deadline=None)
def test_the_victim_is_the_one_the_rule_names(raw, slots, tenant, weights, ttft):
    leases = [Lease(f"l{i}", "b", t, "r", since=since, started=started, preemptible=preemptible, preemptions=n,
                    ttft_s=c) for i, (t, since, started, preemptible, n, c) in enumerate(raw)]
    slots = max(slots, len(leases))
    now = 5.0
    shares = Shares.of(leases, slots, weights)
    assert choose_victim(leases, shares, tenant, now, RULES, ttft) is reference_victim(
        leases, slots, weights, tenant, now, RULES, ttft)


def test_eligibility_waits_for_the_minimum_run_and_stops_at_the_cap():
    lease = Lease("l", "b", "t", "r", since=10.0, started=True, preemptions=1)
    assert not eligible(lease, 10.5, RULES) and eligible(lease, 11.0, RULES)
    assert eligible(attrs.evolve(lease, preemptions=0), 10.0, RULES)   # (never preempted: no minimum run)
    assert eligible(attrs.evolve(lease, started=False), 10.0, RULES)   # (no first token: nothing to lose)
    assert not eligible(attrs.evolve(lease, preemptions=4), 20.0, RULES)
    assert not eligible(attrs.evolve(lease, preemptible=False), 20.0, RULES)


@pytest.mark.parametrize("body, stream, ok", [
    ({}, True, True), ({}, False, False), ({"n": 2}, True, False), ({"logprobs": True}, True, False),
    ({"grammar": "root ::= x"}, True, False), ({"response_format": {"type": "json_object"}}, True, False),
    ({"response_format": {"type": "text"}}, True, True), ({"tools": [{"type": "function"}]}, True, True)])
def test_only_streams_that_can_be_continued_safely_are_resumable(body, stream, ok):
    from apsd.core.models import InferenceRequest
    r = InferenceRequest("r", "t", 1, 10, 5, api="chat.completions",
                         payload={"messages": [{"role": "user", "content": "x"}], **body})
    r.stream = TokenStream() if stream else None
    assert resumable(r) is ok


# -- through the pipeline --------------------------------------------------------------------------

async def test_a_tenant_below_its_share_takes_a_flood_request_s_slot_at_once_and_the_flood_resumes(autojump_clock):
    """A flood holds all four slots with long streams; a steady tenant comes every second. Each steady
    request is dispatched at once, in the slot of a flood stream that is paused and later resumed on the
    same server: every flood client receives exactly its tokens, in order, and is charged them once."""
    servers = {"a": SimulatedServer(slots=4, ttft_s=0.05, tpot_s=0.02)}
    async with forwarding(servers) as pipeline:
        floods = [chat(pipeline, "flood", 300) for _ in range(8)]
        await pipeline.clock.sleep(2.0)
        steady = []
        for _ in range(6):
            r = chat(pipeline, "steady", 10)
            steady.append(r)
            outcome = await r.reply.wait()
            assert isinstance(outcome, Completion)
            await pipeline.clock.sleep(1.0)
        outcomes = [await r.reply.wait() for r in floods]
        engine = pipeline.engines[0]
    assert all(r.dispatched_at == pytest.approx(r.arrival) for r in steady)   # no wait in apsd's queue
    assert all(r.started_at - r.arrival == pytest.approx(0.05) for r in steady)   # the server's own TTFT
    assert engine.preemptions[("a", "resumed")] == 6
    assert servers["a"].bad_continuations == 0
    assert sum(r.preemptions for r in floods) == 6
    for r, outcome in zip(floods, outcomes):
        assert isinstance(outcome, Completion) and outcome.tokens_generated == 300
        assert text_of(r) == expected(300)
    books = pipeline.ledger.tenants["flood"]   # (each prompt and each output token charged once)
    assert books.generated_tokens == 8 * 300 and books.prompt_tokens == sum(r.prompt_tokens for r in floods)
    assert all(r.prompt_tokens == floods[0].prompt_tokens for r in floods)   # (the first prompt, not a continuation's)


@pytest.mark.parametrize("server", ["llama.cpp", "vllm"])
async def test_a_paused_stream_counted_at_its_limit_still_resumes_and_ends_as_the_server_ends_it(
        autojump_clock, monkeypatch, server):
    """A tokenizer may count more tokens in a stream's text than the server generated to write it (a model
    whose text does not tokenize back the same). A preempted stream whose text counts to its whole
    ``max_tokens`` is resumed with at least one token left, never with a limit of 0 (a server may read 0
    as no limit, and apsd would then blame it for sending too many), and ends with the server's own end;
    on llama.cpp, whose chunks are its tokens, the chunks counted stay the count."""
    async def too_many(self, backend, model, text):
        return 10_000

    monkeypatch.setattr(SimulatedBackendClient, "count_output_tokens", too_many)
    servers = {"a": SimulatedServer(slots=2, tpot_s=0.1, says_chunk_tokens=False, server=server)}
    async with forwarding(servers) as pipeline:
        floods = [chat(pipeline, "flood", 50) for _ in range(2)]
        await pipeline.clock.sleep(2.0)
        live = [r.tokens_generated for r in floods]
        assert all(0 < n < 50 for n in live)
        assert isinstance(await chat(pipeline, "steady", 5).reply.wait(), Completion)
        for r in floods:
            assert isinstance(await r.reply.wait(), Completion)
        backend = pipeline.engines[0].backends[0]
    [paused] = [i for i, r in enumerate(floods) if r.preemptions]
    limits = [body["max_tokens"] for body in servers["a"].bodies if body["messages"][-1]["role"] == "assistant"]
    assert limits == [50 - live[paused]] if server == "llama.cpp" else limits == [1]
    assert all(r.tokens_generated <= 50 for r in floods)
    assert backend.healthy and backend.failures == 0


async def test_a_request_without_a_first_token_is_the_victim_and_goes_back_uncharged(autojump_clock):
    """A slow server (its first token takes 2 s): the flood's newest request, still without a token,
    is the victim; it goes back to the queue at its place and is charged once, when it runs."""
    servers = {"a": SimulatedServer(slots=2, ttft_s=2.0, tpot_s=0.01)}
    async with forwarding(servers) as pipeline:
        floods = [chat(pipeline, "flood", 20) for _ in range(3)]
        await pipeline.clock.sleep(0.5)
        steady = chat(pipeline, "steady", 5)
        await trio.testing.wait_all_tasks_blocked()
        assert steady.dispatched_at is not None
        for r in [steady, *floods]:
            assert isinstance(await r.reply.wait(), Completion)
        engine = pipeline.engines[0]
    assert engine.preemptions == {("a", "requeued"): 1}
    assert [r.retries for r in floods] == [0, 0, 0] and sum(r.preemptions for r in floods) == 1
    assert all(text_of(r) == expected(20) for r in floods)


async def test_one_slot_two_tenants_taking_turns_each_wait_at_most_one_request(autojump_clock):
    """llama-server's default: one slot. Two tenants each send a request of about 1 s, wait for its answer,
    and send the next: neither ever waits longer than the other's request in progress, and none is
    preempted (a swap on one slot would only be undone)."""
    servers = {"a": SimulatedServer(slots=1, ttft_s=0.05, tpot_s=0.01)}
    async with forwarding(servers, tenants=("a", "b")) as pipeline:
        sent = []

        async def take_turns(tenant, delay):
            await pipeline.clock.sleep(delay)
            for _ in range(4):
                r = chat(pipeline, tenant, 100)
                sent.append(r)
                assert isinstance(await r.reply.wait(), Completion)
                await pipeline.clock.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(take_turns, "a", 0.0)
            nursery.start_soon(take_turns, "b", 0.3)
    assert len(sent) == 8
    assert max(r.started_at - r.arrival for r in sent) <= 0.05 + 1.1
    assert all(text_of(r) == expected(100) for r in sent) and not any(r.preemptions for r in sent)


async def test_the_minimum_run_and_the_cap_bound_the_churn(autojump_clock):
    """Two slots, two long flood streams, steady requests every 0.3 s: a flood stream is preempted again
    only once its resumed run lasted ``preempt_min_run_s``, and at most ``max_preemptions`` times."""
    servers = {"a": SimulatedServer(slots=2, ttft_s=0.01, tpot_s=0.01)}
    async with forwarding(servers, preempt_min_run_s=1.0, max_preemptions=2) as pipeline:
        engine = pipeline.engines[0]
        runs = collections.defaultdict(list)   # request -> (since, preempted at) of each of its runs

        def on_requeued(request, now):
            if request.tenant_id == "flood":
                runs[request.request_id].append(now)
        pipeline.ledger.events.subscribe("request_requeued", on_requeued, "test")
        floods = [chat(pipeline, "flood", 1500) for _ in range(2)]
        await pipeline.clock.sleep(0.2)
        steady = []
        for _ in range(30):
            steady.append(chat(pipeline, "steady", 5))
            await pipeline.clock.sleep(0.3)
        for r in [*floods, *steady]:
            assert isinstance(await r.reply.wait(), Completion)
    assert [r.preemptions for r in floods] == [2, 2] and all(text_of(r) == expected(1500) for r in floods)
    for times in runs.values():
        assert times[1] - times[0] >= 1.0
    assert servers["a"].bad_continuations == 0 and sum(engine.preemptions.values()) == 4


async def test_requests_that_cannot_be_resumed_are_never_chosen(autojump_clock):
    """Whole answers, several choices, log probabilities: once they run they run to their end, and the
    newcomer waits for a slot to free."""
    servers = {"a": SimulatedServer(slots=2, ttft_s=0.01, tpot_s=0.01)}
    async with forwarding(servers) as pipeline:
        held = [chat(pipeline, "flood", 300, stream=False), chat(pipeline, "flood", 300, logprobs=True)]
        await pipeline.clock.sleep(2.0)
        steady = chat(pipeline, "steady", 5)
        assert isinstance(await steady.reply.wait(), Completion)
        for r in held:
            assert isinstance(await r.reply.wait(), Completion)
        assert sum(pipeline.engines[0].preemptions.values()) == 0
    assert steady.dispatched_at - steady.arrival > 0.5


async def test_two_backlogged_tenants_share_the_slots_without_preempting_each_other(autojump_clock):
    """Two tenants at twice what four slots serve, no classes: a freed slot goes to the tenant below its
    share first, so the share rule never has to take one back."""
    servers = {"a": SimulatedServer(slots=4, ttft_s=0.05, tpot_s=0.01)}
    async with forwarding(servers, tenants=("a", "b")) as pipeline:
        sent = []
        for i in range(200):
            sent.append(chat(pipeline, "ab"[i % 2], 50))
            await pipeline.clock.sleep(1 / 16)
        for r in sent:
            assert isinstance(await r.reply.wait(), Completion)
        assert sum(pipeline.engines[0].preemptions.values()) == 0


async def test_weights_set_the_shares(autojump_clock):
    """Weights 3:1 on four slots: the heavy tenant is below its share with two slots, so it preempts the
    light one; the light one, at its share with one, does not preempt the heavy one."""
    servers = {"a": SimulatedServer(slots=4, ttft_s=0.01, tpot_s=0.01)}
    async with forwarding(servers, tenants=("heavy", "light"), weights={"heavy": 3.0}) as pipeline:
        light = [chat(pipeline, "light", 500) for _ in range(6)]
        await pipeline.clock.sleep(2.0)
        heavy = [chat(pipeline, "heavy", 500) for _ in range(6)]
        await pipeline.clock.sleep(2.0)
        engine = pipeline.engines[0]
        holders = collections.Counter(l.tenant for l in engine.slots.leases("a"))
        assert holders == {"heavy": 3, "light": 1}
        for r in [*light, *heavy]:
            await r.reply.wait()
    assert servers["a"].bad_continuations == 0 and all(text_of(r) == expected(500) for r in [*light, *heavy])


async def test_a_tight_class_takes_its_own_tenants_looser_slot_at_2x_overload(autojump_clock):
    """Two tenants at twice what four slots serve, a fifth of their requests in a tight class (first token
    within 0.3 s, refused when late) and the rest loose (30 s, best effort), on the shipped defaults: the
    tight class meets its target for at least 95% of its requests, taking the slot of a looser request
    of its own tenant, which is paused and resumes with nothing lost; the loose class absorbs the
    overload, and nothing else is preempted (two backlogged tenants alternate on free slots)."""
    import random
    servers = {"a": SimulatedServer(slots=4, ttft_s=0.05, tpot_s=0.01)}
    classes = {"tight": {"ttft_s": 0.3}, "loose": {"ttft_s": 30.0, "on_miss": "best_effort"}}
    rng = random.Random(3)
    async with forwarding(servers, tenants=("a", "b"), classes=classes) as pipeline:
        sent = []
        for i in range(400):   # (4 slots x 1 request / 0.5 s = 8/s served; 16/s offered)
            tenant = "ab"[i % 2]
            sent.append(chat(pipeline, tenant, 50, service_class="tight" if rng.random() < 0.2 else "loose"))
            await pipeline.clock.sleep(1 / 16)
        for r in sent:
            await r.reply.wait()
        figures = {f.name: f for f in pipeline.class_statistics()}
        engine = pipeline.engines[0]
    tight = figures["tight"]
    assert tight.met / (tight.met + tight.missed + tight.refused) >= 0.95, tight
    tights = sum(r.service_class == "tight" for r in sent)
    assert 0 < sum(engine.preemptions.values()) <= tights   # (about one looser request paused per tight one)
    assert servers["a"].bad_continuations == 0
    for r in sent:
        if isinstance(r.reply.outcome, Completion):
            assert text_of(r) == expected(50)


# -- work-conserving: a property over the pool's shapes -----------------------------------------------

@attrs.frozen
class Shape:
    slots: tuple[int, ...]
    #: (tenant, model seconds of idleness before it sends, output tokens, stream)
    arrivals: tuple[tuple[int, float, int, bool], ...]


shapes = st.builds(
    Shape,
    st.lists(st.integers(1, 4), min_size=1, max_size=3).map(tuple).filter(lambda s: sum(s) <= 8),
    st.lists(st.tuples(st.integers(0, 11), st.sampled_from([0.0, 0.0, 0.01, 0.3, 2.0]), st.integers(1, 80),
                       st.booleans()), min_size=1, max_size=40).map(tuple))


@hypothesis.given(shapes)
@hypothesis.settings(max_examples=60, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow])
def test_no_slot_idles_while_a_request_waits(shape):
    """Many tenants (up to 12), 1 to 8 slots over 1 to 3 backends, arrivals after idleness: whenever the
    pipeline is at rest, either nothing waits in apsd's queue or every slot is in use; and every request
    ends complete with all its tokens."""
    async def main():
        servers = {f"b{i}": SimulatedServer(slots=n, ttft_s=0.02, tpot_s=0.01) for i, n in enumerate(shape.slots)}
        tenants = tuple(f"t{i}" for i in range(12))
        violations = []
        async with forwarding(servers, tenants=tenants) as pipeline:
            engine = pipeline.engines[0]

            moved = trio.Event()

            def on_event(now):
                moved.set()
            for event in ("request_admitted", "request_dispatched", "request_requeued", "request_finished"):
                pipeline.ledger.events.subscribe(event, on_event, "test")

            async def watch():   # (after every step of a request, once everything is at rest)
                nonlocal moved
                while True:
                    await moved.wait()
                    moved = trio.Event()
                    await trio.testing.wait_all_tasks_blocked(cushion=0.0)
                    busy = sum(engine.slots.free(b.name, b.config.max_concurrency) == 0 for b in engine.backends)
                    if pipeline.ledger.queued_total and busy < len(engine.backends):
                        violations.append((pipeline.clock.now(), pipeline.ledger.queued_total))

            sent = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                for tenant, idle, tokens, stream in shape.arrivals:
                    await pipeline.clock.sleep(idle)
                    sent.append((chat(pipeline, tenants[tenant], tokens, stream=stream), tokens, stream))
                for r, _, _ in sent:
                    await r.reply.wait()
                nursery.cancel_scope.cancel()
        assert not violations, violations[:5]
        for r, tokens, stream in sent:
            outcome = r.reply.outcome
            assert isinstance(outcome, Completion) and outcome.tokens_generated == tokens
            if stream:
                assert text_of(r) == expected(tokens)
        assert all(s.bad_continuations == 0 for s in servers.values())

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# -- backends that go down ---------------------------------------------------------------------------

async def test_streams_on_a_backend_that_goes_down_resume_elsewhere_or_end_at_once(autojump_clock):
    """A backend found down hands back its requests at once: a resumable stream resumes on the other
    backend with nothing lost; one that cannot be resumed ends with an error now, not at its read timeout."""
    servers = {"a": SimulatedServer(slots=2, ttft_s=0.01, tpot_s=0.05), "b": SimulatedServer(slots=2)}
    async with forwarding(servers) as pipeline:
        engine = pipeline.engines[0]
        resumable_one = chat(pipeline, "flood", 200)
        unresumable = chat(pipeline, "flood", 200, logprobs=True)
        await pipeline.clock.sleep(1.0)
        on_a = [r for r in (resumable_one, unresumable) if r.backend == "a"]
        servers["a"].down = True
        start = pipeline.clock.now()
        engine.watch.mark_down(engine.backends[0], "a test")
        for r in (resumable_one, unresumable):
            await r.reply.wait()
    for r in on_a:
        if r is resumable_one:
            assert isinstance(r.reply.outcome, Completion) and text_of(r) == expected(200)
        else:
            assert isinstance(r.reply.outcome, Refusal) and r.finished_at - start < 0.1
    assert on_a


async def test_the_first_request_after_the_only_backend_died_is_answered_at_once(autojump_clock):
    """The only backend dies between two health checks: the request that finds it unreachable is
    answered 503 ``no_backend`` at once, as every later one is, not after ``no_backend_wait_s``."""
    servers = {"a": SimulatedServer(slots=2)}
    async with forwarding(servers, health_interval_s=2.0, no_backend_wait_s=30.0) as pipeline:
        servers["a"].down = True
        start = pipeline.clock.now()
        r = chat(pipeline, "steady", 5, stream=False)
        outcome = await r.reply.wait()
        assert (outcome.status, outcome.error) == (503, "no_backend")
        assert pipeline.clock.now() - start < 0.1
