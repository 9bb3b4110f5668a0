"""The state in an embedded SQLite file: what a single daemon keeps (``[state] kind = "sqlite"``).

The file is opened in WAL mode with ``synchronous = FULL``: every committed transaction is on
disk when the commit returns, so a ``kill -9`` (or a power cut) loses nothing committed. What is
not committed yet is what the keeper holds in memory between two flushes (usage, bucket levels,
budget spend: at most ``[state] flush_interval_s`` of them); changes through ``/admin`` are
committed before they are answered.

Python's :mod:`sqlite3` does the work, on one connection that a lock guards, in a worker thread
(:func:`trio.to_thread.run_sync`): a slow disk never stalls the event loop. The schema is created
on first open and carries a version (``PRAGMA user_version``); a file of an older schema is migrated
when opened (1 to 2: usage rows gain the issued key they were used with, ``""`` for the old ones; a
table of budget alerts sent), in one transaction; a file written by a newer apsd is refused rather
than misread. The file is the owner's only (0600): one found readable by others is
tightened at open, with a WARNING naming it.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import trio

from apsd.state.dump import StateDump
from apsd.state.records import (
    AuditEntry,
    UsageKey,
    audit_to_json,
    key_from_json,
    key_to_json,
    tenant_from_json,
    tenant_to_json,
)
from apsd.state.store import Change, DeleteTenant, PutKey, PutTenant, Snapshot, UsageRows

__all__ = ["SCHEMA_VERSION", "SqliteState", "StateFileError"]

SCHEMA_VERSION = 2

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tenants (name TEXT PRIMARY KEY, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (key_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, record TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS audit (
    entry_id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, target TEXT NOT NULL, entry TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS audit_target ON audit (target, entry_id);
CREATE TABLE IF NOT EXISTS buckets (tenant TEXT PRIMARY KEY, tokens REAL NOT NULL, at REAL NOT NULL);
-- spend: a budget's account (apsd.core.budget.budget_account: a tenant's name for its tokens, and
-- "<tenant>:usd", "<tenant>:key:<id>", ... for the others) and its amount (tokens, or micro-dollars)
CREATE TABLE IF NOT EXISTS spend (
    tenant TEXT NOT NULL, period TEXT NOT NULL, tokens INTEGER NOT NULL, PRIMARY KEY (tenant, period));
CREATE TABLE IF NOT EXISTS usage (
    hour INTEGER NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL, backend TEXT NOT NULL,
    key TEXT NOT NULL DEFAULT '', field TEXT NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (hour, tenant, model, backend, key, field)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_tenant ON usage (tenant, hour);
CREATE TABLE IF NOT EXISTS alerts (
    account TEXT NOT NULL, period TEXT NOT NULL, threshold REAL NOT NULL, at REAL NOT NULL,
    PRIMARY KEY (account, period, threshold));
INSERT OR IGNORE INTO meta VALUES ('version', 0);
"""

#: Schema 1 to 2: usage rows gain the issued key they were used with (those of schema 1 had none).
_MIGRATE_1_TO_2 = """
BEGIN IMMEDIATE;
CREATE TABLE usage_v2 (
    hour INTEGER NOT NULL, tenant TEXT NOT NULL, model TEXT NOT NULL, backend TEXT NOT NULL,
    key TEXT NOT NULL DEFAULT '', field TEXT NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (hour, tenant, model, backend, key, field)) WITHOUT ROWID;
INSERT INTO usage_v2 SELECT hour, tenant, model, backend, '', field, value FROM usage;
DROP TABLE usage;
ALTER TABLE usage_v2 RENAME TO usage;
PRAGMA user_version = 2;
COMMIT;
"""

T = TypeVar("T")

log = logging.getLogger("apsd.state")


class StateFileError(Exception):
    """The state file cannot be opened or used (the message names the file)."""


