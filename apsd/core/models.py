"""Values that travel through the pipeline.

Ownership: the HTTP layer (or the simulator) creates an :class:`InferenceRequest`
with an empty :class:`ReplySlot` and waits on it; exactly one stage later
resolves the slot with a :class:`Completion` or a :class:`Refusal`, always
through the ledger so the books balance: :meth:`apsd.core.ledger.Ledger.finish` for an
admitted request, :meth:`apsd.core.ledger.Ledger.refuse_unadmitted` for one refused
before admission.

A request's life (each step is the ledger's to count and announce)::

    admitted -> queued -> dispatched to an engine -> started (first token) -> finished
                  ^                 |                      |
                  +---- requeued ---+   (its engine failed before the first token, or preempted it)
                  +---- paused ----------------------------+   (preempted after it: resumed later)

While it runs, its engine updates its progress fields (``tokens_generated``,
``started_at``, ``cost_usd``) and, if a reader attached a
:class:`~apsd.core.streams.TokenStream`, delivers tokens to it as they are produced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import attrs
import trio

if TYPE_CHECKING:
    from apsd.core.streams import TokenStream
    from apsd.core.tracing import RequestTrace

__all__ = ["ALL_APIS", "Batch", "Capacity", "Completion", "Dispatch", "GENERATION_APIS", "InferenceRequest",
           "OPENAI_APIS", "Outcome", "Refusal", "ReplySlot", "exceeds_batch"]


@attrs.frozen
class Completion:
    """A request that ran to its end; the fields of a 200 answer to ``POST /infer``.

    Durations are in model milliseconds (see ``gpu.time_scale``): ``queue_ms`` from admission
    to dispatch, ``ttft_ms`` from admission to the first token, ``prefill_ms`` from dispatch
    to the first token, ``decode_ms`` from the first token to the last, ``latency_ms`` from
    admission to the last token (``queue_ms + prefill_ms + decode_ms``), ``tpot_ms`` the mean
    time per output token after the first (None with a single token). ``batch_id`` and
    ``batch_size`` name the dispatch the request left the queue in (for the ``batch`` engine,
    the batch it ran in).
    """

    request_id: str
    tenant_id: str
    prompt_tokens: int
    tokens_generated: int
    queue_ms: float
    ttft_ms: float
    tpot_ms: float | None
    prefill_ms: float
    decode_ms: float
    latency_ms: float
    batch_id: int
    batch_size: int
    engine_id: int
    effective_priority: float
    cost_usd: float
    #: The backend's own JSON answer (a forwarded request that did not stream), usage included;
    #: None for the simulated engines.
    response: dict[str, Any] | None = None
    #: ``response`` as the backend sent it (relayed byte for byte); None when there is none.
    response_bytes: bytes | None = None


#: How a refused request is counted in the ledger.
RefusalKind = Literal["rejected", "failed", "cancelled"]


@attrs.frozen
class Refusal:
    """A request that did not (or will not) run to its end: an HTTP error answer.

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
    nothing, so a late engine result can never overwrite a shutdown answer.
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


#: Names under which inference servers read a request's output limit besides OpenAI's
#: ``max_tokens``/``max_completion_tokens`` (llama.cpp's ``n_predict``, which takes precedence over
#: ``max_tokens`` there; TGI's and SGLang's ``max_new_tokens``). A client may use any of them; apsd
#: reserves the limit and sends it under every name the client used.
LENGTH_ALIASES = ("n_predict", "max_new_tokens")

#: The APIs (``request.api``) that generate text: every engine runs them (the simulated engines'
#: answers are built in each API's shape by its HTTP blueprint). ``messages`` is Anthropic's Messages API.
GENERATION_APIS = ("chat.completions", "completions", "messages")
#: The OpenAI APIs apsd schedules (each a ``POST /v1/<api>`` of the OpenAI blueprint).
OPENAI_APIS = ("chat.completions", "completions", "embeddings", "responses")
#: Every API apsd schedules; engines that relay to real servers run them all (embeddings generate
#: nothing and are charged on their input; responses and messages are charged on their usage).
ALL_APIS = (*OPENAI_APIS, "messages")


