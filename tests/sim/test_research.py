"""docs/research.md is what `apsd research` writes today: measured, not edited by hand.

`apsd research` loads installed plugins as the daemon does, so docs/research.md is generated with the
plugins the README's test command installs (`pip install -e ".[test]" -e plugins/apsd-vtc`).

The suite runs on two engines (about a minute without plots on a quiet machine). It is run once per
session with the default plugins (``default_research``), into a temporary directory that every test
reading its output shares. Two tests write research.md with other plugins (none; a test plugin's
presets): they run the whole suite too, but reuse the simulations they share with the default run
(``shared_runs``): a run is a function of its workload, its policies and its config, whichever other
presets are registered beside them, and the default run's summaries are compared with the committed
ones byte for byte.
"""

import importlib.metadata
import json
import re
from pathlib import Path

import pytest

import apsd.sim.research.run
from apsd import cli
from apsd.core.hookspecs import hookimpl
from apsd.plugins import load_policy_registry, make_plugin_manager
from apsd.sim import research
from apsd.sim.report import summarize, write_report
from apsd.sim.research import (
    ALONE,
    CLAIMED_COST_PER_1M_TOKENS_USD,
    CLAIMED_GPU_UTILIZATION,
    CLAIMED_JAIN,
    CLAIMED_JAIN_ELSEWHERE,
    CONTINUOUS_ENGINE,
    ISOLATION_SCALED,
    ISOLATION_WORKLOADS,
    NOISY,
    POLICIES,
    SCALED,
    WORKLOADS,
    open_report_writer,
    plugin_presets,
    report_dir,
    write_research,
)
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.workloads import build_workload

#: These tests run whole research reports: seconds of CPU each alone, minutes beside a CPU hog on two
#: cores. The limit guards against a hang, not against a slow machine.
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]


def vtc_version():
    try:
        return importlib.metadata.version("apsd-vtc")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("docs/research.md is generated with the apsd-vtc plugin: "
                    "pip install -e plugins/apsd-vtc (the README's test command installs it)")


def paragraph(md, start):
    """The paragraph of ``md`` that begins with ``start``."""
    return next(p for p in md.split("\n\n") if p.startswith(start))


def table_row(md, start):
    """The cells after the first one of the table row that begins with ``start``."""
    row = next(line for line in md.splitlines() if line.startswith(start))
    return [c.strip() for c in row.strip("|").split("|")][1:]


def remembering(runs):
    """``run_policy`` that runs each simulation once: keyed on the workload, the policies the preset
    names (as the plugin manager's registry defines them), the overrides and the config."""
    def run(workload, choice, *, base_config=None, plugin_manager=None, progress=None, **kwargs):
        preset = load_policy_registry(plugin_manager).presets.get(choice.preset)
        key = (workload.name, workload.seed, json.dumps(workload.params, sort_keys=True), len(workload.arrivals),
               choice.label, repr(preset), sorted(choice.overrides.items()), repr(base_config), sorted(kwargs.items()))
        key = repr(key)
        if key not in runs:
            runs[key] = run_policy(workload, choice, base_config=base_config, plugin_manager=plugin_manager,
                                   progress=progress, **kwargs)
        return runs[key]
    return run


@pytest.fixture(scope="session")
def shared_runs():
    """The simulations of this session's research suites, by what they simulate."""
    return {}


@pytest.fixture(scope="session")
def default_research(tmp_path_factory, shared_runs):
    """``apsd research`` as it runs by default (installed plugins, no APSD_PLUGINS), without plots: once
    per session, into a temporary directory."""
    vtc_version()
    out = tmp_path_factory.mktemp("research")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("APSD_PLUGINS", raising=False)  # what `apsd research` loads by default
        mp.setattr(apsd.sim.research.run, "run_policy", remembering(shared_runs))
        path = write_research(out, plots=False)
    return out, path.read_text()


@pytest.fixture
def reuse_runs(default_research, shared_runs, monkeypatch):
    """write_research reuses the default suite's simulations (see the module docstring)."""
    monkeypatch.setattr(apsd.sim.research.run, "run_policy", remembering(shared_runs))


def all_directories():
    return [report_dir("batch", name) for name in (*WORKLOADS, *ISOLATION_WORKLOADS)] + [
        report_dir("continuous", name) for name in (*WORKLOADS, *(s.name for s in (*SCALED, *ISOLATION_SCALED)))]


