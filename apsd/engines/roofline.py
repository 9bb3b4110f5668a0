"""The roofline model: how long one iteration of a continuous-batching engine takes.

Pure and synchronous: functions of numbers, no trio, no I/O, no clock. A :class:`Deployment`
(a GPU profile × a model profile × a tensor-parallel degree) is validated once when it is
built and precomputes its coefficients, so :meth:`Deployment.step_s`, which the ``continuous``
engine calls once per simulated iteration, is a handful of float operations.

The model and the reasoning behind each term are in docs/explanation/engines.md ("The roofline model");
the published figures it is checked against are in the same file ("Validation").

Units, everywhere: seconds, tokens, bytes, FLOPs. Every figure of a :class:`Deployment` is for
the whole deployment (all ``tp`` GPUs together) unless its name says ``per_gpu``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from apsd.engines.profiles import GIB, GpuProfile, ModelProfile, ProfileError

__all__ = [
    "DEFAULT_CHUNK_BUDGET",
    "DEFAULT_MEMORY_FRACTION",
    "TP_DEGREES",
    "Deployment",
    "DeploymentError",
    "StaticBatchEstimate",
    "estimate_static_batch",
]

#: The tensor-parallel degrees a deployment may use.
TP_DEGREES: tuple[int, ...] = (1, 2, 4, 8)
#: Share of GPU memory the engine takes for weights + KV cache (vLLM's gpu_memory_utilization).
DEFAULT_MEMORY_FRACTION = 0.9
#: Prefill tokens per step (vLLM's max_num_batched_tokens with chunked prefill).
DEFAULT_CHUNK_BUDGET = 8192
#: Bytes of one activation value exchanged by the tensor-parallel all-reduces (bf16).
ACTIVATION_BYTES = 2


class DeploymentError(ProfileError):
    """A GPU × model × tp combination that cannot run; ``str()`` says why and what would."""


def _dtype(bytes_per_param: float) -> str:
    return "bf16" if bytes_per_param == 2 else f"{bytes_per_param:g}-byte"


@attrs.frozen
class Deployment:
    """One model served on ``tp`` GPUs of one kind, with tensor parallelism.

    Build it with :meth:`build` (the constructor validates the same way). Derived figures are
    attributes computed once:

    ``kv_bytes_per_token``
        KV cache of one token across the deployment:
        ``2 · layers · max(kv_heads, tp) · head_dim · kv_bytes_per_value`` (K and V; when
        ``tp`` exceeds the KV heads each GPU keeps a copy of one head, as vLLM does).
    ``context_limit``
        ``max_context``, resolved: the longest sequence served (the model's when none was given).
    ``kv_capacity_tokens``
        ``floor((memory_fraction · memory · tp − weights) / kv_bytes_per_token)``: memory is
        per GPU, weights are ``params · bytes_per_param``; activations and CUDA graphs are
        not subtracted (vLLM profiles them; they take well under 1 GiB for these models).
    ``price_per_hour_usd``
        ``tp ·`` the GPU's hourly price.
    ``kv_read_s_per_token``
        Seconds per step for each token of context a decoding sequence attends over:
        ``kv_bytes_per_token / (hbm · kv_read_efficiency · tp)``.
    ``weight_stream_s``, ``compute_s_per_token``
        The two roofline terms of :meth:`linear_s`.

    Raises :class:`DeploymentError` if ``tp`` is not one of :data:`TP_DEGREES` or does not
    split the heads, if ``max_context`` exceeds the model's, or if the weights plus one
    ``max_context`` sequence of KV cache do not fit in ``memory_fraction`` of the memory.
    """

    gpu: GpuProfile
    model: ModelProfile
    tp: int = 1
    memory_fraction: float = DEFAULT_MEMORY_FRACTION
    #: Longest sequence (prompt + output) this deployment serves; ``None``: the model's.
    max_context: int | None = None

    context_limit: int = attrs.field(init=False, eq=False)
    kv_bytes_per_token: float = attrs.field(init=False, eq=False)
    kv_capacity_tokens: int = attrs.field(init=False, eq=False)
    price_per_hour_usd: float = attrs.field(init=False, eq=False)
    kv_read_s_per_token: float = attrs.field(init=False, eq=False)
    weight_stream_s: float = attrs.field(init=False, eq=False)
    compute_s_per_token: float = attrs.field(init=False, eq=False)
    # Private coefficients (see the properties and methods that use them).
    _fixed_s: float = attrs.field(init=False, eq=False, repr=False)
    _comm_s_per_token: float = attrs.field(init=False, eq=False, repr=False)
    _attention_flops_per_pair: float = attrs.field(init=False, eq=False, repr=False)
    _attention_s_per_pair: float = attrs.field(init=False, eq=False, repr=False)
    _peak_flops: float = attrs.field(init=False, eq=False, repr=False)
    _peak_bytes: float = attrs.field(init=False, eq=False, repr=False)

    @classmethod
    def build(cls, gpu: GpuProfile, model: ModelProfile, tp: int = 1, *,
              memory_fraction: float = DEFAULT_MEMORY_FRACTION, max_context: int | None = None) -> Deployment:
        """Validate and build; :class:`DeploymentError` names the problem and, where one exists, a fix."""
        return cls(gpu, model, tp, memory_fraction, max_context)

    def __attrs_post_init__(self) -> None:
        gpu, model, tp = self.gpu, self.model, self.tp
        where = f"{model.name} on {tp} × {gpu.name}"
        if not isinstance(tp, int) or isinstance(tp, bool) or tp not in TP_DEGREES:
            raise DeploymentError(f"{model.name} on {gpu.name}: tp must be one of "
                                  f"{', '.join(map(str, TP_DEGREES))}, got {tp!r}")
        if not (isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1):
            raise DeploymentError(f"{where}: memory_fraction must be in (0, 1], got {self.memory_fraction!r}")
        if model.heads % tp:
            raise DeploymentError(f"{where}: tp={tp} does not divide the model's {model.heads} attention heads")
        if model.kv_heads % tp and tp % model.kv_heads:
            raise DeploymentError(f"{where}: tp={tp} neither divides the model's {model.kv_heads} KV heads "
                                  "nor is a multiple of them")
        max_context = model.max_context if self.max_context is None else self.max_context
        if not isinstance(max_context, int) or not 1 <= max_context <= model.max_context:
            raise DeploymentError(f"{where}: max_context must be an integer in 1..{model.max_context} "
                                  f"(the model's), got {self.max_context!r}")

        def put(name: str, value: object) -> None:  # the class is frozen; derived fields are set once, here
            object.__setattr__(self, name, value)

        put("max_context", max_context)
        put("context_limit", max_context)

        kv_replicas = max(1, tp // model.kv_heads)
        kv_bytes_per_token = model.kv_bytes_per_token * kv_replicas
        usable = self.memory_fraction * gpu.memory_bytes * tp
        weights = model.weight_bytes
        capacity = math.floor((usable - weights) / kv_bytes_per_token)
        if capacity < max_context:
            needed = weights + kv_bytes_per_token * max_context
            raise DeploymentError(
                f"{model.name} does not fit on {tp} × {gpu.name}: it needs {needed / GIB:.1f} GiB "
                f"({weights / GIB:.1f} GiB of {_dtype(model.bytes_per_param)} weights + "
                f"{kv_bytes_per_token * max_context / GIB:.1f} GiB of KV cache for one {max_context:,}-token "
                f"sequence), but {self.memory_fraction:.0%} of {tp} × {gpu.memory_gib:g} GiB is "
                f"{usable / GIB:.1f} GiB; {self._suggestion(max_context)}")

        peak = gpu.bf16_tflops * 1e12
        hbm = gpu.hbm_gb_s * 1e9
        put("kv_bytes_per_token", kv_bytes_per_token)
        put("kv_capacity_tokens", capacity)
        put("price_per_hour_usd", gpu.price_per_hour_usd * tp)
        put("kv_read_s_per_token", kv_bytes_per_token / (hbm * gpu.kv_read_efficiency * tp))
        put("weight_stream_s", weights / (hbm * gpu.mbu * tp))
        put("compute_s_per_token", 2 * model.params / (peak * gpu.mfu * tp))
        allreduces = 2 * model.layers if tp > 1 else 0
        put("_fixed_s", gpu.step_overhead_s + allreduces * gpu.allreduce_latency_s)
        put("_comm_s_per_token", allreduces * 2 * (tp - 1) / tp * model.hidden * ACTIVATION_BYTES
            / (gpu.interconnect_gb_s * 1e9))
        attention_flops_per_pair = 4 * model.layers * model.heads * model.head_dim
        put("_attention_flops_per_pair", attention_flops_per_pair)
        put("_attention_s_per_pair", attention_flops_per_pair / (peak * gpu.attention_efficiency * tp))
        put("_peak_flops", peak * tp)
        put("_peak_bytes", hbm * tp)

    def _suggestion(self, max_context: int) -> str:
        model = self.model
        for tp in TP_DEGREES:
            if tp <= self.tp or model.heads % tp or (model.kv_heads % tp and tp % model.kv_heads):
                continue
            kv_bytes_per_token = model.kv_bytes_per_token * max(1, tp // model.kv_heads)
            usable = self.memory_fraction * self.gpu.memory_bytes * tp
            if usable - model.weight_bytes >= kv_bytes_per_token * max_context:
                return f"tp={tp} fits"
        return f"no tp up to {TP_DEGREES[-1]} fits"

    # -- the iteration-time model -------------------------------------------------------------

    def linear_s(self, tokens: int) -> float:
        """Seconds of the token-proportional part of a step over ``tokens`` tokens (prefill
        chunk tokens + one per decoding sequence): matmuls vs weight streaming, combined as
        ``(Tc^1.5 + Tm^1.5)^(1/1.5)``, plus the fixed step overhead and, for ``tp > 1``, the
        two all-reduces per layer. ``0.0`` for ``tokens <= 0`` (no step)."""
        if tokens <= 0:
            return 0.0
        tc = tokens * self.compute_s_per_token
        tm = self.weight_stream_s
        combined = math.pow(tc * math.sqrt(tc) + tm * math.sqrt(tm), 2 / 3)  # (math.pow: a float, as ** is not typed)
        return combined + self._fixed_s + tokens * self._comm_s_per_token

    def prefill_attention_s(self, chunk: int, context_before: int) -> float:
        """Seconds of attention for a prefill chunk of ``chunk`` tokens after ``context_before``
        tokens of the same sequence already in the KV cache: causal attention FLOPs
        ``4 · layers · heads · head_dim · chunk · (context_before + (chunk + 1) / 2)`` at the GPU's
        attention efficiency, but never less than reading the earlier context's KV cache."""
        if chunk <= 0:
            return 0.0
        pairs = chunk * (context_before + (chunk + 1) / 2)
        return max(pairs * self._attention_s_per_pair, context_before * self.kv_read_s_per_token)

    def step_s(self, prefill_chunks: Sequence[tuple[int, int]], decode_seqs: int, decode_context_tokens: int) -> float:
        """Seconds of one engine step.

        ``prefill_chunks``: ``(chunk, context_before)`` per sequence prefilling in this step;
        ``decode_seqs``: sequences decoding one token each; ``decode_context_tokens``: the sum,
        over those sequences, of the tokens already in their KV cache. Non-decreasing in every
        argument; ``0.0`` for an empty step.
        """
        tokens = decode_seqs
        attention = 0.0
        for chunk, context_before in prefill_chunks:
            tokens += chunk
            attention += self.prefill_attention_s(chunk, context_before)
        return self.linear_s(tokens) + attention + decode_context_tokens * self.kv_read_s_per_token

    def decode_steps_s(self, seqs: int, context_tokens: int, steps: int) -> float:
        """Seconds of ``steps`` consecutive pure-decode steps of the same ``seqs`` sequences,
        whose KV caches hold ``context_tokens`` tokens in all before the first: step ``k`` reads
        ``context_tokens + k · seqs`` tokens, so the sum is closed-form. Equal (to rounding) to
        summing :meth:`step_s` ``((), seqs, context_tokens + k · seqs)`` over ``k < steps``."""
        if steps <= 0 or seqs <= 0:
            return 0.0
        read_tokens = steps * context_tokens + seqs * steps * (steps - 1) / 2
        return steps * self.linear_s(seqs) + read_tokens * self.kv_read_s_per_token

    def decode_steps_within(self, seqs: int, context_tokens: int, budget_s: float) -> int:
        """The most whole pure-decode steps (as in :meth:`decode_steps_s`) that take at most
        ``budget_s`` seconds: how far the engine can jump before its next event."""
        if seqs <= 0:
            raise ValueError(f"decode_steps_within needs seqs > 0, got {seqs!r}")
        if budget_s <= 0:
            return 0
        # decode_steps_s(K) = a·K² + b·K with:
        a = seqs * self.kv_read_s_per_token / 2
        b = self.linear_s(seqs) + context_tokens * self.kv_read_s_per_token - a
        if a > 0:
            k = int((-b + math.sqrt(b * b + 4 * a * budget_s)) / (2 * a))
        else:
            k = int(budget_s / b)
        k = max(k, 0)
        # The float root may be off by one either way; settle it on the exact sums.
        while self.decode_steps_s(seqs, context_tokens, k + 1) <= budget_s:
            k += 1
        while k > 0 and self.decode_steps_s(seqs, context_tokens, k) > budget_s:
            k -= 1
        return k

    # -- accounting, for MFU and MBU over a run -------------------------------------------------

    def flops(self, prefill_chunks: Sequence[tuple[int, int]], decode_seqs: int, decode_context_tokens: int) -> float:
        """Model FLOPs of one step (same arguments as :meth:`step_s`): ``2 · params`` per token
        plus attention (``4 · layers · heads · head_dim`` per query-key pair)."""
        tokens = decode_seqs
        pairs = float(decode_context_tokens)
        for chunk, context_before in prefill_chunks:
            tokens += chunk
            pairs += chunk * (context_before + (chunk + 1) / 2)
        return 2 * self.model.params * tokens + self._attention_flops_per_pair * pairs

    def bytes_moved(self, prefill_chunks: Sequence[tuple[int, int]], decode_seqs: int,
                    decode_context_tokens: int) -> float:
        """Bytes one step reads from memory (same arguments as :meth:`step_s`): the weights
        once, plus the KV cache of every context token attended over."""
        tokens = decode_seqs
        context = decode_context_tokens
        for chunk, context_before in prefill_chunks:
            tokens += chunk
            context += context_before
        if tokens <= 0:
            return 0.0
        return self.model.weight_bytes + context * self.kv_bytes_per_token

    def mfu(self, flops: float, seconds: float) -> float:
        """Model FLOPs utilisation: ``flops / (peak · tp · seconds)``."""
        return flops / (self._peak_flops * seconds) if seconds > 0 else 0.0

    def mbu(self, bytes_read: float, seconds: float) -> float:
        """Memory bandwidth utilisation: ``bytes_read / (hbm · tp · seconds)``."""
        return bytes_read / (self._peak_bytes * seconds) if seconds > 0 else 0.0


@attrs.frozen
class StaticBatchEstimate:
    """What :func:`estimate_static_batch` predicts (seconds; means are over the requests)."""

    ttft_s: float
    ttft_max_s: float
    #: Mean of ``(last token time − first token time) / (output_tokens − 1)``, as vLLM's
    #: benchmarks define TPOT; 0 when ``output_tokens == 1``.
    tpot_s: float
    #: When the last request finishes.
    latency_s: float
    output_tokens_per_s: float
    mfu: float
    mbu: float
    prefill_steps: int
    decode_steps: int


def estimate_static_batch(deployment: Deployment, batch: int, prompt_tokens: int, output_tokens: int,
                          chunk_budget: int = DEFAULT_CHUNK_BUDGET) -> StaticBatchEstimate:
    """``batch`` identical requests arriving together, run to completion.

    Schedule (the simple case the ``continuous`` engine must reproduce): prefill first, as
    vLLM's V0 scheduler does by default: while any prompt tokens remain, a step carries only
    prefill, up to ``chunk_budget`` tokens taken from the requests in order (a prompt that
    does not fit is split, and its next chunk attends over the part already cached). The
    step that completes a prompt also produces that request's first token. Then all requests
    decode together, one token per step, for ``output_tokens − 1`` steps.

    Raises :class:`DeploymentError` if ``prompt_tokens + output_tokens`` exceeds the
    deployment's ``max_context`` or the batch's KV cache exceeds its capacity (the engine would
    preempt; this estimate does not model that).
    """
    for name, value in (("batch", batch), ("prompt_tokens", prompt_tokens),
                        ("output_tokens", output_tokens), ("chunk_budget", chunk_budget)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    d = deployment
    if prompt_tokens + output_tokens > d.context_limit:
        raise DeploymentError(f"{prompt_tokens} prompt + {output_tokens} output tokens exceed the "
                              f"deployment's max_context ({d.context_limit})")
    if batch * (prompt_tokens + output_tokens) > d.kv_capacity_tokens:
        raise DeploymentError(f"{batch} × ({prompt_tokens} + {output_tokens}) tokens of KV cache exceed the "
                              f"capacity of {d.model.name} on {d.tp} × {d.gpu.name} "
                              f"({d.kv_capacity_tokens:,} tokens)")

    now = flops = bytes_read = 0.0
    first_token_at: list[float] = []
    prefill_steps = 0
    chunks: list[tuple[int, int]] = []
    finishing = 0
    room = chunk_budget
    request, done = 0, 0
    while request < batch:
        take = min(room, prompt_tokens - done)
        chunks.append((take, done))
        done += take
        room -= take
        if done == prompt_tokens:
            finishing += 1
            request, done = request + 1, 0
        if room == 0 or request == batch:
            now += d.step_s(chunks, 0, 0)
            flops += d.flops(chunks, 0, 0)
            bytes_read += d.bytes_moved(chunks, 0, 0)
            prefill_steps += 1
            first_token_at.extend([now] * finishing)
            chunks, finishing, room = [], 0, chunk_budget

    steps = output_tokens - 1
    context = batch * prompt_tokens
    now += d.decode_steps_s(batch, context, steps)
    if steps:
        attended = steps * context + batch * steps * (steps - 1) / 2
        flops += d.flops((), batch * steps, int(attended))
        bytes_read += steps * d.model.weight_bytes + attended * d.kv_bytes_per_token
    tpot = (sum(now - t for t in first_token_at) / batch / steps) if steps else 0.0
    return StaticBatchEstimate(
        ttft_s=sum(first_token_at) / batch,
        ttft_max_s=max(first_token_at),
        tpot_s=tpot,
        latency_s=now,
        output_tokens_per_s=batch * output_tokens / now,
        mfu=d.mfu(flops, now),
        mbu=d.mbu(bytes_read, now),
        prefill_steps=prefill_steps,
        decode_steps=steps,
    )
