"""The Azure LLM inference traces (Azure Public Dataset, 2023 and 2024): CSV with a header.

``TIMESTAMP`` (a date and time, ``2023-11-16 18:15:46.6805900``, or seconds), ``ContextTokens`` (the
prompt) and ``GeneratedTokens`` (the output; a row with 0 is skipped and counted). Times are shifted
so that the first arrival is at 0. No tenants, no prompt contents: a tenant rule splits the requests,
and there is no prefix to share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from apsd.sim.traces.formats import RecordContext, TraceFormat, TraceRecord, field_value
from apsd.sim.traces.rows import TraceRow
from apsd.sim.traces.values import integer_value, timestamp_value
from apsd.sim.workloads import WorkloadError

__all__ = ["AZURE"]

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _check_header(path: Path, line: int, names: list[str]) -> None:
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        raise WorkloadError(f"{path}:{line}: the Azure trace format needs the columns {', '.join(COLUMNS)} "
                            f"(missing {', '.join(missing)})")


def _read(row: TraceRow, context: RecordContext) -> TraceRecord | None:
    values = row.values

    def parse(name: str, reader: Callable[[Any, bool], Any]) -> Any:
        return field_value(row, context, name, reader)

    at = parse("TIMESTAMP", timestamp_value)
    prompt = parse("ContextTokens", lambda raw, text: integer_value(raw, text, 0, 10**9))
    output = parse("GeneratedTokens", lambda raw, text: integer_value(raw, text, 0, 10**9))
    if prompt == 0 or output == 0:
        return None
    return TraceRecord(line=row.line, at=at, prompt_tokens=prompt, output_tokens=output, fields=values)


def _recognises(names: Sequence[str]) -> bool:
    return "ContextTokens" in names and "GeneratedTokens" in names


AZURE = TraceFormat(name="azure", layouts=("csv",),
                    description="Azure LLM inference traces: CSV of TIMESTAMP, ContextTokens, GeneratedTokens",
                    recognises=_recognises, check_header=_check_header, read=_read)