def summary(out, directory, label):
    runs = json.loads((out / directory / "summary.json").read_text())["runs"]
    return next(r for r in runs if r["label"] == label)


def test_committed_research_report_is_current(default_research):
    version = vtc_version()
    out, fresh = default_research
    assert fresh == (ROOT / "docs" / "research.md").read_text(), (
        "docs/research.md is stale: regenerate it with `apsd research`")
    for directory in all_directories():
        committed = (ROOT / "docs" / directory / "summary.json").read_text()
        assert (out / directory / "summary.json").read_text() == committed, f"docs/{directory} is stale"
    # the claims section is computed: its figures come from the runs
    assert "The claim does not hold on this model" in fresh or "The claim holds" in fresh
    # which policies ran, and the plugins they came from, with their versions
    assert "Policies run: the built-in `fifo`, `static`, `aps`, `aps+fixed`, `fair`" in fresh
    assert f"the installed plugins' presets: `vtc` (plugin `vtc`, apsd-vtc {version})" in fresh
    assert "| `vtc` |" in (out / "research" / "vtc-overload" / "report.md").read_text()


def test_reports_go_to_one_directory_per_engine_and_workload(default_research):
    out, md = default_research
    assert report_dir("batch", "vip-flood") == Path("research/vip-flood")
    assert report_dir("continuous", "vip-flood") == Path("research/continuous/vip-flood")
    found = sorted(p.parent.relative_to(out) for p in out.glob("research/**/summary.json"))
    assert found == sorted(all_directories())
    for directory in all_directories():
        assert f"]({directory.as_posix()}/report.md)" in md, directory


def test_every_run_reports_token_times_and_its_engine(default_research):
    out, _ = default_research
    for directory in all_directories():
        runs = json.loads((out / directory / "summary.json").read_text())["runs"]
        for run in runs:
            o = run["overall"]
            assert o["ttft_ms"]["p50"] is not None and o["tpot_ms"]["p50"] is not None, directory
            assert o["ttft_ms"]["p50"] <= o["latency_ms"]["p50"]
            assert 0 < o["gpu_utilization"] <= 1 and o["cost_usd"] > 0, directory
            if directory.parts[1] == "continuous":
                assert run["engine"] == {**CONTINUOUS_ENGINE, **{k: run["engine"][k] for k in ("preemptions", "mfu",
                                                                                          "mbu")}}
                assert 0 < run["engine"]["mfu"] < 1 and 0 < run["engine"]["mbu"] < 1
                assert o["batch_sizes"]["count"] == 0
            else:
                assert run["engine"] == {"kind": "batch", "count": 1, "preemptions": 0, "mfu": None, "mbu": None}


def test_continuous_section_states_what_changes_from_the_runs(default_research):
    out, md = default_research
    section = md[md.index("## On a continuous engine: which conclusions change"):md.index("## The workloads on")]
    for claim in ("**Utilisation**", "**Cost per 1M tokens**", "**The batch window**", "**Starvation**",
                  "**Fairness under overload**"):
        assert f"- {claim}" in section, claim
    # The engine and the price it is billed at come from the profiles.
    assert "a100-80gb × llama-3-8b, tp 1" in section and "$5.12 per hour of busy time" in section

    # Starvation: the lowest bidder's worst wait on each engine, as the table gives it.
    row = table_row(section, "| `static` |")
    for cell, directory in zip(row, ("research/vip-flood", "research/continuous/vip-flood",
                                     "research/continuous/vip-flood-x16")):
        worst = summary(out, directory, "static")["overall"]["lowest_bidder"]["max_queue_wait_ms"]
        assert cell == f"{worst / 1000:.3f}"
    # The default flood is far below the continuous engine's capacity; the scaled one above it.
    load = {name: table_row(section, f"| `{name}` | ") for name in ("vip-flood", "vip-flood-x16")}
    assert float(load["vip-flood"][4]) < 50 and float(load["vip-flood-x16"][4]) > 95
    # The governor: aps and aps+fixed, p50 TTFT on the continuous engine, as the reports measured it.
    bursty = table_row(section, "| `bursty` | continuous |")
    entropy = summary(out, "research/continuous/bursty", "aps")["overall"]["ttft_ms"]["p50"]
    fixed = summary(out, "research/continuous/bursty", "aps+fixed")["overall"]["ttft_ms"]["p50"]
    assert bursty[4].startswith(f"{entropy / 1000:.3f} vs {fixed / 1000:.3f}")


