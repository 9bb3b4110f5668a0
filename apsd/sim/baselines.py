"""Baselines the benchmark table compares apsd against: other schedulers' rules, for the simulator only.

These are not policies of the daemon (nothing registers them there); ``apsd research --table``
registers them on its own plugin manager (:func:`baseline_plugin_manager`) and labels them baselines.

* ``lcf``, **least counter first** (VTC's baseline, Sheng et al., OSDI '24, §5): fair share's counters
  (:class:`~apsd.policies.fair.FairShareQueue`), first come first served inside a tenant, but no counter
  is lifted when a tenant comes back from idle: an idle tenant banks credit, and on its return it is
  served alone until the others' counters catch up.
* a **per-tenant requests-per-minute limit** (:class:`RequestsPerMinute`), what LiteLLM's proxy does with
  ``rpm_limit``: a tenant's requests beyond its limit within a minute (fixed windows, as LiteLLM counts
  per minute) are refused at the door (429 ``rpm_limited``), the rest served first come first served.
  The simulator's driver applies it before admission (``run_policy(..., door=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import pluggy

from apsd.core.hookspecs import hookimpl
from apsd.plugins import make_plugin_manager
from apsd.policies.fair import FairShareQueue, tenant_weights
from apsd.sim.records import Arrival
from apsd.sim.runner import RPM_LIMITED

__all__ = ["LEAST_COUNTER_FIRST", "LeastCounterFirst", "RPM_LIMITED", "RequestsPerMinute",
           "baseline_plugin_manager", "fair_rpm_limits"]

#: The preset (and aging policy) name of least counter first.
LEAST_COUNTER_FIRST = "lcf"


class LeastCounterFirst(FairShareQueue):
    """Fair share's counters without the lift of a returning tenant (see the module docstring)."""

    def _floor(self) -> float:
        return -math.inf   # (a tenant becoming backlogged keeps its counter, however far behind)


class _Baselines:
    @hookimpl
    def register_policies(self, registry: Any) -> None:
        registry.aging(LEAST_COUNTER_FIRST, lambda params, config: LeastCounterFirst(weights=tenant_weights(config)),
                       "least counter first (VTC's baseline): fair share's counters, no lift for a returning tenant")
        registry.preset(LEAST_COUNTER_FIRST, aging=LEAST_COUNTER_FIRST, governor="fixed", batching="micro")


def baseline_plugin_manager() -> pluggy.PluginManager:
    """The built-in policies (no installed plugins) and the baselines' preset ``lcf``."""
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(_Baselines(), name="apsd.sim.baselines")
    return pm


@attrs.define
class RequestsPerMinute:
    """A per-tenant limit of requests per fixed minute (``limits``: tenant -> requests; a tenant not
    named has none). Call it with each arrival in order: the reason it is refused, or None."""

    limits: Mapping[str, int]
    window_s: float = 60.0
    _counts: dict[tuple[str, int], int] = attrs.field(factory=dict, init=False)

    def __call__(self, arrival: Arrival) -> str | None:
        limit = self.limits.get(arrival.tenant)
        if limit is None:
            return None
        window = int(arrival.at // self.window_s)
        key = (arrival.tenant, window)
        if self._counts.get(key, 0) >= limit:
            return (f"tenant {arrival.tenant!r} sent {limit} requests this minute, its limit "
                    f"(a requests-per-minute baseline)")
        self._counts[key] = self._counts.get(key, 0) + 1
        return None


def fair_rpm_limits(tenants: Mapping[str, Any], requests_per_s: float) -> dict[str, int]:
    """Each tenant's share (by weight) of ``requests_per_s`` as a per-minute limit (at least 1)."""
    weights = {name: getattr(tenant, "weight", 1.0) for name, tenant in tenants.items()}
    total = sum(weights.values()) or 1.0
    return {name: max(1, round(requests_per_s * 60.0 * w / total)) for name, w in weights.items()}
