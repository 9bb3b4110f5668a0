"""Tenant rules: how the requests of a trace that names no tenants are split between tenants
(``apsd simulate --trace FILE --trace-tenants RULE``).

* ``round-robin:N``: the i-th request (in file order) goes to tenant ``i mod N``;
* ``hash:FIELD:N``: by a hash (BLAKE2b, so every run agrees) of the row's field ``FIELD`` (for a list,
  its first item: ``hash:hash_ids:8`` groups a Mooncake trace's requests by their first block, its
  system prompt); a row without the field goes to tenant 0;
* ``zipf:N[:S]``: each request drawn independently, tenant ``k`` with probability proportional to
  ``1 / (k + 1) ** S`` (S = 1 by default), from the seed (``--seed``): a few heavy tenants and a tail.

Tenants are named ``tenant_00`` .. ``tenant_NN`` (:func:`apsd.sim.workloads.tenant_names`). A request
whose row names its tenant keeps it.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from apsd.sim.workloads import WorkloadError, tenant_names

__all__ = ["MAX_RULE_TENANTS", "TenantRule", "parse_tenant_rule"]

#: A rule makes at most this many tenants.
MAX_RULE_TENANTS = 10_000
RULES = "round-robin:N, hash:FIELD:N or zipf:N[:S]"


@attrs.frozen
class TenantRule:
    """A parsed rule (see the module docstring)."""

    kind: str
    tenants: int
    field: str | None = None
    exponent: float = 1.0

    @property
    def names(self) -> list[str]:
        return tenant_names(self.tenants)

    def describe(self) -> str:
        if self.kind == "hash":
            return f"hash:{self.field}:{self.tenants}"
        if self.kind == "zipf":
            return f"zipf:{self.tenants}:{self.exponent:g}"
        return f"round-robin:{self.tenants}"

    def assigner(self, seed: int) -> Callable[[int, Mapping[str, Any]], str]:
        """``assign(i, fields)``: the tenant of the ``i``-th request (file order), whose row has ``fields``."""
        names = self.names
        if self.kind == "round-robin":
            return lambda i, fields: names[i % len(names)]
        if self.kind == "hash":
            field = self.field  # (None: every row goes to tenant 0, as a row without the field does)
            return lambda i, fields: names[_hash(fields.get(field) if field is not None else None) % len(names)]
        weights = 1.0 / np.arange(1, len(names) + 1, dtype=float) ** self.exponent
        cumulative = np.cumsum(weights / weights.sum())
        rng = np.random.default_rng(seed)
        draws: list[float] = []

        def zipf(i: int, fields: Mapping[str, Any]) -> str:
            if not draws:  # (drawn in blocks: one numpy call per 4,096 requests)
                draws.extend(rng.random(4096).tolist()[::-1])
            k = int(np.searchsorted(cumulative, draws.pop(), side="right"))
            return names[min(k, len(names) - 1)]
        return zipf


def _hash(value: Any) -> int:
    if isinstance(value, list):
        value = value[0] if value else None
    if value is None:
        return 0
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def parse_tenant_rule(text: str) -> TenantRule:
    """``round-robin:N``, ``hash:FIELD:N`` or ``zipf:N[:S]``; a :class:`WorkloadError` names what is wrong."""
    kind, _, rest = text.strip().partition(":")
    parts = rest.split(":") if rest else []

    def count(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise WorkloadError(f"--trace-tenants {text!r}: the number of tenants must be an integer, "
                                f"got {raw!r}") from None
        if not 1 <= value <= MAX_RULE_TENANTS:
            raise WorkloadError(f"--trace-tenants {text!r}: the number of tenants must be 1 to "
                                f"{MAX_RULE_TENANTS}, got {value}")
        return value

    if kind == "round-robin" and len(parts) == 1:
        return TenantRule("round-robin", count(parts[0]))
    if kind == "hash" and len(parts) == 2 and parts[0]:
        return TenantRule("hash", count(parts[1]), field=parts[0])
    if kind == "zipf" and len(parts) in (1, 2):
        exponent = 1.0
        if len(parts) == 2:
            try:
                exponent = float(parts[1])
            except ValueError:
                exponent = math.nan
            if not 0 <= exponent <= 10:
                raise WorkloadError(f"--trace-tenants {text!r}: the Zipf exponent must be a number 0 to 10, "
                                    f"got {parts[1]!r}")
        return TenantRule("zipf", count(parts[0]), exponent=exponent)
    raise WorkloadError(f"--trace-tenants {text!r}: expected {RULES}")
