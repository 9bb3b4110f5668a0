"""Reservations that fit agents, keys' own limits, max_concurrency and prices: through the whole
pipeline (the forward engine in front of simulated servers), in virtual time."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
import trio.testing

from apsd.core.budget import MICRO
from apsd.core.clock import ModelClock
from apsd.core.config import KeyConfig, KeyLimits, PriceConfig, TenantConfig, parse_config
from apsd.core.models import Completion, InferenceRequest, Refusal
from apsd.core.reservation import MIN_SAMPLES
from apsd.engines.backends import SimulatedBackendClient, SimulatedServer
from apsd.pipeline import Pipeline, open_pipeline
from tests.helpers import build_policies

MODEL = "sim"


def forward_config(tenants: dict[str, TenantConfig], *, slots: int = 16, keys: dict[str, KeyConfig] | None = None,
                   prices: dict[str, PriceConfig] | None = None, **toml: Any):
    config = parse_config({"policy": {"preset": "fair"},
                           "backends": [{"url": "http://s.test", "name": "s", "models": [MODEL],
                                         "max_concurrency": slots}],
                           "forward": {"health_interval_s": 1.0, "metrics_interval_s": 0.5}, **toml}, "<test>")
    return attrs.evolve(config, tenants=tenants, keys=keys or {}, prices=prices or {})


def server(slots: int = 16, ttft_s: float = 0.1, tpot_s: float = 0.01) -> SimulatedServer:
    return SimulatedServer(models=(MODEL,), slots=slots, ttft_s=ttft_s, tpot_s=tpot_s)


@attrs.define(eq=False)
class LengthClient(SimulatedBackendClient):
    """The simulated servers, each answer as long as ``lengths`` says for its request (at most its limit)."""

    lengths: dict[str, int] = attrs.field(factory=dict)

    async def complete(self, backend, api, body, on_chunk, request_id="", traceparent=""):
        limit = int(body.get("max_tokens") or 16)
        body = dict(body, max_tokens=min(limit, self.lengths.get(request_id, limit)))
        return await super().complete(backend, api, body, on_chunk, request_id)


def ask(pipeline: Pipeline, tenant: str, *, tokens: int = 20, prompt: str = "hello there", key_id: str | None = None,
        model: str = MODEL, timeout_s: float | None = None) -> InferenceRequest:
    """A completion asking for ``tokens``, as the OpenAI handler builds it; submitted."""
    request = pipeline.new_request(tenant_id=tenant, prompt=prompt, tokens_requested=tokens, priority_bid=5,
                                   model=model, api="completions", key_id=key_id, timeout_s=timeout_s,
                                   payload={"model": model, "prompt": prompt, "max_tokens": tokens})
    assert pipeline.submit_nowait(request) is None
    return request


@attrs.define
class InFlight:
    """The most requests of each tenant (and key) the scheduler held at once (queued or running)."""

    pipeline: Pipeline
    peak: dict[str, int] = attrs.field(factory=dict)
    running_peak: dict[str, int] = attrs.field(factory=dict)

    def watch(self) -> None:
        events = self.pipeline.ledger.events
        events.subscribe("request_dispatched", self._moved, "test")
        events.subscribe("request_finished", self._moved, "test")
        events.subscribe("request_admitted", self._moved, "test")

    def _moved(self, request: InferenceRequest) -> None:
        gate = self.pipeline.scheduler.gate
        for name in {request.tenant_id, *(k for k in [request.key_id] if k)}:
            count = gate.in_flight(name) if name == request.tenant_id else gate.key_in_flight(name)
            self.peak[name] = max(self.peak.get(name, 0), count)
        running = self.pipeline.ledger.tenants[request.tenant_id].running
        self.running_peak[request.tenant_id] = max(self.running_peak.get(request.tenant_id, 0), running)


# -- max_concurrency ------------------------------------------------------------------------------------

async def test_a_tenant_at_its_max_concurrency_waits_in_line_and_is_never_refused(autojump_clock):
    """Six requests at once from a tenant with max_concurrency 2: all admitted (none refused), at most
    two in flight at any moment, served in arrival order; another tenant's are not held back."""
    config = forward_config({"agent": TenantConfig(rate=1e6, burst=10**6, max_concurrency=2),
                             "other": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), {"s": server()})) as pipeline:
        watch = InFlight(pipeline)
        watch.watch()
        await trio.testing.wait_all_tasks_blocked()
        mine = [ask(pipeline, "agent") for _ in range(6)]
        others = [ask(pipeline, "other") for _ in range(4)]
        await trio.sleep(0.001)
        assert pipeline.tenant_status("agent").waiting_for_concurrency == 4
        assert pipeline.tenant_status("agent").queued == 6 - pipeline.tenant_status("agent").running
        outcomes = [await r.reply.wait() for r in mine + others]
    assert all(isinstance(o, Completion) for o in outcomes)
    assert watch.peak["agent"] == 2 and watch.running_peak["agent"] == 2
    assert watch.running_peak["other"] == 4   # (not held back by the agent's line)
    started = sorted(mine, key=lambda r: r.started_at)
    assert started == mine                    # (arrival order)
    assert max(r.started_at for r in others) < min(r.started_at for r in mine[2:])


