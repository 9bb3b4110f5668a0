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
an idle tenant cannot bank credit and then monopolise the GPU. Ties go to the
tenant served least recently.

Work-conserving: whenever anything is queued, ``pop`` returns a request.

Cost: O(log T) per operation for T backlogged tenants: the fair share is apsd's
public :class:`apsd.FairShareQueue` (a heap of tenants keyed on their counters),
with first-come-first-served order inside each tenant.
The built-in ``fair`` policy is the same fair share with APS order inside a tenant.

Uses only apsd's public API (``docs/how-to/write-a-plugin.md``).
"""

from __future__ import annotations

from typing import Any

import attrs

import apsd

__all__ = ["VtcParams", "VtcQueue", "register_policies"]
__version__ = "0.2.0"


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
    #: Tenant name -> share, over the tenant's own ``weight`` (default 1.0); a tenant of weight 2
    #: gets twice the service.
    weights: dict[str, float] = attrs.field(factory=dict, validator=_positive_weights)


class VtcQueue(apsd.FairShareQueue):
    """An apsd aging (ordering) policy implementing VTC."""

    def __init__(self, params: VtcParams, tenant_weights: dict[str, float] | None = None) -> None:
        # alpha = bid_weight = 0: first come first served inside a tenant
        super().__init__(0.0, 0.0, {**(tenant_weights or {}), **params.weights},
                         apsd.ChargeWeights(params.input_weight, params.output_weight))
        self.params = params


def _vtc(params: dict[str, Any], config: apsd.Config) -> VtcQueue:
    parsed = apsd.parse_section(VtcParams, params, "policy.vtc")
    unknown = sorted(set(parsed.weights) - set(config.tenants))
    if unknown:
        raise apsd.ConfigError(f"policy.vtc.weights.{unknown[0]}: no such tenant "
                               f"(tenants: {', '.join(sorted(config.tenants))})")
    return VtcQueue(parsed, apsd.tenant_weights(config))


@apsd.hookimpl
def register_policies(registry: apsd.PolicyRegistry) -> None:
    registry.aging("vtc", _vtc, "Virtual Token Counter fair share (Sheng et al. OSDI '24) [weights]")
    registry.preset("vtc", aging="vtc", governor="fixed", batching="micro")
