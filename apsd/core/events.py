"""Observation events: the pipeline tells its observers what happened, cheaply and safely.

Ownership: one :class:`EventBus` per pipeline, built from the plugin manager at start-up; the
ledger emits every event (it is where each step is counted). The bus carries observation only:
what must happen when a request ends (its tenant's settlement, its policies) is written out in
:meth:`apsd.core.ledger.Ledger.finish`, which emits ``request_finished`` last. Two kinds of
observer, called in this order:

* apsd's own, which :meth:`EventBus.subscribe` when they are built: the Prometheus exporter's
  histograms (:mod:`apsd.serve.prometheus`);
* plugins' hook implementations (:mod:`apsd.core.hookspecs`), in pluggy's call order.

Each observer is called on its own, with the arguments it declares (by name). One that raises
is logged, naming it, and the others still run. An event nobody observes costs one dict lookup.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import pluggy

from apsd.core.hookspecs import EVENT_HOOKS

__all__ = ["EventBus"]

log = logging.getLogger("apsd.plugins")


class EventBus:
    def __init__(self, plugin_manager: pluggy.PluginManager | None = None) -> None:
        # event -> [(who, function, the argument names it takes)]: subscribers first, then plugins
        self._listeners: dict[str, list[tuple[str, Callable[..., Any], tuple[str, ...]]]] = {}
        self._plugins: dict[str, list[tuple[str, Callable[..., Any], tuple[str, ...]]]] = {}
        self._subscribers: dict[str, list[tuple[str, Callable[..., Any], tuple[str, ...]]]] = {}
        if plugin_manager is not None:
            for name in EVENT_HOOKS:
                impls = getattr(plugin_manager.hook, name).get_hookimpls()
                if impls:
                    self._plugins[name] = [(f"plugin {i.plugin_name!r}", i.function, tuple(i.argnames))
                                           for i in reversed(impls)]
        self._rebuild()

    def subscribe(self, event: str, listener: Callable[..., Any], who: str | None = None) -> None:
        """Call ``listener`` on every ``event``, before the plugins, with the arguments it names
        (any subset of the event's, as for a hook implementation)."""
        if event not in EVENT_HOOKS:
            raise ValueError(f"no event named {event!r} (events: {', '.join(EVENT_HOOKS)})")
        argnames = tuple(inspect.signature(listener).parameters)
        label = who or str(getattr(listener, "__qualname__", repr(listener)))
        self._subscribers.setdefault(event, []).append((label, listener, argnames))
        self._rebuild()

    def _rebuild(self) -> None:
        self._listeners = {name: [*self._subscribers.get(name, ()), *self._plugins.get(name, ())]
                           for name in EVENT_HOOKS if name in self._subscribers or name in self._plugins}

    def wants(self, name: str) -> bool:
        return name in self._listeners

    def emit(self, name: str, **kwargs: Any) -> None:
        listeners = self._listeners.get(name)
        if not listeners:
            return
        for who, function, argnames in listeners:
            try:
                function(*[kwargs[a] for a in argnames])
            except Exception:
                log.exception("%s raised in its %s listener; ignored", who, name)
