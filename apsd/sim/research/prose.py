"""Figures in research.md's prose and table cells: one format per kind of figure ("n/a" when missing)."""

from __future__ import annotations

from collections.abc import Sequence


def pct(x: float | None) -> str:
    """A fraction in prose: percent with one decimal and the sign."""
    return "n/a" if x is None else f"{x * 100:.1f}%"


def pct_cell(x: float | None) -> str:
    """A fraction in a table cell: percent, one decimal (unit in the header)."""
    return "n/a" if x is None else f"{x * 100:.1f}"


def usd(x: float | None) -> str:
    return "n/a" if x is None else f"${x:.2f}"


def seconds(ms: float | None) -> str:
    """A duration in prose: seconds with the unit, one decimal (three below a second)."""
    if ms is None:
        return "n/a"
    return f"{ms / 1000:.1f} s" if abs(ms) >= 1000 else f"{ms / 1000:.3f} s"


def sec_cell(ms: float | None) -> str:
    """A duration in a table cell: seconds with three decimals, as in the comparison tables (unit in the header)."""
    return "n/a" if ms is None else f"{ms / 1000:.3f}"


def change(new: float | None, old: float | None) -> str:
    """``new`` against ``old``, as a signed percentage."""
    if new is None or old is None or old == 0:
        return "n/a"
    return f"{(new - old) / old * 100:+.1f}%"


def ratio(new: float | None, old: float | None) -> str:
    return "n/a" if new is None or not old else f"{new / old:,.1f}×"


def jain_cell(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def whole(x: float | None) -> str:
    """A number rounded to a whole one, thousands separated; an em dash when missing."""
    return "—" if x is None else f"{x:,.0f}"


def listing(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]


def names(items: Sequence[str]) -> str:
    """Names in backticks, listed: ```a`, `b` and `c```."""
    return listing([f"`{item}`" for item in items])
