"""What the state keeps: tenant records, key records, audit entries and usage rows.

A record holds no secret: a key record has the key's SHA-256 hash (the same ``sha256:<hex>`` form
the config file holds) and its first characters (``prefix``, enough to tell keys apart in a list),
never the key. :func:`key_view` and :func:`tenant_view` are what leaves the process (the admin API,
the audit log): no hash either.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import attrs

from apsd.core.config import ConfigError, KeyConfig, KeyLimits, TenantConfig, parse_section

__all__ = ["LATENCY_BOUNDS_MS", "AuditEntry", "KeyRecord", "TenantRecord", "UsageKey", "audit_from_json",
           "audit_to_json", "file_digest", "histogram_bucket", "key_from_json", "key_to_json", "key_view", "limits_dict",
           "percentile", "settings_dict", "tenant_from_json", "tenant_from_settings", "tenant_to_json"]

#: Characters of a key shown in lists (``apsd_`` and 7 of its random ones): tells keys apart, and
#: leaves 250 bits unknown.
KEY_PREFIX_CHARS = 12

#: A tenant's settings a record keeps (its keys are records of their own).
SETTINGS = tuple(f.name for f in attrs.fields(TenantConfig) if f.name != "api_key_hashes")


def settings_dict(tenant: TenantConfig) -> dict[str, Any]:
    """A tenant's settings as JSON-able values (no key hashes)."""
    values = {name: getattr(tenant, name) for name in SETTINGS}
    values["models"] = list(values["models"])
    values["classes"] = list(values["classes"])
    return values


def tenant_from_settings(settings: dict[str, Any], prefix: str = "") -> TenantConfig:
    """A :class:`TenantConfig` from JSON settings, validated exactly as the config file's
    ``[tenants.<name>]`` is (ConfigError naming ``prefix.<field>``); no key hashes allowed here."""
    if "api_key_hashes" in settings:
        raise ConfigError(f"{prefix + '.' if prefix else ''}api_key_hashes: keys are issued with "
                          "POST /admin/tenants/<name>/keys, not set")
    return parse_section(TenantConfig, settings, prefix)


def file_digest(tenant: TenantConfig) -> str:
    """A fingerprint of a tenant's declaration in the config file (settings and key hashes): what
    tells a later start whether the file changed it since it was last applied."""
    values = settings_dict(tenant) | {"api_key_hashes": sorted(tenant.api_key_hashes)}
    return hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:32]


@attrs.frozen
class TenantRecord:
    """A tenant as the state keeps it."""

    name: str
    settings: TenantConfig
    #: ``file``: declared in the config file (and seeded from it); ``admin``: created through ``/admin``.
    origin: str
    #: :func:`file_digest` of the file's declaration last applied (None: never declared in the file).
    file_digest: str | None
    created_at: float
    updated_at: float
    #: When ``/admin`` deleted a tenant the config file declares (``[state] file_tenants = "seed"``):
    #: the record stays, so that the file's unchanged declaration does not bring it back at the
    #: next start (None: in force).
    deleted_at: float | None = None


@attrs.frozen
class KeyRecord:
    """An API key issued through ``/admin`` (the key itself is shown once, when issued): who holds it,
    and its own limits inside its tenant's."""

    key_id: str
    tenant: str
    #: The key's first :data:`KEY_PREFIX_CHARS` characters.
    prefix: str
    #: ``sha256:<hex>`` of the key (never leaves the process).
    key_hash: str = attrs.field(repr=False)
    #: A name for people, unique among its tenant's keys in force (a key issued before keys had names:
    #: its old label, possibly empty; :attr:`label` is then its id).
    name: str
    created_at: float
    #: Unix seconds after which it no longer works (None: never).
    expires_at: float | None = None
    #: When it was revoked (None: it was not).
    revoked_at: float | None = None
    #: Who holds it (a person's or an agent's name) and which (``person``, ``agent`` or empty).
    owner: str = ""
    owner_kind: str = ""
    limits: KeyLimits = KeyLimits()

    @property
    def label(self) -> str:
        """Its name, or its id when it has none."""
        return self.name or self.key_id

    def active(self, now: float) -> bool:
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)

    def config(self) -> KeyConfig:
        """The key as the running daemon holds it (:attr:`apsd.core.config.Config.keys`)."""
        return KeyConfig(key_id=self.key_id, tenant=self.tenant, key_hash=self.key_hash, name=self.name,
                         owner=self.owner, owner_kind=self.owner_kind, limits=self.limits)


def limits_dict(limits: KeyLimits) -> dict[str, Any]:
    """A key's limits as JSON-able values."""
    values = attrs.asdict(limits)
    values["models"] = list(limits.models)
    return values


