"""docs/research.md is what `apsd research` writes today: measured, not edited by hand.

`apsd research` loads installed plugins as the daemon does, so docs/research.md is generated with the
plugins the README's test command installs (`pip install -e ".[test]" -e plugins/apsd-vtc`).

The suite runs on two engines (about 15 s without plots): the tests that use the default plugins share
one run (``default_research``).
"""

import importlib.metadata
import json
import re
from pathlib import Path

import pytest

from apsd import cli
from apsd.sim import research
from apsd.hookspecs import hookimpl
from apsd.plugins import load_policy_registry, make_plugin_manager
from apsd.sim.research import CONTINUOUS_ENGINE, POLICIES, SCALED, WORKLOADS, plugin_presets, report_dir, write_research

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.fixture(scope="module")
def default_research(tmp_path_factory):
    """``apsd research`` as it runs by default (installed plugins, no APSD_PLUGINS), without plots."""
    vtc_version()
    out = tmp_path_factory.mktemp("research")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("APSD_PLUGINS", raising=False)  # what `apsd research` loads by default
        path = write_research(out, plots=False)
    return out, path.read_text()


def all_directories():
    return [report_dir("micro", name) for name in WORKLOADS] + [
        report_dir("continuous", name) for name in (*WORKLOADS, *(s.name for s in SCALED))]


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
    assert "Policies run: the built-in `fifo`, `static`, `aps`, `aps+fixed`" in fresh
    assert f"the installed plugins' presets: `vtc` (plugin `vtc`, apsd-vtc {version})" in fresh
    assert "| `vtc` |" in (out / "research" / "vtc-overload" / "report.md").read_text()


def test_reports_go_to_one_directory_per_engine_and_workload(default_research):
    out, md = default_research
    assert report_dir("micro", "vip-flood") == Path("research/vip-flood")
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
                assert run["engine"] == {"kind": "micro", "count": 1, "preemptions": 0, "mfu": None, "mbu": None}


def test_continuous_section_states_what_changes_from_the_runs(default_research):
    out, md = default_research
    section = md[md.index("## On a continuous engine: which conclusions change"):md.index("## The workloads on")]
    for claim in ("**Utilisation**", "**Cost per 1M tokens**", "**The entropy governor**", "**Starvation**",
                  "**Fairness under overload**"):
        assert f"- {claim}" in section, claim
    # The engine and the price it is billed at come from the profiles.
    assert "a100-80gb × llama-3-8b, tp 1" in section and "$5.12 per hour of busy time" in section

    def summary(directory, label):
        runs = json.loads((out / directory / "summary.json").read_text())["runs"]
        return next(r for r in runs if r["label"] == label)

    # Starvation: the lowest bidder's worst wait on each engine, as the table gives it.
    row = table_row(section, "| `static` |")
    for cell, directory in zip(row, ("research/vip-flood", "research/continuous/vip-flood",
                                     "research/continuous/vip-flood-x16")):
        worst = summary(directory, "static")["overall"]["lowest_bidder"]["max_queue_wait_ms"]
        assert cell == f"{worst / 1000:.3f}"
    # The default flood is far below the continuous engine's capacity; the scaled one above it.
    load = {name: table_row(section, f"| `{name}` | ") for name in ("vip-flood", "vip-flood-x16")}
    assert float(load["vip-flood"][4]) < 50 and float(load["vip-flood-x16"][4]) > 95
    # The governor: aps and aps+fixed, p50 TTFT on the continuous engine, as the reports measured it.
    bursty = table_row(section, "| `bursty` | continuous |")
    entropy = summary("research/continuous/bursty", "aps")["overall"]["ttft_ms"]["p50"]
    fixed = summary("research/continuous/bursty", "aps+fixed")["overall"]["ttft_ms"]["p50"]
    assert bursty[4].startswith(f"{entropy / 1000:.3f} vs {fixed / 1000:.3f}")


class FairPlugin:
    """A third-party plugin with two presets built from built-in policies."""

    @hookimpl
    def register_policies(self, registry):
        registry.preset("zz-fair", aging="fifo", governor="fixed", batching="micro")
        registry.preset("fair", aging="aps", governor="fixed", batching="micro")


def test_plugin_presets_follow_the_built_ins_in_name_order():
    pm = make_plugin_manager(load_entry_points=False)
    assert plugin_presets(load_policy_registry(pm)) == ()
    pm.register(FairPlugin(), name="a-fair-plugin")
    assert plugin_presets(load_policy_registry(pm)) == ("fair", "zz-fair")


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


def test_fairness_verdict_is_measured_with_and_without_vtc(tmp_path, default_research):
    _, md = default_research
    # While the overload lasts, VTC serves the two tenants evenly; the built-ins serve them by demand.
    during = [float(x) for x in table_row(md, "| `vtc-overload`, served by t = ")]
    assert len(during) == len(POLICIES) + 1
    assert during[-1] > max(during[:-1]) + 0.05
    fairness = paragraph(md, "Definition used:")
    assert f"(Jain {during[-1]:.3f}): the most even service of the 5 policies" in fairness
    assert "`vtc` (a plugin preset) had served them" in fairness
    starvation = paragraph(md, "Static priority makes")
    assert "Of the 5 policies run, `vtc` gives the lowest bidder the shortest worst wait." in starvation

    md = write_research(tmp_path / "without", plots=False,
                        plugin_manager=make_plugin_manager(allow="")).read_text()
    assert "no third-party plugin was loaded" in md
    assert "| `vtc`" not in md
    assert "No policy run here served the tenants more evenly than FIFO" in paragraph(md, "Definition used:")
    assert re.search(r"Jain's index \| `fifo` \| `static` \| `aps` \| `aps\+fixed` \|\n\|:---\|(---:\|){4}\n", md)
    assert "No policy served them more evenly than FIFO while the overload lasted." in md


def test_research_md_names_the_policies_and_plugins_that_ran(tmp_path):
    pm = make_plugin_manager(allow="")
    pm.register(FairPlugin(), name="a-fair-plugin")
    md = write_research(tmp_path, plots=False, plugin_manager=pm).read_text()
    assert md.startswith("# apsd research: FIFO, static priority, APS and `fair`, `zz-fair` on the seeds' workloads\n")
    assert ("then the installed plugins' presets: `fair` (plugin `a-fair-plugin`, no installed distribution), "
            "`zz-fair` (plugin `a-fair-plugin`, no installed distribution).") in md
    assert "plugins loaded for this file: plugin `a-fair-plugin` from no installed distribution " \
           "(presets `fair`, `zz-fair`)." in md
    assert "| `fair` |" in md and "| `zz-fair` |" in md