@attrs.define(eq=False)
class InferenceRequest:
    """One request and its progress; identity matters, so no value equality.

    ``arrival`` and ``seq`` are stamped by admission (model seconds, and a
    strictly increasing admission number used to break ties); the scheduler
    stamps ``dispatched_at``, ``effective_priority`` and ``engine_id`` when it
    dispatches it. ``timeout_s`` is the client's own queue timeout (None: the
    config's); the scheduler stamps ``deadline`` when it queues the request (see
    :meth:`apsd.core.scheduler.Scheduler.enqueue`). The progress fields below are its
    engine's to update.
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
    #: Where a reader receives its tokens as they are produced (None: nobody streams them).
    stream: TokenStream | None = attrs.field(default=None, repr=False)
    #: The model asked for (OpenAI ``model``; None: ``POST /infer``, any engine's model).
    model: str | None = None
    #: The API it came through: ``"chat.completions"``, ``"completions"``, ``"embeddings"``, ``"responses"``
    #: or Anthropic's ``"messages"`` (None: ``/infer``).
    api: str | None = None
    #: The client's request body (OpenAI's or Anthropic's), which a forwarding engine relays (parameters
    #: apsd does not interpret pass through untouched).
    payload: dict[str, Any] | None = attrs.field(default=None, repr=False)
    #: The client set no output limit: ``tokens_requested`` is only admission's estimate
    #: (``[gateway] default_max_tokens``), and a forwarding engine sends no limit: the backend
    #: generates until it stops, and the tenant is charged what it generated (its bucket may go
    #: into debt, which it repays before its next request is admitted).
    open_ended: bool = False
    #: Tokens admission took from the tenant's bucket for it (its reservation: the prompt estimate and
    #: the output it will probably generate, :mod:`apsd.core.reservation`); settlement gives back, or
    #: takes, the difference with what it used.
    reserved_tokens: int = 0
    #: Of ``reserved_tokens``, the output part (at most ``tokens_requested``).
    reserved_output: int = 0
    #: The issued API key it came with (its id: ``/admin``), whose limits and usage it counts under;
    #: None: a key from the config file, or none.
    key_id: str | None = None
    #: Tokens admission took from its key's own bucket (0: the key has none).
    key_reserved: int = 0
    #: What admission reserved of each budget it is held to: (account, unit, amount) triples
    #: (:mod:`apsd.core.budget`; amounts in tokens or micro-dollars); settlement settles each.
    budget_holds: tuple[tuple[str, str, int], ...] = ()
    #: What it cost its tenant in US dollars at the ``[prices]`` of its model (the ledger sets it when it
    #: ends), and whether its model had no price (then 0).
    spend_usd: float = 0.0
    unpriced: bool = False
    #: ``max_concurrency`` (:mod:`apsd.core.concurrency`): it counts as in flight for its tenant and key
    #: (entered the queue), or it waits in its tenant's line for a turn.
    in_flight: bool = False
    waiting_in_line: bool = False
    # -- progress (the engine's) -----------------------------------------------------------
    #: The engine it was dispatched to (the last one, after a requeue).
    engine_id: int | None = None
    #: The backend a forwarding engine sent it to (the last one; None: a simulated engine).
    backend: str | None = None
    #: The dispatch it left the queue in, and how many requests that dispatch held.
    dispatch_id: int | None = None
    dispatch_size: int = 0
    #: Model time of its first token (None: not started).
    started_at: float | None = None
    #: Model time it got its outcome (the ledger stamps it; None: not yet).
    finished_at: float | None = None
    #: Output tokens produced so far.
    tokens_generated: int = 0
    #: Its engine took its prompt in though no token came (a forwarded request whose client left after
    #: it was sent: the backend prefilled it), so it is charged its prompt as if it had started.
    prompt_charged: bool = False
    #: Its share of its engine's cost so far, in USD.
    cost_usd: float = 0.0
    #: Times it went back to the queue because its engine failed before its first token.
    retries: int = 0
    #: Times its engine preempted it for a tenant below its share (back to the queue before its first
    #: token, or paused after it and resumed later).
    preemptions: int = 0
    # -- routing and the prefix cache ----------------------------------------------------------
    #: Its routing key: chained hashes of its prompt's blocks (:func:`apsd.core.routing.routing_key`;
    #: None: not computed yet; a simulated request may come with its own).
    prefix_blocks: tuple[int, ...] | None = attrs.field(default=None, repr=False)
    #: Tokens per block of ``prefix_blocks`` (``apsd.core.routing.BLOCK_TOKENS``, 64, but for a trace's
    #: blocks, which may be larger: Mooncake's are 512).
    prefix_block_tokens: int = attrs.field(default=64, repr=False)
    #: Where the routing policy sent it and why (``X-Apsd-Route``), e.g. ``"b1; reason=cache_match"``.
    route: str | None = None
    #: Prompt tokens its engine found in its prefix cache (a backend's ``cached_tokens``).
    cached_tokens: int = 0
    #: The share of a cached prompt token's charge its tenant is spared (``[admission]
    #: cached_prompt_discount``).
    cached_discount: float = 0.0
    # -- service class (apsd.core.classes) -----------------------------------------------------
    #: The service class it names (``X-Apsd-Class`` or ``service_class``; admission puts its tenant's
    #: ``default_class`` there when it names none; None: no class).
    service_class: str | None = None
    #: Model time its first token is due (``arrival`` + its class's ``ttft_s``; admission stamps it;
    #: None: no class). The ``fair`` queue orders classed requests by it.
    class_deadline: float | None = None
    #: Its class's ``on_miss`` is ``best_effort``: once late it is still served, behind requests that
    #: can still meet their deadlines.
    class_best_effort: bool = False
    #: Its trace (:mod:`apsd.core.tracing`); None: not traced (tracing is off, or not sampled).
    trace: RequestTrace | None = attrs.field(default=None, repr=False)

    @property
    def answered(self) -> bool:
        """Whether the request already has its terminal outcome (a queue may still hold it)."""
        return self.reply.outcome is not None

    @property
    def cost_tokens(self) -> int:
        """The most it can use: prompt + requested tokens (what a batch's KV cache holds for it, and what
        ``[queue] max_tokens`` counts). Its bucket reserves less: ``reserved_tokens``."""
        return self.prompt_tokens + self.tokens_requested

    @property
    def prompt_used(self) -> bool:
        """Whether its prompt counts as used: it started, or its engine took the prompt in
        (``prompt_charged``)."""
        return self.started_at is not None or self.prompt_charged

    @property
    def used_tokens(self) -> int:
        """The tokens it used so far: its prompt once it started or its engine took it in (its cached
        tokens at ``cached_discount``), and its output."""
        if not self.prompt_used:
            return self.tokens_generated
        spared = int(self.cached_tokens * self.cached_discount) if self.cached_tokens else 0
        return self.prompt_tokens - spared + self.tokens_generated


@attrs.frozen
class Capacity:
    """What an engine can take on now: how many more sequences, how many more KV tokens.

    ``reserve_output``: a request joining needs KV for its prompt and its whole requested
    output (the batch engine: a batch holds everything it will generate), or only for its prompt and
    first token, its cache growing as it decodes (``continuous``: a sequence that then runs
    out of KV is preempted).
    """

    sequences: int
    kv_tokens: int
    reserve_output: bool = True
    #: Free slots per model name (the ``forward`` engine: its usable backends' free slots for each
    #: model they serve); None: one pool for every model. A request naming a model with no slot
    #: left does not fit; one naming no model (``POST /infer``) fits any slot.
    slots_per_model: dict[str, int] | None = None
    #: Room only requests of tenants below their share may take (``under_share`` says which): the
    #: sequences and KV cache an engine would free by preempting tenants above their share (a
    #: ``continuous`` engine's sequences, a ``forward`` engine's backends' slots; with service classes
    #: also by sending a looser request of a classed request's own tenant back). None: no such room.
    held_sequences: int = 0
    held_kv_tokens: int = 0
    under_share: Callable[[InferenceRequest], bool] | None = None
    #: Of ``held_sequences``, those of the backends serving each model (the ``forward`` engine, beside
    #: ``slots_per_model``); None: one pool for every model.
    held_per_model: dict[str, int] | None = None
    #: Requests the free room should go to before the queue's head (the ``forward`` engine: tenants below
    #: their share of the slots, which would otherwise take a slot back by preemption); None: queue order.
    prefer: Callable[[InferenceRequest], bool] | None = None
    #: Whether the routing policy lets this engine take ``request`` once it took ``taken`` others in the
    #: same dispatch (several engines: it may be meant for another one with room); None: any request.
    route: Callable[[InferenceRequest, int], bool] | None = None

    def need(self, request: InferenceRequest) -> int:
        """KV tokens ``request`` needs to join."""
        if self.reserve_output:
            return request.cost_tokens
        return request.prompt_tokens + request.tokens_generated + 1

    def admits(self, request: InferenceRequest, taken: int = 0, kv_taken: int = 0) -> bool:
        """Whether ``request`` fits once ``taken`` sequences and ``kv_taken`` KV tokens went to
        others: in the free room, or (its tenant below its share) in the held room too."""
        need = kv_taken + self.need(request)
        if not (self.sequences - taken > 0 and need <= self.kv_tokens) and not (
                self.under_share is not None and self.sequences + self.held_sequences - taken > 0
                and need <= self.kv_tokens + self.held_kv_tokens and self.under_share(request)):
            return False
        return self.route is None or self.route(request, taken)

    def fits(self, request: InferenceRequest) -> bool:
        """Whether ``request`` alone fits what is free."""
        return self.admits(request) and self.model_room(request, {}, {}) is not None

    def model_room(self, request: InferenceRequest, slots_taken: dict[str, int],
                   held_taken: dict[str, int]) -> str | None:
        """Where ``request`` fits among its model's slots once ``slots_taken`` free ones and ``held_taken``
        held ones went to others (by model): ``"free"``, ``"held"`` (its tenant below its share), or None.
        ``"free"`` for a request naming no model, or with no slots per model."""
        slots, model = self.slots_per_model, request.model
        if slots is None or model is None:
            return "free"
        if slots.get(model, 0) - slots_taken.get(model, 0) > 0:
            return "free"
        held = self.held_per_model
        if held is not None and held.get(model, 0) - held_taken.get(model, 0) > 0 and \
                self.under_share is not None and self.under_share(request):
            return "held"
        return None


def exceeds_batch(request: InferenceRequest, cap_tokens: int, setting: str) -> str | None:
    """Why ``request`` could never run in a batch whose KV cache holds ``cap_tokens`` (its prompt and
    requested tokens, reserved whole), naming the config key ``setting``; None when it fits.
    The one rule behind the batch engine's and the ``micro`` batching policy's 413s."""
    if request.cost_tokens <= cap_tokens:
        return None
    return (f"request needs {request.cost_tokens} KV tokens (prompt {request.prompt_tokens} + requested "
            f"{request.tokens_requested}) but a batch holds at most {cap_tokens} ({setting})")


@attrs.frozen
class Dispatch:
    """Requests the scheduler hands to one engine at once, in queue order.

    For the ``batch`` engine a dispatch is a batch that runs as one; a ``continuous`` engine
    adds its requests to the sequences it is already running.
    """

    dispatch_id: int
    requests: tuple[InferenceRequest, ...]
    formed_at: float
    window_s: float
    engine_id: int

    @property
    def batch_id(self) -> int:
        """The dispatch's id (its name in 0.1, when every dispatch was a batch)."""
        return self.dispatch_id

    @property
    def kv_tokens(self) -> int:
        return sum(r.cost_tokens for r in self.requests)


#: The name of :class:`Dispatch` in apsd 0.1 (every dispatch was a micro-batch), kept for plugins.
Batch = Dispatch