async def test_a_key_is_held_to_its_own_max_concurrency_inside_its_tenants(autojump_clock):
    """A tenant allowing 3 at once, one of its keys 1: that key's requests run one at a time, and the
    other key's pass them in the tenant's line; the tenant never has more than 3."""
    keys = {"k1": KeyConfig("k1", "t", "sha256:" + "1" * 64, name="one", limits=KeyLimits(max_concurrency=1)),
            "k2": KeyConfig("k2", "t", "sha256:" + "2" * 64, name="two")}
    config = forward_config({"t": TenantConfig(rate=1e6, burst=10**6, max_concurrency=3)}, keys=keys)
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), {"s": server()})) as pipeline:
        watch = InFlight(pipeline)
        watch.watch()
        await trio.testing.wait_all_tasks_blocked()
        first = [ask(pipeline, "t", key_id="k1") for _ in range(3)]
        second = [ask(pipeline, "t", key_id="k2") for _ in range(3)]
        outcomes = [await r.reply.wait() for r in first + second]
    assert all(isinstance(o, Completion) for o in outcomes)
    assert watch.peak["k1"] == 1 and watch.peak["t"] == 3
    assert max(r.started_at for r in second) < first[2].started_at   # (k2's went past k1's waiting ones)


async def test_a_request_waiting_in_line_times_out_or_leaves_and_a_reload_lets_the_rest_in(autojump_clock):
    """Waiting in line counts as queued: its queue timeout runs (504), its client may leave (499), and
    a reload that raises max_concurrency lets the others in at once."""
    config = forward_config({"t": TenantConfig(rate=1e6, burst=10**6, max_concurrency=1)})
    slow = server(ttft_s=5.0)
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), {"s": slow})) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        running = ask(pipeline, "t")
        timed = ask(pipeline, "t", timeout_s=1.0)
        leaving = ask(pipeline, "t")
        waiting = [ask(pipeline, "t") for _ in range(3)]
        await trio.sleep(0.5)
        assert pipeline.cancel(leaving)
        assert (await leaving.reply.wait()).status == 499
        outcome = await timed.reply.wait()
        assert (outcome.status, outcome.error) == (504, "queue_timeout")
        assert pipeline.tenant_status("t").waiting_for_concurrency == 3
        assert not any(r.dispatched_at for r in waiting)
        raised = attrs.evolve(config, tenants={"t": TenantConfig(rate=1e6, burst=10**6, max_concurrency=4)})
        changes = pipeline.reconfigure(raised, build_policies(raised))
        assert "tenant t: max_concurrency 4" in changes
        await trio.sleep(0.001)
        assert all(r.dispatched_at is not None for r in waiting)
        outcomes = [await r.reply.wait() for r in [running, *waiting]]
        assert all(isinstance(o, Completion) for o in outcomes)
        assert pipeline.statistics().books.requests.conservation_ok
        assert pipeline.scheduler.gate.in_flight("t") == 0


