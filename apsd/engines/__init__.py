"""Engines: where admitted requests run.

* :mod:`apsd.core.engine` — the seam: what the scheduler and the pipeline expect of an engine.
* :mod:`apsd.engines.micro` — the seeds' simulated A100, fixed micro-batches (the default).
* :mod:`apsd.engines.continuous` — iteration-level batching on a roofline model
  (:mod:`apsd.engines.roofline`) of a GPU and a model profile (:mod:`apsd.engines.profiles`).
* :mod:`apsd.engines.forward` — relays to real OpenAI-compatible servers through a backend client
  (:mod:`apsd.engines.backends`: over HTTP, or simulated in virtual time).

:func:`build_engines` makes the ``[engine] count`` engines of ``[engine] kind`` a config asks
for; :func:`deployment_for` checks the profiles a config names (a ConfigError listing the
known ones for an unknown name) before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable

from apsd.core.clock import ModelClock
from apsd.core.config import Config, ConfigError
from apsd.core.ledger import Ledger
from apsd.core.models import InferenceRequest
from apsd.core.engine import Demand, Engine, EngineStatistics
from apsd.engines.continuous import ContinuousEngine
from apsd.engines.backends import Backend, BackendClient, HttpBackendClient
from apsd.engines.forward import ForwardEngine
from apsd.engines.micro import FaultInjector, GpuModel, MicroEngine
from apsd.engines.profiles import ProfileError, ProfileRegistry, builtin_profiles
from apsd.engines.roofline import Deployment

__all__ = ["Demand", "Engine", "EngineStatistics", "ForwardEngine", "build_engines", "deployment_for"]


def deployment_for(config: Config, profiles: ProfileRegistry | None = None) -> Deployment:
    """The continuous engines' deployment that ``config``'s ``[engine]`` names; ConfigError if the
    profiles are unknown or the model does not fit."""
    if profiles is None:
        profiles = ProfileRegistry()
        builtin_profiles(profiles)
    engine = config.engine
    try:
        gpu = profiles.get_gpu(engine.gpu)
    except ProfileError as exc:
        raise ConfigError(f"{config.source}: engine.gpu: {exc}") from None
    try:
        model = profiles.get_model(engine.model)
    except ProfileError as exc:
        raise ConfigError(f"{config.source}: engine.model: {exc}") from None
    try:
        return Deployment.build(gpu, model, engine.tp, memory_fraction=engine.memory_fraction)
    except ProfileError as exc:
        raise ConfigError(f"{config.source}: engine: {exc}") from None


def build_engines(config: Config, *, ledger: Ledger, clock: ModelClock, faults: FaultInjector,
                  rank: Callable[[InferenceRequest, float], float],
                  requeue: Callable[[InferenceRequest, str], None],
                  profiles: ProfileRegistry | None = None,
                  backend_client: BackendClient | None = None) -> list[Engine]:
    """``[engine] count`` engines of ``[engine] kind``, numbered from 0 (raises ConfigError); for
    ``forward``, one engine over every ``[[backends]]`` entry, talking through ``backend_client``
    (default: a new :class:`~apsd.engines.backends.HttpBackendClient`, which the engine closes)."""
    engine = config.engine
    if engine.kind == "forward":
        client = backend_client or HttpBackendClient(config.forward)
        return [ForwardEngine(0, [Backend(b) for b in config.backends], client, ledger, clock, config.forward,
                              requeue)]
    if engine.kind == "micro":
        model = GpuModel(config.gpu)
        return [MicroEngine(i, model, ledger, clock, faults, max_retries=engine.max_retries, requeue=requeue)
                for i in range(engine.count)]
    deployment = deployment_for(config, profiles)
    price = engine.price_per_gpu_hour_usd * engine.tp
    return [ContinuousEngine(i, deployment, ledger, clock, rank, max_sequences=engine.max_sequences,
                             max_batched_tokens=engine.max_batched_tokens, reserved_sequences=engine.reserved_sequences,
                             price_per_hour_usd=price)
            for i in range(engine.count)]
