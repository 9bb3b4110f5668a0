"""JSON read strictly: a key repeated within an object is an error, not "last one wins".

Parsers disagree on which of two equal keys counts, so a proxy that validated one value and
apsd that acts on the other would be reading different requests. Every JSON document apsd
reads from outside (request bodies, trace files) goes through :func:`loads`.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["DuplicateKeyError", "loads"]


class DuplicateKeyError(ValueError):
    """``key`` appears twice in one JSON object."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} appears twice in one object")
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return data


def loads(text: str | bytes) -> Any:
    """:func:`json.loads`, but :class:`DuplicateKeyError` for a repeated key in any object
    (``json.JSONDecodeError``, a ValueError too, for malformed text)."""
    return json.loads(text, object_pairs_hook=_unique_pairs)
