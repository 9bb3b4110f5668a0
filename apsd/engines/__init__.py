"""Engines: where admitted requests run.

* :mod:`apsd.core.engine` — the seam: what the scheduler and the pipeline expect of an engine.
* :mod:`apsd.engines.batch` — a simulated GPU with fixed prefill and decode rates (``[gpu]``),
  running whole batches (the default).
* :mod:`apsd.engines.continuous` — iteration-level batching on a roofline model
  (:mod:`apsd.engines.roofline`) of a GPU and a model profile (:mod:`apsd.engines.profiles`).
* :mod:`apsd.engines.forward` — relays to real OpenAI-compatible servers through a backend client
  (:mod:`apsd.engines.backends`: over HTTP, or simulated in virtual time), holding their slots in a
  shared table (:mod:`apsd.core.slots`); what it sends and how it relays the answer
  (:mod:`apsd.engines.relay`), when it preempts and whom (:mod:`apsd.engines.preemption`), and its
  watch on the backends' health and load (:mod:`apsd.engines.watch`).

This package is the only code that knows the kinds apart. Everything else asks it:
:func:`describe` (what a config's engines are: GPUs, busy units, a one-line summary, the figures a
report lists), :func:`check` (refuse a config whose engines cannot be built, before anything
runs) and :func:`build_engines`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from apsd.core.clock import ModelClock
from apsd.core.config import Config, ConfigError
from apsd.core.engine import Demand, Engine, EngineStatistics
from apsd.core.ledger import Ledger
from apsd.core.models import InferenceRequest
from apsd.core.slots import LocalSlots, SlotTable
from apsd.engines.backends import Backend, BackendClient, HttpBackendClient
from apsd.engines.batch import BatchEngine, FaultInjector, GpuModel
from apsd.engines.continuous import ContinuousEngine, tenant_weights
from apsd.engines.forward import ForwardEngine
from apsd.engines.preemption import PreemptionRules
from apsd.engines.profiles import ProfileError, ProfileRegistry, builtin_profiles
from apsd.engines.roofline import Deployment

__all__ = ["Demand", "Engine", "EngineDescription", "EngineStatistics", "ForwardEngine", "build_engines", "check",
           "deployment_for", "describe"]


@attrs.frozen
class EngineDescription:
    """A config's engines as everything outside this package needs them (logs, ``/metrics``,
    the simulator's reports): nobody else asks which kind an engine is."""

    kind: str
    #: Engines the pipeline runs (``forward``: one, routing to every backend).
    count: int
    #: GPUs behind them.
    gpus: int
    #: What busy time is measured against: each engine (a batch GPU, or a continuous deployment of
    #: ``tp`` GPUs, which compute together) or each forwarded backend.
    busy_units: int
    #: One line for logs and reports: ``batch (simulated GPU, [gpu])``, ``continuous (llama-3-8b
    #: on a100-80gb, tp 1)``, ``forward (to a, b)``.
    summary: str
    #: The figures a report lists beside the kind and count (JSON values): the continuous
    #: engine's ``gpu``, ``model`` and ``tp``, the forward engine's ``backends``.
    details: dict[str, Any] = attrs.field(factory=dict)
    #: A request's first token is seen only when it is streamed (a forward engine asks the server
    #: for a whole answer otherwise): a simulator that wants time to first token streams them.
    streams_to_time_first_token: bool = False

    def as_dict(self) -> dict[str, Any]:
        """``kind``, ``count`` and the details: the ``engine`` block of a simulation's summary."""
        return {"kind": self.kind, "count": self.count, **self.details}


def describe(config: Config) -> EngineDescription:
    """What ``config``'s ``[engine]`` (and ``[[backends]]``) make."""
    return _BUILDERS[config.engine.kind].describe(config)


def check(config: Config, profiles: ProfileRegistry | None = None) -> None:
    """Raise ConfigError now if ``config``'s engines cannot be built (the continuous engine's
    profiles are unknown, or its model does not fit its GPUs)."""
    _BUILDERS[config.engine.kind].check(config, profiles)


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


