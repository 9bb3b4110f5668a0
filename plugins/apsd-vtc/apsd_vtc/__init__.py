"""Virtual Token Counter (VTC) fair queuing for apsd.

Sheng et al., "Fairness in Serving Large Language Models", OSDI '24. Each
tenant ``c`` has a counter ``served[c]`` of the (weighted) service it has
received. The queue serves the backlogged tenant with the smallest counter,
first come first served within a tenant. When a request is dispatched, its
tenant is charged ``(input_weight * prompt_tokens + output_weight *
tokens_requested) / weight[c]``; when it ends, the charge is corrected to the
service it really received: its prompt if it started, and the tokens it
generated (``request.started_at``, ``request.tokens_generated``), whatever the
outcome (a client that left mid-stream was served what it got), except a
failure, which is refunded in full.

Counter lift: when a tenant's queue goes from empty to non-empty its counter is
raised to at least the smallest counter among the other backlogged tenants (or,
if none is backlogged, to the counter of the tenant that was served last), so
an idle tenant cannot bank credit and then monopolise the GPU.

Work-conserving: whenever anything is queued, ``pop`` returns a request.

Cost: the order depends on service, not on a key fixed at push time, so it is
not a heap. ``peek`` and ``pop`` scan the backlogged tenants, O(T) for T
backlogged tenants (requests within a tenant are a FIFO deque); ``push`` is O(1)
except when it lifts a returning tenant's counter, which also scans them. With
tens of tenants this is a few microseconds; with thousands, put a heap of
counters in front (counters only grow between lifts).

Uses only apsd's public API (``docs/plugins.md``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import attrs

import apsd

__all__ = ["VtcParams", "VtcQueue", "register_policies"]
__version__ = "0.1.0"


_MAX = 1e6  # weights are ratios: this keeps counters finite


def _positive(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    if not 0 < value <= _MAX:
        raise ValueError(f"must be > 0 and <= {_MAX:g}, got {value!r}")


def _positive_weights(_inst: object, attribute: attrs.Attribute, value: dict[str, float]) -> None:
    for tenant, weight in value.items():
        if not 0 < weight <= _MAX:
            raise ValueError(f"weight of {tenant!r} must be > 0 and <= {_MAX:g}, got {weight!r}")


@attrs.frozen
class VtcParams:
    """``[policy.vtc]``: token weights and per-tenant shares."""

    #: w_p: service charged per prompt (input) token.
    input_weight: float = attrs.field(default=1.0, validator=_positive)
    #: w_q: service charged per generated (output) token.
    output_weight: float = attrs.field(default=2.0, validator=_positive)
    #: Tenant name -> share (default 1.0); a tenant of weight 2 gets twice the service.
    weights: dict[str, float] = attrs.field(factory=dict, validator=_positive_weights)


class VtcQueue:
    """An apsd aging (ordering) policy implementing VTC."""

    def __init__(self, params: VtcParams) -> None:
        self.params = params
        self.counters: dict[str, float] = collections.defaultdict(float)
        self._queues: dict[str, collections.deque[apsd.InferenceRequest]] = {}
        self._charged: dict[apsd.InferenceRequest, float] = {}  # weighted charge per popped request
        self._last_served: str | None = None
        self._length = 0

    def weight(self, tenant_id: str) -> float:
        return self.params.weights.get(tenant_id, 1.0)

    def charge(self, request: apsd.InferenceRequest, output_tokens: int) -> float:
        """The service ``request`` represents with ``output_tokens`` generated, before weighting."""
        p = self.params
        return p.input_weight * request.prompt_tokens + p.output_weight * output_tokens

    # -- the ordering interface ----------------------------------------------------------
    def push(self, request: apsd.InferenceRequest, now: float) -> None:
        tenant = request.tenant_id
        queue = self._queues.get(tenant)
        if not queue:  # the tenant becomes backlogged: lift its counter
            others = [self.counters[t] for t, q in self._queues.items() if q and t != tenant]
            if others:
                floor = min(others)
            else:
                floor = self.counters[self._last_served] if self._last_served is not None else 0.0
            self.counters[tenant] = max(self.counters[tenant], floor)
            queue = self._queues[tenant] = collections.deque()
        queue.append(request)
        self._length += 1

    def _next_tenant(self) -> str:
        best: tuple[float, int] | None = None
        chosen = None
        for tenant, queue in self._queues.items():
            if queue:
                key = (self.counters[tenant], queue[0].seq)
                if best is None or key < best:
                    best, chosen = key, tenant
        if chosen is None:
            raise IndexError("pop from an empty VTC queue")
        return chosen

    def peek(self, now: float) -> apsd.InferenceRequest:
        return self._queues[self._next_tenant()][0]

    def pop(self, now: float) -> apsd.InferenceRequest:
        tenant = self._next_tenant()
        queue = self._queues[tenant]
        request = queue.popleft()
        if not queue:
            del self._queues[tenant]
        self._length -= 1
        if not request.answered:  # an answered request is skipped by the scheduler: no service
            earlier = self._charged.pop(request, None)
            if earlier is not None:  # popped again after a requeue: its first charge goes back
                self.counters[tenant] -= earlier
            charge = self.charge(request, request.tokens_requested) / self.weight(tenant)
            self.counters[tenant] += charge
            self._charged[request] = charge
            self._last_served = tenant
        return request

    def effective_priority(self, request: apsd.InferenceRequest, now: float) -> float:
        """Minus the tenant's counter: higher means less served so far, so sooner."""
        return -self.counters[request.tenant_id]

    def on_finish(self, request: apsd.InferenceRequest, outcome: Any, now: float) -> None:
        """Correct the charge made at pop to the service received (nothing if it failed)."""
        charge = self._charged.pop(request, None)
        if charge is None:
            return  # never charged by this queue (not popped yet, or popped by a replaced one)
        tenant = request.tenant_id
        failed = isinstance(outcome, apsd.Refusal) and outcome.kind == "failed"
        if failed or request.started_at is None:
            served = self.params.output_weight * request.tokens_generated if not failed else 0.0
        else:
            served = self.charge(request, request.tokens_generated)
        self.counters[tenant] += served / self.weight(tenant) - charge

    def discard_answered(self) -> None:
        """Drop requests answered while queued (their clients left); O(N)."""
        for tenant in list(self._queues):
            kept = collections.deque(r for r in self._queues[tenant] if not r.answered)
            if kept:
                self._queues[tenant] = kept
            else:
                del self._queues[tenant]
        self._length = sum(len(q) for q in self._queues.values())

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[apsd.InferenceRequest]:
        for queue in self._queues.values():
            yield from queue


def _vtc(params: dict[str, Any], config: apsd.Config) -> VtcQueue:
    parsed = apsd.parse_section(VtcParams, params, "policy.vtc")
    unknown = sorted(set(parsed.weights) - set(config.tenants))
    if unknown:
        raise apsd.ConfigError(f"policy.vtc.weights.{unknown[0]}: no such tenant "
                               f"(tenants: {', '.join(sorted(config.tenants))})")
    return VtcQueue(parsed)


@apsd.hookimpl
def register_policies(registry: apsd.PolicyRegistry) -> None:
    registry.aging("vtc", _vtc, "Virtual Token Counter fair share (Sheng et al. OSDI '24) [weights]")
    registry.preset("vtc", aging="vtc", governor="fixed", batching="micro")
