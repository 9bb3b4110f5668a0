"""What research.md is computed from: :class:`Measured`, typed, with the measurements that are not
a run's summary (the service while an overload lasts, the capacity of a full engine)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs

from apsd.core.config import Config
from apsd.core.ledger import jain_index
from apsd.engines.roofline import Deployment, DeploymentError, estimate_static_batch
from apsd.sim.records import PolicyRun, Workload
from apsd.sim.report import RunSummary

__all__ = ["Comparison", "Measured", "OverloadService", "ServedByThen", "full_engine_tps", "known", "mean_shape",
           "service_during_overload"]


def known(value: float | None) -> float:
    """A figure that the suite's runs always have (their requests complete: the percentiles and the windows
    exist); ValueError where one is missing."""
    if value is None:
        raise ValueError("a figure the research suite relies on was not measured (a run completed no request?)")
    return value


@attrs.frozen
class Comparison:
    """One workload on one engine: a summary per policy, in policy order (``comparison[label]``)."""

    summaries: tuple[RunSummary, ...]

    def __iter__(self) -> Iterator[RunSummary]:
        return iter(self.summaries)

    def __len__(self) -> int:
        return len(self.summaries)

    def __getitem__(self, label: str) -> RunSummary:
        for s in self.summaries:
            if s.label == label:
                return s
        raise KeyError(label)

    @property
    def labels(self) -> list[str]:
        return [s.label for s in self.summaries]


@attrs.frozen
class ServedByThen:
    """One run at a moment: output tokens each tenant had asked for and been served (by tenant name)."""

    asked: dict[str, int]
    tokens: dict[str, int]
    #: Jain's index of the tokens served over each tenant's configured rate.
    jain: float | None
    #: Whether every tenant with a request admitted by then still had one waiting.
    backlogged: bool


@attrs.frozen
class OverloadService:
    """:func:`service_during_overload`: every run (by policy label) at the workload's last arrival."""

    at: float
    runs: dict[str, ServedByThen]


@attrs.frozen
class Measured:
    """Everything research.md is computed from."""

    #: engine -> workload (or scaled variant) name -> its comparison.
    results: dict[str, dict[str, Comparison]]
    #: report directory (as text) -> :func:`service_during_overload` of its runs.
    overload: dict[str, OverloadService]
    #: engine -> workload -> the summary of :data:`~apsd.sim.research.suite.ZERO_WINDOW`.
    zero_window: dict[str, dict[str, RunSummary]]
    #: engine -> :data:`~apsd.sim.research.suite.NOISY`'s steady tenant alone, under every policy.
    alone: dict[str, Comparison]
    #: workload (or scaled variant) -> output tokens/s of a full continuous engine for its mean request.
    full_engine_tps: dict[str, float | None]
    #: workload (or scaled variant) -> (mean prompt tokens, mean output tokens).
    shapes: dict[str, tuple[int, int]]
    configs: dict[str, Config]
    deployment: Deployment

    def run(self, engine: str, name: str, label: str) -> RunSummary:
        return self.results[engine][name][label]


def mean_shape(workload: Workload) -> tuple[int, int]:
    """The workload's mean prompt and output tokens, rounded (at least 1)."""
    n = max(len(workload.arrivals), 1)
    return (max(round(sum(a.prompt_tokens for a in workload.arrivals) / n), 1),
            max(round(sum(a.output_tokens for a in workload.arrivals) / n), 1))


def full_engine_tps(deployment: Deployment, config: Config, shape: tuple[int, int]) -> float | None:
    """Output tokens/s of one engine full of the workload's mean request: ``max_sequences`` of them
    run together (the roofline's static-batch estimate; None if they do not fit its KV cache)."""
    try:
        return estimate_static_batch(deployment, config.engine.max_sequences, *shape,
                                     chunk_budget=config.engine.max_batched_tokens).output_tokens_per_s
    except DeploymentError:
        return None


def service_during_overload(runs: Sequence[PolicyRun]) -> OverloadService:
    """Per run: output tokens each tenant had asked for and been served by the last arrival, and Jain.

    The index is the report's (tokens / configured rate, over tenants with a request admitted by
    then); ``backlogged`` says whether every such tenant still had a request waiting at that moment.
    """
    at = max((a.at for a in runs[0].workload.arrivals), default=0.0)
    by_label: dict[str, ServedByThen] = {}
    for run in runs:
        asked: dict[str, int] = {}
        tokens: dict[str, int] = {}
        waiting: dict[str, bool] = {}
        for r in run.requests:
            if r.arrival > at or r.outcome == "rejected":
                continue
            asked[r.tenant] = asked.get(r.tenant, 0) + r.output_tokens
            tokens.setdefault(r.tenant, 0)
            waiting.setdefault(r.tenant, False)
            if r.outcome == "completed" and r.finished_at is not None and r.finished_at <= at:
                tokens[r.tenant] += r.output_tokens
            if r.dispatched_at is None or r.dispatched_at > at:
                waiting[r.tenant] = True
        x = [tokens[t] / run.tenant_rates[t] for t in sorted(tokens) if run.tenant_rates.get(t)]
        by_label[run.label] = ServedByThen(asked=dict(sorted(asked.items())), tokens=dict(sorted(tokens.items())),
                                           jain=jain_index(x), backlogged=bool(waiting) and all(waiting.values()))
    return OverloadService(at=at, runs=by_label)
