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
from apsd.core.models import Completion, InferenceRequest, Refusal
from apsd.pipeline import Pipeline, open_pipeline
from apsd.plugins import load_policy_registry, make_plugin_manager
from apsd.sim.records import Arrival, RequestRecord, Workload
from apsd.sim.runner import RPM_LIMITED, PolicyChoice, record_of, seeded_trio_scheduler, simulation_config
from apsd.store.simulated import SimulatedSharedState, simulated_store

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
    #: What happened to each arrival, in arrival order (``engine_id``: the replica's engine).
    requests: tuple[RequestRecord, ...] = ()
    #: Model seconds to the last outcome.
    finished_s: float = 0.0
    #: The replica each arrival went to, in arrival order.
    placed: tuple[int, ...] = ()


def run_replicas(workload: Workload, choice: PolicyChoice, *, replicas: int, sync_interval_s: float,
                 delay_s: float = 0.0, base_config: Config | None = None,
                 tenants: Mapping[str, Any] | None = None,
                 placement: Mapping[str, Sequence[float]] | None = None,
                 plugin_manager: Any = None, door: Callable[[Arrival], str | None] | None = None) -> ReplicaRun:
    """Run ``workload`` through ``replicas`` pipelines sharing one simulated store; ``tenants``
    (name -> :class:`~apsd.core.config.TenantConfig`) replaces the workload's unthrottled buckets.
    ``plugin_manager``: the daemon's by default. ``door``: as :func:`~apsd.sim.runner.run_policy`'s, in front of
    every replica (one limit for all, as a shared store would keep it)."""
    config = simulation_config(base_config or Config(), workload, choice)
    if tenants is not None:
        config = attrs.evolve(config, tenants=dict(tenants))
    config = attrs.evolve(config, store=attrs.evolve(config.store, sync_interval_s=sync_interval_s))
    with seeded_trio_scheduler(workload.seed):
        requests, placed, finished = trio.run(_drive, workload, config, replicas, delay_s,
                                              _placer(placement, replicas), plugin_manager or make_plugin_manager(),
                                              door, clock=trio.testing.MockClock(autojump_threshold=0))
    duration = workload.arrivals[-1].at - workload.arrivals[0].at if workload.arrivals else 0.0
    return ReplicaRun(replicas=replicas, sync_interval_s=sync_interval_s, delay_s=delay_s, duration_s=duration,
                      tenants=tuple(_share(name, t, requests) for name, t in sorted(config.tenants.items())),
                      requests=tuple(record_of(a.at, r) for a, r in zip(workload.arrivals, requests)),
                      finished_s=finished, placed=tuple(placed))


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
                 place: Callable[[str, int], int], pm: Any, door: Callable[[Arrival], str | None] | None
                 ) -> tuple[list[InferenceRequest], list[int], float]:
    shared = SimulatedSharedState(delay_s)
    requests: list[InferenceRequest] = []
    placed: list[int] = []
    async with _pipelines(config, replicas, shared, pm) as pipelines:
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        for n, arrival in enumerate(workload.arrivals):
            await trio.sleep_until(start + arrival.at)
            replica = place(arrival.tenant, n)
            pipeline = pipelines[replica]
            request = pipeline.new_request(tenant_id=arrival.tenant, prompt="", tokens_requested=arrival.output_tokens,
                                           priority_bid=arrival.bid, prompt_tokens=arrival.prompt_tokens,
                                           prefix_blocks=arrival.prefix_blocks, service_class=arrival.service_class,
                                           prefix_block_tokens=arrival.prefix_block_tokens)
            refused = door(arrival) if door is not None else None
            if refused is not None:
                request.reply.resolve(Refusal(429, RPM_LIMITED, refused))
            else:
                pipeline.admit_now(request)
            requests.append(request)
            placed.append(replica)
        for pipeline in pipelines:
            await pipeline.ledger.wait_idle()
        finished = trio.current_time() - start
    return requests, placed, finished


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
