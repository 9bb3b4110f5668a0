"""The engine seam: what the scheduler and the pipeline expect of an engine.

An engine runs admitted requests. It pulls work sized to its free capacity: it sends a
:class:`Demand` on the pipeline's demand channel and the scheduler answers that engine, on
the engine's own answer channel (made by the pipeline, one per engine), with a :class:`~apsd.core.models.Dispatch` cut from the queue
to fit :meth:`Engine.free` as it is when the dispatch is cut. An empty dispatch means the
next request in queue order does not fit now: the engine asks again once its capacity grew.

Ownership: the pipeline builds the engines (:func:`apsd.engines.build_engines`) and starts
each one's :meth:`Engine.serve` in its stages' nursery, with a clone of the demand channel's
send end and the receive end of that engine's answer channel; ``serve`` closes both when it
returns. From the moment a request is dispatched to it, the engine owns it until it calls
:meth:`~apsd.core.ledger.Ledger.finish` (or :meth:`~apsd.core.ledger.Ledger.requeued` and hands it back to
the scheduler): it stamps the first token (:meth:`~apsd.core.ledger.Ledger.started`), updates
``tokens_generated`` and ``cost_usd``, and pushes tokens to ``request.stream`` if there is one.

Time: engines schedule in model time (:class:`~apsd.core.clock.ModelClock`) on absolute deadlines,
and stamp events with the model time the model gives them, so the host's wake-up latency is
never magnified into model time by ``gpu.time_scale``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import trio

from apsd.core.models import Completion

if TYPE_CHECKING:
    from apsd.core.config import Config
    from apsd.core.models import Capacity, Dispatch, InferenceRequest, Refusal

__all__ = ["BackendStatistics", "Demand", "Engine", "EngineStatistics", "UNBOUNDED", "completion"]

#: A capacity that never limits (the ``batch`` engine's sequence count).
UNBOUNDED = 2**62


@attrs.frozen
class Demand:
    """An engine asking for work; the scheduler answers it with one dispatch on the answer
    channel the pipeline made for that engine (``engine.engine_id``)."""

    engine: Engine


@attrs.frozen
class EngineStatistics:
    """One engine, as of now (model seconds and tokens)."""

    engine_id: int
    kind: str
    #: Sequences running now (a ``batch`` engine: the requests of the batch it runs).
    running: int
    #: Sequences it holds but cannot run now (preempted, waiting for KV cache).
    waiting: int
    kv_tokens_used: int
    kv_tokens_capacity: int
    #: Model seconds spent computing, and its cost.
    busy_s: float
    cost_usd: float
    dispatches: int
    tokens_generated: int
    preemptions: int
    #: Model FLOPs and bytes read over the busy time, as fractions of the hardware's peak (None: the
    #: engine has no hardware model, e.g. the ``batch`` engine).
    mfu: float | None = None
    mbu: float | None = None
    #: Prompt tokens of the requests that joined, and how many of them its prefix cache held (their
    #: prefill skipped).
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0


@attrs.frozen
class BackendStatistics:
    """One server an engine forwards to, as of now (``/metrics``, readiness)."""

    name: str
    url: str
    models: tuple[str, ...]
    healthy: bool
    saturated: bool
    in_flight: int
    max_concurrency: int
    requests: int
    failures: int
    retries: int
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    waiting: float | None
    kv_usage: float | None


@runtime_checkable
class Engine(Protocol):
    """Where dispatched requests run. See the module docstring for the protocol."""

    engine_id: int
    #: ``batch``, ``continuous``, ``forward``: the ``[engine] kind`` that built it.
    kind: str
    #: The APIs it runs (``request.api``): :data:`~apsd.core.models.GENERATION_APIS` at least.
    apis: tuple[str, ...]

    def refuse(self, request: InferenceRequest) -> Refusal | None:
        """The 413 answer for a request that could never run on this engine, else None."""

    def free(self) -> Capacity:
        """What it can take on now. Cheap and synchronous: the scheduler calls it when cutting."""

    async def serve(self, demands: trio.MemorySendChannel[Demand],
                    answers: trio.MemoryReceiveChannel[Dispatch]) -> None:
        """Ask for work, run it, repeat; until cancelled or a channel closes. Closes both ends."""

    def models(self) -> list[str]:
        """The model names it serves (OpenAI ``model``); a request naming another is not for it."""

    def cancel(self, request: InferenceRequest) -> bool:
        """Its client left ``request``, which this engine is running: stop it, free its slot and KV
        cache, and finish it as cancelled (billed for what ran), now or at the next step boundary.
        False if this engine cannot stop it (it then runs to its end)."""

    def statistics(self) -> EngineStatistics: ...

    def backend_statistics(self) -> tuple[BackendStatistics, ...] | None:
        """The servers it forwards to; None when it runs on none (a simulated engine: it is ready
        whenever the daemon accepts work)."""

    def route_decisions(self) -> dict[tuple[str, str], int]:
        """(backend, reason) -> requests its routing sent there for that reason (empty: it chooses none)."""

    async def count_message_tokens(self, model: str, body: dict[str, Any]) -> int | None:
        """An Anthropic Messages request's prompt tokens as the engine's server for ``model`` counts them
        (``/v1/messages/count_tokens``); None when it cannot say (apsd's estimate stands)."""

    def reconfigure(self, config: Config) -> list[str]:
        """Take a reloaded config's settings that can change while running; returns what changed
        that the pipeline does not report itself."""


def completion(request: InferenceRequest, *, engine_id: int, end: float, response: dict[str, Any] | None = None,
               response_bytes: bytes | None = None) -> Completion:
    """The :class:`~apsd.core.models.Completion` of a request its engine finished at model time ``end``,
    from the times stamped on it (dispatched, first token) and its progress (tokens, cost)."""
    assert request.dispatched_at is not None and request.started_at is not None
    n = request.tokens_generated
    decode = end - request.started_at
    return Completion(
        request_id=request.request_id, tenant_id=request.tenant_id, prompt_tokens=request.prompt_tokens,
        tokens_generated=n, queue_ms=(request.dispatched_at - request.arrival) * 1000.0,
        ttft_ms=(request.started_at - request.arrival) * 1000.0,
        tpot_ms=decode / (n - 1) * 1000.0 if n > 1 and decode > 0 else None,
        prefill_ms=(request.started_at - request.dispatched_at) * 1000.0, decode_ms=decode * 1000.0,
        latency_ms=(end - request.arrival) * 1000.0, batch_id=request.dispatch_id or 0,
        batch_size=request.dispatch_size, engine_id=engine_id, effective_priority=request.effective_priority or 0.0,
        cost_usd=request.cost_usd, response=response, response_bytes=response_bytes)
