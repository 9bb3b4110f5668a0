"""Published inference measurements the roofline model (apsd/engines/roofline.py) is checked against.

A helpers module, not a test file: ``tests/unit/test_roofline.py`` asserts every point, and
``python -m tests.roofline_points`` prints the Markdown table of docs/explanation/engines.md ("Validation")
from the same data, so the table is always what the code computes.

Each :class:`Point` quotes one published figure exactly as its source prints it, says how apsd
computes the same quantity, and gives the band of relative error ``(apsd − published) /
published`` the test accepts. ``role`` is ``validation`` (band ±15%), ``calibration`` (the
point set a constant of a built-in profile, so agreement is by construction), or ``deviation``
(the model is knowingly off; the band pins where it falls, and ``note`` says why).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from apsd.engines.profiles import ProfileRegistry, builtin_profiles
from apsd.engines.roofline import Deployment, estimate_static_batch

LMDEPLOY = ("https://github.com/InternLM/lmdeploy/blob/3e391df4673326f79363eebe030876861a9b7090/"
            "docs/en/benchmark/a100_fp16.md")
TRTLLM = ("https://github.com/NVIDIA/TensorRT-LLM/blob/138f96d45f90b9667426f7c47297d8c06bafac73/"
          "docs/source/performance.md")
VLLM_A100 = "https://buildkite.com/vllm/performance-benchmark/builds/9523"
VLLM_H100 = "https://buildkite.com/vllm/performance-benchmark/builds/9555"
VLLM_H200 = "https://buildkite.com/vllm/performance-benchmark/builds/9515"
NEMO = "https://docs.nvidia.com/nemo-framework/user-guide/latest/performance/llama.html"
SOURCE_NAMES = {
    LMDEPLOY: "LMDeploy a100_fp16.md",
    TRTLLM: "TensorRT-LLM performance.md",
    VLLM_A100: "vLLM perf CI #9523",
    VLLM_H100: "vLLM perf CI #9555",
    VLLM_H200: "vLLM perf CI #9515",
    NEMO: "NeMo Framework docs",
}

VALIDATION_BAND = (-0.15, 0.15)


def registry() -> ProfileRegistry:
    r = ProfileRegistry(current_plugin="builtin")
    builtin_profiles(r)
    return r


def deployment(gpu: str, model: str, tp: int = 1, memory_fraction: float = 0.9) -> Deployment:
    r = registry()
    return Deployment.build(r.get_gpu(gpu), r.get_model(model), tp, memory_fraction=memory_fraction)


def ttft_ms(gpu: str, model: str, tp: int, prompt: int) -> Callable[[], float]:
    """Time to first token of one request alone."""
    return lambda: estimate_static_batch(deployment(gpu, model, tp), 1, prompt, 1).ttft_s * 1e3


def median_token_ms(gpu: str, model: str, tp: int, batch: int, prompt: int, output: int) -> Callable[[], float]:
    """The decode step halfway through a static batch: the median per-token latency when every
    step of the run is a decode step of the whole batch (context grows linearly)."""
    def figure() -> float:
        d = deployment(gpu, model, tp)
        return d.step_s((), batch, batch * (prompt + (output - 1) // 2)) * 1e3
    return figure


def throughput(gpu: str, model: str, tp: int, batch: int, prompt: int, output: int,
               *, one_prefill_step: bool = False, memory_fraction: float = 0.9) -> Callable[[], float]:
    """Output tokens per second of a static batch (:func:`estimate_static_batch`);
    ``one_prefill_step``: all prompts in one step, as a static-batching engine runs them."""
    def figure() -> float:
        budget = batch * prompt if one_prefill_step else 8192
        d = deployment(gpu, model, tp, memory_fraction)
        return estimate_static_batch(d, batch, prompt, output, budget).output_tokens_per_s
    return figure


def latency_ms(gpu: str, model: str, tp: int, batch: int, prompt: int, output: int) -> Callable[[], float]:
    """End-to-end latency of a static batch (all requests done)."""
    return lambda: estimate_static_batch(deployment(gpu, model, tp), batch, prompt, output).latency_s * 1e3


@attrs.frozen
class Point:
    key: str
    config: str
    source: str
    #: The figure as the source prints it (table row or cell), for a reader to find it.
    quote: str
    published: float
    unit: str
    apsd: Callable[[], float] = attrs.field(repr=False)
    role: str = "validation"
    band: tuple[float, float] = VALIDATION_BAND
    note: str = ""

    def error(self) -> float:
        return self.apsd() / self.published - 1


KV_NOTE = ("long-context decode: LMDeploy's and TensorRT-LLM's decode attention reads the KV cache "
           "at ≈0.85 of HBM bandwidth, apsd assumes 0.65 (kv_read_efficiency); the error grows "
           "with batch × context")
FP8_NOTE = "published with FP8 weights and FP8 arithmetic (twice the bf16 peak); apsd models bf16 only"

POINTS: tuple[Point, ...] = (
    # -- LMDeploy v0.1.0a1 (TurboMind), A100-80G, fp16: static inference benchmark ---------------
    Point("lmd-7b-b1-decode", "A100-80GB, Llama-2-7B, tp1, batch 1, prompt 1, output 128: output tok/s",
          LMDEPLOY, "llama2-7b row `1 | 1 | 1 | 128 | 100.02`", 100.02, "tok/s",
          throughput("a100-80gb", "llama-2-7b", 1, 1, 1, 128)),
    Point("lmd-7b-b1-ttft2048", "A100-80GB, Llama-2-7B, tp1, batch 1, prompt 2048: first token latency",
          LMDEPLOY, "llama2-7b row `1 | 1 | 2048 | 128 | 86.1 | 76.77 | 0.139`", 139.0, "ms",
          ttft_ms("a100-80gb", "llama-2-7b", 1, 2048)),
    Point("lmd-7b-b1-2048", "A100-80GB, Llama-2-7B, tp1, batch 1, prompt 2048, output 128: output tok/s",
          LMDEPLOY, "llama2-7b row `1 | 1 | 2048 | 128 | 86.1`", 86.1, "tok/s",
          throughput("a100-80gb", "llama-2-7b", 1, 1, 2048, 128)),
    Point("lmd-7b-b1-long", "A100-80GB, Llama-2-7B, tp1, batch 1, prompt 2048, output 2048: median token latency",
          LMDEPLOY, "llama2-7b row `1 | 1 | 2048 | 2048 | 93.78 | … | 50%(s) 0.011`", 11.0, "ms",
          median_token_ms("a100-80gb", "llama-2-7b", 1, 1, 2048, 2048)),
    Point("lmd-7b-b16-decode", "A100-80GB, Llama-2-7B, tp1, batch 16, prompt 1, output 128: output tok/s",
          LMDEPLOY, "llama2-7b row `16 | 1 | 1 | 128 | 1504.72`", 1504.72, "tok/s",
          throughput("a100-80gb", "llama-2-7b", 1, 16, 1, 128)),
    Point("lmd-7b-b64-decode", "A100-80GB, Llama-2-7B, tp1, batch 64, prompt 1, output 128: median token latency",
          LMDEPLOY, "llama2-7b row `64 | 1 | 1 | 128 | 4154.81 | … | 50%(s) 0.012`", 12.0, "ms",
          median_token_ms("a100-80gb", "llama-2-7b", 1, 64, 1, 128)),
    Point("lmd-7b-b16-long", "A100-80GB, Llama-2-7B, tp1, batch 16, prompt 128, output 2048: median token latency",
          LMDEPLOY, "llama2-7b row `16 | 1 | 128 | 2048 | 1010.62 | … | 50%(s) 0.015`", 15.0, "ms",
          median_token_ms("a100-80gb", "llama-2-7b", 1, 16, 128, 2048)),
    Point("lmd-7b-b32-long", "A100-80GB, Llama-2-7B, tp1, batch 32, prompt 128, output 2048: median token latency",
          LMDEPLOY, "llama2-7b row `32 | 1 | 128 | 2048 | 1462.12 | … | 50%(s) 0.021`", 21.0, "ms",
          median_token_ms("a100-80gb", "llama-2-7b", 1, 32, 128, 2048),
          role="deviation", band=(0.10, 0.25), note=KV_NOTE),
    Point("lmd-7b-b16-2048", "A100-80GB, Llama-2-7B, tp1, batch 16, prompt 2048, output 128: output tok/s",
          LMDEPLOY, "llama2-7b row `16 | 1 | 2048 | 128 | 348.87 | 78.3 | 2.897 | 0.143 | 3.576`", 348.87, "tok/s",
          throughput("a100-80gb", "llama-2-7b", 1, 16, 2048, 128),
          role="deviation", band=(0.10, 0.25),
          note=("TurboMind v0.1 took 3.6 s to give all 16 prompts their first token (FTL max) where "
                "16 single prefills take 2.2 s: its scheduler interleaves prefills with decodes; "
                "apsd's estimate prefills first, in 8,192-token chunks")),
    Point("lmd-13b-b1-decode", "A100-80GB, Llama-2-13B, tp1, batch 1, prompt 1, output 128: output tok/s",
          LMDEPLOY, "llama2-13b row `1 | 1 | 1 | 128 | 57.49`", 57.49, "tok/s",
          throughput("a100-80gb", "llama-2-13b", 1, 1, 1, 128)),
    Point("lmd-13b-b1-ttft2048", "A100-80GB, Llama-2-13B, tp1, batch 1, prompt 2048: first token latency",
          LMDEPLOY, "llama2-13b row `1 | 1 | 2048 | 128 | 48.99 | 75.09 | 0.242`", 242.0, "ms",
          ttft_ms("a100-80gb", "llama-2-13b", 1, 2048)),
    Point("lmd-13b-b16-long", "A100-80GB, Llama-2-13B, tp1, batch 16, prompt 128, output 2048: median token latency",
          LMDEPLOY, "llama2-13b row `16 | 1 | 128 | 2048 | 605.88 | … | 50%(s) 0.026`", 26.0, "ms",
          median_token_ms("a100-80gb", "llama-2-13b", 1, 16, 128, 2048)),
    Point("lmd-70b-tp4-b1-decode", "4 × A100-80GB, Llama-2-70B, tp4, batch 1, prompt 1, output 128: median token latency",
          LMDEPLOY, "llama2-70b row `1 | 4 | 1 | 128 | 33.94 | … | 50%(s) 0.029`", 29.0, "ms",
          median_token_ms("a100-80gb", "llama-2-70b", 4, 1, 1, 128),
          role="calibration", note="sets allreduce_latency_s of the A100 profiles (35 µs)"),
    Point("lmd-70b-tp4-ttft2048", "4 × A100-80GB, Llama-2-70B, tp4, batch 1, prompt 2048: first token latency",
          LMDEPLOY, "llama2-70b row `1 | 4 | 2048 | 128 | 28.32 | 73.78 | 0.402`", 402.0, "ms",
          ttft_ms("a100-80gb", "llama-2-70b", 4, 2048)),
    Point("lmd-70b-tp4-b64-decode", "4 × A100-80GB, Llama-2-70B, tp4, batch 64, prompt 1, output 128: median token latency",
          LMDEPLOY, "llama2-70b row `64 | 4 | 1 | 128 | 1425.79 | … | 50%(s) 0.037`", 37.0, "ms",
          median_token_ms("a100-80gb", "llama-2-70b", 4, 64, 1, 128)),
    Point("lmd-70b-tp4-b16-long", "4 × A100-80GB, Llama-2-70B, tp4, batch 16, prompt 128, output 2048: median token latency",
          LMDEPLOY, "llama2-70b row `16 | 4 | 128 | 2048 | 482.99 | … | 50%(s) 0.033`", 33.0, "ms",
          median_token_ms("a100-80gb", "llama-2-70b", 4, 16, 128, 2048)),
    # -- TensorRT-LLM performance.md (low latency: v0.5; throughput: v0.6.1), A100 FP16 ----------
    Point("trt-7b-ttft128", "A100 (FP16), LLaMA 7B, tp1, batch 1, input 128: 1st token latency",
          TRTLLM, "A100 low-latency row `LLaMA 7B | 1 | 1 | 128 | 16`", 16.0, "ms",
          ttft_ms("a100-80gb", "llama-2-7b", 1, 128)),
    Point("trt-7b-ttft2048", "A100 (FP16), LLaMA 7B, tp1, batch 1, input 2048: 1st token latency",
          TRTLLM, "A100 low-latency row `LLaMA 7B | 1 | 1 | 2048 | 133`", 133.0, "ms",
          ttft_ms("a100-80gb", "llama-2-7b", 1, 2048)),
    Point("trt-70b-tp4-ttft128", "4 × A100 (FP16), LLaMA 70B, tp4, batch 1, input 128: 1st token latency",
          TRTLLM, "A100 low-latency row `LLaMA 70B | 1 | 4 | 128 | 47`", 47.0, "ms",
          ttft_ms("a100-80gb", "llama-2-70b", 4, 128)),
    Point("trt-70b-tp4-ttft2048", "4 × A100 (FP16), LLaMA 70B, tp4, batch 1, input 2048: 1st token latency",
          TRTLLM, "A100 low-latency row `LLaMA 70B | 1 | 4 | 2048 | 377`", 377.0, "ms",
          ttft_ms("a100-80gb", "llama-2-70b", 4, 2048)),
    Point("trt-7b-b384", "A100 (FP16), LLaMA 7B, tp1, batch 384, 128 in / 128 out: output tok/s (static batch)",
          TRTLLM, "A100 throughput row `LLaMA 7B | 384 | 1 | 128 | 128 | 5,586`", 5586.0, "tok/s",
          throughput("a100-80gb", "llama-2-7b", 1, 384, 128, 128, one_prefill_step=True)),
    Point("trt-7b-b60-long", "A100 (FP16), LLaMA 7B, tp1, batch 60, 128 in / 2048 out: output tok/s (static batch)",
          TRTLLM, "A100 throughput row `LLaMA 7B | 60 | 1 | 128 | 2048 | 1,928`", 1928.0, "tok/s",
          throughput("a100-80gb", "llama-2-7b", 1, 60, 128, 2048, one_prefill_step=True, memory_fraction=0.96),
          role="deviation", band=(-0.25, -0.10),
          note=KV_NOTE + " (the batch needs 96% of the memory for its KV cache, so apsd runs it with memory_fraction=0.96)"),
    Point("trt-7b-b52-2048", "A100 (FP16), LLaMA 7B, tp1, batch 52, 2048 in / 128 out: output tok/s (static batch)",
          TRTLLM, "A100 throughput row `LLaMA 7B | 52 | 1 | 2048 | 128 | 591`", 591.0, "tok/s",
          throughput("a100-80gb", "llama-2-7b", 1, 52, 2048, 128, one_prefill_step=True),
          role="deviation", band=(-0.25, -0.10), note=KV_NOTE),
    # -- TensorRT-LLM, FP8 on H100 / L40S (known deviations) ------------------------------------
    Point("trt-h100-7b-ttft2048", "H100 (FP8), LLaMA 7B, tp1, batch 1, input 2048: 1st token latency",
          TRTLLM, "H100 low-latency row `LLaMA 7B | 1 | 1 | 2048 | 36`", 36.0, "ms",
          ttft_ms("h100-sxm", "llama-2-7b", 1, 2048),
          role="deviation", band=(0.25, 0.50), note=FP8_NOTE),
    Point("trt-h100-70b-tp4-ttft2048", "4 × H100 (FP8), LLaMA 70B, tp4, batch 1, input 2048: 1st token latency",
          TRTLLM, "H100 low-latency row `LLaMA 70B | 1 | 4 | 2048 | 109`", 109.0, "ms",
          ttft_ms("h100-sxm", "llama-2-70b", 4, 2048),
          role="deviation", band=(0.20, 0.50), note=FP8_NOTE),
    Point("trt-l40s-7b-ttft2048", "L40S (FP8), LLaMA 7B, tp1, batch 1, input 2048: 1st token latency",
          TRTLLM, "L40S low-latency row `LLaMA 7B | 1 | 1 | 2048 | 73`", 73.0, "ms",
          ttft_ms("l40s", "llama-2-7b", 1, 2048),
          role="deviation", band=(0.80, 1.20), note=FP8_NOTE + "; the L40S MFU (0.55) is unvalidated"),
    # -- vLLM performance dashboard, latency tests: batch 8, input 32, output 128, bf16 --------
    Point("vllm-a100-8b", "A100-SXM4-80GB, Llama-3.1-8B, tp1, batch 8, 32 in / 128 out: mean end-to-end latency",
          VLLM_A100, "`latency_llama8B_tp1 | A100-SXM4-80GB | 1579.27`", 1579.27, "ms",
          latency_ms("a100-80gb", "llama-3-8b", 1, 8, 32, 128)),
    Point("vllm-a100-70b-tp4", "4 × A100-SXM4-80GB, Llama-3-70B, tp4, batch 8, 32 in / 128 out: mean end-to-end latency",
          VLLM_A100, "`latency_llama70B_tp4 | A100-SXM4-80GB | 3990.59`", 3990.59, "ms",
          latency_ms("a100-80gb", "llama-3-70b", 4, 8, 32, 128)),
    Point("vllm-h100-8b", "H100, Llama-3.1-8B, tp1, batch 8, 32 in / 128 out: mean end-to-end latency",
          VLLM_H100, "`latency_llama8B_tp1 | 8xH100 | 997.542`", 997.542, "ms",
          latency_ms("h100-sxm", "llama-3-8b", 1, 8, 32, 128)),
    Point("vllm-h100-70b-tp4", "4 × H100, Llama-3-70B, tp4, batch 8, 32 in / 128 out: mean end-to-end latency",
          VLLM_H100, "`latency_llama70B_tp4 | 8xH100 | 2444.47`", 2444.47, "ms",
          latency_ms("h100-sxm", "llama-3-70b", 4, 8, 32, 128),
          role="calibration", note="sets allreduce_latency_s of the H100/H200 profiles (25 µs)"),
    Point("vllm-h200-8b", "H200, Llama-3.1-8B, tp1, batch 8, 32 in / 128 out: mean end-to-end latency",
          VLLM_H200, "`latency_llama8B_tp1 | H200 | 833.421`", 833.421, "ms",
          latency_ms("h200", "llama-3-8b", 1, 8, 32, 128),
          role="deviation", band=(-0.25, -0.12),
          note=("at 4 ms per step, costs that do not shrink with bandwidth (per-kernel launch tails, "
                "vLLM's per-step CPU work) exceed the 1 ms step overhead; the measured step is ≈6.5 ms")),
    Point("vllm-h200-70b-tp4", "4 × H200, Llama-3-70B, tp4, batch 8, 32 in / 128 out: mean end-to-end latency",
          VLLM_H200, "`latency_llama70B_tp4 | H200 | 2077.53`", 2077.53, "ms",
          latency_ms("h200", "llama-3-70b", 4, 8, 32, 128)),
    # -- NeMo Framework (TensorRT-LLM backend) inference table --------------------------------
    Point("nemo-a100-7b", "A100 80GB SXM4, Llama-2-7B, tp1, batch 1, 128 in / 20 out: average latency",
          NEMO, "row `Llama-2-7B | 1 | 234.0 | 153.8 | … | 1 | 1 | 1` (A100 column)", 234.0, "ms",
          latency_ms("a100-80gb", "llama-2-7b", 1, 1, 128, 20),
          role="deviation", band=(-0.25, -0.10),
          note=("NeMo's table is slower than LMDeploy and TensorRT-LLM's own tables on the same GPU "
                "(11.7 ms per token against 10) and inconsistent (13B at 142.5 ms beats 7B; "
                "NVIDIA/NeMo discussion #8455)")),
    Point("nemo-h100-7b", "H100 80GB HBM3, Llama-2-7B, tp1, batch 1, 128 in / 20 out: average latency",
          NEMO, "row `Llama-2-7B | 1 | 234.0 | 153.8 | … | 1 | 1 | 1` (H100 column)", 153.8, "ms",
          latency_ms("h100-sxm", "llama-2-7b", 1, 1, 128, 20),
          role="deviation", band=(-0.25, -0.10), note="same table as above; the H100/A100 ratio matches (1.52 vs apsd's 1.57)"),
)


def table() -> str:
    """The Markdown table of docs/explanation/engines.md, computed now."""
    lines = ["| # | Configuration | Source: published figure | Published | apsd | Error | Role |",
             "|---|---|---|---|---|---|---|"]
    for i, p in enumerate(POINTS, 1):
        quote = p.quote.replace("|", "\\|")
        lines.append(f"| {i} | {p.config} | [{SOURCE_NAMES[p.source]}]({p.source}): {quote} | "
                     f"{p.published:g} {p.unit} | {p.apsd():.4g} {p.unit} | {p.error():+.1%} | {p.role} |")
    notes = [f"- #{i} ({p.key}): {p.note}." for i, p in enumerate(POINTS, 1) if p.note]
    return "\n".join(lines + [""] + notes)


if __name__ == "__main__":
    print(table())
