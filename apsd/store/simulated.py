"""The shared state of :class:`~apsd.store.leasing.LeasingStore` in memory, for the simulator.

Several pipelines in one virtual-time run (``apsd simulate --replicas N``) share one
:class:`SimulatedSharedState`, as replicas share Redis: the same exchange rules as the Lua scripts of
:mod:`apsd.store.redis` (tested against them), timed by the trio clock, and each exchange taking
``delay_s`` model seconds, the round trip to Redis. With ``[store] sync_interval_s`` it shows what
the sync period costs in accuracy and buys in traffic.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

import trio

from apsd.core.budget import LEASE_TTL_S, BudgetAsk
from apsd.core.config import StoreConfig
from apsd.store.leasing import LeaseAsk, LeasingStore

__all__ = ["SimulatedSharedState", "simulated_store"]


class SimulatedSharedState:
    """Buckets (tenant -> [tokens, updated]), service totals and replicas' last exchange, in memory."""

    name = "memory (simulated shared store)"

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.buckets: dict[str, list[float]] = {}
        self.totals: dict[str, float] = {}
        self.seen: dict[str, float] = {}
        #: (account, period) -> the budget account's fields, named as in Redis's hash.
        self.budgets: dict[tuple[str, str], dict[str, float]] = {}

    @asynccontextmanager
    async def session(self) -> AsyncIterator[SimulatedSharedState]:
        yield self

    async def lease(self, asks: Sequence[LeaseAsk]) -> list[tuple[float, float]]:
        await trio.sleep(self.delay_s)
        now = trio.current_time()
        out = []
        for ask in asks:
            state = self.buckets.get(ask.tenant)
            returned = ask.returned if state is not None or ask.returned > 0 else 0.0
            tokens, updated = state if state is not None else (ask.burst, now)
            if now > updated:
                tokens, updated = min(ask.burst, tokens + (now - updated) * ask.rate), now
            tokens = min(ask.burst, tokens + returned)
            grant = min(ask.want, tokens) if ask.want > 0 and tokens > 0 else 0.0
            if ask.want or ask.returned or state is None:  # (an ask for nothing only reads, as in Lua)
                self.buckets[ask.tenant] = [tokens - grant, updated]
            out.append((grant, tokens - grant))
        return out

    async def budget(self, replica: str, asks: Sequence[BudgetAsk]) -> list[tuple[float, int, float, float]]:
        await trio.sleep(self.delay_s)
        now = trio.current_time()
        out = []
        for ask in asks:
            account = self.budgets.setdefault((ask.account, ask.period), {})
            spent = account.get("spent", ask.known_spent)   # (lost: written back; see BUDGET_SCRIPT)
            base = account.get(f"settled:{replica}", ask.acknowledged)
            presumed = account.pop(f"presumed:{replica}", 0)
            if presumed > 0:   # (back: what it reports replaces the presumption)
                spent = max(0, spent - presumed)
            if ask.settled > base:
                spent += ask.settled - base
            others = others_short = 0.0
            for name in [f[5:] for f in account if f.startswith("seen:") and f[5:] != replica]:
                if now - account[f"seen:{name}"] > LEASE_TTL_S:   # (its lease presumed spent, unreported)
                    lease = account.pop(f"lease:{name}")
                    spent += lease
                    account[f"presumed:{name}"] = account.get(f"presumed:{name}", 0) + lease
                    del account[f"seen:{name}"]
                    account.pop(f"short:{name}", None)
                else:
                    others += account[f"lease:{name}"]
                    others_short += account.get(f"short:{name}", 0.0)
            unleased = ask.budget - spent - others - ask.holding
            grant = min(ask.want, unleased) if ask.want > 0 and unleased > 0 else 0.0
            account.update({"spent": spent, f"settled:{replica}": max(ask.settled, base),
                            f"lease:{replica}": ask.holding + grant, f"seen:{replica}": now})
            if ask.short - grant > 0:
                account[f"short:{replica}"] = ask.short - grant
            else:
                account.pop(f"short:{replica}", None)
            out.append((grant, int(spent), unleased - grant, others_short))
        return out

    async def service(self, replica: str, given: Mapping[str, float]) -> tuple[int, dict[str, float]]:
        await trio.sleep(self.delay_s)
        now = trio.current_time()
        for tenant, amount in given.items():
            self.totals[tenant] = self.totals.get(tenant, 0.0) + amount
        self.seen[replica] = now
        return sum(1 for t in self.seen.values() if t >= now - 1.0), dict(self.totals)


def simulated_store(config: StoreConfig, state: SimulatedSharedState, replica: int) -> LeasingStore:
    """One replica's store over ``state`` (shared by the simulated replicas)."""
    return LeasingStore(config, state, kind="simulated", replica_id=f"replica-{replica}")
