"""GPU and model profiles: the numbers the ``continuous`` engine's roofline model is made of.

Ownership: a :class:`ProfileRegistry` holds every profile by name. :func:`builtin_profiles`
fills it with the built-ins below; a plugin adds its own through the same two methods,
:meth:`ProfileRegistry.gpu` and :meth:`ProfileRegistry.model`, so a third party can do
anything a built-in does. Profiles are frozen values, validated when they are made: a profile
that exists has finite, positive numbers. Lookups by an unknown name raise
:class:`ProfileError`, whose message lists the known names.

Units, everywhere: seconds, bytes, tokens; a :class:`GpuProfile` describes ONE GPU (a
deployment of ``tp`` GPUs is :class:`apsd.engines.roofline.Deployment`).
"""

from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

import attrs

from apsd.core.hookspecs import hookimpl

__all__ = [
    "BUILTIN_GPUS",
    "BUILTIN_MODELS",
    "GpuProfile",
    "ModelProfile",
    "ProfileError",
    "ProfileRegistry",
    "builtin_profiles",
]

GIB = 1 << 30


class ProfileError(Exception):
    """An unknown or duplicate profile name, or a deployment that cannot run; ``str()`` says which."""


def _positive(_inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name}: must be a finite number > 0, got {value!r}")


def _non_negative(_inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name}: must be a finite number >= 0, got {value!r}")


