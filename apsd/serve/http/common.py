"""What every protocol's handlers share: the app's state, authentication, bodies and answers.

Ownership: :class:`HttpState` is made once per app by :func:`apsd.serve.http.create_app` and kept in
``app.extensions["apsd"]``; handlers reach it with :func:`http_state`. It holds no tasks: the
app reads and submits through the :class:`~apsd.pipeline.Pipeline` it was given.

Authentication is one decorator, :func:`authenticated`: it identifies the caller from the
``Authorization`` or ``x-api-key`` header (:mod:`apsd.serve.auth`) before the body is read, refuses what the
endpoint does not allow (counted as a refusal in the ledger), and hands the handler the
:class:`~apsd.serve.auth.Caller`. Each protocol renders refusals in its own shape: apsd's
``{"error", "message"[, "field"]}`` (:func:`error_response`) or OpenAI's (:mod:`apsd.serve.http.openai`).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import trio
from quart import Response, current_app, g, request
from werkzeug.exceptions import HTTPException

from apsd.core import strictjson
from apsd.core.config import Config
from apsd.core.models import Refusal
from apsd.pipeline import Pipeline
from apsd.serve.auth import API_KEY_HEADER, Caller, HeaderFields, KeyRing
from apsd.serve.prometheus import PrometheusExporter

if TYPE_CHECKING:
    from apsd.core.models import InferenceRequest
    from apsd.serve.tracing import Tracing
    from apsd.state.keeper import StateKeeper

__all__ = ["BodyError", "HeaderFields", "HttpState", "MAX_TENANT_ID_CHARS", "MAX_TOKENS_REQUESTED", "REQUEST_ID_HEADER",
           "ShieldResponseEnd", "authenticated", "begin_trace", "check_field_types", "check_prompt_length",
           "client_request_id", "error_response", "finish_trace", "http_state", "identify_caller", "invalid_field",
           "is_int", "json_response", "note_tenant", "noted_tenant", "outcome_or_cancel", "parse_json_object",
           "read_unread_body", "rounded", "service_class", "shown"]

MAX_TENANT_ID_CHARS = 256
#: Far beyond any real request; bounds client integers before any arithmetic or formatting.
MAX_TOKENS_REQUESTED = 1_000_000_000
#: Wall seconds an answer waits for the rest of a body it did not need (see :func:`read_unread_body`).
UNREAD_BODY_WAIT_S = 1.0


class BodyError(Exception):
    """A request the handler refuses before it reaches the pipeline; ``refusal`` is the answer."""

    def __init__(self, status: int, error: str, message: str, field: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.refusal = Refusal(status, error, message, field=field, headers=headers or {})


class KeyRingCache:
    """The KeyRing of the pipeline's current config (a reload replaces the config, and so the keys)."""

    def __init__(self) -> None:
        self._config: Config | None = None
        self._keyring = KeyRing()

    def get(self, config: Config) -> KeyRing:
        if config is not self._config:
            self._keyring, self._config = KeyRing.from_config(config), config
        return self._keyring


@attrs.define(eq=False)
class HttpState:
    """What the handlers of one app share: its pipeline, the pipeline's Prometheus exporter, the
    keys of the current config, and when the app was made (Unix seconds: ``GET /v1/models``)."""

    pipeline: Pipeline
    exporter: PrometheusExporter
    created: int
    keyring: KeyRingCache = attrs.field(factory=KeyRingCache)
    #: The daemon's state keeper (tenants and keys managed through ``/admin``); None without a daemon.
    keeper: StateKeeper | None = None
    #: Requests' traces (:mod:`apsd.serve.tracing`); None: tracing is off.
    tracing: Tracing | None = None

    def identify(self, authorization: list[str], api_keys: list[str] | None = None) -> Caller | Refusal:
        return self.keyring.get(self.pipeline.config).identify_headers(authorization, api_keys)


def http_state() -> HttpState:
    """The current app's :class:`HttpState` (call inside a request)."""
    state: HttpState = current_app.extensions["apsd"]
    return state


def begin_trace(state: HttpState, inference: InferenceRequest, headers: HeaderFields) -> None:
    """Trace ``inference``, which arrived now with ``headers``, when tracing is on (continuing the client's
    ``traceparent``); it is finished by :func:`finish_trace` once its answer's last byte is written."""
    if state.tracing is None:
        return
    pipeline = state.pipeline
    key = pipeline.config.keys.get(inference.key_id) if inference.key_id is not None else None
    inference.trace = state.tracing.begin(inference, headers.get("traceparent"), headers.get("tracestate"),
                                          key_name=key.name if key else "", time_scale=pipeline.clock.time_scale)


def finish_trace(inference: InferenceRequest, refusal: Refusal | None = None) -> None:
    """End ``inference``'s trace, if it has one, with its outcome (or ``refusal``, when it was refused
    before it was submitted; neither: its client left)."""
    if inference.trace is not None:
        inference.trace.finish(inference, refusal if refusal is not None else inference.reply.outcome)


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])


