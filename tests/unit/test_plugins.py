"""Plugins through their real interfaces: installed distributions, the hooks, failures."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import httpx
import pytest

import apsd
from apsd.core import hookspecs
from apsd.core.config import EngineConfig, GpuConfig, ServerConfig, TenantConfig
from apsd.core.models import Completion
from apsd.pipeline import open_pipeline
from apsd.plugins import PluginError, load_policy_registry, make_plugin_manager
from apsd.policies.aging import ApsQueue
from apsd.serve.daemon import Daemon
from apsd.serve.http import metrics_document
from tests.helpers import make_config

ROOT = Path(__file__).resolve().parents[2]
APSD = str(Path(sys.executable).with_name("apsd"))


# -- every hook has a documented contract ---------------------------------------------------------

HOOKS = [name for name, f in inspect.getmembers(hookspecs, inspect.isfunction)
         if getattr(f, "apsd_spec", None) is not None]


def test_every_hookspec_is_documented():
    assert set(HOOKS) == {"register_policies", "register_profiles", *hookspecs.EVENT_HOOKS}
    plugin_guide = (ROOT / "docs" / "how-to" / "write-a-plugin.md").read_text()
    for name in HOOKS:
        assert len(inspect.getdoc(getattr(hookspecs, name)) or "") > 60, name
        assert f"`{name}" in plugin_guide, f"docs/how-to/write-a-plugin.md does not document {name}"


# -- broken plugins stop the daemon at start-up with one message ------------------------------------

def install_fake_plugin(site: Path, module_source: str, name: str = "broken") -> None:
    """A real (if minimal) installed distribution with an ``apsd`` entry point."""
    (site / f"{name}_mod.py").write_text(textwrap.dedent(module_source))
    info = site / f"{name}_plugin-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text(f"[apsd]\n{name} = {name}_mod\n")


BROKEN = {
    "import error": ("import torch_that_is_not_installed\n",
                     "plugin 'broken' (broken_mod, from broken-plugin 0.3) failed to load: "
                     "ModuleNotFoundError: No module named 'torch_that_is_not_installed'"),
    "bad signature": ("import apsd\n@apsd.hookimpl\ndef register_policies(registry, gpu):\n    pass\n",
                      "plugin 'broken' (broken_mod, from broken-plugin 0.3): bad hook implementation"),
    "misspelled hook": ("import apsd\n@apsd.hookimpl\ndef register_policys(registry):\n    pass\n",
                        "plugin 'broken': unknown hook 'register_policys'"),
    "raises while registering": (
        "import apsd\n@apsd.hookimpl\ndef register_policies(registry):\n    raise RuntimeError('no GPU here')\n",
        "plugin 'broken' failed in register_policies: RuntimeError: no GPU here"),
    "takes a built-in's name": (
        "import apsd\n@apsd.hookimpl\ndef register_policies(registry):\n"
        "    registry.aging('aps', lambda params, config: None)\n",
        "policy name 'aps' is registered twice (aging policy of apsd.policies.aging, aging policy of broken)"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_plugin_is_one_error_naming_it(tmp_path, monkeypatch, case):
    """Loading the installed plugins (as the daemon and ``apsd plugins`` do, in process): one
    PluginError, on one line, naming the plugin and what is wrong with it."""
    source, expected = BROKEN[case]
    install_fake_plugin(tmp_path, source)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("broken_mod", None)    # (each case's module has the same name)
    try:
        with pytest.raises(PluginError) as raised:
            load_policy_registry(make_plugin_manager(allow="broken"))
    finally:
        sys.modules.pop("broken_mod", None)
    assert expected in str(raised.value) and "\n" not in str(raised.value)


def test_broken_plugin_stops_startup_naming_it(tmp_path):
    """The command, for one of the cases above (each is the same PluginError to the command): the
    daemon does not start, ``apsd plugins`` does not list, with status 1 and that one line."""
    source, expected = BROKEN["import error"]
    install_fake_plugin(tmp_path, source)
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    for args in (["--port", "0"], ["plugins"]):
        result = subprocess.run([APSD, *args], capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 1, result.stderr
        assert expected in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_allow_list_skips_a_broken_plugin_and_rejects_unknown_names(tmp_path):
    install_fake_plugin(tmp_path, BROKEN["import error"][0])
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    listed = subprocess.run([APSD, "plugins"], capture_output=True, text=True, timeout=60,
                            env={**env, "APSD_PLUGINS": ""})
    assert listed.returncode == 0 and "broken" not in listed.stdout and "apsd.policies.aging" in listed.stdout
    unknown = subprocess.run([APSD, "plugins"], capture_output=True, text=True, timeout=60,
                             env={**env, "APSD_PLUGINS": "brokn"})
    assert unknown.returncode == 1 and "APSD_PLUGINS names 'brokn'" in unknown.stderr


def test_a_working_third_party_plugin_is_listed_and_selectable(tmp_path):
    install_fake_plugin(tmp_path, """
        import apsd

        class Lifo:
            def __init__(self):
                self.items = []
            def push(self, request, now):
                self.items.append(request)
            def peek(self, now):
                return self.items[-1]
            def pop(self, now):
                return self.items.pop()
            def effective_priority(self, request, now):
                return float(request.priority_bid)
            def __len__(self):
                return len(self.items)
            def __iter__(self):
                return iter(self.items)

        @apsd.hookimpl
        def register_policies(registry):
            registry.aging("lifo", lambda params, config: Lifo(), "last in, first out")

        @apsd.hookimpl
        def request_finished(request, outcome):
            pass
        """, name="lifo")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "APSD_PLUGINS": "lifo"}
    listed = subprocess.run([APSD, "plugins"], capture_output=True, text=True, timeout=60, env=env)
    assert "lifo  [lifo-plugin 0.3]  aging: lifo; observes: request_finished" in listed.stdout
    config = tmp_path / "lifo.toml"
    config.write_text('[policy]\naging = "lifo"\n')
    refused = subprocess.run([APSD, str(config)], capture_output=True, text=True, timeout=60,
                             env={**env, "APSD_PLUGINS": ""})   # not loaded: the name is unknown
    assert refused.returncode == 2 and "unknown aging policy 'lifo' (available: aps, fair, fifo, static)" in refused.stderr


def test_an_installed_plugin_adds_gpu_and_model_profiles(tmp_path):
    install_fake_plugin(tmp_path, """
        import apsd

        @apsd.hookimpl
        def register_profiles(registry):
            registry.gpu(apsd.GpuProfile(name="mi300x", bf16_tflops=1307, hbm_gb_s=5300, memory_gib=192,
                                         price_per_hour_usd=4.0, mfu=0.6, mbu=0.75))
            registry.model(apsd.ModelProfile(name="my-7b", params=6_740_000_000, layers=32, hidden=4096,
                                             heads=32, kv_heads=32, head_dim=128, intermediate=11008,
                                             vocab=32000, max_context=4096))
        """, name="mi")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin", "APSD_PLUGINS": "mi"}
    listed = subprocess.run([APSD, "plugins"], capture_output=True, text=True, timeout=60, env=env)
    assert "mi  [mi-plugin 0.3]  gpus: mi300x; models: my-7b" in listed.stdout
    profiles = subprocess.run([APSD, "profile", "--list"], capture_output=True, text=True, timeout=60, env=env)
    assert "gpu mi300x: 1307 TFLOP/s" in profiles.stdout and "model my-7b" in profiles.stdout
    run = subprocess.run([APSD, "profile", "--gpu", "mi300x", "--model", "my-7b", "--batch", "1",
                          "--prompt-tokens", "1", "--output-tokens", "64", "--json"],
                         capture_output=True, text=True, timeout=60, env=env)
    figures = json.loads(run.stdout)
    # decode is weight streaming: 13.5 GB of weights at 5.3 TB/s x 0.75 = 3.4 ms, plus the step overhead
    assert 3.5 < figures["tpot_ms"] < 6
    config = tmp_path / "mi.toml"
    config.write_text('[engine]\nkind = "continuous"\ngpu = "mi300x"\nmodel = "my-7b"\n')
    unknown = subprocess.run([APSD, str(config)], capture_output=True, text=True, timeout=60,
                             env={**env, "APSD_PLUGINS": ""})   # not loaded: the profile is unknown
    assert unknown.returncode == 2 and "engine.gpu: unknown gpu profile 'mi300x' (known: a100-40gb" in unknown.stderr
    install_fake_plugin(tmp_path, """
        import apsd

        @apsd.hookimpl
        def register_profiles(registry):
            registry.gpu(apsd.GpuProfile(name="a100-80gb", bf16_tflops=1, hbm_gb_s=1, memory_gib=1,
                                         price_per_hour_usd=1, mfu=0.5, mbu=0.5))
        """, name="dup")
    twice = subprocess.run([APSD, "profile", "--list"], capture_output=True, text=True, timeout=60,
                           env={**env, "APSD_PLUGINS": "dup"})
    assert twice.returncode == 1
    assert "gpu profile 'a100-80gb' is registered twice: by apsd.engines.profiles and by dup" in twice.stderr


# -- the observation hooks ----------------------------------------------------------------------

class Recorder:
    """Implements every observation hook and records what it saw."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    @apsd.hookimpl
    def request_admitted(self, request, now):
        self.events.append(("admitted", request.request_id, now))

    @apsd.hookimpl
    def request_rejected(self, request, refusal, now):
        self.events.append(("rejected", request.request_id, refusal.status))

    @apsd.hookimpl
    def request_dispatched(self, request, dispatch, batch, engine_id, now):
        assert request in dispatch.requests and request.dispatched_at == now and batch is dispatch
        assert engine_id == dispatch.engine_id == request.engine_id
        self.events.append(("dispatched", request.request_id, dispatch.dispatch_id))

    @apsd.hookimpl
    def request_started(self, request, engine_id, now):
        assert request.started_at == now and request.tokens_generated >= 0
        self.events.append(("started", request.request_id, engine_id))

    @apsd.hookimpl
    def batch_started(self, batch, engine_id, now):
        self.events.append(("batch_started", batch.batch_id, engine_id))

    @apsd.hookimpl
    def batch_finished(self, batch, engine_id, now, busy_s, cost_usd):
        self.events.append(("batch_finished", batch.batch_id, busy_s, cost_usd))

    @apsd.hookimpl
    def request_finished(self, request, outcome, now):
        self.events.append(("finished", request.request_id, type(outcome).__name__))


