"""Readiness: whether this daemon should be sent new requests now (``GET /ready``).

Liveness and readiness are different questions. ``/health`` answers "is the process serving?"
(200 while it does, draining included): a liveness probe that failed would restart a daemon
that is only waiting for its backends. ``/ready`` answers "would a new request be served?":

* ``draining``: shutdown has begun, new requests get 503 ``shutting_down``;
* ``no_backend``: the ``forward`` engine has no usable backend (none is healthy, or none knows
  its models yet), so every new request would get 503 ``no_backend``. The answer lists the
  models known to have no usable backend (empty while no backend has told its models);
* ``ready`` otherwise. A simulated engine (``batch``, ``continuous``) is always usable. A forward
  engine that serves some models but not others is ready (it can serve some requests; those for
  the missing models get 503 ``no_backend`` at once) and lists the missing ones.

Ownership: :func:`decide_readiness` is pure (snapshots in, a decision out); :func:`readiness`
reads the pipeline's state for it and changes nothing. Both are cheap enough for a probe every
second: they walk the backends once.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from apsd.core.engine import BackendStatistics
from apsd.pipeline import Pipeline

__all__ = ["Readiness", "decide_readiness", "readiness"]


@attrs.frozen
class Readiness:
    """The answer of ``GET /ready`` (200 when :attr:`ready`, 503 otherwise)."""

    #: ``ready``, ``draining`` or ``no_backend``.
    status: str
    #: Why, for a person.
    message: str
    #: Models the forward engine knows that no healthy backend serves now (sorted); empty otherwise.
    models_without_backend: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return self.status == "ready"


def decide_readiness(*, accepting: bool, backends: Iterable[BackendStatistics] | None) -> Readiness:
    """Whether a daemon is ready, from whether it accepts requests and its forward engine's backends.

    ``backends`` is None without a forward engine (the simulated engines are always usable).
    Draining wins over everything else. A backend is usable while it is healthy and knows its
    models (configured, or read from its ``/v1/models``); saturation is load, not unreadiness.
    """
    if not accepting:
        return Readiness("draining", "apsd is shutting down and accepts no new requests")
    if backends is None:
        return Readiness("ready", "the engines are serving")
    known: set[str] = set()
    served: set[str] = set()
    for backend in backends:
        known.update(backend.models)
        if backend.healthy:
            served.update(backend.models)
    missing = tuple(sorted(known - served))
    if not served:
        what = f"models {', '.join(missing)} cannot be served" if missing else "their models are not known yet"
        return Readiness("no_backend", f"no backend is usable: {what}", missing)
    if missing:
        return Readiness("ready", f"serving models {', '.join(sorted(served))}; no usable backend for "
                         f"{', '.join(missing)}", missing)
    return Readiness("ready", f"serving models {', '.join(sorted(served))}")


def readiness(pipeline: Pipeline) -> Readiness:
    """:func:`decide_readiness` for a running pipeline, as of now."""
    forwarded = [found for engine in pipeline.engines if (found := engine.backend_statistics()) is not None]
    backends = [b for found in forwarded for b in found] if forwarded else None
    return decide_readiness(accepting=pipeline.accepting, backends=backends)
