"""Model time: the pipeline's only clock.

Every stage reads time through a :class:`ModelClock`, which is
``trio.current_time()`` rescaled by ``gpu.time_scale``. Under
``trio.testing.MockClock(autojump_threshold=0)`` the whole pipeline therefore
runs as a deterministic discrete-event simulation with no code change. The calendar (which day it
is, in UTC) is another matter: :func:`calendar_time`.
"""

from __future__ import annotations

import time

import attrs
import trio


@attrs.define(eq=False)
class ModelClock:
    """Model seconds since the pipeline started; one model second lasts
    ``time_scale`` wall (trio) seconds. Create it inside ``trio.run``."""

    time_scale: float = 1.0
    origin: float = attrs.field(factory=trio.current_time)

    def now(self) -> float:
        return (trio.current_time() - self.origin) / self.time_scale

    def wall_seconds(self, model_seconds: float) -> float:
        """How long ``model_seconds`` last on the wall (for Retry-After and friends)."""
        return model_seconds * self.time_scale

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(max(0.0, seconds) * self.time_scale)

    def deadline(self, model_time: float) -> float:
        """The trio deadline (for cancel scopes) at which ``model_time`` is reached."""
        return self.origin + model_time * self.time_scale

    def reached(self, model_time: float) -> bool:
        """Whether ``model_time`` has come, judged on the trio clock like :meth:`sleep_until`.

        Comparing :meth:`now` with ``model_time`` instead can disagree by a rounding
        error with the deadline a sleep woke at, and a loop would spin.
        """
        return trio.current_time() >= self.deadline(model_time)

    async def sleep_until(self, model_time: float) -> None:
        await trio.sleep_until(self.deadline(model_time))


def calendar_time() -> float:
    """Unix seconds now: the calendar, never a duration. What it decides: the UTC day or month a
    budget counts in, the hour usage is added to, when an issued key expires, when an audit entry
    was made. (Everything that is timed reads a :class:`ModelClock`.)"""
    return time.time()
