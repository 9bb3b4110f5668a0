"""Reservations that fit agents: a request reserves what it will probably use, not its worst case.

Coding agents ask for ``max_tokens`` 32,000 and use a few hundred tokens of it; sub-agents send
several such requests at once. Reserving the worst case would refuse them (above the tenant's
burst: "it could never be admitted") or pin a tenant's bucket and budget at their caps while
nothing is being spent. So a request reserves (:meth:`OutputEstimates.reservation`):

    reserved = min(prompt + min(max_tokens, estimate), bucket burst)

where ``estimate`` is the tenant's ``output_estimate_tokens`` if it sets one, else the
``[admission] output_estimate_percentile`` of the output lengths of its latest
``output_estimate_window`` completed requests once it has :data:`MIN_SAMPLES` of them, else
``[admission] output_estimate_default``. A request whose prompt alone passes the burst is refused
413 (its prompt is work it is certain to cost); a larger ``max_tokens`` is admitted.

Settlement (:meth:`apsd.core.admission.Admission.settle`) charges what the request really used: the
shortfall, when it generated more than it reserved, is taken from the bucket, which may go below
zero; nothing more is admitted to the tenant until it refilled to the next request's reservation.
So a tenant is held to ``burst + rate·T`` over any window longer than one request: its work up to
``T`` exceeds ``burst + rate·T`` by at most what its requests in flight when the bucket was last
non-negative used beyond their reservations, and that excess is repaid before its next request is
admitted (docs/reference/accounting.md states and proves the bound; tests/unit/test_token_property.py
checks it).

Ownership: admission owns the one :class:`OutputEstimates`, observes every completed request at its
settlement, and asks it at each admission. Learned lengths are this process's own (replicas learn
each from what it served). No clock, no I/O.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

import attrs

from apsd.core.config import AdmissionConfig, TenantConfig

__all__ = ["MIN_SAMPLES", "OutputEstimates"]

#: Completed requests of a tenant before its own output lengths replace ``output_estimate_default``.
MIN_SAMPLES = 10


@attrs.define
class _Recent:
    lengths: collections.deque[int]
    #: The estimate of ``lengths`` as last computed (None: to compute again).
    estimate: int | None = None


@attrs.define(eq=False)
class OutputEstimates:
    """Each tenant's recent output lengths, and the output its requests reserve."""

    settings: AdmissionConfig = attrs.field(factory=AdmissionConfig)
    _recent: dict[str, _Recent] = attrs.field(factory=dict)

    def observe(self, tenant_id: str, tokens: int) -> None:
        """A request of ``tenant_id`` completed having generated ``tokens`` tokens."""
        recent = self._recent.get(tenant_id)
        window = self.settings.output_estimate_window
        if recent is None or recent.lengths.maxlen != window:
            recent = self._recent[tenant_id] = _Recent(collections.deque(recent.lengths if recent else (), window))
        recent.lengths.append(tokens)
        recent.estimate = None

    def learned(self, tenant_id: str) -> int | None:
        """The percentile of the tenant's recent output lengths (None: fewer than :data:`MIN_SAMPLES`)."""
        recent = self._recent.get(tenant_id)
        if recent is None or len(recent.lengths) < MIN_SAMPLES:
            return None
        if recent.estimate is None:
            ordered = sorted(recent.lengths)
            rank = math.ceil(self.settings.output_estimate_percentile / 100 * len(ordered))  # (nearest rank)
            recent.estimate = max(1, ordered[max(0, rank - 1)])
        return recent.estimate

    def estimate(self, tenant_id: str, tenant: TenantConfig) -> int:
        """Output tokens a request of the tenant reserves at most."""
        if tenant.output_estimate_tokens:
            return tenant.output_estimate_tokens
        learned = self.learned(tenant_id)
        return learned if learned is not None else self.settings.output_estimate_default

    def reservation(self, tenant_id: str, tenant: TenantConfig, prompt: int, requested: int,
                    burst: float) -> tuple[int, int]:
        """(tokens reserved, of which output) for a request of ``prompt`` tokens that may generate
        ``requested``, against a bucket of ``burst`` (``prompt <= burst``: checked by admission)."""
        output = min(requested, self.estimate(tenant_id, tenant))
        total = min(prompt + output, int(burst))
        return total, total - prompt

    def forget(self, tenants: Iterable[str]) -> None:
        """Drop what was learned of tenants no longer configured."""
        for name in list(self._recent):
            if name not in tenants:
                del self._recent[name]
