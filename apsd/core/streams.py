"""Token streams: one request's output, delivered to one reader as its engine produces it.

Ownership: whoever wants a request's tokens as they come (an HTTP handler answering with
Server-Sent Events) creates a :class:`TokenStream` and sets ``request.stream`` before
submitting it; the request's engine is the only producer; the creator is the only reader.
Nobody else touches it. A request without a stream costs its engine nothing per token, which
keeps virtual-time simulation cost independent of output lengths.

Buffering is bounded in chunks. The simulated engines call :meth:`TokenStream.push_nowait`,
which never blocks: when ``max_chunks`` chunks are waiting unread, a new chunk is merged
into the last one, so a slow reader receives fewer, larger chunks and never holds up an
engine that serves hundreds of other sequences. A relay that can pass backpressure on (the
forwarding engine reading from a backend's socket) calls :meth:`TokenStream.push` instead,
which waits for room.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator
from typing import Any

import attrs
import trio

__all__ = ["TokenChunk", "TokenStream"]


@attrs.define
class TokenChunk:
    """``tokens`` output tokens (and their ``text``, when the engine has text), the last of which
    was produced at model time ``at``. ``data`` is a forwarded backend's own stream chunk (an
    OpenAI ``chat.completion.chunk`` or ``text_completion`` object) to relay as it is, and ``raw``
    its JSON as the backend sent it when apsd changed nothing in it (relayed without serialising
    it again); both None from the simulated engines. Chunks with ``data`` are never merged.
    Not to be changed once made (mutable only because a frozen class costs more to make, once
    per streamed chunk)."""

    tokens: int
    text: str = ""
    at: float = 0.0
    data: dict[str, Any] | None = None
    raw: bytes | None = None


class TokenStream:
    """A bounded single-producer, single-reader queue of :class:`TokenChunk`.

    The reader iterates (``async for chunk in stream``) until the producer calls
    :meth:`close`; :attr:`error` then says whether the stream ended early (a message) or
    not (None). The reader may :meth:`abandon` it (its client left): pushes are then dropped.
    """

    def __init__(self, max_chunks: int = 64) -> None:
        if max_chunks < 1:
            raise ValueError("max_chunks must be >= 1")
        self.max_chunks = max_chunks
        self._chunks: collections.deque[TokenChunk] = collections.deque()
        self._readable = trio.Event()
        self._writable = trio.Event()
        self.closed = False
        self.abandoned = False
        #: Why the stream ended early (None: it ended normally, or has not ended).
        self.error: str | None = None
        #: Output tokens pushed so far.
        self.tokens = 0

    def push_nowait(self, chunk: TokenChunk) -> None:
        """Add a chunk without ever blocking (merging it into the last one when the buffer is full)."""
        if self.closed or self.abandoned or chunk.tokens <= 0 and not chunk.text and chunk.data is None:
            return
        self.tokens += chunk.tokens
        if len(self._chunks) >= self.max_chunks and chunk.data is None and self._chunks[-1].data is None:
            last = self._chunks.pop()
            chunk = TokenChunk(last.tokens + chunk.tokens, last.text + chunk.text, chunk.at)
        self._chunks.append(chunk)
        self._readable.set()

    async def push(self, chunk: TokenChunk) -> None:
        """Add a chunk, waiting while ``max_chunks`` are unread (backpressure for a relay)."""
        while len(self._chunks) >= self.max_chunks and not (self.closed or self.abandoned):
            self._writable = trio.Event()
            await self._writable.wait()
        self.push_nowait(chunk)

    def close(self, error: str | None = None) -> None:
        """End the stream (idempotent); ``error`` says why it ended early."""
        if not self.closed:
            self.closed = True
            self.error = error
            self._readable.set()
            self._writable.set()

    def abandon(self) -> None:
        """The reader is gone: drop what is buffered and whatever comes."""
        self.abandoned = True
        self._chunks.clear()
        self._writable.set()

    async def receive(self) -> TokenChunk | None:
        """The next chunk, or None once the stream is closed and drained."""
        while not self._chunks:
            if self.closed:
                return None
            self._readable = trio.Event()
            await self._readable.wait()
        chunk = self._chunks.popleft()
        self._writable.set()
        return chunk

    def receive_ready(self) -> list[TokenChunk]:
        """Every chunk buffered now, without waiting (a reader that writes them out together saves a
        write per chunk)."""
        chunks = list(self._chunks)
        self._chunks.clear()
        if chunks:
            self._writable.set()
        return chunks

    async def __aiter__(self) -> AsyncIterator[TokenChunk]:
        while (chunk := await self.receive()) is not None:
            yield chunk
