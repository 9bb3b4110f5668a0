"""HTTP API (Hypercorn; Quart-Trio for the control API): turns requests into pipeline submissions and
outcomes into answers.

The ``/v1`` API, where a pool's traffic goes, is served below the web framework, straight from ASGI
(:mod:`apsd.serve.http.dataplane`, with :mod:`apsd.serve.http.exchange`: a request and its answer);
everything else by a Quart-Trio app, one blueprint per concern. :func:`create_asgi` joins the two in the
one ASGI app the daemon serves. The protocols:

* :mod:`apsd.serve.http.infer`: apsd's own ``POST /infer``;
* :mod:`apsd.serve.http.openai`: the OpenAI-compatible ``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/embeddings``, ``/v1/responses`` and ``/v1/models``;
* :mod:`apsd.serve.http.anthropic`: Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``;
* :mod:`apsd.serve.http.ops`: ``/health``, ``/ready``, ``/metrics``, ``/metrics.json``, ``/tenants/<id>/status``;
* :mod:`apsd.serve.http.admin`: the operator's ``/admin`` (tenants, keys, audit, usage);
* :mod:`apsd.serve.http.ui`: the status page, ``/ui``, and the ``/admin/status`` it reads.

The ``/v1`` handlers take an :class:`~apsd.serve.http.exchange.Exchange` and return an
:class:`~apsd.serve.http.exchange.Answer`; the blueprints use Quart's request and responses. What they
share (the app's state, the :func:`~apsd.serve.http.common.authenticated` decorator, body
parsing, answers) is in :mod:`apsd.serve.http.common`.

Ownership: the app owns no tasks and no state of its own beyond :class:`~apsd.serve.http.common.HttpState`;
it reads and submits through the :class:`~apsd.pipeline.Pipeline` it is given. Hypercorn, run
by the daemon's nursery, serves it. Nothing a client sends produces a 500 or a traceback; an
error is answered in the shape of the protocol its path belongs to (Anthropic's under ``/v1/messages``,
OpenAI's elsewhere under ``/v1/``, apsd's ``{"error", "message"[, "field"]}`` elsewhere). Every answer to a
tenant's request carries the tenant's ``RateLimit`` and ``RateLimit-Policy`` fields.

Access (:mod:`apsd.serve.auth`): with API keys configured, ``POST /infer`` and the ``/v1`` completions
(and ``/v1/messages``) need a tenant's key and run as that tenant (``Authorization: Bearer <key>``, or
``x-api-key: <key>`` as Anthropic's clients send it); ``/v1/models`` needs a tenant's key or the admin key;
``/tenants/<id>/status`` needs that tenant's key or the admin key; ``/metrics`` and
``/metrics.json`` need the admin key or a metrics key; ``/health`` and ``/ready`` are open, and so are
the status page's files (``/ui``: no data in them; the data, ``/admin/status``, needs the admin key).
A metrics key (``[auth] metrics_key_hashes``) reads those two and nothing else: anywhere else
that asks for a key it is refused 403 ``metrics_only`` before the handler runs (one rule, so a
new endpoint cannot forget it). The key is checked before the body is parsed. Without keys
(loopback only) everything is open, and ``X-Apsd-Tenant`` names a ``/v1`` request's tenant; but a
browser may not act for a page of another origin (:func:`apsd.serve.auth.cross_site_refusal`), and
``/admin`` bodies must say they are JSON (415 ``unsupported_media_type``), so that no cross-site form
can send one without a CORS preflight (with keys, the ``Authorization`` header forces one).
"""

from __future__ import annotations

import logging

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from apsd.core.models import Refusal
from apsd.pipeline import Pipeline
from apsd.serve.auth import API_KEY_HEADER, cross_site_refusal
from apsd.serve.http import admin, infer, ops, ui
from apsd.serve.http.common import HttpState, ShieldResponseEnd, error_response, noted_tenant, read_unread_body
from apsd.serve.http.dataplane import DataPlane
from apsd.serve.http.infer import parse_infer_body
from apsd.serve.http.openai import unix_time
from apsd.serve.http.ops import metrics_document
from apsd.serve.prometheus import exporter_for
from apsd.serve.tracing import Tracing
from apsd.state.keeper import StateKeeper

__all__ = ["create_app", "create_asgi", "metrics_document", "parse_infer_body"]

log = logging.getLogger("apsd.serve.http")


