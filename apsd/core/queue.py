"""A waiting queue as a binary heap: the base of the built-in aging policies, and the scheduler's fallback.

A :class:`HeapQueue` keeps ``(key, seq, request)`` so that the smallest key is served first, ties
broken by admission order (``seq``); push/peek/pop are O(log N)/O(1)/O(log N). Subclasses define
:meth:`HeapQueue.key`. :class:`FifoQueue` is arrival order: the scheduler falls back to it when the
configured aging policy fails.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from apsd.core.models import InferenceRequest

__all__ = ["FifoQueue", "HeapQueue"]


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
