"""The whole state as one JSON document: what ``apsd state export`` writes and ``apsd state import``
reads, and what a replica keeps a copy of to write back into a Redis that lost its data.

A :class:`StateDump` holds every tenant record (those ``/admin`` deleted but the config file still
declares included), every issued key's record (its hash, never the key; its name, owner and limits), the audit log with
its entry ids, usage per hour, tenant, model, backend and issued key (``"key"``, absent for requests
with none), budgets' spend per account and period (tokens, or micro-dollars for ``:usd`` accounts), and (from SQLite)
each tenant's bucket level with its time. :func:`dump_to_json` and :func:`dump_from_json` are the
document's format (``"format": "apsd-state"``, ``"version": 1``); a document of another format or a
newer version is refused with a :class:`DumpError` naming what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from apsd.core.config import ConfigError
from apsd.state.records import (
    AuditEntry,
    KeyRecord,
    TenantRecord,
    UsageKey,
    audit_from_json,
    audit_to_json,
    key_from_json,
    key_to_json,
    tenant_from_json,
    tenant_to_json,
)

__all__ = ["DUMP_FORMAT", "DUMP_VERSION", "DumpError", "StateDump", "audit_member", "dump_from_json", "dump_to_json"]

DUMP_FORMAT = "apsd-state"
DUMP_VERSION = 1


class DumpError(Exception):
    """A document that is not a state dump this apsd can read (the message says why)."""


@attrs.frozen
class StateDump:
    tenants: tuple[TenantRecord, ...] = ()
    keys: tuple[KeyRecord, ...] = ()
    #: Oldest first, each with its ``entry_id``.
    audit: tuple[AuditEntry, ...] = ()
    usage: dict[UsageKey, dict[str, float]] = attrs.field(factory=dict)
    #: (tenant, period key) -> tokens settled in that period.
    spend: dict[tuple[str, str], int] = attrs.field(factory=dict)
    #: tenant -> (tokens, Unix seconds when it held them).
    buckets: dict[str, tuple[float, float]] = attrs.field(factory=dict)

    def counts(self) -> str:
        """What it holds, in words (for the command's report and the log)."""
        return (f"{len(self.tenants)} tenants, {len(self.keys)} keys, {len(self.audit)} audit entries, "
                f"{len(self.usage)} usage rows, {len(self.spend)} budget periods, {len(self.buckets)} bucket levels")


def audit_member(entry: AuditEntry) -> str:
    """An audit entry as Redis keeps it: JSON with ``entry_id`` first (``apsd.state.redis`` writes the
    id into that place)."""
    fields = audit_to_json(entry)
    entry_id = fields.pop("entry_id")
    return f'{{"entry_id": {entry_id}, ' + json.dumps(fields)[1:]


def dump_to_json(dump: StateDump) -> dict[str, Any]:
    return {
        "format": DUMP_FORMAT, "version": DUMP_VERSION,
        "tenants": [tenant_to_json(r) for r in dump.tenants],
        "keys": [key_to_json(k) for k in dump.keys],
        "audit": [audit_to_json(e) for e in dump.audit],
        "usage": [{"hour": k.hour, "tenant": k.tenant, "model": k.model, "backend": k.backend,
                   **({"key": k.key} if k.key else {}), "fields": fields}
                  for k, fields in sorted(dump.usage.items(), key=lambda item: attrs.astuple(item[0]))],
        "spend": [{"tenant": t, "period": p, "tokens": n} for (t, p), n in sorted(dump.spend.items())],
        "buckets": [{"tenant": t, "tokens": tokens, "at": at} for t, (tokens, at) in sorted(dump.buckets.items())],
    }


def dump_from_json(data: Any) -> StateDump:
    """A :class:`StateDump` from its JSON document; DumpError naming the part at fault."""
    if not isinstance(data, dict) or data.get("format") != DUMP_FORMAT:
        raise DumpError(f"not an apsd state dump (no \"format\": \"{DUMP_FORMAT}\")")
    if data.get("version") != DUMP_VERSION:
        raise DumpError(f"a state dump of version {data.get('version')!r}; this apsd reads version {DUMP_VERSION}")
    part = "tenants"
    try:
        tenants = tuple(tenant_from_json(r) for r in data.get("tenants", []))
        part = "keys"
        keys = tuple(key_from_json(k) for k in data.get("keys", []))
        part = "audit"
        audit = tuple(sorted((audit_from_json(e) for e in data.get("audit", [])), key=lambda e: e.entry_id))
        part = "usage"
        usage = {UsageKey(int(r["hour"]), str(r["tenant"]), str(r["model"]), str(r["backend"]), str(r.get("key", ""))):
                 {str(f): float(v) for f, v in r["fields"].items()} for r in data.get("usage", [])}
        part = "spend"
        spend = {(str(s["tenant"]), str(s["period"])): int(s["tokens"]) for s in data.get("spend", [])}
        part = "buckets"
        buckets = {str(b["tenant"]): (float(b["tokens"]), float(b["at"])) for b in data.get("buckets", [])}
    except (ConfigError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DumpError(f"{part}: {type(exc).__name__}: {exc}") from None
    return StateDump(tenants, keys, audit, usage, spend, buckets)
