"""The data plane: the ``/v1`` API served straight from ASGI, below the web framework.

``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses`` (OpenAI's
protocol, :mod:`apsd.serve.http.openai`), ``POST /v1/messages`` and ``/v1/messages/count_tokens``
(Anthropic's, :mod:`apsd.serve.http.anthropic`) and ``GET /v1/models`` are where a shared pool's traffic
goes, so they are answered here, in the same Hypercorn server as the rest but without Quart: a request
costs its parsing, apsd's pipeline and the relay, not a framework's routing, contexts and wrappers. Every
other path (``/infer``, ``/admin``, ``/ui``, ``/metrics``, ``/health``, ...) goes to the Quart app
(:func:`apsd.serve.http.create_app`), as does the ASGI lifespan.

A ``/v1`` request is answered as the Quart app answers its own, in this order:

1. without API keys, a cross-site browser request or a foreign ``Host`` is refused
   (:func:`apsd.serve.auth.cross_site_refusal`), and a metrics key goes no further than the metrics
   (403 ``metrics_only``), both counted as refusals;
2. the path and method: 404 ``not_found``, 405 ``method_not_allowed`` (with ``Allow``); ``OPTIONS``
   answers an empty 200 with ``Allow``, ``HEAD`` a ``GET`` without its body;
3. the caller (:func:`apsd.serve.http.common.identify_caller`): 401, 403;
4. the handler: its body (413 ``body_too_large`` beyond ``[server] max_body_bytes``, 408
   ``request_timeout`` after ``[server] body_timeout_s``), its checks, the pipeline.

Every answer is in the shape of its path's protocol (Anthropic's under ``/v1/messages``, OpenAI's
elsewhere), carries its tenant's ``RateLimit`` fields once the handler knows the tenant, and says
``Connection: close`` when apsd is draining or a body the answer did not need cannot be read. A client
that leaves (``http.disconnect``) cancels its handler and so its request; an error in apsd is a 500
``internal_error`` (logged), never a traceback.

Ownership: :class:`DataPlane` owns one nursery per request, holding the task that reads the request's
messages (:meth:`apsd.serve.http.exchange.Exchange.pump`) beside the handler; both end with the answer.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import trio

from apsd.core.models import OPENAI_APIS, Refusal
from apsd.serve.auth import API_KEY_HEADER, Caller, cross_site_refusal
from apsd.serve.http import anthropic, openai
from apsd.serve.http.common import HttpState, identify_caller
from apsd.serve.http.exchange import Answer, Exchange, send_answer

__all__ = ["PREFIX", "ROUTES", "DataPlane", "Route"]

log = logging.getLogger("apsd.serve.http")

#: The paths the data plane answers (all of them, known or not).
PREFIX = "/v1/"

Handler = Callable[[HttpState, Exchange, Caller], Awaitable[Answer]]


@attrs.frozen
class Route:
    """One endpoint: the methods it answers, its handler, and whether it submits requests (which the
    admin key may not: it has no tenant to bill)."""

    methods: tuple[str, ...]
    handle: Handler
    submits: bool = True


#: Path -> endpoint (exact paths: ``/v1/models/`` and ``/v1//models`` are 404s).
ROUTES: dict[str, Route] = {
    **{PREFIX + api.replace(".", "/"): Route(("POST",), partial(openai.complete, api=api)) for api in OPENAI_APIS},
    PREFIX + "models": Route(("GET", "HEAD"), openai.models, submits=False),
    PREFIX + "messages": Route(("POST",), anthropic.messages),
    PREFIX + "messages/count_tokens": Route(("POST",), anthropic.count_tokens),
}


def renderer(path: str) -> Callable[[Refusal], Answer]:
    """The error shape of ``path``'s protocol: Anthropic's under ``/v1/messages``, else OpenAI's."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return anthropic.error_response
    return openai.error_response


