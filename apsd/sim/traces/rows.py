"""A trace file as rows: JSON lines or CSV, read as a stream (one line at a time, never the whole
file), each row with its line number for error messages.

:func:`jsonl_rows` yields one :class:`TraceRow` per non-blank line (a JSON object); :func:`csv_rows`
one per record after the header (a record may span lines: it is numbered by the line it starts on).
Errors are :class:`~apsd.sim.workloads.WorkloadError` s naming ``file:line``.
"""

from __future__ import annotations

import contextlib
import csv
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import attrs

from apsd.core import strictjson
from apsd.sim.workloads import WorkloadError

__all__ = ["TraceRow", "csv_rows", "jsonl_rows", "open_trace"]


@attrs.frozen(slots=True)
class TraceRow:
    """One record of a trace as read: raw values (strings when from CSV) and its line."""

    line: int
    values: dict[str, Any]
    from_text: bool             # True for CSV cells: numbers still to be parsed


@contextlib.contextmanager
def open_trace(path: Path, newline: str) -> Iterator[IO[str]]:
    """``path`` open for reading as UTF-8 (a byte-order mark skipped); a file that is missing or cannot
    be read or decoded, now or while it is read, is one :class:`WorkloadError` naming it."""
    try:
        file = path.open(encoding="utf-8-sig", newline=newline)
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such trace file") from None
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read trace file: {exc}") from None
    try:
        with file:
            yield file
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"{path}: cannot read trace file: {exc}") from None


def jsonl_rows(path: Path, file: IO[str]) -> Iterator[TraceRow]:
    """One row per non-blank line of ``file`` (opened with ``newline="\\n"``: line numbers as an editor
    shows them), each a JSON object whose keys appear once."""
    for line, raw in enumerate(file, start=1):
        if not raw.strip():
            continue
        try:
            values = strictjson.loads(raw)
        except strictjson.DuplicateKeyError as exc:
            raise WorkloadError(f"{path}:{line}: the field {exc.key!r} appears twice") from None
        except json.JSONDecodeError as exc:
            raise WorkloadError(f"{path}:{line}: invalid JSON: {exc.msg} (column {exc.colno})") from None
        except ValueError as exc:   # (nested too deep, NaN or Infinity, a lone surrogate)
            raise WorkloadError(f"{path}:{line}: invalid JSON: {exc}") from None
        if not isinstance(values, dict):
            raise WorkloadError(f"{path}:{line}: must be a JSON object, got {type(values).__name__}")
        yield TraceRow(line, values, from_text=False)


def csv_rows(path: Path, file: IO[str], check_header: Callable[[int, list[str]], None]) -> Iterator[TraceRow]:
    """One row per record after the header (blank records skipped; an empty cell is a missing value);
    ``check_header(line, names)`` raises for a header the format does not take. ``file`` is opened with
    ``newline=""``."""
    reader = csv.reader(file)
    header: list[str] | None = None
    last_line = 0
    try:
        for cells in reader:
            line, last_line = last_line + 1, reader.line_num  # a record starts after the previous one ends
            if not any(cell.strip() for cell in cells):
                continue
            cells = [cell.strip() for cell in cells]
            if header is None:
                duplicates = sorted({c for c in cells if cells.count(c) > 1})
                check_header(line, cells)
                if duplicates:
                    raise WorkloadError(f"{path}:{line}: duplicate column {duplicates[0]!r}")
                header = cells
                continue
            if len(cells) > len(header):
                raise WorkloadError(f"{path}:{line}: {len(cells)} values but the header has {len(header)} columns")
            yield TraceRow(line, {name: cell for name, cell in zip(header, cells) if cell != ""}, from_text=True)
    except csv.Error as exc:
        raise WorkloadError(f"{path}:{reader.line_num}: invalid CSV: {exc}") from None
