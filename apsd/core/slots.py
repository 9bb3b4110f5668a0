"""A server's slots, and the leases that hold them: what every sender to a server shares.

A backend runs at most ``max_concurrency`` requests at once (llama.cpp's ``-np``, vLLM's
``max_num_seqs``): its *slots*. Every request the forward engine runs there holds a :class:`Lease`
on one, from the moment it is placed until its attempt ends. The :class:`SlotTable` holds the
leases of every sender, so that senders together never run more than a server's slots:

* :class:`LocalSlots` (one apsd, ``[store] kind = "memory"``, and the simulator): the table is this
  process's own.
* :class:`apsd.store.redis_slots.RedisSlots` (replicas sharing Redis): the table lives in Redis,
  each claim is atomic there, leases are renewed while they run and expire when their replica
  dies, and a replica preempts another's request by an order through Redis.

Placing a request is two steps: :meth:`SlotTable.hold` puts its lease in this process's view at
once (synchronously, so the engine's next decision sees it), and :meth:`SlotTable.confirm` makes
it the slot's (at once here; one round trip to Redis there). A lease placed in the slot of a
*victim* (a request being preempted for it, :mod:`apsd.engines.preemption`) is confirmed when the
victim's lease is released: the victim's slot passes to it, so no other request can take it in
between.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import trio

__all__ = ["Lease", "LocalSlots", "OnPreempt", "SlotTable"]

#: Called with a lease id when another sender orders this process to preempt that lease's request.
OnPreempt = Callable[[str], None]


@attrs.define(eq=False)
class Lease:
    """One request's hold on one slot of one backend, for one attempt (a resumed request takes a
    new lease). ``since`` is the model time its current run began (a remote lease's: converted to
    this process's clock); ``started``: its first token came; ``preemptible``: it may be chosen as a
    victim at all (not started, or started and resumable); ``preemptions``: times its request was
    preempted before; ``ttft_s``: its service class's target."""

    lease_id: str
    backend: str
    tenant: str
    replica: str
    since: float
    started: bool = False
    preemptible: bool = True
    preemptions: int = 0
    #: Its request's service class's ``ttft_s`` (``math.inf``: no class): a tighter classed request of the
    #: same tenant may take its slot.
    ttft_s: float = math.inf
    #: The lease its slot passes to when it is released (set when it is chosen as a victim).
    yield_to: Lease | None = None
    #: Set once the slot is this lease's (at once, or when the victim it replaces is released).
    granted: trio.Event = attrs.field(factory=trio.Event, repr=False)
    #: The slot will not be this lease's (the victim's owner refused, or the claim failed).
    refused: bool = False


class SlotTable(Protocol):
    """The leases on every backend, as this process sees them (see the module docstring)."""

    #: This process's name among the senders (its leases carry it).
    replica: str

    def leases(self, backend: str) -> Sequence[Lease]:
        """Every lease on ``backend`` known here (this process's, placed but not yet confirmed, included)."""

    def free(self, backend: str, capacity: int) -> int:
        """Slots of ``backend`` (``capacity`` in all) that no lease holds, as far as this process may use."""

    def hold(self, lease: Lease, victim: Lease | None = None) -> None:
        """Put ``lease`` in this process's view now: in a free slot, or in ``victim``'s (which passes
        to it when released)."""

    async def confirm(self, lease: Lease, capacity: int, victim: Lease | None = None) -> bool:
        """Wait until the slot is ``lease``'s (True), or will not be (False: its lease is dropped, and
        the request must go back to the queue). Bounded in time."""

    def update(self, lease: Lease) -> None:
        """``lease``'s ``started`` or ``preemptible`` changed (the other senders learn it)."""

    def release(self, lease: Lease) -> None:
        """``lease``'s attempt ended: its slot is free, or passes to the lease it yields to."""

    def abandon(self, lease: Lease) -> None:
        """A victim that will not be preempted after all (it ended otherwise, or may not be): the lease
        waiting for its slot is refused."""

    def attach(self, backends: Sequence[str], on_preempt: OnPreempt, on_change: Callable[[], None]) -> None:
        """The backends whose slots this process uses, and who to tell when another sender orders a lease
        of this process's preempted, and when slots held elsewhere became free."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the table in step with the other senders until cancelled (returns at once when there
        are none)."""


@attrs.define(eq=False)
class LocalSlots:
    """A :class:`SlotTable` of this process only."""

    replica: str = "local"
    _leases: dict[str, dict[str, Lease]] = attrs.field(factory=dict, init=False)

    def leases(self, backend: str) -> Sequence[Lease]:
        return list(self._leases.get(backend, {}).values())

    def in_use(self, backend: str) -> int:
        return len(self._leases.get(backend, ()))

    def free(self, backend: str, capacity: int) -> int:
        return max(0, capacity - len(self._leases.get(backend, ())))

    def hold(self, lease: Lease, victim: Lease | None = None) -> None:
        self._leases.setdefault(lease.backend, {})[lease.lease_id] = lease
        if victim is None:
            lease.granted.set()
        else:
            victim.yield_to = lease

    async def confirm(self, lease: Lease, capacity: int, victim: Lease | None = None) -> bool:
        await lease.granted.wait()   # (a local victim is cancelled at once: its release follows shortly)
        return not lease.refused

    def update(self, lease: Lease) -> None:
        pass

    def release(self, lease: Lease) -> None:
        held = self._leases.get(lease.backend)
        if held is not None and held.pop(lease.lease_id, None) is not None and not held:
            del self._leases[lease.backend]
        heir = lease.yield_to
        if heir is not None:
            lease.yield_to = None
            heir.granted.set()

    def abandon(self, lease: Lease) -> None:
        heir = lease.yield_to
        if heir is not None:
            lease.yield_to = None
            heir.refused = True
            self.release(heir)
            heir.granted.set()

    def attach(self, backends: Sequence[str], on_preempt: OnPreempt, on_change: Callable[[], None]) -> None:
        pass   # (no other sender)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
