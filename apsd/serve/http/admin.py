"""The operator's API under ``/admin``: tenants, keys, the audit log and usage, live.

Every endpoint needs the admin key (403 ``admin_only`` for any other key; without keys, on
loopback, it is open). Bodies and answers are JSON; :func:`openapi_document` (``GET /admin/openapi.json``)
describes them, the tenant's fields taken from :class:`~apsd.core.config.TenantConfig` itself. A
change is written to the state with its audit entry (:mod:`apsd.state.keeper`), applied here at
once, and on every other replica within ``[state] poll_interval_s``; none needs a reload.

Errors are apsd's ``{"error", "message", "field"}``: 415 ``unsupported_media_type`` for a body sent
without ``Content-Type: application/json`` while no key is configured, 400 for a body that is not a JSON object,
422 ``invalid_field`` naming the field for a value the config file would refuse too (the same
validation), 404 for an unknown tenant or key, 409 for a conflict (``tenant_exists``,
``declared_in_file``, ``admin_key_required``, ``state_off``), 503 ``state_unavailable`` when the state
(Redis, the SQLite file) cannot be written or read now (Redis down, a full disk): nothing changed.

An issued key is in the answer to ``POST /admin/tenants/<name>/keys`` and nowhere else: the state
keeps its hash, lists show its id and first characters, the audit log and the log name it by its name
and id. A key has a name, an owner (a person or an agent) and limits of its own inside its tenant's
(:class:`~apsd.core.config.KeyLimits`: rate, budgets in tokens and dollars, ``max_concurrency``,
models), changed with ``PATCH /admin/keys/<id>``; usage is kept per key (``GET /admin/usage?by=key``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
from quart import Blueprint, Response, request

from apsd.core.budget import MICRO, TOKENS, USD, BudgetLimit, Budgets, budget_account
from apsd.core.config import KeyLimits, TenantConfig, field_comments
from apsd.core.models import Refusal
from apsd.serve.auth import Caller
from apsd.serve.http.common import (
    BodyError,
    authenticated,
    error_response,
    http_state,
    json_response,
    parse_json_object,
)
from apsd.state.keeper import AdminError, StateKeeper
from apsd.state.records import settings_dict
from apsd.state.usage import summarize, to_csv

__all__ = ["blueprint", "openapi_document"]

blueprint = Blueprint("admin", __name__, url_prefix="/admin")

#: Most audit entries one answer lists.
MAX_AUDIT_LIMIT = 1000
#: The longest span one usage query may cover.
MAX_USAGE_SPAN_S = 400 * 86_400


def _keeper() -> StateKeeper:
    keeper = http_state().keeper
    if keeper is None:  # (an app made without a daemon: tests of the other blueprints)
        raise AdminError(503, "state_unavailable", "this server keeps no state")
    return keeper


def _actor(caller: Caller) -> str:
    return caller.actor or "admin"


def _refused(exc: AdminError | BodyError) -> Response:
    refusal = exc.refusal if isinstance(exc, BodyError) else Refusal(exc.status, exc.error, exc.message,
                                                                      field=exc.field)
    http_state().pipeline.ledger.count_refusal(None, refusal.error)
    return error_response(refusal)


def admin_endpoint(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """An ``/admin`` route: the admin key only (:func:`authenticated`); the handler gets the daemon's
    keeper as ``keeper=`` and the caller, and an :class:`AdminError` or :class:`BodyError` it raises
    is answered (and counted) as apsd's error."""
    @authenticated(admin=True)
    @functools.wraps(handler)
    async def guarded(*args: Any, caller: Caller, **kwargs: Any) -> Any:
        try:
            return await handler(*args, keeper=_keeper(), caller=caller, **kwargs)
        except (AdminError, BodyError) as exc:
            return _refused(exc)
    return guarded


async def _body() -> dict[str, Any]:
    """The request's JSON object. Without API keys, 415 ``unsupported_media_type`` unless its
    ``Content-Type`` says JSON: a browser sends a cross-site form, or a ``no-cors`` fetch, only as
    ``text/plain``, form data or multipart, so requiring JSON makes any other page's request need a
    CORS preflight, never granted. (With keys, the ``Authorization`` header does that already.)"""
    state = http_state()
    if request.mimetype != "application/json" and not state.keyring.get(state.pipeline.config).enabled:
        await request.get_data(cache=False, as_text=False, parse_form_data=False)  # (read it: the connection stays usable)
        raise BodyError(415, "unsupported_media_type", "an /admin body must be JSON, sent with 'Content-Type: "
                        f"application/json' (got {request.headers.get('Content-Type', 'none')[:80]!r})")
    return parse_json_object(await request.get_data(cache=False, as_text=False, parse_form_data=False))


