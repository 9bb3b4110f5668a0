"""The operator's endpoints: ``/health``, ``/ready``, ``/metrics``, ``/metrics.json``, ``/tenants/<id>/status``.

``/health`` is liveness (200 while the process serves, draining included); ``/ready`` is
readiness (200 while a new request would be served; 503 while draining or while the forward
engine has no usable backend: :mod:`apsd.serve.readiness` decides).

Access: ``/health`` and ``/ready`` are open (probes carry no credentials; they name no tenant);
``/metrics`` and ``/metrics.json`` need the admin key or a metrics key (``[auth]
metrics_key_hashes``: a scraper's, which reads these two and nothing else; :data:`METRICS_ENDPOINTS`
is what :func:`apsd.serve.http.create_app` keeps it to); a tenant's status needs that tenant's key or
the admin key. Without keys (loopback only) everything is open.
"""

from __future__ import annotations

from typing import Any

import attrs
from quart import Blueprint, Response, request

from apsd.core.models import Refusal
from apsd.pipeline import Pipeline
from apsd.serve.auth import Caller
from apsd.serve.http.common import authenticated, error_response, http_state, json_response
from apsd.serve.prometheus import negotiate
from apsd.serve.readiness import readiness

__all__ = ["METRICS_ENDPOINTS", "OPEN_ENDPOINTS", "blueprint", "metrics_document"]

blueprint = Blueprint("ops", __name__)

#: The endpoints a metrics key may read (Quart endpoint names); it is refused everywhere else.
METRICS_ENDPOINTS = frozenset({"ops.metrics", "ops.metrics_json"})
#: The endpoints that ask for no key: open to anyone, whatever key a request carries (the status
#: page's files hold no data: :mod:`apsd.serve.http.ui`).
OPEN_ENDPOINTS = frozenset({"ops.health", "ops.ready", "ui.page", "ui.asset"})


def metrics_document(pipeline: Pipeline) -> dict[str, Any]:
    """The JSON view of ``/metrics``: the books' figures, then the configuration and state."""
    statistics = pipeline.statistics()
    document = attrs.asdict(statistics.books)
    document.update(attrs.asdict(statistics, filter=lambda field, _: field.name != "books"))
    routes: dict[str, dict[str, int]] = {}  # (JSON keys are strings: where -> reason -> requests)
    for (where, reason), count in sorted(statistics.routes.items()):
        routes.setdefault(where, {})[reason] = count
    document["routes"] = routes
    return document


@blueprint.get("/health")
async def health() -> Response:
    return json_response(attrs.asdict(http_state().pipeline.health()))


@blueprint.get("/ready")
async def ready() -> Response:
    """200 ``{"status": "ready", ...}``, or 503 with ``status`` ``draining`` or ``no_backend``
    (see :mod:`apsd.serve.readiness`); ``Cache-Control: no-store``: a probe must see it change."""
    answer = readiness(http_state().pipeline)
    return json_response(attrs.asdict(answer), status=200 if answer.ready else 503,
                         headers={"Cache-Control": "no-store"})


def _metrics_refusal(caller: Caller) -> Response | None:
    """403 ``admin_only`` for a caller that may not read the metrics (a tenant's key), else None."""
    if caller.may_read_metrics():
        return None
    http_state().pipeline.ledger.count_refusal(None, "admin_only")
    return error_response(Refusal(403, "admin_only", "this endpoint needs the admin key or a metrics key"))


@blueprint.get("/metrics")
@authenticated()
async def metrics(caller: Caller) -> Any:
    """Prometheus text exposition by default; JSON (as ``/metrics.json``) on request.

    ``?format=json`` or ``?format=prometheus`` decides (any other value: 400). Otherwise
    JSON only when the Accept header names ``application/json`` with a higher quality
    than every Prometheus type it names (``text/plain``, ``application/openmetrics-text``);
    Prometheus text in every other case: no Accept header, a scraper's, wildcards only
    (curl's ``*/*``), a browser's, or a tie. See :func:`apsd.serve.prometheus.negotiate`.
    """
    if (refused := _metrics_refusal(caller)) is not None:
        return refused
    state = http_state()
    view = negotiate(request.args.get("format"), request.headers.get("Accept"))
    if view is None:
        return error_response(Refusal(400, "invalid_format", "format must be json or prometheus", field="format"))
    if view == "json":
        return json_response(metrics_document(state.pipeline), headers={"Vary": "Accept"})
    return Response(await state.exporter.scrape(), status=200, content_type=state.exporter.content_type,
                    headers={"Vary": "Accept"})


@blueprint.get("/metrics.json")
@authenticated()
async def metrics_json(caller: Caller) -> Any:
    """The JSON view of ``/metrics``, whatever the Accept header."""
    if (refused := _metrics_refusal(caller)) is not None:
        return refused
    return json_response(metrics_document(http_state().pipeline))


@blueprint.get("/tenants/<tenant_id>/status")
@authenticated()
async def tenant_status(tenant_id: str, caller: Caller) -> Any:
    pipeline = http_state().pipeline
    if not caller.may_read_tenant(tenant_id):  # (whether that tenant exists is not revealed)
        pipeline.ledger.count_refusal(None, "forbidden")
        return error_response(Refusal(403, "forbidden", "an API key reads only its own tenant's status"))
    status = pipeline.tenant_status(tenant_id)
    if status is None:
        return error_response(Refusal(404, "unknown_tenant", f"no tenant named {tenant_id!r}"))
    return json_response(attrs.asdict(status))
