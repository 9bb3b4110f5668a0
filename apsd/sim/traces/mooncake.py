"""The Mooncake trace format (FAST '25), also what NVIDIA Dynamo's router benchmarks read.

JSON lines, one request a line::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

* ``timestamp``: milliseconds (shifted so that the first arrival is at 0);
* ``input_length``, ``output_length``: tokens (a row with an output of 0, a request that produced
  nothing, is skipped and counted);
* ``hash_ids``: the ids of the prompt's blocks of ``--block-tokens`` tokens (512 in the published
  traces), in order, the last block possibly partial. Equal ids are equal blocks: a shared system
  prompt shows as a common first id, a conversation's next turn repeats the ids of the one before;
* optional ``tenant`` (a string) and ``session`` (any value: a tenant rule may hash it). Other fields
  are ignored (variants of the format add their own), but may be hashed by a tenant rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from apsd.sim.traces.formats import RecordContext, TraceFormat, TraceRecord, field_value
from apsd.sim.traces.rows import TraceRow
from apsd.sim.traces.values import hash_ids_value, integer_value, name_value, number_value, tokens_value
from apsd.sim.workloads import WorkloadError

__all__ = ["MOONCAKE"]

REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")


def _read(row: TraceRow, context: RecordContext) -> TraceRecord | None:
    values = row.values

    def parse(name: str, reader: Callable[[Any, bool], Any]) -> Any:
        return field_value(row, context, name, reader)

    at = parse("timestamp", number_value) / 1000.0
    prompt = parse("input_length", tokens_value)
    output = parse("output_length", lambda raw, text: integer_value(raw, text, 0, 10**9))
    blocks = parse("hash_ids", hash_ids_value)
    tenant = parse("tenant", name_value) if "tenant" in values else None
    if output == 0:
        return None
    return TraceRecord(line=row.line, at=at, prompt_tokens=prompt, output_tokens=output, tenant=tenant,
                       blocks=blocks, block_tokens=context.block_tokens, fields=values)


def _recognises(names: Sequence[str]) -> bool:
    return "input_length" in names and "hash_ids" in names


def _no_csv(path: Path, line: int, names: list[str]) -> None:
    raise WorkloadError(f"{path}: the mooncake format is JSON lines (.jsonl)")


MOONCAKE = TraceFormat(
    name="mooncake", layouts=("jsonl",),
    description="Mooncake / NVIDIA Dynamo: JSON lines of timestamp (ms), input_length, output_length, hash_ids",
    recognises=_recognises, check_header=_no_csv, read=_read)
