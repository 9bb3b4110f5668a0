"""Built-in routing policies: ``least-loaded``, ``prefix`` and ``prefix-hash`` (``[routing] policy``).

* ``least-loaded``: the target with room and the smallest share of its slots in use (then the fewest
  requests, then the first). Reason ``least_loaded``.
* ``prefix`` (the default): a picture of each target's prefix cache, an LRU of the key blocks
  (:func:`apsd.core.routing.routing_key`) of the requests sent there, sized from the target's
  ``cache_tokens`` (a block is ``BLOCK_TOKENS`` tokens, or a trace's ``prefix_block_tokens``). A
  request's *match* on a target is how many of its key's first blocks the picture holds. Two states, as SGLang's router:

  1. *Out of balance* when the fullest target's share of its slots exceeds the emptiest's by more
     than ``balance_abs`` **and** is more than ``balance_rel`` times it: the least loaded target
     (reason ``imbalance``).
  2. Else, the target with the longest match (ties: the least loaded), if that match is at least
     ``cache_threshold`` of the key (reason ``cache_match``); below it, the least loaded target
     (reason ``no_match``): a request nobody holds goes where it waits least, and the cache it
     builds there is found by the next turn. Ties between equally loaded targets go to the one whose
     picture holds least (as SGLang sends a new prefix to its smallest tree), so new conversations at
     light load are spread rather than piled on the first target.

  A chosen target without room (saturated, full) spills: the request goes to the target with room
  and the longest match, ties to the least loaded (reason ``spill``). So a small working set at low
  load is spread as least-loaded spreads it, and a large one is kept where its blocks are.
* ``prefix-hash``: stateless. The first ``hash_blocks`` blocks of the key pick a point on a ring of
  the targets (each at ``RING_POINTS`` points, BLAKE2b of its name); walking the ring from there, the
  first target with room whose load is at most ``load_factor`` x (the mean load + 1) takes it
  (consistent hashing with bounded loads, Mirrokni et al., as KubeAI's router). Every replica that
  sees the same loads gives the same answer, without sharing anything. Reasons ``hash`` (the first
  target on the ring) or ``hash_spill``.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
from collections.abc import Sequence
from typing import Any

import attrs

from apsd.core.config import Config, ConfigError, RoutingConfig
from apsd.core.hookspecs import hookimpl
from apsd.core.models import InferenceRequest
from apsd.core.routing import Route, Target, routing_key

__all__ = ["LeastLoaded", "PrefixHashRouting", "PrefixRouting", "RING_POINTS"]

#: Points per target on ``prefix-hash``'s ring (more: a more even split of the keys).
RING_POINTS = 64


def _least_loaded(targets: Sequence[Target], among: Sequence[int] | None = None,
                  cached: Sequence[int] | None = None) -> int:
    """The index of the least-loaded target with room (any, when none has room); ties to the one whose
    cache holds least (``cached``: blocks per target), then the first."""
    indexes = range(len(targets)) if among is None else among
    return min(indexes, key=lambda i: (not targets[i].room, targets[i].fill, targets[i].load,
                                       cached[i] if cached is not None else 0, i))


@attrs.define(eq=False)
class LeastLoaded:
    """``least-loaded``: see the module docstring."""

    name: str = "least-loaded"

    def route(self, request: InferenceRequest, targets: Sequence[Target]) -> Route:
        return Route(_least_loaded(targets), "least_loaded")

    def placed(self, request: InferenceRequest, target: Target) -> None:
        pass


@attrs.define(eq=False)
class PrefixRouting:
    """``prefix``: see the module docstring. ``pictures`` maps a target's name to its LRU of blocks
    (an ordered dict, most recently used last)."""

    settings: RoutingConfig = RoutingConfig()
    name: str = "prefix"
    pictures: dict[str, collections.OrderedDict[int, None]] = attrs.field(factory=dict)

    def match(self, target: str, key: Sequence[int]) -> int:
        """How many of ``key``'s first blocks ``target``'s picture holds."""
        picture = self.pictures.get(target)
        if not picture:
            return 0
        n = 0
        for block in key:
            if block not in picture:
                break
            n += 1
        return n

    def imbalanced(self, targets: Sequence[Target]) -> bool:
        """The first state's test: the fullest and emptiest targets' shares of their slots differ by
        more than ``balance_abs`` and the fullest's is more than ``balance_rel`` times the emptiest's."""
        fills = [t.fill for t in targets]
        high, low = max(fills), min(fills)
        return high - low > self.settings.balance_abs and high > self.settings.balance_rel * low

    def route(self, request: InferenceRequest, targets: Sequence[Target]) -> Route:
        key = routing_key(request)
        matches = [self.match(t.name, key) for t in targets]
        held = [len(self.pictures.get(t.name, ())) for t in targets]
        if len(targets) > 1 and self.imbalanced(targets):
            choice, reason = _least_loaded(targets, cached=held), "imbalance"
        else:
            best = max(range(len(targets)), key=lambda i: (matches[i], -targets[i].fill, -targets[i].load, -i))
            if key and matches[best] > 0 and matches[best] >= self.settings.cache_threshold * len(key):
                choice, reason = best, "cache_match"
            else:
                choice, reason = _least_loaded(targets, cached=held), "no_match"
        if not targets[choice].room:
            with_room = [i for i, t in enumerate(targets) if t.room]
            if with_room:
                longest = max(matches[i] for i in with_room)
                choice = _least_loaded(targets, [i for i in with_room if matches[i] == longest], held)
                reason = "spill"
        return Route(choice, reason)

    def placed(self, request: InferenceRequest, target: Target) -> None:
        """Remember ``request``'s blocks on ``target``, its first block most recently used (a cache
        evicts a prompt's last blocks first, so a picture keeps a key's start longest)."""
        key = routing_key(request)
        picture = self.pictures.setdefault(target.name, collections.OrderedDict())
        for block in reversed(key):
            picture[block] = None
            picture.move_to_end(block)
        capacity = max(1, target.cache_tokens // request.prefix_block_tokens)
        while len(picture) > capacity:
            picture.popitem(last=False)


def _point(text: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


@attrs.define(eq=False)
class PrefixHashRouting:
    """``prefix-hash``: see the module docstring. The ring is rebuilt when the targets change."""

    settings: RoutingConfig = RoutingConfig()
    name: str = "prefix-hash"
    _ring: list[tuple[int, str]] = attrs.field(factory=list, init=False)
    _ring_of: tuple[str, ...] = attrs.field(default=(), init=False)

    def _ring_for(self, names: tuple[str, ...]) -> list[tuple[int, str]]:
        if names != self._ring_of:
            self._ring = sorted((_point(f"{name}#{i}".encode()), name) for name in names for i in range(RING_POINTS))
            self._ring_of = names
        return self._ring

    def order(self, key: Sequence[int], names: tuple[str, ...]) -> list[str]:
        """The targets in ring order from ``key``'s point: the first is its home."""
        ring = self._ring_for(names)
        start = _point(b"".join(block.to_bytes(8, "big") for block in key[:self.settings.hash_blocks]))
        at = bisect.bisect_left(ring, (start, ""))
        seen: dict[str, None] = {}
        for i in range(len(ring)):
            seen.setdefault(ring[(at + i) % len(ring)][1], None)
            if len(seen) == len(names):
                break
        return list(seen)

    def route(self, request: InferenceRequest, targets: Sequence[Target]) -> Route:
        index = {t.name: i for i, t in enumerate(targets)}
        order = self.order(routing_key(request), tuple(t.name for t in targets))
        mean = sum(t.load for t in targets) / len(targets)
        bound = self.settings.load_factor * (mean + 1)
        for n, name in enumerate(order):
            target = targets[index[name]]
            if target.room and target.load <= bound:
                return Route(index[name], "hash" if n == 0 else "hash_spill")
        return Route(_least_loaded(targets), "hash_spill")

    def placed(self, request: InferenceRequest, target: Target) -> None:
        pass


def _least_loaded_factory(params: dict[str, Any], config: Config) -> LeastLoaded:
    _no_params("least-loaded", params)
    return LeastLoaded()


def _prefix_factory(params: dict[str, Any], config: Config) -> PrefixRouting:
    _no_params("prefix", params)
    return PrefixRouting(config.routing)


def _prefix_hash_factory(params: dict[str, Any], config: Config) -> PrefixHashRouting:
    _no_params("prefix-hash", params)
    return PrefixHashRouting(config.routing)


def _no_params(name: str, params: dict[str, Any]) -> None:
    if params:
        raise ConfigError(f"policy.{name}: the built-in routing policies take their settings from [routing] "
                          f"(got {', '.join(sorted(params))})")


@hookimpl
def register_policies(registry: Any) -> None:
    registry.routing("least-loaded", _least_loaded_factory, "the target with room and the fewest requests")
    registry.routing("prefix", _prefix_factory,
                     "the target holding the longest part of the conversation, unless load is out of balance")
    registry.routing("prefix-hash", _prefix_hash_factory,
                     "consistent hashing of the conversation's start with bounded loads (stateless)")