class SqliteState:
    """The state in the SQLite file at ``path`` (created with its directory if missing)."""

    kind = "sqlite"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where = str(path)
        self._lock = threading.Lock()
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            # The file holds key hashes and usage: the owner's only. Made before SQLite opens it, so
            # that the -wal and -shm files SQLite creates beside it take the same permissions; one
            # that exists readable by others (copied, restored from a backup) is tightened, and said so.
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            for file in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                _tighten(file)
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=30)
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = FULL")
            found = self._db.execute("PRAGMA user_version").fetchone()[0]
            if found > SCHEMA_VERSION:
                raise StateFileError(f"{path}: written by a newer apsd (schema {found}; this one knows "
                                     f"{SCHEMA_VERSION}); use that apsd, or another [state] path")
            if found == 1:
                self._db.executescript(_MIGRATE_1_TO_2)
                log.info("state: %s migrated from schema 1 to 2 (usage per issued key; budget alerts)", path,
                         extra={"event": "state"})
            self._db.executescript(_SCHEMA)
            self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except (sqlite3.Error, OSError) as exc:
            raise StateFileError(f"{path}: cannot open the state file: {exc}") from None

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        def locked() -> T:
            with self._lock:
                return work(self._db)
        return await trio.to_thread.run_sync(locked)

    @staticmethod
    def _transaction(db: sqlite3.Connection, work: Callable[[], T]) -> T:
        db.execute("BEGIN IMMEDIATE")
        try:
            result = work()
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        return result

    # -- tenants, keys, audit -------------------------------------------------------------------
    async def load(self) -> Snapshot:
        def read(db: sqlite3.Connection) -> Snapshot:
            version = _version(db)  # (first: see RedisStateStore.load; another process may share the file)
            tenants = {name: tenant_from_json(json.loads(record))
                       for name, record in db.execute("SELECT name, record FROM tenants")}
            keys = tuple(key_from_json(json.loads(record))
                         for (record,) in db.execute("SELECT record FROM api_keys ORDER BY key_id"))
            return Snapshot(tenants, keys, version)
        return await self._run(read)

    async def version(self) -> int:
        return await self._run(_version)

    async def write(self, changes: Sequence[Change], audit: Sequence[AuditEntry]) -> None:
        def apply(db: sqlite3.Connection) -> None:
            def work() -> None:
                for change in changes:
                    match change:
                        case PutTenant(record):
                            db.execute("INSERT OR REPLACE INTO tenants VALUES (?, ?)",
                                       (record.name, json.dumps(tenant_to_json(record))))
                        case DeleteTenant(name):
                            db.execute("DELETE FROM tenants WHERE name = ?", (name,))
                        case PutKey(record):
                            db.execute("INSERT OR REPLACE INTO api_keys VALUES (?, ?, ?)",
                                       (record.key_id, record.tenant, json.dumps(key_to_json(record))))
                for entry in audit:
                    cursor = db.execute("INSERT INTO audit (at, target, entry) VALUES (?, ?, '')",
                                        (entry.at, entry.target))
                    stored = audit_to_json(entry) | {"entry_id": cursor.lastrowid}
                    db.execute("UPDATE audit SET entry = ? WHERE entry_id = ?", (json.dumps(stored), cursor.lastrowid))
                db.execute("UPDATE meta SET value = value + 1 WHERE name = 'version'")
            self._transaction(db, work)
        await self._run(apply)

    async def audit(self, *, target: str | None = None, limit: int = 100,
                    before_id: int | None = None) -> list[AuditEntry]:
        def read(db: sqlite3.Connection) -> list[AuditEntry]:
            where = ["entry_id < ?"]
            args: list[int | str] = [before_id if before_id is not None else 2**62]
            if target is not None:
                where.append("target = ?")
                args.append(target)
            rows = db.execute(f"SELECT entry FROM audit WHERE {' AND '.join(where)} ORDER BY entry_id DESC LIMIT ?",
                              (*args, limit))
            return [AuditEntry(**json.loads(entry)) for (entry,) in rows]
        return await self._run(read)

    # -- buckets, spend, usage ------------------------------------------------------------------
    async def save_buckets(self, levels: Mapping[str, tuple[float, float]]) -> None:
        def save(db: sqlite3.Connection) -> None:
            self._transaction(db, lambda: db.executemany(
                "INSERT OR REPLACE INTO buckets VALUES (?, ?, ?)",
                [(tenant, tokens, at) for tenant, (tokens, at) in levels.items()]))
        if levels:
            await self._run(save)

    async def load_buckets(self) -> dict[str, tuple[float, float]]:
        return await self._run(lambda db: {tenant: (tokens, at) for tenant, tokens, at
                                           in db.execute("SELECT tenant, tokens, at FROM buckets")})

    async def add_spend(self, deltas: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], int]:
        def add(db: sqlite3.Connection) -> dict[tuple[str, str], int]:
            def work() -> dict[tuple[str, str], int]:
                totals = {}
                for (tenant, period), tokens in deltas.items():
                    db.execute("INSERT INTO spend VALUES (?, ?, ?) ON CONFLICT (tenant, period) "
                               "DO UPDATE SET tokens = tokens + excluded.tokens", (tenant, period, tokens))
                    totals[(tenant, period)] = db.execute(
                        "SELECT tokens FROM spend WHERE tenant = ? AND period = ?", (tenant, period)).fetchone()[0]
                return totals
            return self._transaction(db, work)
        return await self._run(add) if deltas else {}

    async def spend(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], int]:
        def read(db: sqlite3.Connection) -> dict[tuple[str, str], int]:
            found = {}
            for tenant, period in keys:
                row = db.execute("SELECT tokens FROM spend WHERE tenant = ? AND period = ?",
                                 (tenant, period)).fetchone()
                found[(tenant, period)] = row[0] if row else 0
            return found
        return await self._run(read)

    @staticmethod
    def _add_usage(db: sqlite3.Connection, rows: UsageRows) -> None:
        values = [(key.hour, key.tenant, key.model, key.backend, key.key, field, amount)
                  for key, fields in rows.items() for field, amount in fields.items()]
        db.executemany("INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT "
                       "(hour, tenant, model, backend, key, field) DO UPDATE SET value = value + excluded.value", values)

    async def add_usage(self, rows: UsageRows) -> None:
        def add(db: sqlite3.Connection) -> None:
            self._transaction(db, lambda: self._add_usage(db, rows))
        if rows:
            await self._run(add)

    async def usage(self, *, tenant: str | None, start: int, end: int) -> dict[UsageKey, dict[str, float]]:
        def read(db: sqlite3.Connection) -> dict[UsageKey, dict[str, float]]:
            query = "SELECT hour, tenant, model, backend, key, field, value FROM usage WHERE hour >= ? AND hour < ?"
            args: list[Any] = [start, end]
            if tenant is not None:
                query += " AND tenant = ?"
                args.append(tenant)
            found: dict[UsageKey, dict[str, float]] = {}
            for hour, name, model, backend, key, field, value in db.execute(query, args):
                found.setdefault(UsageKey(hour, name, model, backend, key), {})[field] = value
            return found
        return await self._run(read)

    async def prune(self, *, usage_before: int | None, audit_before: float | None) -> None:
        def prune(db: sqlite3.Connection) -> None:
            def work() -> None:
                if usage_before is not None:
                    db.execute("DELETE FROM usage WHERE hour < ?", (usage_before,))
                if audit_before is not None:
                    db.execute("DELETE FROM audit WHERE at < ?", (audit_before,))
            self._transaction(db, work)
        await self._run(prune)

    # -- the whole state (apsd state export / import), and a replica's copy of Redis's -------------
    async def dump(self) -> StateDump:
        def read(db: sqlite3.Connection) -> StateDump:
            tenants = tuple(tenant_from_json(json.loads(r)) for (r,) in db.execute("SELECT record FROM tenants "
                                                                                   "ORDER BY name"))
            keys = tuple(key_from_json(json.loads(r)) for (r,) in db.execute("SELECT record FROM api_keys "
                                                                             "ORDER BY key_id"))
            audit = tuple(AuditEntry(**json.loads(e)) for (e,) in db.execute("SELECT entry FROM audit "
                                                                            "ORDER BY entry_id"))
            usage: dict[UsageKey, dict[str, float]] = {}
            for hour, name, model, backend, key, field, value in db.execute(
                    "SELECT hour, tenant, model, backend, key, field, value FROM usage"):
                usage.setdefault(UsageKey(hour, name, model, backend, key), {})[field] = value
            spend = {(t, p): n for t, p, n in db.execute("SELECT tenant, period, tokens FROM spend")}
            buckets = {t: (tokens, at) for t, tokens, at in db.execute("SELECT tenant, tokens, at FROM buckets")}
            return StateDump(tenants, keys, audit, usage, spend, buckets)
        return await self._run(read)

    async def import_dump(self, dump: StateDump) -> None:
        """Add ``dump`` to this state, in one transaction: its tenants and keys (replacing those of
        the same name or id), its audit entries after those here (new ids, in order), its usage and
        spend added to what is here, its bucket levels."""
        def write(db: sqlite3.Connection) -> None:
            def work() -> None:
                for record in dump.tenants:
                    db.execute("INSERT OR REPLACE INTO tenants VALUES (?, ?)",
                               (record.name, json.dumps(tenant_to_json(record))))
                for key in dump.keys:
                    db.execute("INSERT OR REPLACE INTO api_keys VALUES (?, ?, ?)",
                               (key.key_id, key.tenant, json.dumps(key_to_json(key))))
                for entry in dump.audit:
                    cursor = db.execute("INSERT INTO audit (at, target, entry) VALUES (?, ?, '')", (entry.at, entry.target))
                    stored = audit_to_json(entry) | {"entry_id": cursor.lastrowid}
                    db.execute("UPDATE audit SET entry = ? WHERE entry_id = ?", (json.dumps(stored), cursor.lastrowid))
                self._add_usage(db, dump.usage)
                db.executemany("INSERT INTO spend VALUES (?, ?, ?) ON CONFLICT (tenant, period) "
                               "DO UPDATE SET tokens = tokens + excluded.tokens",
                               [(t, p, n) for (t, p), n in dump.spend.items()])
                db.executemany("INSERT OR REPLACE INTO buckets VALUES (?, ?, ?)",
                               [(t, tokens, at) for t, (tokens, at) in dump.buckets.items()])
                db.execute("UPDATE meta SET value = value + 1 WHERE name = 'version'")
            self._transaction(db, work)
        await self._run(write)

    async def copy_audit(self, entries: Sequence[AuditEntry]) -> None:
        """Keep ``entries`` with their ids (a copy of another state's log: an entry already here is
        replaced by the same id's)."""
        def write(db: sqlite3.Connection) -> None:
            self._transaction(db, lambda: db.executemany(
                "INSERT OR REPLACE INTO audit (entry_id, at, target, entry) VALUES (?, ?, ?, ?)",
                [(e.entry_id, e.at, e.target, json.dumps(audit_to_json(e))) for e in entries]))
        if entries:
            await self._run(write)

    async def copy_usage(self, rows: UsageRows) -> None:
        """Set ``rows`` as they are (a copy of another state's rows: values replaced, not added)."""
        def write(db: sqlite3.Connection) -> None:
            self._transaction(db, lambda: db.executemany(
                "INSERT OR REPLACE INTO usage VALUES (?, ?, ?, ?, ?, ?, ?)",
                [(k.hour, k.tenant, k.model, k.backend, k.key, field, value)
                 for k, fields in rows.items() for field, value in fields.items()]))
        if rows:
            await self._run(write)

    async def claim_alert(self, account: str, period: str, threshold: float, at: float) -> bool:
        """Whether this call is the first to claim the alert of ``account`` at ``threshold`` in
        ``period`` (then it is recorded: it is sent once, whoever asks after)."""
        def claim(db: sqlite3.Connection) -> bool:
            return self._transaction(db, lambda: db.execute(
                "INSERT OR IGNORE INTO alerts VALUES (?, ?, ?, ?)", (account, period, threshold, at)).rowcount == 1)
        return await self._run(claim)

    async def last_audit_id(self) -> int:
        return await self._run(lambda db: int(db.execute("SELECT COALESCE(MAX(entry_id), 0) FROM audit")
                                              .fetchone()[0]))

    async def close(self) -> None:
        def close(db: sqlite3.Connection) -> None:
            db.close()
        await self._run(close)


def _tighten(file: Path) -> None:
    """Make ``file`` (if it exists) readable and writable by its owner only, logging the change."""
    try:
        mode = file.stat().st_mode & 0o777
    except FileNotFoundError:
        return
    if mode & 0o077:
        os.chmod(file, 0o600)
        log.warning("state: %s was readable by others (mode %04o): now 0600, the owner's only (it holds key "
                    "hashes and usage)", file, mode, extra={"event": "state"})


def _version(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()[0])
