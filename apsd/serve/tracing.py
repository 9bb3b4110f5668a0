"""OpenTelemetry traces of requests (``[tracing]``), exported over OTLP/HTTP: the implementation of
:mod:`apsd.core.tracing`.

Each traced request is one span, kind SERVER, named as the GenAI semantic conventions name an
inference span (``chat <model>``, ``text_completion <model>``, ``embeddings <model>``), from the
request's arrival to its answer's last byte (or the moment its client left). It continues the
client's ``traceparent`` (W3C trace context) when there is one. Its children: ``apsd.queue``, the
request's wait from arrival to its first dispatch, and one ``apsd.attempt <backend>`` span (kind
CLIENT) per attempt upstream, whose context is sent to the backend as ``traceparent``, so a server
that traces (vLLM with ``--otlp-traces-endpoint``) hangs its own spans under apsd's.

Attributes of the request's span: the GenAI conventions' ``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.response.model``,
``gen_ai.response.id``, ``gen_ai.usage.input_tokens`` and ``gen_ai.usage.output_tokens`` (what the
tenant was charged for: the backend's own counts when it gave them), ``gen_ai.response.time_to_first_chunk``
(seconds); ``http.response.status_code``, and ``error.type`` (apsd's error code) when it was refused or
failed; and apsd's own: ``apsd.tenant``, ``apsd.key.id``, ``apsd.key.name``, ``apsd.service_class``,
``apsd.priority_bid``, ``apsd.queue_wait_s``, ``apsd.route.backend``, ``apsd.route.reason``,
``apsd.preemptions``, ``apsd.retries``, ``apsd.cached_tokens``. A 5xx answer sets the span's status
to error (a 4xx is the client's: the server span stays unset, as the HTTP conventions say).

Cost: with ``[tracing] enabled = false`` (the default) nothing here is imported and a request carries
no trace (``request.trace`` is None). Enabled, spans are batched and exported by the SDK's own thread
(``export_interval_s``); the request's path only records. The SDK is the optional extra
``apsd[tracing]``; enabling tracing without it is a configuration error that names the extra.

Ownership: the daemon makes one :class:`Tracing` at start (:meth:`Tracing.start`) and shuts it down
(flushing what is left) at exit; the HTTP handlers begin and finish each request's trace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import trio

from apsd.core.clock import calendar_time
from apsd.core.config import ConfigError, TracingConfig

if TYPE_CHECKING:
    from apsd.core.models import Completion, InferenceRequest, Refusal
    from apsd.core.tracing import AttemptTrace, RequestTrace

__all__ = ["OPERATIONS", "Tracing"]

log = logging.getLogger("apsd.serve.tracing")

#: The GenAI ``gen_ai.operation.name`` of each API (None: ``POST /infer``).
OPERATIONS = {"chat.completions": "chat", "completions": "text_completion", "embeddings": "embeddings",
              "responses": "chat", "messages": "chat", None: "text_completion"}
#: The extra that brings the SDK and the exporter.
EXTRA = "apsd[tracing]"
#: Wall seconds one export may take (at shutdown too: an unreachable endpoint delays the exit this long).
EXPORT_TIMEOUT_S = 5


class Tracing:
    """The daemon's tracer provider and its OTLP/HTTP exporter (see the module docstring)."""

    def __init__(self, settings: TracingConfig, provider: Any, tracer: Any, propagator: Any, otel: Any) -> None:
        self.settings = settings
        self._provider, self._tracer, self._propagator, self._otel = provider, tracer, propagator, otel

    @staticmethod
    def check(settings: TracingConfig) -> None:
        """Raise ConfigError when ``settings`` enable tracing and the SDK is not installed."""
        if settings.enabled:
            try:
                import opentelemetry.exporter.otlp.proto.http.trace_exporter
                import opentelemetry.sdk.trace  # noqa: F401
            except ImportError as exc:
                raise ConfigError(f"[tracing] enabled needs the OpenTelemetry SDK, which is not installed "
                                  f"({exc.name}): pip install '{EXTRA}'") from None

    @classmethod
    def start(cls, settings: TracingConfig, version: str) -> Tracing | None:
        """A running exporter for ``settings`` (None when tracing is off). Raises ConfigError when the
        OpenTelemetry SDK is not installed."""
        if not settings.enabled:
            return None
        try:
            from opentelemetry import trace
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ConfigError(f"[tracing] enabled needs the OpenTelemetry SDK, which is not installed ({exc.name}): "
                              f"pip install '{EXTRA}'") from None
        resource = Resource.create({"service.name": settings.service_name, "service.version": version})
        provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
                                  shutdown_on_exit=False)
        exporter = OTLPSpanExporter(endpoint=settings.endpoint or None)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=settings.export_interval_s * 1000,
                                                       export_timeout_millis=EXPORT_TIMEOUT_S * 1000))
        where = settings.endpoint or "the OTEL_EXPORTER_OTLP_* endpoint"
        log.info("tracing requests to %s (OTLP/HTTP, a share of %g sampled)", where, settings.sample_ratio)
        return cls(settings, provider, provider.get_tracer("apsd", version), TraceContextTextMapPropagator(), trace)

    def begin(self, request: InferenceRequest, traceparent: str | None, tracestate: str | None = None, *,
              key_name: str = "", time_scale: float = 1.0) -> RequestTrace:
        """The trace of ``request``, which arrived now, continuing the client's ``traceparent``;
        ``key_name``: its issued key's name; ``time_scale``: wall seconds per model second (its times are
        model times: ``gpu.time_scale``)."""
        carrier = {"traceparent": traceparent} if traceparent else {}
        if traceparent and tracestate:
            carrier["tracestate"] = tracestate
        parent = self._propagator.extract(carrier) if carrier else None
        operation = OPERATIONS.get(request.api, "text_completion")
        model = request.model or "apsd"
        attributes: dict[str, Any] = {"gen_ai.operation.name": operation, "gen_ai.request.model": model,
                                      "apsd.tenant": request.tenant_id, "apsd.request_id": request.request_id,
                                      "apsd.priority_bid": request.priority_bid}
        if not request.open_ended:
            attributes["gen_ai.request.max_tokens"] = request.tokens_requested
        start_ns = int(calendar_time() * 1e9)
        span = self._tracer.start_span(f"{operation} {model}", context=parent, kind=self._otel.SpanKind.SERVER,
                                       attributes=attributes, start_time=start_ns)
        if key_name:
            span.set_attribute("apsd.key.name", key_name)
        return _RequestSpan(self, span, start_ns, trio.current_time(), time_scale)

    def shutdown(self) -> None:
        """Export what is left and stop (blocking: run it in a thread)."""
        try:
            self._provider.shutdown()
        except Exception:   # (an exporter that cannot reach its endpoint must not fail the daemon's exit)
            log.warning("tracing: exporting the last spans failed", exc_info=True)


