"""Simulation: workloads through apsd's own pipeline, in virtual time.

Ownership: :func:`run_policy` runs one :class:`~apsd.sim.records.Workload` with one
:class:`PolicyChoice` in a fresh ``trio.run`` under
``trio.testing.MockClock(autojump_threshold=0)``: the daemon's admission,
scheduler, policies and simulated GPUs, with no HTTP. An hour of traffic takes
seconds, and the same workload and seed give the same numbers, byte for byte.

What differs from the daemon, and why:

* One driver task submits the arrivals in order with
  :meth:`~apsd.pipeline.Pipeline.admit_now` instead of through the ingress
  channel (the same admission and scheduler objects decide; the channel exists
  so HTTP handlers never block, which a single driver does not need).
* The workload's tenants replace the config's; the config supplies the GPU
  model, queue limits and policy parameters. ``gpu.time_scale`` is set to 1.
* Trio runs tasks that wake at the same instant in an order it randomises; the
  simulator seeds that choice with the workload's seed, so a run is repeatable.

Error handling: configuration and plugin errors are raised before anything runs
(:class:`~apsd.core.config.ConfigError`, :class:`~apsd.plugins.PluginError`).
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypedDict

import attrs
import numpy as np
import pluggy
import trio
import trio.testing

from apsd.core.clock import ModelClock
from apsd.core.config import Config, ConfigError
from apsd.core.hookspecs import hookimpl
from apsd.core.models import Completion, InferenceRequest, Refusal
from apsd.core.policy import POLICY_KINDS
from apsd.core.streams import TokenStream
from apsd.engines import describe as describe_engines
from apsd.engines.backends import SimulatedBackendClient, SimulatedServer
from apsd.pipeline import open_pipeline
from apsd.plugins import load_policy_registry, load_profile_registry, make_plugin_manager
from apsd.sim.records import Arrival, BatchRecord, EngineRecord, GovernorSample, PolicyRun, RequestRecord, Workload

#: The error code of an arrival a door refused (:func:`run_policy`'s ``door``).
RPM_LIMITED = "rpm_limited"

__all__ = ["RPM_LIMITED", "PolicyChoice", "parse_policy_choice", "record_of", "run_policy", "run_policies",
           "seeded_trio_scheduler"]

#: Governor/queue samples per run, evenly spaced over its duration.
SAMPLES = 500


@attrs.frozen
class PolicyChoice:
    """A preset, optionally with some kinds replaced: ``aps:governor=fixed``."""

    label: str
    preset: str
    overrides: dict[str, str] = attrs.field(factory=dict)


def parse_policy_choice(text: str) -> PolicyChoice:
    """``PRESET[:KIND=NAME[,KIND=NAME]]``; the label is ``PRESET+NAME+...``."""
    preset, _, rest = text.partition(":")
    overrides: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        kind, eq, name = item.partition("=")
        if not eq or kind not in POLICY_KINDS or not name:
            raise ConfigError(f"--policy {text!r}: expected PRESET[:KIND=NAME,...] with KIND one of "
                              f"{', '.join(POLICY_KINDS)}")
        overrides[kind] = name
    if not preset:
        raise ConfigError(f"--policy {text!r}: missing the preset name")
    return PolicyChoice(label="+".join([preset, *overrides.values()]), preset=preset, overrides=overrides)


def simulation_config(base: Config, workload: Workload, choice: PolicyChoice) -> Config:
    """``base`` with the workload's tenants, the choice's policies and real-time-free GPU timing.

    The choice decides every kind (its preset, then its overrides); ``base`` contributes the
    policies' parameters (``[policy.<name>]``), not ``[policy] aging/governor/batching``.
    """
    chosen = choice.overrides.get  # (one name or None for each of POLICY_KINDS)
    policy = attrs.evolve(base.policy, preset=choice.preset, aging=chosen("aging"), governor=chosen("governor"),
                          batching=chosen("batching"))
    return attrs.evolve(base, tenants=dict(workload.tenants), policy=policy,
                        gpu=attrs.evolve(base.gpu, time_scale=1.0),
                        source=f"{base.source} (simulating {workload.name})")


class _BatchRecorder:
    """Observation-hook plugin: one BatchRecord per finished batch."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}
        self.batches: list[BatchRecord] = []

    @hookimpl
    def batch_started(self, batch: Any, now: float) -> None:
        self.started[batch.batch_id] = now

    @hookimpl
    def batch_finished(self, batch: Any, engine_id: int, now: float, busy_s: float, cost_usd: float) -> None:
        self.batches.append(BatchRecord(
            batch_id=batch.batch_id, executor_id=engine_id, size=len(batch.requests), kv_tokens=batch.kv_tokens,
            formed_at=batch.formed_at, started_at=self.started.pop(batch.batch_id), finished_at=now,
            busy_s=busy_s, cost_usd=cost_usd, window_s=batch.window_s))