class DataPlane:
    """ASGI: ``/v1/*`` answered here, everything else (and the lifespan) by ``fallback``, the Quart app."""

    def __init__(self, state: HttpState, fallback: Callable[..., Awaitable[None]]) -> None:
        self.state = state
        self.fallback = fallback

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PREFIX):
            await self.fallback(scope, receive, send)
            return
        server = self.state.pipeline.config.server
        exchange = Exchange.from_scope(scope, max_body_bytes=server.max_body_bytes,
                                       body_timeout_s=server.body_timeout_s)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(exchange.pump, receive, nursery.cancel_scope.cancel)
            await self._respond(exchange, send)
            nursery.cancel_scope.cancel()

    async def _respond(self, exchange: Exchange, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        started = False

        async def send_noting_start(message: dict[str, Any]) -> None:
            nonlocal started
            started = True
            await send(message)

        render = renderer(exchange.path)
        try:
            answer = await self._answer(exchange, render)
            await self._complete_fields(exchange, answer)
            await send_answer(answer, send_noting_start, head=exchange.method == "HEAD")
        except Exception:
            log.exception("internal error answering %s %s", exchange.method, exchange.path)
            if started:   # (the answer is under way: the client sees it end short)
                return
            self.state.pipeline.ledger.count_refusal(None, "internal_error")
            answer = render(Refusal(500, "internal_error", "internal error; see the daemon's log"))
            await self._complete_fields(exchange, answer)
            await send_answer(answer, send)

    async def _answer(self, exchange: Exchange, render: Callable[[Refusal], Answer]) -> Answer:
        state = self.state
        ledger = state.pipeline.ledger
        refusal = self._gate(exchange)
        if refusal is not None:
            ledger.count_refusal(None, refusal.error)
            return render(refusal)
        route = ROUTES.get(exchange.path)
        if route is None:
            return render(Refusal(404, "not_found", f"there is no endpoint at {exchange.path[:200]!r}; "
                                  f"the /v1 API serves {', '.join(sorted(ROUTES))}"))
        allowed = ", ".join((*route.methods, "OPTIONS"))
        if exchange.method == "OPTIONS":
            return Answer(200, headers={"Allow": allowed}, content_type="text/plain")
        if exchange.method not in route.methods:
            return render(Refusal(405, "method_not_allowed", f"{exchange.path} answers {allowed}, not "
                                  f"{exchange.method[:20]}", headers={"Allow": allowed}))
        caller = identify_caller(state, exchange.headers, submits=route.submits)
        if isinstance(caller, Refusal):
            ledger.count_refusal(None, caller.error)
            return render(caller)
        return await route.handle(state, exchange, caller)

    def _gate(self, exchange: Exchange) -> Refusal | None:
        """What every request meets first (as the Quart app's ``before_request``): without API keys, no
        cross-site browser request nor a foreign ``Host``; a metrics key reads the metrics, nothing here."""
        config = self.state.pipeline.config
        keyring = self.state.keyring.get(config)
        headers = exchange.headers
        if not keyring.enabled:
            refusal = cross_site_refusal(exchange.method, headers, config.server.host)
            if refusal is not None:
                return refusal
        if keyring.is_metrics_key(headers.getlist("Authorization"), headers.getlist(API_KEY_HEADER)):
            return Refusal(403, "metrics_only", "a metrics key may only read /metrics and /metrics.json")
        return None

    async def _complete_fields(self, exchange: Exchange, answer: Answer) -> None:
        """The fields every answer gets: its tenant's ``RateLimit`` (once known), and ``Connection: close``
        when apsd is draining or the request's body cannot be read to its end."""
        pipeline = self.state.pipeline
        if exchange.tenant_id is not None and "RateLimit" not in answer.headers:
            answer.headers.update(pipeline.admission.rate_limit_headers(exchange.tenant_id))
        if answer.headers.get("Connection") == "close":
            return
        if not pipeline.accepting or not await exchange.body_drained():
            answer.headers["Connection"] = "close"
