"""Built-in governors (batch window): ``fixed`` and ``entropy``.

``entropy`` is the design's formula: the Shannon entropy ``H = -sum p log2 p`` of
the last ``history`` inter-arrival gaps binned at ``bin_ms``, and the window
``w = base_window * exp(-H / temperature)``. State: ``STABLE`` below
``stable_below_bits``, ``CRITICAL_BURST`` above ``burst_above_bits``,
``TRANSITIONAL`` between. ``H`` is bounded by ``log2(history)``; a burst of
simultaneous arrivals has ``H = 0``. Whether it helps is for the simulator to say.

The view ages with time, not only with arrivals: a gap is forgotten ``forget_after_s``
model seconds after the arrival that closed it. An idle daemon therefore drifts back to
fewer than two remembered gaps (``H = 0``, ``STABLE``, the full window) instead of
reporting the last burst for ever; ``0`` never forgets (the design's formula, literally).
"""

from __future__ import annotations

import collections
import math
from typing import Any

import attrs
import numpy as np

from apsd.core.config import Config, ConfigError, between, parse_section
from apsd.core.hookspecs import hookimpl
from apsd.core.policy import GovernorReading

__all__ = ["EntropyGovernor", "FixedGovernor", "shannon_entropy_bits"]


def shannon_entropy_bits(gaps_s: Any, bin_s: float) -> float:
    """Entropy in bits of ``gaps_s`` binned at ``bin_s`` (0.0 for fewer than two gaps)."""
    gaps = np.asarray(gaps_s, dtype=float)
    if gaps.size < 2:
        return 0.0
    # The tolerance keeps a gap that is a whole number of bins (5 ms, computed as a
    # difference of float timestamps) in its own bin rather than the one below.
    bins = np.floor(gaps / bin_s + 1e-9).astype(np.int64)
    _, counts = np.unique(bins, return_counts=True)
    p = counts / gaps.size
    return float(-(p * np.log2(p)).sum()) + 0.0  # + 0.0 turns -0.0 into 0.0


@attrs.frozen
class FixedParams:
    #: The batch window, in model milliseconds.
    window_ms: float = attrs.field(default=10.0, validator=between(0, 3_600_000))


class FixedGovernor:
    """The same window always."""

    states = ("FIXED",)

    def __init__(self, window_s: float) -> None:
        self._reading = GovernorReading(window_s=window_s, state="FIXED")

    def observe_arrival(self, now: float) -> None:
        pass

    def reading(self, now: float) -> GovernorReading:
        return self._reading


@attrs.frozen
class EntropyParams:
    #: The window at ``H = 0``: ``w = base_window_ms * exp(-H / temperature)``.
    base_window_ms: float = attrs.field(default=10.0, validator=between(0, 3_600_000))
    #: How many of the most recent inter-arrival gaps ``H`` is measured over.
    history: int = attrs.field(default=50, validator=between(2, 1_000_000))
    #: Width of the histogram bins the gaps are sorted into.
    bin_ms: float = attrs.field(default=1.0, validator=between(1e-6, 1e9))
    #: The divisor of ``H`` in the window formula.
    temperature: float = attrs.field(default=5.0, validator=between(1e-6, 1e6))
    #: The state is ``STABLE`` while ``H`` is below this.
    stable_below_bits: float = attrs.field(default=1.5, validator=between(0, 64))
    #: The state is ``CRITICAL_BURST`` while ``H`` is above this (at least ``stable_below_bits``),
    #: ``TRANSITIONAL`` in between.
    burst_above_bits: float = attrs.field(default=2.5, validator=between(0, 64))
    #: Model seconds after which a gap no longer counts (0: never forgotten).
    forget_after_s: float = attrs.field(default=10.0, validator=between(0, 86_400))


def _bin(gap_s: float, bin_s: float) -> int:
    # The tolerance keeps a gap that is a whole number of bins in its own bin (as above).
    return math.floor(gap_s / bin_s + 1e-9)


class EntropyGovernor:
    """Entropy feedback on inter-arrival times.

    Cost: each arrival updates the bin counts of the last ``history`` gaps in
    O(1), and each forgotten gap costs O(1) once; a reading after a change computes
    ``H`` from those counts in O(distinct bins) (at most ``history``), the same value
    :func:`shannon_entropy_bits` gives for the same gaps. ``now`` must not go backwards.
    """

    states = ("STABLE", "TRANSITIONAL", "CRITICAL_BURST")

    def __init__(self, params: EntropyParams) -> None:
        self.params = params
        self._bin_s = params.bin_ms / 1000.0
        #: (model time the gap closed, its bin), oldest first: the remembered gaps.
        self._gaps: collections.deque[tuple[float, int]] = collections.deque()
        self._counts: collections.Counter[int] = collections.Counter()
        self._last_arrival: float | None = None
        self._cached: GovernorReading | None = None

    def _drop_oldest(self) -> None:
        _, old_bin = self._gaps.popleft()
        self._counts[old_bin] -= 1
        if not self._counts[old_bin]:
            del self._counts[old_bin]
        self._cached = None

    def _forget(self, now: float) -> None:
        """Drop the gaps closed more than ``forget_after_s`` before ``now``."""
        memory = self.params.forget_after_s
        if memory:
            gaps = self._gaps
            while gaps and gaps[0][0] < now - memory:
                self._drop_oldest()

    def observe_arrival(self, now: float) -> None:
        self._forget(now)
        if self._last_arrival is not None:
            new_bin = _bin(now - self._last_arrival, self._bin_s)
            self._gaps.append((now, new_bin))
            self._counts[new_bin] += 1
            if len(self._gaps) > self.params.history:
                self._drop_oldest()
        self._last_arrival = now
        self._cached = None

    def entropy_bits(self) -> float:
        """``H`` of the gaps remembered as of the last arrival or reading."""
        n = len(self._gaps)
        if n < 2:
            return 0.0
        h = -sum(c / n * math.log2(c / n) for c in sorted(self._counts.values()))
        return h + 0.0  # + 0.0 turns -0.0 into 0.0

    def reading(self, now: float) -> GovernorReading:
        self._forget(now)
        if self._cached is None:
            p = self.params
            h = self.entropy_bits()
            if h < p.stable_below_bits:
                state = "STABLE"
            elif h > p.burst_above_bits:
                state = "CRITICAL_BURST"
            else:
                state = "TRANSITIONAL"
            window = p.base_window_ms / 1000.0 * math.exp(-h / p.temperature)
            self._cached = GovernorReading(window_s=window, state=state, entropy_bits=h)
        return self._cached


def _fixed(params: dict[str, Any], config: Config) -> FixedGovernor:
    return FixedGovernor(parse_section(FixedParams, params, "policy.fixed").window_ms / 1000.0)


def _entropy(params: dict[str, Any], config: Config) -> EntropyGovernor:
    parsed = parse_section(EntropyParams, params, "policy.entropy")
    if parsed.burst_above_bits < parsed.stable_below_bits:
        raise ConfigError("policy.entropy.burst_above_bits: must be >= stable_below_bits")
    return EntropyGovernor(parsed)


@hookimpl
def register_policies(registry: Any) -> None:
    registry.governor("fixed", _fixed, "constant batch window [window_ms]")
    registry.governor("entropy", _entropy, "window w = base*exp(-H/T) from the entropy of inter-arrival times")
