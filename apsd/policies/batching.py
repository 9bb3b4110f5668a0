"""Built-in batching policy ``micro``: KV-cache-aware micro-batches, sized to the engine that asks.

A dispatch takes requests in the queue's order (highest effective priority first)
until it holds ``max_batch_size`` requests or as many as the engine has free
sequences, or the next request would need more KV tokens than the engine has free
(``Capacity.need``: prompt + requested for the ``batch`` engine, prompt for the
``continuous`` one), or names a model with no free slot (the ``forward`` engine;
``Capacity.model_room``); that request then leads the next dispatch. Free room goes first to the
requests the engine prefers (``Capacity.prefer``: a ``forward`` engine's tenants below their share of
the slots), in queue order, when the queue can look past its head. When the head does not fit and the queue can look past it
(``pop_first``, as the fair-share queues can), the first request in queue order of a tenant below
its share that fits (``Capacity.admits``: the room held for such tenants included) goes instead. ``kv_cap_tokens``, when
set, caps each dispatch's KV tokens further. A request that could never fit is refused
at admission (413) by its engine, or by this policy's own cap, so nothing waits forever.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from apsd.core.config import Config, between, parse_section
from apsd.core.hookspecs import hookimpl
from apsd.core.models import Capacity, InferenceRequest, exceeds_batch
from apsd.core.policy import OrderingPolicy

__all__ = ["MicroBatching"]


@attrs.frozen
class MicroParams:
    #: Most requests in one dispatch (for the ``batch`` engine, one batch).
    max_batch_size: int = attrs.field(default=16, validator=between(1, 1_000_000))
    #: A cap on each dispatch's KV tokens below the engine's own (0: only the engine's).
    kv_cap_tokens: int = attrs.field(default=0, validator=between(0, 10**12))


class MicroBatching:
    def __init__(self, params: MicroParams) -> None:
        self.max_batch_size = params.max_batch_size
        self.kv_cap_tokens = params.kv_cap_tokens

    def refuse_reason(self, request: InferenceRequest) -> str | None:
        if not self.kv_cap_tokens:
            return None
        return exceeds_batch(request, self.kv_cap_tokens, "policy.micro.kv_cap_tokens")

    def _limits(self, free: Capacity) -> tuple[int, int]:
        held = free.under_share is not None
        size = free.sequences + (free.held_sequences if held else 0)
        kv = free.kv_tokens + (free.held_kv_tokens if held else 0)
        return min(self.max_batch_size, size), min(kv, self.kv_cap_tokens) if self.kv_cap_tokens else kv

    def is_full(self, queue: OrderingPolicy, now: float, free: Capacity) -> bool:
        # With fewer than the size limit queued, summing them is cheap; once they reach the
        # KV limit the dispatch cut now would close early, and waiting cannot add to it.
        size, kv = self._limits(free)
        return len(queue) >= size or sum(free.need(r) for r in queue) >= kv

    def cut(self, queue: OrderingPolicy, now: float, free: Capacity) -> list[InferenceRequest]:
        size, _ = self._limits(free)
        batch: list[InferenceRequest] = []
        kv = 0
        slots_taken: dict[str, int] = {}   # (per model: free slots and held ones given out so far)
        held_taken: dict[str, int] = {}
        room: str | None = None

        def takes(request: InferenceRequest) -> bool:
            nonlocal room
            if self.kv_cap_tokens and kv + free.need(request) > self.kv_cap_tokens:
                return False
            room = free.model_room(request, slots_taken, held_taken)
            return room is not None and free.admits(request, len(batch), kv)

        while queue and len(batch) < size:
            head = queue.peek(now)
            taken = self._preferred(queue, now, free, head, takes)
            if taken is None and takes(head):
                taken = queue.pop(now)
            elif taken is None:  # queue order is kept, except for a tenant below its share, which may pass the head
                taken = self._under_share(queue, now, free, takes)
                if taken is None:
                    break
            batch.append(taken)
            kv += free.need(taken)
            if taken.model is not None and free.slots_per_model is not None:
                taken_here = slots_taken if room == "free" else held_taken
                taken_here[taken.model] = taken_here.get(taken.model, 0) + 1
        return batch

    @staticmethod
    def _preferred(queue: OrderingPolicy, now: float, free: Capacity, head: InferenceRequest,
                   takes: Callable[[InferenceRequest], bool]) -> InferenceRequest | None:
        """The first request, in queue order, that the free room should go to before ``head``
        (``Capacity.prefer``), if ``head`` is not one and the queue can find one (``pop_first``)."""
        prefer, pop_first = free.prefer, _pop_first(queue)
        if prefer is None or pop_first is None or prefer(head):
            return None
        return pop_first(lambda r: prefer(r) and takes(r), now)

    @staticmethod
    def _under_share(queue: OrderingPolicy, now: float, free: Capacity,
                     takes: Callable[[InferenceRequest], bool]) -> InferenceRequest | None:
        """The first request, in queue order, of a tenant below its share that fits, if the queue can
        find one (``pop_first``: the fair-share queues); the others keep their place."""
        pop_first = _pop_first(queue)
        under_share = free.under_share
        if pop_first is None or under_share is None:
            return None
        return pop_first(lambda r: under_share(r) and takes(r), now)


#: A queue's ``pop_first(accept, now)``: the first request in queue order that ``accept`` takes, removed
#: from the queue (None: none); the others keep their place.
PopFirst = Callable[[Callable[[InferenceRequest], bool], float], InferenceRequest | None]


def _pop_first(queue: OrderingPolicy) -> PopFirst | None:
    """``queue``'s ``pop_first``, if it has one (the fair-share queues: an optional method of the protocol)."""
    method: PopFirst | None = getattr(queue, "pop_first", None)
    return method


def _micro(params: dict[str, Any], config: Config) -> MicroBatching:
    return MicroBatching(parse_section(MicroParams, params, "policy.micro"))


@hookimpl
def register_policies(registry: Any) -> None:
    registry.batching("micro", _micro, "up to max_batch_size requests within the engine's free KV cache")
