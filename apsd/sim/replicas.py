"""Several replicas in one virtual-time run, sharing tenants' buckets and fair share.

:func:`run_replicas` runs ``replicas`` pipelines (each with its own engines and policies, as
separate apsd processes would have) whose stores are
:class:`~apsd.store.leasing.LeasingStore` fronts over one
:class:`~apsd.store.simulated.SimulatedSharedState`: the daemon's own leasing code, with every
exchange taking ``delay_s`` and happening every ``[store] sync_interval_s``. Arrivals go to the
replicas round robin, or as ``placement`` says (tenant -> weights per replica, for skewed traffic).
The result says, per tenant, what was offered, admitted and served, against what its bucket grants
(``burst + rate * duration``), so that sync periods can be compared on one workload
(``apsd simulate --replicas``).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import numpy as np
import trio
import trio.testing

from apsd.core.config import Config
from apsd.core.models import Completion, InferenceRequest
from apsd.pipeline import Pipeline, open_pipeline
from apsd.plugins import load_policy_registry, make_plugin_manager
from apsd.store.simulated import SimulatedSharedState, simulated_store
from apsd.sim.records import Workload
from apsd.sim.runner import PolicyChoice, simulation_config

__all__ = ["ReplicaRun", "TenantShare", "run_replicas"]


@attrs.frozen
class TenantShare:
    tenant: str
    rate: float
    burst: float
    offered_tokens: int
    admitted_tokens: int
    served_tokens: int
    #: p99 of arrival to last token of its completed requests, model seconds (None: none completed).
    latency_p99_s: float | None

    def bound(self, duration: float) -> float:
        """What its bucket grants over ``duration``: ``burst + rate * duration``."""
        return self.burst + self.rate * duration


@attrs.frozen
class ReplicaRun:
    replicas: int
    sync_interval_s: float
    delay_s: float
    #: Model seconds from the first arrival to the last.
    duration_s: float
    tenants: tuple[TenantShare, ...]


def run_replicas(workload: Workload, choice: PolicyChoice, *, replicas: int, sync_interval_s: float,
                 delay_s: float = 0.0, base_config: Config | None = None,
                 tenants: Mapping[str, Any] | None = None,
                 placement: Mapping[str, Sequence[float]] | None = None) -> ReplicaRun:
    """Run ``workload`` through ``replicas`` pipelines sharing one simulated store; ``tenants``
    (name -> :class:`~apsd.core.config.TenantConfig`) replaces the workload's unthrottled buckets."""
    config = simulation_config(base_config or Config(), workload, choice)
    if tenants is not None:
        config = attrs.evolve(config, tenants=dict(tenants))
    config = attrs.evolve(config, store=attrs.evolve(config.store, sync_interval_s=sync_interval_s))
    requests = trio.run(_drive, workload, config, replicas, delay_s, _placer(placement, replicas),
                        clock=trio.testing.MockClock(autojump_threshold=0))
    duration = workload.arrivals[-1].at - workload.arrivals[0].at if workload.arrivals else 0.0
    return ReplicaRun(replicas=replicas, sync_interval_s=sync_interval_s, delay_s=delay_s, duration_s=duration,
                      tenants=tuple(_share(name, t, requests) for name, t in sorted(config.tenants.items())))


def _placer(placement: Mapping[str, Sequence[float]] | None, replicas: int) -> Callable[[str, int], int]:
    if not placement:
        return lambda tenant, n: n % replicas
    cycles = {}
    for tenant, weights in placement.items():  # a deterministic spread in the given proportions
        total = sum(weights)
        slots = [r for r, w in enumerate(weights) for _ in range(round(100 * w / total))]
        cycles[tenant] = itertools.cycle(slots)
    return lambda tenant, n: next(cycles[tenant]) if tenant in cycles else n % replicas


async def _drive(workload: Workload, config: Config, replicas: int, delay_s: float,
                 place: Callable[[str, int], int]) -> list[InferenceRequest]:
    shared = SimulatedSharedState(delay_s)
    pm = make_plugin_manager()
    requests: list[InferenceRequest] = []
    async with _pipelines(config, replicas, shared, pm) as pipelines:
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        for n, arrival in enumerate(workload.arrivals):
            await trio.sleep_until(start + arrival.at)
            pipeline = pipelines[place(arrival.tenant, n)]
            request = pipeline.new_request(tenant_id=arrival.tenant, prompt="", tokens_requested=arrival.output_tokens,
                                           priority_bid=arrival.bid, prompt_tokens=arrival.prompt_tokens)
            pipeline.admit_now(request)
            requests.append(request)
        for pipeline in pipelines:
            await pipeline.ledger.wait_idle()
    return requests


@asynccontextmanager
async def _pipelines(config: Config, count: int, shared: SimulatedSharedState, pm: Any) -> AsyncIterator[list[Pipeline]]:
    """Open ``count`` pipelines, each with its own policies and a store over ``shared``."""
    registry = load_policy_registry(pm)
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(open_pipeline(
                   config, registry.build(config), request_id_prefix=f"r{replica}",
                   store=simulated_store(config.store, shared, replica)))
               for replica in range(count)]


def _share(name: str, tenant: Any, requests: Sequence[InferenceRequest]) -> TenantShare:
    mine = [r for r in requests if r.tenant_id == name]
    admitted = [r for r in mine if r.reserved_tokens]
    completed = [r for r in mine if isinstance(r.reply.outcome, Completion)]
    latencies = [r.finished_at - r.arrival for r in completed if r.finished_at is not None]
    return TenantShare(tenant=name, rate=tenant.rate, burst=float(tenant.burst),
                       offered_tokens=sum(r.cost_tokens for r in mine),
                       admitted_tokens=sum(r.cost_tokens for r in admitted),
                       served_tokens=sum(r.prompt_tokens + r.tokens_generated for r in completed),
                       latency_p99_s=float(np.percentile(latencies, 99)) if latencies else None)
