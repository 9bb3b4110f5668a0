"""The state keeper: tenants and keys managed live, and what outlives a restart.

Ownership: the daemon opens one keeper (:func:`open_keeper`) before its pipeline, runs
:meth:`StateKeeper.run` in its nursery, and gives it a way to apply a configuration
(``apply``: rebuild the policies if weights changed, then :meth:`apsd.pipeline.Pipeline.reconfigure`,
the same path as a SIGHUP reload). The admin API (:mod:`apsd.serve.http.admin`) calls the
keeper's operations; each one is written to the store, with its audit entry, before it is
applied here and answered. Other replicas see the store's version move within
``[state] poll_interval_s`` and apply the same.

**The effective configuration** is the config file's, with its ``[tenants]`` replaced by the
stored tenants, each with its keys: the file's ``api_key_hashes`` for a tenant the file declares,
and the keys issued through ``/admin`` that are neither revoked nor expired (an expired key stops
working within ``poll_interval_s`` of its expiry).

**Who wins for a tenant the file declares** (``[state] file_tenants``):

* ``seed`` (the default): the latest change wins. At start and at each reload, a declaration that
  is new, or differs from the one last applied (:func:`apsd.state.records.file_digest`), is
  applied; a change made through ``/admin`` since stays until the file's declaration of that
  tenant changes. A tenant the file stops declaring is deleted (one created through ``/admin`` is not).
* ``authoritative``: the file always wins, and ``/admin`` refuses to change or delete the tenants
  it declares (409 ``declared_in_file``); it may still add tenants and issue and revoke keys.

**Kept across restarts**, every ``[state] flush_interval_s`` (and at a clean stop): usage
(:mod:`apsd.state.usage`), each tenant's bucket level with its time (with the memory store; a
restart refills the bucket for the time it was down, at its rate, rather than handing out a full
burst), and budgets' spend. A ``kill -9`` loses at most one interval of them.

**A Redis restarted without its data.** Each replica polls the state's version; one that finds it
gone back writes back the tenants and keys it knows (every replica does: only what is missing is
written). The audit log and usage are not in a replica's memory, so each replica keeps a copy of
them (:class:`RedisCopy`: a SQLite file of its own, in the temporary directory, removed at a clean
stop) following Redis every ``flush_interval_s``; the first replica to find the data gone (a marker in
Redis says which) writes its copy back: the audit log with its ids (entries made since move after
them) and the usage rows, added to what was flushed since. What the replicas settled of budgets
is in the shared store's budget accounts, which the replicas write back at their next exchange
(:mod:`apsd.core.budget`). Lost: what was flushed in the last ``flush_interval_s`` before the loss.
"""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import sqlite3
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from apsd.core.budget import Budgets
from apsd.core.clock import calendar_time
from apsd.core.config import Config, ConfigError, KeyLimits, TenantConfig, check_tenant_classes, parse_section
from apsd.core.keys import hash_key, new_key
from apsd.state.records import (
    KEY_PREFIX_CHARS,
    AuditEntry,
    KeyRecord,
    TenantRecord,
    UsageKey,
    file_digest,
    key_view,
    limits_dict,
    settings_dict,
    tenant_from_settings,
)
from apsd.state.sqlite import SqliteState
from apsd.state.store import Change, DeleteTenant, PutKey, PutTenant, Snapshot, StateStore
from apsd.state.usage import HOUR_S, UsageRecorder

if TYPE_CHECKING:
    from apsd.state.redis import RedisStateStore

__all__ = ["TENANT_NAME", "AdminError", "StateKeeper", "open_keeper", "state_store_for"]

log = logging.getLogger("apsd.state")

#: What a tenant created through ``/admin`` may be called (it appears in URLs, logs and labels).
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: The longest name (or owner) a key may have.
MAX_LABEL_CHARS = 200
#: Seconds between two deletions of usage and audit entries past their retention.
PRUNE_INTERVAL_S = 3600.0
#: The longest a key may be issued for (ten years).
MAX_KEY_LIFETIME_S = 10 * 365 * 86_400


@attrs.define(auto_exc=True)
class AdminError(Exception):
    """An admin operation refused: the status, error code, message and the field at fault."""

    status: int
    error: str
    message: str
    field: str | None = None


def _bad(message: str, field: str | None) -> AdminError:
    return AdminError(422, "invalid_field" if field else "invalid_request", message, field)


