"""The built-in workloads: one generator per scenario (and its cross-checks), and :data:`BUILTINS`, the
table of their names, descriptions, parameters and sizes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from apsd.core.routing import synthetic_blocks
from apsd.sim.records import Arrival
from apsd.sim.workloads.arrivals import (
    Generated,
    fits_kv,
    lognormal_tokens,
    make_arrivals,
    poisson_times,
    ramp_times,
    regular_count,
    regular_times,
    tenant_arrivals,
    tenant_names,
    uniform_bids,
)
from apsd.sim.workloads.params import KV_CAPACITY_TOKENS, Param, bid, count, mean_tokens, positive, sigma, tokens


def seed_stress(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """A high bidder against a low one: VIP and free requests interleaved, all at once (or spread evenly)."""
    vip = ["tenant_a"] * p["vip_requests"]
    free = ["tenant_b"] * p["free_requests"]
    order = [t for pair in zip(vip, free) for t in pair] + vip[len(free):] + free[len(vip):]
    times = [i * p["spread_s"] / len(order) for i in range(len(order))]
    bids = [10 if tenant == "tenant_a" else 1 for tenant in order]
    return Generated(make_arrivals(times, order, p["prompt_tokens"], p["output_tokens"], bids),
                     ["tenant_a", "tenant_b"])


def burst_50(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """A quiet Poisson background over all tenants, then every tenant bursts at ``burst_at``."""
    names = tenant_names(p["tenants"])
    tenant_bid = np.array([1 + i * 10 // len(names) for i in range(len(names))])
    background = poisson_times(rng, p["background_rate"], p["duration"])
    background_tenant = rng.integers(0, len(names), background.size)
    burst = p["burst_at"] + rng.uniform(0.0, p["burst_window_s"], (len(names), p["burst_requests"]))
    burst_tenant = np.repeat(np.arange(len(names)), p["burst_requests"])
    times = np.concatenate([background, burst.ravel()])
    who = np.concatenate([background_tenant, burst_tenant]).astype(np.int64)
    arrivals = make_arrivals(times, np.array(names)[who], p["prompt_tokens"], p["output_tokens"], tenant_bid[who])
    return Generated(arrivals, names)


def check_burst_50(p: Mapping[str, Any]) -> None:
    fits_kv(p)
    if p["burst_at"] > p["duration"]:
        raise ValueError(f"burst_at: must be <= duration ({p['duration']:g}), got {p['burst_at']:g}")


def poisson(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """Poisson arrivals over equal tenants; lognormal sizes; uniform bids."""
    names = tenant_names(p["tenants"])
    times = poisson_times(rng, p["rate"], p["duration"])
    size = times.size
    who = rng.integers(0, len(names), size)
    prompts = lognormal_tokens(rng, p["prompt_mean"], p["prompt_sigma"], size)
    outputs = lognormal_tokens(rng, p["output_mean"], p["output_sigma"], size)
    return Generated(make_arrivals(times, np.array(names)[who], prompts, outputs, uniform_bids(rng, size)), names)


def regular_requests(p: Mapping[str, Any], rng: np.random.Generator,
                     size: int) -> tuple[list[str], list[str], NDArray[np.int64]]:
    """What ``periodic`` and ``bursty`` share for one seed: round-robin tenants and the same bids."""
    names = tenant_names(p["tenants"])
    return names, [names[i % len(names)] for i in range(size)], uniform_bids(rng, size)


def periodic(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """One arrival every ``1/rate`` seconds exactly: every gap equal, entropy 0."""
    size = regular_count(p["rate"], p["duration"])
    names, who, bids = regular_requests(p, rng, size)
    times = regular_times(p["rate"], p["duration"])
    return Generated(make_arrivals(times, who, p["prompt_tokens"], p["output_tokens"], bids), names)


def bursty(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """``periodic``'s requests (same count, tenants, bids, sizes) in on/off bursts.

    Each gap is, with probability ``1/burst_size``, an off period (exponential)
    and otherwise an in-burst gap (exponential, mean ``burst_gap_ms``): bursts
    hold ``burst_size`` requests on average. The gaps are then scaled to sum to
    ``duration``, so the mean rate is exactly ``periodic``'s.
    """
    size = regular_count(p["rate"], p["duration"])
    names, who, bids = regular_requests(p, rng, size)
    in_burst_gap = p["burst_gap_ms"] / 1000
    off_gap = off_period_s(p)
    is_off = rng.random(size) < 1 / p["burst_size"]
    gaps = np.where(is_off, rng.exponential(off_gap, size), rng.exponential(in_burst_gap, size))
    gaps *= p["duration"] / gaps.sum()
    times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return Generated(make_arrivals(times, who, p["prompt_tokens"], p["output_tokens"], bids), names)


def off_period_s(p: Mapping[str, Any]) -> float:
    """The mean off period that keeps the mean gap at ``1/rate``."""
    return float(p["burst_size"] / p["rate"] - (p["burst_size"] - 1) * p["burst_gap_ms"] / 1000)


def check_bursty(p: Mapping[str, Any]) -> None:
    fits_kv(p)
    if off_period_s(p) <= 0:
        raise ValueError(f"burst_gap_ms: a burst of {p['burst_size']:g} requests {p['burst_gap_ms']:g} ms apart "
                         f"lasts longer than burst_size/rate = {p['burst_size'] / p['rate']:g} s; lower it")


def vip_flood(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """A VIP tenant's Poisson flood above GPU capacity and a free tenant's trickle."""
    vip = poisson_times(rng, p["vip_rate"], p["duration"])
    free = poisson_times(rng, p["free_rate"], p["duration"])
    arrivals = (make_arrivals(vip, "vip", p["prompt_tokens"], p["output_tokens"], p["vip_bid"])
                + make_arrivals(free, "free", p["prompt_tokens"], p["output_tokens"], p["free_bid"]))
    return Generated(arrivals, ["vip", "free"])


def vtc_overload(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """VTC's overload experiment: two Poisson tenants, equal bids, fixed sizes."""
    arrivals = [arrival for tenant, rate in (("tenant_a", p["rate_a"]), ("tenant_b", p["rate_b"]))
                for arrival in tenant_arrivals(poisson_times(rng, rate, p["duration"]), tenant, p)]
    return Generated(arrivals, ["tenant_a", "tenant_b"])


