"""HTTP API (Quart-Trio): turns requests into pipeline submissions and outcomes into answers.

Ownership: the app owns no tasks and no state of its own; it reads and submits
through the :class:`~apsd.pipeline.Pipeline` it is given. Hypercorn, run by the
daemon's nursery, serves it.

Every error answer is JSON ``{"error": code, "message": text[, "field": name]}``;
nothing a client sends produces a 500 or a traceback.

Access (:mod:`apsd.auth`): with API keys configured, ``POST /infer`` needs a
tenant's key and runs as that tenant; ``/tenants/<id>/status`` needs that
tenant's key or the admin key; ``/metrics`` needs the admin key; ``/health`` is
open (liveness probes carry no credentials; it names no tenant). The key is
checked before the body is parsed. Without keys (loopback only) everything is open.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from . import strictjson
from .auth import Caller, KeyRing
from .config import Config
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
#: The fields of a 200 answer, in order (cheaper than attrs.asdict on every answer: no recursion).
_COMPLETION_FIELDS = tuple(field.name for field in attrs.fields(Completion) if field.name != "response")
#: A day, the largest ``[queue] timeout_s``: larger client values are cut to it before any arithmetic.
MAX_TIMEOUT_S = 86_400.0


class BodyError(Exception):
    def __init__(self, status: int, error: str, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.refusal = Refusal(status, error, message, field=field)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; BodyError 400 unless it is exactly one.

    A key repeated in any object of the document is refused (``duplicate_key``, naming it):
    parsers disagree on which value wins, so a proxy and apsd could read different requests.
    """
    try:
        data = strictjson.loads(raw)
    except strictjson.DuplicateKeyError as exc:
        key = exc.key if len(exc.key) <= 64 else exc.key[:64] + "..."
        raise BodyError(400, "duplicate_key", f"the request body repeats the key {key!r}; "
                        "each key may appear once per object", field=exc.key[:256]) from None
    except (ValueError, RecursionError):
        raise BodyError(400, "invalid_json", "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BodyError(400, "invalid_json", "the request body must be a JSON object")
    return data


def parse_infer_body(raw: bytes, *, tenant_required: bool = True) -> dict[str, Any]:
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
                        f"got {_shown(data['tokens_requested'])}", field="tokens_requested")
    if not 1 <= data["priority_bid"] <= 10:
        raise BodyError(422, "invalid_field", f"priority_bid must be 1-10, got {_shown(data['priority_bid'])}",
                        field="priority_bid")
    if "timeout_s" in data:
        timeout = data["timeout_s"]
        # (json.loads accepts NaN and Infinity; an int is compared before it becomes a float)
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0 \
                or isinstance(timeout, float) and not math.isfinite(timeout):
            raise BodyError(422, "invalid_field", "timeout_s must be a number of seconds > 0", field="timeout_s")
        data["timeout_s"] = float(min(timeout, MAX_TIMEOUT_S))
    return data


def _shown(number: int) -> str:
    """A client's integer for a message: never formatted in full beyond 18 digits (a 5000-digit
    int cannot even be printed)."""
    return str(number) if -10**18 < number < 10**18 else "an integer of more than 18 digits"


def check_prompt_length(prompt: str, pipeline: Pipeline) -> None:
    """413 ``prompt_too_long`` beyond ``[admission] max_prompt_tokens`` (estimated tokens)."""
    limit = pipeline.config.admission.max_prompt_tokens
    tokens = pipeline.estimate_prompt_tokens(prompt)
    if tokens > limit:
        raise BodyError(413, "prompt_too_long",
                        f"the prompt is about {tokens} tokens ({len(prompt)} characters at "
                        f"{pipeline.config.admission.chars_per_token:g} per token); the limit is {limit} "
                        "(admission.max_prompt_tokens)", field="prompt")


#: Wall seconds an answer waits for the rest of a body it did not need (see :func:`_read_unread_body`).
UNREAD_BODY_WAIT_S = 1.0