@contextlib.contextmanager
def seeded_trio_scheduler(seed: int) -> Iterator[None]:
    """Fix the order trio gives tasks waking at the same instant, for the duration of one run.

    Trio has no public hook for this: it is the private ``trio._core._run._r``. If trio ever
    drops it, nothing is seeded and tests/sim/test_simulate.py's byte-for-byte test says so.
    """
    from trio._core import _run

    rng = getattr(_run, "_r", None)
    if not isinstance(rng, random.Random):
        yield
        return
    state = rng.getstate()
    rng.seed(seed)
    try:
        yield
    finally:
        rng.setstate(state)


def run_policy(workload: Workload, choice: PolicyChoice, *, base_config: Config | None = None,
               plugin_manager: pluggy.PluginManager | None = None,
               progress: Callable[[int], None] | None = None,
               door: Callable[[Arrival], str | None] | None = None) -> PolicyRun:
    """Simulate ``workload`` under ``choice``; ``progress(n)`` is called as arrivals are submitted.
    ``door`` (a simulator-only baseline, :class:`apsd.sim.baselines.RequestsPerMinute`) is asked about
    each arrival before admission: a reason refuses it there (429 ``rpm_limited``), None lets it in."""
    config = simulation_config(base_config or Config(), workload, choice)
    pm = plugin_manager or make_plugin_manager()
    recorder = _BatchRecorder()
    pm.register(recorder)
    try:
        policies = load_policy_registry(pm).build(config)
        profiles = load_profile_registry(pm)
        with seeded_trio_scheduler(workload.seed):
            started = time.perf_counter()
            requests, duration, engines, gpus = trio.run(
                _drive, workload, config, policies, progress, profiles, door,
                clock=trio.testing.MockClock(autojump_threshold=0))
            wall_s = time.perf_counter() - started
        fresh_governor = load_policy_registry(pm).build(config).governor
    finally:
        pm.unregister(recorder)
    batches = tuple(sorted(recorder.batches, key=lambda b: b.batch_id))
    records = tuple(record_of(arrival.at, request) for arrival, request in zip(workload.arrivals, requests))
    samples, interval = _sample(records, fresh_governor, duration)
    return PolicyRun(label=choice.label, policy=dict(policies.names), workload=workload, requests=records,
                     batches=batches, samples=samples, sample_interval_s=interval, duration_s=duration,
                     gpus=gpus, tenant_rates={n: t.rate for n, t in config.tenants.items()},
                     engine=describe_engine(config), engines=engines, wall_s=wall_s, classes=dict(config.classes))


def run_policies(workload: Workload, choices: Sequence[PolicyChoice], **kwargs: Any) -> list[PolicyRun]:
    """The same workload under each choice, in order."""
    return [run_policy(workload, choice, **kwargs) for choice in choices]


def simulated_backends(config: Config) -> SimulatedBackendClient | None:
    """For the ``forward`` engine: its ``[[backends]]`` simulated in model time (each running
    ``max_concurrency`` requests at once, at its ``sim_ttft_s`` and ``sim_tpot_s``), so the
    forwarding logic runs with the daemon's own code; None for the other engines (no backends)."""
    if not config.backends:
        return None
    servers = {b.label: SimulatedServer(models=b.models or ("sim",), slots=b.max_concurrency, ttft_s=b.sim_ttft_s,
                                        tpot_s=b.sim_tpot_s) for b in config.backends}
    return SimulatedBackendClient(ModelClock(), servers)


def describe_engine(config: Config) -> dict[str, Any]:
    """The ``[engine]`` a run used, for its report (:meth:`apsd.engines.EngineDescription.as_dict`)."""
    return describe_engines(config).as_dict()


async def _drive(workload: Workload, config: Config, policies: Any, progress: Callable[[int], None] | None,
                 profiles: Any, door: Callable[[Arrival], str | None] | None
                 ) -> tuple[list[InferenceRequest], float, tuple[EngineRecord, ...], int]:
    requests: list[InferenceRequest] = []
    async with open_pipeline(config, policies, request_id_prefix="sim", profiles=profiles,
                             backend_client=simulated_backends(config)) as pipeline:
        clock = pipeline.clock
        mock = trio.lowlevel.current_clock()
        streamed = describe_engines(config).streams_to_time_first_token
        # Let the stages start and block (engines ask for work) before the first arrival: they were
        # made runnable together with this task, and _advance_to only sees tasks that are runnable
        # for the *next* batch of the run loop, not those still due in the current one.
        await trio.testing.wait_all_tasks_blocked()
        for n, arrival in enumerate(workload.arrivals, 1):
            if not clock.reached(arrival.at):  # arrivals at one instant all queue before anything else runs
                await _advance_to(clock, mock, arrival.at)
            request = pipeline.new_request(tenant_id=arrival.tenant, prompt="", tokens_requested=arrival.output_tokens,
                                           priority_bid=arrival.bid, prompt_tokens=arrival.prompt_tokens,
                                           prefix_blocks=arrival.prefix_blocks, service_class=arrival.service_class,
                                           prefix_block_tokens=arrival.prefix_block_tokens)
            refused = door(arrival) if door is not None else None
            if refused is not None:  # (refused at the door: never admitted, nothing to book)
                request.reply.resolve(Refusal(429, RPM_LIMITED, refused))
            else:
                if streamed:  # (so that its first token is seen; nobody reads the stream)
                    request.stream = TokenStream()
                    request.stream.abandon()
                pipeline.admit_now(request)
            requests.append(request)
            if progress is not None and n % 1024 == 0:
                progress(1024)
        if progress is not None:
            progress(len(requests) % 1024)
        await pipeline.ledger.wait_idle()
        duration = clock.now()
        engines = tuple(EngineRecord(engine_id=e.engine_id, kind=e.kind, busy_s=e.busy_s, cost_usd=e.cost_usd,
                                     dispatches=e.dispatches, tokens_generated=e.tokens_generated,
                                     preemptions=e.preemptions, kv_tokens_capacity=e.kv_tokens_capacity,
                                     mfu=e.mfu, mbu=e.mbu)
                        for e in (engine.statistics() for engine in pipeline.engines))
        gpus = pipeline.gpus
    return requests, duration, engines, gpus


