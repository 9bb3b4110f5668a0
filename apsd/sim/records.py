"""What a simulation records, and what a workload is: plain frozen values.

Ownership: :mod:`apsd.sim.workloads` makes :class:`Workload` values;
:mod:`apsd.sim.runner` runs them through the real pipeline and produces one
:class:`PolicyRun` per policy; :mod:`apsd.sim.report` turns runs into numbers,
Markdown and plots. All times are model seconds from the start of the run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from apsd.core.config import TenantConfig
from apsd.core.routing import BLOCK_TOKENS

__all__ = ["Arrival", "BatchRecord", "EngineRecord", "GovernorSample", "PolicyRun", "RequestRecord", "Workload"]


@attrs.frozen
class Arrival:
    """One request of a workload: when it arrives and what it asks for."""

    at: float
    tenant: str
    prompt_tokens: int
    output_tokens: int
    bid: int
    #: Its prompt's routing key (:func:`apsd.core.routing.synthetic_blocks`, or a trace's block ids):
    #: requests that share a prefix share its blocks. None: no key (one pool of engines, no prefix
    #: cache hits).
    prefix_blocks: tuple[int, ...] | None = attrs.field(default=None, repr=False)
    #: The service class it names (``[classes.<name>]``; None: its tenant's default, if any).
    service_class: str | None = None
    #: Tokens per block of ``prefix_blocks`` (a trace's block size; 64 for the built-ins).
    prefix_block_tokens: int = attrs.field(default=BLOCK_TOKENS, repr=False)


@attrs.frozen
class Workload:
    """A named, fully generated workload (identical for every policy it is run with)."""

    name: str
    description: str
    #: Sorted by ``at``; ties keep generation (file) order. A tuple, or for a trace a sequence that makes
    #: each :class:`Arrival` as it is read (:class:`apsd.sim.traces.columns.TraceArrivals`).
    arrivals: Sequence[Arrival]
    tenants: dict[str, TenantConfig]       # the tenants' buckets during the simulation
    params: dict[str, Any]                 # the parameters it was generated with (for the report)
    seed: int = 0


@attrs.frozen
class RequestRecord:
    """What happened to one arrival."""

    tenant: str
    bid: int
    prompt_tokens: int
    output_tokens: int
    arrival: float
    outcome: str                           # "completed" | "rejected" | "failed" | "cancelled"
    error: str | None = None               # the refusal's error code when not completed
    dispatched_at: float | None = None
    finished_at: float | None = None
    batch_id: int | None = None
    batch_size: int | None = None
    cost_usd: float = 0.0
    #: Model time of its first token (None: it never produced one).
    started_at: float | None = None
    #: Mean model seconds per output token after the first (completed requests of 2+ tokens).
    tpot: float | None = None
    #: The engine that ran it last (None: never dispatched).
    engine_id: int | None = None
    #: Prompt tokens its engine's prefix cache held (their prefill skipped).
    cached_tokens: int = 0
    #: Where the routing policy sent it and why (``engine-2; reason=cache_match``; None: no choice made).
    route: str | None = None
    #: Its service class (as admission resolved it; None: none).
    service_class: str | None = None

    @property
    def queue_wait(self) -> float | None:
        return None if self.dispatched_at is None else self.dispatched_at - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.started_at is None else self.started_at - self.arrival

    @property
    def latency(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.arrival


@attrs.frozen
class EngineRecord:
    """One engine over a whole run (from its :class:`apsd.engines.EngineStatistics`)."""

    engine_id: int
    kind: str
    busy_s: float
    cost_usd: float
    dispatches: int
    tokens_generated: int
    preemptions: int
    kv_tokens_capacity: int
    mfu: float | None
    mbu: float | None


@attrs.frozen
class BatchRecord:
    batch_id: int
    executor_id: int
    size: int
    kv_tokens: int
    formed_at: float
    started_at: float
    finished_at: float
    busy_s: float
    cost_usd: float
    window_s: float


@attrs.frozen
class GovernorSample:
    """The governor and queue, sampled at a fixed interval of model time."""

    at: float
    state: str
    entropy_bits: float | None
    window_s: float
    queue_depth: int


@attrs.frozen
class PolicyRun:
    """One policy on one workload: everything the report needs."""

    label: str                             # e.g. "aps", or "aps+fixed" for a variant
    policy: dict[str, str]                 # preset, aging, governor, batching
    workload: Workload
    requests: tuple[RequestRecord, ...]    # in arrival order
    batches: tuple[BatchRecord, ...]       # in finishing order
    samples: tuple[GovernorSample, ...]
    sample_interval_s: float
    duration_s: float                      # from 0 to the last outcome
    gpus: int
    tenant_rates: dict[str, float]
    #: The ``[engine]`` it ran on: kind, and for ``continuous`` gpu, model, tp; and count.
    engine: dict[str, Any] = attrs.field(factory=lambda: {"kind": "batch", "count": 1})
    engines: tuple[EngineRecord, ...] = ()
    wall_s: float = attrs.field(default=0.0, eq=False)  # real seconds it took: never in reports' data
    #: The service classes it ran with (``[classes]``: name -> ServiceClassConfig; empty: none).
    classes: dict[str, Any] = attrs.field(factory=dict)

    @property
    def busy_s(self) -> float:
        """Model seconds the engines computed, summed over engines."""
        return sum(e.busy_s for e in self.engines) if self.engines else sum(b.busy_s for b in self.batches)

    @property
    def cost_usd(self) -> float:
        return sum(e.cost_usd for e in self.engines) if self.engines else sum(b.cost_usd for b in self.batches)
