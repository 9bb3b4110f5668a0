"""The tracing seam: what a request's life tells its trace, without knowing how traces are made.

A request that is traced carries a :class:`RequestTrace` (``request.trace``; None when tracing is off,
and then nothing below costs more than that check). The HTTP layer makes it when the request arrives
(continuing the client's ``traceparent``) and finishes it when the answer's last byte is written, or its
client left; an engine that sends the request upstream opens an :class:`AttemptTrace` for each attempt
and sends its ``traceparent`` with it, so the backend's own trace joins the request's.

The implementation (OpenTelemetry, exported over OTLP/HTTP) is :mod:`apsd.serve.tracing`; these
protocols are what the layers below the daemon see of it. Every method is synchronous, cheap and never
raises (a tracing failure must not fail a request).
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["AttemptTrace", "RequestTrace"]


class AttemptTrace(Protocol):
    """One attempt to run a request on a backend (a span of its own, a child of the request's)."""

    #: The W3C ``traceparent`` header to send with the attempt ("" when the trace is not sampled).
    traceparent: str

    def end(self, error: str | None = None) -> None:
        """The attempt ended: with the error code that ended it (``backend_timeout``, ``preempted``, ...)
        or None (the backend answered)."""


class RequestTrace(Protocol):
    """One request's trace, from its arrival to its answer's last byte."""

    def attempt(self, backend: str, url: str) -> AttemptTrace:
        """An attempt on ``backend`` (at ``url``) starts now."""

    def finish(self, request: Any, outcome: Any) -> None:
        """The answer's last byte is written (or its client left: ``outcome`` may then be None): the
        request's figures (an :class:`~apsd.core.models.InferenceRequest`; its ``Completion`` or
        ``Refusal``) become the span's attributes and the span ends. Once; later calls do nothing.
        (Typed loosely: :mod:`apsd.core.models` refers to this module.)"""
