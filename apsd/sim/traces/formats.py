"""What a trace format is, and what it reads a row into.

A :class:`TraceFormat` names a file layout (JSON lines or CSV), recognises it from its first row
(:attr:`TraceFormat.recognises`), and turns each row into a :class:`TraceRecord`: the arrival in
seconds, the sizes, and what the trace says of the request beyond them (its tenant, class, bid, prompt
blocks). The formats themselves live in their own modules (:mod:`~apsd.sim.traces.native`,
:mod:`~apsd.sim.traces.mooncake`, :mod:`~apsd.sim.traces.azure`, :mod:`~apsd.sim.traces.burstgpt`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import attrs

from apsd.sim.traces.rows import TraceRow, csv_rows, jsonl_rows
from apsd.sim.workloads import WorkloadError

__all__ = ["RecordContext", "TraceFormat", "TraceRecord", "field_value"]


@attrs.define(slots=True)
class TraceRecord:
    """One request of a trace, as its format reads it (before tenants are assigned and times shifted)."""

    line: int
    #: Its arrival, in seconds (on the trace's own clock; :func:`~apsd.sim.traces.load.load_trace`
    #: shifts foreign formats so the first arrival is at 0).
    at: float
    prompt_tokens: int
    output_tokens: int
    #: Its tenant (None: the trace names none; the tenant rule gives one).
    tenant: str | None = None
    bid: int = 1
    service_class: str | None = None
    #: Its prompt's blocks, in order (equal ids: equal blocks of an equal prefix), each ``block_tokens``
    #: long (the last may be partial); None: no block ids.
    blocks: Sequence[int] | None = None
    block_tokens: int = 0
    #: A shared prefix named instead of block ids: (its name, its tokens); None: none.
    prefix: tuple[str, int] | None = None
    #: Every field of the row, for a tenant rule that hashes one (``hash:FIELD:N``).
    fields: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class RecordContext:
    """What reading a row may depend on beyond the row: the file (for messages), the block size of
    block ids (``--block-tokens``), and whether a tenant rule (``--trace-tenants``) gives rows that name
    no tenant one."""

    path: Path
    block_tokens: int
    tenant_rule: bool = False


@attrs.frozen
class TraceFormat:
    """A trace format: its name, the layout it is read as, how it is recognised, and its rows' reading."""

    name: str
    #: The layouts it comes in: ``"jsonl"`` (JSON lines), ``"csv"`` (a header row, then records).
    layouts: tuple[str, ...]
    description: str
    #: Whether a first row with these field names (a JSON object's keys, a CSV header) is this format.
    recognises: Callable[[Sequence[str]], bool]
    #: Raises ``WorkloadError`` for a CSV header the format does not take (``(path, line, names)``).
    check_header: Callable[[Path, int, list[str]], None]
    #: A row as a record; ``WorkloadError`` naming ``file:line: field`` for a bad one, None to skip it
    #: (a row the format marks as not a request, e.g. one that produced no output).
    read: Callable[[TraceRow, RecordContext], TraceRecord | None]
    #: Whether arrival times are shifted so that the first is at 0 (foreign traces start anywhere).
    shift_to_zero: bool = True

    def rows(self, path: Path, file: IO[str], layout: str) -> Iterator[TraceRow]:
        """The rows of ``file`` in ``layout`` (open as :func:`~apsd.sim.traces.rows.open_trace` opens it)."""
        if layout == "jsonl":
            return jsonl_rows(path, file)
        return csv_rows(path, file, lambda line, names: self.check_header(path, line, names))


def field_value(row: TraceRow, context: RecordContext, name: str, reader: Callable[[Any, bool], Any]) -> Any:
    """Row field ``name`` read by ``reader`` (:mod:`apsd.sim.traces.values`); a missing or bad value is a
    :class:`WorkloadError` naming ``file:line: field``."""
    raw = row.values.get(name)
    if raw is None:
        raise WorkloadError(f"{context.path}:{row.line}: {name}: missing")
    try:
        return reader(raw, row.from_text)
    except ValueError as exc:
        raise WorkloadError(f"{context.path}:{row.line}: {name}: {exc}") from None
