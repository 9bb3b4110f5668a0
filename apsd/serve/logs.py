"""Structured logs: one line per event, human-readable or JSON.

Ownership: :func:`configure_logging` (called by the CLI) sets the root handler's
level and format; this module is also a built-in plugin whose observation hooks
log rejections (INFO), batches and finished requests (DEBUG). Lifecycle events
(start, ready, reload, shutdown) are logged by the daemon with the same
``event`` field. Request lines never carry prompt text unless
``--log-prompts`` asked for it.

Every line has ``event`` and the event's fields (``request_id``, ``tenant``,
``batch_id``, ...): in text as ``key=value`` after the message, in JSON as keys.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from apsd.core.hookspecs import hookimpl

__all__ = ["configure_logging", "event_fields"]

log = logging.getLogger("apsd.core.events")

_settings = {"prompts": False}

#: LogRecord attributes that are not event fields.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def event_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a record carries (passed as ``extra=``)."""
    return {k: v for k, v in vars(record).items() if k not in _STANDARD}


def _text_value(value: Any) -> str:
    """A field value for a text line: quoted (JSON-escaped) when it could be mistaken for
    something else, so a client-chosen tenant name cannot start a forged log line."""
    text = str(value)
    if isinstance(value, str) and (not text or not text.isprintable() or any(c in text for c in ' "=')):
        return json.dumps(text)
    return text


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = event_fields(record)
        line = super().format(record)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body = {"ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
                "level": record.levelname, "logger": record.name, "msg": record.getMessage(),
                **event_fields(record)}
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, default=str)


def configure_logging(level: str = "INFO", fmt: str = "text", *, prompts: bool = False) -> None:
    """Logging to stderr in ``fmt`` ("text" or "json"): apsd's loggers at ``level``, others at INFO or above.

    Other libraries never log at DEBUG: hpack's DEBUG lines hold every decoded HTTP/2 header,
    ``Authorization`` included, and API keys must never reach a log. httpx and httpcore (the
    forward engine's client) log warnings only: httpx writes a line per request at INFO, which
    on a busy gateway would be a line per forwarded request.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(logging.INFO, logging.getLevelName(level)))
    logging.getLogger("apsd").setLevel(level)
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    _settings["prompts"] = prompts


@hookimpl
def request_rejected(request: Any, refusal: Any) -> None:
    if log.isEnabledFor(logging.INFO):
        log.info("request rejected", extra={"event": "reject", "request_id": request.request_id,
                                            "tenant": request.tenant_id, "status": refusal.status,
                                            "error": refusal.error})


@hookimpl
def batch_finished(batch: Any, engine_id: int, busy_s: float, cost_usd: float) -> None:
    # DEBUG, not INFO: one line per batch is a flood on a busy daemon (and a few percent of its CPU
    # under the HTTP benchmark); the batch figures are in /metrics
    if log.isEnabledFor(logging.DEBUG):
        log.debug("batch finished", extra={"event": "batch", "batch_id": batch.batch_id, "executor": engine_id,
                                          "size": len(batch.requests), "kv_tokens": batch.kv_tokens,
                                          "busy_s": round(busy_s, 6), "cost_usd": round(cost_usd, 8)})


@hookimpl
def request_finished(request: Any, outcome: Any) -> None:
    if log.isEnabledFor(logging.DEBUG):
        fields = {"event": "request", "request_id": request.request_id, "tenant": request.tenant_id,
                  "outcome": getattr(outcome, "kind", "completed"), "batch_id": getattr(outcome, "batch_id", None),
                  "latency_ms": getattr(outcome, "latency_ms", None)}
        if _settings["prompts"]:
            fields["prompt"] = request.prompt
        log.debug("request finished", extra=fields)
