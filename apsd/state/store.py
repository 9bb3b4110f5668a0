"""The state store's interface: what the keeper asks of SQLite (one daemon) or Redis (replicas).

Every method is async; an implementation does its blocking work off the trio thread. Writes of
tenants and keys (:meth:`StateStore.write`) are atomic with their audit entries and bump
:meth:`StateStore.version`, which is how a replica learns that another one changed something.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import attrs

from apsd.state.dump import StateDump
from apsd.state.records import AuditEntry, KeyRecord, TenantRecord, UsageKey

__all__ = ["DeleteTenant", "PutKey", "PutTenant", "Snapshot", "StateStore", "UsageRows"]

#: Usage to add or read: per row, field -> amount (see :mod:`apsd.state.usage` for the fields).
UsageRows = Mapping[UsageKey, Mapping[str, float]]


@attrs.frozen
class PutTenant:
    record: TenantRecord


@attrs.frozen
class DeleteTenant:
    name: str


@attrs.frozen
class PutKey:
    record: KeyRecord


Change = PutTenant | DeleteTenant | PutKey


@attrs.frozen
class Snapshot:
    """Tenants and keys as stored, at ``version``."""

    #: Every record, those deleted through ``/admin`` but remembered for the config file included.
    tenants: dict[str, TenantRecord]
    keys: tuple[KeyRecord, ...]
    version: int

    @property
    def in_force(self) -> dict[str, TenantRecord]:
        """The tenants that exist (not deleted)."""
        return {name: record for name, record in self.tenants.items() if record.deleted_at is None}


class StateStore(Protocol):
    kind: str
    #: Where it is (a file path or a Redis URL without credentials), for logs.
    where: str

    async def load(self) -> Snapshot: ...

    async def version(self) -> int: ...

    async def write(self, changes: Sequence[Change], audit: Sequence[AuditEntry]) -> None:
        """Apply ``changes`` and append ``audit``, atomically; bump the version."""

    async def audit(self, *, target: str | None = None, limit: int = 100,
                    before_id: int | None = None) -> list[AuditEntry]:
        """The newest entries first (about ``target`` only, if given), at most ``limit``, older than
        ``before_id`` if given."""

    async def save_buckets(self, levels: Mapping[str, tuple[float, float]]) -> None:
        """Tenants' bucket levels: tenant -> (tokens, Unix seconds when they were that)."""

    async def load_buckets(self) -> dict[str, tuple[float, float]]: ...

    async def add_spend(self, deltas: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], int]:
        """Add settled budget spend per (tenant, period key); returns the new totals."""

    async def spend(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]: ...

    async def add_usage(self, rows: UsageRows) -> None: ...

    async def usage(self, *, tenant: str | None, start: int, end: int) -> dict[UsageKey, dict[str, float]]:
        """Rows whose hour is in ``[start, end)`` (Unix seconds), of ``tenant`` or every tenant."""

    async def prune(self, *, usage_before: int | None, audit_before: float | None) -> None:
        """Delete usage of hours before ``usage_before`` and audit entries before ``audit_before``."""

    async def claim_alert(self, account: str, period: str, threshold: float, at: float) -> bool:
        """Record that the budget alert of ``account`` at ``threshold`` in ``period`` is sent; whether
        this call recorded it (False: another replica, or an earlier run, did)."""

    async def dump(self) -> StateDump:
        """Everything it holds (``apsd state export``)."""

    async def import_dump(self, dump: StateDump) -> None:
        """Add ``dump`` to what it holds (``apsd state import``): tenants and keys replace those of the
        same name or id; audit entries, usage and spend are added."""

    async def close(self) -> None: ...