# -- reservations that fit agents -----------------------------------------------------------------------

async def test_a_request_reserves_its_probable_output_and_the_tenant_learns_it(autojump_clock):
    """max_tokens 32,000 on a tenant of burst 5,000: admitted, reserving the prompt and 1,024 before the
    tenant has history, then the 90th percentile of its last completions; the bucket is charged what
    each request generated, not what it reserved. (The bucket barely refills: rate 1e-6.)"""
    config = forward_config({"t": TenantConfig(rate=1e-6, burst=5000)})
    client = LengthClient(ModelClock(), {"s": server(slots=1)})
    async with open_pipeline(config, build_policies(config), backend_client=client) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        bucket = pipeline.admission.buckets["t"]
        for number, length in enumerate([60, 10, 20, 30, 40, 50, 70, 80, 90, 100][:MIN_SAMPLES]):
            request = ask(pipeline, "t", tokens=32_000, prompt="x" * 40)
            client.lengths[request.request_id] = length
            await trio.testing.wait_all_tasks_blocked()   # (admitted)
            assert request.reserved_output == 1024 and request.reserved_tokens == request.prompt_tokens + 1024
            assert isinstance(await request.reply.wait(), Completion) and request.tokens_generated == length
        # ten completions of 10 to 100 tokens: their 90th percentile (nearest rank) is 90
        level = bucket.level(pipeline.clock.now())
        learned = ask(pipeline, "t", tokens=32_000, prompt="x" * 40)
        client.lengths[learned.request_id] = 400   # (310 beyond what it will reserve)
        await trio.testing.wait_all_tasks_blocked()
        assert learned.reserved_output == 90 and learned.reserved_tokens == learned.prompt_tokens + 90
        assert bucket.level(pipeline.clock.now()) == pytest.approx(level - learned.reserved_tokens, abs=0.01)
        await learned.reply.wait()
        assert learned.used_tokens == learned.prompt_tokens + 400
        assert bucket.level(pipeline.clock.now()) == pytest.approx(level - learned.used_tokens, abs=0.01)


async def test_what_a_request_generates_beyond_its_reservation_is_debt_repaid_before_the_next(autojump_clock):
    """A tenant that reserves 10 output tokens a request (output_estimate_tokens) and gets 300: its bucket
    goes below zero, and its next request waits until the debt is repaid at its rate (429 with the
    wait in Retry-After meanwhile)."""
    config = forward_config({"t": TenantConfig(rate=10.0, burst=100, output_estimate_tokens=10)})
    client = LengthClient(ModelClock(), {"s": server()})
    async with open_pipeline(config, build_policies(config), backend_client=client) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        first = ask(pipeline, "t", tokens=32_000)
        client.lengths[first.request_id] = 300
        await trio.testing.wait_all_tasks_blocked()
        assert first.reserved_tokens == first.prompt_tokens + 10
        await first.reply.wait()
        bucket = pipeline.admission.buckets["t"]
        debt = -bucket.level(pipeline.clock.now())
        assert debt > 150   # 100 - (3 + 300), refilled at 10/s over the answer's 3 s
        refused = await ask(pipeline, "t", tokens=32_000).reply.wait()
        assert (refused.status, refused.error) == (429, "rate_limited")
        assert int(refused.headers["Retry-After"]) == pytest.approx((debt + 13) / 10, abs=1)
        await trio.sleep((debt + 13) / 10)
        again = ask(pipeline, "t", tokens=32_000)
        client.lengths[again.request_id] = 5
        assert isinstance(await again.reply.wait(), Completion)


