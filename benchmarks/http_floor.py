"""The floor under any Quart-Trio daemon: an app that does nothing but answer, for ``bench_dataplane.py --floor``.

    python benchmarks/http_floor.py quart PORT      # an empty Quart-Trio handler on Hypercorn (apsd's stack)
    python benchmarks/http_floor.py asgi PORT       # an empty ASGI app on Hypercorn alone

Both answer ``POST /v1/chat/completions`` at once with a fixed chat completion (or, with
``"stream": true``, a fixed stream of 16 chunks), and after 20 ms for the model ``standin-20ms``,
as the stand-in backend does: what a request costs them is what the HTTP stack costs with no work
at all, the part of apsd's cost that no change inside apsd can remove.
"""

from __future__ import annotations

import json
import sys

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

ANSWER = json.dumps({"id": "chatcmpl-floor", "object": "chat.completion", "created": 0, "model": "standin",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": " tok" * 16},
                                  "logprobs": None, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 16, "completion_tokens": 16, "total_tokens": 32}}).encode()
CHUNK = b'data: {"id":"chatcmpl-floor","object":"chat.completion.chunk","created":0,"model":"standin",' \
        b'"choices":[{"index":0,"delta":{"content":" tok"},"logprobs":null,"finish_reason":null}]}\n\n'
STREAM = [CHUNK] * 16 + [b"data: [DONE]\n\n"]
SLOW_MODEL, SLOW_S = "standin-20ms", 0.020


def _wants(body: bytes) -> tuple[bool, bool]:
    """(stream, slow) of a request body."""
    try:
        data = json.loads(body)
    except ValueError:
        return False, False
    return bool(data.get("stream")), data.get("model") == SLOW_MODEL


def quart_app():  # type: ignore[no-untyped-def]
    from quart import Response, request
    from quart_trio import QuartTrio

    app = QuartTrio("floor")

    @app.post("/v1/chat/completions")
    async def complete() -> Response:
        stream, slow = _wants(await request.get_data())
        if slow:
            await trio.sleep(SLOW_S)
        if stream:
            async def events():  # type: ignore[no-untyped-def]
                for event in STREAM:
                    yield event
            return Response(events(), content_type="text/event-stream")
        return Response(ANSWER, content_type="application/json")

    return app


async def asgi_app(scope, receive, send):  # type: ignore[no-untyped-def]
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    stream, slow = _wants(body)
    if slow:
        await trio.sleep(SLOW_S)
    kind = b"text/event-stream" if stream else b"application/json"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
    for piece in STREAM if stream else [ANSWER]:
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def main() -> None:
    kind, port = sys.argv[1], int(sys.argv[2])
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    trio.run(serve, quart_app() if kind == "quart" else asgi_app, config)


if __name__ == "__main__":
    main()
