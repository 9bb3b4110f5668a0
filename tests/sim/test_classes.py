"""Service classes on the continuous engine with the shipped defaults (256 sequences, isolation on),
in virtual time: the study behind ``apsd research --classes``, and the engine's part in it (prompts
ordered by deadline, a tight request taking the place of a looser prompt of its own tenant, the
engine's wait in admission's early refusal)."""

from __future__ import annotations

import collections

import attrs

from apsd.core.config import Config, EngineConfig, ServiceClassConfig, TenantConfig
from apsd.core.models import Completion
from apsd.pipeline import open_pipeline
from apsd.sim.records import Arrival, Workload
from apsd.sim.research.classes import TIGHT_TARGET, classes_markdown, run_classes_study, study_config
from apsd.sim.runner import parse_policy_choice, run_policy
from tests.helpers import build_policies, make_config

CLASSES = {"tight": ServiceClassConfig(ttft_s=1.0), "loose": ServiceClassConfig(ttft_s=30.0, on_miss="best_effort")}


def test_the_tight_class_holds_on_the_default_engine_at_twice_the_load_and_the_loose_class_absorbs_it():
    engine = study_config(Config()).engine
    assert (engine.kind, engine.max_sequences, engine.isolation) == ("continuous", 256, True)
    assert engine.max_sequences == EngineConfig().max_sequences and engine.isolation == EngineConfig().isolation
    result = run_classes_study(duration=60.0, seed=1)
    assert result.overload == 2.0
    tight = result.attainment("interactive")
    assert tight is not None and tight >= TIGHT_TARGET
    assert result.attainment("interactive", classes=False) < 0.5
    loose = next(r for r in result.with_classes if r.name == "batch")
    assert loose.refused == 0 and loose.requests > 3 * next(r.requests for r in result.with_classes
                                                            if r.name == "interactive")
    assert loose.attainment < 0.8 and loose.missed > 0.2 * loose.requests   # the overload lands on it
    assert "holds" in classes_markdown(result)


def classes_config(**engine: object) -> Config:
    return make_config({"policy": {"preset": "fair"}},
                       engine=EngineConfig(kind="continuous", **engine), classes=dict(CLASSES),
                       tenants={name: TenantConfig(rate=1e12, burst=10**12, classes=tuple(CLASSES))
                                for name in ("a", "b")})


async def test_a_tight_request_passes_a_full_engines_backlog_by_taking_a_looser_prompts_place(autojump_clock):
    """The engine is full of one tenant's loose prompts (it holds far more than a second of prefill): a
    tight request of the same tenant gets its first token within its second, and the loose prompt it
    displaced goes back to the queue and still completes."""
    config = classes_config(max_sequences=16)
    async with open_pipeline(config, build_policies(config)) as pipeline:
        loose = []
        for _ in range(40):
            request = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=64, priority_bid=5,
                                           prompt_tokens=4096, service_class="loose")
            assert pipeline.admit_now(request)
            loose.append(request)
        await pipeline.clock.sleep(0.5)
        engine = pipeline.engines[0]
        assert engine.statistics().running == 16 and pipeline.ledger.queued_total > 0
        tight = pipeline.new_request(tenant_id="a", prompt="", tokens_requested=8, priority_bid=5,
                                     prompt_tokens=512, service_class="tight")
        assert pipeline.admit_now(tight)
        outcome = await tight.reply.wait()
        assert isinstance(outcome, Completion) and outcome.ttft_ms <= 1000
        assert engine._displaced >= 1
        done = [await r.reply.wait() for r in loose]
    assert all(isinstance(o, Completion) for o in done)                # nothing displaced is lost
    assert any(r.retries for r in loose)                                # (a displaced one came back)


def workload(arrivals: list[Arrival], tenants: tuple[str, ...]) -> Workload:
    return Workload(name="t", description="t", arrivals=tuple(arrivals), seed=1, params={},
                    tenants={t: TenantConfig(rate=1e6, burst=10**9, classes=tuple(CLASSES)) for t in tenants})


def test_early_refusal_counts_the_engines_own_wait():
    """A tight class alone at several times what the engine can prefill, with sequences to spare (so
    nothing waits in apsd's queue): admission refuses what the engine could not start in time, and
    what it admits is on time."""
    config = attrs.evolve(Config(), classes={"tight": CLASSES["tight"]},
                          engine=attrs.evolve(Config().engine, kind="continuous"))
    arrivals = [Arrival(at=i / 20, tenant="a", prompt_tokens=4096, output_tokens=16, bid=5, service_class="tight")
                for i in range(400)]
    run = run_policy(workload(arrivals, ("a",)), parse_policy_choice("fair"), base_config=config)
    ends = collections.Counter((r.outcome, r.error) for r in run.requests)
    met = sum(1 for r in run.requests if r.outcome == "completed" and r.ttft <= 1.0)
    assert ends[("rejected", "deadline_unmeetable")] > 200             # refused at the door ...
    assert ends[("completed", None)] > 50 and met >= 0.95 * ends[("completed", None)]   # ... the rest on time
