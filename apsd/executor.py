"""Executor stage: a simulated GPU that runs batches (the seed's A100 model).

Ownership: each :class:`SimulatedExecutor` owns a clone of the demand channel's
send end and of the batch channel's receive end. It answers every request of a
batch it received through the ledger (exactly once), records busy time and cost.

The model (all constants in ``[gpu]``): prefill at ``prefill_tokens_per_s``
over the batch's prompt tokens, then decode of the batch's requested tokens at
``decode_tokens_per_s * (decode_batch_base + decode_batch_sqrt * sqrt(b))``
tokens/s for a batch of ``b`` requests. Every request of a batch finishes when
the batch does. The batch's cost, ``busy seconds * price_per_hour / 3600``, is
split between its requests in proportion to their tokens (prompt + generated).

Faults (``[gpu] fail_probability``, ``fail_every_n_batches``, ``fault_seed``):
the pipeline owns one :class:`FaultInjector` that its executors share; it
decides, as each batch starts, whether the batch will fail. A failing batch
still takes its full busy time (the GPU worked, then failed) and is booked like
any other (``Ledger.batch_ran``: busy time, cost, ``batch_finished``), but
every request in it is answered 502 ``executor_failed`` (``kind="failed"``,
tokens refunded, nothing billed to the tenant) instead of completing. It is
not retried: a client may send it again. The executor then asks for the next
batch as usual, so the daemon keeps serving. The cost of a failed batch is the
operator's: it is in ``cost_usd`` overall, but in no tenant's.
"""

from __future__ import annotations

import logging
import math
import random

import attrs
import trio

from .clock import ModelClock
from .config import GpuConfig
from .ledger import Ledger
from .models import Batch, Completion, Refusal

__all__ = ["FaultInjector", "GpuModel", "SimulatedExecutor"]

log = logging.getLogger("apsd.executor")


@attrs.frozen
class GpuModel:
    """Pure timing and cost arithmetic of the simulated GPU."""

    gpu: GpuConfig

    def decode_tokens_per_s(self, batch_size: int) -> float:
        g = self.gpu
        return g.decode_tokens_per_s * (g.decode_batch_base + g.decode_batch_sqrt * math.sqrt(batch_size))

    def prefill_s(self, batch: Batch) -> float:
        return sum(r.prompt_tokens for r in batch.requests) / self.gpu.prefill_tokens_per_s

    def decode_s(self, batch: Batch) -> float:
        return sum(r.tokens_requested for r in batch.requests) / self.decode_tokens_per_s(len(batch.requests))

    def cost_usd(self, busy_s: float) -> float:
        return busy_s * self.gpu.price_per_hour_usd / 3600.0


@attrs.define(eq=False)
class FaultInjector:
    """Which batches fail; one per pipeline, shared by its executors (the pipeline owns it).

    Batches are counted in the order they start, across all executors; the n-th fails if
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
class SimulatedExecutor:
    executor_id: int
    model: GpuModel
    ledger: Ledger
    clock: ModelClock
    #: Shared with the pipeline's other executors; None: this executor never fails.
    faults: FaultInjector | None = None

    async def serve_executor(
        self,
        demand: trio.MemorySendChannel[int],
        batches: trio.MemoryReceiveChannel[Batch],
    ) -> None:
        """Ask for a batch, run it, repeat; ends when either channel closes."""
        async with demand, batches:
            while True:
                try:
                    await demand.send(self.executor_id)
                    batch = await batches.receive()
                except (trio.EndOfChannel, trio.BrokenResourceError):
                    return
                await self.run_batch(batch)

    async def run_batch(self, batch: Batch) -> None:
        prefill_s = self.model.prefill_s(batch)
        decode_s = self.model.decode_s(batch)
        busy_s = prefill_s + decode_s
        fails = self.faults is not None and self.faults.batch_fails()
        self.ledger.batch_started(batch, self.executor_id)
        # The batch runs from the moment it was cut for this (idle) executor and ends when the model
        # says, whatever the host's task-switch and wake-up latency: with gpu.time_scale < 1 that
        # latency would otherwise be magnified into model time.
        end = batch.formed_at + busy_s
        await self.clock.sleep_until(end)
        cost = self.model.cost_usd(busy_s)
        self.ledger.batch_ran(batch, self.executor_id, busy_s, cost)
        if fails:
            self._fail_batch(batch)
            return
        batch_tokens = sum(r.cost_tokens for r in batch.requests)
        for request in batch.requests:
            assert request.dispatched_at is not None and request.effective_priority is not None
            self.ledger.finish(request, Completion(
                request_id=request.request_id,
                tenant_id=request.tenant_id,
                prompt_tokens=request.prompt_tokens,
                tokens_generated=request.tokens_requested,
                queue_ms=(request.dispatched_at - request.arrival) * 1000.0,
                prefill_ms=prefill_s * 1000.0,
                decode_ms=decode_s * 1000.0,
                latency_ms=(end - request.arrival) * 1000.0,
                batch_id=batch.batch_id,
                batch_size=len(batch.requests),
                effective_priority=request.effective_priority,
                cost_usd=cost * request.cost_tokens / batch_tokens if batch_tokens else 0.0,
            ))

    def _fail_batch(self, batch: Batch) -> None:
        """Answer every request of a failed batch 502 ``executor_failed`` (the ledger refunds them)."""
        log.warning("simulated GPU %d failed running batch %d (%d requests)",
                    self.executor_id, batch.batch_id, len(batch.requests))
        refusal = Refusal(502, "executor_failed",
                          f"simulated GPU {self.executor_id} failed running batch {batch.batch_id}",
                          kind="failed")
        for request in batch.requests:
            self.ledger.finish(request, refusal)
