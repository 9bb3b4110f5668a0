"""Routing and the prefix cache in virtual time: the continuous engine's cache, settlement at the
discount, routing between four continuous engines (the study's two claims), and the forward engine's
backends chosen by the routing policy."""

from __future__ import annotations

import pytest

from apsd.core.config import AdmissionConfig, BackendConfig, EngineConfig, RoutingConfig, TenantConfig
from apsd.core.models import Completion
from apsd.core.routing import BLOCK_TOKENS, synthetic_blocks
from apsd.engines.backends import SimulatedBackendClient, SimulatedServer
from apsd.pipeline import open_pipeline
from apsd.sim.research.routing import run_routing_study
from tests.helpers import build_policies, make_config

TENANTS = {"t": TenantConfig(rate=1e-6, burst=10**9)}


def continuous(count: int = 1, policy: str = "prefix", discount: float = 0.0, **engine):
    return make_config({"policy": {"preset": "fair"}},
                       engine=EngineConfig(kind="continuous", count=count, **engine),
                       routing=RoutingConfig(policy=policy), admission=AdmissionConfig(cached_prompt_discount=discount),
                       tenants=TENANTS)


async def submit(pipeline, prefix: int, prompt: int, own: int, output: int = 8):
    request = pipeline.new_request(tenant_id="t", prompt="", tokens_requested=output, priority_bid=5,
                                   prompt_tokens=prompt, prefix_blocks=synthetic_blocks((prefix, 4096), own, prompt))
    assert pipeline.admit_now(request)
    return request


@pytest.mark.parametrize("cache", [True, False])
async def test_a_cached_prefix_skips_its_prefill_and_is_settled_at_the_discount(autojump_clock, cache):
    config = continuous(prefix_cache=cache, discount=0.5)
    async with open_pipeline(config, build_policies(config)) as pipeline:
        first = await submit(pipeline, prefix=1, prompt=4096 + 100, own=1)
        await first.reply.wait()
        level = pipeline.admission.buckets["t"].level(pipeline.clock.now())
        second = await submit(pipeline, prefix=1, prompt=4096 + 100, own=2)
        other = await submit(pipeline, prefix=2, prompt=4096 + 100, own=3)
        done = [await r.reply.wait() for r in (second, other)]
        assert all(isinstance(o, Completion) for o in done)
        spent = level - pipeline.admission.buckets["t"].level(pipeline.clock.now())
    assert first.cached_tokens == 0 and other.cached_tokens == 0
    if cache:
        assert second.cached_tokens == 4096                         # the shared blocks, whole
        assert done[0].prefill_ms < done[1].prefill_ms / 5          # 100 tokens against 4,196
        # the tenant pays half price for the cached tokens: (4196 - 2048 + 8) + (4196 + 8)
        assert spent == pytest.approx(4196 - 2048 + 8 + 4196 + 8)
        assert pipeline.engines[0].statistics().cached_prompt_tokens == 4096
    else:
        assert second.cached_tokens == 0
        assert spent == pytest.approx(2 * (4196 + 8))


async def test_a_prompt_is_never_served_whole_from_the_cache(autojump_clock):
    config = continuous()
    async with open_pipeline(config, build_policies(config)) as pipeline:
        first = await submit(pipeline, prefix=1, prompt=4096, own=1)
        await first.reply.wait()
        again = await submit(pipeline, prefix=1, prompt=4096, own=2)   # the same prompt: every block cached
        assert isinstance(await again.reply.wait(), Completion)
    assert again.cached_tokens == 4096 - 1                              # its last token is computed


async def test_the_engines_route_a_prefix_back_to_where_it_is_cached(autojump_clock):
    config = continuous(count=4)
    async with open_pipeline(config, build_policies(config)) as pipeline:
        requests = []
        for turn in range(6):
            for prefix in range(3):
                request = await submit(pipeline, prefix=prefix, prompt=4096 + 64, own=turn)
                requests.append(request)
            await pipeline.clock.sleep(2.0)
        assert all([isinstance(await r.reply.wait(), Completion) for r in requests])
        decisions = pipeline.route_decisions()
    engines = {p: {r.engine_id for r in requests[p::3]} for p in range(3)}
    assert all(len(e) == 1 for e in engines.values())                  # each prefix stays on one engine ...
    assert len({e.pop() for e in engines.values()}) == 3               # ... and the three are spread
    assert sum(r.cached_tokens for r in requests) == 15 * 4096         # every turn after the first hits
    assert requests[3].route.endswith("reason=cache_match") and requests[0].route.endswith("reason=no_match")
    assert sum(n for (_, reason), n in decisions.items() if reason == "cache_match") == 15


async def test_requests_without_a_key_are_taken_by_whichever_engine_asks(autojump_clock):
    config = continuous(count=2, max_sequences=4)
    async with open_pipeline(config, build_policies(config)) as pipeline:
        requests = []
        for _ in range(8):
            request = pipeline.new_request(tenant_id="t", prompt="", tokens_requested=50, priority_bid=5,
                                           prompt_tokens=500)
            assert pipeline.admit_now(request)
            requests.append(request)
        assert all([isinstance(await r.reply.wait(), Completion) for r in requests])
    assert {r.engine_id for r in requests} == {0, 1} and all(r.route is None for r in requests)