def budget_document(budgets: Budgets, limit: BudgetLimit | None) -> dict[str, Any] | None:
    """A budget as the admin API and the status page show it: tokens, or dollars (``_usd`` fields)."""
    if limit is None:
        return None
    view = budgets.view(limit)
    common = {"unit": view.unit, "period": view.period, "resets_at": view.resets_at,
              "used_ratio": round(view.used_ratio, 6)}
    if view.unit == TOKENS:
        return {"limit": view.limit, "spent": view.spent, "reserved": view.reserved, **common}
    return {"limit_usd": view.limit / MICRO, "spent_usd": view.spent / MICRO, "reserved_usd": view.reserved / MICRO,
            **common}


def budgets_of(tenant: str, key_id: str | None = None) -> dict[str, dict[str, Any] | None]:
    """The tenant's (or its key's) budgets now: ``budget`` (tokens) and ``budget_usd``, each None when unset."""
    budgets = http_state().pipeline.admission.budgets
    limits = budgets.limits()
    return {"budget": budget_document(budgets, limits.get(budget_account(tenant, key_id, TOKENS))),
            "budget_usd": budget_document(budgets, limits.get(budget_account(tenant, key_id, USD)))}


def tenant_view(keeper: StateKeeper, name: str) -> dict[str, Any] | None:
    """A tenant's settings, where they come from, its keys and its live figures (None: no such tenant)."""
    pipeline = http_state().pipeline
    tenant = pipeline.config.tenants.get(name)
    if tenant is None:
        return None
    status = pipeline.tenant_status(name)
    budgets = budgets_of(name)
    keys = keeper.key_views(name)
    declared = name in keeper.file_config.tenants
    return {"name": name, **settings_dict(tenant), "source": keeper.tenant_source(name),
            "declared_in_file": declared,
            "keys": {"issued": len(keys), "active": sum(k["active"] for k in keys),
                     "in_file": len(keeper.file_config.tenants[name].api_key_hashes) if declared else 0},
            "live": None if status is None else {
                "tokens_available": round(status.tokens_available, 3), "queued": status.queued,
                "running": status.running, "admitted": status.admitted, "completed": status.completed,
                "rejected": status.rejected, "prompt_tokens": status.prompt_tokens,
                "generated_tokens": status.generated_tokens, "spend_usd": status.spend_usd,
                "waiting_for_concurrency": status.waiting_for_concurrency,
                "budget_used": None if (tokens := budgets.get("budget")) is None else tokens["spent"]
                + tokens["reserved"], **budgets}}


# -- tenants ---------------------------------------------------------------------------------------

def _unknown_tenant(name: str) -> AdminError:
    return AdminError(404, "unknown_tenant", f"no tenant named {name!r}")


@blueprint.get("/tenants")
@admin_endpoint
async def list_tenants(keeper: StateKeeper, caller: Caller) -> Any:
    names = sorted(http_state().pipeline.config.tenants)
    return json_response({"tenants": [tenant_view(keeper, name) for name in names]})


@blueprint.post("/tenants")
@admin_endpoint
async def create_tenant(keeper: StateKeeper, caller: Caller) -> Any:
    record = await keeper.create_tenant(_actor(caller), await _body())
    return json_response(tenant_view(keeper, record.name), status=201,
                         headers={"Location": f"/admin/tenants/{record.name}"})


@blueprint.get("/tenants/<name>")
@admin_endpoint
async def get_tenant(name: str, keeper: StateKeeper, caller: Caller) -> Any:
    view = tenant_view(keeper, name)
    if view is None:
        raise _unknown_tenant(name)
    return json_response(view)


@blueprint.patch("/tenants/<name>")
@admin_endpoint
async def update_tenant(name: str, keeper: StateKeeper, caller: Caller) -> Any:
    await keeper.update_tenant(_actor(caller), name, await _body())
    return json_response(tenant_view(keeper, name))


@blueprint.delete("/tenants/<name>")
@admin_endpoint
async def delete_tenant(name: str, keeper: StateKeeper, caller: Caller) -> Any:
    await keeper.delete_tenant(_actor(caller), name)
    return no_content()


