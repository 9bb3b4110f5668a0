"""Workload generators: defaults, determinism, shapes, and every error message (traces: test_traces.py)."""

from __future__ import annotations

import collections
import math
import statistics

import numpy as np
import pytest

from apsd.core.config import Config, TenantConfig
from apsd.engines.batch import GpuModel
from apsd.policies.governor import shannon_entropy_bits
from apsd.sim.records import Arrival, Workload
from apsd.sim.workloads import (
    KV_CAPACITY_TOKENS,
    WorkloadError,
    build_workload,
    list_workloads,
    load_params_file,
    parse_param_assignments,
)

BUILTIN_NAMES = ["seed-stress", "burst-50", "poisson", "periodic", "bursty", "vip-flood", "vtc-overload",
                 "head-of-line", "noisy-neighbor", "proportional", "on-off", "increase", "dist-shift", "shared-prefixes",
                 "multi-turn"]
#: Tenant isolation's workloads: each overloads the batch engine's GPU with its defaults.
ISOLATION_NAMES = ["noisy-neighbor", "proportional", "on-off", "increase", "dist-shift"]
DEFAULTS = {name: defaults for name, _, defaults in list_workloads()}
#: Every built-in draws something from its seed except the seed's own stress test.
RANDOM_NAMES = [n for n in BUILTIN_NAMES if n != "seed-stress"]


def seed_gpu_load(workload: Workload, batch: int = 16) -> float:
    """The seed GPU's busy seconds per second of arrivals, were every request in a full batch."""
    gpu = GpuModel(Config().gpu)
    busy = sum(a.prompt_tokens / gpu.gpu.prefill_tokens_per_s + a.output_tokens / gpu.decode_tokens_per_s(batch)
               for a in workload.arrivals)
    return busy / workload.params["duration"]


def only(workload: Workload, tenant: str) -> Workload:
    """``workload`` with only ``tenant``'s arrivals."""
    return Workload(workload.name, workload.description, tuple(a for a in workload.arrivals if a.tenant == tenant),
                    workload.tenants, workload.params, workload.seed)


def arrival_times(workload: Workload, tenant: str) -> list[float]:
    return [a.at for a in workload.arrivals if a.tenant == tenant]


def gaps(workload: Workload) -> np.ndarray:
    return np.diff([a.at for a in workload.arrivals])


def by_tenant(workload: Workload) -> dict[str, list[Arrival]]:
    grouped: dict[str, list[Arrival]] = collections.defaultdict(list)
    for arrival in workload.arrivals:
        grouped[arrival.tenant].append(arrival)
    return grouped


# --------------------------------------------------------------------------- every built-in


def test_the_builtins_are_exactly_these():
    assert [name for name, _, _ in list_workloads()] == BUILTIN_NAMES
    for name, description, defaults in list_workloads():
        assert description and "\n" not in description, name
        assert defaults, name


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_with_defaults_is_well_formed(name):
    workload = build_workload(name)
    assert workload.name == name
    assert workload.seed == 0
    assert workload.params == DEFAULTS[name]
    assert 100 <= len(workload.arrivals) <= 5000  # runs in well under a few seconds simulated
    times = [a.at for a in workload.arrivals]
    assert times == sorted(times)
    assert times[0] >= 0
    for a in workload.arrivals:
        assert type(a.at) is float and type(a.prompt_tokens) is int and type(a.output_tokens) is int
        assert type(a.bid) is int and type(a.tenant) is str
        assert a.prompt_tokens >= 1 and a.output_tokens >= 1
        assert a.prompt_tokens + a.output_tokens <= KV_CAPACITY_TOKENS
        assert 1 <= a.bid <= 10
        assert a.tenant in workload.tenants
    # every tenant is unthrottled: a bucket that no default workload can empty
    for bucket in workload.tenants.values():
        assert bucket == TenantConfig(rate=1e6, burst=10**9)
    assert sum(a.prompt_tokens + a.output_tokens for a in workload.arrivals) < 10**9


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_is_deterministic_for_a_seed(name):
    assert build_workload(name, seed=7) == build_workload(name, seed=7)
    assert build_workload(name, seed=7).seed == 7


