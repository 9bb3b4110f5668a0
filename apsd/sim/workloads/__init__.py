"""Workloads for ``apsd simulate``: the built-in generators (traces: :mod:`apsd.sim.traces`).

Ownership: this module turns a built-in's name and parameters into a
:class:`~apsd.sim.records.Workload`: every arrival generated up front, so
:mod:`apsd.sim.runner` replays the very same requests for every policy. It owns
parameter handling (defaults, strict types, ranges, the limit of
:data:`MAX_ARRIVALS` arrivals, shared with traces). Every problem is a
:class:`WorkloadError` whose one-line message names the workload and the
parameter (``workload 'poisson': rate: must be > 0, got -1``); a trace's name the
file, line and field (``trace.csv:7: bid: must be between 1 and 10, got 11``).

Determinism: a built-in draws only from ``numpy.random.default_rng(seed)``, so a
name, parameters and seed always give the same workload. Arrivals are sorted by
``at`` with a stable sort: ties keep generation order.

Tenant buckets: no built-in is about throttling, so every tenant a workload
defines gets :data:`UNTHROTTLED`, ``TenantConfig(rate=1e6 tokens/s,
burst=10**9)``: far more than any workload here can use, so admission never
rejects for quota and a comparison measures scheduling alone. A trace's tenants
get the same bucket.

Sizes: a built-in's requests always fit the batch engine's KV cache of
:data:`KV_CAPACITY_TOKENS` per batch (``prompt + output <= 32768``); random sizes
are clipped to ``1..16384`` each. Bids are integers 1..10.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from apsd.core.config import read_toml
from apsd.sim.records import Workload
from apsd.sim.workloads.arrivals import tenant_names
from apsd.sim.workloads.builtins import BUILTINS, Builtin
from apsd.sim.workloads.params import KV_CAPACITY_TOKENS, MAX_ARRIVALS, UNTHROTTLED, WorkloadError

__all__ = [
    "KV_CAPACITY_TOKENS",
    "MAX_ARRIVALS",
    "UNTHROTTLED",
    "WorkloadError",
    "build_workload",
    "list_workloads",
    "load_params_file",
    "parse_param_assignments",
    "tenant_names",
]


def list_workloads() -> list[tuple[str, str, dict[str, Any]]]:
    """Every built-in as ``(name, one-line description, default parameters)``."""
    return [(b.name, b.description, {k: p.default for k, p in b.params.items()}) for b in BUILTINS.values()]


def effective_params(builtin: Builtin, given: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults with ``given`` merged over them, each checked; cross-checks too."""
    def error(problem: str) -> WorkloadError:
        return WorkloadError(f"workload {builtin.name!r}: {problem}")

    unknown = sorted(set(given) - set(builtin.params), key=str)
    if unknown:
        raise error(f"unknown parameter {unknown[0]!r} (parameters: {', '.join(sorted(builtin.params))})")
    params: dict[str, Any] = {}
    for name, param in builtin.params.items():
        try:
            params[name] = param.check(given[name]) if name in given else param.default
        except ValueError as exc:
            raise error(f"{name}: {exc}") from None
    try:
        builtin.check(params)
    except ValueError as exc:
        raise error(str(exc)) from None
    expected, what = builtin.expected_arrivals(params)
    if expected > MAX_ARRIVALS:
        raise error(f"{what}: asks for about {expected:,.0f} arrivals (limit {MAX_ARRIVALS:,})")
    return params


def build_workload(name: str, params: Mapping[str, Any] | None = None, seed: int = 0) -> Workload:
    """Generate built-in ``name`` with ``params`` over its defaults, from ``seed``.

    Raises :class:`WorkloadError` for an unknown name or parameter, a value of the
    wrong type or out of range, more than :data:`MAX_ARRIVALS` arrivals, or none.
    """
    builtin = BUILTINS.get(name)
    if builtin is None:
        raise WorkloadError(f"unknown workload {name!r} (built-ins: {', '.join(BUILTINS)})")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise WorkloadError(f"workload {name!r}: seed: must be an integer >= 0, got {seed!r}")
    if params is not None and not isinstance(params, Mapping):
        raise WorkloadError(f"workload {name!r}: parameters must be a mapping, got {type(params).__name__}")
    effective = effective_params(builtin, params or {})
    generated = builtin.generate(effective, np.random.default_rng(seed))
    if not generated.arrivals:
        raise WorkloadError(f"workload {name!r}: generated no arrivals (raise the rate, duration or counts)")
    if len(generated.arrivals) > MAX_ARRIVALS:
        raise WorkloadError(f"workload {name!r}: {builtin.expected_arrivals(effective)[1]}: generated "
                            f"{len(generated.arrivals):,} arrivals (limit {MAX_ARRIVALS:,})")
    return Workload(
        name=name,
        description=builtin.description,
        arrivals=tuple(sorted(generated.arrivals, key=lambda a: a.at)),
        tenants={tenant: UNTHROTTLED for tenant in generated.tenants},
        params=effective,
        seed=seed,
    )


def load_params_file(path: str | Path) -> dict[str, Any]:
    """The top-level keys of TOML file ``path`` as workload parameters (checked by :func:`build_workload`)."""
    return read_toml(Path(path), "parameter file", WorkloadError)


def parse_param_assignments(items: Sequence[str]) -> dict[str, Any]:
    """``["rate=5", "name=x"]`` -> ``{"rate": 5, "name": "x"}``: TOML values, else the bare string.

    A later assignment to the same key wins. An item without ``=`` or with an
    empty key is a :class:`WorkloadError`.
    """
    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise WorkloadError(f"parameter {item!r}: expected key=value (e.g. rate=5)")
        params[key] = toml_value(value.strip())
    return params


def toml_value(text: str) -> Any:
    """``text`` read as a TOML value (``5``, ``1.5``, ``true``, ``"x"``), or itself when it is not one."""
    if "\n" in text or "\r" in text:
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