def test_the_design_claims_are_stated_once_and_printed_from_there(default_research):
    _, md = default_research
    claims = md[md.index("## What the design claims, and what apsd measures on the batch engine"):
                md.index("## On a continuous engine")]
    assert f'**"{CLAIMED_GPU_UTILIZATION * 100:g}% GPU utilization"** (the design\'s claim).' in claims
    assert f'**"${CLAIMED_COST_PER_1M_TOKENS_USD:.2f} per 1M tokens"** (the design\'s claim).' in claims
    assert (f"**\"Jain's fairness {CLAIMED_JAIN:g}\"** (the design's claim; one of its documents gives "
            f"{CLAIMED_JAIN_ELSEWHERE:g}).") in claims
    assert f"The design's claimed {CLAIMED_JAIN:g} is not reproduced as a property of APS." in claims
    # The design documents are not in the repository: research.md says what they claim, not which one.
    assert not re.search(r"\bseeds\b|\bseed (engine|model|GPU|\d{3})|seeds' ", md)


class EvenPlugin:
    """A third-party plugin with two presets built from built-in policies."""

    @hookimpl
    def register_policies(self, registry):
        registry.preset("zz-even", aging="fifo", governor="fixed", batching="micro")
        registry.preset("even", aging="aps", governor="fixed", batching="micro")


def test_plugin_presets_follow_the_built_ins_in_name_order():
    pm = make_plugin_manager(load_entry_points=False)
    assert plugin_presets(load_policy_registry(pm)) == ()
    pm.register(EvenPlugin(), name="an-even-plugin")
    assert plugin_presets(load_policy_registry(pm)) == ("even", "zz-even")


def test_apsd_research_loads_installed_plugins_as_the_daemon_does(tmp_path, monkeypatch):
    vtc_version()
    seen = []

    def fake_write_research(out_dir, **kwargs):
        seen.append(kwargs["plugin_manager"])
        return out_dir / "research.md"

    monkeypatch.setattr(research, "write_research", fake_write_research)
    monkeypatch.delenv("APSD_PLUGINS", raising=False)
    assert cli.research_main(["--out", str(tmp_path), "--quiet"]) == 0
    assert plugin_presets(load_policy_registry(seen[-1])) == ("vtc",)
    monkeypatch.setenv("APSD_PLUGINS", "")  # none, as for the daemon
    assert cli.research_main(["--out", str(tmp_path), "--quiet"]) == 0
    assert plugin_presets(load_policy_registry(seen[-1])) == ()
    monkeypatch.setenv("APSD_PLUGINS", "no-such-plugin")
    with pytest.raises(SystemExit) as exc:
        cli.research_main(["--out", str(tmp_path), "--quiet"])
    assert exc.value.code == 1


def test_fairness_verdict_is_measured_with_and_without_vtc(tmp_path, default_research, reuse_runs):
    _, md = default_research
    # While the overload lasts, fair share and VTC serve the two tenants evenly; the others by demand.
    during = [float(x) for x in table_row(md, "| `vtc-overload`, served by t = ")]
    assert len(during) == len(POLICIES) + 1
    fair, vtc = during[POLICIES.index("fair")], during[-1]
    assert min(fair, vtc) > max(during[:POLICIES.index("fair")]) + 0.05
    fairness = paragraph(md, "Definition used:")
    assert f"(Jain {fair:.3f}): the most even service of the 6 policies" in fairness
    assert "`fair` had served them" in fairness
    starvation = paragraph(md, "Static priority makes")
    assert re.search(r"Of the 6 policies run, (`fair` and `vtc` give|`fair` gives|`vtc` gives) the lowest bidder the "
                     r"shortest worst wait\.", starvation)

    md = write_research(tmp_path / "without", plots=False,
                        plugin_manager=make_plugin_manager(allow="")).read_text()
    assert "no third-party plugin was loaded" in md
    assert "| `vtc`" not in md
    assert "`fair` had served them" in paragraph(md, "Definition used:")
    assert re.search(r"Jain's index \| `fifo` \| `static` \| `aps` \| `aps\+fixed` \| `fair` \|\n\|:---\|(---:\|){5}\n",
                     md)
    assert "Of the 5 policies run, `fair` gives the lowest bidder the shortest worst wait." in md


