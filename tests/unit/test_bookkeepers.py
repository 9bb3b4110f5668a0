"""The ledger's bookkeepers (apsd/core/ledger.py): what must follow a request's steps is called at
each step, in the order added, after the books and before the observers, and its failure propagates
(the step fails loudly), where an observer's failure on the event bus is logged and ignored."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from apsd.core.ledger import Bookkeeper, Ledger
from apsd.core.models import InferenceRequest, Refusal


class Recorder(Bookkeeper):
    def __init__(self, name: str, calls: list[str], fail: str | None = None) -> None:
        self.name, self.calls, self.fail = name, calls, fail

    def _note(self, step: str) -> None:
        self.calls.append(f"{self.name}.{step}")
        if step == self.fail:
            raise RuntimeError(f"{self.name} failed at {step}")

    def admitted(self, request: Any, now: float) -> None:
        self._note("admitted")

    def rejected(self, request: Any, refusal: Any, now: float) -> None:
        self._note("rejected")

    def finished(self, request: Any, outcome: Any, now: float) -> None:
        self._note("finished")


def test_bookkeepers_follow_each_step_in_order_before_the_observers():
    calls: list[str] = []
    ledger = Ledger(tenant_names=["t"])
    ledger.events.subscribe("request_finished", lambda request: calls.append("observer.finished"))
    for name in ("classes", "usage"):
        ledger.keep_books_with(Recorder(name, calls))
    ledger.keep_books_with(ledger.bookkeepers[0])   # (once)
    request = InferenceRequest("r1", "t", 1, 1, 5)
    ledger.admit(request)
    ledger.finish(request, Refusal(499, "client_disconnected", "left", kind="cancelled"))
    ledger.refuse_unadmitted(InferenceRequest("r2", "t", 1, 1, 5), Refusal(429, "rate_limited", "later"))
    assert calls == ["classes.admitted", "usage.admitted", "classes.finished", "usage.finished",
                     "observer.finished", "classes.rejected", "usage.rejected"]


def test_a_bookkeepers_failure_fails_the_step_where_an_observers_is_logged(caplog):
    caplog.set_level(logging.ERROR)
    ledger = Ledger(tenant_names=["t"])
    ledger.events.subscribe("request_admitted", lambda request: 1 / 0, "a broken observer")
    request = InferenceRequest("r1", "t", 1, 1, 5)
    ledger.admit(request)                                          # (the observer's failure: logged)
    assert "a broken observer raised in its request_admitted listener" in caplog.text
    ledger.keep_books_with(Recorder("usage", [], fail="finished"))
    with pytest.raises(RuntimeError, match="usage failed at finished"):
        ledger.finish(request, Refusal(499, "client_disconnected", "left", kind="cancelled"))
