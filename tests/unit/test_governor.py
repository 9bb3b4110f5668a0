import math

import pytest

from apsd.policies.governor import EntropyGovernor, EntropyParams, FixedGovernor, shannon_entropy_bits


def feed(governor, gaps_ms):
    t = 0.0
    governor.observe_arrival(t)
    for gap in gaps_ms:
        t += gap / 1000.0
        governor.observe_arrival(t)
    return governor.reading(t)


@pytest.mark.parametrize(
    ("gaps_ms", "bits", "state"),
    [
        ([5.0] * 49, 0.0, "STABLE"),                       # perfectly periodic
        ([0.0] * 49, 0.0, "STABLE"),                       # simultaneous burst: H = 0 too
        ([0.5, 1.5] * 20, 1.0, "STABLE"),                  # two 1 ms bins, equally likely
        ([0.5, 1.5, 2.5, 3.5] * 10, 2.0, "TRANSITIONAL"),  # four bins
        ([i + 0.5 for i in range(8)] * 5, 3.0, "CRITICAL_BURST"),
        ([i + 0.5 for i in range(50)], math.log2(50), "CRITICAL_BURST"),  # the bound log2(50)
    ],
)
def test_entropy_window_and_state(gaps_ms, bits, state):
    reading = feed(EntropyGovernor(EntropyParams()), gaps_ms)
    assert reading.entropy_bits == pytest.approx(bits)
    assert reading.state == state
    assert reading.window_s == pytest.approx(0.010 * math.exp(-bits / 5.0))


def test_entropy_uses_only_the_last_50_gaps():
    governor = EntropyGovernor(EntropyParams())
    reading = feed(governor, [i + 0.5 for i in range(8)] * 20 + [5.0] * 50)
    assert reading.entropy_bits == 0.0


def test_state_thresholds_are_configurable():
    params = EntropyParams(stable_below_bits=0.5, burst_above_bits=0.9, base_window_ms=20.0)
    reading = feed(EntropyGovernor(params), [0.5, 1.5] * 20)
    assert (reading.state, reading.window_s) == ("CRITICAL_BURST", pytest.approx(0.020 * math.exp(-0.2)))


def test_entropy_of_few_gaps_is_zero():
    assert shannon_entropy_bits([], 0.001) == 0.0
    assert shannon_entropy_bits([0.003], 0.001) == 0.0
    assert feed(EntropyGovernor(EntropyParams()), []).window_s == pytest.approx(0.010)


def test_fixed_governor():
    governor = FixedGovernor(0.025)
    governor.observe_arrival(1.0)
    assert governor.reading(2.0).window_s == 0.025
    assert governor.reading(2.0).state == "FIXED"


def test_incremental_entropy_equals_the_batch_formula_on_random_gaps():
    import random

    rng = random.Random(3)
    governor = EntropyGovernor(EntropyParams(history=50))
    t, gaps = 0.0, []
    governor.observe_arrival(t)
    for _ in range(500):
        gap = rng.choice([0.0, 0.0004, 0.0013, 0.002, rng.expovariate(200.0)])
        t += gap
        gaps.append(gap)
        governor.observe_arrival(t)
        expected = shannon_entropy_bits(gaps[-50:], 0.001)
        assert governor.reading(t).entropy_bits == pytest.approx(expected, abs=1e-9)


def test_gaps_are_forgotten_with_time_so_an_idle_governor_reads_stable():
    """Issue 11.1: the view ages with time, not only with arrivals."""
    governor = EntropyGovernor(EntropyParams(forget_after_s=10.0))
    burst = feed(governor, [i + 0.5 for i in range(8)] * 5)  # 40 gaps over ~0.16 s
    assert burst.state == "CRITICAL_BURST"
    last = 0.16
    assert governor.reading(last + 9.0).state == "CRITICAL_BURST"     # still remembered
    idle = governor.reading(last + 10.5)                               # every gap older than 10 s
    assert (idle.state, idle.entropy_bits) == ("STABLE", 0.0)
    assert idle.window_s == pytest.approx(0.010)


def test_forgetting_drops_only_the_gaps_older_than_the_memory():
    governor = EntropyGovernor(EntropyParams(forget_after_s=1.0))
    t = 0.0
    governor.observe_arrival(t)
    for gap_ms in [i + 0.5 for i in range(8)] * 4:    # 32 varied gaps, ending near t = 0.13 s
        t += gap_ms / 1000
        governor.observe_arrival(t)
    t = 2.0                                           # a second later: a periodic stream starts
    for _ in range(20):
        t += 0.005
        governor.observe_arrival(t)
    # the varied gaps closed more than 1 s ago are gone; what is left is the 5 ms gaps and the one
    # long gap (0.13 s -> 2.005 s) that opened the stream: two bins, 1 against 19
    reading = governor.reading(t)
    assert reading.entropy_bits == pytest.approx(shannon_entropy_bits([1.875] + [0.005] * 19, 0.001))
    assert reading.state == "STABLE"


def test_forget_after_zero_never_forgets():
    governor = EntropyGovernor(EntropyParams(forget_after_s=0.0))
    feed(governor, [i + 0.5 for i in range(8)] * 5)
    assert governor.reading(1e6).state == "CRITICAL_BURST"


def test_governors_declare_their_states():
    assert EntropyGovernor(EntropyParams()).states == ("STABLE", "TRANSITIONAL", "CRITICAL_BURST")
    assert FixedGovernor(0.01).states == ("FIXED",)