def test_research_md_names_the_policies_and_plugins_that_ran(tmp_path, reuse_runs):
    pm = make_plugin_manager(allow="")
    pm.register(EvenPlugin(), name="an-even-plugin")
    md = write_research(tmp_path, plots=False, plugin_manager=pm).read_text()
    assert md.startswith("# apsd research: FIFO, static priority, APS, fair share and `even`, `zz-even` on the "
                         "design's workloads and tenant isolation\n")
    assert ("then the installed plugins' presets: `even` (plugin `an-even-plugin`, no installed distribution), "
            "`zz-even` (plugin `an-even-plugin`, no installed distribution).") in md
    assert "plugins loaded for this file: plugin `an-even-plugin` from no installed distribution " \
           "(presets `even`, `zz-even`)." in md
    assert "| `even` |" in md and "| `zz-even` |" in md


def test_isolation_compares_the_steady_tenant_with_its_neighbour_and_alone(default_research):
    out, md = default_research
    section = md[md.index("## Tenant isolation"):md.index("## The workloads on the batch engine")]
    assert "`neighbor_rate = 0`" in section
    for engine, name in (("batch", NOISY), ("continuous", next(s.name for s in ISOLATION_SCALED
                                                                 if s.workload == NOISY))):
        row = table_row(section, f"| `fifo` | {engine} |")
        steady = summary(out, report_dir(engine, name), "fifo")["tenants"]["steady"]
        assert row[1] == f"{steady['latency_ms']['p99'] / 1000:.3f}"
        assert row[4] == f"{steady['ttft_ms']['p99'] / 1000:.3f}"
        assert float(row[1]) > 10 * float(row[2])  # the flood: FIFO makes the steady tenant wait behind it
    # The alone figure is what a run of the same workload without the neighbour gives.
    workload = build_workload(NOISY, ALONE, seed=1)
    assert {a.tenant for a in workload.arrivals} == {"steady"}
    alone = summarize(run_policy(workload, parse_policy_choice("fifo"), plugin_manager=make_plugin_manager(allow="")))
    row = table_row(section, "| `fifo` | batch |")
    assert row[2] == f"{alone.tenants['steady'].latency_ms.p99 / 1000:.3f}"
    assert row[5] == f"{alone.tenants['steady'].ttft_ms.p99 / 1000:.3f}"
    # Fair share keeps the steady tenant far closer to its latency alone than FIFO does.
    fair = table_row(section, "| `fair` | batch |")
    assert float(fair[1]) < float(row[1]) / 10
    assert "beside the flood, `fifo` makes it" in section


def test_isolation_reports_the_service_difference_of_every_backlogged_workload(default_research):
    out, md = default_research
    section = md[md.index("**The service difference between backlogged tenants**"):
                 md.index("## The workloads on the batch engine")]
    for name in ISOLATION_WORKLOADS:
        row = table_row(section, f"| `{name}` | batch |")
        d = summary(out, report_dir("batch", name), "fifo")["overall"]["service_difference"]
        assert row[1] == f"{d['max']:,.0f} ({d['first_half_max']:,.0f}) / {d['mean']:,.0f}"
    for scaled in ISOLATION_SCALED:
        assert f"| `{scaled.name}` | continuous |" in section
    assert "| `periodic` |" not in section  # one tenant at a time: never two backlogged
    # Under fair share the difference is a fraction of FIFO's where both tenants stay backlogged.
    d = {label: summary(out, report_dir("batch", "vtc-overload"), label)["overall"]["service_difference"]
         for label in ("fifo", "fair")}
    assert d["fair"]["mean"] < d["fifo"]["mean"] / 10
    assert "The whole run's maximum exceeds the first half's by more than 25% on" in section
    # Every report has the figure and its table.
    report = (out / report_dir("batch", "on-off") / "report.md").read_text()
    assert "### Service difference between backlogged tenants" in report


def test_reports_with_plots_are_written_by_worker_processes_byte_for_byte(tmp_path):
    workload = build_workload("seed-stress", {"vip_requests": 4, "free_requests": 4})
    pm = make_plugin_manager(allow="")
    runs = [run_policy(workload, parse_policy_choice(p), plugin_manager=pm) for p in ("fifo", "fair")]
    write_report(runs, tmp_path / "here", title="T")
    (tmp_path / "taken").write_text("a file where a directory should go")
    with pytest.raises(FileExistsError):
        with open_report_writer(plots=True) as write:
            write(runs, tmp_path / "pool", "T")
            write(runs, tmp_path / "taken", "T")  # fails in its worker: raised when the block exits
    written = sorted(p.name for p in (tmp_path / "here").iterdir())
    assert len(written) == 10
    for name in written:
        assert (tmp_path / "pool" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name