def no_content() -> Response:
    """204 with nothing after its head. (``Response(status=204)`` gets quart's default body, an
    iterable it drives with asyncio: under trio that raised "no running event loop" in the middle of
    the answer, logged an ASGI error and dropped the keep-alive connection.)"""
    answer = Response(b"", status=204)
    del answer.headers["Content-Type"], answer.headers["Content-Length"]
    return answer


# -- keys ------------------------------------------------------------------------------------------

def key_views(keeper: StateKeeper, tenant: str | None = None, key_id: str | None = None) -> list[dict[str, Any]]:
    """Issued keys (of ``tenant``, or the one ``key_id``) as the admin API shows them: the record's view
    (:func:`apsd.state.records.key_view`) and its live figures on this replica: requests and tokens
    since start, its spend, its budgets now and its requests in flight."""
    pipeline = http_state().pipeline
    views = []
    for view in keeper.key_views(tenant):
        if key_id is not None and view["id"] != key_id:
            continue
        stats = pipeline.ledger.keys.get(view["id"])
        view["live"] = {
            "admitted": stats.admitted if stats else 0, "completed": stats.completed if stats else 0,
            "prompt_tokens": stats.prompt_tokens if stats else 0,
            "generated_tokens": stats.generated_tokens if stats else 0,
            "spend_usd": stats.spend_usd if stats else 0.0,
            **(budgets_of(view["tenant"], view["id"]) if view["active"] else {"budget": None, "budget_usd": None})}
        views.append(view)
    return views


@blueprint.post("/tenants/<name>/keys")
@admin_endpoint
async def issue_key(name: str, keeper: StateKeeper, caller: Caller) -> Any:
    body = await _body() if await request.get_data(cache=True) else {}
    record, key = await keeper.issue_key(_actor(caller), name, body)
    (view,) = key_views(keeper, name, record.key_id)
    return json_response({**view, "key": key}, status=201, headers={"Cache-Control": "no-store"})


@blueprint.get("/tenants/<name>/keys")
@admin_endpoint
async def tenant_keys(name: str, keeper: StateKeeper, caller: Caller) -> Any:
    if name not in keeper.snapshot.in_force and name not in http_state().pipeline.config.tenants:
        raise _unknown_tenant(name)
    return json_response({"keys": key_views(keeper, name)})


@blueprint.get("/keys")
@admin_endpoint
async def list_keys(keeper: StateKeeper, caller: Caller) -> Any:
    return json_response({"keys": key_views(keeper, request.args.get("tenant"))})


def _one_key(keeper: StateKeeper, key_id: str) -> dict[str, Any]:
    views = key_views(keeper, key_id=key_id)
    if not views:
        raise AdminError(404, "unknown_key", f"no key with id {key_id!r}")
    return views[0]


@blueprint.get("/keys/<key_id>")
@admin_endpoint
async def get_key(key_id: str, keeper: StateKeeper, caller: Caller) -> Any:
    return json_response(_one_key(keeper, key_id))


@blueprint.patch("/keys/<key_id>")
@admin_endpoint
async def update_key(key_id: str, keeper: StateKeeper, caller: Caller) -> Any:
    await keeper.update_key(_actor(caller), key_id, await _body())
    return json_response(_one_key(keeper, key_id))


@blueprint.delete("/keys/<key_id>")
@admin_endpoint
async def revoke_key(key_id: str, keeper: StateKeeper, caller: Caller) -> Any:
    record = await keeper.revoke_key(_actor(caller), key_id)
    return json_response(_one_key(keeper, record.key_id))


# -- audit and usage -------------------------------------------------------------------------------

def _int_arg(name: str, default: int | None, low: int, high: int) -> int | None:
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise AdminError(400, "invalid_parameter", f"{name} must be an integer, got {raw[:40]!r}", name) from None
    if not low <= value <= high:
        raise AdminError(400, "invalid_parameter", f"{name} must be between {low} and {high}", name)
    return value


@blueprint.get("/audit")
@admin_endpoint
async def audit(keeper: StateKeeper, caller: Caller) -> Any:
    """Newest first; ``?target=`` (a tenant, or ``key:<id>``), ``?limit=`` (1-1000, default 100),
    ``?before=`` (an entry id: the page after)."""
    limit = _int_arg("limit", 100, 1, MAX_AUDIT_LIMIT)
    before = _int_arg("before", None, 1, 2**62)
    entries = await keeper.audit(target=request.args.get("target"), limit=limit or 100, before_id=before)
    return json_response({"entries": [entry.view() for entry in entries]})


