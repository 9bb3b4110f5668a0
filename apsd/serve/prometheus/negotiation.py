"""Which view of ``GET /metrics`` a client asked for: Prometheus text or JSON."""

from __future__ import annotations

from typing import Literal

from werkzeug.datastructures import MIMEAccept
from werkzeug.http import parse_accept_header

#: Media types a Prometheus scraper asks for.
PROMETHEUS_TYPES = frozenset({"text/plain", "application/openmetrics-text"})


def negotiate(format_param: str | None, accept: str | None) -> Literal["json", "prometheus"] | None:
    """Which view of ``GET /metrics`` a client gets (None: ``format`` names neither).

    ``?format=json`` or ``?format=prometheus`` decides. Otherwise JSON only when the
    Accept header names ``application/json`` with a higher quality than every
    Prometheus type it names (``text/plain``, ``application/openmetrics-text``);
    Prometheus text in every other case: no Accept header, a scraper's header,
    wildcards only (curl's ``*/*``), a browser's, or a tie.
    """
    if format_param is not None:
        return "json" if format_param == "json" else "prometheus" if format_param == "prometheus" else None
    quality = {"application/json": 0.0}
    for value, q in parse_accept_header(accept or "", MIMEAccept):
        media_type = value.split(";", 1)[0].strip().lower()
        if media_type == "application/json" or media_type in PROMETHEUS_TYPES:
            quality[media_type] = max(quality.get(media_type, 0.0), q)
    json_q = quality.pop("application/json")
    return "json" if json_q > 0 and json_q > max(quality.values(), default=0.0) else "prometheus"
