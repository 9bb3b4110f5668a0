"""What the research suite runs: its policies, workloads and engines, and where their reports go."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from apsd.core.config import Config
from apsd.core.policy import PolicyRegistry
from apsd.plugins import DEFAULT_PLUGINS
from apsd.sim.runner import PolicyChoice

__all__ = ["ALONE", "BATCH", "CONTINUOUS", "CONTINUOUS_ENGINE", "ENGINES", "GOVERNOR_WORKLOADS", "ISOLATION_SCALED",
           "ISOLATION_WORKLOADS", "NOISY", "POLICIES", "SCALED", "WORKLOADS", "ZERO_WINDOW", "ScaledWorkload",
           "continuous_names", "engine_configs", "isolation_names", "noisy_name", "plugin_presets", "report_dir",
           "scaled"]

#: The suite's two engines, named by the kind each runs: the default ``batch`` engine (a simulated
#: GPU running whole batches, ``[gpu]``), and the continuous engine of :data:`CONTINUOUS_ENGINE`.
BATCH = "batch"
CONTINUOUS = "continuous"
ENGINES = (BATCH, CONTINUOUS)

#: Compared on every workload: FIFO, static priority, APS with the entropy governor, APS with a
#: fixed window (to isolate the governor), and the weighted fair share between tenants (the default
#: preset). The installed plugins' presets follow them.
POLICIES = ("fifo", "static", "aps", "aps:governor=fixed", "fair")

#: The design documents' scenarios, with the built-in workloads' default parameters.
WORKLOADS = ("seed-stress", "burst-50", "vip-flood", "periodic", "bursty", "head-of-line", "vtc-overload")

#: The second engine (``[engine]``): one A100-80GB serving Llama-3-8B, batching at the iteration level.
CONTINUOUS_ENGINE: dict[str, Any] = {"kind": CONTINUOUS, "gpu": "a100-80gb", "model": "llama-3-8b", "tp": 1,
                                     "count": 1}

#: Tenant isolation: a noisy neighbour and VTC's experiments (Sheng et al., OSDI '24, §5), on the
#: batch engine with the built-in defaults, on the continuous engine as :data:`ISOLATION_SCALED`.
ISOLATION_WORKLOADS = ("noisy-neighbor", "proportional", "on-off", "increase", "dist-shift")

#: The workload whose steady tenant research.md compares with and without its neighbour, and the
#: parameter that removes the neighbour (its "alone" run).
NOISY = "noisy-neighbor"
ALONE = {"neighbor_rate": 0.0}

#: The workloads the governor claim is checked on (two regular, two irregular arrival patterns).
GOVERNOR_WORKLOADS = ("periodic", "bursty", "burst-50", "seed-stress")


@attrs.frozen
class ScaledWorkload:
    """A built-in workload with some parameters scaled, run on the continuous engine only."""

    #: Its name in the report and its directory: the workload's name and the factor.
    name: str
    workload: str
    params: dict[str, Any]
    #: Why, in a few words (research.md prints it beside the measured load).
    why: str

    def described(self) -> str:
        """"`name`: `workload` with `k=v`, ... (why)"."""
        return (f"`{self.name}`: `{self.workload}` with " + ", ".join(f"`{k}={v:g}`" for k, v in self.params.items())
                + f" ({self.why})")


#: The design's workloads were sized for the batch engine's GPU, which serves a few hundred tokens per
#: second; the continuous engine serves thousands, so the two overload scenarios are re-run with their
#: rates scaled until they overload it again. The built-in defaults stay as they are.
SCALED = (
    ScaledWorkload("vip-flood-x16", "vip-flood", {"vip_rate": 80.0},
                   "the VIP's rate ×16, 5 → 80 req/s, with the free tenant's trickle unchanged: starvation"),
    ScaledWorkload("vtc-overload-x8", "vtc-overload", {"rate_a": 12.0, "rate_b": 24.0, "duration": 120.0},
                   "both rates ×8, 1.5 → 12 and 3 → 24 req/s, over 120 s instead of 600 s so that no "
                   "tenant's queue reaches `max_requests_per_tenant`: both tenants above their fair share"),
)

#: The isolation workloads on the continuous engine: rates scaled until they overload it (it serves about
#: 18 req/s of 256/256-token requests and 54 req/s of 64/128), over durations short enough that no tenant's
#: queue reaches `max_requests_per_tenant` (2,000) under FIFO.
ISOLATION_SCALED = (
    ScaledWorkload("noisy-neighbor-x10", "noisy-neighbor", {"steady_rate": 5.0, "neighbor_rate": 100.0,
                                                            "duration": 20.0},
                   "both rates ×10, 0.5 → 5 and 10 → 100 req/s, about twice what the engine serves, over 20 s "
                   "instead of 120 s"),
    ScaledWorkload("proportional-x16", "proportional", {"rate": 8.0, "duration": 30.0},
                   "the rates ×16, 0.5, 1 and 1.5 → 8, 16 and 24 req/s, over 30 s instead of 120 s"),
    ScaledWorkload("on-off-x8", "on-off", {"steady_rate": 24.0, "on_rate": 16.0, "period_s": 10.0,
                                           "duration": 60.0},
                   "both rates ×8, 3 → 24 and 2 → 16 req/s, in 10 s periods over 60 s instead of 60 s "
                   "periods over 600 s"),
    ScaledWorkload("increase-x16", "increase", {"constant_rate": 8.0, "start_rate": 3.2, "end_rate": 32.0,
                                                "duration": 60.0},
                   "the rates ×16, 0.5 → 8 and a ramp from 3.2 to 32 req/s, over 60 s instead of 600 s"),
    ScaledWorkload("dist-shift-x16", "dist-shift", {"rate_a": 16.0, "rate_b": 16.0, "duration": 60.0,
                                                    "shift_at": 30.0},
                   "both rates ×16, 1 → 16 req/s, over 60 s instead of 120 s, swapped at 30 s"),
)

#: The control for the governor: APS with a fixed window of 0 ms (``[policy.fixed] window_ms = 0``),
#: run on :data:`GOVERNOR_WORKLOADS` on both engines for research.md's governor paragraph only.
ZERO_WINDOW = PolicyChoice(label="aps+fixed 0 ms", preset="aps", overrides={"governor": "fixed"})


def report_dir(engine: str, name: str) -> Path:
    """Where a workload's report goes under ``<out>``: ``research/<workload>`` on the batch engine
    (as before the continuous engine existed), ``research/continuous/<workload>`` on the continuous
    engine (scaled variants included, under their own names)."""
    return Path("research", name) if engine == BATCH else Path("research", engine, name)


def plugin_presets(registry: PolicyRegistry) -> tuple[str, ...]:
    """The presets registered by plugins other than the built-ins, by plugin name, then preset name.

    The order depends only on the names, never on installation or registration order.
    """
    return tuple(p.name for p in sorted(registry.presets.values(), key=lambda p: (p.plugin, p.name))
                 if p.plugin not in DEFAULT_PLUGINS)


def engine_configs(config: Config) -> dict[str, Config]:
    """``config`` on one batch engine, and on the continuous engine of :data:`CONTINUOUS_ENGINE`."""
    batch = attrs.evolve(config, engine=attrs.evolve(config.engine, kind=BATCH, count=1))
    continuous = attrs.evolve(config, engine=attrs.evolve(config.engine, **CONTINUOUS_ENGINE))
    return {BATCH: batch, CONTINUOUS: continuous}


def continuous_names() -> list[str]:
    """The continuous engine's comparison workloads: the design's, then their scaled variants."""
    return [*WORKLOADS, *(s.name for s in SCALED)]


def isolation_names(engine: str) -> list[str]:
    """The isolation workloads' report names on ``engine``: the built-ins, or their scaled variants."""
    return list(ISOLATION_WORKLOADS) if engine == BATCH else [s.name for s in ISOLATION_SCALED]


def noisy_name(engine: str) -> str:
    """:data:`NOISY`'s report name on ``engine``."""
    return next(name for name in isolation_names(engine) if name.startswith(NOISY))


def scaled(name: str) -> ScaledWorkload | None:
    """The scaled variant called ``name`` (None: a built-in's name)."""
    return next((s for s in (*SCALED, *ISOLATION_SCALED) if s.name == name), None)
