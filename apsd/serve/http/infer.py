"""apsd's own protocol: ``POST /infer``, one request answered with its :class:`~apsd.core.models.Completion`.

Every error answer is JSON ``{"error": code, "message": text[, "field": name]}``
(:func:`~apsd.serve.http.common.error_response`).
"""

from __future__ import annotations

import json
import math

import attrs
from quart import Blueprint, Response, request

from apsd.core.config import clamp_bid
from apsd.core.models import Completion
from apsd.serve.auth import Caller
from apsd.serve.http.common import (
    MAX_TENANT_ID_CHARS,
    MAX_TOKENS_REQUESTED,
    BodyError,
    authenticated,
    begin_trace,
    check_prompt_length,
    error_response,
    finish_trace,
    http_state,
    json_response,
    note_tenant,
    parse_json_object,
    service_class,
    shown,
)

__all__ = ["MAX_TIMEOUT_S", "InferBody", "blueprint", "parse_infer_body"]

blueprint = Blueprint("infer", __name__)

_INFER_FIELDS = {"tenant_id": str, "prompt": str, "tokens_requested": int, "priority_bid": int}
#: Optional fields. ``timeout_s``: model seconds the request may wait queued, > 0; a value above
#: ``[queue] timeout_s`` is not refused but clamped to it (only the config's limit applies).
#: ``service_class``: the request's service class (``X-Apsd-Class`` takes precedence).
_OPTIONAL_INFER_FIELDS = ("timeout_s", "service_class")
#: The fields of a 200 answer, in order (cheaper than attrs.asdict on every answer: no recursion).
_COMPLETION_FIELDS = tuple(field.name for field in attrs.fields(Completion)
                           if field.name not in ("response", "response_bytes"))
#: A day, the largest ``[queue] timeout_s``: larger client values are cut to it before any arithmetic.
MAX_TIMEOUT_S = 86_400.0


@attrs.frozen
class InferBody:
    """A valid ``POST /infer`` body."""

    prompt: str
    tokens_requested: int
    #: 1-10 as sent (served at most at the tenant's ``max_bid``: :func:`~apsd.core.config.clamp_bid`).
    priority_bid: int
    #: None: the key names the tenant.
    tenant_id: str | None = None
    #: Model seconds it may wait queued, at most :data:`MAX_TIMEOUT_S`; None: ``[queue] timeout_s``.
    timeout_s: float | None = None
    #: The service class the body names (None: none; checked by admission).
    service_class: str | None = None


def parse_infer_body(raw: bytes, *, tenant_required: bool = True) -> InferBody:
    """Validate a ``POST /infer`` body; BodyError names the field and the rule.

    ``tenant_required=False`` (API keys on: the key names the tenant) makes ``tenant_id`` optional.
    """
    data = parse_json_object(raw)
    unknown = sorted(set(data) - set(_INFER_FIELDS) - set(_OPTIONAL_INFER_FIELDS))
    if unknown:
        raise BodyError(422, "unknown_field", f"unknown field {unknown[0]!r} (fields: "
                        f"{', '.join([*_INFER_FIELDS, *_OPTIONAL_INFER_FIELDS])})", field=unknown[0])
    for name, kind in _INFER_FIELDS.items():
        if name == "tenant_id" and name not in data and not tenant_required:
            continue
        if name not in data:
            raise BodyError(422, "missing_field", f"{name} is required", field=name)
        value = data[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            expected = "an integer" if kind is int else "a string"
            raise BodyError(422, "invalid_field", f"{name} must be {expected}, got {json.dumps(value)[:40]}",
                            field=name)
    if "tenant_id" in data and (not data["tenant_id"].strip() or len(data["tenant_id"]) > MAX_TENANT_ID_CHARS):
        raise BodyError(422, "invalid_field", f"tenant_id must be 1-{MAX_TENANT_ID_CHARS} characters",
                        field="tenant_id")
    if not 1 <= data["tokens_requested"] <= MAX_TOKENS_REQUESTED:
        raise BodyError(422, "invalid_field", f"tokens_requested must be 1-{MAX_TOKENS_REQUESTED}, "
                        f"got {shown(data['tokens_requested'])}", field="tokens_requested")
    if not 1 <= data["priority_bid"] <= 10:
        raise BodyError(422, "invalid_field", f"priority_bid must be 1-10, got {shown(data['priority_bid'])}",
                        field="priority_bid")
    if "timeout_s" in data:
        timeout = data["timeout_s"]
        # (json.loads accepts NaN and Infinity; an int is compared before it becomes a float)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0 \
                or isinstance(timeout, float) and not math.isfinite(timeout):
            raise BodyError(422, "invalid_field", "timeout_s must be a number of seconds > 0", field="timeout_s")
        data["timeout_s"] = float(min(timeout, MAX_TIMEOUT_S))
    return InferBody(**data)


@blueprint.post("/infer")
@authenticated(submits=True)
async def infer(caller: Caller) -> Response:
    """Submit one request and answer its outcome; a client that leaves cancels it.

    ``priority_bid`` above the tenant's ``max_bid`` is served at ``max_bid`` (clamped, not refused).
    """
    pipeline = http_state().pipeline
    try:
        body = parse_infer_body(await request.get_data(cache=False, as_text=False, parse_form_data=False), tenant_required=caller.anonymous)
        tenant_id = body.tenant_id if body.tenant_id is not None else caller.tenant
        assert tenant_id is not None   # (parse_infer_body requires it of an anonymous caller; a key has one)
        if not caller.anonymous and tenant_id != caller.tenant:
            raise BodyError(403, "tenant_mismatch", "tenant_id names a tenant other than the API key's "
                            "(leave it out, or name the key's own tenant)", field="tenant_id")
        note_tenant(tenant_id)
        prompt_tokens = pipeline.estimate_prompt_tokens(body.prompt)
        check_prompt_length(prompt_tokens, len(body.prompt), pipeline)
        class_name = service_class(body.service_class, request.headers)
    except BodyError as exc:
        pipeline.ledger.count_refusal(None, exc.refusal.error)
        return error_response(exc.refusal)
    tenant = pipeline.config.tenants.get(tenant_id)  # (an unknown one: admission answers 404)
    inference = pipeline.new_request(tenant_id=tenant_id, prompt=body.prompt, tokens_requested=body.tokens_requested,
                                     priority_bid=clamp_bid(tenant, body.priority_bid), prompt_tokens=prompt_tokens,
                                     timeout_s=body.timeout_s, service_class=class_name, key_id=caller.key_id)
    begin_trace(http_state(), inference, request.headers)
    refusal = pipeline.submit_nowait(inference)
    try:
        outcome = refusal or await inference.reply.wait()
    finally:  # the client went away (the handler is cancelled): a queued request leaves
        if not inference.answered:
            pipeline.cancel(inference)
        finish_trace(inference, refusal)
    if isinstance(outcome, Completion):
        headers = pipeline.admission.rate_limit_headers(outcome.tenant_id)
        return json_response({name: getattr(outcome, name) for name in _COMPLETION_FIELDS}, headers=headers)
    return error_response(outcome)