def key_view(key: KeyRecord, now: float) -> dict[str, Any]:
    """What the admin API and the audit log say of a key: everything but its hash."""
    return {"id": key.key_id, "tenant": key.tenant, "prefix": key.prefix, "name": key.label, "label": key.label,
            "owner": key.owner, "owner_kind": key.owner_kind, "limits": limits_dict(key.limits),
            "created_at": key.created_at, "expires_at": key.expires_at, "revoked_at": key.revoked_at,
            "active": key.active(now)}


@attrs.frozen
class AuditEntry:
    """One change: who made it, when, to what, and the values before and after (never a key)."""

    at: float
    #: ``admin:<name>`` (a named admin key, ``[auth.admin_keys]``), ``admin:<8 hex>`` (another admin key:
    #: the first hex digits of its hash, which key, not the key), ``admin:open`` (no keys configured,
    #: loopback), ``file`` (the config file, at start or reload).
    actor: str
    #: ``tenant.create``, ``tenant.update``, ``tenant.delete``, ``key.issue``, ``key.update``, ``key.revoke``.
    action: str
    #: The tenant's name, or ``key:<id>``.
    target: str
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    #: Assigned by the store, increasing.
    entry_id: int = 0

    def view(self) -> dict[str, Any]:
        return {"id": self.entry_id, "at": self.at, "actor": self.actor, "action": self.action,
                "target": self.target, "before": self.before, "after": self.after}


# -- usage ---------------------------------------------------------------------------------------

@attrs.frozen
class UsageKey:
    """The row usage is added to: an hour (Unix seconds at its start), a tenant, a model, a backend,
    an issued key."""

    hour: int
    tenant: str
    #: The model the request named ("" for ``POST /infer``).
    model: str
    #: The backend that served it ("" for a simulated engine, or a request that never reached one).
    backend: str
    #: The issued key it came with (its id; "" for a key from the config file, or none).
    key: str = ""


#: Upper bounds (ms) of the latency histograms kept per usage row: 25% apart from 1 ms to about 20
#: minutes, so a percentile read from them is within 12% of the true one; above the last, one more.
LATENCY_BOUNDS_MS = tuple(round(1.25 ** i, 3) for i in range(64))


def histogram_bucket(ms: float) -> int:
    """The index of the histogram bucket ``ms`` falls in."""
    if ms <= 1.0:
        return 0
    return min(len(LATENCY_BOUNDS_MS), math.ceil(math.log(ms) / math.log(1.25) - 1e-9))


def percentile(counts: dict[int, float], q: float) -> float | None:
    """The ``q`` quantile (0-1) in ms of a histogram (bucket index -> count): the geometric middle
    of the bucket it falls in. None for an empty histogram."""
    total = sum(counts.values())
    if total <= 0:
        return None
    rank = q * total
    seen = 0.0
    for index in sorted(counts):
        seen += counts[index]
        if seen >= rank:
            upper = 1.25 ** index
            return round(upper if index == 0 else upper / math.sqrt(1.25), 3)
    return round(1.25 ** max(counts), 3)


# -- how records are stored (JSON objects) -------------------------------------------------------

def tenant_to_json(record: TenantRecord) -> dict[str, Any]:
    return {"name": record.name, "settings": settings_dict(record.settings), "origin": record.origin,
            "file_digest": record.file_digest, "created_at": record.created_at, "updated_at": record.updated_at,
            "deleted_at": record.deleted_at}


def tenant_from_json(data: dict[str, Any]) -> TenantRecord:
    return TenantRecord(name=data["name"], settings=tenant_from_settings(data["settings"], f"tenants.{data['name']}"),
                        origin=data["origin"], file_digest=data["file_digest"], created_at=data["created_at"],
                        updated_at=data["updated_at"], deleted_at=data.get("deleted_at"))


def key_to_json(record: KeyRecord) -> dict[str, Any]:
    values = attrs.asdict(record, recurse=False)
    values["limits"] = limits_dict(record.limits)
    return values


def key_from_json(data: dict[str, Any]) -> KeyRecord:
    """A key record as stored; one stored before keys had names, owners and limits (``label``, no
    ``limits``) reads as a key named by its old label, held by nobody in particular, with no limits of
    its own."""
    values = dict(data)
    if "label" in values:
        values.setdefault("name", values.pop("label"))
    values["limits"] = parse_section(KeyLimits, dict(values.get("limits") or {}), f"keys.{values.get('key_id')}")
    return KeyRecord(**values)


def audit_to_json(entry: AuditEntry) -> dict[str, Any]:
    return attrs.asdict(entry)


def audit_from_json(data: dict[str, Any]) -> AuditEntry:
    return AuditEntry(**data)
