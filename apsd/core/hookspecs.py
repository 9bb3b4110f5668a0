"""The hooks a plugin implements: the plugin author's reference.

A plugin is any module or object with functions marked ``@apsd.hookimpl``. The
daemon registers the built-ins in :data:`apsd.plugins.DEFAULT_PLUGINS` first,
then every entry point in the ``apsd`` group of installed distributions (limited
by ``APSD_PLUGINS`` when set). An implementation may take any subset of a
spec's arguments, by name; misspelled hook names and unknown arguments stop the
daemon at start-up naming the plugin.

Two families:

* Registration — :func:`register_policies` and :func:`register_profiles`, called once
  at start-up; they contribute policies, and GPU and model profiles.
* Observation hooks (``request_*``, ``batch_*``) — called on the pipeline's
  hot path, synchronously, in the pipeline task where the event happens. They
  must be quick and must not block (no I/O; hand work to your own queue). Their
  return values are ignored. If one raises, the exception is logged with the
  plugin's traceback and the pipeline carries on: observers can never lose or
  change a request's outcome. Objects passed in are the pipeline's own: treat
  them as read-only. ``now`` is model seconds since the pipeline started.

A request's events, in order. Every admitted request produces ``request_admitted``,
then, unless it ends while queued, ``request_dispatched`` and, once its first token
exists, ``request_started``; then exactly one ``request_finished``. A request whose
engine fails before its first token may be put back in the queue
(``request_requeued``) and is dispatched again. A request refused before admission
produces exactly one ``request_rejected`` (bodies too malformed to name a request
produce none). ``batch_started`` and ``batch_finished`` come from the ``batch``
engine, whose dispatches run as batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from apsd.core.models import Dispatch, InferenceRequest, Outcome, Refusal
    from apsd.core.policy import PolicyRegistry

hookspec = pluggy.HookspecMarker("apsd")
hookimpl = pluggy.HookimplMarker("apsd")

#: The observation hooks, in the order a request meets them.
EVENT_HOOKS = ("request_admitted", "request_rejected", "request_dispatched", "request_requeued",
               "batch_started", "request_started", "batch_finished", "request_finished")


@hookspec
def register_policies(registry: PolicyRegistry) -> None:
    """Register policy factories and presets with ``registry``.

    Called once per plugin manager, at start-up, before the config's policies
    are built, for every plugin in registration order (built-ins first). Call
    ``registry.aging(name, factory, summary)``, ``registry.governor(...)``,
    ``registry.batching(...)``, ``registry.routing(...)`` and ``registry.preset(name,
    aging=..., governor=..., batching=...)``. Each ``factory(params, config)`` receives
    the ``[policy.<name>]`` table as a dict and the whole :class:`apsd.Config`, and
    returns a new policy object (see ``docs/how-to/write-a-plugin.md`` for the
    interfaces); it raises :class:`apsd.ConfigError` for a bad parameter.

    The fourth kind, a *routing* policy (:class:`apsd.core.routing.RoutingPolicy`),
    decides where a dispatched request runs when there are several backends or
    engines; ``[routing] policy`` picks it by name (presets do not), and its
    ``route`` and ``placed`` are called synchronously on the dispatch path.

    May raise: any exception stops the daemon at start-up with one message
    naming the plugin (registering a name another plugin already took raises
    ``ValueError``). Returns nothing.
    """


@hookspec
def register_profiles(registry: Any) -> None:
    """Register GPU and model profiles for the ``continuous`` engine with ``registry`` (an
    :class:`apsd.ProfileRegistry`).

    Called once per plugin manager, at start-up, for every plugin in registration order
    (built-ins first), before the config's ``[engine]`` is checked. Call
    ``registry.gpu(apsd.GpuProfile(...))`` and ``registry.model(apsd.ModelProfile(...))``;
    the profiles' fields are documented on those classes (``apsd/engines/profiles.py``).

    May raise: any exception stops the daemon at start-up with one message naming the
    plugin (a name another plugin already registered raises ``ProfileError``). Returns nothing.
    """


@hookspec
def request_admitted(request: InferenceRequest, now: float) -> None:
    """``request`` passed admission: its tokens are taken, ``arrival``/``seq`` are set.

    Called once per admitted request, before it enters the queue.
    """


@hookspec
def request_rejected(request: InferenceRequest, refusal: Refusal, now: float) -> None:
    """``request`` was refused before admission (``refusal.status`` 404, 413, 429, 503, ...).

    Called once per refused request; the client gets ``refusal`` as its answer.
    """


@hookspec
def request_dispatched(request: InferenceRequest, dispatch: Dispatch, batch: Dispatch, engine_id: int,
                       now: float) -> None:
    """``request`` left the queue in ``dispatch``, for engine ``engine_id``; ``dispatched_at``,
    ``effective_priority`` and ``engine_id`` are set. Called once per dispatch of the request
    (again after a requeue), for each request in dispatch order. ``batch`` is ``dispatch``
    under its apsd 0.1 name."""


@hookspec
def request_requeued(request: InferenceRequest, engine_id: int, reason: str, now: float) -> None:
    """``request``'s engine failed before its first token and the request went back to the
    queue (``request.retries`` counts how often), keeping its place in queue order. ``reason``
    says what failed. Called once per requeue; a dispatch follows, or its timeout, or shutdown."""


@hookspec
def batch_started(batch: Dispatch, engine_id: int, now: float) -> None:
    """The batch engine ``engine_id`` began running ``batch``. Called once per batch."""


@hookspec
def request_started(request: InferenceRequest, engine_id: int, now: float) -> None:
    """``request``'s first token was produced (``request.started_at == now``): ``now -
    request.arrival`` is its time to first token. Called at most once per request."""


@hookspec
def batch_finished(batch: Dispatch, engine_id: int, now: float, busy_s: float, cost_usd: float) -> None:
    """``batch`` finished on batch engine ``engine_id`` after ``busy_s`` model seconds, costing
    ``cost_usd``. Called once per batch that ran, before its requests' ``request_finished``.
    """


@hookspec
def request_finished(request: InferenceRequest, outcome: Outcome, now: float) -> None:
    """An admitted request reached its terminal outcome, delivered to the client.

    ``outcome`` is a :class:`apsd.Completion` (completed) or a
    :class:`apsd.Refusal` whose ``kind`` is ``"failed"`` or ``"cancelled"``.
    ``request.tokens_generated`` and ``request.used_tokens`` say what it used: its
    tenant is charged that (nothing if it failed), and refunded the rest of what
    admission reserved. Called exactly once per admitted request.
    """
