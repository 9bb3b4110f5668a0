"""Built-in batching policy ``micro``: KV-cache-aware micro-batches.

A batch takes requests in the queue's order (highest effective priority first)
until it holds ``max_batch_size`` requests or the next request would push its
KV tokens (prompt + requested, summed over the batch) past ``kv_cap_tokens``;
that request then leads the next batch. A request larger than the cap on its
own is refused at admission (413), so nothing can wait forever.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..config import Config, between, parse_section
from ..hookspecs import hookimpl
from ..models import InferenceRequest
from ..policy import OrderingPolicy

__all__ = ["MicroBatching"]


@attrs.frozen
class MicroParams:
    max_batch_size: int = attrs.field(default=16, validator=between(1, 1_000_000))
    kv_cap_tokens: int = attrs.field(default=32_768, validator=between(1, 10**12))


class MicroBatching:
    def __init__(self, params: MicroParams) -> None:
        self.max_batch_size = params.max_batch_size
        self.kv_cap_tokens = params.kv_cap_tokens

    def refuse_reason(self, request: InferenceRequest) -> str | None:
        if request.cost_tokens > self.kv_cap_tokens:
            return (f"request needs {request.cost_tokens} KV tokens (prompt {request.prompt_tokens} + "
                    f"requested {request.tokens_requested}) but a batch holds at most "
                    f"{self.kv_cap_tokens} (policy.micro.kv_cap_tokens)")
        return None

    def is_full(self, queue: OrderingPolicy, now: float) -> bool:
        # With fewer than max_batch_size queued, summing them is cheap; once they reach the
        # KV cap the batch cut now would close early, and waiting cannot add to it.
        return len(queue) >= self.max_batch_size or sum(r.cost_tokens for r in queue) >= self.kv_cap_tokens

    def cut(self, queue: OrderingPolicy, now: float) -> list[InferenceRequest]:
        batch: list[InferenceRequest] = []
        kv = 0
        while queue and len(batch) < self.max_batch_size:
            cost = queue.peek(now).cost_tokens
            if batch and kv + cost > self.kv_cap_tokens:
                break
            batch.append(queue.pop(now))
            kv += cost
        return batch


def _micro(params: dict[str, Any], config: Config) -> MicroBatching:
    return MicroBatching(parse_section(MicroParams, params, "policy.micro"))


@hookimpl
def register_policies(registry: Any) -> None:
    registry.batching("micro", _micro, "up to max_batch_size requests within kv_cap_tokens")
