"""JSON read strictly: a key repeated within an object is an error, not "last one wins".

Parsers disagree on which of two equal keys counts, so a proxy that validated one value and
apsd that acts on the other would be reading different requests. Every JSON document apsd
reads from outside (request bodies, trace files) goes through :func:`loads`.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["DuplicateKeyError", "MAX_DEPTH", "NonStandardJSONError", "TooDeepError", "loads"]

#: Deepest nesting of arrays and objects accepted. Python's parser recurses in C and the code that
#: copies, walks or re-encodes a document recurses in Python: a 1 KB body nested 700 deep would
#: otherwise end in RecursionError wherever it is next touched. Real requests nest a dozen levels
#: (a JSON schema in ``response_format`` a few dozen).
MAX_DEPTH = 100

#: A JSON string escape of a UTF-16 surrogate (``\ud83d``): legal in pairs, a lone one is not text.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE = re.compile("[\ud800-\udfff]")


class DuplicateKeyError(ValueError):
    """``key`` appears twice in one JSON object."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} appears twice in one object")
        self.key = key


class TooDeepError(ValueError):
    """Arrays and objects nested deeper than :data:`MAX_DEPTH`."""

    def __init__(self) -> None:
        super().__init__(f"arrays and objects are nested more than {MAX_DEPTH} levels deep")


class NonStandardJSONError(ValueError):
    """``NaN``/``Infinity`` (Python's extension, not JSON) or a lone surrogate (not Unicode text)."""


def _no_constants(name: str) -> Any:
    raise NonStandardJSONError(f"{name} is not JSON (numbers must be finite)")


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
    """:func:`json.loads`, but strict: :class:`DuplicateKeyError` for a repeated key in any object,
    :class:`TooDeepError` past :data:`MAX_DEPTH`, :class:`NonStandardJSONError` for ``NaN``,
    ``Infinity`` or a lone surrogate (``json.JSONDecodeError``, a ValueError too, for malformed
    text). Every error is a ValueError; nothing else escapes (not even RecursionError)."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_pairs, parse_constant=_no_constants)
    except RecursionError:
        raise TooDeepError() from None
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    _check_depth_and_text(data, check_text=_SURROGATE_ESCAPE.search(raw) is not None)
    return data


def _check_depth_and_text(data: Any, *, check_text: bool) -> None:
    """Raise TooDeepError past MAX_DEPTH; with ``check_text``, NonStandardJSONError for a string
    (value or key) holding a lone surrogate. Iterative: no recursion on a client's document."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            items: Any = value.values()
            if check_text and any(_SURROGATE.search(key) for key in value):
                raise NonStandardJSONError("a key holds a lone UTF-16 surrogate (not Unicode text)")
        elif isinstance(value, list):
            items = value
        else:
            if check_text and isinstance(value, str) and _SURROGATE.search(value):
                raise NonStandardJSONError("a string holds a lone UTF-16 surrogate (not Unicode text)")
            continue
        if depth > MAX_DEPTH:
            raise TooDeepError()
        for item in items:
            if isinstance(item, (dict, list)) or check_text and isinstance(item, str):
                stack.append((item, depth + 1))
