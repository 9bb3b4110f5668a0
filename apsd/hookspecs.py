"""The hooks a plugin implements: the plugin author's reference.

A plugin is any module or object with functions marked ``@apsd.hookimpl``,
registered by the daemon at start-up: the built-ins in
:data:`apsd.plugins.DEFAULT_PLUGINS` first, then every entry point in the
``apsd`` group of installed distributions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from .policy import PolicyRegistry

hookspec = pluggy.HookspecMarker("apsd")
hookimpl = pluggy.HookimplMarker("apsd")


@hookspec
def register_policies(registry: PolicyRegistry) -> None:
    """Register policy factories and presets with ``registry``.

    Called once per plugin manager, at start-up, before the config's policies
    are built. Call ``registry.aging(name, factory, summary)``,
    ``registry.governor(...)``, ``registry.batching(...)`` and
    ``registry.preset(name, aging=..., governor=..., batching=...)``; each
    ``factory(params, config)`` receives the ``[policy.<name>]`` table as a
    dict and the whole :class:`apsd.config.Config`.

    May raise: registering a name that another plugin already took raises
    ``ValueError``, which stops the daemon at start-up naming both plugins.
    Returns nothing.
    """