def identify_caller(state: HttpState, headers: HeaderFields, *, admin: bool = False,
                    submits: bool = False) -> Caller | Refusal:
    """Who sends a request with ``headers``, or why the endpoint refuses them (see :func:`authenticated`;
    the refusal is not counted here)."""
    caller = state.identify(headers.getlist("Authorization"), headers.getlist(API_KEY_HEADER))
    if isinstance(caller, Caller):
        if admin and not caller.admin:
            return Refusal(403, "admin_only", "this endpoint needs the admin key")
        if submits and not caller.anonymous and caller.tenant is None:
            return Refusal(403, "admin_cannot_submit", "the admin key cannot submit requests; use the tenant's own key")
    return caller


def authenticated(*, admin: bool = False, submits: bool = False,
                  answer: Callable[[Refusal], Response] | None = None) -> Callable[[Handler], Handler]:
    """Decorate a route: it runs only for a caller the endpoint allows, given as ``caller=``.

    Every caller must present a valid key once keys are configured (401 otherwise, with
    ``WWW-Authenticate``); without keys everyone is :data:`~apsd.serve.auth.OPEN_ACCESS`. ``admin``:
    the operator's key only (403 ``admin_only``). ``submits``: the endpoint submits requests,
    which the admin key may not do (403 ``admin_cannot_submit``: it has no tenant to bill).
    A refusal is counted in the ledger (unattributed) and rendered by ``answer`` (default
    :func:`error_response`). The key is checked before anything reads the body.
    """
    render = answer or error_response

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def guarded(*args: Any, **kwargs: Any) -> Any:
            state = http_state()
            caller = identify_caller(state, request.headers, admin=admin, submits=submits)
            if isinstance(caller, Refusal):
                state.pipeline.ledger.count_refusal(None, caller.error)
                return render(caller)
            return await handler(*args, caller=caller, **kwargs)
        return guarded  # type: ignore[return-value]
    return decorate


def note_tenant(tenant_id: str) -> None:
    """Say which tenant the current request is for, once a handler knows: every answer to it then
    carries that tenant's ``RateLimit`` and ``RateLimit-Policy`` fields (:func:`apsd.serve.http.create_app`
    adds them), refusals and streams included."""
    g.apsd_tenant = tenant_id


def noted_tenant() -> str | None:
    """The tenant :func:`note_tenant` named for the current request (None: none yet)."""
    tenant: str | None = g.get("apsd_tenant")
    return tenant


async def outcome_or_cancel(pipeline: Any, inference: Any) -> Any:
    """The answer to ``inference`` (a whole one: not streamed); a client that goes away meanwhile (the
    handler is cancelled) cancels the request."""
    try:
        return await inference.reply.wait()
    finally:
        if not inference.answered:
            pipeline.cancel(inference)


def invalid_field(field: str, rule: str, error: str = "invalid_field") -> BodyError:
    """A 422 naming ``field`` and the ``rule`` it breaks."""
    return BodyError(422, error, f"{field} {rule}", field=field)