async def test_observation_hooks_fire_once_each_in_order(autojump_clock):
    pm = make_plugin_manager(load_entry_points=False)
    recorder = Recorder()
    pm.register(recorder, name="recorder")
    config = make_config(tenants={"t": TenantConfig(rate=1e6, burst=10**6)}, engine=EngineConfig(count=2))
    policies = load_policy_registry(pm).build(config, "aps")
    async with open_pipeline(config, policies) as pipeline:
        requests = []
        for i in range(40):
            r = pipeline.new_request(tenant_id="t" if i % 10 else "nobody", prompt="", tokens_requested=50,
                                     priority_bid=1 + i % 10, prompt_tokens=10)
            pipeline.submit_nowait(r)
            requests.append(r)
        outcomes = [await r.reply.wait() for r in requests]
        ledger = pipeline.ledger
    kinds = Counter(e[0] for e in recorder.events)
    assert kinds["rejected"] == 4 and kinds["admitted"] == kinds["dispatched"] == kinds["finished"] == 36
    assert kinds["batch_started"] == kinds["batch_finished"] == ledger.batches == 3
    assert sum(e[2] for e in recorder.events if e[0] == "batch_finished") == pytest.approx(ledger.gpu_busy_s)
    assert sum(e[3] for e in recorder.events if e[0] == "batch_finished") == pytest.approx(ledger.cost_usd)
    for r, outcome in zip(requests, outcomes):
        mine = [e[0] for e in recorder.events if e[1] == r.request_id]
        assert mine == (["admitted", "dispatched", "started", "finished"] if isinstance(outcome, Completion)
                        else ["rejected"])
    assert {e[2] for e in recorder.events if e[0] == "batch_started"} == {0, 1}   # both GPUs ran


