"""The ``continuous`` engine: iteration-level batching on a roofline model, as vLLM and Sarathi do.

Sequences join and leave the running batch at every step boundary. Each step spends a token
budget (``[engine] max_batched_tokens``): one token for every decoding sequence, the rest on
prefill chunks of the sequences still reading their prompt, first come first served (chunked
prefill). A step lasts what :meth:`~apsd.engines.roofline.Deployment.step_s` says for that mix on
the deployment's GPU x model x tp. The step that consumes a prompt's last chunk produces the
sequence's first token; each later step produces one more; a sequence finishes when it has
its ``tokens_requested``.

KV cache: a sequence holds its prompt from the moment it joins and one more token per step
while decoding (``Capacity.need``: prompt + 1 to join). When the decoding sequences' next step
would not fit, the running sequence the queue policy ranks lowest (the scheduler's ``rank``:
the aging policy's effective priority; the latest arrival on a tie) is preempted: its cache is
freed and it waits in this engine, ahead of any new work (the engine asks for nothing while
one waits), to be recomputed: its prompt and the tokens it had generated are prefilled again,
then it continues. A request that could never fit (prompt + requested beyond the cache or the
model's context) is refused at admission.

Isolation (``[engine] isolation``, on by default): a tenant is *below its share* when it has
fewer sequences in this engine than ``max_sequences`` divided by the tenants there, itself
included (:meth:`ContinuousEngine.under_share`); with tenants' weights (``[tenants.<name>] weight``),
its weight's part of it (weight 4 beside a tenant of weight 1: four fifths). Three rules keep such a
tenant's first token close to what it would be alone, whatever the others send:

1. **It gets in.** When the engine is full (sequences or KV cache), it still takes a request of
   a tenant below its share: it preempts (recompute) the newest sequences of the tenant furthest
   above its share until the newcomer fits. The room this could free is offered to the
   scheduler as held room (``Capacity.held_sequences``, ``held_kv_tokens``), which only such
   requests may take, and the fair-share queues let them pass the head.
2. **Its prompt goes first.** Its prefill runs in a step of its own, before the decodes of the
   running batch (which wait that one step, never two in a row).
3. **Steps stay short.** The prompts of tenants at or above their share are prefilled in chunks
   of at most ``prefill_chunk_tokens`` per step (Sarathi-Serve's chunked prefill), so the step a
   newcomer arrives during is short too. By default the chunk is the smallest whose prefill is
   about as cheap per token as any (:func:`prefill_chunk_for`; 512 tokens for llama-3-8b on an
   A100): shorter steps at almost no cost in throughput. A prompt alone (nothing decoding, nothing
   else prefilling or waiting) is not chunked: there is no one to keep a step short for, and its
   first token comes as soon as the hardware allows (the published single-request figures).

While such a tenant comes back often (a fast step in the last ``PROTECT_S``), the others' steps
are kept within ``PROTECT_FACTOR`` times its fast step where a smaller chunk allows, so the step it
arrives during is about as short as its own prefill.

The guarantee (:func:`first_token_bound_s`): from its dispatch, the first token of a request of
the tenant with the smallest share below its share comes within the step in progress (at most
``S``, the longest step with prefill beside ``max_sequences - 1`` decodes reading the whole KV
cache, or another tenant's fast step), one step ``S`` if that was a fast step, and its own fast
step. Its queue wait is the scheduler's (the governor's window, under the fair-share queues, which
let it pass the head). The measured ratio to its time alone, over a grid of workloads, is in
``apsd.sim.isolation_grid`` and docs/explanation/fairness-and-admission.md. With
``isolation = false`` none of this applies: FCFS steps of up to ``max_batched_tokens``, and
preemption only when the KV cache runs out.

Service classes (:mod:`apsd.core.classes`): a request with a class carries a deadline
(``class_deadline``), and while it can still meet it (no first token yet, the deadline not passed) it
is *punctual*. The engine orders prompts by it, within the rules above:

* **Deadline order.** A step that is not a fast step prefills the punctual prompts first, the most
  urgent first (the tighter class, then the earlier deadline: :func:`apsd.core.classes.urgency`), then
  the others in the order above; a fast step takes a tenant's punctual prompts before its others.
  Without isolation the punctual prompts go first, then the others first come first served. A prompt
  whose deadline passed is no longer punctual: it goes behind those that can still be on time.
4. **A tight request takes a looser prompt's place** (isolation on, classes configured). A full engine
   also takes a classed request whose tenant has a prompt here of a looser class (or none) that has not
   started: that prompt goes back to the scheduler's queue (``requeue``, its place in queue order kept)
   and the classed request joins instead. A tenant only trades places with itself, so its share is
   unchanged; without this, a tight request would wait for a slot behind the seconds of work a
   256-sequence engine holds. Among a tenant's sequences, preemption takes prompts that have not started,
   least urgent first, before others.
* **Its wait, told to admission.** :meth:`ContinuousEngine.first_token_wait_s` is what a classed request
  dispatched now would wait for its first token: the step in progress, the punctual prompts of its
  class or tighter ones, and its own, at the prefill rate of the last steps. Admission's early refusal
  adds it to the wait in the queue.

Without classes configured nothing of this applies: the engine behaves exactly as without it.

Events, not tokens: a run of steps in which only decoding happens and nothing joins, finishes,
runs out of cache or is cancelled is computed in closed form
(:meth:`~apsd.engines.roofline.Deployment.decode_steps_s`) and slept over at once, so a
simulation's cost grows with arrivals, finishes and preemptions, not with tokens. A dispatch or
a cancellation arriving in the middle of such a run takes effect at the end of the step in
progress. Sequences with a token stream are woken every ``STREAM_INTERVAL_S`` model seconds
to receive their tokens.

Prefix cache (``[engine] prefix_cache``, on by default, as vLLM's automatic prefix caching): the
engine keeps the key blocks (:func:`apsd.core.routing.routing_key`, ``BLOCK_TOKENS`` tokens each, or a
trace's ``prefix_block_tokens``) of every prompt it has read, in an LRU of as many tokens as its KV
cache holds, a prompt's first block most recently used. A request joining whose key starts with cached blocks skips their prefill: its
sequence starts with that many tokens in its context (at most its prompt less one token: the last
is always computed) and ``request.cached_tokens`` says how many, for settlement at ``[admission]
cached_prompt_discount``. Its KV cache is still counted whole (blocks shared between sequences are
not deduplicated: the engine errs toward preempting early), and a preempted sequence recomputes its
whole prompt. Several engines: the routing policy decides which engine a request goes to
(:meth:`ContinuousEngine.target`, the scheduler's routing).

Costs: a step's cost (its seconds at the deployment's price) is shared by the tokens it
processed: each decoding sequence pays for one token, each prefill chunk for its tokens.
MFU and MBU are model FLOPs and bytes read over busy time, against the deployment's peaks.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

import attrs
import trio

from apsd.core.classes import urgency
from apsd.core.clock import ModelClock
from apsd.core.config import Config
from apsd.core.engine import Demand, EngineStatistics, completion
from apsd.core.ledger import Ledger
from apsd.core.models import GENERATION_APIS, Capacity, Dispatch, InferenceRequest, Refusal
from apsd.core.routing import Target, routing_key
from apsd.core.streams import TokenChunk
from apsd.engines.roofline import Deployment

__all__ = ["ContinuousEngine", "first_token_bound_s", "prefill_chunk_for", "tenant_weights"]

log = logging.getLogger("apsd.engines.continuous")

#: Model seconds between two deliveries of tokens to the streams of decoding sequences.
STREAM_INTERVAL_S = 0.05
#: Model seconds after a fast step during which the others' steps are kept as short as it (:meth:`ContinuousEngine._protect`).
PROTECT_S = 2.0
#: How much longer than the protected fast step the others' steps may be.
PROTECT_FACTOR = 2.5
#: A protected step's prefill chunk is a multiple of this many tokens ...
CHUNK_STEP = 16
#: ... and at least this many: the smallest prefill chunk of a protected step: the prefill of tenants above their share always advances.
MIN_CHUNK = 64
#: Steps with prefill over which the engine's prefill rate is measured (:meth:`ContinuousEngine.first_token_wait_s`).
RATE_STEPS = 64
#: A prefill chunk is as cheap per token as any when its prefill costs at most this much more per
#: token than the cheapest chunk's (:func:`prefill_chunk_for`).
CHUNK_TOLERANCE = 0.10


def first_token_bound_s(deployment: Deployment, max_sequences: int, max_batched_tokens: int, chunk: int,
                        prompt_tokens: int) -> float:
    """Model seconds from a dispatch to the first token of a request of ``prompt_tokens`` whose tenant
    is below its share and has the smallest share of those waiting in the fast lane, on an isolating
    engine: the step in progress (a step with prefill of tenants at or above their share, ``S``, or
    another tenant's fast step, ``F(max_batched_tokens)``), one step ``S`` if that was a fast step,
    then its own fast step (its prompt, and at most ``chunk`` tokens of others'). ``S`` is the
    longest step the engine takes beside ``max_sequences - 1`` decodes reading the whole KV cache."""
    d = deployment
    chunk = min(chunk, max_batched_tokens)
    longest = d.step_s([(chunk, d.context_limit)], max_sequences - 1, d.kv_capacity_tokens)
    fast = d.step_s([(min(max_batched_tokens, prompt_tokens + chunk), 0)], 0, 0)
    return max(longest, d.step_s([(max_batched_tokens, 0)], 0, 0)) + longest + fast


def prefill_chunk_for(deployment: Deployment, max_batched_tokens: int) -> int:
    """The default prefill chunk while isolating: the smallest power of two (64 or more, at most
    ``max_batched_tokens``) whose prefill, alone in a step, costs per token at most
    ``CHUNK_TOLERANCE`` more than the cheapest power of two's. Below it a step's fixed cost (reading
    the weights) shows; above it steps only get longer."""
    sizes = [1 << k for k in range(6, 31) if 1 << k <= max_batched_tokens] or [max_batched_tokens]
    per_token = {n: deployment.step_s([(n, 0)], 0, 0) / n for n in sizes}
    cheapest = min(per_token.values())
    return next(n for n in sizes if per_token[n] <= cheapest * (1 + CHUNK_TOLERANCE))


def tenant_weights(config: Config) -> dict[str, float]:
    """The configured tenants whose weight is not 1, and their weights."""
    return {name: tenant.weight for name, tenant in config.tenants.items() if tenant.weight != 1.0}


def _target_s(request: InferenceRequest) -> float:
    """A request's class's ``ttft_s`` (infinite without a class), to the millisecond (its deadline less
    its arrival is not exact in floating point: two requests of one class must compare equal)."""
    deadline = request.class_deadline
    return math.inf if deadline is None else round(deadline - request.arrival, 3)


@attrs.define(eq=False, slots=True)
class Sequence:
    """One request inside the engine. While it decodes, its live ``generated`` and ``context``
    are the stored values plus the engine's decode steps since ``step_base``."""

    request: InferenceRequest
    #: Tokens still to prefill (its prompt, or after a preemption its prompt and output so far).
    prompt_left: int
    #: Tokens in its KV cache (as of ``step_base`` while decoding).
    context: int = 0
    #: Output tokens produced (as of ``step_base`` while decoding).
    generated: int = 0
    step_base: int = 0
    cost_base: float = 0.0
    #: The engine's decode-step count at which it has all its tokens.
    finish_step: int = 0


@attrs.define(eq=False)
class ContinuousEngine:
    """One deployment (``tp`` GPUs) running continuous batching; see the module docstring."""

    engine_id: int
    deployment: Deployment
    ledger: Ledger
    clock: ModelClock
    #: The queue policy's ranking of a request now (higher: served sooner): who is preempted.
    rank: Callable[[InferenceRequest, float], float]
    max_sequences: int = 256
    max_batched_tokens: int = 8192
    #: Share-based admission, preemption and fast-lane prefill (the module docstring).
    isolation: bool = True
    #: Prefill tokens per step of tenants at or above their share while isolating (0: derived
    #: from the deployment, :func:`prefill_chunk_for`).
    prefill_chunk_tokens: int = 0
    price_per_hour_usd: float = 0.0
    #: Keep the blocks of prompts read, and skip their prefill when a prompt starts with them.
    prefix_cache: bool = False
    #: Service classes are configured: a classed request may displace a less urgent prompt of its own
    #: tenant that has not started (rule 4 of the module docstring).
    classes: bool = False
    #: Tenants whose weight (``[tenants.<name>] weight``) is not 1: their shares here are in proportion
    #: (the module docstring); empty: equal shares.
    weights: dict[str, float] = attrs.field(factory=dict)
    #: The scheduler's ``requeue``: where a displaced prompt goes back to (rule 4); None: preempted instead.
    requeue: Callable[[InferenceRequest, str], None] | None = None
    kind: str = attrs.field(default="continuous", init=False)
    apis: tuple[str, ...] = attrs.field(default=GENERATION_APIS, init=False)
    # -- state ---------------------------------------------------------------------------------
    #: Model time of the current step boundary (the engine's own schedule).
    t: float = attrs.field(default=0.0, init=False)
    _prefilling: collections.deque[Sequence] = attrs.field(factory=collections.deque, init=False)
    _decoding: dict[InferenceRequest, Sequence] = attrs.field(factory=dict, init=False)
    _finishes: list[tuple[int, int, Sequence]] = attrs.field(factory=list, init=False)
    _preempted: list[Sequence] = attrs.field(factory=list, init=False)
    #: Tenant -> its requests in this engine (dispatched here and not finished), for :meth:`under_share`.
    _per_tenant: collections.Counter[str] = attrs.field(factory=collections.Counter, init=False)
    #: The last step was a fast-lane prefill (the next one decodes, whatever waits).
    _fast_last: bool = attrs.field(default=False, init=False)
    #: :meth:`shares`, cached until the state it depends on changes.
    _shares: dict[str, float] = attrs.field(factory=dict, init=False)
    _shares_key: tuple[int, ...] | None = attrs.field(default=None, init=False)
    #: Bumped whenever a tenant's requests here change (for the cache of :meth:`shares`).
    _tenants_changed: int = attrs.field(default=0, init=False)
    #: While model time is before ``_protect_until``, steps with prefill of tenants at or above their
    #: share last at most ``_protect_step_s`` where they can (:meth:`_chunk`).
    _protect_until: float = attrs.field(default=-math.inf, init=False)
    _protect_step_s: float = attrs.field(default=math.inf, init=False)
    _streaming: set[Sequence] = attrs.field(factory=set, init=False)
    #: Model time of the last delivery of tokens to the streams of decoding sequences.
    _delivered_at: float = attrs.field(default=0.0, init=False)
    #: Decode steps taken so far (every decoding sequence advances one token per step).
    _step: int = attrs.field(default=0, init=False)
    #: Tokens in the KV caches of the decoding sequences, summed.
    _decode_context: int = attrs.field(default=0, init=False)
    _kv_used: int = attrs.field(default=0, init=False)
    #: USD one decoding sequence has paid per step, accumulated over every step so far.
    _cost_per_slot: float = attrs.field(default=0.0, init=False)
    _inbox: collections.deque[Dispatch] = attrs.field(factory=collections.deque, init=False)
    _aborts: set[InferenceRequest] = attrs.field(factory=set, init=False)
    _asked: bool = attrs.field(default=False, init=False)
    #: Bumped whenever capacity may have grown; an empty dispatch is not asked for again before.
    _version: int = attrs.field(default=0, init=False)
    _empty_at: int = attrs.field(default=-1, init=False)
    _demands: trio.MemorySendChannel[Demand] | None = attrs.field(default=None, init=False)
    _answers: trio.MemoryReceiveChannel[Dispatch] | None = attrs.field(default=None, init=False)
    #: The scope of the wait the engine is in (for an answer, or to the end of a run): a cancellation
    #: cancels it so the engine acts at once.
    _wait_scope: trio.CancelScope | None = attrs.field(default=None, init=False)
    _tiebreak: itertools.count[int] = attrs.field(factory=itertools.count, init=False)
    #: KV tokens kept free when admitting or resuming (set from the deployment).
    _watermark: int = attrs.field(default=0, init=False)
    # -- statistics ----------------------------------------------------------------------------
    _busy_s: float = attrs.field(default=0.0, init=False)
    _cost_usd: float = attrs.field(default=0.0, init=False)
    _flops: float = attrs.field(default=0.0, init=False)
    _bytes: float = attrs.field(default=0.0, init=False)
    _dispatches: int = attrs.field(default=0, init=False)
    _tokens: int = attrs.field(default=0, init=False)
    _preemptions: int = attrs.field(default=0, init=False)
    #: Prompts sent back to the queue to make room for more urgent ones (rule 4).
    _displaced: int = attrs.field(default=0, init=False)
    #: Model time the step (or run of decode steps) in progress ends; during a run of decode steps, its
    #: sequences and their context at its start (for :meth:`_step_left`).
    _step_end: float = attrs.field(default=0.0, init=False)
    _run_steps: tuple[int, int] | None = attrs.field(default=None, init=False)
    #: (prefill tokens, seconds) of the last ``RATE_STEPS`` steps with prefill (with classes only), for
    #: :meth:`first_token_wait_s`.
    _recent_prefill: collections.deque[tuple[int, float]] = attrs.field(
        factory=lambda: collections.deque(maxlen=RATE_STEPS), init=False)
    #: The prefix cache: key blocks, least recently used first, and the tokens each holds (and in all).
    _blocks: collections.OrderedDict[int, int] = attrs.field(factory=collections.OrderedDict, init=False)
    _block_tokens_held: int = attrs.field(default=0, init=False)
    _prompt_tokens: int = attrs.field(default=0, init=False)
    _cached_tokens: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        if not self.price_per_hour_usd:
            self.price_per_hour_usd = self.deployment.price_per_hour_usd
        self.t = self.clock.now()
        self._watermark = self.deployment.kv_capacity_tokens // 100
        if not self.prefill_chunk_tokens:
            self.prefill_chunk_tokens = prefill_chunk_for(self.deployment, self.max_batched_tokens)

    # -- the seam --------------------------------------------------------------------------------
    def refuse(self, request: InferenceRequest) -> Refusal | None:
        """413 for a request that could never fit: beyond the model's context or the KV cache."""
        d = self.deployment
        total = request.cost_tokens
        if total > d.context_limit:
            return Refusal(413, "exceeds_context_length",
                           f"request needs {total} tokens of context (prompt {request.prompt_tokens} + requested "
                           f"{request.tokens_requested}) but {d.model.name} serves at most {d.context_limit}")
        if total > d.kv_capacity_tokens:
            return Refusal(413, "exceeds_kv_capacity",
                           f"request needs {total} KV tokens (prompt {request.prompt_tokens} + requested "
                           f"{request.tokens_requested}) but {d.model.name} on {d.tp} x {d.gpu.name} holds "
                           f"{d.kv_capacity_tokens}")
        return None

    def free(self) -> Capacity:
        """Room for new sequences: none while a preempted one waits; KV cache beyond a watermark
        (1% of it, as vLLM keeps) and the next step's growth of the decoding sequences. While
        isolating, the room preempting tenants above their share would free is held for the others."""
        inbox = sum(len(d.requests) for d in self._inbox)
        running = len(self._prefilling) + len(self._decoding) + inbox
        kv = self._spare_kv() - self._inbox_kv()
        slots = self.max_sequences - running
        if not self.isolation:
            if self._preempted:
                return Capacity(sequences=0, kv_tokens=0, reserve_output=False)
            return Capacity(sequences=max(0, slots), kv_tokens=max(0, kv), reserve_output=False)
        held_sequences, held_kv = self._preemptible()
        swap_sequences, swap_kv = self._swappable()
        held_sequences, held_kv = held_sequences + swap_sequences, held_kv + swap_kv
        held_sequences += min(0, slots)  # (dispatched requests not yet joined may have taken some already)
        held_kv += min(0, kv)
        slots, kv = max(0, slots), max(0, kv)
        if self._preempted:  # what was preempted comes back first, after tenants below their share
            held_sequences, held_kv, slots, kv = held_sequences + slots, held_kv + kv, 0, 0
        return Capacity(sequences=slots, kv_tokens=kv, reserve_output=False, held_sequences=max(0, held_sequences),
                        held_kv_tokens=max(0, held_kv), under_share=self.may_use_held)

    def under_share(self, request: InferenceRequest) -> bool:
        """Whether ``request``'s tenant is below its share here (:meth:`shares`)."""
        return self._below_share(request.tenant_id)

    def may_use_held(self, request: InferenceRequest) -> bool:
        """Whether ``request`` may take the held room of a full engine: its tenant is below its share,
        or it is a classed request that can still meet its deadline and its tenant has a less urgent
        prompt here that has not started (which it displaces: rule 4 of the module docstring)."""
        if self._below_share(request.tenant_id):
            return True
        deadline = request.class_deadline
        return (self.classes and deadline is not None and self.clock.now() <= deadline
                and self._displaceable(request) is not None)

    def first_token_wait_s(self, request: InferenceRequest, target_s: float) -> float:
        """Model seconds from now to the first token of ``request``, of a class whose ``ttft_s`` is
        ``target_s``, if it joined now: the rest of the step in progress, then the prompts this engine
        prefills before its own (the punctual classed prompts of its class or a tighter one, those
        dispatched here included) and its own prompt (less what the prefix cache holds), at the prefill
        rate of the engine's last ``RATE_STEPS`` steps with prefill (before any: a chunk beside the
        decodes running now). Admission's early refusal of a class's requests adds it to their wait in
        the queue (:meth:`apsd.core.classes.ServiceClasses.refuse_unmeetable`)."""
        mine = round(target_s, 3)
        ahead = sum(seq.prompt_left for seq in self._prefilling if self._punctual(seq)
                    and _target_s(seq.request) <= mine)
        ahead += sum(r.prompt_tokens for d in self._inbox for r in d.requests
                     if r.class_deadline is not None and _target_s(r) <= mine and not r.answered)
        ahead += max(1, request.prompt_tokens - self._cached_prefix(request, touch=False))
        tokens = sum(n for n, _ in self._recent_prefill)
        seconds = sum(s for _, s in self._recent_prefill)
        if not tokens or not seconds:
            chunk = self.prefill_chunk_tokens if self.isolation else self.max_batched_tokens
            tokens, seconds = chunk, self.deployment.step_s([(chunk, 0)], len(self._decoding), self._decode_context)
        return self._step_left() + ahead * seconds / tokens

    def _step_left(self) -> float:
        """Model seconds until the step in progress ends (a run of decode steps takes in what was
        dispatched at the end of its step in progress)."""
        now = self.clock.now()
        if self._run_steps is None:
            return max(0.0, self._step_end - now)
        n, context = self._run_steps
        d = self.deployment
        done = d.decode_steps_within(n, context, max(0.0, now - self.t))
        return max(0.0, self.t + d.decode_steps_s(n, context, done + 1) - now)

    def _displaceable(self, request: InferenceRequest) -> Sequence | None:
        """The prompt of ``request``'s tenant here that ``request`` (a classed request) would displace:
        one that has not started, unclassed or of a looser class (a longer ``ttft_s``); the least urgent
        (:meth:`_displace_key`). None: there is none. (Never one of its own class: that would only
        trade places inside a class, over and over.)"""
        mine = _target_s(request)
        candidates = [seq for seq in self._prefilling
                      if seq.request.tenant_id == request.tenant_id and seq.request.started_at is None
                      and _target_s(seq.request) > mine]
        return max(candidates, key=self._displace_key, default=None)

    def _displace_key(self, seq: Sequence) -> tuple[int, float, int]:
        """Which not-started prompt to displace first (the largest): not punctual, then least urgent, then newest."""
        if self._punctual(seq):
            return (0, urgency(seq.request), seq.request.seq)
        return (1, 0.0, seq.request.seq)

    def _swappable(self) -> tuple[int, int]:
        """Room classed requests could take by displacing less urgent prompts of their own tenants that
        have not started (rule 4): those prompts, and their KV tokens (none without classed requests)."""
        if not self.classes:
            return 0, 0
        waiting = [seq for seq in self._prefilling if seq.request.started_at is None]
        return len(waiting), sum(seq.context + seq.prompt_left for seq in waiting)

    def shares(self) -> dict[str, float]:
        """Tenant -> its dominant share of this engine: the larger of its fraction of ``max_sequences``
        (its requests here, dispatched, running or preempted) and of the usable KV cache (the tokens
        its sequences hold), over its weight. A tenant is below its share while this times the tenants'
        weights here, summed (itself included; without weights: the number of tenants), is under 1,
        above it while over 1."""
        key = (self._step, self._version, self._kv_used, self._tenants_changed, len(self._prefilling), self._preemptions)
        if key == self._shares_key:
            return self._shares
        kv: collections.Counter[str] = collections.Counter()
        for seq in self._prefilling:
            kv[seq.request.tenant_id] += seq.context + seq.prompt_left
        for seq in self._decoding.values():
            kv[seq.request.tenant_id] += seq.context + self._step - seq.step_base
        for dispatch in self._inbox:
            for request in dispatch.requests:
                kv[request.tenant_id] += request.prompt_tokens + 1
        usable = self.deployment.kv_capacity_tokens - self._watermark
        weights = self.weights
        self._shares = {tenant: max(n / self.max_sequences, kv[tenant] / usable) / weights.get(tenant, 1.0)
                        for tenant, n in self._per_tenant.items()} if weights else \
            {tenant: max(n / self.max_sequences, kv[tenant] / usable) for tenant, n in self._per_tenant.items()}
        self._shares_key = key
        return self._shares

    def _weight_of(self, tenants: dict[str, float]) -> float:
        """The weights of ``tenants`` (the keys of :meth:`shares`) summed: their count when no tenant has
        a weight other than 1."""
        if not self.weights:
            return len(tenants)
        return sum(self.weights.get(t, 1.0) for t in tenants)

    def _below_share(self, tenant: str) -> bool:
        shares = self.shares()
        here = self._weight_of(shares) + (self.weights.get(tenant, 1.0) if tenant not in shares else 0)
        return shares.get(tenant, 0.0) * here < 1.0

    def _over_share(self, tenant: str) -> bool:
        shares = self.shares()
        return shares[tenant] * self._weight_of(shares) > 1.0

    def _protect(self, fast_step_s: float, end: float) -> None:
        """A fast step of ``fast_step_s`` ends at ``end``: for ``PROTECT_S`` after it, the others' steps
        are kept within ``PROTECT_FACTOR`` times the shortest such step (so a tenant below its share that
        comes back finds a step in progress not much longer than its own prefill)."""
        target = PROTECT_FACTOR * fast_step_s
        self._protect_step_s = target if self.t >= self._protect_until else min(self._protect_step_s, target)
        self._protect_until = end + PROTECT_S

    def _chunk(self, decoding: int, decode_context: int) -> int:
        """The prefill tokens of a step beside ``decoding`` decodes: ``prefill_chunk_tokens``; while
        protecting, the most (a multiple of ``CHUNK_STEP``, at least ``MIN_CHUNK``) whose step lasts no
        longer than the protected target (the step's duration grows with its chunk: a bisection)."""
        chunk = self.prefill_chunk_tokens
        if self.t >= self._protect_until:
            return chunk
        d, target = self.deployment, self._protect_step_s
        if chunk <= MIN_CHUNK or d.step_s([(chunk, 0)], decoding, decode_context) <= target:
            return max(chunk, MIN_CHUNK)
        low, high = MIN_CHUNK // CHUNK_STEP, chunk // CHUNK_STEP  # step(low) <= target or low is the floor
        while high - low > 1:
            middle = (low + high) // 2
            if d.step_s([(middle * CHUNK_STEP, 0)], decoding, decode_context) <= target:
                low = middle
            else:
                high = middle
        return low * CHUNK_STEP

    def _fast(self, seq: Sequence) -> bool:
        """Whether ``seq``'s prompt takes the fast lane: its tenant is below its share and another
        tenant here has a larger share."""
        shares, tenant = self.shares(), seq.request.tenant_id
        mine = shares[tenant]
        return mine * self._weight_of(shares) < 1.0 and any(share > mine for share in shares.values())

    def _preemptible(self) -> tuple[int, int]:
        """What preempting tenants above their share (counting one more tenant: a newcomer) could free for
        a tenant below its share: their sequences and KV tokens beyond that share."""
        shares = self.shares()
        tenants = self._weight_of(shares) + 1
        over = [t for t, share in shares.items() if share * tenants > 1.0]
        if not over:
            return 0, 0
        usable = self.deployment.kv_capacity_tokens - self._watermark
        if not self.weights:  # (then the weights' sum is the count of tenants: an int)
            count = len(shares) + 1
            sequences = sum(max(0, self._per_tenant[t] - self.max_sequences // count) for t in over)
            kv = sum(max(0, round(shares[t] * usable) - usable // count) for t in over)
            return sequences, kv
        weight = self.weights.get
        sequences = sum(max(0, self._per_tenant[t] - math.floor(self.max_sequences * weight(t, 1.0) / tenants))
                        for t in over)
        kv = sum(max(0, round(shares[t] * weight(t, 1.0) * usable) - math.floor(usable * weight(t, 1.0) / tenants))
                 for t in over)
        return sequences, kv

    def first_token_bound_s(self, prompt_tokens: int) -> float:
        """The guarantee, in model seconds from its dispatch, for a request of ``prompt_tokens`` whose
        tenant is below its share and has the smallest share of those waiting in the fast lane
        (:func:`first_token_bound_s`)."""
        return first_token_bound_s(self.deployment, self.max_sequences, self.max_batched_tokens,
                                   self.prefill_chunk_tokens, prompt_tokens)

    def _spare_kv(self) -> int:
        """KV tokens that can be given to a sequence joining or resuming now."""
        return self.deployment.kv_capacity_tokens - self._watermark - self._kv_used - len(self._decoding)

    def _inbox_kv(self) -> int:
        return sum(r.prompt_tokens + 1 for d in self._inbox for r in d.requests) if self._inbox else 0

    def models(self) -> list[str]:
        return [self.deployment.model.name]

    def cancel(self, request: InferenceRequest) -> bool:
        self._aborts.add(request)
        if self._wait_scope is not None:
            self._wait_scope.cancel()
        return True

    def reconfigure(self, config: Config) -> list[str]:
        """Take the tenants' new weights; the deployment and its limits need a restart (Pipeline.reconfigure
        says so)."""
        self.weights = tenant_weights(config)
        self._shares_key = None
        return []

    def backend_statistics(self) -> None:
        return None   # (simulated: no server)

    def route_decisions(self) -> dict[tuple[str, str], int]:
        return {}

    async def count_message_tokens(self, model: str, body: dict[str, Any]) -> int | None:
        return None   # (apsd's estimate is this engine's count)

    def statistics(self) -> EngineStatistics:
        d = self.deployment
        return EngineStatistics(
            engine_id=self.engine_id, kind=self.kind, running=len(self._prefilling) + len(self._decoding),
            waiting=len(self._preempted), kv_tokens_used=self._kv_used, kv_tokens_capacity=d.kv_capacity_tokens,
            busy_s=self._busy_s, cost_usd=self._cost_usd, dispatches=self._dispatches, tokens_generated=self._tokens,
            preemptions=self._preemptions, mfu=d.mfu(self._flops, self._busy_s), mbu=d.mbu(self._bytes, self._busy_s),
            prompt_tokens=self._prompt_tokens, cached_prompt_tokens=self._cached_tokens)

    def target(self, request: InferenceRequest) -> Target:
        """This engine as a routing policy sees it for ``request``: its sequences (running, preempted and
        dispatched), ``max_sequences``, whether ``request`` fits now, and its KV cache's size."""
        inbox = sum(len(d.requests) for d in self._inbox)
        load = len(self._prefilling) + len(self._decoding) + len(self._preempted) + inbox
        return Target(name=f"engine-{self.engine_id}", load=load, capacity=self.max_sequences,
                      room=self.free().fits(request), cache_tokens=self.deployment.kv_capacity_tokens)

    # -- the prefix cache ------------------------------------------------------------------------
    def _cached_prefix(self, request: InferenceRequest, touch: bool = True) -> int:
        """Tokens of ``request``'s prompt its first cached blocks hold (``touch``: marked used now)."""
        if not self.prefix_cache:
            return 0
        blocks = self._blocks
        key = routing_key(request)
        n = 0
        for block in key:
            if block not in blocks:
                break
            n += 1
        if touch:
            for block in reversed(key[:n]):
                blocks.move_to_end(block)
        return max(0, min(n * request.prefix_block_tokens, request.prompt_tokens - 1))

    def _remember_prompt(self, request: InferenceRequest) -> None:
        """``request``'s prompt was read: keep its blocks (its first most recently used), evicting the
        least recently used beyond what the KV cache holds."""
        if not self.prefix_cache:
            return
        blocks = self._blocks
        size = request.prefix_block_tokens
        for block in reversed(routing_key(request)[:request.prompt_tokens // size]):
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = size
                self._block_tokens_held += size
        capacity = self.deployment.kv_capacity_tokens
        while self._block_tokens_held > capacity:
            self._block_tokens_held -= blocks.popitem(last=False)[1]

    # -- the loop --------------------------------------------------------------------------------
    async def serve(self, demands: trio.MemorySendChannel[Demand],
                    answers: trio.MemoryReceiveChannel[Dispatch]) -> None:
        """Ask for work whenever there is room, run steps, repeat; until cancelled or a channel closes.

        One task: it receives its answers itself, waiting for one while idle or during a run of
        decode steps, and taking any that arrived during a step at the step's end.
        """
        async with demands, answers:
            self._demands, self._answers = demands, answers
            try:
                await self._run()
            except (trio.EndOfChannel, trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    def _on_answer(self, dispatch: Dispatch) -> None:
        self._asked = False
        self._tenants_changed += 1
        if dispatch.requests:
            self._inbox.append(dispatch)
            self._per_tenant.update(r.tenant_id for r in dispatch.requests)
            self._ask()  # keep an ask outstanding: the next arrival is dispatched at once
        else:
            self._empty_at = self._version

    def _take_answers(self) -> None:
        """Take the answers that arrived while the engine was stepping."""
        assert self._answers is not None
        while True:
            try:
                dispatch = self._answers.receive_nowait()
            except trio.WouldBlock:
                return
            self._on_answer(dispatch)

    async def _step_until(self, end: float) -> None:
        """Let model time reach ``end`` (a step's end), taking answers that arrive meanwhile (they join
        at ``end``; the engine asks again at once, so the next arrival is dispatched at once too)."""
        deadline = self.clock.deadline(end)
        while not self.clock.reached(end):
            await self._wait_for_answer(deadline)

    async def _wait_for_answer(self, deadline: float) -> bool:
        """Wait for an answer until the trio ``deadline`` (or a cancellation); whether one came."""
        assert self._answers is not None
        with trio.CancelScope(deadline=deadline) as scope:
            self._wait_scope = scope
            try:
                dispatch = await self._answers.receive()
            finally:
                self._wait_scope = None
            self._on_answer(dispatch)
            return True
        return False

    def ask_again(self) -> None:
        """The queue's head changed since this engine was answered with an empty dispatch: ask now
        (the new head may fit the headroom), without waiting for capacity to grow."""
        self._empty_at = -1
        self._ask()

    def _ask(self) -> None:
        """Ask for work if there is none asked for and room for some (never blocks: each engine has at
        most one ask outstanding, and the demand channel holds one per engine)."""
        if self._asked or self._empty_at == self._version or self._demands is None:
            return   # (None: not serving yet; it asks once it starts)
        free = self.free()
        if (free.sequences > 0 and free.kv_tokens > 0) or (free.held_sequences > 0 and free.held_kv_tokens > 0):
            self._asked = True
            self._demands.send_nowait(Demand(self))

    def _running(self) -> bool:
        return bool(self._prefilling or self._decoding or self._preempted)

    async def _run(self) -> None:
        while True:
            self._take_answers()
            self._boundary()
            headroom = self.deployment.kv_capacity_tokens - self._kv_used
            if len(self._decoding) > headroom:  # the next step's tokens would not fit: make room
                self._preempt(len(self._decoding) - headroom)
                continue
            self._ask()
            if not self._running() and not self._inbox and not self._aborts:
                await self._wait_for_answer(math.inf)
                self.t = max(self.t, self.clock.now())  # idle until now
                continue
            if not self._running():
                continue
            if self._prefilling:
                await self._mixed_step()
            else:
                await self._decode_run()

    def _boundary(self) -> None:
        """At a step boundary: cancel what must be, take in what was dispatched, resume what fits."""
        if self._aborts:
            for request in list(self._aborts):
                self._abort(request)
            self._aborts.clear()
        joined: list[InferenceRequest] = []
        while self._inbox:
            dispatch = self._inbox.popleft()
            self._dispatches += 1
            for request in dispatch.requests:
                if request.answered:
                    self._leave_tenant(request)
                    continue
                joined.append(request)
                if request.stream is not None and request.stream.abandoned:
                    self._aborts.add(request)
                cached = self._cached_prefix(request)
                request.cached_tokens = cached
                self._prompt_tokens += request.prompt_tokens
                self._cached_tokens += cached
                seq = Sequence(request, prompt_left=request.prompt_tokens - cached, context=cached)
                self._kv_used += request.prompt_tokens
                self._prefilling.append(seq)
                if request.stream is not None:
                    self._streaming.add(seq)
            if self._aborts:
                self._boundary()
        if self.isolation:
            if self.classes and self.requeue is not None and joined:
                self._swap(joined)
            self._make_room()
        if self._preempted:
            self._resume()

    def _resume(self) -> None:
        """Move preempted sequences whose recomputation fits back to prefilling, highest rank first."""
        self._preempted.sort(key=lambda s: (not self._punctual(s), -self.rank(s.request, self.t), s.request.seq))
        while (self._preempted and self._preempted[0].prompt_left + 1 <= self._spare_kv()
               and len(self._prefilling) + len(self._decoding) < self.max_sequences):
            seq = self._preempted.pop(0)
            self._kv_used += seq.prompt_left
            self._prefilling.appendleft(seq)
            self._version += 1

    # -- one step with prefill ---------------------------------------------------------------------
    async def _mixed_step(self) -> None:
        """One step: the decodes and prefill chunks (while isolating and something else runs or waits, at
        most ``prefill_chunk_tokens`` of them: a prompt alone is prefilled whole, as far as the budget
        allows; the prompts of the tenants with the smallest shares here first); or the fast lane:
        the prompts of tenants below their share alone, the decodes waiting one (short) step; never
        two such steps in a row."""
        d = self.deployment
        prefilling, fast = self._prefill_order()
        self._fast_last = fast
        decoding = 0 if fast else len(self._decoding)
        decode_context = 0 if fast else self._decode_context
        budget = self.max_batched_tokens - decoding
        if fast:  # the first prompt whole, then the other fast ones up to a chunk
            budget = min(budget, max(self.prefill_chunk_tokens, prefilling[0].prompt_left))
        elif self.isolation and (decoding or len(prefilling) > 1 or self._preempted):
            budget = min(budget, self._chunk(decoding, decode_context))   # (a prompt alone is not chunked)
        chunks: list[tuple[Sequence, int]] = []
        for seq in prefilling:
            if budget <= 0 or (fast and not self._fast(seq)):
                break
            chunk = min(seq.prompt_left, budget)
            chunks.append((seq, chunk))
            budget -= chunk
        pairs = [(chunk, seq.context) for seq, chunk in chunks]
        duration = d.step_s(pairs, decoding, decode_context)
        end = self.t + duration
        if fast:
            self._protect(duration, end)
        self._step_end = end
        prefilled = sum(chunk for _, chunk in chunks)
        if self.classes:
            self._recent_prefill.append((prefilled, duration))
        await self._step_until(end)
        tokens = decoding + sum(chunk for _, chunk in chunks)
        cost = duration * self.price_per_hour_usd / 3600.0
        self._account(duration, cost, d.flops(pairs, decoding, decode_context),
                      d.bytes_moved(pairs, decoding, decode_context))
        per_token = cost / tokens if tokens else 0.0
        if decoding:
            self._advance(1, per_token)
        self.t = end
        if decoding and self.t - self._delivered_at >= STREAM_INTERVAL_S:
            self._deliver_decoded()
        for seq, chunk in chunks:
            seq.request.cost_usd += chunk * per_token
            seq.context += chunk
            seq.prompt_left -= chunk
            if not seq.prompt_left:
                self._prefilling.remove(seq)
                self._first_token_after_prefill(seq)
        self._finish_due()

    def _prefill_order(self) -> tuple[list[Sequence] | collections.deque[Sequence], bool]:
        """The prompts to prefill, in the order the next step takes them, and whether it is a fast step.

        While isolating: the tenants with the smallest shares first; the step is a fast one when the
        first is below its share (:meth:`_fast`). Service classes (the module docstring): inside a
        fast step a tenant's punctual classed prompts go first (most urgent first), and in any other
        step every punctual classed prompt goes first, most urgent first (:func:`urgency`), then the
        rest in the order above. Without classed prompts the order is exactly the classless one."""
        prefilling = self._prefilling
        classed = any(s.request.class_deadline is not None for s in prefilling)
        if not self.isolation:
            if not classed:
                return prefilling, False
            place = {seq: n for n, seq in enumerate(prefilling)}  # (FCFS, what was preempted first)
            return sorted(prefilling, key=lambda s: self._deadline_key(s) if self._punctual(s) else
                          (1, 0.0, place[s])), False
        shares = self.shares()
        if not classed:
            ordered = sorted(prefilling, key=lambda s: (shares[s.request.tenant_id], s.request.seq))
            return ordered, not self._fast_last and self._fast(ordered[0])
        ordered = sorted(prefilling, key=lambda s: (shares[s.request.tenant_id], self._deadline_key(s)))
        if not self._fast_last and self._fast(ordered[0]):
            return ordered, True
        return sorted(ordered, key=lambda s: self._deadline_key(s) if self._punctual(s) else
                      (1, shares[s.request.tenant_id], s.request.seq)), False

    def _punctual(self, seq: Sequence) -> bool:
        """Whether ``seq``'s request has a class deadline it can still meet (it has not passed)."""
        deadline = seq.request.class_deadline
        return deadline is not None and seq.request.started_at is None and self.t <= deadline

    def _deadline_key(self, seq: Sequence) -> tuple[int, float, int]:
        """Punctual classed requests first, most urgent first; then the others by admission order."""
        if self._punctual(seq):
            return (0, urgency(seq.request), seq.request.seq)
        return (1, 0.0, seq.request.seq)

    def _first_token_after_prefill(self, seq: Sequence) -> None:
        """The step that read ``seq``'s last prompt chunk produced its next token."""
        seq.generated += 1
        request = seq.request
        request.tokens_generated = seq.generated
        if seq.generated == 1:
            self._remember_prompt(request)
        self._tokens += 1
        if request.started_at is None:
            self.ledger.started(request, self.t)
        if seq in self._streaming:
            self._deliver(seq)
        if seq.generated >= request.tokens_requested:
            self._complete(seq)
            return
        seq.step_base, seq.cost_base = self._step, self._cost_per_slot
        seq.finish_step = self._step + request.tokens_requested - seq.generated
        self._decoding[request] = seq
        self._decode_context += seq.context
        heapq.heappush(self._finishes, (seq.finish_step, next(self._tiebreak), seq))

    # -- runs of decode steps ------------------------------------------------------------------------
    async def _decode_run(self) -> None:
        d = self.deployment
        self._fast_last = False
        self._finish_due()  # (aborts and preemptions may have left stale finishes on top)
        n = len(self._decoding)
        if not n:
            return
        headroom = self.deployment.kv_capacity_tokens - self._kv_used
        steps = min(self._finishes[0][0] - self._step, headroom // n)
        if self._streaming:
            steps = max(1, min(steps, d.decode_steps_within(n, self._decode_context, STREAM_INTERVAL_S)))
        end = self.t + d.decode_steps_s(n, self._decode_context, steps)
        self._step_end, self._run_steps = end, (n, self._decode_context)
        await self._wait_for_answer(self.clock.deadline(end))
        self._run_steps = None
        if not self.clock.reached(end):  # woken early: finish the step in progress, then take it in
            done = d.decode_steps_within(n, self._decode_context, self.clock.now() - self.t)
            steps = min(steps, done + 1)
            end = self.t + d.decode_steps_s(n, self._decode_context, steps)
            await self._step_until(end)
        duration = end - self.t
        context_read = steps * self._decode_context + n * steps * (steps - 1) // 2
        cost = duration * self.price_per_hour_usd / 3600.0
        self._account(duration, cost, d.flops((), n * steps, context_read),
                      steps * d.model.weight_bytes + context_read * d.kv_bytes_per_token)
        self._advance(steps, cost / (n * steps))
        self.t = end
        self._deliver_decoded()
        self._finish_due()

    def _deliver_decoded(self) -> None:
        """Give the streams of decoding sequences their new tokens (at most every ``STREAM_INTERVAL_S``
        while steps carry prefill; a run of decode steps is cut at that interval already)."""
        if not self._streaming:
            return
        self._delivered_at = self.t
        for seq in self._streaming:
            if seq.request in self._decoding:
                self._sync(seq)
                self._deliver(seq)

    def _advance(self, steps: int, cost_per_token: float) -> None:
        """Every decoding sequence takes ``steps`` more steps, paying ``cost_per_token`` each."""
        n = len(self._decoding)
        self._step += steps
        self._decode_context += n * steps
        self._kv_used += n * steps
        self._cost_per_slot += cost_per_token * steps
        self._tokens += n * steps

    def _account(self, duration: float, cost: float, flops: float, bytes_read: float) -> None:
        self._busy_s += duration
        self._cost_usd += cost
        self._flops += flops
        self._bytes += bytes_read
        self.ledger.engine_ran(duration, cost)

    def _sync(self, seq: Sequence) -> None:
        """Bring a decoding sequence's stored progress up to the current step."""
        delta = self._step - seq.step_base
        if delta:
            seq.generated += delta
            seq.context += delta
            seq.request.cost_usd += self._cost_per_slot - seq.cost_base
            seq.step_base, seq.cost_base = self._step, self._cost_per_slot
        seq.request.tokens_generated = seq.generated

    def _finish_due(self) -> None:
        """Complete the decoding sequences that have all their tokens; drop stale heap entries
        (sequences that left decoding, or re-entered it after a preemption with a new finish)."""
        finishes = self._finishes
        while finishes:
            finish_step, _, seq = finishes[0]
            live = self._decoding.get(seq.request) is seq and seq.finish_step == finish_step
            if live and finish_step > self._step:
                return
            heapq.heappop(finishes)
            if live:
                self._leave_decoding(seq)
                self._complete(seq)

    def _leave_decoding(self, seq: Sequence) -> None:
        self._sync(seq)
        del self._decoding[seq.request]
        self._decode_context -= seq.context

    # -- endings ----------------------------------------------------------------------------------
    def _complete(self, seq: Sequence) -> None:
        if seq in self._streaming:  # (its last tokens: a mixed step delivers none to decoding sequences)
            self._deliver(seq)
        self._release(seq)
        request = seq.request
        self.ledger.finish(request, completion(request, engine_id=self.engine_id, end=self.t), at=self.t)

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s KV cache and slot (it has left every running structure)."""
        self._kv_used -= seq.context + seq.prompt_left
        self._streaming.discard(seq)
        self._leave_tenant(seq.request)
        self._version += 1

    def _leave_tenant(self, request: InferenceRequest) -> None:
        self._tenants_changed += 1
        per_tenant = self._per_tenant
        per_tenant[request.tenant_id] -= 1
        if not per_tenant[request.tenant_id]:
            del per_tenant[request.tenant_id]

    def _abort(self, request: InferenceRequest) -> None:
        """Its client left: stop it now (a step boundary), free its slot and cache, bill what ran."""
        seq = self._decoding.get(request)
        if seq is not None:
            self._leave_decoding(seq)
            self._release(seq)
        elif (seq := next((s for s in self._prefilling if s.request is request), None)) is not None:
            self._prefilling.remove(seq)
            self._release(seq)
        elif (seq := next((s for s in self._preempted if s.request is request), None)) is not None:
            self._preempted.remove(seq)  # (it holds no cache)
            self._streaming.discard(seq)
            self._leave_tenant(request)
            self._version += 1
        else:
            return  # finished already, or never reached this engine
        self.ledger.finish(request, Refusal(499, "client_disconnected",
                                            "the client disconnected while the request was running",
                                            kind="cancelled"), at=self.t)

    def _make_room(self) -> None:
        """While isolating: requests of tenants below their share joined a full engine; preempt the
        newest sequences of the tenants furthest above their share until everything fits."""
        over_slots = len(self._prefilling) + len(self._decoding) - self.max_sequences
        over_kv = self._kv_used + len(self._decoding) - (self.deployment.kv_capacity_tokens - self._watermark)
        while (over_slots > 0 or over_kv > 0) and (victim := self._victim(over_share_only=True)) is not None:
            over_kv -= self._preempt_one(victim)
            over_slots -= 1

    def _over_capacity(self) -> tuple[int, int]:
        """Sequences beyond ``max_sequences``, and KV tokens beyond the usable cache (positive: too many)."""
        return (len(self._prefilling) + len(self._decoding) - self.max_sequences,
                self._kv_used + len(self._decoding) - (self.deployment.kv_capacity_tokens - self._watermark))

    def _swap(self, joined: list[InferenceRequest]) -> None:
        """Rule 4: classed requests that just joined a full engine, their tenants above their share (they
        came in by displacing), each send a looser prompt of their own tenant that has not started back
        to the queue (:meth:`_displaceable`), most urgent joiner first, while the engine is over capacity."""
        over_slots, over_kv = self._over_capacity()
        for request in sorted((r for r in joined if r.class_deadline is not None), key=urgency):
            if over_slots <= 0 and over_kv <= 0:
                return
            if not self._over_share(request.tenant_id) or (victim := self._displaceable(request)) is None:
                continue
            over_kv -= self._displace(victim)
            over_slots -= 1

    def _displace(self, seq: Sequence) -> int:
        """Send a prompt that has not started back to the scheduler's queue (rule 4), in its old place;
        the KV tokens this frees."""
        freed = seq.context + seq.prompt_left
        self._prefilling.remove(seq)
        self._release(seq)
        self._displaced += 1
        self._prompt_tokens -= seq.request.prompt_tokens   # (it joins again later, and is counted then)
        self._cached_tokens -= seq.request.cached_tokens
        seq.request.cached_tokens = 0
        assert self.requeue is not None
        self.requeue(seq.request, f"engine {self.engine_id} gave its place to a more urgent request")
        return freed

    def _victim(self, over_share_only: bool = False) -> Sequence | None:
        """The running sequence to preempt: while isolating tenants from each other, the newest of the
        tenant furthest above its share; else (or if none is above it) the one the queue policy ranks
        lowest, the newest on a tie."""
        running = (*self._decoding.values(), *self._prefilling)
        if self.isolation and len(self._per_tenant) > 1:
            over = [seq for seq in running if self._over_share(seq.request.tenant_id)]
            if over:
                shares = self.shares()
                if not self.classes:
                    return max(over, key=lambda s: (shares[s.request.tenant_id], s.request.seq))
                return max(over, key=lambda s: (shares[s.request.tenant_id], self._victim_rank(s)))
        if over_share_only:
            return None
        return min(running, key=lambda s: (self._punctual(s), self.rank(s.request, self.t), -s.request.seq),
                   default=None)

    def _victim_rank(self, seq: Sequence) -> tuple[int, int, float, int]:
        """With service classes, which sequence of a tenant to preempt first (the largest): a prompt
        that has not started (least urgent first, :meth:`_displace_key`), else the newest."""
        if seq.request.started_at is None:
            return (1, *self._displace_key(seq))
        return (0, 0, 0.0, seq.request.seq)

    def _preempt(self, tokens: int) -> None:
        """Free at least ``tokens`` KV tokens by preempting running sequences (:meth:`_victim`)."""
        while tokens > 0 and (victim := self._victim()) is not None:
            tokens -= self._preempt_one(victim)

    def _preempt_one(self, victim: Sequence) -> int:
        """Preempt ``victim`` (recompute); the KV tokens this frees."""
        if victim.request in self._decoding:
            self._leave_decoding(victim)
            freed = victim.context
            # recompute: everything it had, the pending token included, is prefilled again
            victim.prompt_left, victim.context = victim.request.prompt_tokens + victim.generated, 0
        else:
            self._prefilling.remove(victim)
            freed = victim.context + victim.prompt_left
            victim.prompt_left += victim.context
            victim.context = 0
        self._kv_used -= freed
        self._preempted.append(victim)
        self._preemptions += 1
        log.debug("engine %d preempted %s (%d KV tokens)", self.engine_id, victim.request.request_id, freed)
        return freed

    def _deliver(self, seq: Sequence) -> None:
        stream = seq.request.stream
        assert stream is not None
        stream.push_nowait(TokenChunk(tokens=seq.generated - stream.tokens, at=self.t))
