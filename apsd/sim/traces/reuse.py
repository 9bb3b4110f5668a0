"""A trace's own prefix reuse: the share of its prompt tokens an infinite prefix cache would hold.

Each request, in arrival order, finds cached the leading blocks of its key that any earlier request's
prompt held whole (its blocks of ``prefix_block_tokens``, up to ``prompt_tokens // prefix_block_tokens``),
at most its prompt less one token (the last is always computed), exactly as the continuous engine
counts a hit (:mod:`apsd.engines.continuous`, prefix cache) but with nothing ever evicted and every
engine's cache one. What a cache-aware router with real caches reaches is measured against it.
"""

from __future__ import annotations

from collections.abc import Iterable

from apsd.sim.records import Arrival

__all__ = ["infinite_cache_share"]


def infinite_cache_share(arrivals: Iterable[Arrival]) -> float:
    """Cached prompt tokens over all prompt tokens, with an infinite cache (0 with no prompt tokens)."""
    seen: set[int] = set()
    cached = total = 0
    for arrival in arrivals:
        total += arrival.prompt_tokens
        key = arrival.prefix_blocks
        if not key:
            continue
        size = arrival.prefix_block_tokens
        n = 0
        for block in key:
            if block not in seen:
                break
            n += 1
        cached += max(0, min(n * size, arrival.prompt_tokens - 1))
        seen.update(key[:arrival.prompt_tokens // size])
    return cached / total if total else 0.0