def create_app(pipeline: Pipeline, *, keeper: StateKeeper | None = None, tracing: Tracing | None = None) -> QuartTrio:
    """The control API over ``pipeline`` (and ``/admin`` over the daemon's ``keeper``; requests traced by
    ``tracing``): every path but ``/v1/*``, which :func:`create_asgi` adds. The app is cheap, make one per
    pipeline."""
    app = QuartTrio("apsd")
    app.config["MAX_CONTENT_LENGTH"] = pipeline.config.server.max_body_bytes
    app.config["BODY_TIMEOUT"] = pipeline.config.server.body_timeout_s  # then 408 request_timeout
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.url_map.merge_slashes = False  # an empty path segment ("a//b") is a 404, not an HTML 308 redirect
    # the exporter is made before serving: its histograms see every dispatch
    app.extensions["apsd"] = HttpState(pipeline=pipeline, exporter=exporter_for(pipeline), created=unix_time(),
                                       keeper=keeper, tracing=tracing)
    for blueprint in (infer.blueprint, ops.blueprint, admin.blueprint, ui.blueprint):
        app.register_blueprint(blueprint)

    @app.before_request
    async def refuse_cross_site() -> Response | None:
        """Without API keys: no request from another site's page, nor to a host name that is not this
        daemon's (:func:`apsd.serve.auth.cross_site_refusal`), before any handler runs."""
        state: HttpState = app.extensions["apsd"]
        if state.keyring.get(pipeline.config).enabled:
            return None
        refusal = cross_site_refusal(request.method, request.headers, pipeline.config.server.host)
        if refusal is None:
            return None
        pipeline.ledger.count_refusal(None, refusal.error)
        return error_response(refusal)

    @app.before_request
    async def confine_metrics_keys() -> Response | None:
        """A metrics key goes no further than ``/metrics``, ``/metrics.json`` and the open endpoints
        (``/health``, ``/ready``, the status page's files):
        anywhere else (a submission, a tenant's status, ``/v1/models``, an unknown path) it is
        refused 403 ``metrics_only``, counted like every refusal, before any handler runs."""
        if request.endpoint in ops.METRICS_ENDPOINTS or request.endpoint in ops.OPEN_ENDPOINTS:
            return None
        state: HttpState = app.extensions["apsd"]
        if not state.keyring.get(pipeline.config).is_metrics_key(request.headers.getlist("Authorization"),
                                                                  request.headers.getlist(API_KEY_HEADER)):
            return None
        pipeline.ledger.count_refusal(None, "metrics_only")
        return error_response(Refusal(403, "metrics_only", "a metrics key may only read /metrics and /metrics.json"))

    @app.after_request
    async def rate_limit_fields(response: Response) -> Response:
        """Every answer to a tenant's request (once its handler knows the tenant: ``note_tenant``) carries
        the tenant's ``RateLimit`` and ``RateLimit-Policy`` fields as of now, so that a client can pace
        itself by any answer: a 200, a stream, a 429, a 413 (:meth:`apsd.core.admission.Admission.rate_limit_headers`)."""
        tenant_id = noted_tenant()
        if tenant_id is not None and "RateLimit" not in response.headers:
            response.headers.update(pipeline.admission.rate_limit_headers(tenant_id))
        return response

    @app.after_request
    async def close_when_unread_or_draining(response: Response) -> Response:
        """``Connection: close`` when a body the answer did not need cannot be read (a 413) or apsd
        is draining: a client then opens a new connection instead of waiting on one hypercorn will
        not read again (or will drop at the end of the drain)."""
        if response.headers.get("Connection") == "close":  # (a 408: nothing more to read)
            return response
        if not pipeline.accepting or not await read_unread_body():
            response.headers["Connection"] = "close"
        return response

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        code = exc.code or 500
        names = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "body_too_large"}
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


def create_asgi(app: QuartTrio) -> ShieldResponseEnd:
    """The one ASGI app the daemon serves: the ``/v1`` data plane (:class:`~apsd.serve.http.dataplane.DataPlane`)
    in front of ``app`` (:func:`create_app`), sharing its state, each answer's last message shielded
    (:class:`~apsd.serve.http.common.ShieldResponseEnd`, which also hands the server its send timeout)."""
    state: HttpState = app.extensions["apsd"]
    return ShieldResponseEnd(DataPlane(state, app), send_timeout_s=state.pipeline.config.server.send_timeout_s)