async def _read_unread_body() -> bool:
    """Read and drop the rest of a body the answer did not need (a 401, a routing 404/405); False
    when it cannot be (over ``max_body_bytes``, or not all there within UNREAD_BODY_WAIT_S).

    An answer sent before its request's body has arrived leaves hypercorn 0.18 with a keep-alive
    connection it never reads again; reading the body first avoids that. When it cannot be read the
    answer says ``Connection: close`` instead. A request without a body has nothing unread.
    """
    announced = request.content_length or "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    if not announced or request.body._complete.is_set():  # (quart's Body has no public flag)
        return True
    with trio.move_on_after(UNREAD_BODY_WAIT_S):
        try:
            await request.body
        except HTTPException:  # RequestEntityTooLarge: the 413 case
            return False
        return True
    return False


class _KeyRingCache:
    """The KeyRing of the pipeline's current config (a reload replaces the config, and so the keys)."""

    def __init__(self) -> None:
        self._config: Config | None = None
        self._keyring = KeyRing()

    def get(self, config: Config) -> KeyRing:
        if config is not self._config:
            self._keyring, self._config = KeyRing.from_config(config), config
        return self._keyring


def rounded(value: Any, key: str = "") -> Any:
    """``value`` with every float rounded for an answer: milliseconds (keys ending ``_ms``) to the
    microsecond, US dollars (``_usd``) to the nano-dollar, anything else to 6 significant digits.

    Binary floats print as ``0.00042480468749999994``; no client needs those digits, and the
    figures are model estimates anyway. Non-finite floats become null (JSON has no NaN).
    """
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        if key.endswith("_ms"):
            return round(value, 3)
        if key.endswith("_usd"):
            return round(value, 9)
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: rounded(v, k if isinstance(k, str) else key) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, key) for v in value]
    return value


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON answer, floats :func:`rounded`."""
    return Response(json.dumps(rounded(data)), status=status, headers=headers or {},
                    content_type="application/json")


def metrics_document(pipeline: Pipeline) -> dict[str, Any]:
    """The JSON view of ``/metrics``: the books' figures, then the configuration and state."""
    statistics = pipeline.statistics()
    document = attrs.asdict(statistics.books)
    document.update(attrs.asdict(statistics, filter=lambda field, _: field.name != "books"))
    return document


def error_response(refusal: Refusal) -> Response:
    body: dict[str, Any] = {"error": refusal.error, "message": refusal.message}
    if refusal.field is not None:
        body["field"] = refusal.field
    return Response(json.dumps(body), status=refusal.status, headers=refusal.headers,
                    content_type="application/json")


