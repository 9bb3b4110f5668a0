"""The pipeline: admission -> scheduler -> engines, wired with trio memory channels.

Ownership: a :class:`Pipeline` owns its stages and every channel between them, but
not the nursery they run in. :func:`open_pipeline` is the one way to run them, for the
daemon, the simulator and tests alike: it opens a nursery for the stages, yields the
pipeline, and on exit answers whatever is unfinished (503) and stops them;
:meth:`Pipeline.stop_stages` stops them earlier (the daemon's shutdown). The HTTP layer
talks to it through :meth:`Pipeline.submit_nowait` and :meth:`Pipeline.cancel`, the
simulator through :meth:`Pipeline.admit_now`; both read the views
(:meth:`Pipeline.statistics`, :meth:`Pipeline.health`, :meth:`Pipeline.tenant_status`),
frozen snapshots that the HTTP edge serialises.

It also starts the scheduler's queue-timeout task (:meth:`Scheduler.serve_timeouts`) and the service
classes' deadline task (:meth:`apsd.core.classes.ServiceClasses.serve_deadlines`).

Channels (buffer sizes are deliberate)::

    ingress   queue.ingress_buffer   submitters never block: a full ingress is a 503
    (admitted)                       no channel: admission calls Scheduler.enqueue itself
                                     (no task switch per request)
    demands   engine.count           each engine has at most one outstanding ask
    answers   1 per engine           the scheduler's answer to that engine's one ask
"""

from __future__ import annotations

import collections
import math
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from apsd.core.admission import Admission, estimate_tokens
from apsd.core.classes import ClassFigures, ServiceClasses
from apsd.core.clock import ModelClock
from apsd.core.config import Config
from apsd.core.engine import BackendStatistics
from apsd.core.events import EventBus
from apsd.core.ledger import Ledger, LedgerStatistics
from apsd.core.models import Dispatch, InferenceRequest, Refusal
from apsd.core.policy import PolicySet
from apsd.core.prices import Prices
from apsd.core.routing import BLOCK_TOKENS
from apsd.core.scheduler import Scheduler
from apsd.core.service_window import FairnessView, watch_for
from apsd.core.slots import LocalSlots, SlotTable
from apsd.engines import Demand, Engine, EngineDescription, EngineStatistics, build_engines, describe
from apsd.engines.backends import BackendClient
from apsd.engines.profiles import ProfileRegistry
from apsd.store import Store, build_slot_table, build_store

__all__ = ["GovernorView", "Health", "Pipeline", "PipelineStatistics", "TenantStatus", "open_pipeline"]


@attrs.frozen
class GovernorView:
    """The governor's current reading (``state`` ERROR, with ``error``, when it raised)."""

    state: str
    entropy_bits: float | None
    window_ms: float | None
    error: str | None = None


@attrs.frozen
class Health:
    """``GET /health``: ``status`` is ``ok``, or ``draining`` once shutdown began."""

    status: str
    policy: dict[str, str]
    queue_depth: int
    governor: GovernorView


@attrs.frozen
class PipelineStatistics:
    """``GET /metrics``' figures: the books, and the running configuration and state."""

    books: LedgerStatistics
    policy: dict[str, str]
    queue_depth: int
    engine_kind: str
    #: Engines, and the GPUs they use (``tp`` per continuous engine).
    engines: tuple[EngineStatistics, ...]
    #: The forward engine's backends (empty for the simulated engines).
    backends: tuple[BackendStatistics, ...]
    gpus: int
    time_scale: float
    governor: GovernorView
    #: (where, reason) -> requests the routing policy sent there for that reason (:meth:`Pipeline.route_decisions`).
    routes: dict[tuple[str, str], int] = attrs.field(factory=dict)


@attrs.frozen
class TenantStatus:
    """``GET /tenants/<id>/status``."""

    tenant_id: str
    rate: float
    burst: int
    #: The tenant's bucket now, as far as this replica knows (with a shared store: see
    #: :class:`apsd.store.BucketView`); ``replica_tokens``: what this replica may admit without
    #: waiting for the store; ``shared_tokens``: what the shared bucket held at this replica's last read
    #: of it, ``shared_age_s`` seconds ago (both None with the memory store).
    tokens_available: float
    replica_tokens: float
    shared_tokens: float | None
    shared_age_s: float | None
    queued: int
    running: int
    in_flight: int
    admitted: int
    completed: int
    rejected: int
    rejected_by_error: dict[str, int]
    failed: int
    cancelled: int
    prompt_tokens: int
    generated_tokens: int
    cost_usd: float
    #: What its requests cost it at ``[prices]``, US dollars (since start; the usage history keeps it longer).
    spend_usd: float = 0.0
    #: Its requests waiting in its line for its ``max_concurrency`` (:mod:`apsd.core.concurrency`).
    waiting_for_concurrency: int = 0


