"""Service-class attainment of a simulated run (:mod:`apsd.core.classes` states the rules).

:func:`class_attainment` counts, per class, what happened to every arrival of it: ``met`` (completed
with its first token within ``ttft_s``, and its mean time per output token within ``tpot_s`` when
that is set), ``refused`` (503 ``deadline_unmeetable``: at admission or when its deadline came while
queued), ``missed`` (every other end, other refusals included, such as a full queue). Here
``attainment = met / requests``: of every request of the class, whatever refused it.

``labels`` gives each record's class when the run had none (the same arrivals under a configuration
without classes, measured against the classes they would have had).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from apsd.core.classes import DEADLINE_UNMEETABLE
from apsd.core.config import ServiceClassConfig
from apsd.sim.records import PolicyRun, RequestRecord

__all__ = ["ClassAttainment", "class_attainment", "is_met"]

_EPSILON = 1e-9


@attrs.frozen
class ClassAttainment:
    """One class's figures in one run."""

    name: str
    ttft_s: float
    on_miss: str
    requests: int
    met: int
    missed: int
    refused: int

    @property
    def attainment(self) -> float | None:
        return self.met / self.requests if self.requests else None

    def as_dict(self) -> dict[str, object]:
        return {"class": self.name, "ttft_s": self.ttft_s, "on_miss": self.on_miss, "requests": self.requests,
                "met": self.met, "missed": self.missed, "refused": self.refused, "attainment": self.attainment}


def is_met(record: RequestRecord, spec: ServiceClassConfig) -> bool:
    """Whether ``record`` met ``spec``'s targets."""
    if record.outcome != "completed" or record.ttft is None or record.ttft > spec.ttft_s + _EPSILON:
        return False
    return not spec.tpot_s or record.tpot is None or record.tpot <= spec.tpot_s + _EPSILON


def class_attainment(run: PolicyRun, classes: Mapping[str, ServiceClassConfig],
                     labels: Sequence[str | None] | None = None) -> list[ClassAttainment]:
    """Every class of ``classes``'s figures in ``run``, by name."""
    names = labels if labels is not None else [r.service_class for r in run.requests]
    counts = {name: [0, 0, 0, 0] for name in classes}  # requests, met, missed, refused
    for record, name in zip(run.requests, names):
        if name not in counts:
            continue
        c = counts[name]
        c[0] += 1
        if is_met(record, classes[name]):
            c[1] += 1
        elif record.error == DEADLINE_UNMEETABLE:
            c[3] += 1
        else:
            c[2] += 1
    return [ClassAttainment(name, spec.ttft_s, spec.on_miss, *counts[name]) for name, spec in sorted(classes.items())]