# -- policies and observers that raise at run time ------------------------------------------------

class FlakyQueue(ApsQueue):
    """APS, except it cannot order tenant_b, and its next pop raises when told to."""

    fail_next_pop = False

    def push(self, request, now):
        if request.tenant_id == "tenant_b":
            raise ValueError("cannot order tenant_b")
        super().push(request, now)

    def pop(self, now):
        if FlakyQueue.fail_next_pop:
            FlakyQueue.fail_next_pop = False
            raise RuntimeError("heap corrupted")
        return super().pop(now)


class FlakyPlugin:
    @apsd.hookimpl
    def register_policies(self, registry):
        registry.aging("flaky", lambda params, config: FlakyQueue(alpha=1.0))

    @apsd.hookimpl
    def request_finished(self, request, outcome, now):
        raise RuntimeError("observer bug")   # must never change an outcome


async def test_a_policy_that_raises_fails_only_affected_requests(nursery):
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(FlakyPlugin(), name="flaky")
    config = make_config({"policy": {"aging": "flaky"}}, server=ServerConfig(port=0),
                         gpu=GpuConfig(time_scale=0.001))
    daemon = Daemon.from_config(config, handle_signals=False, plugin_manager=pm)
    (url,) = await nursery.start(daemon.run)
    body = {"prompt": "hi", "tokens_requested": 20, "priority_bid": 5}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        bad = await client.post("/infer", json={"tenant_id": "tenant_b", **body})
        assert bad.status_code == 500
        assert bad.json() == {"error": "policy_error",
                              "message": "aging policy 'flaky' raised ValueError: cannot order tenant_b"}
        good = await client.post("/infer", json={"tenant_id": "tenant_a", **body})
        assert good.status_code == 200

        FlakyQueue.fail_next_pop = True       # the next cut fails
        broken_cut = await client.post("/infer", json={"tenant_id": "tenant_c", **body})
        assert broken_cut.status_code == 500
        assert broken_cut.json()["message"] == ("cutting a batch (batching policy 'micro' from aging policy "
                                                "'flaky') raised RuntimeError: heap corrupted")
        after = await client.post("/infer", json={"tenant_id": "tenant_a", **body})
        assert after.status_code == 200           # a fresh queue: the daemon keeps serving
        counts = (await client.get("/metrics.json")).json()["requests"]
    assert (counts["completed"], counts["failed"]) == (2, 2) and counts["conservation_ok"]
    daemon.request_shutdown()