async def test_max_request_tokens_and_a_prompt_above_the_burst_are_refused_413(autojump_clock):
    config = forward_config({"capped": TenantConfig(rate=100, burst=1000, max_request_tokens=2000),
                             "small": TenantConfig(rate=100, burst=50)})
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), {"s": server()})) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        capped = pipeline.new_request(tenant_id="capped", prompt="hi", tokens_requested=32_000, priority_bid=5,
                                      model=MODEL, api="completions", payload={"model": MODEL, "prompt": "hi"})
        pipeline.submit_nowait(capped)
        refusal = await capped.reply.wait()
        assert (refusal.status, refusal.error, refusal.field) == (413, "exceeds_max_request_tokens", "max_tokens")
        assert "max_request_tokens" in refusal.message and "2000" in refusal.message
        big_output = ask(pipeline, "small", tokens=32_000)   # (admitted: an output limit is not a certain cost)
        assert isinstance(await big_output.reply.wait(), Completion)
        big_prompt = pipeline.new_request(tenant_id="small", prompt="1" * 60, tokens_requested=1, priority_bid=5,
                                          model=MODEL, api="completions", payload={"model": MODEL, "prompt": "1" * 60})
        pipeline.submit_nowait(big_prompt)
        refusal = await big_prompt.reply.wait()
        assert (refusal.status, refusal.error) == (413, "exceeds_tenant_burst")


# -- keys' own buckets and budgets; prices --------------------------------------------------------------

async def test_a_keys_own_bucket_and_dollar_budget_hold_it_and_not_its_tenants_other_keys(autojump_clock):
    """A key with a rate of its own and a dollar budget: its requests are refused when either runs out
    (429 naming the key), while the tenant's other key goes on; its spend is priced at [prices]."""
    keys = {"k1": KeyConfig("k1", "t", "sha256:" + "1" * 64, name="ci",
                            limits=KeyLimits(rate=1.0, burst=200, budget_usd=0.01)),
            "k2": KeyConfig("k2", "t", "sha256:" + "2" * 64, name="laptop")}
    prices = {MODEL: PriceConfig(input_per_1m_usd=10.0, output_per_1m_usd=20.0)}
    config = forward_config({"t": TenantConfig(rate=1e6, burst=10**6)}, keys=keys, prices=prices)
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), {"s": server()})) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        first = ask(pipeline, "t", tokens=50, key_id="k1")
        assert isinstance(await first.reply.wait(), Completion)
        assert first.spend_usd == pytest.approx((first.prompt_tokens * 10 + 50 * 20) / 1e6)
        refused = ask(pipeline, "t", tokens=190, key_id="k1")   # (its bucket: 200 less what the first used)
        outcome = await refused.reply.wait()
        assert (outcome.status, outcome.error) == (429, "rate_limited") and "key 'ci'" in outcome.message
        others = ask(pipeline, "t", tokens=190, key_id="k2")
        assert isinstance(await others.reply.wait(), Completion)
        spent = first.spend_usd
        while True:   # the key's dollar budget: $0.01, about nine requests of 50 tokens
            await trio.sleep(200.0)   # (its bucket refills)
            request = ask(pipeline, "t", tokens=50, key_id="k1")
            outcome = await request.reply.wait()
            if isinstance(outcome, Refusal):
                break
            spent += request.spend_usd
        assert (outcome.status, outcome.error) == (429, "budget_exhausted") and "key 'ci'" in outcome.message
        assert 0.01 - (request.prompt_tokens * 10 + 50 * 20) / 1e6 < spent <= 0.01   # (no room for one more)
        limits = pipeline.admission.budgets.limits()
        view = pipeline.admission.budgets.view(limits["t:key:k1:usd"])
        assert view.spent == round(spent * MICRO) and view.reserved == 0
        assert pipeline.ledger.keys["k1"].spend_usd == pytest.approx(spent)
        assert pipeline.ledger.tenants["t"].spend_usd == pytest.approx(spent + others.spend_usd)


