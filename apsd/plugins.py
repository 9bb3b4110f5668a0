"""Plugin discovery: one fresh pluggy manager per daemon, built-ins registered like anyone else.

Ownership: :func:`make_plugin_manager` builds the manager (built-ins, then the
``apsd`` entry points of installed distributions, filtered by ``APSD_PLUGINS``);
:func:`load_policy_registry` asks every plugin for its policies,
:func:`load_profile_registry` for its GPU and model profiles;
:func:`build_policies` does both and instantiates the configured policies.
Every failure is a :class:`PluginError` whose message names the plugin.

``APSD_PLUGINS``: unset loads every installed plugin; a comma-separated list of
entry-point names loads only those (a name that is not installed is an error);
set but empty loads none. Built-ins always load.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from types import EllipsisType
from typing import Any

import pluggy

from apsd.core import hookspecs
from apsd.core.config import Config
from apsd.core.policy import POLICY_KINDS, PluginError, PolicyRegistry, PolicySet
from apsd.core.version import VERSION
from apsd.engines.profiles import ProfileRegistry

__all__ = [
    "DEFAULT_PLUGINS",
    "ENTRY_POINT_GROUP",
    "PluginError",
    "build_policies",
    "describe_plugins",
    "load_policy_registry",
    "load_profile_registry",
    "make_plugin_manager",
]

#: Built-in policy modules, registered exactly as entry-point plugins are.
DEFAULT_PLUGINS: tuple[str, ...] = (
    "apsd.policies.aging",
    "apsd.policies.fair",
    "apsd.policies.governor",
    "apsd.policies.batching",
    "apsd.policies.routing",
    "apsd.engines.profiles",
)

ENTRY_POINT_GROUP = "apsd"
ALLOW_LIST_VARIABLE = "APSD_PLUGINS"




def _allow_list(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {name.strip() for name in value.split(",") if name.strip()}


def _load_entry_points(pm: pluggy.PluginManager, allowed: set[str] | None) -> None:
    entry_points = {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    if allowed is not None and (missing := sorted(allowed - set(entry_points))):
        raise PluginError(f"{ALLOW_LIST_VARIABLE} names {missing[0]!r}, but no installed distribution "
                          f"provides it (installed: {', '.join(sorted(entry_points)) or 'none'})")
    for name, ep in sorted(entry_points.items()):
        if allowed is not None and name not in allowed:
            continue
        where = f"plugin {name!r} ({ep.value}"
        where += f", from {ep.dist.name} {ep.dist.version})" if ep.dist else ")"
        try:
            pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"{where}: bad hook implementation: {exc}") from exc
        except Exception as exc:
            raise PluginError(f"{where} failed to load: {type(exc).__name__}: {exc}") from exc


def make_plugin_manager(*, load_entry_points: bool = True,
                        allow: str | None | EllipsisType = ...) -> pluggy.PluginManager:
    """A new manager with the hookspecs, the built-ins and (by default) installed plugins.

    ``allow`` is an ``APSD_PLUGINS``-style string; by default the environment variable is read.
    """
    pm = pluggy.PluginManager("apsd")
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    if load_entry_points:
        allowed = _allow_list(os.environ.get(ALLOW_LIST_VARIABLE) if isinstance(allow, EllipsisType) else allow)
        _load_entry_points(pm, allowed)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {pm.get_name(exc.plugin)!r}: {exc}") from exc
    return pm


def _register(pm: pluggy.PluginManager, hook: str, registry: Any) -> None:
    """Call every plugin's ``hook`` with ``registry``, in registration order (built-ins first), telling
    the registry who is registering; PluginError naming the plugin if one raises."""
    for impl in getattr(pm.hook, hook).get_hookimpls():
        registry.current_plugin = impl.plugin_name
        try:
            impl.function(registry=registry)
        except Exception as exc:
            raise PluginError(f"plugin {impl.plugin_name!r} failed in {hook}: {type(exc).__name__}: {exc}") from exc


def load_policy_registry(pm: pluggy.PluginManager) -> PolicyRegistry:
    """Call every plugin's ``register_policies`` (registration order) and return the registry."""
    registry = PolicyRegistry(plugin_manager=pm)
    _register(pm, "register_policies", registry)
    return registry


def load_profile_registry(pm: pluggy.PluginManager) -> ProfileRegistry:
    """Call every plugin's ``register_profiles`` (registration order) and return the registry."""
    registry = ProfileRegistry()
    _register(pm, "register_profiles", registry)
    return registry


def build_policies(config: Config, preset: str | None = None, *,
                   plugin_manager: pluggy.PluginManager | None = None) -> PolicySet:
    """The policies ``config`` (and ``preset``) select, from built-ins and installed plugins.

    Raises :class:`~apsd.core.config.ConfigError` or :class:`PluginError`.
    """
    pm = plugin_manager or make_plugin_manager()
    return load_policy_registry(pm).build(config, preset)


def describe_plugins(pm: pluggy.PluginManager, registry: PolicyRegistry,
                     profiles: ProfileRegistry | None = None) -> list[dict[str, Any]]:
    """One dict per registered plugin: name, distribution, version, built-in, what it provides
    (policies, presets and, given ``profiles``, GPU and model profiles)."""
    dists = {id(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    described = []
    for plugin in pm.get_plugins():
        name = pm.get_name(plugin)
        dist = dists.get(id(plugin))
        builtin = name in DEFAULT_PLUGINS
        provides: dict[str, list[str]] = {
            kind: [e.name for e in registry.entries.values() if (e.plugin, e.kind) == (name, kind)]
            for kind in (*POLICY_KINDS, "routing")
        }
        provides["presets"] = [p.name for p in registry.presets.values() if p.plugin == name]
        if profiles is not None:
            provides["gpus"] = [g.name for g in profiles.gpus() if profiles.registered_by("gpu", g.name) == name]
            provides["models"] = [m.name for m in profiles.models()
                                  if profiles.registered_by("model", m.name) == name]
        hooks = sorted(impl.name for impl in pm.get_hookcallers(plugin) or [])
        described.append({
            "name": name,
            "distribution": "apsd" if builtin else (dist.project_name if dist else None),
            "version": VERSION if builtin else (dist.version if dist else None),
            "builtin": builtin,
            "provides": {k: v for k, v in provides.items() if v},
            "hooks": hooks,
        })
    return sorted(described, key=lambda d: (not d["builtin"], d["name"]))