async def test_a_failed_cut_fails_everything_queued_and_starts_a_fresh_queue(autojump_clock):
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(FlakyPlugin(), name="flaky")
    config = make_config({"policy": {"aging": "flaky"}}, tenants={"t": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(config, load_policy_registry(pm).build(config, "fifo")) as pipeline:
        broken_queue = pipeline.scheduler.queue
        FlakyQueue.fail_next_pop = True
        first = [pipeline.new_request(tenant_id="t", prompt="", tokens_requested=10, priority_bid=5,
                                      prompt_tokens=0) for _ in range(5)]
        for r in first:
            pipeline.submit_nowait(r)
        assert {(await r.reply.wait()).error for r in first} == {"policy_error"}
        assert pipeline.scheduler.queue is not broken_queue and len(pipeline.scheduler.queue) == 0
        later = pipeline.new_request(tenant_id="t", prompt="", tokens_requested=10, priority_bid=5, prompt_tokens=0)
        pipeline.submit_nowait(later)
        assert isinstance(await later.reply.wait(), Completion)
        requests = metrics_document(pipeline)["requests"]
    assert (requests["failed"], requests["completed"], requests["conservation_ok"]) == (5, 1, True)


class EventfulGovernor:
    """A fixed 10 ms window that also hears every dispatch and finish (optionally failing)."""

    def __init__(self) -> None:
        self.dispatched: list[int] = []
        self.finished: list[str] = []
        self.fail_dispatch = False

    def observe_arrival(self, now):
        pass

    def reading(self, now):
        return apsd.GovernorReading(window_s=0.010, state="EVENTFUL")

    def on_dispatch(self, batch, now):
        if self.fail_dispatch:
            raise KeyError("no room")
        self.dispatched.append(batch.batch_id)

    def on_finish(self, request, outcome, now):
        self.finished.append(type(outcome).__name__)


async def test_policies_hear_dispatch_and_finish_and_a_failing_dispatch_fails_its_batch(autojump_clock):
    governor = EventfulGovernor()

    class Plugin:
        @apsd.hookimpl
        def register_policies(self, registry):
            registry.governor("eventful", lambda params, config: governor)

    pm = make_plugin_manager(load_entry_points=False)
    pm.register(Plugin(), name="eventful")
    config = make_config({"policy": {"governor": "eventful"}}, tenants={"t": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(config, load_policy_registry(pm).build(config, "fifo")) as pipeline:
        def submit(n):
            batch = [pipeline.new_request(tenant_id="t", prompt="", tokens_requested=10, priority_bid=5,
                                          prompt_tokens=0) for _ in range(n)]
            for r in batch:
                pipeline.submit_nowait(r)
            return batch

        ok = [await r.reply.wait() for r in submit(20)]
        governor.fail_dispatch = True
        failed = [await r.reply.wait() for r in submit(3)]
        governor.fail_dispatch = False
        again = [await r.reply.wait() for r in submit(1)]
    assert all(isinstance(o, Completion) for o in ok + again)
    assert governor.dispatched == [1, 2, 4]           # batch 3 was cut, then refused by on_dispatch
    assert {(o.status, o.error) for o in failed} == {(500, "policy_error")}
    assert "governor policy 'eventful' raised KeyError" in failed[0].message
    assert governor.finished == ["Completion"] * 20 + ["Refusal"] * 3 + ["Completion"]


class RaisingObserver:
    @apsd.hookimpl
    def request_admitted(self, request):
        raise RuntimeError("observer bug")


async def test_a_raising_observer_does_not_hide_events_from_others(autojump_clock):
    pm = make_plugin_manager(load_entry_points=False)
    recorder = Recorder()
    pm.register(recorder, name="recorder")
    pm.register(RaisingObserver(), name="raiser")     # registered last: pluggy calls it first
    config = make_config(tenants={"t": TenantConfig(rate=1e6, burst=10**6)})
    policies = load_policy_registry(pm).build(config, "fifo")
    async with open_pipeline(config, policies) as pipeline:   # hooks come with the policies' plugins
        r = pipeline.new_request(tenant_id="t", prompt="", tokens_requested=5, priority_bid=5, prompt_tokens=0)
        pipeline.submit_nowait(r)
        assert isinstance(await r.reply.wait(), Completion)
    assert [e[0] for e in recorder.events if e[1] == r.request_id] == ["admitted", "dispatched", "started", "finished"]


class BadPriorityQueue(ApsQueue):
    def effective_priority(self, request, now):
        raise ZeroDivisionError("bad priority")


async def test_effective_priority_raising_answers_the_cut_requests(autojump_clock):
    class Plugin:
        @apsd.hookimpl
        def register_policies(self, registry):
            registry.aging("badprio", lambda params, config: BadPriorityQueue(alpha=1.0))

    pm = make_plugin_manager(load_entry_points=False)
    pm.register(Plugin(), name="badprio")
    config = make_config({"policy": {"aging": "badprio"}}, tenants={"t": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(config, load_policy_registry(pm).build(config, "fifo")) as pipeline:
        requests = [pipeline.new_request(tenant_id="t", prompt="", tokens_requested=5, priority_bid=5,
                                         prompt_tokens=0) for _ in range(20)]
        for r in requests:
            pipeline.submit_nowait(r)
        outcomes = [await r.reply.wait() for r in requests]
        counts = metrics_document(pipeline)["requests"]
    assert {o.error for o in outcomes} == {"policy_error"}
    assert "ZeroDivisionError: bad priority" in outcomes[0].message
    assert (counts["failed"], counts["queued"], counts["running"], counts["conservation_ok"]) == (20, 0, 0, True)


def test_a_factory_bug_names_the_plugin():
    class Plugin:
        @apsd.hookimpl
        def register_policies(self, registry):
            registry.batching("oops", lambda params, config: 1 / 0)

    pm = make_plugin_manager(load_entry_points=False)
    pm.register(Plugin(), name="oops-plugin")
    with pytest.raises(PluginError, match="batching policy 'oops' of plugin 'oops-plugin' failed to build: "
                                          "ZeroDivisionError: division by zero"):
        load_policy_registry(pm).build(make_config({"policy": {"batching": "oops"}}))


def test_policy_names_are_unique_across_kinds_and_presets_are_checked():
    class SameName:
        @apsd.hookimpl
        def register_policies(self, registry):
            registry.governor("aps", lambda params, config: None)

    pm = make_plugin_manager(load_entry_points=False)
    pm.register(SameName(), name="same-name")
    with pytest.raises(PluginError, match="policy name 'aps' is registered twice .* unique across kinds"):
        load_policy_registry(pm)

    class BadPreset:
        @apsd.hookimpl
        def register_policies(self, registry):
            registry.preset("bad", aging="nope", governor="fixed", batching="micro")

    pm = make_plugin_manager(load_entry_points=False)
    pm.register(BadPreset(), name="bad-preset")
    with pytest.raises(PluginError, match="preset 'bad' of plugin 'bad-preset' names unknown aging policy 'nope'"):
        load_policy_registry(pm).build(make_config(), "bad")


class NanGovernor(EventfulGovernor):
    def reading(self, now):
        return apsd.GovernorReading(window_s=float("nan"), state="BROKEN")


class LenRaises(ApsQueue):
    def __len__(self):
        raise RuntimeError("len broke")


class CutsNothing:
    def refuse_reason(self, request):
        return None

    def is_full(self, queue, now, free):
        return True

    def cut(self, queue, now, free):
        return None


@pytest.mark.parametrize(
    ("kind", "policy", "message"),
    [
        ("governor", EventfulGovernor, None),   # control: works
        ("governor", NanGovernor, "returned window_s nan (must be finite and >= 0)"),
        ("aging", lambda: LenRaises(alpha=1.0), "aging policy 'odd' raised RuntimeError: len broke"),
        ("batching", CutsNothing, "raised TypeError"),
    ],
)
async def test_bad_policy_results_fail_requests_not_the_daemon(autojump_clock, kind, policy, message):
    class Plugin:
        @apsd.hookimpl
        def register_policies(self, registry):
            getattr(registry, kind)("odd", lambda params, config: policy())

    pm = make_plugin_manager(load_entry_points=False)
    pm.register(Plugin(), name="odd")
    config = make_config({"policy": {kind: "odd"}}, tenants={"t": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(config, load_policy_registry(pm).build(config, "fifo")) as pipeline:
        outcomes = []
        for _ in range(3):   # one after another: the pipeline keeps going after each failure
            r = pipeline.new_request(tenant_id="t", prompt="", tokens_requested=10, priority_bid=5, prompt_tokens=0)
            pipeline.submit_nowait(r)
            outcomes.append(await r.reply.wait())
        bucket = pipeline.admission.buckets["t"].level(pipeline.clock.now())
    if message is None:
        assert all(isinstance(o, Completion) for o in outcomes)
    else:
        assert {(o.status, o.error) for o in outcomes} == {(500, "policy_error")}
        assert message in outcomes[0].message
        assert bucket == 10**6     # failed requests got their tokens back


class CutsWithoutPopping(CutsNothing):
    def cut(self, queue, now, free):
        return [queue.peek(now)]                 # never pops: would be dispatched forever


class RebuildFails(ApsQueue):
    built = 0

    def __init__(self, alpha):
        RebuildFails.built += 1
        if RebuildFails.built > 1:
            raise RuntimeError("cannot rebuild")
        super().__init__(alpha)

    def pop(self, now):
        raise RuntimeError("pop broke")


async def test_a_cut_of_unpopped_requests_fails_instead_of_repeating(autojump_clock):
    class Plugin:
        @apsd.hookimpl
        def register_policies(self, registry):
            registry.batching("peeker", lambda params, config: CutsWithoutPopping())

    pm = make_plugin_manager(load_entry_points=False)
    pm.register(Plugin(), name="peeker")
    config = make_config({"policy": {"batching": "peeker"}}, tenants={"t": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(config, load_policy_registry(pm).build(config, "fifo")) as pipeline:
        r = pipeline.new_request(tenant_id="t", prompt="", tokens_requested=5, priority_bid=5, prompt_tokens=0)
        pipeline.admit_now(r)
        outcome = await r.reply.wait()
        batches = pipeline.ledger.batches
    assert "cut requests it did not pop from the queue" in outcome.message and batches == 0


async def test_when_the_queue_cannot_be_rebuilt_apsd_falls_back_to_arrival_order(autojump_clock):
    class Plugin:
        @apsd.hookimpl
        def register_policies(self, registry):
            registry.aging("fragile", lambda params, config: RebuildFails(alpha=1.0))

    RebuildFails.built = 0
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(Plugin(), name="fragile")
    config = make_config({"policy": {"aging": "fragile"}}, tenants={"t": TenantConfig(rate=1e6, burst=10**6)})
    async with open_pipeline(config, load_policy_registry(pm).build(config, "fifo")) as pipeline:
        first = pipeline.new_request(tenant_id="t", prompt="", tokens_requested=5, priority_bid=5, prompt_tokens=0)
        pipeline.admit_now(first)
        assert (await first.reply.wait()).error == "policy_error"
        second = pipeline.new_request(tenant_id="t", prompt="", tokens_requested=5, priority_bid=5, prompt_tokens=0)
        pipeline.admit_now(second)
        assert isinstance(await second.reply.wait(), Completion)
        assert pipeline.health().policy["aging"] == "fifo (fallback)"
