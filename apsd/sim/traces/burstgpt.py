"""The BurstGPT trace format (Wang et al., 2024): CSV with the header
``Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type``.

``Timestamp`` is seconds from the trace's start (shifted so that the first arrival is at 0),
``Request tokens`` the prompt, ``Response tokens`` the output (0 for a request that failed: skipped and
counted). ``Model`` (``ChatGPT``, ``GPT-4``) and ``Log Type`` (``Conversation log``, ``API log``) are kept
for a tenant rule to hash (``hash:Model:2``). ``Total tokens`` is not read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from apsd.sim.traces.formats import RecordContext, TraceFormat, TraceRecord, field_value
from apsd.sim.traces.rows import TraceRow
from apsd.sim.traces.values import integer_value, time_value
from apsd.sim.workloads import WorkloadError

__all__ = ["BURSTGPT"]

COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")


def _check_header(path: Path, line: int, names: list[str]) -> None:
    missing = [c for c in ("Timestamp", "Request tokens", "Response tokens") if c not in names]
    if missing:
        raise WorkloadError(f"{path}:{line}: the BurstGPT format needs the columns {', '.join(COLUMNS)} "
                            f"(missing {', '.join(missing)})")


def _read(row: TraceRow, context: RecordContext) -> TraceRecord | None:
    values = row.values

    def parse(name: str, reader: Callable[[Any, bool], Any]) -> Any:
        return field_value(row, context, name, reader)

    at = parse("Timestamp", time_value)
    prompt = parse("Request tokens", lambda raw, text: integer_value(raw, text, 0, 10**9))
    output = parse("Response tokens", lambda raw, text: integer_value(raw, text, 0, 10**9))
    if prompt == 0 or output == 0:
        return None
    return TraceRecord(line=row.line, at=at, prompt_tokens=prompt, output_tokens=output, fields=values)


def _recognises(names: Sequence[str]) -> bool:
    return "Request tokens" in names and "Response tokens" in names


BURSTGPT = TraceFormat(name="burstgpt", layouts=("csv",),
                       description="BurstGPT: CSV of Timestamp, Model, Request tokens, Response tokens, Total "
                                   "tokens, Log Type",
                       recognises=_recognises, check_header=_check_header, read=_read)
