"""What a policy is: the three kinds the scheduler calls, and the registry that names them.

Ownership: the scheduler owns one object of each kind for the daemon's life and
calls it directly on the hot path (no pluggy call per heap operation). Policies
are synchronous and pure apart from their own state; they never do I/O and never
read a clock: the scheduler passes ``now`` (model seconds) in.

* **aging** — an :class:`OrderingPolicy` *is* the waiting queue: it decides
  which admitted request is served next.
* **governor** — a :class:`Governor` watches arrivals and sets the batch window.
* **batching** — a :class:`BatchingPolicy` decides when a batch is full and cuts
  it from the queue.

Factories receive the policy's own ``[policy.<name>]`` table (already a dict)
and the whole :class:`~apsd.core.config.Config`; they raise
:class:`~apsd.core.config.ConfigError` (use :func:`apsd.core.config.parse_section`) for a
bad parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import attrs

from apsd.core.config import Config, ConfigError

if TYPE_CHECKING:
    from apsd.core.models import Capacity, InferenceRequest

__all__ = [
    "BatchingPolicy",
    "GovernorReading",
    "Governor",
    "NO_WINDOW",
    "NoWindow",
    "OrderingPolicy",
    "PolicyKind",
    "PolicyRegistry",
    "PolicySet",
    "POLICY_KINDS",
]

PolicyKind = Literal["aging", "governor", "batching", "routing"]
POLICY_KINDS: tuple[PolicyKind, ...] = ("aging", "governor", "batching")


@runtime_checkable
class OrderingPolicy(Protocol):
    """The waiting queue, in the order the policy wants requests served."""

    def push(self, request: InferenceRequest, now: float) -> None:
        """Add an admitted request (its ``arrival`` and ``seq`` are set)."""

    def peek(self, now: float) -> InferenceRequest:
        """The request :meth:`pop` would return at ``now``; IndexError if empty."""

    def pop(self, now: float) -> InferenceRequest:
        """Remove and return the request to serve next; IndexError if empty."""

    def effective_priority(self, request: InferenceRequest, now: float) -> float:
        """The priority reported for ``request`` at ``now`` (higher is served sooner)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[InferenceRequest]:
        """Every queued request, in no particular order."""


@attrs.frozen
class GovernorReading:
    """What a governor reports: entropy in bits (if it measures it), window, state."""

    window_s: float
    state: str
    entropy_bits: float | None = None


@runtime_checkable
class Governor(Protocol):
    """Sets the batch window from what it observes.

    A governor may also have a ``states`` attribute: every state name its readings can
    report, so that ``apsd_governor_state`` exports a series for each from the first scrape
    (without it, a state appears once it has been reported).
    """

    def observe_arrival(self, now: float) -> None:
        """Called once per admitted request, in arrival order."""

    def reading(self, now: float) -> GovernorReading:
        """The current window and state as of ``now`` (never earlier than a previous call's);
        called at every dispatch decision, by ``/health``, ``/metrics`` and systemd's status
        line, also while nothing arrives: a reading that depends on recent arrivals must age."""


#: The governor's name where an engine batches by itself and no window is configured.
NO_WINDOW = "none"


class NoWindow:
    """The governor of an engine that forms its own batches (``continuous``, ``forward``) when no
    window is configured (:meth:`~apsd.core.config.PolicyConfig.window_configured`): a dispatch is
    cut as soon as the engine asks, so no request waits for others to arrive."""

    states = ("NONE",)
    _reading = GovernorReading(window_s=0.0, state="NONE")

    def observe_arrival(self, now: float) -> None:
        pass

    def reading(self, now: float) -> GovernorReading:
        return self._reading


@runtime_checkable
class BatchingPolicy(Protocol):
    """Decides when to dispatch and what goes in a dispatch, for the engine that asked.

    ``free`` is that engine's capacity as it is now (:class:`apsd.core.models.Capacity`): how many
    more sequences, how many more KV tokens, and ``free.need(request)``, the KV tokens a
    request needs to join it.
    """

    def refuse_reason(self, request: InferenceRequest) -> str | None:
        """Why ``request`` could never be in any dispatch (admission answers 413), else None.
        (What no engine can hold, the engines refuse themselves.)"""

    def is_full(self, queue: OrderingPolicy, now: float, free: Capacity) -> bool:
        """True when waiting longer cannot make the next dispatch bigger."""

    def cut(self, queue: OrderingPolicy, now: float, free: Capacity) -> list[InferenceRequest]:
        """Pop the next dispatch from ``queue``: requests that fit ``free`` together. Empty only
        when the next request in queue order does not fit ``free`` (the engine then asks again
        when it has more room); otherwise non-empty when the queue is."""


PolicyFactory = Callable[[dict[str, Any], Config], Any]


@attrs.frozen
class PolicyEntry:
    kind: PolicyKind
    name: str
    factory: PolicyFactory
    summary: str
    plugin: str


@attrs.frozen
class Preset:
    name: str
    aging: str
    governor: str
    batching: str
    plugin: str


@attrs.frozen
class PolicySet:
    """The three policy objects a pipeline runs with, and their names."""

    aging: OrderingPolicy
    governor: Governor
    batching: BatchingPolicy
    #: Where a request goes when there is more than one place (:mod:`apsd.core.routing`).
    routing: Any
    names: dict[str, str]
    #: Builds a fresh, empty aging policy (used after the running one raised).
    new_aging: Callable[[], OrderingPolicy]
    #: The plugin manager the policies came from: its observation hooks are the pipeline's events.
    plugin_manager: Any = None


