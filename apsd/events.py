"""Observation events: the pipeline tells plugins what happened, cheaply and safely.

Ownership: one :class:`EventBus` per pipeline, built from the plugin manager at
start-up. Hooks without implementations cost one dict lookup; a hook that raises
is logged and ignored (see :mod:`apsd.hookspecs`).
"""

from __future__ import annotations

import logging
from typing import Any

import pluggy

from .hookspecs import EVENT_HOOKS

__all__ = ["EventBus"]

log = logging.getLogger("apsd.plugins")


class EventBus:
    def __init__(self, plugin_manager: pluggy.PluginManager | None = None) -> None:
        self._hooks: dict[str, Any] = {}
        if plugin_manager is not None:
            for name in EVENT_HOOKS:
                hook = getattr(plugin_manager.hook, name)
                if hook.get_hookimpls():
                    self._hooks[name] = hook

    def wants(self, name: str) -> bool:
        return name in self._hooks

    def emit(self, name: str, **kwargs: Any) -> None:
        hook = self._hooks.get(name)
        if hook is None:
            return
        try:
            hook(**kwargs)
        except Exception:
            log.exception("a plugin's %s hook raised; ignored", name)
