"""The forward engine's upstream connections (apsd/engines/upstream.py): body framing and SSE
splitting on bytes, and the keep-alive pool against a real socket peer that answers as scripted
(reused connections, a server that closes one while idle, one that dies mid-answer)."""

from __future__ import annotations

import functools
import ssl

import hypothesis.strategies as st
import pytest
import trio
import trustme
from hypothesis import given, settings

from apsd.engines.upstream import SseSplitter, UpstreamError, UpstreamPool, _BodyDecoder

# -- framing -------------------------------------------------------------------------------------


def _chunked(pieces: list[bytes], trailers: bytes = b"") -> bytes:
    return b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n" + trailers + b"\r\n"


def _feed_in_parts(decoder: _BodyDecoder, data: bytes, cuts: list[int]) -> bytes:
    out, previous = [], 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(data))) + [len(data)]:
        out.append(decoder.feed(data[previous:cut]))
        previous = cut
    return b"".join(out)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.binary(min_size=0, max_size=40), max_size=8),
       trailers=st.sampled_from([b"", b"X-Trailer: 1\r\n", b"A: 1\r\nB: 2\r\n"]),
       cuts=st.lists(st.integers(0, 400), max_size=12))
def test_a_chunked_body_is_decoded_whatever_the_reads_it_arrives_in(pieces, trailers, cuts):
    data = _chunked(pieces, trailers)
    decoder = _BodyDecoder(length=None, chunked=True)
    assert _feed_in_parts(decoder, data, cuts) == b"".join(pieces)
    assert decoder.done and not decoder.overrun


def test_a_chunked_body_ends_at_its_last_chunk_and_bytes_past_it_are_noticed():
    decoder = _BodyDecoder(length=None, chunked=True)
    assert decoder.feed(b"3\r\nabc\r\n") == b"abc" and not decoder.done
    assert decoder.feed(b"0\r\n\r\nHTTP/1.1 200") == b""
    assert decoder.done and decoder.overrun   # (the connection will not be reused)


@pytest.mark.parametrize("bad", [b"zz\r\nabc\r\n", b"-3\r\nabc\r\n", b"\r\nabc\r\n", b"3\r\nabcXY", b"1" * 5000])
def test_a_malformed_chunked_body_is_an_error_that_says_so(bad):
    with pytest.raises(UpstreamError, match="malformed chunked body"):
        _BodyDecoder(length=None, chunked=True).feed(bad)


def test_a_content_length_body_stops_at_its_length():
    decoder = _BodyDecoder(length=5, chunked=False)
    assert decoder.feed(b"ab") == b"ab" and not decoder.done
    assert decoder.feed(b"cdeXX") == b"cde"
    assert decoder.done and decoder.overrun


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.binary(max_size=30).filter(lambda b: b"\r" not in b and b"\n" not in b), max_size=6),
       newline=st.sampled_from([b"\n", b"\r\n", b"\r"]), cuts=st.lists(st.integers(0, 300), max_size=10))
def test_sse_events_are_split_on_bytes_whatever_the_line_endings_and_reads(values, newline, cuts):
    body = b"".join(b": comment" + newline + b"event: x" + newline + b"data: " + v + newline + newline
                    for v in values) + b"data: end\n\n"   # (a last CR may be half a CRLF: what follows says)
    splitter = SseSplitter()
    out, previous = [], 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(body))) + [len(body)]:
        out += splitter.feed(body[previous:cut])
        previous = cut
    assert out == values + [b"end"]


def test_an_event_of_several_data_lines_joins_them_and_one_without_data_is_skipped():
    assert SseSplitter().feed(b"data: a\ndata:b\ndata\n\n: only a comment\n\nid: 3\n\n") == [b"a\nb\n"]


# -- the pool, against a scripted server -------------------------------------------------------------


