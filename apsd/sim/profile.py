"""``apsd profile``: what one continuous engine does with a batch of identical requests.

Ownership: :func:`profile_deployment` runs ``batch`` requests of ``prompt_tokens`` +
``output_tokens``, all arriving at model time 0, through the daemon's own pipeline (admission,
scheduler, one ``continuous`` engine) in virtual time, and measures them. The queue dispatches
at once (``fifo`` order, a ``fixed`` window of 0 ms) and the tenant is never rate-limited, so
the figures are the engine's alone.

Figures (:class:`ProfileResult`), in model time:

* ``ttft_ms`` — mean time from arrival to the first token;
* ``tpot_ms`` — mean time per output token after the first (a request's last token time minus
  its first, over ``output_tokens - 1``; 0 when ``output_tokens`` is 1);
* ``output_tokens_per_s`` — ``batch * output_tokens`` over the makespan (arrival to last token);
* ``kv_capacity_tokens`` — the deployment's KV cache, in tokens;
* ``mfu``, ``mbu`` — model FLOPs and bytes read over the engine's busy time, against the peaks.
"""

from __future__ import annotations

import attrs
import trio
import trio.testing

from apsd.core.config import Config, EngineConfig, TenantConfig, parse_config
from apsd.core.models import Completion
from apsd.engines import deployment_for
from apsd.engines.profiles import ProfileRegistry
from apsd.pipeline import open_pipeline
from apsd.plugins import load_policy_registry, load_profile_registry, make_plugin_manager

__all__ = ["ProfileResult", "profile_deployment"]


@attrs.frozen
class ProfileResult:
    ttft_ms: float
    tpot_ms: float
    output_tokens_per_s: float
    kv_capacity_tokens: int
    mfu: float
    mbu: float


def profile_config(gpu: str, model: str, tp: int, batch: int, max_batched_tokens: int = 8192) -> Config:
    """The config a profile runs with: one continuous engine, dispatch at once, no rate limit."""
    config = parse_config({"policy": {"preset": "fifo", "fixed": {"window_ms": 0.0}}}, "<apsd profile>")
    return attrs.evolve(config, engine=EngineConfig(kind="continuous", count=1, gpu=gpu, model=model, tp=tp,
                                                    max_sequences=max(256, batch),
                                                    max_batched_tokens=max_batched_tokens),
                        tenants={"profile": TenantConfig(rate=1e12, burst=10**12)})


def profile_deployment(gpu: str, model: str, *, tp: int = 1, batch: int, prompt_tokens: int, output_tokens: int,
                       max_batched_tokens: int = 8192, profiles: ProfileRegistry | None = None) -> ProfileResult:
    """Run the batch (see the module docstring); ConfigError for unknown profiles, a model that does
    not fit, or requests the deployment could never hold."""
    pm = make_plugin_manager()
    profiles = profiles or load_profile_registry(pm)
    config = profile_config(gpu, model, tp, batch, max_batched_tokens)
    deployment_for(config, profiles)  # (unknown names and a model that does not fit: a ConfigError now)
    policies = load_policy_registry(pm).build(config)

    async def run() -> ProfileResult:
        async with open_pipeline(config, policies, profiles=profiles) as pipeline:
            requests = [pipeline.new_request(tenant_id="profile", prompt="", tokens_requested=output_tokens,
                                             priority_bid=5, prompt_tokens=prompt_tokens) for _ in range(batch)]
            for request in requests:
                pipeline.admit_now(request)
            outcomes = [await request.reply.wait() for request in requests]
            [engine] = pipeline.engines
            statistics = engine.statistics()
        done: list[tuple[float, float, float]] = []  # (arrival, first token, last token) of each request
        for request, outcome in zip(requests, outcomes):
            if not isinstance(outcome, Completion):
                raise ValueError(f"{outcome.error}: {outcome.message}")
            assert request.started_at is not None and request.finished_at is not None  # (it completed)
            done.append((request.arrival, request.started_at, request.finished_at))
        makespan = max(end for _, _, end in done)
        tpots = [(end - first) / (output_tokens - 1) for _, first, end in done] if output_tokens > 1 else [0.0]
        return ProfileResult(
            ttft_ms=sum(first - arrival for arrival, first, _ in done) / batch * 1000.0,
            tpot_ms=sum(tpots) / len(tpots) * 1000.0,
            output_tokens_per_s=batch * output_tokens / makespan,
            kv_capacity_tokens=statistics.kv_tokens_capacity,
            mfu=statistics.mfu or 0.0,
            mbu=statistics.mbu or 0.0,
        )

    return trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
