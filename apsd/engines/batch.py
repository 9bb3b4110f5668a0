"""The ``batch`` engine: a simulated GPU with fixed prefill and decode rates, running whole batches.

Its constants are ``[gpu]``'s; the defaults approximate an A100 serving a small model.

When idle, an engine asks for a batch with its whole KV cache free (``gpu.kv_cap_tokens``,
prompt + requested tokens reserved per request); the scheduler's batching policy cuts it.
The batch then runs as one: prefill at ``prefill_tokens_per_s`` over its prompt tokens,
then decode of its requested tokens at ``decode_tokens_per_s * (decode_batch_base +
decode_batch_sqrt * sqrt(b))`` tokens/s for ``b`` requests (constants in ``[gpu]``). Every
request's first token comes at the end of the batch's prefill, and every request finishes
when the batch does. The batch's cost, ``busy seconds * price_per_hour_usd / 3600``, is split
between its requests in proportion to their tokens (prompt + generated). A running batch
cannot be cut short: a client that leaves does not stop its request, which is billed.

Streams: a request with a stream receives its tokens at the simulated pace, evenly over the
batch's decode (every ``STREAM_INTERVAL_S`` model seconds), instead of all at the end.

Faults (``[gpu] fail_probability``, ``fail_every_n_batches``, ``fault_seed``): the pipeline's
engines share one :class:`FaultInjector`, which decides as each batch starts whether it will
fail. A failing batch takes its full busy time and is booked like any other (busy time, cost,
``batch_finished``: the operator's cost, in no tenant's), but produces no token: each of its
requests goes back to the queue if it has retries left (``[engine] max_retries``), else it is
answered 502 ``executor_failed`` (``kind="failed"``; charged what it used: nothing when it had no token yet).
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from typing import Any

import attrs
import trio

from apsd.core.clock import ModelClock
from apsd.core.config import Config, GpuConfig
from apsd.core.engine import UNBOUNDED, Demand, EngineStatistics, completion
from apsd.core.ledger import Ledger
from apsd.core.models import GENERATION_APIS, Capacity, Dispatch, InferenceRequest, Refusal, exceeds_batch
from apsd.core.streams import TokenChunk

__all__ = ["FaultInjector", "GpuModel", "BatchEngine"]

log = logging.getLogger("apsd.engines.batch")

#: The model name the ``batch`` engine answers to on the OpenAI API (``GET /v1/models``).
BATCH_MODEL_NAME = "apsd-batch"
#: The ``[gpu]`` keys of fault injection.
FAULT_KEYS = ("fail_probability", "fail_every_n_batches", "fault_seed")
#: Model seconds between two deliveries of tokens to the streams of a running batch.
STREAM_INTERVAL_S = 0.05


@attrs.frozen
class GpuModel:
    """Pure timing and cost arithmetic of the simulated GPU (``[gpu]``)."""

    gpu: GpuConfig

    def decode_tokens_per_s(self, batch_size: int) -> float:
        g = self.gpu
        return g.decode_tokens_per_s * (g.decode_batch_base + g.decode_batch_sqrt * math.sqrt(batch_size))

    def prefill_s(self, batch: Dispatch) -> float:
        return sum(r.prompt_tokens for r in batch.requests) / self.gpu.prefill_tokens_per_s

    def decode_s(self, batch: Dispatch) -> float:
        return sum(r.tokens_requested for r in batch.requests) / self.decode_tokens_per_s(len(batch.requests))

    def cost_usd(self, busy_s: float) -> float:
        return busy_s * self.gpu.price_per_hour_usd / 3600.0


@attrs.define(eq=False)
class FaultInjector:
    """Which batches fail; one per pipeline, shared by its batch engines (built with them).

    Batches are counted in the order they start, across all engines; the n-th fails if
    ``n`` is a multiple of ``fail_every_n_batches`` (when that is set), or if a draw from
    its own ``random.Random(fault_seed)`` (never the global generator) falls below
    ``fail_probability``. One draw per batch, and only while the probability is above 0, so
    the same seed and the same batch order fail the same batches, and with the defaults
    nothing is drawn and nothing fails.
    """

    gpu: GpuConfig
    #: Batches started so far.
    batches: int = attrs.field(default=0, init=False)
    _rng: random.Random = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._rng = random.Random(self.gpu.fault_seed)

    def configure(self, gpu: GpuConfig) -> None:
        """Take new settings (a reload); the batch count goes on, the generator is reseeded
        only if ``fault_seed`` changed."""
        if gpu.fault_seed != self.gpu.fault_seed:
            self._rng = random.Random(gpu.fault_seed)
        self.gpu = gpu

    def batch_fails(self) -> bool:
        """Count one more batch started; whether it is to fail."""
        self.batches += 1
        drawn = self.gpu.fail_probability > 0 and self._rng.random() < self.gpu.fail_probability
        every = self.gpu.fail_every_n_batches
        return drawn or (every > 0 and self.batches % every == 0)


@attrs.define(eq=False)
class BatchEngine:
    """One simulated GPU (see the module docstring)."""

    engine_id: int
    model: GpuModel
    ledger: Ledger
    clock: ModelClock
    #: Shared with the pipeline's other engines; None: this engine never fails.
    faults: FaultInjector | None = None
    max_retries: int = 0
    #: Called with a request whose batch failed and that has retries left, and why: back to the queue.
    requeue: Callable[[InferenceRequest, str], None] | None = None
    kind: str = attrs.field(default="batch", init=False)
    apis: tuple[str, ...] = attrs.field(default=GENERATION_APIS, init=False)
    _running: Dispatch | None = attrs.field(default=None, init=False)
    _dispatches: int = attrs.field(default=0, init=False)
    _busy_s: float = attrs.field(default=0.0, init=False)
    _cost_usd: float = attrs.field(default=0.0, init=False)
    _tokens: int = attrs.field(default=0, init=False)

    def refuse(self, request: InferenceRequest) -> Refusal | None:
        """413 ``exceeds_batch_capacity`` for a request that alone needs more than a batch's KV cache."""
        reason = exceeds_batch(request, self.model.gpu.kv_cap_tokens, "gpu.kv_cap_tokens")
        return None if reason is None else Refusal(413, "exceeds_batch_capacity", reason)

    def free(self) -> Capacity:
        if self._running is not None:
            return Capacity(sequences=0, kv_tokens=0)
        return Capacity(sequences=UNBOUNDED, kv_tokens=self.model.gpu.kv_cap_tokens, reserve_output=True)

    def models(self) -> list[str]:
        """The simulated model has no name of its own: requests may name ``apsd-batch``."""
        return [BATCH_MODEL_NAME]

    def cancel(self, request: InferenceRequest) -> bool:
        return False  # a batch runs as one: the request finishes with it (and is billed)

    def reconfigure(self, config: Config) -> list[str]:
        """Take ``[gpu]``'s model constants and fault injection, and ``engine.max_retries`` (from
        the next batch on); returns what changed."""
        old, new = self.model.gpu, config.gpu
        changes = []
        if any(getattr(new, k) != getattr(old, k) for k in FAULT_KEYS):
            changes.append("gpu fault injection: " + ", ".join(f"{k}={getattr(new, k)}" for k in FAULT_KEYS))
        if attrs.evolve(new, **{k: getattr(old, k) for k in FAULT_KEYS}) != old:
            changes.append("gpu model constants")
        if self.faults is not None:
            self.faults.configure(new)
        self.model = GpuModel(new)
        self.max_retries = config.engine.max_retries
        return changes

    def backend_statistics(self) -> None:
        return None   # (simulated: no server)

    def route_decisions(self) -> dict[tuple[str, str], int]:
        return {}

    async def count_message_tokens(self, model: str, body: dict[str, Any]) -> int | None:
        return None   # (apsd's estimate is this engine's count)

    def statistics(self) -> EngineStatistics:
        running = self._running
        return EngineStatistics(
            engine_id=self.engine_id, kind=self.kind, running=len(running.requests) if running else 0, waiting=0,
            kv_tokens_used=running.kv_tokens if running else 0, kv_tokens_capacity=self.model.gpu.kv_cap_tokens,
            busy_s=self._busy_s, cost_usd=self._cost_usd, dispatches=self._dispatches, tokens_generated=self._tokens,
            preemptions=0)

    async def serve(self, demands: trio.MemorySendChannel[Demand],
                    answers: trio.MemoryReceiveChannel[Dispatch]) -> None:
        """Ask for a batch, run it, repeat; ends when either channel closes."""
        async with demands, answers:
            while True:
                try:
                    demands.send_nowait(Demand(self))  # (one ask per engine: the channel has room)
                    batch = await answers.receive()
                except (trio.EndOfChannel, trio.BrokenResourceError):
                    return
                if batch.requests:
                    await self.run_batch(batch)

    async def run_batch(self, batch: Dispatch) -> None:
        prefill_s = self.model.prefill_s(batch)
        decode_s = self.model.decode_s(batch)
        busy_s = prefill_s + decode_s
        fails = self.faults is not None and self.faults.batch_fails()
        self._running = batch
        self._dispatches += 1
        self.ledger.batch_started(batch, self.engine_id)
        # The batch runs from the moment it was cut for this (idle) engine, and each step ends when
        # the model says, whatever the host's task-switch and wake-up latency: with
        # gpu.time_scale < 1 that latency would otherwise be magnified into model time.
        first_token = batch.formed_at + prefill_s
        end = first_token + decode_s
        try:
            await self.clock.sleep_until(first_token)
            if not fails:
                for request in batch.requests:
                    self.ledger.started(request, first_token)
                    request.tokens_generated = 1
                await self._decode(batch, first_token, end)
            await self.clock.sleep_until(end)
        finally:
            self._running = None
        cost = self.model.cost_usd(busy_s)
        self._busy_s += busy_s
        self._cost_usd += cost
        self.ledger.batch_ran(batch, self.engine_id, busy_s, cost)
        if fails:
            self._fail_batch(batch)
            return
        batch_tokens = sum(r.cost_tokens for r in batch.requests)
        for request in batch.requests:
            assert request.dispatched_at is not None and request.effective_priority is not None
            request.tokens_generated = request.tokens_requested
            request.cost_usd = cost * request.cost_tokens / batch_tokens if batch_tokens else 0.0
            self._tokens += request.tokens_generated
            if request.stream is not None:
                self._deliver(request, end)
            self.ledger.finish(request, completion(request, engine_id=self.engine_id, end=end), at=end)

    async def _decode(self, batch: Dispatch, start: float, end: float) -> None:
        """Deliver the first token to every stream, then the rest evenly until ``end``."""
        streaming = [r for r in batch.requests if r.stream is not None]
        for request in streaming:
            self._deliver(request, start)
        if not streaming or end <= start:
            return
        at = start
        while (at := min(end, at + STREAM_INTERVAL_S)) < end:
            await self.clock.sleep_until(at)
            share = (at - start) / (end - start)
            for request in streaming:
                request.tokens_generated = max(1, int(request.tokens_requested * share))
                self._deliver(request, at)

    @staticmethod
    def _deliver(request: InferenceRequest, at: float) -> None:
        """Push the tokens produced since the last delivery to ``request``'s stream."""
        stream = request.stream
        assert stream is not None
        stream.push_nowait(TokenChunk(tokens=request.tokens_generated - stream.tokens, at=at))

    def _fail_batch(self, batch: Dispatch) -> None:
        """Requeue (retries left) or answer 502 ``executor_failed`` every request of a failed batch."""
        log.warning("simulated GPU %d failed running batch %d (%d requests)",
                    self.engine_id, batch.dispatch_id, len(batch.requests))
        refusal = Refusal(502, "executor_failed",
                          f"simulated GPU {self.engine_id} failed running batch {batch.dispatch_id}",
                          kind="failed")
        for request in batch.requests:
            if request.retries < self.max_retries and self.requeue is not None and not request.answered:
                self.requeue(request, f"simulated GPU {self.engine_id} failed running batch {batch.dispatch_id}")
            else:
                self.ledger.finish(request, refusal)
