"""The figures of one run as typed values: :class:`RunSummary` and the values it holds.

:func:`apsd.sim.report.summarize` makes them from a :class:`~apsd.sim.records.PolicyRun`; the
report and the research suite read their attributes. ``as_dict()`` gives what ``summary.json``
holds (keys named as the attributes; the counts of :class:`Outcomes` and the engine's details
sit beside the other keys, not nested), ``to_json()`` its text, and :func:`summary_json` the
whole file.

Every number is rounded to :data:`SIGNIFICANT_DIGITS` significant digits as a value is made
(integers stay integers, a non-finite float becomes None), so two identical runs give equal
values and byte-identical JSON. Times are in milliseconds where a name ends in ``_ms``, model
seconds elsewhere; a figure with nothing to measure is None.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import attrs
import numpy as np

from apsd.core.ledger import FAIRNESS_DEFINITION

__all__ = ["SIGNIFICANT_DIGITS", "BatchSizes", "ClassSummary", "EngineSummary", "Fairness", "GovernorSummary", "LowestBidder",
           "TenantIsolation",
           "Outcomes", "Overall", "Percentiles", "RunSummary", "ServiceDifference", "TenantSummary", "TimeInState",
           "WorkloadSummary", "plain", "rounded", "summary_json"]

#: Floats in summaries are rounded to this many significant digits.
SIGNIFICANT_DIGITS = 6


def rounded(x: Any) -> Any:
    """A number as a summary keeps it: None and integers unchanged (numpy's unwrapped), a float
    rounded to :data:`SIGNIFICANT_DIGITS` significant digits, None when it is not finite."""
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, (int, np.integer)):
        return int(x)
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{SIGNIFICANT_DIGITS}g}") + 0.0  # + 0.0 turns -0.0 into 0.0


def plain(value: Any) -> Any:
    """A JSON-ready copy of ``value``: summary values as their dicts, numbers :func:`rounded`,
    tuples as lists, keys as strings, anything else unknown as its text."""
    if isinstance(value, _Value):
        return value.as_dict()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float, np.integer, np.floating)):
        return rounded(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return str(value)


class _Value:
    """``as_dict()``: the attributes, in order, as plain JSON values."""

    __slots__ = ()
    __attrs_attrs__: ClassVar[tuple[attrs.Attribute[Any], ...]]  # (each value is an attrs class)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: plain(getattr(self, f.name)) for f in attrs.fields(type(self))}


@attrs.frozen
class Percentiles(_Value):
    """p50, p95, p99 and the maximum of a duration, in milliseconds (all None without data)."""

    p50: float | None = attrs.field(converter=rounded)
    p95: float | None = attrs.field(converter=rounded)
    p99: float | None = attrs.field(converter=rounded)
    max: float | None = attrs.field(converter=rounded)

    @classmethod
    def of_seconds(cls, values_s: Any) -> Percentiles:
        """Of ``values_s`` (seconds; linear interpolation between ranks)."""
        if not len(values_s):
            return cls(None, None, None, None)
        x = np.asarray(values_s, dtype=float) * 1000.0
        p = np.percentile(x, (50, 95, 99), method="linear")
        return cls(float(p[0]), float(p[1]), float(p[2]), float(x.max()))


@attrs.frozen
class Outcomes(_Value):
    """How many requests were sent and how they ended (``rejected_by_error``: error code -> count, by code)."""

    sent: int = attrs.field(converter=rounded)
    completed: int = attrs.field(converter=rounded)
    rejected: int = attrs.field(converter=rounded)
    failed: int = attrs.field(converter=rounded)
    cancelled: int = attrs.field(converter=rounded)
    rejected_by_error: dict[str, int]


@attrs.frozen
class TenantSummary(Outcomes):
    """One tenant's requests: outcomes, service against its configured rate, and times of its completed ones."""

    admitted: int = attrs.field(converter=rounded)
    rate: float | None = attrs.field(converter=rounded)
    bids: tuple[int, ...]
    output_tokens: int = attrs.field(converter=rounded)
    #: Output tokens served over its rate (None without a rate).
    service_per_rate: float | None = attrs.field(converter=rounded)
    cost_usd: float = attrs.field(converter=rounded)
    queue_wait_ms: Percentiles
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    latency_ms: Percentiles


@attrs.frozen
class Fairness(_Value):
    """Jain's index as the daemon defines it (:data:`apsd.core.ledger.FAIRNESS_DEFINITION`)."""

    jain_index: float | None = attrs.field(converter=rounded)
    tenants_counted: int = attrs.field(converter=rounded)
    fairness_definition: str = FAIRNESS_DEFINITION


@attrs.frozen
class LowestBidder(_Value):
    """Every request with the smallest bid among the arrivals, and the queue waits of its completed ones."""

    bid: int | None = attrs.field(converter=rounded)
    tenants: tuple[str, ...]
    requests: int = attrs.field(converter=rounded)
    completed: int = attrs.field(converter=rounded)
    max_queue_wait_ms: float | None = attrs.field(converter=rounded)
    p99_queue_wait_ms: float | None = attrs.field(converter=rounded)


@attrs.frozen
class TimeInState(_Value):
    seconds: float = attrs.field(converter=rounded)
    fraction: float = attrs.field(converter=rounded)


@attrs.frozen
class GovernorSummary(_Value):
    """The governor's samples: time in each state (by state name), mean window and entropy."""

    samples: int = attrs.field(converter=rounded)
    sample_interval_s: float = attrs.field(converter=rounded)
    time_in_state: dict[str, TimeInState]
    mean_window_ms: float | None = attrs.field(converter=rounded)
    mean_entropy_bits: float | None = attrs.field(converter=rounded)


@attrs.frozen
class BatchSizes(_Value):
    """Fixed batches (``distribution``: size as text -> batches, by size); none for iteration-level engines."""

    count: int = attrs.field(converter=rounded)
    distribution: dict[str, int]
    mean: float | None = attrs.field(converter=rounded)


@attrs.frozen
class ServiceDifference(_Value):
    """The service difference between backlogged tenants (:mod:`apsd.sim.report.service`)."""

    window_s: float = attrs.field(converter=rounded)
    step_s: float = attrs.field(converter=rounded)
    input_weight: float = attrs.field(converter=rounded)
    output_weight: float = attrs.field(converter=rounded)
    #: Windows in which two or more tenants were backlogged throughout.
    windows: int = attrs.field(converter=rounded)
    max: float | None = attrs.field(converter=rounded)
    max_window_start_s: float | None = attrs.field(converter=rounded)
    mean: float | None = attrs.field(converter=rounded)
    #: The same over the windows that end by half the run's duration.
    first_half_windows: int = attrs.field(converter=rounded)
    first_half_max: float | None = attrs.field(converter=rounded)
    first_half_max_window_start_s: float | None = attrs.field(converter=rounded)


@attrs.frozen
class Overall(Outcomes):
    """The whole run: outcomes, throughput, the engines' busy time and cost, fairness and times."""

    output_tokens: int = attrs.field(converter=rounded)
    #: Output tokens per model second to the last outcome.
    throughput_tokens_per_s: float | None = attrs.field(converter=rounded)
    #: Fixed batches run (0 on an iteration-level engine).
    batches: int = attrs.field(converter=rounded)
    #: Model seconds the engines computed (an engine of ``tp`` GPUs counts once).
    gpu_busy_s: float = attrs.field(converter=rounded)
    #: Busy time over (engines × duration).
    gpu_utilization: float | None = attrs.field(converter=rounded)
    cost_usd: float = attrs.field(converter=rounded)
    cost_per_1m_tokens_usd: float | None = attrs.field(converter=rounded)
    #: Prompt tokens the engines found in their prefix caches over all prompt tokens, of the completed
    #: requests (None: none completed).
    cached_prompt_share: float | None = attrs.field(converter=rounded)
    fairness: Fairness
    lowest_bidder: LowestBidder
    queue_wait_ms: Percentiles
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    latency_ms: Percentiles
    governor: GovernorSummary
    batch_sizes: BatchSizes
    service_difference: ServiceDifference


@attrs.frozen
class EngineSummary(_Value):
    """The run's ``[engine]`` (:meth:`apsd.engines.EngineDescription.as_dict`) and its engines' totals."""

    kind: str
    count: int
    #: What the engine kind describes beside its kind and count (``gpu``, ``model``, ``tp``; ``backends``).
    details: dict[str, Any]
    preemptions: int = attrs.field(converter=rounded)
    #: FLOP and memory-bandwidth utilisation over the engines' busy time (None without a hardware model).
    mfu: float | None = attrs.field(converter=rounded)
    mbu: float | None = attrs.field(converter=rounded)

    @classmethod
    def of(cls, engine: Mapping[str, Any], preemptions: int = 0, mfu: float | None = None,
           mbu: float | None = None) -> EngineSummary:
        """From an ``engine`` block (``kind``, ``count`` and the details)."""
        details = {k: plain(v) for k, v in engine.items() if k not in ("kind", "count")}
        return cls(kind=str(engine.get("kind", "?")), count=int(engine.get("count", 1)), details=details,
                   preemptions=preemptions, mfu=mfu, mbu=mbu)

    def as_dict(self) -> dict[str, Any]:
        described = dict(sorted({"kind": self.kind, "count": self.count, **self.details}.items()))
        return {**described, "preemptions": self.preemptions, "mfu": self.mfu, "mbu": self.mbu}

    def describe(self, gpus: int | None = None) -> str:
        """In words: "1 `continuous` engine (a100-80gb × llama-3-8b, tp 1)" (``gpus``: named when not one per engine)."""
        d = self.details
        if "gpu" in d:
            what = f"{d['gpu']} × {d['model']}, tp {d.get('tp', 1)}"
        elif "backends" in d:
            what = "to " + ", ".join(f"`{b}`" for b in d["backends"])
        else:
            what = "a simulated GPU, `[gpu]`"
        text = f"{self.count} `{self.kind}` {'engine' if self.count == 1 else 'engines'} ({what})"
        if gpus is not None and gpus != self.count:
            text += f", {gpus} GPUs"
        return text


@attrs.frozen
class WorkloadSummary(_Value):
    name: str
    description: str
    #: The parameters it was generated with, as JSON values.
    params: dict[str, Any] = attrs.field(converter=plain)
    seed: int
    arrivals: int
    tenants: int


@attrs.frozen
class TenantIsolation(_Value):
    """One tenant beside the others against alone (the same arrivals of its own, nobody else's): its p99
    time to first token, and its output tokens per second from its first arrival to its last finish."""

    tenant: str
    ttft_p99_alone_ms: float | None = attrs.field(converter=rounded)
    ttft_p99_ms: float | None = attrs.field(converter=rounded)
    #: p99 TTFT beside the others over alone (None without both).
    ratio: float | None = attrs.field(converter=rounded)
    tokens_per_s_alone: float | None = attrs.field(converter=rounded)
    tokens_per_s: float | None = attrs.field(converter=rounded)


@attrs.frozen
class ClassSummary(_Value):
    """One service class's attainment in a run (:mod:`apsd.sim.report.classes`: attainment = met / requests)."""

    name: str
    ttft_s: float = attrs.field(converter=rounded)
    tpot_s: float = attrs.field(converter=rounded)
    on_miss: str
    requests: int = attrs.field(converter=rounded)
    met: int = attrs.field(converter=rounded)
    missed: int = attrs.field(converter=rounded)
    refused: int = attrs.field(converter=rounded)
    attainment: float | None = attrs.field(converter=rounded)


@attrs.frozen
class RunSummary(_Value):
    """One policy on one workload: what ``summary.json`` holds for it."""

    label: str
    #: preset, aging, governor, batching (by kind).
    policy: dict[str, str]
    workload: WorkloadSummary
    gpus: int
    engine: EngineSummary
    duration_s: float = attrs.field(converter=rounded)
    #: By tenant name, sorted.
    tenants: dict[str, TenantSummary]
    overall: Overall
    #: Each tenant beside the others against alone, by tenant name (empty: not compared).
    isolation: tuple[TenantIsolation, ...] = ()
    #: Where the routing policy sent requests and why: engine (or backend) -> reason -> requests, both
    #: sorted (empty: no routing decision was made).
    routing: dict[str, dict[str, int]] = attrs.field(factory=dict)
    #: Every configured service class's attainment, by name (empty: no classes).
    classes: tuple[ClassSummary, ...] = ()

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2, sort_keys=True)


def summary_json(title: str, summaries: list[RunSummary]) -> str:
    """The text of ``summary.json``: the title and every run, keys sorted."""
    return json.dumps({"title": title, "runs": [s.as_dict() for s in summaries]}, indent=2, sort_keys=True) + "\n"