@pytest.mark.parametrize("name", RANDOM_NAMES)
def test_a_different_seed_gives_different_arrivals(name):
    assert build_workload(name, seed=1).arrivals != build_workload(name, seed=2).arrivals


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_params_are_a_fresh_copy_per_workload(name):
    workload = build_workload(name, {})
    workload.params.clear()
    assert build_workload(name).params == DEFAULTS[name] != {}
    assert dict(list_workloads()[BUILTIN_NAMES.index(name)][2]) == DEFAULTS[name]


# --------------------------------------------------------------------------- each built-in's shape


def test_seed_stress_is_seed_002s_test():
    workload = build_workload("seed-stress")
    tenants = by_tenant(workload)
    assert {t: len(a) for t, a in tenants.items()} == {"tenant_a": 50, "tenant_b": 50}
    assert {a.bid for a in tenants["tenant_a"]} == {10}
    assert {a.bid for a in tenants["tenant_b"]} == {1}
    assert {a.at for a in workload.arrivals} == {0.0}
    assert {(a.prompt_tokens, a.output_tokens) for a in workload.arrivals} == {(16, 100)}
    assert [a.tenant for a in workload.arrivals[:4]] == ["tenant_a", "tenant_b", "tenant_a", "tenant_b"]
    # simultaneous arrivals: every gap is 0, so the seed's entropy is 0 (REFERENCE §1)
    assert shannon_entropy_bits(gaps(workload)[:50], 0.001) == 0.0


def test_seed_stress_counts_and_spread():
    workload = build_workload("seed-stress", {"vip_requests": 3, "free_requests": 1, "spread_s": 0.4})
    assert [(a.tenant, a.at) for a in workload.arrivals] == [
        ("tenant_a", 0.0), ("tenant_b", 0.1), ("tenant_a", 0.2), ("tenant_a", pytest.approx(0.3))]


def test_burst_50_every_tenant_bursts_at_once():
    workload = build_workload("burst-50")
    p = workload.params
    assert len(workload.tenants) == 50
    tenant_bids = {}
    for arrival in workload.arrivals:
        assert tenant_bids.setdefault(arrival.tenant, arrival.bid) == arrival.bid  # one bid per tenant
    assert sorted(set(tenant_bids.values())) == list(range(1, 11))
    in_burst = [a for a in workload.arrivals if p["burst_at"] <= a.at < p["burst_at"] + p["burst_window_s"]]
    assert len(in_burst) >= 50 * p["burst_requests"]
    assert collections.Counter(a.tenant for a in in_burst).most_common()[-1][1] >= p["burst_requests"]
    before = [a for a in workload.arrivals if a.at < p["burst_at"]]
    assert 0 < len(before) < 3 * p["background_rate"] * p["burst_at"]  # a quiet background
    # a burst of simultaneous arrivals has low entropy, not high (REFERENCE §1)
    burst_gaps = np.diff([a.at for a in in_burst])[:50]
    assert shannon_entropy_bits(burst_gaps, 0.001) < 1.0


def test_poisson_rate_sizes_and_tenants():
    workload = build_workload("poisson", {"rate": 10, "duration": 200, "tenants": 5})
    assert len(workload.arrivals) == pytest.approx(2000, rel=0.1)
    assert sorted(workload.tenants) == [f"tenant_{i:02d}" for i in range(5)]
    assert statistics.fmean(a.output_tokens for a in workload.arrivals) == pytest.approx(100, rel=0.1)
    assert statistics.fmean(a.prompt_tokens for a in workload.arrivals) == pytest.approx(256, rel=0.1)
    assert len({a.output_tokens for a in workload.arrivals}) > 20
    assert {a.bid for a in workload.arrivals} == set(range(1, 11))


def test_poisson_sigma_zero_gives_fixed_sizes():
    workload = build_workload("poisson", {"prompt_sigma": 0, "output_sigma": 0, "output_mean": 40})
    assert {(a.prompt_tokens, a.output_tokens) for a in workload.arrivals} == {(256, 40)}


