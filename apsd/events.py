"""Observation events: the pipeline tells plugins what happened, cheaply and safely.

Ownership: one :class:`EventBus` per pipeline, built from the plugin manager at
start-up. Each hook implementation is called on its own, with the arguments it
declares: one that raises is logged (naming its plugin) and the others still
run. A hook nobody implements costs one dict lookup.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pluggy

from .hookspecs import EVENT_HOOKS

__all__ = ["EventBus"]

log = logging.getLogger("apsd.plugins")


class EventBus:
    def __init__(self, plugin_manager: pluggy.PluginManager | None = None) -> None:
        # hook name -> [(plugin name, function, the argument names it takes)], in pluggy's call order
        self._listeners: dict[str, list[tuple[str, Callable[..., Any], tuple[str, ...]]]] = {}
        if plugin_manager is not None:
            for name in EVENT_HOOKS:
                impls = getattr(plugin_manager.hook, name).get_hookimpls()
                if impls:
                    self._listeners[name] = [(i.plugin_name, i.function, tuple(i.argnames))
                                             for i in reversed(impls)]

    def wants(self, name: str) -> bool:
        return name in self._listeners

    def emit(self, name: str, **kwargs: Any) -> None:
        listeners = self._listeners.get(name)
        if not listeners:
            return
        for plugin, function, argnames in listeners:
            try:
                function(*[kwargs[a] for a in argnames])
            except Exception:
                log.exception("plugin %r raised in its %s hook; ignored", plugin, name)