class _AttemptSpan:
    """An attempt upstream: a CLIENT span under the request's (:class:`~apsd.core.tracing.AttemptTrace`)."""

    def __init__(self, span: Any, traceparent: str, now_ns: Callable[[], int]) -> None:
        self._span, self.traceparent, self._now_ns = span, traceparent, now_ns

    def end(self, error: str | None = None) -> None:
        if error is not None:
            self._span.set_attribute("error.type", error)
        # (on the request span's clock: the SDK's own, the calendar read anew, can be microseconds behind it)
        self._span.end(end_time=self._now_ns())


class _RequestSpan:
    """One request's span (:class:`~apsd.core.tracing.RequestTrace`)."""

    def __init__(self, tracing: Tracing, span: Any, start_ns: int, start_trio: float, time_scale: float) -> None:
        self._tracing, self._span = tracing, span
        self._start_ns, self._start_trio, self._scale = start_ns, start_trio, time_scale
        self._first_attempt_ns: int | None = None
        self._finished = False

    def _now_ns(self) -> int:
        """Wall time now (Unix nanoseconds), as its span's start plus the trio clock's seconds since: never
        goes back, whatever the calendar does meanwhile."""
        return self._start_ns + int((trio.current_time() - self._start_trio) * 1e9)

    def attempt(self, backend: str, url: str) -> AttemptTrace:
        tracing, otel = self._tracing, self._tracing._otel
        now = self._now_ns()
        if self._first_attempt_ns is None:
            self._first_attempt_ns = now
        context = otel.set_span_in_context(self._span)
        span = tracing._tracer.start_span(f"apsd.attempt {backend}", context=context, kind=otel.SpanKind.CLIENT,
                                          start_time=now, attributes={"apsd.backend": backend, "url.full": url})
        carrier: dict[str, str] = {}
        tracing._propagator.inject(carrier, context=otel.set_span_in_context(span))
        return _AttemptSpan(span, carrier.get("traceparent", ""), self._now_ns)

    def finish(self, request: InferenceRequest, outcome: Completion | Refusal | None) -> None:
        if self._finished:
            return
        self._finished = True
        try:
            self._finish(request, outcome)
        except Exception:   # (a trace must never fail its request)
            log.warning("tracing: request %s's span could not be finished", request.request_id, exc_info=True)

    def _finish(self, request: InferenceRequest, outcome: Completion | Refusal | None) -> None:
        from apsd.core.models import Completion, Refusal

        tracing, otel, span = self._tracing, self._tracing._otel, self._span
        end = self._now_ns()
        scale = self._scale
        dispatched = self._first_attempt_ns
        if dispatched is None and request.dispatched_at is not None:
            dispatched = self._start_ns + int(max(0.0, request.dispatched_at - request.arrival) * scale * 1e9)
        if dispatched is not None:
            queue = tracing._tracer.start_span("apsd.queue", context=otel.set_span_in_context(span),
                                               start_time=self._start_ns, attributes={"apsd.tenant": request.tenant_id})
            queue.end(end_time=max(self._start_ns, dispatched))
            span.set_attribute("apsd.queue_wait_s", max(0, dispatched - self._start_ns) / 1e9)
        attributes: dict[str, Any] = {"apsd.preemptions": request.preemptions, "apsd.retries": request.retries,
                                      "gen_ai.response.id": request.request_id}
        if request.key_id is not None:
            attributes["apsd.key.id"] = request.key_id
        if request.service_class is not None:
            attributes["apsd.service_class"] = request.service_class
        if request.route:
            backend, _, reason = request.route.partition("; reason=")
            attributes["apsd.route.backend"], attributes["apsd.route.reason"] = backend, reason
        if request.cached_tokens:
            attributes["apsd.cached_tokens"] = request.cached_tokens
        if request.started_at is not None:
            attributes["gen_ai.response.time_to_first_chunk"] = max(0.0, request.started_at - request.arrival) * scale
        if isinstance(outcome, Completion):
            attributes["http.response.status_code"] = 200
            attributes["gen_ai.usage.input_tokens"] = outcome.prompt_tokens
            attributes["gen_ai.usage.output_tokens"] = outcome.tokens_generated
            model = outcome.response.get("model") if isinstance(outcome.response, dict) else None
            attributes["gen_ai.response.model"] = model if isinstance(model, str) else request.model or "apsd"
        elif isinstance(outcome, Refusal):
            attributes["http.response.status_code"] = outcome.status
            attributes["error.type"] = outcome.error
            if request.prompt_used or request.tokens_generated:
                attributes["gen_ai.usage.input_tokens"] = request.prompt_tokens if request.prompt_used else 0
                attributes["gen_ai.usage.output_tokens"] = request.tokens_generated
            if outcome.status >= 500:
                span.set_status(otel.Status(otel.StatusCode.ERROR, outcome.error))
        else:
            attributes["error.type"] = "client_disconnected"
        span.set_attributes(attributes)
        span.end(end_time=end)