def _fraction(_inst: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (isinstance(value, (int, float)) and 0 < value <= 1):
        raise ValueError(f"{attribute.name}: must be in (0, 1], got {value!r}")


def _positive_int(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{attribute.name}: must be an integer > 0, got {value!r}")


def _name(_inst: object, attribute: attrs.Attribute[Any], value: str) -> None:
    if not (isinstance(value, str) and value.strip() and value == value.strip()):
        raise ValueError(f"{attribute.name}: must be a non-empty name without surrounding spaces, got {value!r}")


@attrs.frozen
class GpuProfile:
    """One GPU, as the roofline model sees it (see docs/explanation/engines.md, "The roofline model").

    The peak figures are the datasheet's; the efficiencies say how much of them an inference
    engine actually gets, so ``bf16_tflops * mfu`` is the sustained matmul rate and
    ``hbm_gb_s * mbu`` the sustained weight-streaming rate.
    """

    name: str = attrs.field(validator=_name)
    #: Dense (no sparsity) BF16/FP16 tensor-core peak, TFLOP/s.
    bf16_tflops: float = attrs.field(validator=_positive)
    #: Memory bandwidth, GB/s (10^9 bytes).
    hbm_gb_s: float = attrs.field(validator=_positive)
    #: Memory, GiB (2^30 bytes), as the driver reports it.
    memory_gib: float = attrs.field(validator=_positive)
    #: On-demand cloud price of ONE GPU for one hour, USD (source in the profile's comment).
    price_per_hour_usd: float = attrs.field(validator=_non_negative)
    #: Achievable model-FLOPs utilisation of large (prefill) matmuls.
    mfu: float = attrs.field(validator=_fraction)
    #: Achievable bandwidth utilisation when streaming the weights (decode).
    mbu: float = attrs.field(validator=_fraction)
    #: Fixed cost of one engine step (kernel launches with CUDA graphs, sampling, scheduling).
    step_overhead_s: float = attrs.field(default=1e-3, validator=_non_negative)
    #: Bandwidth utilisation of the decode attention kernels reading the KV cache.
    kv_read_efficiency: float = attrs.field(default=0.65, validator=_fraction)
    #: FLOPs utilisation of prefill attention (flash-attention class kernels).
    attention_efficiency: float = attrs.field(default=0.5, validator=_fraction)
    #: All-reduce bus bandwidth between GPUs of one tensor-parallel group, GB/s (NCCL "busbw").
    interconnect_gb_s: float = attrs.field(default=200.0, validator=_positive)
    #: Effective fixed cost of one all-reduce at small sizes (launch, synchronisation, latency),
    #: paid twice per layer per step when ``tp > 1``.
    allreduce_latency_s: float = attrs.field(default=30e-6, validator=_non_negative)
    summary: str = ""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB


@attrs.frozen
class ModelProfile:
    """A decoder-only transformer (Llama-style: GQA attention, gated MLP, untied embeddings).

    ``params`` is the published parameter count; :meth:`architecture_params` recomputes it from
    the shapes, which the tests use to catch a mistyped number.
    """

    name: str = attrs.field(validator=_name)
    params: int = attrs.field(validator=_positive_int)
    layers: int = attrs.field(validator=_positive_int)
    hidden: int = attrs.field(validator=_positive_int)
    heads: int = attrs.field(validator=_positive_int)
    kv_heads: int = attrs.field(validator=_positive_int)
    head_dim: int = attrs.field(validator=_positive_int)
    #: MLP inner width (only :meth:`architecture_params` uses it).
    intermediate: int = attrs.field(validator=_positive_int)
    vocab: int = attrs.field(validator=_positive_int)
    #: Longest sequence (prompt + output) the model supports, tokens.
    max_context: int = attrs.field(validator=_positive_int)
    #: 2 for bf16/fp16 weights.
    bytes_per_param: float = attrs.field(default=2.0, validator=_positive)
    #: 2 for an fp16/bf16 KV cache.
    kv_bytes_per_value: float = attrs.field(default=2.0, validator=_positive)
    summary: str = ""

    def __attrs_post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads ({self.heads}) must be a multiple of "
                             f"kv_heads ({self.kv_heads})")

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache of one token, all layers, one replica: ``2 (K and V) · layers · kv_heads · head_dim · bytes``."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.kv_bytes_per_value

    def architecture_params(self) -> int:
        """The parameter count implied by the shapes (embeddings, attention, gated MLP, norms)."""
        q_and_o = 2 * self.hidden * self.heads * self.head_dim
        k_and_v = 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = 3 * self.hidden * self.intermediate
        per_layer = q_and_o + k_and_v + mlp + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


# ---------------------------------------------------------------------------------------------
# Built-in GPUs. Peaks: NVIDIA datasheets (A100: https://www.nvidia.com/en-us/data-center/a100/,
# H100/H200: https://www.nvidia.com/en-us/data-center/h100/ and /h200/, L40S:
# https://www.nvidia.com/en-us/data-center/l40s/), dense BF16 (the datasheets' headline figures
# with sparsity are twice these).
#
# Prices: AWS EC2 on-demand list prices (us-east-1, Linux; https://aws.amazon.com/ec2/pricing/on-demand/)
# divided by the GPUs in the instance: p4d.24xlarge 8 x A100-40GB $32.7726/h, p4de.24xlarge
# 8 x A100-80GB $40.9657/h, p5.48xlarge 8 x H100 $98.32/h (the list price since its July 2023
# launch, see https://www.nextplatform.com/2023/07/27/h100-gpu-instance-pricing-on-aws-grin-and-bear-it/),
# g6e.xlarge 1 x L40S $1.861/h. AWS publishes no on-demand list price for 8 x H200 (p5e) in
# us-east-1; its EC2 Capacity Blocks list H200 at $5.408 and H100 at $4.916 per accelerator-hour
# (https://aws.amazon.com/ec2/capacityblocks/pricing/, rates to 1 January 2025), so the H200
# figure is the H100 on-demand price scaled by that ratio (x1.10). Neoclouds charge far less
# (≈ $2-3 an H100-hour); override the price in your own profile if that is your market.
#
# Efficiencies: A100 MFU 0.70 / MBU 0.77 reproduce LMDeploy's published A100 figures
# (docs/explanation/engines.md, "Validation"). Hopper keeps MBU 0.77 (same HBM controller class, and the
# vLLM H100 decode point agrees within 7%) but gets MFU 0.60: the 989 TFLOP/s peak is rarely
# sustained at 700 W, and large bf16 GEMMs measure ~600-700 TFLOP/s; no published bf16 Hopper
# prefill figure was found to check it (the TensorRT-LLM ones are FP8). L40S: Ada GEMMs at
# 350 W sustain less of their peak (0.55); GDDR6 streams well (0.75); both are estimates.
#
# Interconnect: NCCL all-reduce bus bandwidth measured on DGX-class machines, ≈230 GB/s over
# A100 NVLink 3 and ≈450 GB/s over H100/H200 NVLink 4; the L40S has no NVLink (PCIe 4.0 x16,
# ≈20 GB/s). allreduce_latency_s is calibrated on one published tensor-parallel decode figure
# per NVLink generation (LMDeploy llama2-70b tp4 on A100; vLLM llama-3-70b tp4 on H100) and
# absorbs, besides NCCL latency, the lower efficiency of the narrower per-GPU matmuls; the L40S
# figures are estimates (no published tensor-parallel L40S figure was found).
# ---------------------------------------------------------------------------------------------

BUILTIN_GPUS: tuple[GpuProfile, ...] = (
    GpuProfile(
        name="a100-40gb", bf16_tflops=312.0, hbm_gb_s=1555.0, memory_gib=40.0,
        price_per_hour_usd=round(32.7726 / 8, 3), mfu=0.70, mbu=0.77,
        interconnect_gb_s=230.0, allreduce_latency_s=35e-6,
        summary="NVIDIA A100 SXM4 40GB (HBM2, NVLink 3)",
    ),
    GpuProfile(
        name="a100-80gb", bf16_tflops=312.0, hbm_gb_s=2039.0, memory_gib=80.0,
        price_per_hour_usd=round(40.9657 / 8, 3), mfu=0.70, mbu=0.77,
        interconnect_gb_s=230.0, allreduce_latency_s=35e-6,
        summary="NVIDIA A100 SXM4 80GB (HBM2e, NVLink 3)",
    ),
    GpuProfile(
        name="h100-sxm", bf16_tflops=989.0, hbm_gb_s=3350.0, memory_gib=80.0,
        price_per_hour_usd=round(98.32 / 8, 3), mfu=0.60, mbu=0.77,
        interconnect_gb_s=450.0, allreduce_latency_s=25e-6,
        summary="NVIDIA H100 SXM5 80GB (HBM3, NVLink 4)",
    ),
    GpuProfile(
        # 143,771 MiB as nvidia-smi reports the "141 GB" part.
        name="h200", bf16_tflops=989.0, hbm_gb_s=4800.0, memory_gib=140.0,
        price_per_hour_usd=round(98.32 / 8 * 5.408 / 4.916, 3), mfu=0.60, mbu=0.77,
        interconnect_gb_s=450.0, allreduce_latency_s=25e-6,
        summary="NVIDIA H200 SXM 141GB (HBM3e, NVLink 4)",
    ),
    GpuProfile(
        # 46,068 MiB as nvidia-smi reports the "48 GB" part.
        name="l40s", bf16_tflops=362.0, hbm_gb_s=864.0, memory_gib=45.0,
        price_per_hour_usd=1.861, mfu=0.55, mbu=0.75,
        interconnect_gb_s=20.0, allreduce_latency_s=50e-6,
        summary="NVIDIA L40S 48GB (GDDR6, PCIe 4.0, no NVLink)",
    ),
)

# ---------------------------------------------------------------------------------------------
# Built-in models: the config.json of each Hugging Face repository (meta-llama/Llama-2-7b-hf,
# Llama-2-13b-hf, Llama-2-70b-hf, Meta-Llama-3-8B, Meta-Llama-3-70B) and the parameter counts of
# their safetensors index; Llama 2: https://arxiv.org/abs/2307.09288 (Table 1: context 4k, GQA
# for 70B), Llama 3: https://ai.meta.com/blog/meta-llama-3/ (128K vocabulary, GQA, 8K context).
# ---------------------------------------------------------------------------------------------

BUILTIN_MODELS: tuple[ModelProfile, ...] = (
    ModelProfile(
        name="llama-2-7b", params=6_738_415_616, layers=32, hidden=4096, heads=32, kv_heads=32,
        head_dim=128, intermediate=11008, vocab=32000, max_context=4096,
        summary="Llama 2 7B (multi-head attention)",
    ),
    ModelProfile(
        name="llama-2-13b", params=13_015_864_320, layers=40, hidden=5120, heads=40, kv_heads=40,
        head_dim=128, intermediate=13824, vocab=32000, max_context=4096,
        summary="Llama 2 13B (multi-head attention)",
    ),
    ModelProfile(
        name="llama-3-8b", params=8_030_261_248, layers=32, hidden=4096, heads=32, kv_heads=8,
        head_dim=128, intermediate=14336, vocab=128256, max_context=8192,
        summary="Llama 3 8B (GQA, 8 KV heads)",
    ),
    ModelProfile(
        name="llama-3.1-8b", params=8_030_261_248, layers=32, hidden=4096, heads=32, kv_heads=8,
        head_dim=128, intermediate=14336, vocab=128256, max_context=131072,
        summary="Llama 3.1 8B (Llama 3 8B's shape, 128K context: long prompts such as Mooncake's traces)",
    ),
    ModelProfile(
        name="llama-2-70b", params=68_976_648_192, layers=80, hidden=8192, heads=64, kv_heads=8,
        head_dim=128, intermediate=28672, vocab=32000, max_context=4096,
        summary="Llama 2 70B (GQA, 8 KV heads)",
    ),
    ModelProfile(
        name="llama-3-70b", params=70_553_706_496, layers=80, hidden=8192, heads=64, kv_heads=8,
        head_dim=128, intermediate=28672, vocab=128256, max_context=8192,
        summary="Llama 3 70B (GQA, 8 KV heads)",
    ),
)

ProfileKind = Literal["gpu", "model"]
#: A GPU or a model profile (what a table of :class:`ProfileRegistry` holds).
P = TypeVar("P", GpuProfile, ModelProfile)


@attrs.define(eq=False)
class ProfileRegistry:
    """Named GPU and model profiles, filled by the built-ins and by plugins.

    ``current_plugin`` names whoever is registering (the plugin manager sets it before calling
    each plugin, as :class:`apsd.core.policy.PolicyRegistry` does), so a duplicate name's error can
    say who registered it first. Registering never replaces: two profiles with one name are
    an error, whichever kind.
    """

    _gpus: dict[str, tuple[GpuProfile, str]] = attrs.field(factory=dict, init=False)
    _models: dict[str, tuple[ModelProfile, str]] = attrs.field(factory=dict, init=False)
    current_plugin: str = "?"

    def gpu(self, profile: GpuProfile) -> None:
        """Register a GPU profile under ``profile.name``; raises :class:`ProfileError` if taken."""
        if not isinstance(profile, GpuProfile):
            raise ProfileError(f"{self.current_plugin} registered a {type(profile).__name__} as a GPU "
                               "profile; expected apsd.engines.profiles.GpuProfile")
        self._add("gpu", self._gpus, profile.name, profile)

    def model(self, profile: ModelProfile) -> None:
        """Register a model profile under ``profile.name``; raises :class:`ProfileError` if taken."""
        if not isinstance(profile, ModelProfile):
            raise ProfileError(f"{self.current_plugin} registered a {type(profile).__name__} as a model "
                               "profile; expected apsd.engines.profiles.ModelProfile")
        self._add("model", self._models, profile.name, profile)

    def _add(self, kind: ProfileKind, table: dict[str, tuple[P, str]], name: str, profile: P) -> None:
        if name in table:
            raise ProfileError(f"{kind} profile {name!r} is registered twice: by {table[name][1]} "
                               f"and by {self.current_plugin}")
        table[name] = (profile, self.current_plugin)

    def get_gpu(self, name: str) -> GpuProfile:
        """The GPU profile called ``name``; :class:`ProfileError` listing the known ones if none is."""
        return self._entry("gpu", self._gpus, name)[0]

    def get_model(self, name: str) -> ModelProfile:
        """The model profile called ``name``; :class:`ProfileError` listing the known ones if none is."""
        return self._entry("model", self._models, name)[0]

    def _entry(self, kind: ProfileKind, table: dict[str, tuple[P, str]], name: str) -> tuple[P, str]:
        """(the profile, the plugin that registered it); :class:`ProfileError` listing the known ones if none is."""
        try:
            return table[name]
        except KeyError:
            known = ", ".join(sorted(table)) or "none"
            raise ProfileError(f"unknown {kind} profile {name!r} (known: {known})") from None

    def gpus(self) -> list[GpuProfile]:
        """Every GPU profile, by name."""
        return [self._gpus[name][0] for name in sorted(self._gpus)]

    def models(self) -> list[ModelProfile]:
        """Every model profile, by name."""
        return [self._models[name][0] for name in sorted(self._models)]

    def registered_by(self, kind: ProfileKind, name: str) -> str:
        """Which plugin registered the profile (for ``apsd plugins``-style listings)."""
        if kind == "gpu":
            return self._entry(kind, self._gpus, name)[1]
        return self._entry(kind, self._models, name)[1]


def builtin_profiles(registry: ProfileRegistry) -> None:
    """Register the built-in GPUs and models, exactly as a plugin registers its own."""
    for gpu in BUILTIN_GPUS:
        registry.gpu(gpu)
    for model in BUILTIN_MODELS:
        registry.model(model)


@hookimpl
def register_profiles(registry: ProfileRegistry) -> None:
    """The built-ins, registered through the same hook a plugin implements."""
    builtin_profiles(registry)
