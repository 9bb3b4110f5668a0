"""A request ends in one function, :meth:`apsd.core.ledger.Ledger.finish`: the books, the tenant's
settlement, the policies, the stream, then the observers, in that order; only observers are
shielded from failures."""

from __future__ import annotations

import pytest
import trio

from apsd.core.admission import Admission
from apsd.core.hookspecs import hookimpl
from apsd.core.models import Completion
from apsd.core.streams import TokenStream
from apsd.pipeline import open_pipeline
from apsd.plugins import load_policy_registry, make_plugin_manager
from tests.helpers import build_policies, make_config, submit

TENANTS = {"a": {"rate": 1000.0, "burst": 10_000}}


async def test_a_settlement_that_raises_stops_the_pipeline_loudly(autojump_clock, monkeypatch):
    """A billing bug must surface, not become a log line: the exception leaves the pipeline."""
    def broken_settle(self, request, outcome, now):
        raise RuntimeError("settlement bug")

    monkeypatch.setattr(Admission, "settle", broken_settle)
    config = make_config({"tenants": TENANTS})
    with pytest.raises(BaseException) as raised:
        async with open_pipeline(config, build_policies(config)) as pipeline:
            request = submit(pipeline, tenant="a", tokens=8, prompt_tokens=8)
            with trio.fail_after(60):
                await request.reply.wait()
            await trio.sleep(1)  # (the engine's task raises right after answering)
    failures = [raised.value]
    while failures and isinstance(failures[0], BaseExceptionGroup):
        failures = list(failures[0].exceptions)
    assert [str(f) for f in failures] == ["settlement bug"]


async def test_the_steps_of_an_ending_run_in_order(autojump_clock):
    seen: list[tuple[str, object]] = []
    config = make_config({"tenants": TENANTS})

    class Observer:
        @hookimpl
        def request_finished(self, request, outcome, now):
            seen.append(("observer", request.stream.closed))

    manager = make_plugin_manager(load_entry_points=False)
    manager.register(Observer(), name="observer")
    policies = load_policy_registry(manager).build(config, None)

    original_on_finish = getattr(policies.aging, "on_finish", None)

    def on_finish(request, outcome, now):
        seen.append(("policies", request.stream.closed))
        if original_on_finish is not None:
            original_on_finish(request, outcome, now)

    policies.aging.on_finish = on_finish
    async with open_pipeline(config, policies) as pipeline:
        real_settle = pipeline.ledger.settle

        def settle(request, outcome, now):
            seen.append(("settle", pipeline.ledger.tenants["a"].completed))  # the books come first
            real_settle(request, outcome, now)

        pipeline.ledger.settle = settle
        request = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=8, priority_bid=5, prompt_tokens=8)
        request.stream = TokenStream()
        assert pipeline.submit_nowait(request) is None
        outcome = await request.reply.wait()
    assert isinstance(outcome, Completion)
    assert [step for step, _ in seen] == ["settle", "policies", "observer"]
    assert seen[0][1] == 1                    # counted before settlement
    assert seen[1][1] is False                # the policies heard before the stream closed ...
    assert seen[2][1] is True                 # ... and the observers after


async def test_an_observer_that_raises_changes_nothing(autojump_clock):
    class Failing:
        @hookimpl
        def request_finished(self, request, outcome, now):
            raise RuntimeError("observer bug")

    config = make_config({"tenants": TENANTS})
    manager = make_plugin_manager(load_entry_points=False)
    manager.register(Failing(), name="failing")
    async with open_pipeline(config, load_policy_registry(manager).build(config, None)) as pipeline:
        request = submit(pipeline, tenant="a", tokens=8, prompt_tokens=8)
        outcome = await request.reply.wait()
        assert isinstance(outcome, Completion)
        assert pipeline.ledger.tenants["a"].completed == 1
        assert pipeline.admission.buckets["a"].level(pipeline.clock.now()) == pytest.approx(10_000, abs=1)
