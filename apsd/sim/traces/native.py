"""apsd's own trace format: JSON lines (``.jsonl``) or CSV with a header (``.csv``).

Fields (an unknown one is an error; in CSV an empty cell is a missing value):

* ``at`` (or ``arrival``, or ``time``; one of them): seconds from the start of the simulation, >= 0;
* ``tenant``: a non-empty string (it may be left out when a tenant rule is given);
* ``prompt_tokens``, ``output_tokens``: integers, 1 to 10^9;
* ``bid``: 1-10, default 1;
* ``service_class``: the class it names (``[classes.<name>]`` of the config; optional);
* a prefix key, optional, either ``prefix`` (a name: requests naming the same prefix share their first
  ``prefix_tokens`` tokens, cut into 64-token blocks) with ``prefix_tokens``, or ``hash_ids`` (JSON lines
  only: block ids as the Mooncake format gives them, ``--block-tokens`` tokens each).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from apsd.core.routing import BLOCK_TOKENS
from apsd.sim.traces.formats import RecordContext, TraceFormat, TraceRecord
from apsd.sim.traces.rows import TraceRow
from apsd.sim.traces.values import bid_value, hash_ids_value, integer_value, name_value, time_value, tokens_value
from apsd.sim.workloads import WorkloadError

__all__ = ["FIELDS_HELP", "NATIVE"]

TIME_FIELDS = ("at", "arrival", "time")
FIELDS = ("tenant", "prompt_tokens", "output_tokens", "bid", "service_class", "prefix", "prefix_tokens", "hash_ids")
FIELDS_HELP = ("fields: at (or arrival, time), tenant, prompt_tokens, output_tokens, bid, service_class, "
               "prefix, prefix_tokens, hash_ids")


def _unknown(names: Sequence[str]) -> list[str]:
    return [n for n in names if n not in TIME_FIELDS and n not in FIELDS]


def _unknown_problem(unknown: Sequence[str]) -> str:
    listed = ", ".join(repr(n) for n in unknown)
    return f"unknown field{'s' if len(unknown) > 1 else ''} {listed} ({FIELDS_HELP})"


def _check_header(path: Path, line: int, names: list[str]) -> None:
    unknown = _unknown(names)
    if unknown:
        raise WorkloadError(f"{path}:{line}: {_unknown_problem(unknown)}")
    if "hash_ids" in names:
        raise WorkloadError(f"{path}:{line}: hash_ids: a list of block ids: JSON lines only (use prefix and "
                            "prefix_tokens in CSV)")


def _read(row: TraceRow, context: RecordContext) -> TraceRecord:
    path, values = context.path, row.values

    def error(field: str, problem: str) -> WorkloadError:
        return WorkloadError(f"{path}:{row.line}: {field}: {problem}")

    if not row.from_text:
        unknown = _unknown(list(values))
        if unknown:
            raise WorkloadError(f"{path}:{row.line}: {_unknown_problem(unknown)}")
    times = [name for name in TIME_FIELDS if name in values]
    if len(times) > 1:
        raise error(times[0], f"give the arrival time once (found {', '.join(times)})")

    def parse(name: str, reader: Any, required: bool = True) -> Any:
        raw = values.get(name)
        if raw is None:
            if required:
                raise error(name, "missing")
            return None
        try:
            return reader(raw, row.from_text)
        except ValueError as exc:
            raise error(name, str(exc)) from None

    at = parse(times[0] if times else "at", time_value)
    tenant = parse("tenant", name_value, required=not context.tenant_rule)
    prompt = parse("prompt_tokens", tokens_value)
    output = parse("output_tokens", tokens_value)
    bid = parse("bid", bid_value, required=False) or 1
    service_class = parse("service_class", name_value, required=False)
    record = TraceRecord(line=row.line, at=at, prompt_tokens=prompt, output_tokens=output, tenant=tenant, bid=bid,
                         service_class=service_class, fields=values)
    prefix = parse("prefix", name_value, required=False)
    prefix_tokens = parse("prefix_tokens", lambda raw, text: integer_value(raw, text, 1, prompt), required=False)
    if (prefix is None) != (prefix_tokens is None):
        raise error("prefix" if prefix is None else "prefix_tokens", "missing (prefix and prefix_tokens go together)")
    if prefix is not None:
        if "hash_ids" in values:
            raise error("hash_ids", "give a prefix or hash_ids, not both")
        record.prefix, record.block_tokens = (prefix, prefix_tokens), BLOCK_TOKENS
    elif "hash_ids" in values:
        record.blocks = parse("hash_ids", hash_ids_value)
        record.block_tokens = context.block_tokens
    return record


def _recognises(names: Sequence[str]) -> bool:
    return True   # (the fallback: tried last)


NATIVE = TraceFormat(
    name="apsd", layouts=("jsonl", "csv"), description="apsd's own: at, tenant, prompt_tokens, output_tokens[, bid, "
    "service_class, prefix + prefix_tokens, hash_ids]; JSON lines or CSV",
    recognises=_recognises, check_header=_check_header, read=_read, shift_to_zero=False)
