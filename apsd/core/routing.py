"""Routing: where a dispatched request runs, when there is more than one place.

Fair share and priority decide *when* a request leaves the queue (the scheduler); a routing policy
decides *where* it goes: to which backend of the ``forward`` engine, or to which of several
``continuous`` engines. The built-ins (:mod:`apsd.policies.routing`) are ``least-loaded``,
``prefix`` and ``prefix-hash``; a plugin registers more with ``registry.routing(name, factory)``
from its ``register_policies`` hook, and ``[routing] policy`` picks one.

The routing key is the whole rendered conversation (:func:`routing_key`): the model, the tools and
every message with its role, in order, cut into blocks of ``BLOCK_CHARS`` characters, each block's
hash chained to the one before it (as vLLM and llama.cpp key their caches by token prefix). Two
conversations share their first ``n`` block hashes exactly when their renderings share their first
``n`` blocks: a late message, a different tool or another model changes every block from there on.

A policy sees the places as :class:`Target` s and answers a :class:`Route`: the target and a
*reason* (a short word, exported as the ``reason`` label of ``apsd_route_decisions_total`` and in
the ``X-Apsd-Route`` response header). It is told where each request really went
(:meth:`RoutingPolicy.placed`), which may differ from its answer when the target filled up in the
meantime. It is called synchronously on the dispatch path: it must be quick and must not block.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    from apsd.core.models import InferenceRequest

__all__ = ["BLOCK_CHARS", "BLOCK_TOKENS", "Route", "RoutingPolicy", "Target", "chain_blocks", "render_conversation",
           "routing_key", "synthetic_blocks"]

#: Characters per block of the routing key: about ``BLOCK_TOKENS`` tokens at 4 characters a token.
BLOCK_CHARS = 256
#: Tokens per block of a prefix cache (the continuous engine's, and a simulated request's key).
BLOCK_TOKENS = 64

_SEPARATOR = "\x1e"   # (between the parts of a rendering: no message text can fake a boundary)


@attrs.frozen
class Target:
    """A place a request may run, as a routing policy sees it."""

    #: The backend's name (``[[backends]] name``) or ``engine-<id>``.
    name: str
    #: Requests running there now (those apsd sent it).
    load: int
    #: Requests it runs at once (``max_concurrency``, ``max_sequences``).
    capacity: int
    #: Whether it can take one more now (healthy, not saturated, a free slot).
    room: bool
    #: Tokens its prefix cache holds (what the ``prefix`` policy's picture of it is sized from).
    cache_tokens: int

    @property
    def fill(self) -> float:
        """Its load as a share of its capacity."""
        return self.load / self.capacity if self.capacity > 0 else 1.0


@attrs.frozen
class Route:
    """A routing policy's answer: the index of the chosen target among those it was given, and why."""

    index: int
    reason: str


@runtime_checkable
class RoutingPolicy(Protocol):
    """Where each request goes (see the module docstring)."""

    #: The name it was registered under (``[routing] policy``).
    name: str

    def route(self, request: InferenceRequest, targets: Sequence[Target]) -> Route:
        """Choose among ``targets`` (never empty; those without ``room`` included, so a policy can
        say it spilled) for ``request``. The chosen target should have room when any has."""

    def placed(self, request: InferenceRequest, target: Target) -> None:
        """``request`` was sent to ``target`` (what a cache-aware policy remembers)."""


def render_conversation(model: str | None, payload: dict[str, Any] | None, prompt: str) -> str:
    """The text a request's routing key is cut from: its model, its tools, then every message with its
    role (chat), its prompt (completions) or its input (responses), in the order the server renders
    them, so that a conversation's next turn renders as an extension of this one."""
    parts = [model or ""]
    if payload is None:   # (POST /infer; a simulated request without text has no key: "")
        return _SEPARATOR.join([*parts, prompt]) if prompt else ""
    for name in ("tools", "functions", "tool_choice", "response_format", "instructions"):
        if name in payload:
            parts.append(f"{name}={_canonical(payload[name])}")
    messages = payload.get("messages")
    if isinstance(messages, list):
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                text = content if isinstance(content, str) else _canonical(content)
                extra = {k: v for k, v in message.items() if k not in ("role", "content")}
                parts.append(f"{message.get('role')}:{text}" + (_canonical(extra) if extra else ""))
            else:
                parts.append(_canonical(message))
        return _SEPARATOR.join(parts)
    for name in ("prompt", "input"):
        if name in payload:
            value = payload[name]
            parts.append(value if isinstance(value, str) else _canonical(value))
    return _SEPARATOR.join(parts)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def chain_blocks(text: str, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """The chained hashes of ``text``'s whole blocks of ``block_chars`` characters, and of its last
    partial block (so a short conversation still has a key): block ``i``'s hash covers blocks ``0..i``.
    BLAKE2b, so every process and replica computes the same keys."""
    data = text.encode("utf-8", "surrogatepass")
    size = block_chars
    blocks: list[int] = []
    previous = b""
    for start in range(0, len(data), size):
        digest = hashlib.blake2b(previous + data[start:start + size], digest_size=8).digest()
        blocks.append(int.from_bytes(digest, "big"))
        previous = digest
    return tuple(blocks)


def routing_key(request: InferenceRequest, block_chars: int = BLOCK_CHARS) -> tuple[int, ...]:
    """``request``'s routing key: its ``prefix_blocks`` when it came with them (a simulated request),
    else the chained block hashes of its rendered conversation, computed once and kept on it."""
    if request.prefix_blocks is None:
        request.prefix_blocks = chain_blocks(render_conversation(request.model, request.payload, request.prompt),
                                             block_chars)
    return request.prefix_blocks


def synthetic_blocks(shared: tuple[int, int], own: int, prompt_tokens: int) -> tuple[int, ...]:
    """A simulated request's key: a prompt of ``prompt_tokens`` that starts with ``shared[1]`` tokens
    shared by every request of prefix ``shared[0]``, then tokens of its own (``own`` tells them apart),
    in whole blocks of ``BLOCK_TOKENS`` (a partial block is never cached)."""
    prefix_id, prefix_tokens = shared
    blocks = prompt_tokens // BLOCK_TOKENS
    common = min(blocks, prefix_tokens // BLOCK_TOKENS)
    key: list[int] = []
    previous = b""
    for i in range(blocks):
        label = f"p{prefix_id}:{i}" if i < common else f"p{prefix_id}:{i}:r{own}"
        previous = hashlib.blake2b(previous + label.encode(), digest_size=8).digest()
        key.append(int.from_bytes(previous, "big"))
    return tuple(key)