class PluginError(Exception):
    """A plugin could not be loaded, registered or built; ``str()`` names it, on one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def _call_factory(entry: PolicyEntry, params: dict[str, Any], config: Config) -> Any:
    try:
        return entry.factory(params, config)
    except ConfigError as exc:
        raise ConfigError(f"{config.source}: {exc}") from None
    except Exception as exc:
        raise PluginError(f"{entry.kind} policy {entry.name!r} of plugin {entry.plugin!r} failed to build: "
                          f"{type(exc).__name__}: {exc}") from exc


@attrs.define(eq=False)
class PolicyRegistry:
    """Named policy factories and presets, filled by the ``register_policies`` hook."""

    entries: dict[tuple[str, str], PolicyEntry] = attrs.field(factory=dict)
    presets: dict[str, Preset] = attrs.field(factory=dict)
    current_plugin: str = "?"
    plugin_manager: Any = None

    def _add(self, kind: PolicyKind, name: str, factory: PolicyFactory, summary: str) -> None:
        # Names are unique across kinds: a policy's parameters live in [policy.<name>].
        taken = [e for (_, n), e in self.entries.items() if n == name]
        if taken:
            other = taken[0]
            raise ValueError(f"policy name {name!r} is registered twice ({other.kind} policy of {other.plugin}, "
                             f"{kind} policy of {self.current_plugin}); names are unique across kinds")
        self.entries[(kind, name)] = PolicyEntry(kind, name, factory, summary, self.current_plugin)

    def aging(self, name: str, factory: PolicyFactory, summary: str = "") -> None:
        """Register an :class:`OrderingPolicy` factory under ``name``."""
        self._add("aging", name, factory, summary)

    def governor(self, name: str, factory: PolicyFactory, summary: str = "") -> None:
        """Register a :class:`Governor` factory under ``name``."""
        self._add("governor", name, factory, summary)

    def batching(self, name: str, factory: PolicyFactory, summary: str = "") -> None:
        """Register a :class:`BatchingPolicy` factory under ``name``."""
        self._add("batching", name, factory, summary)

    def routing(self, name: str, factory: PolicyFactory, summary: str = "") -> None:
        """Register a routing policy factory (an :class:`apsd.core.routing.RoutingPolicy`) under ``name``,
        for ``[routing] policy``; its parameters are its ``[policy.<name>]`` table."""
        self._add("routing", name, factory, summary)

    def preset(self, name: str, *, aging: str, governor: str, batching: str) -> None:
        """Register a preset: a name for ``--policy`` that picks one policy of each kind."""
        if name in self.presets:
            raise ValueError(f"preset {name!r} is registered twice")
        self.presets[name] = Preset(name, aging, governor, batching, self.current_plugin)

    def names(self, kind: PolicyKind) -> list[str]:
        return sorted(name for (k, name) in self.entries if k == kind)

    def build(self, config: Config, preset: str | None = None) -> PolicySet:
        """Instantiate the policies ``config`` asks for; ``preset`` overrides ``[policy] preset``.

        Raises ConfigError naming the unknown preset, policy or parameter table.
        """
        source = config.source
        chosen_preset = preset or config.policy.preset
        if chosen_preset not in self.presets:
            raise ConfigError(f"{source}: policy preset {chosen_preset!r} is unknown "
                              f"(available: {', '.join(sorted(self.presets))})")
        base = self.presets[chosen_preset]
        names: dict[str, str] = {}
        for kind in POLICY_KINDS:
            names[kind] = getattr(config.policy, kind) or getattr(base, kind)
            if (kind, names[kind]) not in self.entries:
                available = ", ".join(self.names(kind))
                if getattr(config.policy, kind):
                    raise ConfigError(f"{source}: policy.{kind}: unknown {kind} policy {names[kind]!r} "
                                      f"(available: {available})")
                raise PluginError(f"preset {chosen_preset!r} of plugin {base.plugin!r} names unknown {kind} "
                                  f"policy {names[kind]!r} (available: {available})")
        known = {name for (_, name) in self.entries}
        for table in config.policy.params:
            if table not in known:
                raise ConfigError(f"{source}: policy.{table}: no policy of that name has parameters "
                                  f"(policies: {', '.join(sorted(known))})")
        selected = {**names, "routing": config.routing.policy}
        for (entry_kind, name), entry in self.entries.items():  # catch typos in unselected tables too
            if name in config.policy.params and name != selected[entry_kind]:
                _call_factory(entry, dict(config.policy.params[name]), config)
        built = {}
        for kind in POLICY_KINDS:
            entry = self.entries[(kind, names[kind])]
            built[kind] = _call_factory(entry, dict(config.policy.params.get(entry.name, {})), config)
        if config.engine.batches_itself and not config.policy.window_configured(names["governor"]):
            built["governor"], names["governor"] = NoWindow(), NO_WINDOW
        routing = self.entries.get(("routing", config.routing.policy))
        if routing is None:
            raise ConfigError(f"{source}: routing.policy: unknown routing policy {config.routing.policy!r} "
                              f"(available: {', '.join(self.names('routing'))})")
        built["routing"] = _call_factory(routing, dict(config.policy.params.get(routing.name, {})), config)
        aging = self.entries[("aging", names["aging"])]
        aging_params = dict(config.policy.params.get(aging.name, {}))
        return PolicySet(aging=built["aging"], governor=built["governor"], batching=built["batching"],
                         routing=built["routing"], names={"preset": chosen_preset, **names},
                         new_aging=lambda: aging.factory(dict(aging_params), config),
                         plugin_manager=self.plugin_manager)
