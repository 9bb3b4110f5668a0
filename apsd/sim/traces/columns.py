"""A trace's arrivals held as columns: numpy arrays, not a Python object per request.

:class:`TraceArrivals` is the :attr:`~apsd.sim.records.Workload.arrivals` of a trace: a read-only
sequence whose items are made when read (:class:`~apsd.sim.records.Arrival`), so a trace of millions
of requests costs a few arrays; the runner makes each arrival as it submits it. The prompt keys are one
flat array of block keys with an offset per request. :class:`ArrivalColumns` builds it from
:class:`~apsd.sim.traces.formats.TraceRecord` s as they are read, then sorts by arrival (stable: file
order on ties).

Keys: a trace's block ids are chained (each key covers its block and every block before it, as
:func:`apsd.core.routing.chain_blocks` does for text) with Python's hash of a pair of integers, which
every run computes alike: equal keys mean equal prefixes even if a trace reused an id elsewhere. A
named prefix (apsd's own ``prefix`` / ``prefix_tokens``) becomes :func:`apsd.core.routing.synthetic_blocks`.
"""

from __future__ import annotations

import array
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
from numpy.typing import NDArray

from apsd.core.routing import BLOCK_TOKENS, synthetic_blocks
from apsd.sim.records import Arrival
from apsd.sim.traces.formats import TraceRecord

__all__ = ["ArrivalColumns", "TraceArrivals", "chain_ids"]


_MASK = 2**64 - 1


def chain_ids(ids: Sequence[int]) -> list[int]:
    """Block ids as chained keys: key ``i`` stands for ids ``0..i`` (an unsigned 64-bit integer each, as
    :func:`apsd.core.routing.chain_blocks` makes them)."""
    keys = []
    previous = 0
    for block in ids:
        previous = hash((previous, block)) & _MASK
        keys.append(previous)
    return keys


#: A column of integers (of the width its array.array had).
Ints = NDArray[np.integer[Any]]


class TraceArrivals(Sequence[Arrival]):
    """The arrivals of a trace, sorted by time; an :class:`Arrival` is made each time one is read."""

    def __init__(self, at: NDArray[np.float64], tenant: Ints, tenants: list[str], prompt: Ints, output: Ints,
                 bid: Ints, service_class: Ints, classes: list[str | None], offsets: NDArray[np.int64],
                 keys: NDArray[np.uint64], block_tokens: Ints) -> None:
        self._at, self._tenant, self._tenants = at, tenant, tenants
        self._prompt, self._output, self._bid = prompt, output, bid
        self._class, self._classes = service_class, classes
        self._offsets, self._keys, self._block_tokens = offsets, keys, block_tokens

    def __len__(self) -> int:
        return len(self._at)

    def _make(self, i: int) -> Arrival:
        tokens = int(self._block_tokens[i])
        key = tuple(self._keys[self._offsets[i]:self._offsets[i + 1]].tolist()) if tokens else None
        return Arrival(at=float(self._at[i]), tenant=self._tenants[self._tenant[i]], prompt_tokens=int(self._prompt[i]),
                       output_tokens=int(self._output[i]), bid=int(self._bid[i]), prefix_blocks=key,
                       service_class=self._classes[self._class[i]], prefix_block_tokens=tokens or BLOCK_TOKENS)

    @overload
    def __getitem__(self, index: int) -> Arrival: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Arrival, ...]: ...

    def __getitem__(self, index: int | slice) -> Arrival | tuple[Arrival, ...]:
        if isinstance(index, slice):
            return tuple(self._make(i) for i in range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("arrival index out of range")
        return self._make(index)

    def __iter__(self) -> Iterator[Arrival]:
        return (self._make(i) for i in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash((len(self), float(self._at.sum()) if len(self) else 0.0))

    def __repr__(self) -> str:
        return f"TraceArrivals({len(self)} arrivals)"

    @property
    def tenants(self) -> list[str]:
        """The tenants that have arrivals, in order of first appearance in the file."""
        return list(self._tenants)

    @property
    def classes(self) -> list[str]:
        """The service classes the arrivals name, in order of first appearance."""
        return [c for c in self._classes if c is not None]


class ArrivalColumns:
    """Collects records (:meth:`add`), then :meth:`finish` sorts them into a :class:`TraceArrivals`."""

    def __init__(self) -> None:
        self._at = array.array("d")
        self._tenant = array.array("l")
        self._prompt = array.array("q")
        self._output = array.array("q")
        self._bid = array.array("b")
        self._class = array.array("l")
        self._offsets = array.array("q", [0])
        self._keys = array.array("Q")
        self._block_tokens = array.array("l")
        self._tenants: dict[str, int] = {}
        self._classes: dict[str | None, int] = {None: 0}

    def __len__(self) -> int:
        return len(self._at)

    def add(self, record: TraceRecord, tenant: str) -> None:
        """Append ``record`` as a request of ``tenant``."""
        self._at.append(record.at)
        self._tenant.append(self._tenants.setdefault(tenant, len(self._tenants)))
        self._prompt.append(record.prompt_tokens)
        self._output.append(record.output_tokens)
        self._bid.append(record.bid)
        self._class.append(self._classes.setdefault(record.service_class, len(self._classes)))
        if record.blocks is not None:
            self._keys.extend(chain_ids(record.blocks))
            self._block_tokens.append(record.block_tokens)
        elif record.prefix is not None:
            name, tokens = record.prefix
            prefix_id = int.from_bytes(hashlib.blake2b(name.encode("utf-8", "surrogatepass"), digest_size=8).digest(),
                                       "big")
            self._keys.extend(synthetic_blocks((prefix_id, tokens), len(self._at), record.prompt_tokens))
            self._block_tokens.append(record.block_tokens)
        else:
            self._block_tokens.append(0)
        self._offsets.append(len(self._keys))

    def finish(self, shift_to_zero: bool) -> TraceArrivals:
        """The arrivals sorted by time (stable), shifted so that the first is at 0 when ``shift_to_zero``."""
        at = np.frombuffer(self._at, dtype=np.float64).copy()
        columns = [np.frombuffer(c, dtype=np.dtype(c.typecode)).copy() for c in
                   (self._tenant, self._prompt, self._output, self._bid, self._class, self._block_tokens)]
        offsets = np.frombuffer(self._offsets, dtype=np.int64).copy()
        keys = np.frombuffer(self._keys, dtype=np.uint64).copy()
        if len(at) and np.any(np.diff(at) < 0):
            order = np.argsort(at, kind="stable")
            at = at[order]
            columns = [c[order] for c in columns]
            lengths = np.diff(offsets)[order]
            starts = offsets[:-1][order]
            new_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            gather = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1], dtype=np.int64)
            keys, offsets = keys[gather], new_offsets
        if shift_to_zero and len(at):
            at = at - at[0]
        tenant, prompt, output, bid, service_class, block_tokens = columns
        classes: list[str | None] = [None] * len(self._classes)
        for name, index in self._classes.items():
            classes[index] = name
        return TraceArrivals(at, tenant, list(self._tenants), prompt, output, bid, service_class, classes,
                             offsets, keys, block_tokens)