class ShieldResponseEnd:
    """ASGI middleware: the last message of a response is sent shielded from cancellation.

    Sending it makes hypercorn (0.18) close the request's stream and then, in the same call,
    either close the connection (its client still owes body, or asked to close) or restart the
    keep-alive timer. Meanwhile that stream's ``http.disconnect`` reaches quart-trio, which
    cancels the request's task group, the very task still inside that call: the close or the
    timer restart is cut off at its first checkpoint, and the connection stays open, idle and
    untimed, until the client leaves (a slow-body client got its 408 and kept its socket).
    Shielding that one ``send`` lets hypercorn finish its bookkeeping.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_last_shielded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await self.app(scope, receive, send_last_shielded)


def create_app(pipeline: Pipeline) -> QuartTrio:
    """The API over ``pipeline``; the app is cheap, make one per pipeline."""
    app = QuartTrio("apsd")
    app.config["MAX_CONTENT_LENGTH"] = pipeline.config.server.max_body_bytes
    app.config["BODY_TIMEOUT"] = pipeline.config.server.body_timeout_s  # then 408 request_timeout
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.url_map.merge_slashes = False  # an empty path segment ("a//b") is a 404, not an HTML 308 redirect
    app.asgi_app = ShieldResponseEnd(app.asgi_app)  # type: ignore[method-assign]
    keyring = _KeyRingCache()

    def authenticate(*, admin: bool = False) -> Caller | Response:
        """The caller, or the 401/403 answer (counted as a refusal). ``admin``: operator-only endpoint."""
        caller = keyring.get(pipeline.config).identify_headers(request.headers.getlist("Authorization"))
        if isinstance(caller, Caller) and admin and not caller.admin:
            caller = Refusal(403, "admin_only", "this endpoint needs the admin key")
        if isinstance(caller, Refusal):
            pipeline.ledger.count_refusal(None, caller.error)
            return error_response(caller)
        return caller

    @app.after_request
    async def close_when_unread_or_draining(response: Response) -> Response:
        """``Connection: close`` when a body the answer did not need cannot be read (a 413) or apsd
        is draining: a client then opens a new connection instead of waiting on one hypercorn will
        not read again (or will drop at the end of the drain)."""
        if response.headers.get("Connection") == "close":  # (a 408: nothing more to read)
            return response
        if not pipeline.accepting or not await _read_unread_body():
            response.headers["Connection"] = "close"
        return response

    @app.post("/infer")
    async def infer() -> Response:
        caller = authenticate()
        if isinstance(caller, Response):
            return caller
        if not caller.anonymous and caller.tenant is None:
            pipeline.ledger.count_refusal(None, "admin_cannot_submit")
            return error_response(Refusal(403, "admin_cannot_submit",
                                          "the admin key cannot submit requests; use the tenant's own key"))
        try:
            body = parse_infer_body(await request.get_data(cache=False), tenant_required=caller.anonymous)
            tenant_id = body.get("tenant_id", caller.tenant)
            if not caller.anonymous and tenant_id != caller.tenant:
                raise BodyError(403, "tenant_mismatch", "tenant_id names a tenant other than the API key's "
                                "(leave it out, or name the key's own tenant)", field="tenant_id")
            check_prompt_length(body["prompt"], pipeline)
        except BodyError as exc:
            pipeline.ledger.count_refusal(None, exc.refusal.error)
            return error_response(exc.refusal)
        inference = pipeline.new_request(tenant_id=tenant_id, prompt=body["prompt"],
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
            return json_response({name: getattr(outcome, name) for name in _COMPLETION_FIELDS}, headers=headers)
        return error_response(outcome)

    @app.get("/health")
    async def health() -> Response:
        return json_response(attrs.asdict(pipeline.health()))

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
        caller = authenticate(admin=True)
        if isinstance(caller, Response):
            return caller
        view = negotiate(request.args.get("format"), request.headers.get("Accept"))
        if view is None:
            return error_response(Refusal(400, "invalid_format", "format must be json or prometheus",
                                          field="format"))
        if view == "json":
            return json_response(metrics_document(pipeline), headers={"Vary": "Accept"})
        return Response(exporter.exposition(), status=200, content_type=exporter.content_type,
                        headers={"Vary": "Accept"})

    @app.get("/metrics.json")
    async def metrics_json() -> Any:
        """The JSON view of ``/metrics``, whatever the Accept header."""
        caller = authenticate(admin=True)
        if isinstance(caller, Response):
            return caller
        return json_response(metrics_document(pipeline))

    @app.get("/tenants/<tenant_id>/status")
    async def tenant_status(tenant_id: str) -> Any:
        caller = authenticate()
        if isinstance(caller, Response):
            return caller
        if not caller.may_read_tenant(tenant_id):  # (whether that tenant exists is not revealed)
            pipeline.ledger.count_refusal(None, "forbidden")
            return error_response(Refusal(403, "forbidden", "an API key reads only its own tenant's status"))
        status = pipeline.tenant_status(tenant_id)
        if status is None:
            return error_response(Refusal(404, "unknown_tenant", f"no tenant named {tenant_id!r}"))
        return json_response(attrs.asdict(status))

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        names = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        message = exc.description or exc.name
        # keep werkzeug's own headers (a 405's Allow, RFC 9110 15.5.6), not its HTML content type
        headers = {k: v for k, v in exc.get_headers() if k.lower() != "content-type"}
        if code == 413:
            pipeline.ledger.count_refusal(None, "body_too_large")
            message = f"request body exceeds {pipeline.config.server.max_body_bytes} bytes (server.max_body_bytes)"
        elif code == 408:
            pipeline.ledger.count_refusal(None, "request_timeout")
            message = (f"the request body did not arrive within {pipeline.config.server.body_timeout_s:g} s "
                       "(server.body_timeout_s)")
            headers["Connection"] = "close"  # the rest of that body is not worth waiting for
        return error_response(Refusal(code, names.get(code, exc.name.lower().replace(" ", "_")), message,
                                      headers=headers))

    @app.errorhandler(Exception)
    async def internal_error(exc: Exception) -> Response:
        log.exception("internal error answering %s %s", request.method, request.path)
        pipeline.ledger.count_refusal(None, "internal_error")
        return error_response(Refusal(500, "internal_error", "internal error; see the daemon's log"))

    return app

