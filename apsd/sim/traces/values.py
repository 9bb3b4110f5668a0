"""Reading one value of a trace: numbers, integers, times, names; each problem a ``ValueError`` whose
message the caller prefixes with ``file:line: field:`` (:class:`~apsd.sim.workloads.WorkloadError`).

``from_text`` is True for CSV cells (strings still to be parsed) and False for JSON values (already
typed: a JSON string where a number belongs is an error, never converted).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

__all__ = ["MAX_BLOCK_ID", "MAX_TRACE_TOKENS", "bid_value", "hash_ids_value", "integer_value", "name_value", "number_value", "time_value",
           "timestamp_value", "tokens_value"]

#: A trace's sizes may be up to this (what ``POST /infer`` accepts); admission judges the rest.
MAX_TRACE_TOKENS = 1_000_000_000
#: Block ids are integers 0 .. this (64 bits, unsigned).
MAX_BLOCK_ID = 2**64 - 1


def number_value(raw: Any, from_text: bool) -> float:
    """A finite number."""
    if from_text:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"must be a number, got {raw!r}") from None
    elif isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ValueError(f"must be a number, got {raw!r}")
    else:
        value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"must be a finite number, got {raw!r}")
    return value


def integer_value(raw: Any, from_text: bool, low: int, high: int) -> int:
    """An integer in ``low..high``."""
    if from_text:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"must be an integer, got {raw!r}") from None
    elif isinstance(raw, bool) or not isinstance(raw, int):
        raise ValueError(f"must be an integer, got {raw!r}")
    else:
        value = raw
    if not low <= value <= high:
        raise ValueError(f"must be between {low} and {high}, got {value}")
    return value


def time_value(raw: Any, from_text: bool) -> float:
    """Seconds, >= 0."""
    value = number_value(raw, from_text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {raw!r}")
    return value


def timestamp_value(raw: Any, from_text: bool) -> float:
    """A point in time as seconds: a number, or an ISO 8601 date and time (``2023-11-16 18:15:46.6805900``,
    as the Azure traces write it), as seconds since the epoch (a time without a zone is read as UTC)."""
    if from_text:
        try:
            return number_value(raw, True)
        except ValueError:
            pass
        try:
            moment = datetime.fromisoformat(raw.strip())
        except ValueError:
            raise ValueError(f"must be a number of seconds or a date and time, got {raw!r}") from None
        if moment.tzinfo is None:
            return (moment - datetime(1970, 1, 1)).total_seconds()
        return moment.timestamp()
    return number_value(raw, False)


def name_value(raw: Any, from_text: bool) -> str:
    """A non-empty string, stripped."""
    if not isinstance(raw, str):
        raise ValueError(f"must be a string, got {raw!r}")
    if not raw.strip():
        raise ValueError("must not be empty")
    return raw.strip()


def tokens_value(raw: Any, from_text: bool) -> int:
    return integer_value(raw, from_text, 1, MAX_TRACE_TOKENS)


def bid_value(raw: Any, from_text: bool) -> int:
    return integer_value(raw, from_text, 1, 10)


def hash_ids_value(raw: Any, from_text: bool) -> list[int]:
    """A JSON list of block ids: integers 0 to 2^64 - 1 (possibly empty)."""
    if from_text or not isinstance(raw, list):
        raise ValueError(f"must be a list of integers, got {raw!r}")
    for n, value in enumerate(raw):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BLOCK_ID:
            raise ValueError(f"item {n}: must be an integer between 0 and {MAX_BLOCK_ID}, got {value!r}")
    return raw