@attrs.define(eq=False)
class Pipeline:
    config: Config
    policies: PolicySet
    clock: ModelClock
    ledger: Ledger
    admission: Admission
    scheduler: Scheduler
    engines: list[Engine]
    #: Where tenants' buckets and fair-share counters live (``[store]``); its task runs with the stages.
    store: Store
    #: The forward engine's backends' slots, shared with the other replicas through the store's Redis
    #: (``[store]``); its task runs with the stages.
    slots: SlotTable
    request_id_prefix: str
    #: The service classes (``[classes]``): admission's deadline checks and the attainment counts.
    classes: ServiceClasses
    _ingress_send: trio.MemorySendChannel[InferenceRequest]
    _ingress_receive: trio.MemoryReceiveChannel[InferenceRequest]
    _next_request: int = 0
    _stages_scope: trio.CancelScope | None = None

    @classmethod
    def build(cls, config: Config, policies: PolicySet, *, request_id_prefix: str | None = None,
              profiles: ProfileRegistry | None = None, backend_client: BackendClient | None = None,
              store: Store | None = None, slots: SlotTable | None = None) -> Pipeline:
        """Assemble a pipeline (call inside ``trio.run``: the clock starts now). Raises ConfigError
        for an ``[engine]`` whose profiles are unknown or do not fit. ``store``: the one ``[store]``
        asks for unless given (several simulated replicas may share one); ``slots``: the table of the
        forward engine's backends' slots, the one ``[store]`` asks for unless given (this process's own
        when a store is given)."""
        clock = ModelClock(time_scale=config.gpu.time_scale)
        if store is None:
            store = build_store(config)
            slots = slots if slots is not None else build_slot_table(config, clock, store)
        elif slots is None:
            slots = LocalSlots()
        ledger = Ledger(tenant_names=config.tenants, clock=clock, events=EventBus(policies.plugin_manager))
        scheduler = Scheduler(policies=policies, ledger=ledger, clock=clock, queue_timeout_s=config.queue.timeout_s)
        engines = build_engines(config, ledger=ledger, clock=clock, rank=scheduler.rank,
                                requeue=scheduler.requeue, profiles=profiles, backend_client=backend_client,
                                routing=policies.routing, slots=slots)
        if len(engines) > 1 and all(hasattr(engine, "target") for engine in engines):
            scheduler.route_between(policies.routing, engines)
        prices = Prices(dict(config.prices), default_model=lambda: _single_model(engines))
        admission = Admission(tenants=dict(config.tenants), batching=policies.batching, ledger=ledger,
                              clock=clock, engine_refuse=engines[0].refuse, max_queued=config.queue.max_requests,
                              max_queued_per_tenant=config.queue.max_requests_per_tenant,
                              max_queued_tokens=config.queue.max_tokens, store=store, keys=dict(config.keys),
                              settings=config.admission, prices=prices)
        ledger.price = prices.spend_usd
        scheduler.gate.limits = admission.concurrency_limits
        classes = ServiceClasses(classes=dict(config.classes), clock=clock,
                                 queued_total=lambda: ledger.queued_total, finish=ledger.finish,
                                 note_answered_in_queue=scheduler.note_answered_in_queue)
        waits = [engine.first_token_wait_s for engine in engines if hasattr(engine, "first_token_wait_s")]
        if waits:
            classes.engine_wait = lambda request, target_s: min(wait(request, target_s) for wait in waits)
        takes = [engine.takes_now for engine in engines if hasattr(engine, "takes_now")]
        if takes:
            classes.takes_now = lambda request: any(take(request) for take in takes)
        if config.classes:  # (without classes, nothing listens: the unclassed path pays nothing)
            ledger.keep_books_with(classes)
        admission.classes = classes
        # How a request ends (Ledger.finish): the books, then the tenant's settlement, then the policies.
        ledger.settle, ledger.tell_policies = admission.settle, scheduler.policy_finished
        scheduler.on_new_queue = store.share
        store.share(scheduler.queue)
        store.share_budgets(admission.budgets)
        send, receive = trio.open_memory_channel[InferenceRequest](config.queue.ingress_buffer)
        return cls(config=config, policies=policies, clock=clock, ledger=ledger, admission=admission,
                   scheduler=scheduler, engines=engines, store=store, slots=slots, classes=classes,
                   request_id_prefix=request_id_prefix if request_id_prefix is not None else secrets.token_hex(4),
                   ingress_send=send, ingress_receive=receive)

    def stop_stages(self) -> None:
        """Cancel the stages: no engine runs, or bills, anything after this."""
        if self._stages_scope is not None:
            self._stages_scope.cancel()

    async def _run_stages(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the stages in a nursery of their own (which :meth:`stop_stages` cancels)."""
        async with trio.open_nursery() as nursery:
            self._stages_scope = nursery.cancel_scope
            await nursery.start(self.store.run)  # (admission decides against what it has from the start)
            await nursery.start(self.slots.run)
            self._start_stages(nursery)
            task_status.started()

    def _start_stages(self, nursery: trio.Nursery) -> None:
        """Start admission (which also queues what it admits), the scheduler's loops (dispatch,
        queue timeouts) and every engine in ``nursery``."""
        demand_send, demand_receive = trio.open_memory_channel[Demand](len(self.engines))
        answers: dict[int, trio.MemorySendChannel[Dispatch]] = {}
        nursery.start_soon(self.admission.serve_admission, self._ingress_receive.clone(), self.scheduler.enqueue)
        with demand_send:
            for engine in self.engines:
                answer_send, answer_receive = trio.open_memory_channel[Dispatch](1)
                answers[engine.engine_id] = answer_send
                nursery.start_soon(engine.serve, demand_send.clone(), answer_receive)
        nursery.start_soon(self.scheduler.serve_dispatch, demand_receive, answers)
        nursery.start_soon(self.scheduler.serve_timeouts)
        nursery.start_soon(self.classes.serve_deadlines)

    # -- the way in ------------------------------------------------------------------------
    def estimate_prompt_tokens(self, prompt: str) -> int:
        """Prompt tokens, estimated (:func:`apsd.core.admission.estimate_tokens`)."""
        return estimate_tokens(prompt, self.config.admission)

    def new_request(self, *, tenant_id: str, prompt: str, tokens_requested: int, priority_bid: int,
                    prompt_tokens: int | None = None, timeout_s: float | None = None, model: str | None = None,
                    api: str | None = None, payload: dict[str, Any] | None = None, open_ended: bool = False,
                    request_id: str | None = None, prefix_blocks: tuple[int, ...] | None = None,
                    service_class: str | None = None, prefix_block_tokens: int = BLOCK_TOKENS,
                    key_id: str | None = None) -> InferenceRequest:
        """A request ready to submit; ``timeout_s`` (model seconds, > 0) may shorten ``[queue] timeout_s``
        for it (a longer one is clamped to the config's when it is queued). ``model``, ``api``,
        ``payload`` and ``open_ended`` describe an OpenAI-style request (see
        :class:`~apsd.core.models.InferenceRequest`). ``request_id``: the client's own (``X-Request-Id``,
        already checked by the HTTP layer); None: apsd numbers it. ``prefix_blocks``: a simulated request's
        routing key (:func:`apsd.core.routing.synthetic_blocks`, or a trace's blocks of ``prefix_block_tokens``
        tokens each); None: computed from its text when routed. ``service_class``: the class it names
        (``X-Apsd-Class``; None: its tenant's default). ``key_id``: the issued key it came with (its limits and
        usage count under it; None: none, or a key of the file)."""
        if timeout_s is not None and not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self._next_request += 1
        return InferenceRequest(
            request_id=request_id or f"{self.request_id_prefix}-{self._next_request}",
            open_ended=open_ended,
            tenant_id=tenant_id,
            prompt_tokens=self.estimate_prompt_tokens(prompt) if prompt_tokens is None else prompt_tokens,
            tokens_requested=tokens_requested,
            priority_bid=priority_bid,
            prompt=prompt,
            timeout_s=timeout_s,
            model=model,
            api=api,
            payload=payload,
            prefix_blocks=prefix_blocks,
            prefix_block_tokens=prefix_block_tokens,
            cached_discount=self.config.admission.cached_prompt_discount,
            service_class=service_class,
            key_id=key_id,
        )

    def models(self) -> list[str]:
        """The model names requests may ask for: what the engines serve (``GET /v1/models``)."""
        names: dict[str, None] = {}
        for engine in self.engines:
            for name in engine.models():
                names.setdefault(name, None)
        return list(names)

    def apis(self) -> list[str]:
        """The OpenAI APIs requests may use: what the engines run (``request.api``)."""
        names: dict[str, None] = {}
        for engine in self.engines:
            for name in engine.apis:
                names.setdefault(name, None)
        return list(names)

    @property
    def accepting(self) -> bool:
        return self.admission.accepting

    def submit_nowait(self, request: InferenceRequest) -> Refusal | None:
        """Hand ``request`` to admission; a Refusal if it cannot even be taken in.

        Otherwise the request's reply slot will be resolved exactly once. Submit each
        request once, from one task (the order of submission is the order of admission).
        """
        self._mark_submitted(request)
        refusal = None
        if not self.accepting:
            refusal = Refusal(503, "shutting_down", "apsd is shutting down and accepts no new requests",
                              headers={"Retry-After": "5"})
        else:
            try:
                self._ingress_send.send_nowait(request)
            except trio.WouldBlock:
                refusal = Refusal(503, "ingress_full", "admission is behind; retry shortly",
                                  headers={"Retry-After": "1"})
        if refusal is not None:
            self.ledger.refuse_unadmitted(request, refusal)
        return refusal

    @staticmethod
    def _mark_submitted(request: InferenceRequest) -> None:
        if request.submitted or request.answered:
            raise ValueError(f"request {request.request_id} was already submitted")
        request.submitted = True

    def admit_now(self, request: InferenceRequest) -> bool:
        """Admit (or refuse) ``request`` and queue it at once, bypassing the ingress channel.

        For a single driver task such as the simulator: the same admission and scheduler
        objects decide, without the two task switches the channels cost. Returns whether
        it was admitted; a refused request is answered already.
        """
        self._mark_submitted(request)
        if not self.admission.handle(request):
            return False
        self.scheduler.enqueue(request)
        return True

    def cancel(self, request: InferenceRequest) -> bool:
        """The client gave up on ``request``. Queued: it leaves the queue, counted as cancelled,
        its tokens refunded. Running: its engine stops it (now or at its next step boundary),
        frees its slot and KV cache, and it is billed for what ran; an engine that cannot stop
        it (``batch``: a batch runs as one) lets it finish, billed. Returns whether it was (or
        will be) cancelled."""
        if request.stream is not None:
            request.stream.abandon()
        if request.answered:
            return False
        if request.dispatched_at is not None:
            engine = self._engine(request.engine_id)
            return engine is not None and engine.cancel(request)
        if request not in self.ledger.outstanding:  # still waiting for admission: it will refuse it
            request.abandoned = True
            return True
        self.ledger.finish(request, Refusal(499, "client_disconnected",
                                            "the client disconnected while the request was queued",
                                            kind="cancelled"))
        request.prompt = ""  # the queue may hold it a while longer: keep only what ordering needs
        self.scheduler.note_answered_in_queue()
        return True

    # -- the way out -----------------------------------------------------------------------
    def close_doors(self) -> None:
        """Stop admitting: from now on every new request is answered 503."""
        self.admission.accepting = False

    def abort_outstanding(self) -> int:
        """Answer every unfinished request with 503 (the ledger refunds its tokens); returns how many."""
        while True:  # requests still in the ingress buffer were never admitted
            try:
                request = self._ingress_receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            self.ledger.refuse_unadmitted(request, Refusal(
                503, "shutting_down", "apsd is shutting down", headers={"Retry-After": "5"}))
        self.scheduler.drop_queued()  # so no engine picks up a request already answered
        aborted = 0
        for request in list(self.ledger.outstanding):
            aborted += self.ledger.finish(request, Refusal(
                503, "shutting_down", "apsd shut down before this request could finish",
                kind="cancelled", headers={"Retry-After": "5"}))
        return aborted

    def _engine(self, engine_id: int | None) -> Engine | None:
        return next((e for e in self.engines if e.engine_id == engine_id), None)

    # -- live reconfiguration ----------------------------------------------------------------
    def reconfigure(self, config: Config, policies: PolicySet) -> list[str]:
        """Apply a new, already validated config and its policies, atomically; returns what changed.

        Synchronous, so no request is handled half under the old and half under the new
        settings. Queued and running requests are kept and finish: queued ones move into the
        new queue in admission order, keeping their deadlines (a new ``queue.timeout_s`` applies
        to requests queued from then on). Fault injection takes its new settings at the next
        batch; its batch count goes on. Tenants are added (full bucket), removed (new requests
        get 404; their queued ones still run) or re-rated (current tokens kept, capped at the
        new burst; with a shared store, the shared level is kept). What cannot change while running
        (``[server]``, ``[store]``, ``[tracing]``, ``[engine]`` but ``max_retries``, ``gpu.time_scale``,
        ``queue.ingress_buffer``) keeps its old value and is reported as needing a restart.
        """
        old = self.config
        kept_engine = attrs.evolve(old.engine, max_retries=config.engine.max_retries)
        changes = [f"{name} needs a restart to change (kept as before)"
                   for name, now, then in (("[server]", config.server, old.server),
                                           ("[store]", config.store, old.store),
                                           ("[tracing]", config.tracing, old.tracing),
                                           ("[engine]", attrs.evolve(config.engine, max_retries=0),
                                            attrs.evolve(old.engine, max_retries=0)),
                                           ("gpu.time_scale", config.gpu.time_scale, old.gpu.time_scale),
                                           ("queue.ingress_buffer", config.queue.ingress_buffer,
                                            old.queue.ingress_buffer))
                   if now != then]
        config = attrs.evolve(config, server=old.server, engine=kept_engine, store=old.store, tracing=old.tracing,
                              gpu=attrs.evolve(config.gpu, time_scale=old.gpu.time_scale),
                              queue=attrs.evolve(config.queue, ingress_buffer=old.queue.ingress_buffer))
        changes += self.admission.reconfigure(config.tenants, policies.batching, config.queue, keys=config.keys,
                                              admission=config.admission, prices=config.prices)
        changes += self.classes.reconfigure(config.classes)
        if config.classes:
            self.ledger.keep_books_with(self.classes)
        self.ledger.add_tenants(config.tenants)
        if policies.names != self.policies.names or config.policy.params != old.policy.params:
            changes.append("policies: " + ", ".join(f"{k}={v}" for k, v in policies.names.items()))
        self.scheduler.use_policies(policies)
        self.scheduler.release_waiting()
        if config.queue.timeout_s != old.queue.timeout_s:  # admission reports the other queue keys
            changes.append(f"queue.timeout_s {config.queue.timeout_s:g} (for requests queued from now on)")
        self.scheduler.queue_timeout_s = config.queue.timeout_s
        engine_changes: list[str] = []
        for engine in self.engines:
            engine_changes = engine.reconfigure(config)
        changes += engine_changes
        if config.engine.max_retries != old.engine.max_retries:
            changes.append(f"engine.max_retries {config.engine.max_retries}")
        changes += [f"{section}.{field.name} {getattr(getattr(config, section), field.name)}"
                    for section in ("admission", "gateway")
                    for field in attrs.fields(type(getattr(config, section)))
                    if getattr(getattr(config, section), field.name) != getattr(getattr(old, section), field.name)]
        if (config.forward, config.backends) != (old.forward, old.backends):
            changes.append("[forward] and [[backends]] need a restart to change (kept as before)")
            config = attrs.evolve(config, forward=old.forward, backends=old.backends)
        self.config, self.policies = config, policies
        return changes

    # -- read-only views -----------------------------------------------------------------
    def governor_view(self) -> GovernorView:
        try:
            reading = self.scheduler.governor_reading()
        except Exception as exc:  # a broken governor must not break /health and /metrics
            return GovernorView(state="ERROR", entropy_bits=None, window_ms=None, error=f"{type(exc).__name__}: {exc}")
        return GovernorView(state=reading.state, entropy_bits=reading.entropy_bits, window_ms=reading.window_s * 1000.0)

    def class_statistics(self) -> tuple[ClassFigures, ...]:
        """Every service class's attainment counts (:mod:`apsd.core.classes`)."""
        return self.classes.statistics()

    def health(self) -> Health:
        return Health(status="ok" if self.accepting else "draining", policy=self.scheduler.policy_names,
                      queue_depth=self.scheduler.queue_depth, governor=self.governor_view())

    @property
    def engine_description(self) -> EngineDescription:
        """What its engines are (GPUs, busy units, a summary), as :func:`apsd.engines.describe` says."""
        return describe(self.config)

    @property
    def gpus(self) -> int:
        return self.engine_description.gpus

    def statistics(self) -> PipelineStatistics:
        rates = {name: t.rate for name, t in self.config.tenants.items()}
        return PipelineStatistics(
            books=self.ledger.statistics(self.clock.now(), self.engine_description.busy_units, rates),
            policy=self.scheduler.policy_names,
            queue_depth=self.scheduler.queue_depth,
            engine_kind=self.config.engine.kind,
            engines=tuple(engine.statistics() for engine in self.engines),
            backends=tuple(b for engine in self.engines for b in engine.backend_statistics() or ()),
            gpus=self.gpus,
            time_scale=self.clock.time_scale,
            governor=self.governor_view(),
            routes=self.route_decisions(),
        )

    def route_decisions(self) -> dict[tuple[str, str], int]:
        """(backend or engine, reason) -> requests the routing policy sent there for that reason: the
        forward engine's choices between its backends, the scheduler's between several engines."""
        counts = collections.Counter(self.scheduler.route_counts)
        for engine in self.engines:
            counts.update(engine.route_decisions())
        return dict(counts)

    def fairness_view(self, *, idle: bool = True) -> FairnessView:
        """Fairness now, in model time: each configured tenant's output tokens over the last
        minute, its share of them beside its weight's share, its queued and running requests; the
        window's Jain index, and the queue by priority band (:mod:`apsd.core.service_window`).
        ``idle=False``: only the tenants with work (in time proportional to their number, not to
        the tenants configured). Service counts from the first call (or the exporter's making)."""
        return watch_for(self.ledger).view(self.clock.now(), self.config.tenants, idle=idle)

    def tenant_status(self, tenant_id: str) -> TenantStatus | None:
        tenant = self.config.tenants.get(tenant_id)
        if tenant is None:
            return None
        stats = self.ledger.tenants[tenant_id]
        bucket = self.store.bucket_view(self.admission.buckets[tenant_id], self.clock.now())
        return TenantStatus(
            tenant_id=tenant_id, rate=tenant.rate, burst=tenant.burst, tokens_available=bucket.tokens,
            replica_tokens=bucket.replica_tokens, shared_tokens=bucket.shared_tokens,
            shared_age_s=None if bucket.shared_age_s is None else round(bucket.shared_age_s, 3),
            queued=stats.queued, running=stats.running, in_flight=stats.in_flight, admitted=stats.admitted,
            completed=stats.completed, rejected=stats.rejected, rejected_by_error=dict(stats.rejected_by_error),
            failed=stats.failed, cancelled=stats.cancelled, prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.generated_tokens, cost_usd=stats.cost_usd, spend_usd=stats.spend_usd,
            waiting_for_concurrency=self.scheduler.gate.waiting(tenant_id))