def test_periodic_is_regular_with_zero_entropy():
    workload = build_workload("periodic")
    rate = workload.params["rate"]
    assert len(workload.arrivals) == rate * workload.params["duration"]
    assert np.allclose(gaps(workload), 1 / rate)
    assert shannon_entropy_bits(gaps(workload)[:50], 0.001) == 0.0


def test_bursty_has_periodics_mean_rate_and_much_higher_entropy():
    periodic, bursty = build_workload("periodic"), build_workload("bursty")
    assert periodic.params["rate"] == bursty.params["rate"]
    assert periodic.params["duration"] == bursty.params["duration"]
    assert len(bursty.arrivals) == len(periodic.arrivals)
    assert gaps(bursty).mean() == pytest.approx(gaps(periodic).mean(), rel=0.05)
    # same requests, only the timing differs
    assert [(a.tenant, a.bid, a.prompt_tokens) for a in bursty.arrivals] == [
        (a.tenant, a.bid, a.prompt_tokens) for a in periodic.arrivals]
    windows = [shannon_entropy_bits(gaps(bursty)[i:i + 50], 0.001) for i in range(0, 150, 50)]
    assert min(windows) > 3.0
    assert max(windows) <= math.log2(50) + 1e-9
    # bursts: most gaps are far shorter than the periodic gap, a few far longer
    assert np.median(gaps(bursty)) < 0.1 * gaps(periodic)[0]
    assert gaps(bursty).max() > 3 * gaps(periodic)[0]


def test_vip_flood_overloads_the_gpu_and_starves_free():
    workload = build_workload("vip-flood")
    tenants = by_tenant(workload)
    duration = workload.params["duration"]
    assert {a.bid for a in tenants["vip"]} == {10}
    assert {a.bid for a in tenants["free"]} == {1}
    assert len(tenants["vip"]) / duration > 3.6  # above the batched capacity (~3.6 req/s at b=16)
    assert 0 < len(tenants["free"]) < 0.1 * len(tenants["vip"])


def test_vtc_overload_rates_are_vtcs():
    workload = build_workload("vtc-overload")
    duration = workload.params["duration"]
    assert duration == 600
    tenants = by_tenant(workload)
    assert len(tenants["tenant_a"]) / duration == pytest.approx(1.5, rel=0.1)
    assert len(tenants["tenant_b"]) / duration == pytest.approx(3.0, rel=0.1)
    assert {(a.prompt_tokens, a.output_tokens) for a in workload.arrivals} == {(256, 256)}
    assert len({a.bid for a in workload.arrivals}) == 1


def test_head_of_line_has_a_few_huge_requests_with_any_bid():
    workload = build_workload("head-of-line", {"duration": 1000})
    small = workload.params["output_tokens"]
    huge = [a for a in workload.arrivals if a.output_tokens == small * workload.params["huge_factor"]]
    assert {a.output_tokens for a in workload.arrivals} == {small, small * 20}
    assert len(huge) == round(0.02 * len(workload.arrivals))
    assert max(a.bid for a in huge) > min(a.bid for a in workload.arrivals)


def test_head_of_line_has_a_huge_request_even_when_short():
    workload = build_workload("head-of-line", {"duration": 10})
    assert sum(a.output_tokens > 100 for a in workload.arrivals) == 1


# --------------------------------------------------------------------------- tenant isolation


@pytest.mark.parametrize("name", ISOLATION_NAMES)
def test_isolation_workloads_overload_the_seed_gpu_with_same_bid_tenants(name):
    workload = build_workload(name, seed=3)
    assert seed_gpu_load(workload) > 1.2
    assert len({a.bid for a in workload.arrivals}) == 1
    assert len(workload.tenants) >= 2