class ScriptedServer:
    """A TCP server on a free loopback port: reads each request (head and Content-Length body)
    and answers with the next scripted reply (bytes, then ``"close"`` to close the connection
    after it, or ``"die"`` to close without answering)."""

    def __init__(self, replies: list[tuple[bytes, str]]) -> None:
        self.replies = list(replies)
        self.connections = 0
        self.requests: list[bytes] = []
        self.port = 0

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED, tls: ssl.SSLContext | None = None) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        if tls is not None:
            listeners = [trio.SSLListener(listener, tls, https_compatible=True) for listener in listeners]
        task_status.started()
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.abc.Stream) -> None:
        try:
            await self._answer(stream)
        except trio.BrokenResourceError:   # (a client that failed the TLS handshake)
            pass

    async def _answer(self, stream: trio.abc.Stream) -> None:
        self.connections += 1
        buffer = b""
        async with stream:
            while self.replies:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(buffer) < length:
                    buffer += await stream.receive_some(65536)
                self.requests.append(head + b"\r\n\r\n" + buffer[:length])
                buffer = buffer[length:]
                reply, then = self.replies.pop(0)
                if then == "die":
                    return
                await stream.send_all(reply)
                if then == "close":
                    return


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\": 1}\r\n"
STREAM = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
          + _chunked([b"data: {\"n\": 1}\n\n", b"data: {\"n\": 2}\n\n", b"data: [DONE]\n\n"]))


async def _post(pool: UpstreamPool, port: int, path: str = "/v1/chat/completions") -> tuple[int, bytes]:
    async with pool.request("POST", f"http://127.0.0.1:{port}{path}", b'{"a": 1}',
                            [("Content-Type", "application/json")]) as response:
        return response.status, await response.read()


async def test_requests_to_one_server_reuse_one_connection_and_send_a_proper_request():
    server = ScriptedServer([(OK, "keep"), (STREAM, "keep"), (OK, "keep")])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        pool = UpstreamPool(connect_timeout_s=5)
        with trio.fail_after(10):
            assert await _post(pool, server.port) == (200, b'{"ok": 1}\r\n')
            status, body = await _post(pool, server.port)
            assert status == 200 and SseSplitter().feed(body) == [b'{"n": 1}', b'{"n": 2}', b"[DONE]"]
            assert await _post(pool, server.port) == (200, b'{"ok": 1}\r\n')
        assert pool.opened == 1 and server.connections == 1
        head = server.requests[0]
        assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
        assert f"host: 127.0.0.1:{server.port}".encode() in head.lower() and head.endswith(b'{"a": 1}')
        await pool.aclose()
        nursery.cancel_scope.cancel()


async def test_a_connection_the_server_closed_while_idle_is_replaced_without_failing_the_request():
    server = ScriptedServer([(OK, "close"), (OK, "keep")])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        pool = UpstreamPool(connect_timeout_s=5)
        with trio.fail_after(10):
            assert (await _post(pool, server.port))[0] == 200
            await trio.sleep(0.05)   # (the server's close reaches us)
            assert (await _post(pool, server.port))[0] == 200
        assert pool.opened == 2 and server.connections == 2
        nursery.cancel_scope.cancel()


async def test_connection_close_is_honoured_and_a_server_that_dies_mid_answer_is_an_error():
    half = STREAM[:STREAM.index(b"data: {\"n\": 2}")]
    server = ScriptedServer([(OK.replace(b"OK\r\n", b"OK\r\nConnection: close\r\n"), "keep"), (half, "close")])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        pool = UpstreamPool(connect_timeout_s=5)
        with trio.fail_after(10):
            assert (await _post(pool, server.port))[0] == 200
            with pytest.raises(UpstreamError, match="closed the connection in the middle of its answer"):
                await _post(pool, server.port)
        assert pool.opened == 2   # (Connection: close: the first connection was not reused)
        nursery.cancel_scope.cancel()


async def test_a_server_that_closes_a_fresh_connection_without_answering_is_an_error_not_a_retry():
    server = ScriptedServer([(b"", "die"), (OK, "keep")])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        pool = UpstreamPool(connect_timeout_s=5)
        with trio.fail_after(10), pytest.raises(UpstreamError, match="without answering"):
            await _post(pool, server.port)
        assert pool.opened == 1   # (only a reused connection is retried: this one may have been seen)
        nursery.cancel_scope.cancel()


async def test_a_body_left_unread_closes_its_connection():
    server = ScriptedServer([(STREAM, "keep"), (OK, "keep")])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        pool = UpstreamPool(connect_timeout_s=5)
        with trio.fail_after(10):
            async with pool.request("POST", f"http://127.0.0.1:{server.port}/", b"", []) as response:
                assert response.status == 200   # (and nothing of the body read)
            assert (await _post(pool, server.port))[0] == 200
        assert pool.opened == 2 and server.connections == 2
        nursery.cancel_scope.cancel()