async def _advance_to(clock: Any, mock: Any, model_time: float) -> None:
    """Let virtual time reach ``model_time``, then admit after everything else due by then.

    When no other task can run and none has a deadline before then, nothing can happen in
    between: jump the MockClock there directly (what autojump would do, without its two
    run-loop passes and a cancel scope per arrival). Otherwise sleep, then wait until every
    other task is blocked: events due at the same instant (a batch ending, a window
    closing) always come before the arrival. Trio orders equal deadlines by memory
    address, so without this rule a tie could go either way from run to run.
    """
    gap = clock.deadline(model_time) - trio.current_time()
    stats = trio.lowlevel.current_statistics()
    if isinstance(mock, trio.testing.MockClock) and stats.tasks_runnable == 0 \
            and stats.seconds_to_next_deadline > gap:
        mock.jump(gap)
    else:
        await clock.sleep_until(model_time)
        await trio.testing.wait_all_tasks_blocked()


def _sample(records: Sequence[RequestRecord], governor: Any, duration: float) -> tuple[tuple[GovernorSample, ...],
                                                                                      float]:
    """The governor and the queue at ``SAMPLES`` evenly spaced instants, rebuilt after the run.

    Both only change at events: the governor's reading at admissions (replayed into a fresh
    governor from the same factory), the queue depth at admissions and dispatches (counted
    from the records). Each sample is the state once everything at that instant happened.
    A governor that also reacts to ``on_dispatch``/``on_finish`` is replayed from arrivals
    only. (No sampling task: its wake-ups would tie with events at the same instant.)
    """
    interval = max(duration, 1e-9) / SAMPLES
    admitted = [r for r in records if r.outcome != "rejected"]
    arrivals = np.array([r.arrival for r in admitted])
    dispatches = np.sort(np.array([r.dispatched_at for r in admitted if r.dispatched_at is not None]))
    samples = []
    fed = 0
    for n in range(SAMPLES):
        at = n * interval
        while fed < len(admitted) and admitted[fed].arrival <= at:
            governor.observe_arrival(admitted[fed].arrival)
            fed += 1
        reading = governor.reading(at)
        depth = int(np.searchsorted(arrivals, at, side="right") - np.searchsorted(dispatches, at, side="right"))
        samples.append(GovernorSample(at=at, state=reading.state, entropy_bits=reading.entropy_bits,
                                      window_s=reading.window_s, queue_depth=depth))
    return tuple(samples), interval


class _RecordFields(TypedDict):
    """The fields of a :class:`RequestRecord` that every outcome has."""

    tenant: str
    bid: int
    prompt_tokens: int
    output_tokens: int
    arrival: float
    service_class: str | None


def record_of(at: float, request: InferenceRequest) -> RequestRecord:
    """What happened to ``request``, which arrived at ``at`` (model seconds), as a record."""
    outcome = request.reply.outcome
    common = _RecordFields(tenant=request.tenant_id, bid=request.priority_bid, prompt_tokens=request.prompt_tokens,
                           output_tokens=request.tokens_requested, arrival=at, service_class=request.service_class)
    if isinstance(outcome, Completion):
        return RequestRecord(**common, outcome="completed", dispatched_at=request.dispatched_at,
                             finished_at=request.finished_at, batch_id=outcome.batch_id,
                             batch_size=outcome.batch_size, cost_usd=outcome.cost_usd, started_at=request.started_at,
                             tpot=None if outcome.tpot_ms is None else outcome.tpot_ms / 1000.0,
                             engine_id=request.engine_id, cached_tokens=request.cached_tokens,
                             route=request.route)
    assert isinstance(outcome, Refusal)
    return RequestRecord(**common, outcome=outcome.kind, error=outcome.error, dispatched_at=request.dispatched_at,
                         started_at=request.started_at, engine_id=request.engine_id)
