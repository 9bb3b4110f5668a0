"""What the benchmark table (``apsd research --table``) runs: its rows (schedulers) and its workloads.

Rows (:data:`ROWS`), each a scheduler an operator could put in front of shared GPUs:

* **FCFS** (``fifo``): first come first served, the default of most servers and gateways.
* **static priority** (``static``): the highest bid first.
* **RPM limit** (a baseline, :mod:`apsd.sim.baselines`): FCFS behind a per-tenant requests-per-minute
  limit, what LiteLLM's proxy offers (``rpm_limit``); each tenant's limit its share (by weight) of the
  requests the engines complete per minute under FCFS on the same workload.
* **LCF** (a baseline, ``lcf``): least counter first, VTC's baseline: fair share's counters without
  the lift of a returning tenant.
* **fair** (``fair``): apsd's default, VTC's fair share between tenants.
* **fair + prefix routing**: the same with ``[routing] policy = "prefix"`` (every other row routes
  ``least-loaded``); it differs only where there are several engines and prompts share prefixes.
* **fair + classes**: the same with the workload's service classes configured (every other row runs the
  same arrivals without classes, and is measured against the classes they would have had); it differs
  only where the workload has classes.

Workloads (:data:`WORKLOADS`): VTC's published suites (overload, proportional, on/off, increase,
distribution shift) at the rates the research suite scales them to on one continuous engine; QLM's
interactive + batch mix; a population of shared prefixes on two engines; a Mooncake-format trace on two
engines (generated: :mod:`apsd.sim.traces.synthetic`); and two replicas with tenants weighted 4:1 whose
traffic enters skewed (the case NVIDIA Dynamo's users reported: a 4:1 premium:regular policy that holds
behind one router, and gives about 1:1 behind two with a premium tenant mostly on one and a regular one
mostly on the other).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import attrs
import numpy as np
from numpy.typing import NDArray

from apsd.core.config import ServiceClassConfig, TenantConfig
from apsd.sim.records import Arrival, Workload
from apsd.sim.traces import load_trace
from apsd.sim.traces.synthetic import MooncakeShape, write_mooncake_trace
from apsd.sim.workloads import UNTHROTTLED, build_workload

__all__ = ["ROWS", "WORKLOADS", "TableRow", "TableWorkload", "row"]


@attrs.frozen
class TableRow:
    """One scheduler of the table."""

    label: str
    preset: str
    routing: str = "least-loaded"
    #: FCFS behind a requests-per-minute limit per tenant.
    rpm_limit: bool = False
    #: The workload's service classes configured (else: none, and measured against them).
    classes: bool = False
    #: Not one of apsd's policies: a baseline the simulator implements to compare with.
    baseline: bool = False


ROWS = (
    TableRow("FCFS", "fifo"),
    TableRow("static priority", "static"),
    TableRow("RPM limit (LiteLLM-style, baseline)", "fifo", rpm_limit=True, baseline=True),
    TableRow("LCF (VTC's baseline)", "lcf", baseline=True),
    TableRow("fair (VTC)", "fair"),
    TableRow("fair + prefix routing", "fair", routing="prefix"),
    TableRow("fair + classes", "fair", classes=True),
)


def row(label: str) -> TableRow:
    return next(r for r in ROWS if r.label == label)


@attrs.frozen
class TableWorkload:
    """One workload of the table and the engines it runs on."""

    name: str
    description: str
    #: The workload from a seed.
    build: Callable[[int], Workload]
    engines: int = 1
    model: str = "llama-3-8b"
    classes: dict[str, ServiceClassConfig] = attrs.field(factory=dict)
    #: Two replicas or more: tenant -> the share of its arrivals each replica gets (None: one apsd).
    placement: dict[str, tuple[float, ...]] | None = None


def _builtin(name: str, **params: float) -> Callable[[int], Workload]:
    return lambda seed: build_workload(name, params, seed=seed)


def _tenants(names: tuple[str, ...], weights: dict[str, float] | None = None,
             classes: tuple[str, ...] = ()) -> dict[str, TenantConfig]:
    weights = weights or {}
    return {name: TenantConfig(rate=UNTHROTTLED.rate, burst=UNTHROTTLED.burst, weight=weights.get(name, 1.0),
                               classes=classes) for name in names}


def _poisson(rng: np.random.Generator, rate: float, duration: float) -> NDArray[np.float64]:
    return np.sort(rng.uniform(0.0, duration, rng.poisson(rate * duration)))


#: QLM's two kinds of request on one pool: interactive chat with a tight first-token target, batch jobs
#: with a loose one (QLM, arXiv 2407.00047).
QLM_CLASSES = {"interactive": ServiceClassConfig(ttft_s=1.0),
               "batch": ServiceClassConfig(ttft_s=60.0, on_miss="best_effort")}


def qlm_mix(seed: int, duration: float = 60.0) -> Workload:
    """``chat``: interactive requests (512 in / 128 out, bid 8) at 4 req/s; ``jobs``: batch requests
    (1,024 in / 256 out, bid 2) at 16 req/s, together about twice what one engine completes."""
    rng = np.random.default_rng(seed)
    arrivals = [Arrival(at=float(t), tenant="chat", prompt_tokens=512, output_tokens=128, bid=8,
                        service_class="interactive") for t in _poisson(rng, 4.0, duration)]
    arrivals += [Arrival(at=float(t), tenant="jobs", prompt_tokens=1024, output_tokens=256, bid=2,
                         service_class="batch") for t in _poisson(rng, 16.0, duration)]
    return Workload(name="interactive-batch", description="QLM's mix: interactive chat beside batch jobs",
                    arrivals=tuple(sorted(arrivals, key=lambda a: a.at)),
                    tenants=_tenants(("chat", "jobs"), classes=tuple(QLM_CLASSES)),
                    params={"duration": duration, "chat_rate": 4.0, "jobs_rate": 16.0}, seed=seed)


def mooncake_trace(seed: int, requests: int = 1500, speed: float = 1.0) -> Workload:
    """A generated Mooncake-format trace of ``requests`` requests (:mod:`apsd.sim.traces.synthetic`), read
    back as a trace, split between three tenants by Zipf weights (a heavy one and two lighter ones)."""
    with tempfile.TemporaryDirectory(prefix="apsd-table-") as directory:
        path = write_mooncake_trace(Path(directory) / "mooncake-shaped.jsonl",
                                    MooncakeShape(requests=requests, rate=speed * MooncakeShape().rate), seed=seed)
        workload = load_trace(path, tenants="zipf:3", seed=seed)
    return attrs.evolve(workload, description=f"a generated Mooncake-format trace of {requests:,} requests, "
                        "tenants by zipf:3", params={"requests": requests, "tenants": "zipf:3"})


def skewed_replicas(seed: int, duration: float = 30.0) -> Workload:
    """``premium`` (weight 4, bid 8) and ``regular`` (weight 1, bid 2), each flooding at 60 req/s of
    256 in / 256 out (together about 3 times what the two replicas' engines complete)."""
    rng = np.random.default_rng(seed)
    arrivals = [Arrival(at=float(t), tenant=tenant, prompt_tokens=256, output_tokens=256, bid=bid)
                for tenant, bid in (("premium", 8), ("regular", 2)) for t in _poisson(rng, 60.0, duration)]
    return Workload(name="replicas-4-to-1", description="premium and regular tenants weighted 4:1, both flooding",
                    arrivals=tuple(sorted(arrivals, key=lambda a: a.at)),
                    tenants=_tenants(("premium", "regular"), {"premium": 4.0, "regular": 1.0}),
                    params={"duration": duration, "rate": 60.0}, seed=seed)


WORKLOADS = (
    TableWorkload("vtc-overload", "VTC's overload: two tenants at 12 and 24 req/s, 256 in / 256 out, 60 s",
                  _builtin("vtc-overload", rate_a=12.0, rate_b=24.0, duration=60.0)),
    TableWorkload("proportional", "VTC's proportional: three tenants at 8, 16 and 24 req/s, 256 / 256, 30 s",
                  _builtin("proportional", rate=8.0, duration=30.0)),
    TableWorkload("on-off", "VTC's on/off: a steady tenant at 24 req/s, one at 16 req/s on for 10 s, off for 10 s, 60 s",
                  _builtin("on-off", steady_rate=24.0, on_rate=16.0, period_s=10.0, duration=60.0)),
    TableWorkload("increase", "VTC's increase: a tenant at 8 req/s beside one ramping from 3.2 to 32 req/s, 60 s",
                  _builtin("increase", constant_rate=8.0, start_rate=3.2, end_rate=32.0, duration=60.0)),
    TableWorkload("dist-shift", "VTC's distribution shift: two tenants at 16 req/s with opposite shapes "
                  "(512 in / 32 out against 32 / 512), swapped at 30 s of 60 s",
                  _builtin("dist-shift", rate_a=16.0, rate_b=16.0, duration=60.0, shift_at=30.0)),
    TableWorkload("interactive-batch", "QLM's mix: interactive chat (class `interactive`: first token within 1 s, "
                  "refuse; bid 8) at 4 req/s beside batch jobs (class `batch`: 60 s, best effort; bid 2) at 16 req/s, "
                  "60 s", qlm_mix, classes=QLM_CLASSES),
    TableWorkload("shared-prefix", "a population of 228 shared prefixes of 4,096 tokens (Zipf popularity), four "
                  "tenants at 12 req/s together, on two engines, 60 s",
                  _builtin("shared-prefixes", rate=12.0, duration=60.0), engines=2),
    TableWorkload("mooncake-trace", "a generated Mooncake-format trace (1,500 requests, about 12,000-token prompts "
                  "in 512-token blocks, conversations and shared system prompts) split between three tenants by "
                  "zipf:3, on two engines of a long-context model", mooncake_trace, engines=2, model="llama-3.1-8b"),
    TableWorkload("replicas-4-to-1", "two apsd replicas sharing a store, each in front of one engine; `premium` "
                  "(weight 4) and `regular` (weight 1) each flood at 60 req/s of 256 / 256, `premium` sending 90% to "
                  "the first replica and `regular` 90% to the second (the skewed ingress reported against NVIDIA Dynamo), 30 s", skewed_replicas,
                  placement={"premium": (0.9, 0.1), "regular": (0.1, 0.9)}),
)