async def test_an_unreachable_server_is_an_upstream_error():
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()   # (nothing listens there now)
    with trio.fail_after(10), pytest.raises(UpstreamError):
        await _post(UpstreamPool(connect_timeout_s=5), port)


@pytest.mark.parametrize(("reply", "error"), [
    (b"SPDY/3 200 OK\r\n\r\n", "other than HTTP/1.x"),
    (b"HTTP/1.1 200 OK\r\nX-A: 1\r\n folded\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\nX-A : 1\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", "transfer coding"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n", "in the middle of its headers"),
])
async def test_a_malformed_answer_head_is_an_error_that_names_what_is_wrong(reply, error):
    server = ScriptedServer([(reply, "close")])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with trio.fail_after(10), pytest.raises(UpstreamError, match=error):
            await _post(UpstreamPool(connect_timeout_s=5), server.port)
        nursery.cancel_scope.cancel()


async def test_an_interim_answer_is_skipped_and_the_final_one_read():
    server = ScriptedServer([(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK, "keep")])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with trio.fail_after(10):
            assert await _post(UpstreamPool(connect_timeout_s=5), server.port) == (200, b'{"ok": 1}\r\n')
        nursery.cancel_scope.cancel()


async def test_a_header_with_a_line_break_is_never_sent():
    pool = UpstreamPool(connect_timeout_s=5)
    server = ScriptedServer([(OK, "keep")])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with trio.fail_after(10), pytest.raises(UpstreamError, match="line break"):
            async with pool.request("POST", f"http://127.0.0.1:{server.port}/", b"",
                                    [("Authorization", "Bearer x\r\nX-Injected: 1")]):
                pass
        assert server.requests == []
        nursery.cancel_scope.cancel()


async def test_the_client_relays_each_events_bytes_as_sent_but_re_serialises_json_split_over_lines():
    from apsd.core.config import BackendConfig, ForwardConfig
    from apsd.engines.backends import Backend, HttpBackendClient

    events = [b'data: {"choices": [{"index": 0, "delta": {"content": "a"}}]}\n\n',
              b'data: {"choices": [{"index": 0,\ndata: "delta": {"content": "b"}}]}\n\n',
              b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n', b"data: [DONE]\n\n"]
    reply = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
             + _chunked(events))
    server = ScriptedServer([(reply, "keep")])
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        client = HttpBackendClient(ForwardConfig())
        backend = Backend(BackendConfig(url=f"http://127.0.0.1:{server.port}"))
        chunks = []

        def on_chunk(chunk):
            chunks.append(chunk)

        with trio.fail_after(10):
            answer = await client.complete(backend, "chat.completions", {"model": "m", "stream": True,
                                                                         "max_tokens": 2}, on_chunk)
        assert (answer.prompt_tokens, answer.completion_tokens) == (3, 2)
        assert chunks[0].raw == events[0][6:-2] and chunks[1].raw is None and chunks[1].data["choices"][0]["delta"] == {
            "content": "b"}
        assert client.connections_opened == 1
        await client.aclose()
        nursery.cancel_scope.cancel()


async def test_an_https_server_is_checked_against_the_ca_and_its_connections_kept():
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    trusted = ssl.create_default_context()
    ca.configure_trust(trusted)
    server = ScriptedServer([(OK, "keep"), (STREAM, "keep"), (OK, "keep")])
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(server.serve, tls=server_context))
        pool = UpstreamPool(connect_timeout_s=5, ssl_context=trusted)
        url = f"https://127.0.0.1:{server.port}/v1/chat/completions"
        with trio.fail_after(10):
            for _ in range(2):
                async with pool.request("POST", url, b"{}", []) as response:
                    assert response.status == 200 and await response.read()
            assert pool.opened == 1 and server.connections == 1
            with pytest.raises(UpstreamError, match="CERTIFICATE_VERIFY_FAILED"):   # (the system does not trust it)
                async with UpstreamPool(connect_timeout_s=5).request("POST", url, b"{}", []):
                    pass
        await pool.aclose()
        nursery.cancel_scope.cancel()