def test_prefix_routing_halves_mean_ttft_on_a_zipf_population_twice_one_cache_at_80_percent_load():
    """The study's first claim (docs/research/routing.md has the full run)."""
    rows = {r.policy: r for r in run_routing_study(cases=("zipf",), policies=("least-loaded", "prefix"))}
    assert rows["least-loaded"].ttft_mean_ms >= 2 * rows["prefix"].ttft_mean_ms
    assert rows["prefix"].hit_rate > rows["least-loaded"].hit_rate + 0.1
    assert rows["prefix"].completed == rows["prefix"].requests


def test_with_a_small_working_set_at_low_load_prefix_is_no_worse_than_least_loaded():
    rows = {r.policy: r for r in run_routing_study(cases=("small",), policies=("least-loaded", "prefix"),
                                                    duration=300)}
    assert rows["prefix"].ttft_mean_ms <= 1.05 * rows["least-loaded"].ttft_mean_ms


# -- the forward engine's backends ----------------------------------------------------------------

def forwarding(policy: str):
    backends = [BackendConfig(url=f"http://b{i}.invalid", name=f"b{i}", models=("sim",), max_concurrency=4)
                for i in range(3)]
    return make_config({"routing": {"policy": policy}}, backends=tuple(backends),
                       engine=EngineConfig(kind="forward"), tenants=TENANTS)


def conversation(n: int, turns: int) -> dict:
    messages = [{"role": "system", "content": f"You are assistant number {n}. " + "Be brief. " * 100}]
    for turn in range(turns):
        messages += [{"role": "user", "content": f"question {turn}"}, {"role": "assistant", "content": "ok " * 30}]
    return {"model": "sim", "messages": messages + [{"role": "user", "content": "and now?"}], "max_tokens": 4}


@pytest.mark.parametrize("policy", ["prefix", "prefix-hash", "least-loaded"])
async def test_the_forward_engine_sends_a_conversations_turns_where_its_prefix_went(autojump_clock, policy):
    config = forwarding(policy)
    servers = {f"b{i}": SimulatedServer(models=("sim",), slots=4) for i in range(3)}
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(pipeline_clock(), servers)) as pipeline:
        await pipeline.clock.sleep(1.0)                                 # the backends' first health checks
        routed: dict[int, list[str]] = {n: [] for n in range(4)}
        for turn in range(4):
            requests = {}
            for n in [(k + turn) % 4 for k in range(4)]:   # (a different order each turn)
                body = conversation(n, turn)
                request = pipeline.new_request(tenant_id="t", prompt="x", tokens_requested=4, priority_bid=5,
                                               model="sim", api="chat.completions", payload=body)
                assert pipeline.admit_now(request)
                requests[n] = request
            for n, request in requests.items():
                assert isinstance(await request.reply.wait(), Completion)
                routed[n].append(request.route)
        decisions = pipeline.route_decisions()
    backends = {n: {route.split(";")[0] for route in routes} for n, routes in routed.items()}
    if policy == "least-loaded":
        assert all(route.endswith("reason=least_loaded") for routes in routed.values() for route in routes)
        assert any(len(b) > 1 for b in backends.values())               # turns wander between backends
    else:
        assert all(len(b) == 1 for b in backends.values())              # every turn where the first went
        reason = "cache_match" if policy == "prefix" else "hash"
        assert sum(n for (_, r), n in decisions.items() if r == reason) >= 8
    assert sum(decisions.values()) == 16


def pipeline_clock():
    from apsd.core.clock import ModelClock
    return ModelClock()



def test_the_workloads_keys_share_what_their_prompts_share():
    from apsd.sim.workloads import build_workload

    shared = build_workload("shared-prefixes", {"duration": 60.0, "rate": 2.0, "prefixes": 3}, seed=2).arrivals
    by_key = {}
    for arrival in shared:
        by_key.setdefault(arrival.prefix_blocks[:4096 // BLOCK_TOKENS], []).append(arrival)
    assert len(by_key) == 3                                  # one shared start per prefix ...
    own = [a.prefix_blocks[4096 // BLOCK_TOKENS:] for a in shared]
    assert len(set(own)) == len(own)                         # ... then blocks of each request's own
    turns = build_workload("multi-turn", {"duration": 5.0, "rate": 1.0, "turns": 3}, seed=2).arrivals
    first = min(turns, key=lambda a: a.at)
    mine = sorted((a for a in turns if a.prefix_blocks[0] == first.prefix_blocks[0]), key=lambda a: a.at)
    assert len(mine) == 3
    for before, after in zip(mine, mine[1:]):                # each turn extends the one before
        assert after.prefix_blocks[:len(before.prefix_blocks)] == before.prefix_blocks
        assert len(after.prefix_blocks) > len(before.prefix_blocks)


def test_prefix_routing_keeps_most_of_a_mooncake_traces_reuse_and_beats_least_loaded():
    """Between 4 continuous engines, on a Mooncake-format trace (docs/research/routing.md has the 12,000-request
    run): ``prefix`` routing's cached share is at least 70% of an infinite cache's, its mean TTFT below
    ``least-loaded``'s."""
    from apsd.sim.research.trace_routing import REUSE_TARGET, run_trace_routing, trace_routing_markdown

    result = run_trace_routing(requests=2000, policies=("least-loaded", "prefix"))
    prefix, least = result.row("prefix"), result.row("least-loaded")
    assert prefix.completed == prefix.requests == 2000
    assert 0.5 < result.infinite_share < 0.9
    assert prefix.cached_share >= REUSE_TARGET * result.infinite_share
    assert prefix.cached_share > least.cached_share
    assert prefix.ttft_mean_ms < least.ttft_mean_ms
    assert "the claim holds" in trace_routing_markdown(result)
