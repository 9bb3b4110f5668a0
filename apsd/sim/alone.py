"""Each tenant of a workload alone: the same arrivals of that tenant with nobody else, under the same
policy and engine. ``apsd simulate`` compares every tenant's run beside the others with its run alone
(the isolation table that leads its summary and report)."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pluggy

from apsd.core.config import Config
from apsd.sim.records import PolicyRun, Workload
from apsd.sim.runner import PolicyChoice, run_policy

__all__ = ["MAX_TENANTS_ALONE", "alone_runs", "tenant_alone"]

#: Workloads with more tenants are not compared with their tenants alone (one run each).
MAX_TENANTS_ALONE = 8


def tenant_alone(workload: Workload, tenant: str) -> Workload:
    """``workload`` with only ``tenant``'s arrivals."""
    return attrs.evolve(workload, name=f"{workload.name} ({tenant} alone)",
                        arrivals=tuple(a for a in workload.arrivals if a.tenant == tenant))


def alone_runs(workload: Workload, choice: PolicyChoice, *, base_config: Config | None = None,
               plugin_manager: pluggy.PluginManager | None = None,
               progress: Callable[[int], None] | None = None) -> dict[str, PolicyRun] | None:
    """Tenant -> its run alone under ``choice``; None for a single tenant or more than
    :data:`MAX_TENANTS_ALONE`."""
    tenants = sorted({a.tenant for a in workload.arrivals})
    if not 1 < len(tenants) <= MAX_TENANTS_ALONE:
        return None
    return {tenant: run_policy(tenant_alone(workload, tenant), choice, base_config=base_config,
                               plugin_manager=plugin_manager, progress=progress)
            for tenant in tenants}
