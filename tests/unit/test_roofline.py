"""The roofline model and its profiles: arithmetic, validation, and published measurements.

The published points live in ``tests/roofline_points.py`` (one place for the data, which also
prints the table of docs/explanation/engines.md); every one is asserted here with its stated band.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from apsd.engines.profiles import (
    BUILTIN_GPUS,
    BUILTIN_MODELS,
    GpuProfile,
    ModelProfile,
    ProfileError,
    ProfileRegistry,
    builtin_profiles,
)
from apsd.engines.roofline import Deployment, DeploymentError, estimate_static_batch
from tests.roofline_points import POINTS, VALIDATION_BAND, registry, table

KIB = 1024
GIB = 1 << 30


def deploy(gpu: str, model: str, tp: int = 1, **kwargs) -> Deployment:
    r = registry()
    return Deployment.build(r.get_gpu(gpu), r.get_model(model), tp, **kwargs)


# -- the required figures (published LMDeploy figures, A100-80GB, Llama-2-7B) ----------------------

def test_single_stream_decode_is_about_9_8_ms_per_token():
    estimate = estimate_static_batch(deploy("a100-80gb", "llama-2-7b"), 1, 1, 128)
    assert estimate.tpot_s == pytest.approx(9.8e-3, rel=0.15)


def test_first_token_of_a_2048_token_prompt_is_about_136_ms():
    estimate = estimate_static_batch(deploy("a100-80gb", "llama-2-7b"), 1, 2048, 1)
    assert estimate.ttft_s == pytest.approx(0.136, rel=0.15)


# -- every published point, within its band ------------------------------------------------------

@pytest.mark.parametrize("point", POINTS, ids=[p.key for p in POINTS])
def test_published_point(point):
    low, high = point.band
    error = point.error()
    assert low <= error <= high, (f"{point.key}: apsd {point.apsd():.4g} {point.unit} vs published "
                                  f"{point.published:g} ({error:+.1%}), band {low:+.0%}..{high:+.0%}")


def test_points_are_well_formed():
    assert len({p.key for p in POINTS}) == len(POINTS)
    for p in POINTS:
        assert p.role in ("validation", "calibration", "deviation"), p.key
        assert p.source.startswith("https://"), p.key
        if p.role == "validation":
            assert p.band == VALIDATION_BAND, p.key
        else:
            assert p.note, f"{p.key}: a {p.role} point says why"
    # Most points test the model; few define it.
    assert sum(p.role == "validation" for p in POINTS) > sum(p.role != "validation" for p in POINTS)
    assert sum(p.role == "calibration" for p in POINTS) <= 2


def test_the_docs_table_is_what_the_code_computes():
    docs = (Path(__file__).resolve().parents[2] / "docs" / "explanation" / "engines.md").read_text()
    missing = [line for line in table().splitlines() if line and line not in docs]
    assert not missing, "docs/explanation/engines.md is stale; paste `python -m tests.roofline_points`:\n" + "\n".join(missing)


# -- KV cache and memory -------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "kib"), [("llama-2-7b", 512), ("llama-3-8b", 128), ("llama-2-13b", 800),
                                            ("llama-2-70b", 320), ("llama-3-70b", 320)])
def test_kv_bytes_per_token(model, kib):
    assert registry().get_model(model).kv_bytes_per_token == kib * KIB
    assert deploy("a100-80gb", model, 4 if "70b" in model else 1).kv_bytes_per_token == kib * KIB


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    model = ModelProfile(name="tiny-gqa", params=1_000_000_000, layers=16, hidden=2048, heads=16, kv_heads=4,
                         head_dim=128, intermediate=8192, vocab=32000, max_context=4096)
    gpu = registry().get_gpu("a100-80gb")
    assert Deployment.build(gpu, model, 4).kv_bytes_per_token == model.kv_bytes_per_token
    assert Deployment.build(gpu, model, 8).kv_bytes_per_token == 2 * model.kv_bytes_per_token


def test_kv_capacity_formula():
    d = deploy("a100-80gb", "llama-2-7b")
    assert d.kv_capacity_tokens == math.floor((0.9 * 80 * GIB - 6_738_415_616 * 2) / (512 * KIB))
    d = deploy("a100-40gb", "llama-2-70b", 4)
    assert d.kv_capacity_tokens == math.floor((0.9 * 40 * GIB * 4 - 68_976_648_192 * 2) / (320 * KIB))
    d = deploy("a100-80gb", "llama-2-7b", memory_fraction=0.5)
    assert d.kv_capacity_tokens == math.floor((0.5 * 80 * GIB - 6_738_415_616 * 2) / (512 * KIB))


def test_70b_is_refused_on_one_a100_40gb_with_the_memory_it_needs():
    with pytest.raises(DeploymentError) as caught:
        deploy("a100-40gb", "llama-2-70b")
    message = str(caught.value)
    assert "llama-2-70b does not fit on 1 × a100-40gb" in message
    assert "needs 129.7 GiB (128.5 GiB of bf16 weights + 1.2 GiB of KV cache" in message
    assert "36.0 GiB" in message and "tp=4 fits" in message
    assert isinstance(caught.value, ProfileError)


def test_a_model_that_fits_nowhere_says_so():
    huge = ModelProfile(name="huge", params=400_000_000_000, layers=126, hidden=16384, heads=128, kv_heads=8,
                        head_dim=128, intermediate=53248, vocab=128256, max_context=8192)
    with pytest.raises(DeploymentError, match="no tp up to 8 fits"):
        Deployment.build(registry().get_gpu("a100-40gb"), huge, 8)


def test_weights_that_fit_but_leave_no_room_for_one_sequence_are_refused():
    # 70B bf16 weights (128.5 GiB) fit in 2 × 80 GiB × 0.9 = 144 GiB, leaving room for ~52k tokens.
    assert deploy("a100-80gb", "llama-2-70b", 2).kv_capacity_tokens > 4096
    with pytest.raises(DeploymentError, match="does not fit"):
        deploy("a100-80gb", "llama-2-70b", 2, memory_fraction=0.8)


@pytest.mark.parametrize("tp", [0, 3, 16, -1, True, 2.0])
def test_tp_must_be_a_supported_degree(tp):
    with pytest.raises(DeploymentError, match="tp must be one of 1, 2, 4, 8"):
        deploy("a100-80gb", "llama-2-7b", tp)


def test_tp_must_split_the_heads():
    model = ModelProfile(name="odd", params=1_000_000_000, layers=8, hidden=1536, heads=12, kv_heads=12,
                         head_dim=128, intermediate=4096, vocab=32000, max_context=2048)
    with pytest.raises(DeploymentError, match="does not divide the model's 12 attention heads"):
        Deployment.build(registry().get_gpu("a100-80gb"), model, 8)


def test_max_context_is_bounded_by_the_models():
    assert deploy("a100-80gb", "llama-2-7b", max_context=2048).max_context == 2048
    assert deploy("a100-80gb", "llama-2-7b").max_context == 4096
    with pytest.raises(DeploymentError, match="max_context"):
        deploy("a100-80gb", "llama-2-7b", max_context=8192)


def test_price_is_per_deployment():
    gpu = registry().get_gpu("h100-sxm")
    assert deploy("h100-sxm", "llama-3-70b", 4).price_per_hour_usd == pytest.approx(4 * gpu.price_per_hour_usd)


# -- the iteration-time model --------------------------------------------------------------------

def test_tp2_halves_the_weight_streaming_time():
    one, two = deploy("a100-80gb", "llama-2-13b"), deploy("a100-80gb", "llama-2-13b", 2)
    assert two.weight_stream_s == pytest.approx(one.weight_stream_s / 2)
    assert two.compute_s_per_token == pytest.approx(one.compute_s_per_token / 2)
    assert two.kv_read_s_per_token == pytest.approx(one.kv_read_s_per_token / 2)


def test_weight_streaming_and_compute_follow_the_formulas():
    d = deploy("a100-80gb", "llama-2-7b")
    p = 6_738_415_616
    assert d.weight_stream_s == pytest.approx(2 * p / (2039e9 * 0.77))
    assert d.compute_s_per_token == pytest.approx(2 * p / (312e12 * 0.70))
    assert d.kv_read_s_per_token == pytest.approx(512 * KIB / (2039e9 * 0.65))
    tc, tm = 100 * d.compute_s_per_token, d.weight_stream_s
    assert d.linear_s(100) == pytest.approx((tc ** 1.5 + tm ** 1.5) ** (1 / 1.5) + 1e-3)
    assert d.linear_s(0) == 0.0


def test_tensor_parallel_steps_pay_for_the_all_reduces():
    d = deploy("a100-80gb", "llama-2-70b", 4)
    gpu = d.gpu
    fixed = gpu.step_overhead_s + 2 * 80 * gpu.allreduce_latency_s
    per_token = 2 * 80 * 2 * 3 / 4 * 8192 * 2 / (gpu.interconnect_gb_s * 1e9)
    tc, tm = 64 * d.compute_s_per_token, d.weight_stream_s
    assert d.linear_s(64) == pytest.approx((tc ** 1.5 + tm ** 1.5) ** (2 / 3) + fixed + 64 * per_token)


def test_step_s_sums_its_parts():
    d = deploy("a100-80gb", "llama-3-8b")
    chunks = [(512, 0), (256, 1024)]
    expected = (d.linear_s(512 + 256 + 10) + d.prefill_attention_s(512, 0) + d.prefill_attention_s(256, 1024)
                + 5000 * d.kv_read_s_per_token)
    assert d.step_s(chunks, 10, 5000) == pytest.approx(expected)
    assert d.step_s((), 0, 0) == 0.0


def test_prefill_attention_counts_causal_pairs_and_never_beats_reading_the_cache():
    d = deploy("a100-80gb", "llama-2-7b")
    per_pair = 4 * 32 * 32 * 128 / (312e12 * 0.5)
    assert d.prefill_attention_s(2048, 0) == pytest.approx(2048 * 2049 / 2 * per_pair)
    assert d.prefill_attention_s(1, 3000) == pytest.approx(3000 * d.kv_read_s_per_token)
    assert d.prefill_attention_s(0, 3000) == 0.0


@pytest.mark.parametrize("name", ["a100-80gb", "h100-sxm"])
def test_step_s_is_monotonic_in_every_input(name):
    d = deploy(name, "llama-2-70b", 4)
    grid = [0, 1, 7, 64, 512, 4096]
    for chunk in grid:
        for before in grid:
            for seqs in grid:
                for context in (0, 100, 10_000, 300_000):
                    base = d.step_s([(chunk, before)], seqs, context)
                    assert d.step_s([(chunk + 1, before)], seqs, context) >= base
                    assert d.step_s([(chunk, before + 1)], seqs, context) >= base
                    assert d.step_s([(chunk, before)], seqs + 1, context) >= base
                    assert d.step_s([(chunk, before)], seqs, context + 1) >= base
                    assert d.step_s([(chunk, before), (1, 0)], seqs, context) >= base


def test_decode_steps_s_is_the_sum_of_its_steps():
    d = deploy("h100-sxm", "llama-3-8b")
    seqs, context, steps = 24, 24 * 700, 333
    summed = sum(d.step_s((), seqs, context + k * seqs) for k in range(steps))
    assert d.decode_steps_s(seqs, context, steps) == pytest.approx(summed, rel=1e-9)
    assert d.decode_steps_s(seqs, context, 0) == 0.0


@pytest.mark.parametrize("budget", [0.0, 0.001, 0.0135, 0.5, 7.3, 600.0])
def test_decode_steps_within_is_the_most_that_fit(budget):
    d = deploy("a100-80gb", "llama-2-7b")
    seqs, context = 16, 16 * 1500
    k = d.decode_steps_within(seqs, context, budget)
    assert d.decode_steps_s(seqs, context, k) <= budget
    assert d.decode_steps_s(seqs, context, k + 1) > budget
    with pytest.raises(ValueError):
        d.decode_steps_within(0, 0, 1.0)


def test_utilisations_stay_below_the_profiles_efficiencies():
    for name in ("a100-80gb", "h100-sxm", "l40s"):
        d = deploy(name, "llama-3-8b")
        for args in [([(8192, 0)], 0, 0), ([(2048, 4096)], 0, 0), ((), 1, 100), ((), 64, 64 * 2000), ((), 256, 0)]:
            seconds = d.step_s(*args)
            assert 0 < d.mfu(d.flops(*args), seconds) < d.gpu.mfu
            assert 0 < d.mbu(d.bytes_moved(*args), seconds) < max(d.gpu.mbu, d.gpu.kv_read_efficiency)
    d = deploy("a100-80gb", "llama-2-7b")
    assert d.flops((), 1, 0) == 2 * 6_738_415_616
    assert d.bytes_moved((), 1, 1000) == 2 * 6_738_415_616 + 1000 * 512 * KIB
    assert d.bytes_moved((), 0, 0) == 0.0 and d.mfu(1.0, 0.0) == 0.0


# -- the static-batch estimate -------------------------------------------------------------------

def test_a_lone_request_s_first_token_is_one_prefill_step():
    d = deploy("a100-80gb", "llama-2-7b")
    estimate = estimate_static_batch(d, 1, 1000, 1)
    assert estimate.ttft_s == estimate.latency_s == pytest.approx(d.step_s([(1000, 0)], 0, 0))
    assert estimate.tpot_s == 0 and estimate.decode_steps == 0 and estimate.prefill_steps == 1


def test_prompts_are_prefilled_first_in_chunks_of_the_budget():
    d = deploy("a100-80gb", "llama-2-7b")
    estimate = estimate_static_batch(d, 4, 3000, 10, chunk_budget=8192)
    # 12,000 prompt tokens: 8,192 (two prompts and 2,192 of the third), then 3,808.
    first = d.step_s([(3000, 0), (3000, 0), (2192, 0)], 0, 0)
    second = d.step_s([(808, 2192), (3000, 0)], 0, 0)
    assert estimate.prefill_steps == 2
    assert estimate.ttft_s == pytest.approx((2 * first + 2 * (first + second)) / 4)
    assert estimate.ttft_max_s == pytest.approx(first + second)
    decode = d.decode_steps_s(4, 4 * 3000, 9)
    assert estimate.latency_s == pytest.approx(first + second + decode)
    assert estimate.tpot_s == pytest.approx((2 * (second + decode) + 2 * decode) / 4 / 9)
    assert estimate.output_tokens_per_s == pytest.approx(40 / estimate.latency_s)
    assert 0 < estimate.mfu < d.gpu.mfu and 0 < estimate.mbu < d.gpu.mbu


def test_a_batch_beyond_the_kv_capacity_is_refused():
    d = deploy("a100-40gb", "llama-2-13b")
    with pytest.raises(DeploymentError, match="exceed the capacity"):
        estimate_static_batch(d, 64, 2000, 2000)
    with pytest.raises(DeploymentError, match="max_context"):
        estimate_static_batch(d, 1, 4000, 200)
    with pytest.raises(ValueError, match="batch must be an integer >= 1"):
        estimate_static_batch(d, 0, 10, 10)


# -- profiles and the registry -------------------------------------------------------------------

def test_builtin_names():
    r = registry()
    assert [g.name for g in r.gpus()] == ["a100-40gb", "a100-80gb", "h100-sxm", "h200", "l40s"]
    assert [m.name for m in r.models()] == ["llama-2-13b", "llama-2-70b", "llama-2-7b", "llama-3-70b", "llama-3-8b", "llama-3.1-8b"]
    assert r.registered_by("gpu", "h200") == "builtin"


@pytest.mark.parametrize("model", BUILTIN_MODELS, ids=lambda m: m.name)
def test_builtin_parameter_counts_match_their_architecture(model):
    assert model.architecture_params() == model.params


def test_builtin_gpus_keep_the_reference_figures():
    by_name = {g.name: g for g in BUILTIN_GPUS}
    assert (by_name["a100-40gb"].bf16_tflops, by_name["a100-40gb"].hbm_gb_s, by_name["a100-40gb"].memory_gib) == (312, 1555, 40)
    assert (by_name["a100-80gb"].bf16_tflops, by_name["a100-80gb"].hbm_gb_s, by_name["a100-80gb"].memory_gib) == (312, 2039, 80)
    assert (by_name["h100-sxm"].bf16_tflops, by_name["h100-sxm"].hbm_gb_s, by_name["h100-sxm"].memory_gib) == (989, 3350, 80)
    assert (by_name["a100-80gb"].mfu, by_name["a100-80gb"].mbu) == (0.70, 0.77)


def test_unknown_names_list_the_known_ones():
    r = registry()
    with pytest.raises(ProfileError, match=r"unknown gpu profile 'b200' \(known: a100-40gb, a100-80gb, h100-sxm, h200, l40s\)"):
        r.get_gpu("b200")
    with pytest.raises(ProfileError, match=r"unknown model profile 'llama-4' \(known: llama-2-13b, .*llama-3.1-8b\)"):
        r.get_model("llama-4")
    with pytest.raises(ProfileError, match=r"known: none"):
        ProfileRegistry().get_model("llama-2-7b")


def test_duplicate_names_name_both_registrants():
    r = registry()
    r.current_plugin = "apsd-myprofiles"
    with pytest.raises(ProfileError, match="gpu profile 'h200' is registered twice: by builtin and by apsd-myprofiles"):
        r.gpu(BUILTIN_GPUS[3])
    with pytest.raises(ProfileError, match="model profile 'llama-2-7b' is registered twice"):
        r.model(BUILTIN_MODELS[0])
    with pytest.raises(ProfileError, match="expected apsd.engines.profiles.GpuProfile"):
        r.gpu(BUILTIN_MODELS[0])


def test_a_plugin_registers_like_a_builtin():
    r = ProfileRegistry()
    builtin_profiles(r)
    r.current_plugin = "apsd-b200"
    r.gpu(GpuProfile(name="b200", bf16_tflops=2250, hbm_gb_s=8000, memory_gib=180, price_per_hour_usd=6.0,
                     mfu=0.6, mbu=0.75))
    d = Deployment.build(r.get_gpu("b200"), r.get_model("llama-3-70b"))
    assert d.kv_capacity_tokens > 100_000
    assert r.registered_by("gpu", "b200") == "apsd-b200"


@pytest.mark.parametrize(("field", "value"), [("mfu", 1.5), ("mbu", 0), ("hbm_gb_s", -1), ("bf16_tflops", float("nan")),
                                              ("memory_gib", float("inf")), ("name", " a100 "), ("price_per_hour_usd", -0.1)])
def test_gpu_profiles_are_validated(field, value):
    good = {"name": "x", "bf16_tflops": 1.0, "hbm_gb_s": 1.0, "memory_gib": 1.0, "price_per_hour_usd": 1.0,
            "mfu": 0.5, "mbu": 0.5}
    with pytest.raises(ValueError, match=field):
        GpuProfile(**{**good, field: value})


def test_model_profiles_are_validated():
    with pytest.raises(ValueError, match="kv_heads"):
        ModelProfile(name="bad", params=1, layers=1, hidden=64, heads=6, kv_heads=4, head_dim=16, intermediate=1,
                     vocab=1, max_context=1)
    with pytest.raises(ValueError, match="layers"):
        ModelProfile(name="bad", params=1, layers=0, hidden=64, heads=4, kv_heads=4, head_dim=16, intermediate=1,
                     vocab=1, max_context=1)


def test_deployments_are_values():
    assert deploy("h200", "llama-3-8b") == deploy("h200", "llama-3-8b", max_context=8192)
    assert hash(deploy("h200", "llama-3-8b")) == hash(deploy("h200", "llama-3-8b"))
    assert deploy("h200", "llama-3-8b") != deploy("h200", "llama-3-8b", 2)