async def test_an_unpriced_model_is_refused_to_a_dollar_budget_and_free_to_the_others(autojump_clock):
    """A model without a price: 403 model_not_priced for a tenant with a dollar budget, served (spend 0,
    counted unpriced) for one without; [prices."*"] prices it."""
    config = forward_config({"budgeted": TenantConfig(rate=1e6, burst=10**6, budget_usd=5.0),
                             "free": TenantConfig(rate=1e6, burst=10**6)},
                            prices={"other-model": PriceConfig(input_per_1m_usd=1.0, output_per_1m_usd=1.0)})
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), {"s": server()})) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        refused = await ask(pipeline, "budgeted").reply.wait()
        assert (refused.status, refused.error, refused.field) == (403, "model_not_priced", "model")
        assert "'sim' has no price" in refused.message
        free = ask(pipeline, "free")
        assert isinstance(await free.reply.wait(), Completion) and free.unpriced and free.spend_usd == 0
        assert pipeline.ledger.tenants["free"].unpriced == 1
        priced = attrs.evolve(config, prices={"*": PriceConfig(input_per_1m_usd=1.0, output_per_1m_usd=2.0)})
        assert "prices: 1 models priced" in pipeline.reconfigure(priced, build_policies(priced))
        served = ask(pipeline, "budgeted", tokens=20)
        assert isinstance(await served.reply.wait(), Completion)
        assert served.spend_usd == pytest.approx((served.prompt_tokens * 1 + 20 * 2) / 1e6)


async def test_a_replica_cut_off_from_the_store_never_lets_its_lease_be_spent_twice(autojump_clock):
    """Two replicas share a budget of 1,000 tokens through the simulated store (the Redis script's
    rules). One holds a lease and then loses the store: it admits from its lease for a while, never past
    LEASE_FRESH_S after its last exchange. After LEASE_TTL_S the store drops that lease but counts it as
    spent (the cut-off replica may have spent it, unreported): the other replica cannot spend it again.
    When the cut-off replica is back, what it really spent replaces the presumption, the rest of its old
    lease goes to the other, and together they spend exactly the budget."""
    from apsd.core.budget import LEASE_FRESH_S, LEASE_TTL_S, Budgets, tenant_limits
    from apsd.store.simulated import SimulatedSharedState

    (limit,) = tenant_limits("team", TenantConfig(rate=1e6, burst=10**6, budget_tokens=1000))
    limits = {limit.account: limit}
    state = SimulatedSharedState()
    replicas = {name: Budgets(wall=lambda: 1.8e9, limits=lambda: limits) for name in ("a", "b")}
    for budgets in replicas.values():
        budgets.share(0.05)
        budgets.replicas = 2

    async def exchange(name: str) -> None:
        budgets = replicas[name]
        asks = budgets.asks(limits)
        for one, answer in zip(asks, await state.budget(name, asks)):
            budgets.exchanged(one, *answer)

    def spend(name: str, cost: int) -> bool:
        budgets = replicas[name]
        if budgets.refusal(limit, cost) is not None:
            return False
        budgets.reserve(limit, cost)
        budgets.settle(limit.account, cost, cost, limit)
        return True

    spent = 0
    for _ in range(3):   # a busy: it leases twice its demand (an idle b keeps a little)
        for name in ("a", "b"):
            await exchange(name)
        spent += 50 * sum(spend("a", 50) for _ in range(4))
    assert replicas["a"]._accounts[limit.account].lease >= 300   # (what a holds now, unspent)
    cut_off = trio.current_time()
    spent_by_a_cut_off = 0
    while trio.current_time() - cut_off < 2 * LEASE_TTL_S:
        if trio.current_time() - cut_off < 5:   # a spends part of its lease while cut off
            done = 10 * spend("a", 10)
            assert done, "a cannot spend the lease it holds"
            spent += done
            spent_by_a_cut_off += done
        elif trio.current_time() - cut_off >= LEASE_FRESH_S:
            assert not spend("a", 1), "a spends a lease the store may have given away"
        await exchange("b")
        spent += 10 * sum(spend("b", 10) for _ in range(20))
        assert spent <= 1000
        await trio.sleep(0.5)
    assert spent_by_a_cut_off == 100 and spent < 1000   # (a's old lease is not b's, though a spent only part)
    await exchange("a")   # back: it reports what it spent, claims nothing, and the rest is free again
    account = state.budgets[(limit.account, replicas["a"]._accounts[limit.account].key)]
    assert account["spent"] == spent and "presumed:a" not in account
    assert account["lease:a"] == replicas["a"]._accounts[limit.account].lease <= 1000 - spent   # (a fresh grant)
    for _ in range(10):
        for name in ("a", "b"):
            await exchange(name)
            spent += 10 * sum(spend(name, 10) for _ in range(20))
            assert spent <= 1000
        await trio.sleep(0.5)
    assert spent == 1000


