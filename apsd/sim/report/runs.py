"""Reading a :class:`~apsd.sim.records.PolicyRun`: its requests by outcome and tenant, their times,
and what identifies its workload. Shared by the figures, the plots and the Markdown."""

from __future__ import annotations

import collections
import json
from collections.abc import Iterable

from apsd.sim.records import PolicyRun, RequestRecord
from apsd.sim.report.summary import plain

__all__ = ["by_tenant", "completed", "engine_count", "latencies", "queue_waits", "tenant_names", "tenant_weight",
           "tpots", "ttfts", "workload_key"]


def completed(requests: Iterable[RequestRecord]) -> list[RequestRecord]:
    return [r for r in requests if r.outcome == "completed"]


def queue_waits(requests: Iterable[RequestRecord]) -> list[float]:
    return [r.queue_wait for r in requests if r.queue_wait is not None]


def latencies(requests: Iterable[RequestRecord]) -> list[float]:
    return [r.latency for r in requests if r.latency is not None]


def ttfts(requests: Iterable[RequestRecord]) -> list[float]:
    return [r.ttft for r in requests if r.ttft is not None]


def tpots(requests: Iterable[RequestRecord]) -> list[float]:
    return [r.tpot for r in requests if r.tpot is not None]


def engine_count(run: PolicyRun) -> int:
    """What busy time is measured against: engines (an engine of ``tp`` GPUs counts once), or the
    forward engine's backends; runs recorded without engine records count one per GPU, as the
    ``batch`` engine has."""
    backends = run.engine.get("backends")
    if backends:
        return len(backends)
    return len(run.engines) or run.gpus


def tenant_names(run: PolicyRun) -> list[str]:
    """Every tenant that sent a request or is configured, sorted."""
    return sorted({r.tenant for r in run.requests} | set(run.workload.tenants))


def by_tenant(run: PolicyRun) -> dict[str, list[RequestRecord]]:
    grouped: dict[str, list[RequestRecord]] = collections.defaultdict(list)
    for r in run.requests:
        grouped[r.tenant].append(r)
    return grouped


def tenant_weight(run: PolicyRun, tenant: str) -> float:
    config = run.workload.tenants.get(tenant)
    return 1.0 if config is None else config.weight


def workload_key(run: PolicyRun) -> tuple[str, int, str, int]:
    """Equal for runs of the same generated workload: name, seed, parameters and arrivals."""
    wl = run.workload
    return (wl.name, wl.seed, json.dumps(plain(wl.params), sort_keys=True), len(wl.arrivals))
