"""Values that travel through the pipeline.

Ownership: the HTTP layer (or the simulator) creates an :class:`InferenceRequest`
with an empty :class:`ReplySlot` and waits on it; exactly one stage later
resolves the slot with a :class:`Completion` or a :class:`Refusal`, always
through the ledger so the books balance: :meth:`apsd.ledger.Ledger.finish` for an
admitted request, :meth:`apsd.ledger.Ledger.refuse_unadmitted` for one refused
before admission.
"""

from __future__ import annotations

from typing import Literal

import attrs
import trio

__all__ = ["Batch", "Completion", "InferenceRequest", "Outcome", "Refusal", "ReplySlot"]


@attrs.frozen
class Completion:
    """A request that ran; the fields of a 200 answer to ``POST /infer``.

    Durations are in model milliseconds (see ``gpu.time_scale``).
    """

    request_id: str
    tenant_id: str
    prompt_tokens: int
    tokens_generated: int
    queue_ms: float
    prefill_ms: float
    decode_ms: float
    latency_ms: float
    batch_id: int
    batch_size: int
    effective_priority: float
    cost_usd: float


#: How a refused request is counted in the ledger.
RefusalKind = Literal["rejected", "failed", "cancelled"]


@attrs.frozen
class Refusal:
    """A request that did not (or will not) run: an HTTP error answer.

    ``error`` is a stable machine-readable code, ``message`` says what happened
    in words and ``headers`` carries e.g. ``Retry-After``.
    """

    status: int
    error: str
    message: str
    kind: RefusalKind = "rejected"
    headers: dict[str, str] = attrs.field(factory=dict)
    field: str | None = None


Outcome = Completion | Refusal


@attrs.define(eq=False)
class ReplySlot:
    """Where a request's single terminal outcome is delivered.

    :meth:`resolve` succeeds once; later calls return ``False`` and change
    nothing, so a late executor result can never overwrite a shutdown answer.
    """

    _event: trio.Event = attrs.field(factory=trio.Event, init=False)
    outcome: Outcome | None = attrs.field(default=None, init=False)

    def resolve(self, outcome: Outcome) -> bool:
        if self.outcome is not None:
            return False
        self.outcome = outcome
        self._event.set()
        return True

    async def wait(self) -> Outcome:
        await self._event.wait()
        assert self.outcome is not None
        return self.outcome


@attrs.define(eq=False)
class InferenceRequest:
    """One request and its progress; identity matters, so no value equality.

    ``arrival`` and ``seq`` are stamped by admission (model seconds, and a
    strictly increasing admission number used to break ties); the scheduler
    stamps ``dispatched_at`` and ``effective_priority`` when it cuts a batch.
    ``timeout_s`` is the client's own queue timeout (None: the config's); the
    scheduler stamps ``deadline`` when it queues the request (see
    :meth:`apsd.scheduler.Scheduler.enqueue`).
    """

    request_id: str
    tenant_id: str
    prompt_tokens: int
    tokens_requested: int
    priority_bid: int
    prompt: str = attrs.field(default="", repr=False)
    reply: ReplySlot = attrs.field(factory=ReplySlot, repr=False)
    arrival: float = 0.0
    seq: int = 0
    dispatched_at: float | None = None
    effective_priority: float | None = None
    #: Set once handed to a pipeline (a request is submitted at most once).
    submitted: bool = False
    #: Its client left before admission decided it: admission refuses it.
    abandoned: bool = False
    #: Model seconds the client lets it wait in the queue (> 0; None: ``[queue] timeout_s``).
    timeout_s: float | None = None
    #: Model time at which it leaves the queue with 504 ``queue_timeout`` if still queued
    #: (``arrival`` + the shorter of ``timeout_s`` and ``[queue] timeout_s``); None: never.
    deadline: float | None = None

    @property
    def answered(self) -> bool:
        """Whether the request already has its terminal outcome (a queue may still hold it)."""
        return self.reply.outcome is not None

    @property
    def cost_tokens(self) -> int:
        """What the request costs its tenant's bucket and occupies in the KV cache."""
        return self.prompt_tokens + self.tokens_requested


@attrs.frozen
class Batch:
    """Requests cut together by the scheduler and run as one on an executor."""

    batch_id: int
    requests: tuple[InferenceRequest, ...]
    formed_at: float
    window_s: float

    @property
    def kv_tokens(self) -> int:
        return sum(r.cost_tokens for r in self.requests)
