"""A built-in workload's parameters: the limits every workload shares, :class:`Param` (a default whose
type is the parameter's, and a range) and the kinds of parameter the built-ins use; :class:`WorkloadError`,
the one error of workloads and traces."""

from __future__ import annotations

import math

import attrs

from apsd.core.config import SEED_KV_CAP_TOKENS, TenantConfig

#: The bucket every tenant gets unless a scenario is about throttling (none is yet).
UNTHROTTLED = TenantConfig(rate=1e6, burst=10**9)
#: A workload may hold at most this many arrivals (built or loaded).
MAX_ARRIVALS = 2_000_000
#: The batch engine's KV cache per batch: every built-in request fits it.
KV_CAPACITY_TOKENS = SEED_KV_CAP_TOKENS
#: Random prompt and output sizes are clipped to ``1..MAX_RANDOM_TOKENS`` each.
MAX_RANDOM_TOKENS = KV_CAPACITY_TOKENS // 2


class WorkloadError(Exception):
    """A workload problem: one line naming the workload and parameter, or ``file:line: field``."""


@attrs.frozen
class Param:
    """One parameter of a built-in: its default (whose type is the parameter's type) and range."""

    default: int | float
    low: float = 0
    high: float = math.inf
    #: ``True`` when ``low`` itself is refused (``rate`` must be > 0, not >= 0).
    exclusive_low: bool = False

    def check(self, value: object) -> int | float:
        """The value converted to the parameter's type; ``ValueError`` says what is wrong."""
        given = value
        if isinstance(self.default, int):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"must be an integer, got {value!r}")
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"must be a number, got {value!r}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"must be a finite number, got {value!r}")
        if self.exclusive_low and value <= self.low:
            raise ValueError(f"must be > {self.low:g}, got {given!r}")
        if not self.low <= value <= self.high:
            if self.high == math.inf:
                raise ValueError(f"must be >= {self.low:g}, got {given!r}")
            raise ValueError(f"must be between {self.low:g} and {self.high:g}, got {given!r}")
        return value


def positive(default: float, high: float = 1e6) -> Param:
    """A number > 0 (a rate or a duration)."""
    return Param(float(default), 0, high, exclusive_low=True)


def count(default: int, low: int = 0, high: int = MAX_ARRIVALS) -> Param:
    return Param(default, low, high)


def tokens(default: int) -> Param:
    return Param(default, 1, KV_CAPACITY_TOKENS - 1)


def bid(default: int) -> Param:
    return Param(default, 1, 10)


def mean_tokens(default: float) -> Param:
    return Param(float(default), 1, MAX_RANDOM_TOKENS)


def sigma(default: float) -> Param:
    """A lognormal sigma; 0 makes the size fixed at its mean."""
    return Param(float(default), 0, 3)