def _config_error(exc: ConfigError) -> AdminError:
    """A validation error from :func:`apsd.core.config.parse_section` as a 400 naming its field."""
    message = str(exc)
    field = message.split(":", 1)[0].split(".")[-1].split("[")[0] if ":" in message else None
    return _bad(message, field)


def state_store_for(config: Config, environ: Mapping[str, str]) -> StateStore | None:
    """The store ``[state]`` asks for (None: ``off``)."""
    kind = config.state.kind
    if kind == "auto":
        kind = "redis" if config.store.shared else "sqlite"
    if kind == "off":
        return None
    if kind == "redis":
        from apsd.state.redis import RedisStateStore

        return RedisStateStore(config.store.url, config.store.key_prefix)
    from apsd.state.sqlite import SqliteState

    return SqliteState(config.state.sqlite_path(environ))


def _leaf(exc: BaseException) -> BaseException:
    """The one error inside (nested) groups of one, as coredis raises them."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


@contextmanager
def _state_errors(store: StateStore, what: str) -> Iterator[None]:
    """Turn a state that fails now (Redis down, a SQLite disk full or read-only) into 503
    ``state_unavailable``, logged at WARNING with the cause: an admin write or read gets an answer
    that says so, never a 500. (AdminError passes through.)"""
    try:
        yield
    except AdminError:
        raise
    except Exception as error:  # (sqlite3.Error, OSError, coredis's errors, in groups of one)
        exc = _leaf(error)
        log.warning("state: %s failed at %s: %s: %s", what, store.where, type(exc).__name__, exc,
                    extra={"event": "state"})
        raise AdminError(503, "state_unavailable", f"the state at {store.where} cannot be used now "
                         f"({type(exc).__name__}: {str(exc)[:200]}); nothing was changed: retry when it can "
                         "(the running tenants and keys are served meanwhile)") from None


def _unreachable(store: StateStore, exc: BaseException) -> None:
    exc = _leaf(exc)
    log.warning("state: %s cannot be reached (%s: %s): serving the config file's tenants and keys until it "
                "can; /admin changes are refused until then", store.where, type(exc).__name__, exc,
                extra={"event": "state"})


@asynccontextmanager
async def open_keeper(config: Config, *, environ: Mapping[str, str] | None = None,
                      wall: Callable[[], float] = calendar_time) -> AsyncIterator[StateKeeper]:
    """Open the state ``[state]`` names, seed it from ``config``'s tenants, yield the keeper, and
    close the state on the way out. ConfigError if it cannot be opened or read (the message names
    the file or server)."""
    from apsd.state.sqlite import StateFileError

    try:
        store = state_store_for(config, os.environ if environ is None else environ)
    except StateFileError as exc:
        raise ConfigError(f"{config.source}: state: {exc}") from None
    keeper = StateKeeper(store=store, file_config=config, wall=wall)
    if store is not None and store.kind == "redis":
        from apsd.state.redis import RedisStateStore

        assert isinstance(store, RedisStateStore)  # (what state_store_for makes of kind "redis")
        keeper.copy = RedisCopy.open(store)
    try:
        if store is not None:
            try:
                await keeper.reconcile(config)
            except (OSError, sqlite3.Error) as exc:
                if store.kind != "redis":
                    raise ConfigError(f"{config.source}: state: cannot use the state file {store.where}: "
                                      f"{exc}") from None
                _unreachable(store, exc)
            except Exception as exc:  # (coredis's errors): Redis may come back, as for the shared buckets
                if store.kind != "redis":
                    raise
                _unreachable(store, exc)
            if keeper.seeded:
                log.info("state kept in %s (%s): %d tenants, %d keys issued", store.where, store.kind,
                         len(keeper.snapshot.in_force), len(keeper.snapshot.keys), extra={"event": "state"})
        yield keeper
    finally:
        await keeper.close()


@attrs.define(eq=False)
class StateKeeper:
    store: StateStore | None
    #: The config file's configuration (command-line overrides applied), as last loaded.
    file_config: Config
    wall: Callable[[], float] = calendar_time
    snapshot: Snapshot = attrs.field(factory=lambda: Snapshot({}, (), 0))
    #: Applies an effective configuration to the running daemon (set by the daemon).
    apply: Callable[[Config, str], None] | None = None
    budgets: Budgets | None = None
    usage: UsageRecorder | None = None
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _usage_lock: trio.Lock = attrs.field(factory=trio.Lock)
    _built_at: float = 0.0
    #: The state was read, and the file's tenants written to it, since start (until then, and with
    #: no state at all, the effective configuration is the file's).
    seeded: bool = False
    _pruned_at: float = 0.0
    #: A replica's copy of the audit log and usage of a Redis state (None: another state, or no copy).
    copy: RedisCopy | None = None

    @property
    def enabled(self) -> bool:
        return self.store is not None

    # -- the effective configuration ----------------------------------------------------------
    def effective(self) -> Config:
        """The config file's configuration with the stored tenants and their keys (see the module)."""
        self._built_at = now = self.wall()
        if self.store is None or not self.seeded:
            return self.file_config
        issued: dict[str, list[str]] = {}
        keys = {}
        for key in self.snapshot.keys:
            if key.active(now) and key.tenant in self.snapshot.in_force:
                issued.setdefault(key.tenant, []).append(key.key_hash)
                keys[key.key_id] = key.config()
        tenants = {}
        for name, record in sorted(self.snapshot.in_force.items()):
            declared = self.file_config.tenants.get(name)
            hashes = (declared.api_key_hashes if declared is not None else ()) + tuple(issued.get(name, ()))
            tenants[name] = attrs.evolve(record.settings, api_key_hashes=tuple(dict.fromkeys(hashes)))
        return attrs.evolve(self.file_config, tenants=tenants, keys=keys)

    def _next_expiry(self) -> float | None:
        """When the first key that worked at the last :meth:`effective` expires (None: none will)."""
        return min((k.expires_at for k in self.snapshot.keys if k.revoked_at is None
                    and k.expires_at is not None and k.expires_at > self._built_at), default=None)

    def _apply(self, why: str) -> None:
        if self.apply is not None:
            self.apply(self.effective(), why)

    # -- the config file ----------------------------------------------------------------------
    async def reconcile(self, config: Config) -> list[str]:
        """Write the file's tenants into the store by the ``file_tenants`` rule (at start and at each
        reload); returns what changed, by name. Does not apply anything (the caller does)."""
        self.file_config = config
        if self.store is None:
            return []
        async with self._lock:
            self.snapshot = await self.store.load()
            now = self.wall()
            authoritative = config.state.file_tenants == "authoritative"
            changes: list[Change] = []
            audit: list[AuditEntry] = []
            said: list[str] = []
            for name, declared in sorted(config.tenants.items()):
                digest = file_digest(declared)
                record = self.snapshot.tenants.get(name)
                settings = attrs.evolve(declared, api_key_hashes=())
                if record is not None and record.file_digest == digest and (
                        not authoritative or (record.settings == settings and record.deleted_at is None)):
                    continue  # (seed: unchanged in the file since last applied; the store's values stand)
                new = TenantRecord(name, settings, "file", digest, record.created_at if record else now, now)
                changes.append(PutTenant(new))
                existing = record if record is not None and record.deleted_at is None else None
                if existing is not None and existing.settings == settings and existing.origin == "file":
                    continue  # (the digest moved with the keys only: nothing to audit)
                audit.append(AuditEntry(now, "file", "tenant.create" if existing is None else "tenant.update", name,
                                        None if existing is None else settings_dict(existing.settings),
                                        settings_dict(settings)))
                said.append(f"tenant {name} {'created' if existing is None else 'updated'} from {config.source}")
            for name, record in sorted(self.snapshot.tenants.items()):
                if record.file_digest is not None and name not in config.tenants:
                    changes.append(DeleteTenant(name))
                    if record.deleted_at is None:
                        changes += self._revocations(name, now)
                        audit.append(AuditEntry(now, "file", "tenant.delete", name, settings_dict(record.settings)))
                        said.append(f"tenant {name} deleted: {config.source} no longer declares it")
            if changes:
                await self.store.write(changes, audit)
                self.snapshot = await self.store.load()
            self.seeded = True
            return said

    def _revocations(self, tenant: str, now: float) -> list[Change]:
        return [PutKey(attrs.evolve(k, revoked_at=now)) for k in self.snapshot.keys
                if k.tenant == tenant and k.revoked_at is None]

    # -- admin operations ---------------------------------------------------------------------
    def _writable(self) -> StateStore:
        if self.store is None:
            raise AdminError(409, "state_off", '[state] kind = "off": nothing is kept, so nothing can be changed '
                             "through /admin; change the config file and reload")
        if not self.seeded:
            raise AdminError(503, "state_unavailable", f"the state at {self.store.where} cannot be reached now; "
                             "retry when it can (the config file's tenants and keys are served meanwhile)")
        return self.store

    def _guard_file(self, name: str) -> None:
        if self.file_config.state.file_tenants == "authoritative" and name in self.file_config.tenants:
            raise AdminError(409, "declared_in_file", f"tenant {name!r} is declared in {self.file_config.source}, "
                             "which is authoritative ([state] file_tenants): change it there and reload")

    def _record(self, name: str) -> TenantRecord:
        record = self.snapshot.in_force.get(name)
        if record is None:
            raise AdminError(404, "unknown_tenant", f"no tenant named {name!r}")
        return record

    async def _commit(self, changes: list[Change], audit: list[AuditEntry], why: str) -> None:
        store = self._writable()
        with _state_errors(store, "a change"):
            await store.write(changes, audit)
        try:
            self.snapshot = await store.load()
        except Exception as error:  # written, but not read back: apply it as written (the next poll reads it)
            log.warning("state: %s changed, but reading it back failed (%s): applied as written", store.where,
                        _leaf(error), extra={"event": "state"})
            self.snapshot = _applied(self.snapshot, changes)
        self._apply(why)

    async def create_tenant(self, actor: str, body: Mapping[str, Any]) -> TenantRecord:
        self._writable()
        name = body.get("name")
        if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
            raise _bad("name: required: 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
                       "name")
        settings = {k: v for k, v in body.items() if k != "name"}
        try:
            tenant = tenant_from_settings(settings)
            check_tenant_classes({name: tenant}, self.file_config.classes, prefix="")
        except ConfigError as exc:
            raise _config_error(exc) from None
        async with self._lock:
            if name in self.snapshot.in_force:
                raise AdminError(409, "tenant_exists", f"a tenant named {name!r} exists; PATCH it instead", "name")
            self._guard_file(name)
            now = self.wall()
            deleted = self.snapshot.tenants.get(name)  # (the file's declaration stays the older change)
            record = TenantRecord(name, tenant, "admin", deleted.file_digest if deleted else None, now, now)
            await self._commit([PutTenant(record)],
                               [AuditEntry(now, actor, "tenant.create", name, None, settings_dict(tenant))],
                               f"tenant {name} created by {actor}")
            return record

    async def update_tenant(self, actor: str, name: str, patch: Mapping[str, Any]) -> TenantRecord:
        self._writable()
        async with self._lock:
            record = self._record(name)
            self._guard_file(name)
            if "name" in patch and patch["name"] != name:
                raise _bad("name: a tenant cannot be renamed (create another, then delete this one)", "name")
            merged = settings_dict(record.settings) | {k: v for k, v in patch.items() if k != "name"}
            try:
                tenant = tenant_from_settings(merged)
                check_tenant_classes({name: tenant}, self.file_config.classes, prefix="")
            except ConfigError as exc:
                raise _config_error(exc) from None
            if tenant == record.settings:
                return record
            now = self.wall()
            new = attrs.evolve(record, settings=tenant, updated_at=now)
            await self._commit([PutTenant(new)], [AuditEntry(now, actor, "tenant.update", name,
                                                             settings_dict(record.settings), settings_dict(tenant))],
                               f"tenant {name} updated by {actor}")
            return new

    async def delete_tenant(self, actor: str, name: str) -> None:
        self._writable()
        async with self._lock:
            record = self._record(name)
            self._guard_file(name)
            now = self.wall()
            # a tenant the file declares is remembered as deleted, so that the file's unchanged
            # declaration does not bring it back (the latest change wins)
            gone = (PutTenant(attrs.evolve(record, deleted_at=now, updated_at=now)) if record.file_digest is not None
                    else DeleteTenant(name))
            await self._commit([gone, *self._revocations(name, now)],
                               [AuditEntry(now, actor, "tenant.delete", name, settings_dict(record.settings))],
                               f"tenant {name} deleted by {actor}")

    @staticmethod
    def _key_fields(body: Mapping[str, Any], allowed: tuple[str, ...]) -> dict[str, Any]:
        """A key's identity fields from an admin body (``name``, or its old spelling ``label``;
        ``owner``; ``owner_kind``), checked; 422 naming the field."""
        unknown = sorted(set(body) - set(allowed))
        if unknown:
            raise _bad(f"{unknown[0]}: unknown field (fields: {', '.join(allowed)})", unknown[0])
        if "name" in body and "label" in body and body["name"] != body["label"]:
            raise _bad("label: the old name of name: give one of them", "label")
        fields: dict[str, Any] = {}
        for field, source in (("name", "name"), ("name", "label"), ("owner", "owner")):
            if source not in body:
                continue
            value = body[source]
            if not isinstance(value, str) or len(value) > MAX_LABEL_CHARS or any(ord(c) < 32 or 127 <= ord(c) < 160
                                                                                for c in value):
                raise _bad(f"{source}: must be a string of at most {MAX_LABEL_CHARS} printable characters", source)
            fields[field] = value.strip()
        if "owner_kind" in body:
            if body["owner_kind"] not in ("", "person", "agent"):
                raise _bad('owner_kind: must be "person", "agent" or empty', "owner_kind")
            fields["owner_kind"] = body["owner_kind"]
        return fields

    def _key_limits(self, tenant: str, values: Mapping[str, Any]) -> KeyLimits:
        """A key's limits, validated as the config file validates a tenant's (422 naming the field); its
        models must be among its tenant's."""
        try:
            limits = parse_section(KeyLimits, dict(values))
        except ConfigError as exc:
            raise _config_error(exc) from None
        allowed = self._record(tenant).settings.models
        outside = [m for m in limits.models if allowed and m not in allowed]
        if outside:
            raise _bad(f"models: {outside[0]!r} is not among tenant {tenant!r}'s models ({', '.join(allowed)}): "
                       "a key never gets more than its tenant", "models")
        return limits

    def _check_name_free(self, tenant: str, name: str, key_id: str | None, now: float) -> None:
        if name and any(k.tenant == tenant and k.name == name and k.key_id != key_id and k.active(now)
                        for k in self.snapshot.keys):
            raise AdminError(409, "key_name_exists", f"tenant {tenant!r} has a key named {name!r} already; "
                             "names tell a tenant's keys apart", "name")

    async def issue_key(self, actor: str, tenant: str, body: Mapping[str, Any]) -> tuple[KeyRecord, str]:
        """A new key for ``tenant`` (body, every field optional: ``name``, ``owner``, ``owner_kind``, its
        limits (:class:`~apsd.core.config.KeyLimits`' fields), and ``expires_in_s`` or ``expires_at``);
        returns its record and the key, which is never stored nor shown again."""
        self._writable()
        limit_fields = tuple(f.name for f in attrs.fields(KeyLimits))
        identity = self._key_fields({k: v for k, v in body.items() if k not in limit_fields},
                                    ("name", "label", "owner", "owner_kind", "expires_in_s", "expires_at"))
        now = self.wall()
        expires_at = self._expiry(body, now)
        if not self.file_config.auth.admin_hashes():
            raise AdminError(409, "admin_key_required", "issuing a key turns authentication on, and no admin key "
                             "is configured, so /admin would lock you out: add [auth] admin_key_hashes "
                             "('apsd hash-key --new') to the config file and reload first")
        async with self._lock:
            self._record(tenant)
            limits = self._key_limits(tenant, {k: v for k, v in body.items() if k in limit_fields})
            self._check_name_free(tenant, identity.get("name", ""), None, now)
            key = new_key()
            record = KeyRecord(key_id="key_" + secrets.token_hex(6), tenant=tenant, prefix=key[:KEY_PREFIX_CHARS],
                               key_hash=hash_key(key), name=identity.get("name", ""), created_at=now,
                               expires_at=expires_at, owner=identity.get("owner", ""),
                               owner_kind=identity.get("owner_kind", ""), limits=limits)
            await self._commit([PutKey(record)],
                               [AuditEntry(now, actor, "key.issue", f"key:{record.key_id}", None,
                                           key_view(record, now))],
                               f"key {_named(record)} issued to tenant {tenant} by {actor}")
            return record, key

    async def update_key(self, actor: str, key_id: str, patch: Mapping[str, Any]) -> KeyRecord:
        """Change a key's name, owner, owner kind or limits (a limit left out keeps its value; ``null``
        or 0 sets it back to its tenant's)."""
        self._writable()
        limit_fields = tuple(f.name for f in attrs.fields(KeyLimits))
        identity = self._key_fields({k: v for k, v in patch.items() if k not in limit_fields},
                                    ("name", "label", "owner", "owner_kind"))
        async with self._lock:
            record = next((k for k in self.snapshot.keys if k.key_id == key_id), None)
            if record is None:
                raise AdminError(404, "unknown_key", f"no key with id {key_id!r}")
            now = self.wall()
            if not record.active(now):
                raise AdminError(409, "key_inactive", f"key {key_id!r} is revoked or expired: issue another")
            merged = limits_dict(record.limits) | {k: v for k, v in patch.items() if k in limit_fields and v is not None}
            for field in (k for k in limit_fields if k in patch and patch[k] is None):
                merged.pop(field, None)
            limits = self._key_limits(record.tenant, merged)
            self._check_name_free(record.tenant, identity.get("name", record.name), key_id, now)
            new = attrs.evolve(record, limits=limits, **identity)
            if new == record:
                return record
            await self._commit([PutKey(new)],
                               [AuditEntry(now, actor, "key.update", f"key:{key_id}", key_view(record, now),
                                           key_view(new, now))],
                               f"key {_named(new)} of tenant {record.tenant} updated by {actor}")
            return new

    @staticmethod
    def _expiry(body: Mapping[str, Any], now: float) -> float | None:
        if "expires_in_s" in body and "expires_at" in body:
            raise _bad("expires_at: give expires_in_s or expires_at, not both", "expires_at")
        for field, base in (("expires_in_s", now), ("expires_at", 0.0)):
            if field not in body or body[field] is None:
                continue
            value = body[field]
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise _bad(f"{field}: must be a number of seconds", field)
            at = base + float(value)
            if not now < at <= now + MAX_KEY_LIFETIME_S:
                raise _bad(f"{field}: the key must expire in the future, within ten years", field)
            return at
        return None

    async def revoke_key(self, actor: str, key_id: str) -> KeyRecord:
        self._writable()
        async with self._lock:
            record = next((k for k in self.snapshot.keys if k.key_id == key_id), None)
            if record is None:
                raise AdminError(404, "unknown_key", f"no key with id {key_id!r}")
            if record.revoked_at is not None:
                return record
            now = self.wall()
            revoked = attrs.evolve(record, revoked_at=now)
            await self._commit([PutKey(revoked)],
                               [AuditEntry(now, actor, "key.revoke", f"key:{key_id}", key_view(record, now),
                                           key_view(revoked, now))],
                               f"key {_named(record)} of tenant {record.tenant} revoked by {actor}")
            return revoked

    # -- reads --------------------------------------------------------------------------------
    def tenant_source(self, name: str) -> str:
        record = self.snapshot.in_force.get(name)
        return record.origin if record is not None else "file"

    def key_views(self, tenant: str | None = None) -> list[dict[str, Any]]:
        now = self.wall()
        return [key_view(k, now) for k in self.snapshot.keys if tenant is None or k.tenant == tenant]

    async def usage_rows(self, *, tenant: str | None, start: float, end: float) -> dict[UsageKey, dict[str, float]]:
        """Usage of the hours that overlap ``[start, end)`` (Unix seconds), of ``tenant`` or every
        tenant: what the state holds plus what the next flush will add, so an answer is current."""
        first_hour = int(start) // HOUR_S * HOUR_S
        async with self._usage_lock:
            if self.store is None:
                rows = {}
            else:
                with _state_errors(self.store, "reading usage"):
                    rows = await self.store.usage(tenant=tenant, start=first_hour, end=math.ceil(end))
            pending = self.usage.pending() if self.usage is not None else {}
        for key, fields in pending.items():
            if (tenant is None or key.tenant == tenant) and first_hour <= key.hour < end:
                merged = rows.setdefault(key, {})
                for field, amount in fields.items():
                    merged[field] = merged.get(field, 0) + amount
        return rows

    async def claim_alert(self, account: str, period: str, threshold: float, at: float) -> bool:
        """Whether this replica is the first to claim the budget alert of ``account`` at ``threshold`` in
        ``period`` (:mod:`apsd.serve.alerts`: it is sent once, across replicas and restarts). Raises
        when the state cannot be reached (the alert is claimed at a later try)."""
        if self.store is None:
            return True
        return await self.store.claim_alert(account, period, threshold, at)

    async def audit(self, *, target: str | None, limit: int, before_id: int | None) -> list[AuditEntry]:
        """The audit log, newest first (:meth:`StateStore.audit`); 503 ``state_unavailable`` when the
        state cannot be read now."""
        if self.store is None:
            return []
        with _state_errors(self.store, "reading the audit log"):
            return await self.store.audit(target=target, limit=limit, before_id=before_id)

    # -- background ---------------------------------------------------------------------------
    async def run(self, *, buckets: Callable[[], Mapping[str, tuple[float, float]]],
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Flush (usage, buckets, spend) and look for other replicas' changes until cancelled; a last
        flush on the way out. ``buckets`` gives tenant -> (tokens, Unix seconds) to keep."""
        task_status.started()
        if self.store is None:
            await trio.sleep_forever()
        settings = self.file_config.state
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._every, settings.flush_interval_s, lambda: self.flush(buckets()))
                nursery.start_soon(self._every, settings.poll_interval_s, self.poll)
                if self.copy is not None:
                    nursery.start_soon(self._every, settings.flush_interval_s, self.follow)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2.0):
                try:
                    await self.flush(buckets())
                except Exception as exc:  # (the state cannot be reached: what was not written is lost)
                    log.warning("state: the last flush failed, usage since the previous one is lost: %s: %s",
                                type(_leaf(exc)).__name__, _leaf(exc), extra={"event": "state"})

    @staticmethod
    async def _every(interval: float, work: Callable[[], Any]) -> None:
        """``work`` every ``interval`` seconds; a failure (a store that cannot be reached now may be
        reachable later) is logged at WARNING once, then at DEBUG until it works again."""
        failing = False
        what = getattr(work, "__name__", "flush")
        while True:
            await trio.sleep(interval)
            try:
                await work()
            except Exception as error:
                exc = _leaf(error)
                log.log(logging.DEBUG if failing else logging.WARNING, "state: %s failed (retried every %g s): %s: %s",
                        what, interval, type(exc).__name__, exc, extra={"event": "state"})
                failing = True
            else:
                if failing:
                    log.warning("state: %s works again", what, extra={"event": "state"})
                failing = False

    async def poll(self) -> None:
        """Apply changes another replica (or process) made, and expiries."""
        assert self.store is not None
        if not self.seeded:  # (unreachable at start: seed it now, and serve what it holds)
            await self.reconcile(self.file_config)
            log.warning("state: %s reached: its tenants and keys are served", self.store.where,
                        extra={"event": "state"})
            self._apply("the state was reached")
            return
        version = await self.store.version()
        expiry = self._next_expiry()
        if version < self.snapshot.version:
            await self._write_back(version)
        elif version != self.snapshot.version:
            async with self._lock:
                self.snapshot = await self.store.load()
            self._apply("tenants or keys changed in the state")
        elif expiry is not None and expiry <= self.wall():
            self._apply("a key expired")

    async def _write_back(self, version: int) -> None:
        """The store went back in time (a Redis restarted without persistence, or restored from an
        older dump): write back the tenants and keys this replica knows, so that no tenant or key
        made through ``/admin`` is lost while one replica remembers it."""
        assert self.store is not None
        async with self._lock:
            known = self.snapshot
            log.warning("state: %s went back from version %d to %d (restarted without its data?): writing back "
                        "the %d tenants and %d keys this replica knows", self.store.where, known.version, version,
                        len(known.tenants), len(known.keys), extra={"event": "state"})
            stored = await self.store.load()
            changes: list[Change] = [PutTenant(r) for name, r in sorted(known.tenants.items())
                                     if name not in stored.tenants]
            present = {k.key_id for k in stored.keys}
            changes += [PutKey(k) for k in known.keys if k.key_id not in present]
            await self.store.write(changes, [AuditEntry(self.wall(), "state", "state.restore", self.store.where,
                                                        {"version": known.version}, {"version": version})])
            self.snapshot = await self.store.load()
            if self.copy is not None and self.copy.followed and await self.copy.store.claim_restore():
                copied = await self.copy.local.dump()
                await self.copy.store.restore_audit(copied.audit)
                await self.store.add_usage(copied.usage)
                log.warning("state: wrote back %d audit entries and %d usage rows into %s from this replica's copy",
                            len(copied.audit), len(copied.usage), self.store.where, extra={"event": "state"})
        self._apply("the state was written back")

    async def follow(self) -> None:
        """Bring this replica's copy of a Redis state's audit log and usage up to date (not while the
        state looks as if it lost its data: the next poll writes the copy back first)."""
        assert self.store is not None and self.copy is not None
        async with self._lock:
            if not self.seeded or await self.store.version() < self.snapshot.version:
                return
            await self.copy.follow(self.wall())

    async def flush(self, buckets: Mapping[str, tuple[float, float]]) -> None:
        """Write usage, bucket levels and budget spend (what a kill -9 would lose)."""
        store = self.store
        if store is None:
            return
        if self.usage is not None:
            async with self._usage_lock:  # (a reader sees these rows pending or stored, never neither)
                rows = self.usage.take()
                try:
                    await store.add_usage(rows)
                except BaseException:
                    self.usage.give_back(rows)
                    raise
        await store.save_buckets(buckets)
        if self.budgets is not None:
            await self._exchange_spend(store)
        now = self.wall()
        if now - self._pruned_at < PRUNE_INTERVAL_S:
            return
        self._pruned_at = now
        settings = self.file_config.state
        await store.prune(usage_before=int(now - settings.usage_retention_days * 86_400) // HOUR_S * HOUR_S
                          if settings.usage_retention_days else None,
                          audit_before=now - settings.audit_retention_days * 86_400
                          if settings.audit_retention_days else None)

    async def _exchange_spend(self, store: StateStore) -> None:
        budgets = self.budgets
        assert budgets is not None
        if budgets.shared:
            return  # (the shared store counts the spend of budgets it leases: apsd.store.leasing)
        settled = budgets.take_settled()
        try:
            totals = await store.add_spend(settled)
        except BaseException:
            budgets.untake(settled)  # (kept for the next flush)
            raise
        limits = budgets.limits()
        wanted = [(account, key) for account, key in budgets.periods().items() if (account, key) not in totals]
        totals |= await store.spend(wanted)
        for (account, key), spent in totals.items():
            if account in limits:
                budgets.set_spent(limits[account], key, spent)

    def effective_tenants(self) -> dict[str, TenantConfig]:
        if self.store is None or not self.seeded:
            return dict(self.file_config.tenants)
        return {name: record.settings for name, record in self.snapshot.in_force.items()}

    async def restore(self, budgets: Budgets) -> dict[str, tuple[float, float]]:
        """At start: the spend of the current periods of the budgets in force (``budgets.limits()``:
        tenants' and keys', tokens and dollars), and the saved bucket levels."""
        self.budgets = budgets
        if self.store is None or not self.seeded:
            return {}
        from apsd.core.budget import period_key

        now = self.wall()
        limits = budgets.limits()
        keys = [(account, period_key(limit.period, now)) for account, limit in limits.items()]
        for (account, key), spent in (await self.store.spend(keys)).items():
            budgets.set_spent(limits[account], key, spent)
        return await self.store.load_buckets()

    async def close(self) -> None:
        if self.store is not None:
            with trio.CancelScope(shield=True):
                await self.store.close()
                if self.copy is not None:
                    await self.copy.close()



def _named(record: KeyRecord) -> str:
    """A key in a log line: its id, and its name when it has one (never the key)."""
    return f"{record.key_id} {record.name!r}" if record.name else record.key_id


def _applied(snapshot: Snapshot, changes: list[Change]) -> Snapshot:
    """``snapshot`` with ``changes`` applied (as the store applied them), its version unchanged."""
    tenants, keys = dict(snapshot.tenants), {k.key_id: k for k in snapshot.keys}
    for change in changes:
        match change:
            case PutTenant(record):
                tenants[record.name] = record
            case DeleteTenant(name):
                tenants.pop(name, None)
            case PutKey(record):
                keys[record.key_id] = record
    return Snapshot(tenants, tuple(sorted(keys.values(), key=lambda k: k.key_id)), snapshot.version)


@attrs.define(eq=False)
class RedisCopy:
    """A replica's copy of a Redis state's audit log and usage (see the module docstring), in a SQLite
    file of its own: :meth:`follow` copies the entries after the last one it has, and the usage rows
    of the last two hours (all of them the first time); the file is removed at :meth:`close`."""

    #: The Redis state it copies.
    store: RedisStateStore
    local: SqliteState
    path: Path
    followed: bool = False
    _audit_seen: int = 0

    @classmethod
    def open(cls, store: RedisStateStore) -> RedisCopy | None:
        import tempfile

        from apsd.state.sqlite import StateFileError

        descriptor, name = tempfile.mkstemp(prefix="apsd-redis-copy-", suffix=".db")
        os.close(descriptor)
        try:
            return cls(store, SqliteState(Path(name)), Path(name))
        except StateFileError as exc:
            log.warning("state: no copy of the audit log and usage can be kept (%s): a Redis restarted without "
                        "its data would lose them", exc, extra={"event": "state"})
            return None

    async def follow(self, now: float) -> None:
        store = self.store
        entries = await store.audit_after(self._audit_seen)
        await self.local.copy_audit(entries)
        if entries:
            self._audit_seen = entries[-1].entry_id
        start = (int(now) // HOUR_S - 2) * HOUR_S if self.followed else 0
        await self.local.copy_usage(await store.usage(tenant=None, start=start, end=2**62))
        self.followed = True

    async def close(self) -> None:
        await self.local.close()
        for suffix in ("", "-wal", "-shm"):
            await trio.Path(str(self.path) + suffix).unlink(missing_ok=True)
