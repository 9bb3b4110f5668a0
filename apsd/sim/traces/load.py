"""Loading a trace: its layout from the file name, its format from its first row (or as asked), its
records streamed into columns (:mod:`~apsd.sim.traces.columns`), its tenants from the trace or a rule.

Layout: ``.jsonl`` (or ``.json``, one object a line) or ``.csv``. Format, when not given: the first
format among Mooncake, Azure and BurstGPT that recognises the first row's field names (a JSON object's
keys, the CSV header), else apsd's own (:mod:`~apsd.sim.traces.native`).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from apsd.core.config import TenantConfig
from apsd.sim.records import Workload
from apsd.sim.traces.azure import AZURE
from apsd.sim.traces.burstgpt import BURSTGPT
from apsd.sim.traces.columns import ArrivalColumns
from apsd.sim.traces.formats import RecordContext, TraceFormat
from apsd.sim.traces.mooncake import MOONCAKE
from apsd.sim.traces.native import NATIVE
from apsd.sim.traces.rows import open_trace
from apsd.sim.traces.split import TenantRule, parse_tenant_rule
from apsd.sim.workloads import MAX_ARRIVALS, UNTHROTTLED, WorkloadError

__all__ = ["DEFAULT_BLOCK_TOKENS", "FORMATS", "LAYOUTS", "detect_format", "load_trace"]

#: The formats by name; detection tries them in this order (apsd's own, which takes anything, last).
FORMATS: dict[str, TraceFormat] = {f.name: f for f in (MOONCAKE, AZURE, BURSTGPT, NATIVE)}
#: File name endings and the layout each is read as.
LAYOUTS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
#: Tokens per block id (``hash_ids``) unless told otherwise: the published Mooncake traces' 512.
DEFAULT_BLOCK_TOKENS = 512


def _layout(path: Path) -> str:
    layout = LAYOUTS.get(path.suffix.lower())
    if layout is None:
        raise WorkloadError(f"{path}: unknown trace format {path.suffix or '(no extension)'!r} (use .jsonl or .csv)")
    return layout


def _first_names(path: Path, layout: str) -> list[str]:
    """The field names of ``path``'s first row: the first JSON object's keys, or the CSV header."""
    with open_trace(path, newline="\n" if layout == "jsonl" else "") as file:
        if layout == "csv":
            for cells in csv.reader(file):
                if any(cell.strip() for cell in cells):
                    return [cell.strip() for cell in cells]
            return []
        for raw in file:
            if raw.strip():
                try:
                    values = json.loads(raw)
                except ValueError:
                    return []   # (reading it as apsd's own reports the problem with its line)
                return list(values) if isinstance(values, dict) else []
    return []


def detect_format(path: str | Path) -> TraceFormat:
    """The format of trace ``path``, from its layout and first row (see the module docstring)."""
    path = Path(path)
    layout = _layout(path)
    names = _first_names(path, layout)
    return next(f for f in FORMATS.values() if layout in f.layouts and f.recognises(names))


def load_trace(path: str | Path, *, format: str | None = None, block_tokens: int = DEFAULT_BLOCK_TOKENS,
               tenants: str | TenantRule | None = None, seed: int = 1) -> Workload:
    """A workload replaying trace ``path``.

    ``format``: a name of :data:`FORMATS` (None: detected). ``block_tokens``: tokens per block id.
    ``tenants``: the rule (:mod:`~apsd.sim.traces.split`) for requests whose row names no tenant; without
    one, a foreign trace's requests all go to ``tenant_00`` and apsd's own format requires ``tenant``.
    ``seed``: the ``zipf`` rule's. Every tenant gets :data:`~apsd.sim.workloads.UNTHROTTLED`'s bucket and
    may use every service class the trace names (the config must define them). The workload is named
    after the file's stem. Rows the format marks as no request (an output of 0 tokens) are skipped and
    counted in the description. Every problem is a :class:`WorkloadError`: ``file:line: field: problem``.
    """
    path = Path(path)
    layout = _layout(path)
    if format is None:
        fmt = detect_format(path)
    else:
        named = FORMATS.get(format)
        if named is None:
            raise WorkloadError(f"--trace-format {format!r}: unknown (formats: {', '.join(FORMATS)})")
        fmt = named
        if layout not in fmt.layouts:
            raise WorkloadError(f"{path}: the {fmt.name} format is {' or '.join(fmt.layouts)}, not {layout}")
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or not 1 <= block_tokens <= 1 << 20:
        raise WorkloadError(f"--block-tokens: must be an integer 1 to {1 << 20}, got {block_tokens!r}")
    rule = parse_tenant_rule(tenants) if isinstance(tenants, str) else tenants
    if rule is None and fmt is not NATIVE:
        rule = TenantRule("round-robin", 1)
    assign = rule.assigner(seed) if rule is not None else None
    context = RecordContext(path=path, block_tokens=block_tokens, tenant_rule=rule is not None)
    columns = ArrivalColumns()
    skipped = 0
    with open_trace(path, newline="\n" if layout == "jsonl" else "") as file:
        for row in fmt.rows(path, file, layout):
            record = fmt.read(row, context)
            if record is None:
                skipped += 1
                continue
            if len(columns) == MAX_ARRIVALS:
                raise WorkloadError(f"{path}:{row.line}: more than {MAX_ARRIVALS:,} arrivals (the limit)")
            tenant = record.tenant
            if tenant is None:
                assert assign is not None
                tenant = assign(len(columns), record.fields)
            columns.add(record, tenant)
    if not len(columns):
        raise WorkloadError(f"{path}: empty trace (no arrivals)")
    arrivals = columns.finish(fmt.shift_to_zero)
    classes = tuple(arrivals.classes)
    bucket = UNTHROTTLED if not classes else TenantConfig(rate=UNTHROTTLED.rate, burst=UNTHROTTLED.burst,
                                                           classes=classes)
    names = arrivals.tenants
    span = arrivals[-1].at - arrivals[0].at
    description = (f"trace {path} ({fmt.name}): {len(arrivals):,} arrivals from {len(names)} tenants over {span:g} s"
                   + (f", tenants by {rule.describe()}" if rule is not None else "")
                   + (f"; {skipped:,} rows without output skipped" if skipped else ""))
    params: dict[str, object] = {"trace": str(path), "format": fmt.name, "block_tokens": block_tokens,
                                 "tenants": rule.describe() if rule is not None else None}
    return Workload(name=path.stem, description=description, arrivals=arrivals,
                    tenants={name: bucket for name in names}, params=params,
                    seed=seed if rule is not None and rule.kind == "zipf" else 0)