def _time_arg(name: str, default: float) -> float:
    """A time parameter: Unix seconds, or an ISO 8601 date or time (UTC unless it says otherwise)."""
    raw = request.args.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
        if math.isfinite(value):
            return value
    except ValueError:
        pass
    import datetime

    try:
        moment = datetime.datetime.fromisoformat(raw)
    except ValueError:
        raise AdminError(400, "invalid_parameter", f"{name} must be Unix seconds or an ISO 8601 date or time "
                         f"(2026-11-26, 2026-11-26T14:00Z), got {raw[:40]!r}", name) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = request.args.get(name, default)
    if value not in choices:
        raise AdminError(400, "invalid_parameter", f"{name} must be {' or '.join(c or '(absent)' for c in choices)}",
                         name)
    return value


@blueprint.get("/usage")
@admin_endpoint
async def usage(keeper: StateKeeper, caller: Caller) -> Any:
    """``?tenant=&key=&from=&to=&group_by=hour|day&by=model|key|model,key&format=json|csv`` (default:
    every tenant, the last 24 hours by hour, JSON). ``by=key`` gives a row per issued key (``key``: its
    id, ``key_name``; ``""`` for requests without an issued key); ``key=<id>`` keeps one key's rows."""
    end = _time_arg("to", keeper.wall())
    start = _time_arg("from", end - 86_400)
    group_by = _choice("group_by", "hour", ("hour", "day"))
    view = _choice("format", "json", ("json", "csv"))
    by = _choice("by", "", ("model", "key", "model,key", "key,model", ""))
    if not start < end:
        raise AdminError(400, "invalid_parameter", "from must be before to", "from")
    if end - start > MAX_USAGE_SPAN_S:
        raise AdminError(400, "invalid_parameter", "from and to may be at most 400 days apart", "from")
    rows = await keeper.usage_rows(tenant=request.args.get("tenant") or None, start=start, end=end)
    only_key = request.args.get("key")
    if only_key:
        rows = {row: fields for row, fields in rows.items() if row.key == only_key}
    names = {k.key_id: k.label for k in keeper.snapshot.keys}
    summaries = summarize(rows, group_by=group_by, by_model="model" in by, by_key="key" in by or bool(only_key),
                          key_names=names)
    if view == "csv":
        return Response(to_csv(summaries), status=200, content_type="text/csv; charset=utf-8",
                        headers={"Content-Disposition": 'attachment; filename="apsd-usage.csv"'})
    return json_response({"from": start, "to": end, "group_by": group_by, "rows": summaries})


# -- the description -------------------------------------------------------------------------------

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean"}


def _tenant_schema() -> dict[str, Any]:
    comments = field_comments(TenantConfig)
    properties: dict[str, Any] = {"name": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                                           "description": "The tenant's name (cannot change)."}}
    for field in attrs.fields(attrs.resolve_types(TenantConfig)):
        if field.name == "api_key_hashes":
            continue
        schema: dict[str, Any] = ({"type": "array", "items": {"type": "string"}} if field.name in ("models", "classes")
                                  else {"type": _JSON_TYPES.get(field.type, "string")})  # type: ignore[arg-type]
        if field.default is not attrs.NOTHING:
            default = field.default
            schema["default"] = list(default) if isinstance(default, tuple) else default
        schema["description"] = comments.get(field.name, "")
        properties[field.name] = schema
    return {"type": "object", "properties": properties, "required": ["name", "rate", "burst"],
            "additionalProperties": False}


def _key_identity_schema() -> dict[str, Any]:
    return {"name": {"type": "string", "maxLength": 200,
                     "description": "A name for people, unique among the tenant's keys in force (label: its old name)."},
            "label": {"type": "string", "maxLength": 200, "description": "The old name of name."},
            "owner": {"type": "string", "maxLength": 200,
                      "description": "Who holds it: a person or an agent (e.g. alice@example.com, claude-code/ci)."},
            "owner_kind": {"type": "string", "enum": ["", "person", "agent"]}}