def _single_model(engines: list[Engine]) -> str | None:
    """The one model the engines serve (what a request naming none is priced as), or None."""
    names = {name for engine in engines for name in engine.models()}
    return next(iter(names)) if len(names) == 1 else None


@asynccontextmanager
async def open_pipeline(config: Config, policies: PolicySet, *, request_id_prefix: str | None = "sim",
                        profiles: ProfileRegistry | None = None,
                        backend_client: BackendClient | None = None,
                        store: Store | None = None) -> AsyncIterator[Pipeline]:
    """Build a pipeline, run its stages in a nursery of their own, and yield it.

    The one way a pipeline runs: the daemon (which adds HTTP), the simulator and tests.
    Observation hooks of the plugins the policies came from fire in every case. Under
    ``trio.testing.MockClock(autojump_threshold=0)`` it runs in virtual time. On exit, new
    requests are refused, requests still unfinished are answered 503, and the stages stop.
    Raises ConfigError before anything runs for an ``[engine]`` that cannot be built. The forward
    engine talks to its backends through ``backend_client`` (default: over HTTP), and tenants'
    buckets live in ``store`` (default: the one ``[store]`` asks for).
    """
    pipeline = Pipeline.build(config, policies, request_id_prefix=request_id_prefix, profiles=profiles,
                              backend_client=backend_client, store=store)
    async with trio.open_nursery() as nursery:
        await nursery.start(pipeline._run_stages)
        try:
            yield pipeline
        finally:
            pipeline.close_doors()
            pipeline.abort_outstanding()
            nursery.cancel_scope.cancel()
