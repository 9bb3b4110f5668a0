"""Plugin discovery: one fresh pluggy manager per daemon, built-ins registered like anyone else.

Ownership: :func:`load_policy_registry` is called once by whoever builds a
pipeline (daemon, simulator, tests); it returns the filled
:class:`~apsd.policy.PolicyRegistry`, and the pipeline keeps the manager.
"""

from __future__ import annotations

import importlib

import pluggy

from . import hookspecs
from .policy import PolicyRegistry

__all__ = ["DEFAULT_PLUGINS", "PluginError", "load_policy_registry", "make_plugin_manager"]

#: Built-in policy modules, registered exactly as entry-point plugins are.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "apsd.policies.aging",
    "apsd.policies.governor",
    "apsd.policies.batching",
)

ENTRY_POINT_GROUP = "apsd"


class PluginError(Exception):
    """A plugin could not be loaded or registered; ``str()`` names the plugin."""


def make_plugin_manager(*, load_entry_points: bool = True) -> pluggy.PluginManager:
    """A new manager with the hookspecs, the built-ins and (by default) installed plugins."""
    pm = pluggy.PluginManager("apsd")
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if load_entry_points:
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        except Exception as exc:  # an entry point that fails to import or register
            raise PluginError(f"plugin failed to load: {type(exc).__name__}: {exc}") from exc
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {exc.plugin!r}: {exc}") from exc
    return pm


def load_policy_registry(pm: pluggy.PluginManager) -> PolicyRegistry:
    """Call every plugin's ``register_policies`` and return the filled registry."""
    registry = PolicyRegistry()
    for impl in pm.hook.register_policies.get_hookimpls():  # registration order: built-ins first
        registry.current_plugin = impl.plugin_name
        try:
            impl.function(registry=registry)
        except Exception as exc:
            raise PluginError(f"plugin {impl.plugin_name!r} failed in register_policies: "
                              f"{type(exc).__name__}: {exc}") from exc
    return registry
