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