def head_of_line(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """Poisson small requests with a few huge ones (``huge_factor`` x the output) among them."""
    names = tenant_names(p["tenants"])
    times = poisson_times(rng, p["rate"], p["duration"])
    size = times.size
    who = rng.integers(0, len(names), size)
    bids = uniform_bids(rng, size)  # independent of size: a huge request is not always the lowest bid
    huge_count = min(size, max(1, round(size * p["huge_fraction"]))) if p["huge_fraction"] > 0 else 0
    outputs = np.full(size, p["output_tokens"], dtype=np.int64)
    outputs[rng.choice(size, huge_count, replace=False)] *= p["huge_factor"]
    return Generated(make_arrivals(times, np.array(names)[who], p["prompt_tokens"], outputs, bids), names)


def check_head_of_line(p: Mapping[str, Any]) -> None:
    total = p["prompt_tokens"] + p["output_tokens"] * p["huge_factor"]
    if total > KV_CAPACITY_TOKENS:
        raise ValueError(f"huge_factor: prompt_tokens + output_tokens * huge_factor must be "
                         f"<= {KV_CAPACITY_TOKENS}, got {total}")


def noisy_neighbor(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """A steady tenant's regular requests beside a same-bid neighbour's Poisson flood.

    The steady tenant's arrivals (every ``1/steady_rate`` s from t = 0) draw nothing from the
    seed, so they are the same whatever the neighbour sends; with ``neighbor_rate = 0`` the
    workload is the steady tenant alone, and ``neighbor`` is not one of its tenants.
    """
    steady = tenant_arrivals(regular_times(p["steady_rate"], p["duration"]), "steady", p, "steady_")
    neighbor = tenant_arrivals(poisson_times(rng, p["neighbor_rate"], p["duration"]), "neighbor", p, "neighbor_")
    return Generated(steady + neighbor, ["steady", "neighbor"] if p["neighbor_rate"] > 0 else ["steady"])


def check_noisy_neighbor(p: Mapping[str, Any]) -> None:
    for prefix in ("steady_", "neighbor_"):
        fits_kv(p, f"{prefix}prompt_tokens", f"{prefix}output_tokens")


def proportional(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """VTC's proportional experiment: tenant ``i`` sends Poisson arrivals at ``(i + 1) * rate``."""
    names = tenant_names(p["tenants"])
    arrivals = [arrival for i, name in enumerate(names)
                for arrival in tenant_arrivals(poisson_times(rng, (i + 1) * p["rate"], p["duration"]), name, p)]
    return Generated(arrivals, names)


def on_off(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """VTC's on-off experiment: a steady Poisson tenant, and one whose Poisson arrivals fall only in
    its on periods: on for ``period_s`` from t = 0, then off for ``period_s``, and so on."""
    steady = poisson_times(rng, p["steady_rate"], p["duration"])
    switching = poisson_times(rng, p["on_rate"], p["duration"])
    switching = switching[np.floor(switching / p["period_s"]) % 2 == 0]
    return Generated(tenant_arrivals(steady, "steady", p) + tenant_arrivals(switching, "on_off", p),
                     ["steady", "on_off"])


def increase(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """VTC's increase experiment: a constant-rate tenant beside one whose rate ramps linearly (Poisson both)."""
    constant = poisson_times(rng, p["constant_rate"], p["duration"])
    rising = ramp_times(rng, p["start_rate"], p["end_rate"], p["duration"])
    return Generated(tenant_arrivals(constant, "constant", p) + tenant_arrivals(rising, "increasing", p),
                     ["constant", "increasing"])


def check_increase(p: Mapping[str, Any]) -> None:
    fits_kv(p)
    if p["end_rate"] < p["start_rate"]:
        raise ValueError(f"end_rate: must be >= start_rate ({p['start_rate']:g}), got {p['end_rate']:g}")


def dist_shift(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """Two Poisson tenants with opposite request shapes that swap at ``shift_at``.

    Before it, ``tenant_a`` sends long prompts and short outputs and ``tenant_b`` short prompts
    and long outputs; from it on, the reverse. Each request draws one long and one short size
    (lognormal, means ``long_tokens`` and ``short_tokens``). (VTC's own distribution-shift run
    changes the tenants' rates between phases, which ``on-off`` and ``proportional`` cover.)
    """
    arrivals: list[Arrival] = []
    for tenant, rate, long_prompts_first in (("tenant_a", p["rate_a"], True), ("tenant_b", p["rate_b"], False)):
        times = poisson_times(rng, rate, p["duration"])
        longs = lognormal_tokens(rng, p["long_tokens"], p["sigma"], times.size)
        shorts = lognormal_tokens(rng, p["short_tokens"], p["sigma"], times.size)
        long_prompt = (times < p["shift_at"]) == long_prompts_first
        arrivals += make_arrivals(times, tenant, np.where(long_prompt, longs, shorts),
                                  np.where(long_prompt, shorts, longs), p["bid"])
    return Generated(arrivals, ["tenant_a", "tenant_b"])


def check_dist_shift(p: Mapping[str, Any]) -> None:
    if p["shift_at"] > p["duration"]:
        raise ValueError(f"shift_at: must be <= duration ({p['duration']:g}), got {p['shift_at']:g}")


def zipf_choices(rng: np.random.Generator, population: int, exponent: float, size: int) -> NDArray[np.int64]:
    """``size`` draws from ``0..population-1`` with P(k) proportional to 1 / (k + 1) ** exponent."""
    weights = 1.0 / np.arange(1, population + 1, dtype=float) ** exponent
    return rng.choice(population, size=size, p=weights / weights.sum())


def shared_prefixes(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """Poisson arrivals whose prompts start with one of ``prefixes`` shared prefixes (documents,
    system prompts), drawn by a Zipf law, then ``suffix_tokens`` of their own."""
    names = tenant_names(p["tenants"])
    times = poisson_times(rng, p["rate"], p["duration"])
    which = zipf_choices(rng, p["prefixes"], p["zipf"], times.size)
    who = rng.integers(0, len(names), times.size)
    prompt = p["prefix_tokens"] + p["suffix_tokens"]
    arrivals = [Arrival(at=float(at), tenant=names[int(t)], prompt_tokens=prompt, output_tokens=p["output_tokens"],
                        bid=5, prefix_blocks=synthetic_blocks((int(k), p["prefix_tokens"]), n, prompt))
                for n, (at, k, t) in enumerate(zip(times, which, who))]
    return Generated(arrivals, names)


def multi_turn(p: Mapping[str, Any], rng: np.random.Generator) -> Generated:
    """Conversations starting as a Poisson process, each with its own system prompt and ``turns``
    turns: a turn's prompt is the whole conversation so far (system prompt, earlier questions and
    answers) and its question; the next turn comes its answer's length in decode time plus an
    exponential think time later."""
    names = tenant_names(p["tenants"])
    starts = poisson_times(rng, p["rate"], p["duration"])
    arrivals: list[Arrival] = []
    for c, start in enumerate(starts):
        tenant = names[int(rng.integers(0, len(names)))]
        at = float(start)
        for turn in range(p["turns"]):
            prompt = p["system_tokens"] + turn * (p["user_tokens"] + p["output_tokens"]) + p["user_tokens"]
            arrivals.append(Arrival(at=at, tenant=tenant, prompt_tokens=prompt, output_tokens=p["output_tokens"],
                                    bid=5, prefix_blocks=synthetic_blocks((c, prompt), 0, prompt)))
            at += float(rng.exponential(p["think_s"])) + 0.02 * p["output_tokens"]
    return Generated(arrivals, names)


def check_multi_turn(p: Mapping[str, Any]) -> None:
    longest = p["system_tokens"] + p["turns"] * (p["user_tokens"] + p["output_tokens"])
    if longest > KV_CAPACITY_TOKENS:
        raise ValueError(f"turns: the last turn's conversation ({longest} tokens) must be <= {KV_CAPACITY_TOKENS}")


@attrs.frozen
class Builtin:
    """A built-in workload: its parameters, how many arrivals they ask for, and the generator."""

    name: str
    description: str
    params: dict[str, Param]
    generate: Callable[[Mapping[str, Any], np.random.Generator], Generated]
    #: The expected number of arrivals and the parameters that set it (for the size limit).
    expected_arrivals: Callable[[Mapping[str, Any]], tuple[float, str]]
    #: Checks across parameters; ``ValueError("param: problem")``.
    check: Callable[[Mapping[str, Any]], None] = fits_kv


BUILTINS: dict[str, Builtin] = {b.name: b for b in [
    Builtin(
        "seed-stress",
        "a high bidder against a low one: tenant_a (bid 10) x 50 and tenant_b (bid 1) x 50, interleaved, all at t=0",
        {"vip_requests": count(50), "free_requests": count(50), "prompt_tokens": tokens(16),
         "output_tokens": tokens(100), "spread_s": Param(0.0, 0, 1e6)},
        seed_stress,
        lambda p: (p["vip_requests"] + p["free_requests"], "vip_requests + free_requests"),
    ),
    Builtin(
        "burst-50",
        "50 tenants (bids 1-10): a quiet Poisson background, then all burst together at burst_at",
        {"tenants": count(50, 1, 10_000), "duration": positive(60), "background_rate": Param(0.5, 0, 1e6),
         "burst_at": Param(30.0, 0, 1e6), "burst_requests": count(4), "burst_window_s": Param(0.05, 0, 1e6),
         "prompt_tokens": tokens(64), "output_tokens": tokens(100)},
        burst_50,
        lambda p: (p["background_rate"] * p["duration"] + p["tenants"] * p["burst_requests"],
                   "background_rate * duration + tenants * burst_requests"),
        check_burst_50,
    ),
    Builtin(
        "poisson",
        "steady Poisson arrivals over equal tenants; lognormal sizes; bids uniform 1-10",
        {"rate": positive(2), "duration": positive(120), "tenants": count(4, 1, 10_000),
         "prompt_mean": mean_tokens(256), "prompt_sigma": sigma(0.5),
         "output_mean": mean_tokens(100), "output_sigma": sigma(0.5)},
        poisson,
        lambda p: (p["rate"] * p["duration"], "rate * duration"),
        lambda p: None,
    ),
    Builtin(
        "periodic",
        "one arrival every 1/rate s exactly (inter-arrival entropy 0); tenants round-robin, bids 1-10",
        {"rate": positive(2), "duration": positive(120), "tenants": count(4, 1, 10_000),
         "prompt_tokens": tokens(64), "output_tokens": tokens(100)},
        periodic,
        lambda p: (regular_count(p["rate"], p["duration"]), "rate * duration"),
    ),
    Builtin(
        "bursty",
        "periodic's requests at the same mean rate, in on/off bursts with exponential gaps (high entropy)",
        {"rate": positive(2), "duration": positive(120), "tenants": count(4, 1, 10_000),
         "prompt_tokens": tokens(64), "output_tokens": tokens(100),
         "burst_size": Param(10.0, 1, 1e6), "burst_gap_ms": positive(20, 1e9)},
        bursty,
        lambda p: (regular_count(p["rate"], p["duration"]), "rate * duration"),
        check_bursty,
    ),
    Builtin(
        "vip-flood",
        "a VIP (bid 10) flooding above GPU capacity and a free tenant's (bid 1) trickle: starvation",
        {"duration": positive(120), "vip_rate": positive(5), "free_rate": positive(0.2),
         "prompt_tokens": tokens(64), "output_tokens": tokens(100), "vip_bid": bid(10), "free_bid": bid(1)},
        vip_flood,
        lambda p: ((p["vip_rate"] + p["free_rate"]) * p["duration"], "(vip_rate + free_rate) * duration"),
    ),
    Builtin(
        "vtc-overload",
        "VTC's overload experiment: two tenants at 1.5 and 3 req/s (Poisson), 256 in / 256 out",
        {"duration": positive(600), "rate_a": positive(1.5), "rate_b": positive(3),
         "prompt_tokens": tokens(256), "output_tokens": tokens(256), "bid": bid(5)},
        vtc_overload,
        lambda p: ((p["rate_a"] + p["rate_b"]) * p["duration"], "(rate_a + rate_b) * duration"),
    ),
    Builtin(
        "head-of-line",
        "Poisson small requests with 2% huge ones (20x the output tokens); bids uniform 1-10 for all",
        {"rate": positive(2), "duration": positive(120), "tenants": count(4, 1, 10_000),
         "prompt_tokens": tokens(64), "output_tokens": tokens(100),
         "huge_fraction": Param(0.02, 0, 1), "huge_factor": count(20, 1, KV_CAPACITY_TOKENS)},
        head_of_line,
        lambda p: (p["rate"] * p["duration"], "rate * duration"),
        check_head_of_line,
    ),
    Builtin(
        "noisy-neighbor",
        "a steady tenant (0.5 req/s, regular) beside a same-bid neighbour's Poisson flood of 10 req/s, "
        "above GPU capacity",
        {"duration": positive(120), "steady_rate": positive(0.5), "steady_prompt_tokens": tokens(64),
         "steady_output_tokens": tokens(64), "steady_bid": bid(5), "neighbor_rate": Param(10.0, 0, 1e6),
         "neighbor_prompt_tokens": tokens(64), "neighbor_output_tokens": tokens(128), "neighbor_bid": bid(5)},
        noisy_neighbor,
        lambda p: (regular_count(p["steady_rate"], p["duration"]) + p["neighbor_rate"] * p["duration"],
                   "(steady_rate + neighbor_rate) * duration"),
        check_noisy_neighbor,
    ),
    Builtin(
        "proportional",
        "VTC's proportional experiment: 3 tenants at 0.5, 1 and 1.5 req/s (Poisson), all above their "
        "fair share, 256 in / 256 out",
        {"duration": positive(120), "tenants": count(3, 2, 100), "rate": positive(0.5),
         "prompt_tokens": tokens(256), "output_tokens": tokens(256), "bid": bid(5)},
        proportional,
        lambda p: (p["rate"] * p["tenants"] * (p["tenants"] + 1) / 2 * p["duration"],
                   "rate * tenants * (tenants + 1) / 2 * duration"),
    ),
    Builtin(
        "on-off",
        "VTC's on-off experiment: a steady tenant at 3 req/s beside one at 2 req/s in 60 s on / 60 s off "
        "periods (Poisson), 256 in / 256 out",
        {"duration": positive(600), "steady_rate": positive(3), "on_rate": positive(2), "period_s": positive(60),
         "prompt_tokens": tokens(256), "output_tokens": tokens(256), "bid": bid(5)},
        on_off,
        lambda p: ((p["steady_rate"] + p["on_rate"]) * p["duration"], "(steady_rate + on_rate) * duration"),
    ),
    Builtin(
        "increase",
        "VTC's increase experiment: a tenant at 0.5 req/s beside one whose rate ramps from 0.2 to 2 req/s "
        "(Poisson), 256 in / 256 out",
        {"duration": positive(600), "constant_rate": positive(0.5), "start_rate": Param(0.2, 0, 1e6),
         "end_rate": positive(2), "prompt_tokens": tokens(256), "output_tokens": tokens(256), "bid": bid(5)},
        increase,
        lambda p: ((p["constant_rate"] + (p["start_rate"] + p["end_rate"]) / 2) * p["duration"],
                   "(constant_rate + (start_rate + end_rate) / 2) * duration"),
        check_increase,
    ),
    Builtin(
        "dist-shift",
        "two tenants at 1 req/s each (Poisson) with opposite sizes, 512 in / 32 out against 32 in / 512 out "
        "(lognormal), swapped halfway",
        {"duration": positive(120), "rate_a": positive(1), "rate_b": positive(1), "shift_at": Param(60.0, 0, 1e6),
         "long_tokens": mean_tokens(512), "short_tokens": mean_tokens(32), "sigma": sigma(0.5), "bid": bid(5)},
        dist_shift,
        lambda p: ((p["rate_a"] + p["rate_b"]) * p["duration"], "(rate_a + rate_b) * duration"),
        check_dist_shift,
    ),
    Builtin(
        "shared-prefixes",
        "Poisson arrivals whose prompts start with one of many shared prefixes (Zipf popularity), then a "
        "suffix of their own: the prefix cache's and cache-aware routing's workload",
        {"rate": positive(9), "duration": positive(120), "tenants": count(4, 1, 10_000), "prefixes": count(228, 1),
         "prefix_tokens": tokens(4096), "suffix_tokens": tokens(128), "output_tokens": tokens(64),
         "zipf": Param(1.0, 0, 10)},
        shared_prefixes,
        lambda p: (p["rate"] * p["duration"], "rate * duration"),
        lambda p: fits_kv({"prompt_tokens": p["prefix_tokens"] + p["suffix_tokens"],
                           "output_tokens": p["output_tokens"]}),
    ),
    Builtin(
        "multi-turn",
        "chat conversations (Poisson starts), each turn's prompt the whole conversation so far: its "
        "system prompt, the earlier turns and a new question",
        {"rate": positive(1), "duration": positive(120), "tenants": count(4, 1, 10_000), "turns": count(6, 1, 1000),
         "system_tokens": tokens(2048), "user_tokens": tokens(128), "output_tokens": tokens(128),
         "think_s": Param(5.0, 0, 1e6)},
        multi_turn,
        lambda p: (p["rate"] * p["duration"] * p["turns"], "rate * duration * turns"),
        check_multi_turn,
    ),
]}
