"""The hooks a plugin implements: the plugin author's reference.

A plugin is any module or object with functions marked ``@apsd.hookimpl``. The
daemon registers the built-ins in :data:`apsd.plugins.DEFAULT_PLUGINS` first,
then every entry point in the ``apsd`` group of installed distributions (limited
by ``APSD_PLUGINS`` when set). An implementation may take any subset of a
spec's arguments, by name; misspelled hook names and unknown arguments stop the
daemon at start-up naming the plugin.

Two families:

* :func:`register_policies` — called once at start-up; contributes policies.
* Observation hooks (``request_*``, ``batch_*``) — called on the pipeline's
  hot path, synchronously, in the pipeline task where the event happens. They
  must be quick and must not block (no I/O; hand work to your own queue). Their
  return values are ignored. If one raises, the exception is logged with the
  plugin's traceback and the pipeline carries on: observers can never lose or
  change a request's outcome. Objects passed in are the pipeline's own: treat
  them as read-only. ``now`` is model seconds since the pipeline started.

Every admitted request produces exactly: ``request_admitted``, then (unless it
is cancelled or fails while queued) ``request_dispatched``, then exactly one
``request_finished``. A request refused before admission produces exactly one
``request_rejected`` (bodies too malformed to name a request produce none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .models import Batch, InferenceRequest, Outcome, Refusal
    from .policy import PolicyRegistry

hookspec = pluggy.HookspecMarker("apsd")
hookimpl = pluggy.HookimplMarker("apsd")

#: The observation hooks, in the order a request meets them.
EVENT_HOOKS = ("request_admitted", "request_rejected", "request_dispatched", "batch_started",
               "batch_finished", "request_finished")


@hookspec
def register_policies(registry: PolicyRegistry) -> None:
    """Register policy factories and presets with ``registry``.

    Called once per plugin manager, at start-up, before the config's policies
    are built, for every plugin in registration order (built-ins first). Call
    ``registry.aging(name, factory, summary)``, ``registry.governor(...)``,
    ``registry.batching(...)`` and ``registry.preset(name, aging=...,
    governor=..., batching=...)``. Each ``factory(params, config)`` receives the
    ``[policy.<name>]`` table as a dict and the whole :class:`apsd.Config`, and
    returns a new policy object (see ``docs/plugins.md`` for the three
    interfaces); it raises :class:`apsd.ConfigError` for a bad parameter.

    May raise: any exception stops the daemon at start-up with one message
    naming the plugin (registering a name another plugin already took raises
    ``ValueError``). Returns nothing.
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
def request_dispatched(request: InferenceRequest, batch: Batch, now: float) -> None:
    """``request`` left the queue in ``batch``; ``dispatched_at`` and
    ``effective_priority`` are set. Called once per request, in batch order."""


@hookspec
def batch_started(batch: Batch, executor_id: int, now: float) -> None:
    """Executor ``executor_id`` began running ``batch``. Called once per batch."""


@hookspec
def batch_finished(batch: Batch, executor_id: int, now: float, busy_s: float, cost_usd: float) -> None:
    """``batch`` finished on ``executor_id`` after ``busy_s`` model seconds, costing ``cost_usd``.

    Called once per batch that ran, before its requests' ``request_finished``.
    """


@hookspec
def request_finished(request: InferenceRequest, outcome: Outcome, now: float) -> None:
    """An admitted request reached its terminal outcome, delivered to the client.

    ``outcome`` is a :class:`apsd.Completion` (completed) or a
    :class:`apsd.Refusal` whose ``kind`` is ``"failed"`` or ``"cancelled"``.
    Called exactly once per admitted request.
    """
