"""Every error code apsd answers with, in one place: its HTTP status, when it is answered, and the
headers that come with it.

A refusal (:class:`~apsd.core.models.Refusal`) carries one of these codes as ``error``: ``/infer`` and
``/admin`` answer it as ``{"error": code, "message": ..., "field": ...}``, the OpenAI API as the
``code`` of its error object and the Anthropic API in its message (their ``type``, by status, is the
API's own). A code is stable: clients branch on it, so one is never renamed.

The catalogue generates the error table of ``docs/reference/errors.md`` (``python -m apsd.reference``),
and ``tests/unit/test_errors.py`` checks both ways that it is complete: every code the package answers
with is here, and every code here is answered somewhere. A new code is added here first.

Ownership: a constant table, read by the reference generator and the tests; nothing at run time
depends on it.
"""

from __future__ import annotations

import attrs

__all__ = ["CATALOGUE", "ErrorCode", "by_code"]


@attrs.frozen
class ErrorCode:
    code: str
    #: The statuses it is answered with (one, but for codes whose status says which case).
    statuses: tuple[int, ...]
    #: When it is answered (Markdown).
    when: str
    #: The headers that come with it (Markdown; "" none beyond the usual).
    headers: str = ""
    #: Which part of the API answers it: "requests" (``/infer``, ``/v1``), "admin", "backend" (the forward
    #: engine, for a request already admitted), or "internal" (an outcome counted, never sent).
    part: str = "requests"


_RETRY_1 = "`Retry-After: 1`"