def build_engines(config: Config, *, ledger: Ledger, clock: ModelClock,
                  rank: Callable[[InferenceRequest, float], float],
                  requeue: Callable[..., None],
                  profiles: ProfileRegistry | None = None,
                  backend_client: BackendClient | None = None, routing: Any = None,
                  slots: SlotTable | None = None) -> list[Engine]:
    """``[engine] count`` engines of ``[engine] kind``, numbered from 0 (raises ConfigError); for
    ``forward``, one engine over every ``[[backends]]`` entry, talking through ``backend_client``
    (default: a new :class:`~apsd.engines.backends.HttpBackendClient`, which the engine closes).
    ``rank`` and ``requeue`` are the scheduler's (an engine's order of preemption, and the way
    back to the queue for a request whose engine failed or preempted it). ``routing``: the routing policy
    (:class:`~apsd.core.routing.RoutingPolicy`) the forward engine picks its backends with; ``slots``: the
    table of its backends' slots (default: this process's own, :class:`~apsd.core.slots.LocalSlots`)."""
    return _BUILDERS[config.engine.kind].build(config, ledger=ledger, clock=clock, rank=rank, requeue=requeue,
                                               profiles=profiles, backend_client=backend_client, routing=routing,
                                               slots=slots)


class _Batch:
    def describe(self, config: Config) -> EngineDescription:
        engine = config.engine
        return EngineDescription(kind=engine.kind, count=engine.count, gpus=engine.count, busy_units=engine.count,
                                 summary=f"{engine.kind} (simulated GPU, [gpu])")

    def check(self, config: Config, profiles: ProfileRegistry | None) -> None:
        pass

    def build(self, config: Config, *, ledger: Ledger, clock: ModelClock, requeue: Callable[[InferenceRequest, str], None],
              **_: Any) -> list[Engine]:
        model, faults = GpuModel(config.gpu), FaultInjector(config.gpu)  # (one injector, shared by the engines)
        return [BatchEngine(i, model, ledger, clock, faults, max_retries=config.engine.max_retries, requeue=requeue)
                for i in range(config.engine.count)]


class _Continuous:
    def describe(self, config: Config) -> EngineDescription:
        engine = config.engine
        return EngineDescription(kind=engine.kind, count=engine.count, gpus=engine.count * engine.tp,
                                 busy_units=engine.count,
                                 summary=f"{engine.kind} ({engine.model} on {engine.gpu}, tp {engine.tp})",
                                 details={"gpu": engine.gpu, "model": engine.model, "tp": engine.tp})

    def check(self, config: Config, profiles: ProfileRegistry | None) -> None:
        deployment_for(config, profiles)

    def build(self, config: Config, *, ledger: Ledger, clock: ModelClock, rank: Callable[[InferenceRequest, float], float],
              profiles: ProfileRegistry | None, requeue: Callable[[InferenceRequest, str], None] | None = None,
              **_: Any) -> list[Engine]:
        engine = config.engine
        deployment = deployment_for(config, profiles)
        price = engine.price_per_gpu_hour_usd * engine.tp
        return [ContinuousEngine(i, deployment, ledger, clock, rank, max_sequences=engine.max_sequences,
                                 max_batched_tokens=engine.max_batched_tokens,
                                 isolation=engine.isolation, prefill_chunk_tokens=engine.prefill_chunk_tokens,
                                 price_per_hour_usd=price, prefix_cache=engine.prefix_cache,
                                 classes=bool(config.classes), requeue=requeue, weights=tenant_weights(config))
                for i in range(engine.count)]


class _Forward:
    def describe(self, config: Config) -> EngineDescription:
        labels = [b.label for b in config.backends]
        return EngineDescription(kind=config.engine.kind, count=1, gpus=sum(b.gpus for b in config.backends),
                                 busy_units=len(labels), summary=f"{config.engine.kind} (to {', '.join(labels)})",
                                 details={"backends": labels}, streams_to_time_first_token=True)

    def check(self, config: Config, profiles: ProfileRegistry | None) -> None:
        pass

    def build(self, config: Config, *, ledger: Ledger, clock: ModelClock, requeue: Callable[..., None],
              backend_client: BackendClient | None, routing: Any, slots: SlotTable | None = None,
              **_: Any) -> list[Engine]:
        client = backend_client or HttpBackendClient(config.forward)
        if routing is None:
            raise ValueError("the forward engine needs a routing policy")
        forward = config.forward
        rules = PreemptionRules(enabled=config.engine.isolation, min_run_s=forward.preempt_min_run_s,
                                max_preemptions=forward.max_preemptions)
        return [ForwardEngine(0, [Backend(b) for b in config.backends], client, ledger, clock, forward,
                              requeue, routing, rules=rules, slots=slots if slots is not None else LocalSlots(),
                              weights={name: tenant.weight for name, tenant in config.tenants.items()},
                              default_cache_tokens=config.routing.cache_tokens)]


#: ``[engine] kind`` -> how to check and build its engines (the kinds themselves: ``apsd.core.config.ENGINE_KINDS``).
_BUILDERS: dict[str, _Batch | _Continuous | _Forward] = {"batch": _Batch(), "continuous": _Continuous(),
                                                          "forward": _Forward()}
