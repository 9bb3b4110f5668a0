"""Built-in aging (queue order) policies: ``fifo``, ``static`` and ``aps``.

All three are binary heaps keyed so that the smallest key is served first,
ties broken by admission order (``seq``). push/peek/pop are O(log N)/O(1)/O(log N).

``aps`` serves the request with the highest ``P_eff = P_bid + alpha * (now - t_a)``.
With one ``alpha`` for every request, the difference between two requests'
``P_eff`` does not depend on ``now``, so the order never changes with time and a
heap keyed on ``alpha * t_a - P_bid`` is exact at every moment: aging costs
nothing per tick and ``P_eff`` is computed only when reported.
"""

from __future__ import annotations

from typing import Any

import attrs

from apsd.core.config import Config, between, parse_section
from apsd.core.hookspecs import hookimpl
from apsd.core.models import InferenceRequest
from apsd.core.queue import FifoQueue, HeapQueue

__all__ = ["ApsQueue", "FifoQueue", "HeapQueue", "StaticQueue"]


class StaticQueue(HeapQueue):
    """Highest bid first, arrival order within a bid. Starves low bidders under a flood."""

    def key(self, request: InferenceRequest) -> float:
        return -float(request.priority_bid)


@attrs.frozen
class ApsParams:
    #: Priority points a request gains per model second of waiting.
    alpha: float = attrs.field(default=1.0, validator=between(0, 1e6))


class ApsQueue(HeapQueue):
    """``P_bid + alpha * wait``, exact with no re-heapify (see the module docstring)."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        self.alpha = alpha

    def key(self, request: InferenceRequest) -> float:
        return self.alpha * request.arrival - request.priority_bid

    def effective_priority(self, request: InferenceRequest, now: float) -> float:
        return request.priority_bid + self.alpha * (now - request.arrival)


@attrs.frozen
class NoParams:
    """For policies without parameters: any key in their table is an error."""


def _fifo(params: dict[str, Any], config: Config) -> FifoQueue:
    parse_section(NoParams, params, "policy.fifo")
    return FifoQueue()


def _static(params: dict[str, Any], config: Config) -> StaticQueue:
    parse_section(NoParams, params, "policy.static")
    return StaticQueue()


def _aps(params: dict[str, Any], config: Config) -> ApsQueue:
    return ApsQueue(parse_section(ApsParams, params, "policy.aps").alpha)


@hookimpl
def register_policies(registry: Any) -> None:
    registry.aging("fifo", _fifo, "arrival order; ignores bids")
    registry.aging("static", _static, "highest bid first; can starve low bidders")
    registry.aging("aps", _aps, "P_bid + alpha*wait, exact O(log N) lazy aging [alpha]")
    registry.preset("fifo", aging="fifo", governor="fixed", batching="micro")
    registry.preset("static", aging="static", governor="fixed", batching="micro")
    registry.preset("aps", aging="aps", governor="entropy", batching="micro")