def is_int(value: Any) -> bool:
    """A JSON integer (not a boolean, which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_field_types(data: dict[str, Any], *, numbers: tuple[str, ...] = (), integers: tuple[str, ...] = (),
                      booleans: tuple[str, ...] = (), objects: tuple[str, ...] = ()) -> None:
    """Each present (non-null) field of ``data`` named in ``numbers``, ``integers``, ``booleans`` or
    ``objects`` has that JSON type, else :func:`invalid_field` names the first that does not: fields apsd
    relays without reading, checked so that a backend is not sent a wrong type (a 4xx at best, at worst a
    5xx that would be retried and blamed on it)."""
    for name in numbers:
        value = data.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise invalid_field(name, "must be a number")
    for name in integers:
        value = data.get(name)
        if value is not None and not is_int(value):
            raise invalid_field(name, "must be an integer")
    for name in booleans:
        value = data.get(name)
        if value is not None and not isinstance(value, bool):
            raise invalid_field(name, "must be true or false")
    for name in objects:
        value = data.get(name)
        if value is not None and not isinstance(value, dict):
            raise invalid_field(name, "must be an object")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; BodyError 400 unless it is exactly one.

    A key repeated in any object of the document is refused (``duplicate_key``, naming it):
    parsers disagree on which value wins, so a proxy and apsd could read different requests.
    Nesting deeper than :data:`apsd.core.strictjson.MAX_DEPTH` is refused (``too_deep``), and so are
    ``NaN``/``Infinity`` and lone surrogates (``invalid_json``): a backend would choke on them
    and the request would come back as a 5xx blamed on it.
    """
    try:
        data = strictjson.loads(raw)
    except strictjson.DuplicateKeyError as exc:
        key = exc.key if len(exc.key) <= 64 else exc.key[:64] + "..."
        raise BodyError(400, "duplicate_key", f"the request body repeats the key {key!r}; "
                        "each key may appear once per object", field=exc.key[:256]) from None
    except strictjson.TooDeepError as exc:
        raise BodyError(400, "too_deep", f"the request body's {exc}; the limit is {strictjson.MAX_DEPTH}") from None
    except strictjson.NonStandardJSONError as exc:
        raise BodyError(400, "invalid_json", f"the request body is not standard JSON: {exc}") from None
    except ValueError:
        raise BodyError(400, "invalid_json", "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BodyError(400, "invalid_json", "the request body must be a JSON object")
    return data


#: A client's ``X-Request-Id`` that apsd adopts: short, and safe in a log line and a header.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
REQUEST_ID_HEADER = "X-Request-Id"


def client_request_id(headers: HeaderFields) -> str | None:
    """The client's ``X-Request-Id`` (one header, 1-128 of letters, digits and ``-_.:``), or None
    when it sent none; BodyError 400 ``invalid_header`` for anything else. apsd names the request
    by it in its log and answers, and sends it to the backend."""
    values = headers.getlist(REQUEST_ID_HEADER)
    if not values:
        return None
    if len(values) > 1 or not _REQUEST_ID.fullmatch(values[0]):
        raise BodyError(400, "invalid_header", f"{REQUEST_ID_HEADER} must be one id of 1-128 letters, digits "
                        "and -_.: characters", field=REQUEST_ID_HEADER)
    return values[0]


#: The header naming a request's service class (``[classes.<name>]``); it takes precedence over the
#: body's ``service_class``.
CLASS_HEADER = "X-Apsd-Class"
_CLASS_NAME = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def service_class(body_value: Any, headers: HeaderFields) -> str | None:
    """The service class a request names: its :data:`CLASS_HEADER` header (in ``headers``), else ``body_value`` (the
    body's ``service_class``; None: absent). BodyError 400 ``invalid_header`` / 422 ``invalid_field``
    for one that is not a name of 1-64 letters, digits and ``-_.:``. Whether the class exists and the
    tenant may use it, admission says (400 ``unknown_class``, 403 ``class_not_allowed``)."""
    values = headers.getlist(CLASS_HEADER)
    if values:
        if len(values) > 1 or not _CLASS_NAME.fullmatch(values[0].strip()):
            raise BodyError(400, "invalid_header", f"{CLASS_HEADER} must name one class (1-64 letters, digits "
                            "and -_.: characters)", field=CLASS_HEADER)
        return values[0].strip()
    if body_value is None:
        return None
    if not isinstance(body_value, str) or not _CLASS_NAME.fullmatch(body_value):
        raise BodyError(422, "invalid_field", "service_class must be a class name (1-64 letters, digits and -_.: "
                        "characters)", field="service_class")
    return body_value


def shown(number: int) -> str:
    """A client's integer for a message: never formatted in full beyond 18 digits (a 5000-digit
    int cannot even be printed)."""
    return str(number) if -10**18 < number < 10**18 else "an integer of more than 18 digits"


def check_prompt_length(tokens: int, characters: int, pipeline: Pipeline, field: str = "prompt") -> None:
    """413 ``prompt_too_long`` when ``tokens`` (the estimate for ``characters`` of prompt) exceeds
    ``[admission] max_prompt_tokens``."""
    limit = pipeline.config.admission.max_prompt_tokens
    if tokens > limit:
        raise BodyError(413, "prompt_too_long",
                        f"the prompt is about {tokens} tokens ({characters} characters, estimated as "
                        f"docs/reference/accounting.md says); the limit is {limit} (admission.max_prompt_tokens)",
                        field=field)


async def read_unread_body() -> bool:
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


def rounded(value: Any, key: str = "") -> Any:
    """``value`` with every float rounded for an answer: milliseconds (keys ending ``_ms``) and Unix
    times (``_at``, ``at``, ``from``, ``to``) to the microsecond and the millisecond, US dollars (``_usd``) to the nano-dollar, anything else to 6 significant digits.

    Binary floats print as ``0.00042480468749999994``; no client needs those digits, and the
    figures are model estimates anyway. Non-finite floats become null (JSON has no NaN).
    """
    if isinstance(value, float):
        if not math.isfinite(value):
            return None
        if key.endswith("_ms") or key.endswith("_at") or key in ("at", "from", "to"):  # (times: Unix seconds)
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


def error_response(refusal: Refusal) -> Response:
    """apsd's error answer: ``{"error": code, "message": text[, "field": name]}`` and the refusal's headers."""
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

    It also gives apsd's server (:mod:`apsd.serve.server`) the send timeout, ``[server] send_timeout_s``,
    in the ASGI lifespan state: a ``send`` cannot time out here, since hypercorn shields the socket
    write inside it, so the server bounds the write itself and drops a client that takes nothing of
    its answer for that long (the request then sees ``http.disconnect`` and is cancelled).
    """

    def __init__(self, app: Any, send_timeout_s: float | None = None) -> None:
        self.app = app
        self.send_timeout_s = send_timeout_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan" and self.send_timeout_s is not None and isinstance(scope.get("state"), dict):
            from apsd.serve.server import SEND_TIMEOUT_STATE  # (here: only the lifespan needs it)
            scope["state"][SEND_TIMEOUT_STATE] = self.send_timeout_s
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_last_shielded(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await self.app(scope, receive, send_last_shielded)