def test_noisy_neighbor_steady_tenant_is_regular_beside_a_flood():
    workload = build_workload("noisy-neighbor")
    p = workload.params
    steady = [a for a in workload.arrivals if a.tenant == "steady"]
    assert [a.at for a in steady] == pytest.approx([i / p["steady_rate"] for i in range(60)])
    assert {(a.prompt_tokens, a.output_tokens) for a in steady} == {(64, 64)}
    neighbor = [a for a in workload.arrivals if a.tenant == "neighbor"]
    assert len(neighbor) / p["duration"] == pytest.approx(10, rel=0.1)
    assert {(a.prompt_tokens, a.output_tokens) for a in neighbor} == {(64, 128)}
    assert seed_gpu_load(only(workload, "neighbor")) > 1.5  # the neighbour alone overloads the GPU
    assert list(workload.tenants) == ["steady", "neighbor"]


def test_noisy_neighbor_steady_arrivals_do_not_depend_on_the_neighbour():
    with_neighbor = build_workload("noisy-neighbor", seed=1)
    alone = build_workload("noisy-neighbor", {"neighbor_rate": 0}, seed=1)
    assert {a.tenant for a in alone.arrivals} == {"steady"} and list(alone.tenants) == ["steady"]
    steady = [a for a in with_neighbor.arrivals if a.tenant == "steady"]
    assert list(alone.arrivals) == steady
    other = build_workload("noisy-neighbor", {"neighbor_rate": 30, "neighbor_output_tokens": 500, "neighbor_bid": 9},
                           seed=2)
    assert [a for a in other.arrivals if a.tenant == "steady"] == steady


def test_proportional_rates_are_one_two_three_times_rate():
    workload = build_workload("proportional", {"duration": 600})
    counts = collections.Counter(a.tenant for a in workload.arrivals)
    rate = workload.params["rate"]
    for i, tenant in enumerate(sorted(workload.tenants)):
        assert counts[tenant] / 600 == pytest.approx((i + 1) * rate, rel=0.1)
    # all backlogged: even the slowest tenant asks for more than an equal share of the seed GPU
    assert seed_gpu_load(only(workload, "tenant_00")) > 1 / len(workload.tenants)
    assert build_workload("proportional", {"tenants": 5}).tenants.keys() == {f"tenant_0{i}" for i in range(5)}