#: In the order the reference lists them: who is calling, the body, admission, capacity, the engine.
CATALOGUE: tuple[ErrorCode, ...] = (
    # -- who is calling --------------------------------------------------------------------------
    ErrorCode("missing_api_key", (401,), "API keys are configured and the request has no key", "`WWW-Authenticate`"),
    ErrorCode("invalid_authorization", (401,), "the `Authorization` header is not one `Bearer <key>`",
              "`WWW-Authenticate`"),
    ErrorCode("invalid_api_key", (401,), "the key is unknown, revoked or expired", "`WWW-Authenticate`"),
    ErrorCode("tenant_mismatch", (403,), "the body's `tenant_id` (or `X-Apsd-Tenant`) is not the key's tenant"),
    ErrorCode("admin_cannot_submit", (403,), "the admin key was used to submit a request"),
    ErrorCode("metrics_only", (403,), "a metrics key was used for anything but the metrics"),
    ErrorCode("admin_only", (403,), "an endpoint that needs the admin key was called with another key"),
    ErrorCode("forbidden", (403,), "a tenant's key asked for another tenant's status"),
    ErrorCode("host_not_allowed", (403,), "no keys are configured and the request names another host than the "
              "daemon's (DNS rebinding)"),
    ErrorCode("cross_site_request", (403,), "a browser sent a request that changes something from another origin"),
    ErrorCode("missing_tenant", (400,), "`/v1` without keys and without `X-Apsd-Tenant`"),
    ErrorCode("invalid_header", (400,), "a bad `X-Apsd-Tenant`, `X-Apsd-Priority`, `X-Apsd-Class` or "
              "`X-Request-Id` (`field` names it)"),
    # -- the body --------------------------------------------------------------------------------
    ErrorCode("invalid_json", (400,), "the body is not valid JSON, or not a JSON object"),
    ErrorCode("too_deep", (400,), "arrays and objects nested more than 100 deep"),
    ErrorCode("duplicate_key", (400,), "a key appears twice in one JSON object (`field` names it): parsers "
              "disagree on which value wins, so a proxy and apsd could read different requests"),
    ErrorCode("invalid_format", (400,), "`GET /metrics?format=` names neither `json` nor `prometheus`"),
    ErrorCode("request_timeout", (408,), "the body did not arrive in full within `server.body_timeout_s` of its "
              "headers; the connection is closed", "`Connection: close`"),
    ErrorCode("unknown_field", (422,), "a field of `/infer` is unknown (`field` names it)"),
    ErrorCode("missing_field", (422,), "a required field is missing (`field` names it)"),
    ErrorCode("invalid_field", (422,), "a field is of the wrong type or out of range (`field` names it); on "
              "`/admin`, a value the config file would refuse"),
    ErrorCode("body_too_large", (413,), "the body is larger than `server.max_body_bytes`"),
    ErrorCode("prompt_too_long", (413,), "the prompt is estimated at more than `admission.max_prompt_tokens` "
              "tokens"),
    ErrorCode("unsupported_media_type", (415,), "an `/admin` body sent without `Content-Type: application/json` "
              "(no keys configured)"),
    ErrorCode("not_found", (404,), "no such path"),
    ErrorCode("method_not_allowed", (405,), "the path does not take that method"),
    ErrorCode("model_not_found", (404,), "`/v1`: no engine serves the `model` named"),
    ErrorCode("unsupported_api", (404,), "`/v1/embeddings`, `/v1/responses` or `/v1/messages` where no engine or "
              "backend serving the model runs that API"),
    # -- admission ---------------------------------------------------------------------------------
    ErrorCode("shutting_down", (503,), "the daemon is shutting down, or shut down before this request finished",
              "`Retry-After: 5`"),
    ErrorCode("unknown_tenant", (404,), "the tenant is not configured (on `/admin`: no such tenant)"),
    ErrorCode("tenant_disabled", (403,), "the tenant is disabled"),
    ErrorCode("model_not_allowed", (403,), "the tenant or its key may not use the `model` named"),
    ErrorCode("unknown_class", (400,), "`X-Apsd-Class` or `service_class` names no configured class"),
    ErrorCode("class_not_allowed", (403,), "the tenant may not use the class named (its `classes`)"),
    ErrorCode("deadline_unmeetable", (503,), "a class with `on_miss = \"refuse\"`: the wait ahead of the request "
              "is estimated past its `ttft_s` at admission, or its deadline came while it was queued (counted as "
              "cancelled, tokens refunded); never a truncated answer", "`Retry-After`"),
    ErrorCode("exceeds_max_request_tokens", (413,), "the request's prompt and `max_tokens` pass the tenant's "
              "`max_request_tokens`"),
    ErrorCode("exceeds_tenant_burst", (413,), "the request's prompt is more tokens than the tenant's (or its "
              "key's) `burst`, so it could never be admitted"),
    ErrorCode("exceeds_batch_capacity", (413,), "the request alone needs more KV tokens (prompt + requested) than "
              "one dispatch may hold: `[gpu] kv_cap_tokens` on the `batch` engine, or `[policy.micro] "
              "kv_cap_tokens`"),
    ErrorCode("exceeds_context_length", (413,), "the `continuous` engine: the request needs more context than the "
              "model serves"),
    ErrorCode("exceeds_kv_capacity", (413,), "the `continuous` engine: the request needs more KV tokens than the "
              "deployment's whole cache"),
    ErrorCode("exceeds_queue_capacity", (413,), "the request costs more tokens than the whole queue may hold "
              "(`queue.max_tokens`)"),
    ErrorCode("model_not_priced", (403,), "the tenant or key has a dollar budget and the model has no price "
              "(`[prices]`)"),
    ErrorCode("tenant_queue_full", (429,), "the tenant already has `queue.max_requests_per_tenant` requests "
              "waiting (its share of the queue; other tenants are unaffected)", _RETRY_1),
    ErrorCode("queue_full", (503,), "`queue.max_requests` requests are already waiting to be dispatched, or this "
              "request's tokens would take the queued total past `queue.max_tokens`", _RETRY_1),
    ErrorCode("budget_exhausted", (429,), "the request would pass its tenant's or key's budget for the day or "
              "month", "`Retry-After` (the period's end)"),
    ErrorCode("budget_leasing", (429,), "replicas: the budget could cover the request, this replica's lease of it "
              "cannot yet", _RETRY_1),
    ErrorCode("rate_limited", (429,), "the tenant's (or key's) bucket holds fewer tokens than the request reserves",
              "`Retry-After`, `RateLimit`, `RateLimit-Policy`"),
    ErrorCode("store_unavailable", (503,), "replicas share a Redis store that cannot be reached, `[store] "
              "on_unavailable = \"refuse\"`, and this replica's lease cannot cover the request", "`Retry-After`"),
    ErrorCode("ingress_full", (503,), "the admission stage is behind (`queue.ingress_buffer` requests wait for it)",
              _RETRY_1),
    ErrorCode("policy_error", (500,), "a policy plugin raised while handling this request (the message names it); "
              "the daemon keeps serving"),
    ErrorCode("internal_error", (500,), "a bug in apsd (the log has the traceback); the daemon keeps serving"),
    # -- queued and running ------------------------------------------------------------------------
    ErrorCode("queue_timeout", (504,), "the request waited longer than its timeout (`timeout_s`, or "
              "`queue.timeout_s`) without being dispatched; counted as cancelled, tokens refunded"),
    ErrorCode("no_backend", (503,), "the `forward` engine has had no healthy backend serving the request's model "
              "for `forward.no_backend_wait_s`", "`Retry-After`"),
    ErrorCode("executor_failed", (502,), "the simulated GPU failed while running this request's batch (fault "
              "injection, `[gpu] fail_*`); counted as failed, tokens refunded"),
    ErrorCode("stream_error", (500,), "a stream ended without an outcome (a bug; the stream's last event says so)"),
    ErrorCode("backend_failed", (502,), "the backend failed: a 5xx or 429 of its own once retries were spent, a "
              "connection closed mid-answer, a malformed answer, more tokens than it was allowed", part="backend"),
    ErrorCode("backend_unreachable", (502,), "the backend could not be reached (connection refused or reset, or "
              "no answer to a health check) once retries were spent", part="backend"),
    ErrorCode("backend_invalid_usage", (502,), "the backend reported a usage that cannot be true (not a count, "
              "beyond the request's limits)", part="backend"),
    ErrorCode("backend_timeout", (504,), "the backend sent no first token within `forward.first_token_timeout_s`, "
              "or went silent for `forward.read_timeout_s`", part="backend"),
    ErrorCode("backend_rejected", (400, 404, 422), "the backend refused the request itself: its 4xx (but 429) "
              "relayed with its status and message (a prompt beyond the server's context, say)", part="backend"),
    ErrorCode("client_disconnected", (499,), "its client left before the answer (counted as cancelled; no one "
              "reads it)", part="internal"),
    # -- /admin --------------------------------------------------------------------------------------
    ErrorCode("invalid_parameter", (400,), "a query parameter of `/admin` is out of range or malformed "
              "(`field` names it)", part="admin"),
    ErrorCode("unknown_key", (404,), "no key with that id", part="admin"),
    ErrorCode("tenant_exists", (409,), "a tenant of that name exists", part="admin"),
    ErrorCode("declared_in_file", (409,), "the tenant is declared in the config file, which `[state] file_tenants "
              "= \"authoritative\"` keeps authoritative", part="admin"),
    ErrorCode("admin_key_required", (409,), "issuing a key while no admin key is configured", part="admin"),
    ErrorCode("key_inactive", (409,), "the key is revoked or expired", part="admin"),
    ErrorCode("key_name_exists", (409,), "the tenant has a key of that name", part="admin"),
    ErrorCode("state_off", (409,), "`[state] kind = \"off\"`: nothing is kept, so nothing can be changed",
              part="admin"),
    ErrorCode("state_unavailable", (503,), "the state cannot be written or read now (Redis down or hung)",
              part="admin"),
)


def by_code() -> dict[str, ErrorCode]:
    """The catalogue by code."""
    return {entry.code: entry for entry in CATALOGUE}
