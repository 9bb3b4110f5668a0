"""The building blocks of the built-in workloads: tenant names, arrival times (Poisson, regular, a ramp),
request sizes and bids, drawn from the generator's ``numpy`` random source only."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
from numpy.typing import NDArray

from apsd.sim.records import Arrival
from apsd.sim.workloads.params import KV_CAPACITY_TOKENS, MAX_RANDOM_TOKENS


def tenant_names(tenants: int) -> list[str]:
    """``tenant_00`` .. ``tenant_NN``: zero-padded so they sort in order."""
    width = max(2, len(str(tenants - 1)))
    return [f"tenant_{i:0{width}d}" for i in range(tenants)]


def poisson_times(rng: np.random.Generator, rate: float, duration: float) -> NDArray[np.float64]:
    """A Poisson process on ``[0, duration)``: a Poisson count, then uniform sorted times."""
    return np.sort(rng.uniform(0.0, duration, rng.poisson(rate * duration)))


def lognormal_tokens(rng: np.random.Generator, mean: float, sigma_: float, size: int) -> NDArray[np.int64]:
    """Integer sizes with the given mean, clipped to ``1..MAX_RANDOM_TOKENS``; fixed when sigma is 0."""
    if sigma_ == 0:
        return np.full(size, min(max(round(mean), 1), MAX_RANDOM_TOKENS), dtype=np.int64)
    mu = math.log(mean) - sigma_**2 / 2  # so that the lognormal's mean is ``mean``
    return np.clip(np.rint(rng.lognormal(mu, sigma_, size)), 1, MAX_RANDOM_TOKENS).astype(np.int64)


def uniform_bids(rng: np.random.Generator, size: int) -> NDArray[np.int64]:
    return rng.integers(1, 11, size)


def regular_count(rate: float, duration: float) -> int:
    """How many of the times ``0, 1/rate, 2/rate, ...`` fall before ``duration``."""
    return max(1, math.ceil(rate * duration - 1e-9))


def regular_times(rate: float, duration: float) -> NDArray[np.float64]:
    """The times ``0, 1/rate, 2/rate, ...`` before ``duration`` (at least the first): no randomness."""
    return np.arange(regular_count(rate, duration)) / rate


def ramp_times(rng: np.random.Generator, start_rate: float, end_rate: float, duration: float) -> NDArray[np.float64]:
    """A Poisson process on ``[0, duration)`` whose rate goes linearly from ``start_rate`` to ``end_rate``.

    The expected count by ``t`` is ``L(t) = start_rate*t + (end_rate - start_rate)*t**2/(2*duration)``;
    a Poisson count of uniform points on ``[0, L(duration))`` mapped through ``L``'s inverse, written
    ``2u / (b + sqrt(b**2 + 4au))`` so that it holds when either coefficient is 0.
    """
    a, b = (end_rate - start_rate) / (2 * duration), start_rate
    u = np.sort(rng.uniform(0.0, (a * duration + b) * duration, rng.poisson((start_rate + end_rate) / 2 * duration)))
    return 2 * u / (b + np.sqrt(b * b + 4 * a * u))


def make_arrivals(times: Any, tenants: Any, prompt_tokens: Any, output_tokens: Any, bids: Any) -> list[Arrival]:
    """Arrivals from columns; a scalar column is repeated. Values become plain ``float``/``int``/``str``."""
    size = len(times)

    def column(values: Any) -> list[Any]:
        items: list[Any] = np.broadcast_to(np.asarray(values), (size,)).tolist()
        return items

    return [
        Arrival(at=float(at), tenant=str(tenant), prompt_tokens=int(prompt), output_tokens=int(output), bid=int(b))
        for at, tenant, prompt, output, b in zip(
            column(times), column(tenants), column(prompt_tokens), column(output_tokens), column(bids), strict=True)
    ]


def tenant_arrivals(times: NDArray[np.float64], tenant: str, p: Mapping[str, Any], prefix: str = "") -> list[Arrival]:
    """``times`` as one tenant's arrivals, of the sizes and bid in ``p[prefix + "prompt_tokens"]``,
    ``p[prefix + "output_tokens"]`` and ``p[prefix + "bid"]``."""
    return make_arrivals(times, tenant, p[f"{prefix}prompt_tokens"], p[f"{prefix}output_tokens"], p[f"{prefix}bid"])


def fits_kv(p: Mapping[str, Any], prompt: str = "prompt_tokens", output: str = "output_tokens") -> None:
    """Cross-check: a fixed-size request must fit the KV cache of one batch."""
    total = p[prompt] + p[output]
    if total > KV_CAPACITY_TOKENS:
        raise ValueError(f"{output}: {prompt} + {output} must be <= {KV_CAPACITY_TOKENS}, got {total}")


@attrs.frozen
class Generated:
    """What a generator returns: its arrivals (any order) and the tenants it defines."""

    arrivals: list[Arrival]
    tenants: list[str]          # every tenant the scenario defines, in order