@pytest.mark.parametrize("asked_on", ["a", "both"])
async def test_a_budgets_last_request_is_served_though_two_replicas_hold_parts_of_what_is_left(autojump_clock, asked_on):
    """Two replicas share a budget of 1,000 tokens through the simulated store (the Redis script's
    rules); 900 are spent, a holds 60 of the rest and b (idle) 40. A request of 100, the last the budget
    allows, is asked on a (``a``) or on a and b in turn, each refused one retried every exchange
    (``budget_leasing``): within a few exchanges b gives its part back (told that a's refused request
    is short of it) and the request is served on one of them; the budget is then spent to the token.
    Before this rule each kept its part (an idle share; a lease of its own for its refused requests)
    until the period ended."""
    from apsd.core.budget import Budgets, tenant_limits
    from apsd.store.simulated import SimulatedSharedState

    (limit,) = tenant_limits("team", TenantConfig(rate=1e6, burst=10**6, budget_tokens=1000))
    limits = {limit.account: limit}
    state = SimulatedSharedState()
    replicas = {name: Budgets(wall=lambda: 1.8e9, limits=lambda: limits) for name in ("a", "b")}
    for budgets in replicas.values():
        budgets.share(0.05)
        budgets.replicas = 2
    key = replicas["a"]._account(limit).key
    state.budgets[(limit.account, key)] = {"spent": 900, "settled:a": 900, "lease:a": 60.0, "seen:a": 0.0,
                                           "lease:b": 40.0, "seen:b": 0.0}
    for name, lease in (("a", 60.0), ("b", 40.0)):
        account = replicas[name]._account(limit)
        account.spent, account.settled_total, account.acknowledged = 900, 900 if name == "a" else 0, \
            900 if name == "a" else 0
        account.lease, account.exchanged, account.exchanged_at = lease, True, trio.current_time()

    async def exchange(name: str) -> None:
        budgets = replicas[name]
        asks = budgets.asks(limits)
        for one, answer in zip(asks, await state.budget(name, asks)):
            budgets.exchanged(one, *answer)

    served_on = None
    for turn in range(20):
        name = "a" if asked_on == "a" else "ab"[turn % 2]
        if replicas[name].refusal(limit, 100) is None:
            replicas[name].reserve(limit, 100)
            replicas[name].settle(limit.account, 100, 100, limit)
            served_on = name
            break
        for other in ("a", "b"):
            await exchange(other)
        await trio.sleep(0.05)
    assert served_on is not None, f"the last request was never served: {state.budgets}"
    assert turn <= 6, f"served only at turn {turn}"
    for name in ("a", "b"):
        await exchange(name)
    assert state.budgets[(limit.account, key)]["spent"] == 1000
