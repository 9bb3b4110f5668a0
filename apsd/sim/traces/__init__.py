"""Traces for ``apsd simulate --trace``: recorded (or recorded-shaped) arrivals replayed through apsd.

* :mod:`~apsd.sim.traces.load` — :func:`load_trace`: layout, format detection, tenants, the workload.
* :mod:`~apsd.sim.traces.formats` — what a format is (:class:`TraceFormat`) and reads (:class:`TraceRecord`);
  the formats: :mod:`~apsd.sim.traces.native` (apsd's own), :mod:`~apsd.sim.traces.mooncake` (Mooncake and
  NVIDIA Dynamo), :mod:`~apsd.sim.traces.azure` (Azure LLM inference traces), :mod:`~apsd.sim.traces.burstgpt`.
* :mod:`~apsd.sim.traces.rows` and :mod:`~apsd.sim.traces.values` — a file as a stream of rows, and their values.
* :mod:`~apsd.sim.traces.split` — tenant rules for traces that name no tenants.
* :mod:`~apsd.sim.traces.columns` — arrivals held as arrays (:class:`TraceArrivals`), prompt keys from block ids.
* :mod:`~apsd.sim.traces.reuse` — the trace's own prefix reuse: what an infinite cache would hold.
* :mod:`~apsd.sim.traces.synthetic` — a Mooncake-format trace with realistic structure, generated (the
  published traces cannot be downloaded here).
"""

from apsd.sim.traces.columns import TraceArrivals
from apsd.sim.traces.formats import TraceFormat, TraceRecord
from apsd.sim.traces.load import DEFAULT_BLOCK_TOKENS, FORMATS, detect_format, load_trace
from apsd.sim.traces.split import TenantRule, parse_tenant_rule

__all__ = ["DEFAULT_BLOCK_TOKENS", "FORMATS", "TenantRule", "TraceArrivals", "TraceFormat", "TraceRecord",
           "detect_format", "load_trace", "parse_tenant_rule"]