def _key_limits_schema() -> dict[str, Any]:
    comments = field_comments(KeyLimits)
    properties: dict[str, Any] = {}
    for field in attrs.fields(attrs.resolve_types(KeyLimits)):
        schema: dict[str, Any] = ({"type": ["array", "null"], "items": {"type": "string"}} if field.name == "models"
                                  else {"type": [_JSON_TYPES.get(field.type, "string"), "null"]})  # type: ignore[arg-type]
        default = field.default
        schema["default"] = list(default) if isinstance(default, tuple) else default
        schema["description"] = comments.get(field.name, "") + " (null: back to none of its own)"
        properties[field.name] = schema
    return properties


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of ``/admin``."""
    error = {"$ref": "#/components/schemas/Error"}
    answers = {"401": {"description": "no valid key", "content": {"application/json": {"schema": error}}},
               "403": {"description": "not the admin key", "content": {"application/json": {"schema": error}}}}

    def op(summary: str, ok: str, *, body: str | None = None, extra: tuple[str, ...] = ()) -> dict[str, Any]:
        operation: dict[str, Any] = {"summary": summary, "responses": {ok: {"description": "done"}, **answers}}
        for status in extra:
            operation["responses"][status] = {"description": "refused",
                                              "content": {"application/json": {"schema": error}}}
        if body:
            operation["requestBody"] = {"content": {"application/json": {"schema": {"$ref": body}}}}
        return operation

    name = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "openapi": "3.1.0",
        "info": {"title": "apsd admin API", "version": "1"},
        "security": [{"bearer": []}],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "Tenant": _tenant_schema(),
                "TenantPatch": {**_tenant_schema(), "required": []},
                "KeyRequest": {"type": "object", "additionalProperties": False, "properties": {
                    **_key_identity_schema(),
                    "expires_in_s": {"type": "number", "description": "Seconds from now until it stops working."},
                    "expires_at": {"type": "number", "description": "Unix seconds when it stops working."},
                    **_key_limits_schema()}},
                "KeyPatch": {"type": "object", "additionalProperties": False, "properties": {
                    **_key_identity_schema(), **_key_limits_schema()}},
                "Error": {"type": "object", "properties": {"error": {"type": "string"}, "message": {"type": "string"},
                                                           "field": {"type": "string"}}},
            },
        },
        "paths": {
            "/admin/tenants": {"get": op("List tenants with their settings, source, keys and live figures", "200"),
                               "post": op("Create a tenant", "201", body="#/components/schemas/Tenant",
                                          extra=("400", "409", "422"))},
            "/admin/tenants/{name}": {
                "parameters": name,
                "get": op("Read a tenant", "200", extra=("404",)),
                "patch": op("Change some of a tenant's settings (disabled: true disables it)", "200",
                            body="#/components/schemas/TenantPatch", extra=("400", "404", "409", "422")),
                "delete": op("Delete a tenant (its keys are revoked)", "204", extra=("404", "409"))},
            "/admin/tenants/{name}/keys": {
                "parameters": name,
                "get": op("List a tenant's issued keys (id and prefix, never the key)", "200", extra=("404",)),
                "post": op("Issue a key: the answer's key field is shown this once", "201",
                           body="#/components/schemas/KeyRequest", extra=("400", "404", "409", "422"))},
            "/admin/keys": {"get": op("List issued keys (?tenant=)", "200")},
            "/admin/keys/{key_id}": {
                "parameters": [{"name": "key_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": op("Read a key: its name, owner, limits and live figures", "200", extra=("404",)),
                "patch": op("Change a key's name, owner or limits", "200", body="#/components/schemas/KeyPatch",
                            extra=("400", "404", "409", "422")),
                "delete": op("Revoke a key", "200", extra=("404",))},
            "/admin/audit": {"get": op("The audit log, newest first (?target=&limit=&before=)", "200", extra=("400",))},
            "/admin/usage": {"get": op("Usage per tenant and hour or day (?tenant=&key=&from=&to=&group_by=hour|day"
                                       "&by=model|key|model,key&format=json|csv)", "200", extra=("400",))},
            "/admin/status": {"get": op("What the status page (/ui) shows, now: tenants, backends, engine, "
                                        "fairness history, usage per day", "200")},
            "/admin/openapi.json": {"get": op("This description", "200")},
        },
    }


@blueprint.get("/openapi.json")
@admin_endpoint
async def openapi(keeper: StateKeeper, caller: Caller) -> Any:
    return json_response(openapi_document())
