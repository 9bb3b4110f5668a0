"""HTTP API (Quart-Trio): turns requests into pipeline submissions and outcomes into answers.

Ownership: the app owns no tasks and no state of its own; it reads and submits
through the :class:`~apsd.pipeline.Pipeline` it is given. Hypercorn, run by the
daemon's nursery, serves it.

Every error answer is JSON ``{"error": code, "message": text[, "field": name]}``;
nothing a client sends produces a 500 or a traceback.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import attrs
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from .models import Completion, Refusal
from .pipeline import Pipeline
from .prometheus import exporter_for, negotiate

__all__ = ["create_app", "parse_infer_body"]

log = logging.getLogger("apsd.http")

MAX_TENANT_ID_CHARS = 256
#: Far beyond any real request; bounds client integers before any arithmetic or formatting.
MAX_TOKENS_REQUESTED = 1_000_000_000
_INFER_FIELDS = {"tenant_id": str, "prompt": str, "tokens_requested": int, "priority_bid": int}
#: Optional fields. ``timeout_s``: model seconds the request may wait queued, > 0; a value above
#: ``[queue] timeout_s`` is not refused but clamped to it (only the config's limit applies).
_OPTIONAL_INFER_FIELDS = ("timeout_s",)
#: A day, the largest ``[queue] timeout_s``: larger client values are cut to it before any arithmetic.
MAX_TIMEOUT_S = 86_400.0


class BodyError(Exception):
    def __init__(self, status: int, error: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.refusal = Refusal(status, error, message, field=field)


def parse_infer_body(raw: bytes) -> dict[str, Any]:
    """Validate a ``POST /infer`` body; BodyError names the field and the rule."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise BodyError(400, "invalid_json", "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BodyError(400, "invalid_json", "the request body must be a JSON object")
    unknown = sorted(set(data) - set(_INFER_FIELDS) - set(_OPTIONAL_INFER_FIELDS))
    if unknown:
        raise BodyError(422, "unknown_field", f"unknown field {unknown[0]!r} (fields: "
                        f"{', '.join([*_INFER_FIELDS, *_OPTIONAL_INFER_FIELDS])})", field=unknown[0])
    for name, kind in _INFER_FIELDS.items():
        if name not in data:
            raise BodyError(422, "missing_field", f"{name} is required", field=name)
        value = data[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            expected = "an integer" if kind is int else "a string"
            raise BodyError(422, "invalid_field", f"{name} must be {expected}, got {json.dumps(value)[:40]}",
                            field=name)
    if not data["tenant_id"].strip() or len(data["tenant_id"]) > MAX_TENANT_ID_CHARS:
        raise BodyError(422, "invalid_field", f"tenant_id must be 1-{MAX_TENANT_ID_CHARS} characters",
                        field="tenant_id")
    # (never format a client's integer before bounding it: a 5000-digit int cannot be printed)
    if not 1 <= data["tokens_requested"] <= MAX_TOKENS_REQUESTED:
        raise BodyError(422, "invalid_field", f"tokens_requested must be 1-{MAX_TOKENS_REQUESTED}",
                        field="tokens_requested")
    if not 1 <= data["priority_bid"] <= 10:
        raise BodyError(422, "invalid_field", "priority_bid must be 1-10", field="priority_bid")
    if "timeout_s" in data:
        timeout = data["timeout_s"]
        # (json.loads accepts NaN and Infinity; an int is compared before it becomes a float)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0 \
                or isinstance(timeout, float) and not math.isfinite(timeout):
            raise BodyError(422, "invalid_field", "timeout_s must be a number of seconds > 0", field="timeout_s")
        data["timeout_s"] = float(min(timeout, MAX_TIMEOUT_S))
    return data


def error_response(refusal: Refusal) -> Response:
    body: dict[str, Any] = {"error": refusal.error, "message": refusal.message}
    if refusal.field is not None:
        body["field"] = refusal.field
    return Response(json.dumps(body), status=refusal.status, headers=refusal.headers,
                    content_type="application/json")


def create_app(pipeline: Pipeline) -> QuartTrio:
    """The API over ``pipeline``; the app is cheap, make one per pipeline."""
    app = QuartTrio("apsd")
    app.config["MAX_CONTENT_LENGTH"] = pipeline.config.server.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]

    @app.post("/infer")
    async def infer() -> Response:
        try:
            body = parse_infer_body(await request.get_data(cache=False))
        except BodyError as exc:
            pipeline.ledger.count_refusal(None, exc.refusal.error)
            return error_response(exc.refusal)
        inference = pipeline.new_request(tenant_id=body["tenant_id"], prompt=body["prompt"],
                                         tokens_requested=body["tokens_requested"],
                                         priority_bid=body["priority_bid"], timeout_s=body.get("timeout_s"))
        refusal = pipeline.submit_nowait(inference)
        try:
            outcome = refusal or await inference.reply.wait()
        finally:  # the client went away (the handler is cancelled): a queued request leaves
            if not inference.answered:
                pipeline.cancel(inference)
        if isinstance(outcome, Completion):
            headers = pipeline.admission.rate_limit_headers(outcome.tenant_id)
            return Response(json.dumps(attrs.asdict(outcome)), status=200, headers=headers,
                            content_type="application/json")
        return error_response(outcome)

    @app.get("/health")
    async def health() -> dict:
        return pipeline.health()

    exporter = exporter_for(pipeline)  # before serving: its histograms see every dispatch

    @app.get("/metrics")
    async def metrics() -> Any:
        """Prometheus text exposition by default; JSON (as ``/metrics.json``) on request.

        ``?format=json`` or ``?format=prometheus`` decides (any other value: 400). Otherwise
        JSON only when the Accept header names ``application/json`` with a higher quality
        than every Prometheus type it names (``text/plain``, ``application/openmetrics-text``);
        Prometheus text in every other case: no Accept header, a scraper's, wildcards only
        (curl's ``*/*``), a browser's, or a tie. See :func:`apsd.prometheus.negotiate`.
        """
        view = negotiate(request.args.get("format"), request.headers.get("Accept"))
        if view is None:
            return error_response(Refusal(400, "invalid_format", "format must be json or prometheus",
                                          field="format"))
        if view == "json":
            return pipeline.metrics(), 200, {"Vary": "Accept"}
        return Response(exporter.exposition(), status=200, content_type=exporter.content_type,
                        headers={"Vary": "Accept"})

    @app.get("/metrics.json")
    async def metrics_json() -> dict:
        """The JSON view of ``/metrics``, whatever the Accept header."""
        return pipeline.metrics()

    @app.get("/tenants/<tenant_id>/status")
    async def tenant_status(tenant_id: str) -> Any:
        status = pipeline.tenant_status(tenant_id)
        if status is None:
            return error_response(Refusal(404, "unknown_tenant", f"no tenant named {tenant_id!r}"))
        return status

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        names = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        message = exc.description or exc.name
        if code == 413:
            pipeline.ledger.count_refusal(None, "body_too_large")
            message = f"request body exceeds {pipeline.config.server.max_body_bytes} bytes (server.max_body_bytes)"
        # keep werkzeug's own headers (a 405's Allow, RFC 9110 15.5.6), not its HTML content type
        headers = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}
        return error_response(Refusal(code, names.get(code, exc.name.lower().replace(" ", "_")), message,
                                      headers=headers))

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        log.exception("internal error answering %s %s", request.method, request.path)
        pipeline.ledger.count_refusal(None, "internal_error")
        return error_response(Refusal(500, "internal_error", "internal error; see the daemon's log"))

    return app