def test_on_off_tenant_sends_only_in_its_on_periods():
    workload = build_workload("on-off")
    period = workload.params["period_s"]
    on_off = arrival_times(workload, "on_off")
    assert all(int(t // period) % 2 == 0 for t in on_off)
    # every on period has arrivals, at about on_rate
    per_period = collections.Counter(int(t // period) for t in on_off)
    assert sorted(per_period) == [0, 2, 4, 6, 8]
    assert min(per_period.values()) / period == pytest.approx(workload.params["on_rate"], rel=0.25)
    steady = arrival_times(workload, "steady")
    assert len(steady) / workload.params["duration"] == pytest.approx(3, rel=0.1)
    assert {int(t // period) for t in steady} == set(range(10))  # the steady tenant never stops


def test_increase_rate_grows_linearly_beside_a_constant_tenant():
    workload = build_workload("increase", {"duration": 3000})
    thirds = [collections.Counter(int(t // 1000) for t in arrival_times(workload, tenant))
              for tenant in ("constant", "increasing")]
    assert [thirds[0][k] / 1000 for k in range(3)] == pytest.approx([0.5] * 3, rel=0.15)
    # the ramp's mean rate in each third: 0.2 + 1.8 * (k + 0.5) / 3
    assert [thirds[1][k] / 1000 for k in range(3)] == pytest.approx([0.5, 1.1, 1.7], rel=0.1)
    flat = build_workload("increase", {"start_rate": 1.0, "end_rate": 1.0, "duration": 3000})
    assert len(arrival_times(flat, "increasing")) / 3000 == pytest.approx(1.0, rel=0.1)
    from_zero = build_workload("increase", {"start_rate": 0, "duration": 600})
    assert min(arrival_times(from_zero, "increasing")) > 1  # the rate starts at 0: 1/600 arrivals expected by 1 s


def test_dist_shift_tenants_swap_request_shapes_at_shift_at():
    workload = build_workload("dist-shift", {"duration": 400, "shift_at": 100})
    for tenant, long_prompts_first in (("tenant_a", True), ("tenant_b", False)):
        for before in (True, False):
            mine = [a for a in workload.arrivals if a.tenant == tenant and (a.at < 100) == before]
            prompt = statistics.fmean(a.prompt_tokens for a in mine)
            output = statistics.fmean(a.output_tokens for a in mine)
            long_prompts = long_prompts_first == before
            assert (prompt, output) == (pytest.approx(512 if long_prompts else 32, rel=0.15),
                                        pytest.approx(32 if long_prompts else 512, rel=0.15))
    assert len({a.prompt_tokens for a in workload.arrivals}) > 50  # lognormal sizes
    fixed = build_workload("dist-shift", {"sigma": 0})
    assert {(a.prompt_tokens, a.output_tokens) for a in fixed.arrivals} == {(512, 32), (32, 512)}


# --------------------------------------------------------------------------- parameters


def test_params_override_defaults_and_numbers_become_floats():
    workload = build_workload("periodic", {"rate": 5, "duration": 10, "tenants": 2})
    assert workload.params == {**DEFAULTS["periodic"], "rate": 5.0, "duration": 10.0, "tenants": 2}
    assert type(workload.params["rate"]) is float
    assert len(workload.arrivals) == 50
    assert set(workload.tenants) == {"tenant_00", "tenant_01"}


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("poisson", {"rat": 1},
         "workload 'poisson': unknown parameter 'rat' (parameters: duration, output_mean, output_sigma, "
         "prompt_mean, prompt_sigma, rate, tenants)"),
        ("poisson", {"tenants": True}, "workload 'poisson': tenants: must be an integer, got True"),
        ("poisson", {"tenants": 2.5}, "workload 'poisson': tenants: must be an integer, got 2.5"),
        ("poisson", {"rate": "5"}, "workload 'poisson': rate: must be a number, got '5'"),
        ("poisson", {"rate": False}, "workload 'poisson': rate: must be a number, got False"),
        ("poisson", {"rate": -1}, "workload 'poisson': rate: must be > 0, got -1"),
        ("poisson", {"rate": math.nan}, "workload 'poisson': rate: must be a finite number, got nan"),
        ("periodic", {"duration": 0}, "workload 'periodic': duration: must be > 0, got 0"),
        ("vtc-overload", {"bid": 11}, "workload 'vtc-overload': bid: must be between 1 and 10, got 11"),
        ("seed-stress", {"vip_requests": -1},
         "workload 'seed-stress': vip_requests: must be between 0 and 2e+06, got -1"),
        ("poisson", {"rate": 1000, "duration": 10_000},
         "workload 'poisson': rate * duration: asks for about 10,000,000 arrivals (limit 2,000,000)"),
        ("seed-stress", {"vip_requests": 1_200_000, "free_requests": 1_200_000},
         "workload 'seed-stress': vip_requests + free_requests: asks for about 2,400,000 arrivals "
         "(limit 2,000,000)"),
        ("head-of-line", {"huge_factor": 400},
         "workload 'head-of-line': huge_factor: prompt_tokens + output_tokens * huge_factor must be "
         "<= 32768, got 40064"),
        ("periodic", {"prompt_tokens": 30000, "output_tokens": 3000},
         "workload 'periodic': output_tokens: prompt_tokens + output_tokens must be <= 32768, got 33000"),
        ("burst-50", {"burst_at": 100}, "workload 'burst-50': burst_at: must be <= duration (60), got 100"),
        ("bursty", {"burst_gap_ms": 1000},
         "workload 'bursty': burst_gap_ms: a burst of 10 requests 1000 ms apart lasts longer than "
         "burst_size/rate = 5 s; lower it"),
        ("seed-stress", {"vip_requests": 0, "free_requests": 0},
         "workload 'seed-stress': generated no arrivals (raise the rate, duration or counts)"),
        ("noisy-neighbor", {"neighbor_rate": -1},
         "workload 'noisy-neighbor': neighbor_rate: must be between 0 and 1e+06, got -1"),
        ("noisy-neighbor", {"steady_rate": 0}, "workload 'noisy-neighbor': steady_rate: must be > 0, got 0"),
        ("noisy-neighbor", {"neighbor_prompt_tokens": 30000, "neighbor_output_tokens": 3000},
         "workload 'noisy-neighbor': neighbor_output_tokens: neighbor_prompt_tokens + neighbor_output_tokens "
         "must be <= 32768, got 33000"),
        ("noisy-neighbor", {"steady_bid": 0}, "workload 'noisy-neighbor': steady_bid: must be between 1 and 10, got 0"),
        ("noisy-neighbor", {"neighbor_rate": 1e5, "duration": 100},
         "workload 'noisy-neighbor': (steady_rate + neighbor_rate) * duration: asks for about 10,000,050 arrivals "
         "(limit 2,000,000)"),
        ("proportional", {"tenants": 1}, "workload 'proportional': tenants: must be between 2 and 100, got 1"),
        ("on-off", {"period_s": 0}, "workload 'on-off': period_s: must be > 0, got 0"),
        ("increase", {"start_rate": 3, "end_rate": 2},
         "workload 'increase': end_rate: must be >= start_rate (3), got 2"),
        ("increase", {"start_rate": -0.5}, "workload 'increase': start_rate: must be between 0 and 1e+06, got -0.5"),
        ("dist-shift", {"shift_at": 200}, "workload 'dist-shift': shift_at: must be <= duration (120), got 200"),
        ("dist-shift", {"long_tokens": 20000},
         "workload 'dist-shift': long_tokens: must be between 1 and 16384, got 20000"),
    ],
)
def test_bad_params_are_named(name, params, message):
    with pytest.raises(WorkloadError) as info:
        build_workload(name, params)
    assert str(info.value) == message


def test_unknown_workload_lists_the_builtins():
    with pytest.raises(WorkloadError) as info:
        build_workload("poison")
    assert str(info.value) == f"unknown workload 'poison' (built-ins: {', '.join(BUILTIN_NAMES)})"


def test_parse_param_assignments_reads_toml_values():
    assert parse_param_assignments(
        ["rate=5", "duration=60.5", "flag=true", "name=steady", 'quoted="a b"', " tenants = 8 ", "empty="]
    ) == {"rate": 5, "duration": 60.5, "flag": True, "name": "steady", "quoted": "a b", "tenants": 8, "empty": ""}
    assert parse_param_assignments(["rate=1", "rate=2"]) == {"rate": 2}
    assert parse_param_assignments([]) == {}


@pytest.mark.parametrize("item", ["rate", "=5", " =5"])
def test_parse_param_assignments_needs_key_equals_value(item):
    with pytest.raises(WorkloadError) as info:
        parse_param_assignments(["duration=1", item])
    assert str(info.value) == f"parameter {item!r}: expected key=value (e.g. rate=5)"


def test_cli_assignments_feed_build_workload():
    workload = build_workload("poisson", parse_param_assignments(["rate=5", "duration=60", "tenants=8"]))
    assert (workload.params["rate"], workload.params["duration"], workload.params["tenants"]) == (5.0, 60.0, 8)
    with pytest.raises(WorkloadError, match="rate: must be a number, got 'fast'"):
        build_workload("poisson", parse_param_assignments(["rate=fast"]))


def test_load_params_file(tmp_path):
    path = tmp_path / "params.toml"
    path.write_text("rate = 3\nduration = 20.0\n")
    assert load_params_file(path) == {"rate": 3, "duration": 20.0}
    assert build_workload("poisson", load_params_file(path)).params["rate"] == 3.0


def test_load_params_file_errors(tmp_path):
    with pytest.raises(WorkloadError) as info:
        load_params_file(tmp_path / "none.toml")
    assert str(info.value) == f"{tmp_path / 'none.toml'}: no such parameter file"
    bad = tmp_path / "bad.toml"
    bad.write_text("rate = \n")
    with pytest.raises(WorkloadError, match=r"bad\.toml: TOML syntax error"):
        load_params_file(bad)
