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

import heapq
from collections.abc import Iterator
from typing import Any

import attrs

from ..config import Config, between, parse_section
from ..hookspecs import hookimpl
from ..models import InferenceRequest

__all__ = ["ApsQueue", "FifoQueue", "HeapQueue", "StaticQueue"]


class HeapQueue:
    """A heap of ``(key, seq, request)``; subclasses define :meth:`key`."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, InferenceRequest]] = []

    def key(self, request: InferenceRequest) -> float:
        raise NotImplementedError

    def effective_priority(self, request: InferenceRequest, now: float) -> float:
        return float(request.priority_bid)

    def push(self, request: InferenceRequest, now: float) -> None:
        heapq.heappush(self._heap, (self.key(request), request.seq, request))

    def peek(self, now: float) -> InferenceRequest:
        return self._heap[0][2]

    def pop(self, now: float) -> InferenceRequest:
        return heapq.heappop(self._heap)[2]

    def discard_answered(self) -> None:
        """Drop requests answered while queued (O(N)); the scheduler calls it when they pile up."""
        self._heap = [entry for entry in self._heap if not entry[2].answered]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[InferenceRequest]:
        return (entry[2] for entry in self._heap)


class FifoQueue(HeapQueue):
    """Arrival order; the bid is ignored (and reported as the priority)."""

    def key(self, request: InferenceRequest) -> float:
        return 0.0


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
