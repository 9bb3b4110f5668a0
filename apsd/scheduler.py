"""Scheduler stage: the waiting queue, the batch window, and cutting batches on demand.

Ownership: the scheduler owns the receive end of the admitted channel
(:meth:`Scheduler.serve_intake`), the receive end of the demand channel and the
send end of the batch channel (:meth:`Scheduler.serve_dispatch`). The queue
itself is the aging policy object; the scheduler is its only user.

When a batch is cut: executors *pull*. An idle executor sends its id on the
demand channel and then waits on the unbuffered batch channel; only then does
the scheduler wait out the window and cut, so a batch is formed at the last
moment and a late high-priority request still gets in.

The window: a batch is cut as soon as the batching policy says it is full, or
once ``window_s`` (from the governor) has passed since the first request of
the current backlog arrived. Requests left over after a cut have already
waited, so they go out as soon as an executor is free.
"""

from __future__ import annotations

import attrs
import trio

from .clock import ModelClock
from .ledger import Ledger
from .models import Batch, InferenceRequest
from .policy import GovernorReading, PolicySet

__all__ = ["Scheduler"]


@attrs.define(eq=False)
class Scheduler:
    policies: PolicySet
    ledger: Ledger
    clock: ModelClock
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _backlog_since: float | None = attrs.field(default=None, init=False)
    _next_batch_id: int = attrs.field(default=1, init=False)

    @property
    def queue_depth(self) -> int:
        return len(self.policies.aging)

    def governor_reading(self) -> GovernorReading:
        return self.policies.governor.reading(self.clock.now())

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def enqueue(self, request: InferenceRequest) -> None:
        """Put an admitted request in the queue and tell the governor it arrived."""
        self.policies.governor.observe_arrival(request.arrival)
        self.policies.aging.push(request, self.clock.now())
        if self._backlog_since is None:
            self._backlog_since = request.arrival
        self._wake()

    def drop_queued(self) -> list[InferenceRequest]:
        """Empty the queue (shutdown): the caller answers the requests it gets back."""
        now = self.clock.now()
        dropped = [self.policies.aging.pop(now) for _ in range(len(self.policies.aging))]
        self._backlog_since = None
        return dropped

    async def serve_intake(self, admitted: trio.MemoryReceiveChannel[InferenceRequest]) -> None:
        """Move admitted requests into the queue until the channel closes."""
        async with admitted:
            async for request in admitted:
                self.enqueue(request)

    async def serve_dispatch(
        self,
        demand: trio.MemoryReceiveChannel[int],
        batches: trio.MemorySendChannel[Batch],
    ) -> None:
        """For each executor that asks, wait for a batch and hand it over."""
        async with demand, batches:
            async for _executor_id in demand:
                batch = await self.wait_next_batch()
                await batches.send(batch)

    async def wait_next_batch(self) -> Batch:
        """Wait until the queue has a batch to cut (full, or its window elapsed), then cut it."""
        queue = self.policies.aging
        while True:
            now = self.clock.now()
            if not queue:
                await self._changed.wait()
                continue
            reading = self.policies.governor.reading(now)
            assert self._backlog_since is not None
            cut_at = self._backlog_since + reading.window_s
            if self.clock.reached(cut_at) or self.policies.batching.is_full(queue, now):
                return self._cut(now, reading)
            with trio.move_on_at(self.clock.deadline(cut_at)):
                await self._changed.wait()

    def _cut(self, now: float, reading: GovernorReading) -> Batch:
        queue = self.policies.aging
        requests = self.policies.batching.cut(queue, now)
        if not requests:
            raise RuntimeError(f"batching policy {self.policies.names['batching']!r} cut an empty batch "
                               "from a non-empty queue")
        for request in requests:
            request.dispatched_at = now
            request.effective_priority = queue.effective_priority(request, now)
        if not queue:
            self._backlog_since = None
        batch = Batch(batch_id=self._next_batch_id, requests=tuple(requests), formed_at=now,
                      window_s=reading.window_s)
        self._next_batch_id += 1
        self.ledger.dispatched(batch)
        return batch
