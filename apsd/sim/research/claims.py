"""Every number research.md compares measurements against, in one place: what the design
documents claim, and when a measured difference counts as one.

The verdicts of :mod:`~apsd.sim.research.design`, :mod:`~apsd.sim.research.continuous` and
:mod:`~apsd.sim.research.isolation` compare with these and print them from here, so a verdict's
threshold and its wording cannot drift apart.
"""

from __future__ import annotations

# -- what the design claims ----------------------------------------------------------------------

#: The GPU utilisation the design claims ("95% GPU utilization"), as a fraction of the time.
CLAIMED_GPU_UTILIZATION = 0.95
#: The cost the design claims per 1M output tokens, in USD ("$0.53 per 1M tokens").
CLAIMED_COST_PER_1M_TOKENS_USD = 0.53
#: The Jain's fairness index the design claims for APS ("Jain's fairness 0.94").
CLAIMED_JAIN = 0.94
#: The lower Jain's index that one of the design documents gives instead.
CLAIMED_JAIN_ELSEWHERE = 0.67
#: What the design says of the entropy governor, quoted.
CLAIMED_GOVERNOR = "prevents phase transitions into congestion"
#: What the design warns of under a static priority, quoted.
CLAIMED_STARVATION = "high-volume tenants can starve low-volume ones"

# -- when a difference counts --------------------------------------------------------------------

#: A time (p99 latency, median TTFT) changed when it moved by more than this fraction of the control's.
MATERIAL_CHANGE = 0.05
#: Jain's indices closer than this are the same.
JAIN_TIE = 0.005
#: A figure (a wait, a latency, a mean service difference) within this factor of the best ties with it.
TIE_RATIO = 1.005
#: Tenants' shares of the service are "in proportion to" their shares of the demand within this many
#: percentage points.
SHARE_TOLERANCE_PCT = 5.0
#: A whole run's largest service difference grew when it exceeds its first half's by more than this factor.
GROWTH_RATIO = 1.25
#: A run lightly loads the continuous engine below this fraction of a full engine's throughput.
LIGHT_LOAD = 0.5
#: A median queue wait is the fixed batch window when within this many milliseconds of it.
WINDOW_MATCH_MS = 0.5
#: A request waited no longer than the batch window when its wait exceeds it by at most this many
#: milliseconds (what rounding leaves).
WINDOW_ROUNDING_MS = 1e-3


def percent(fraction: float) -> str:
    """A threshold in prose: ``0.95`` -> ``95%``."""
    return f"{fraction * 100:g}%"
