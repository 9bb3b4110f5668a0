"""docs/research.md is what `apsd research` writes today: measured, not edited by hand.

`apsd research` loads installed plugins as the daemon does, so docs/research.md is generated with the
plugins the README's test command installs (`pip install -e ".[test]" -e plugins/apsd-vtc`).
"""

import importlib.metadata
import re
from pathlib import Path

import pytest

from apsd import cli
from apsd.sim import research
from apsd.hookspecs import hookimpl
from apsd.plugins import load_policy_registry, make_plugin_manager
from apsd.sim.research import POLICIES, plugin_presets, write_research

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


def test_committed_research_report_is_current(tmp_path, monkeypatch):
    version = vtc_version()
    monkeypatch.delenv("APSD_PLUGINS", raising=False)  # what `apsd research` loads by default
    path = write_research(tmp_path, plots=False)
    fresh = path.read_text()
    assert fresh == (ROOT / "docs" / "research.md").read_text(), (
        "docs/research.md is stale: regenerate it with `apsd research`")
    for name in ("seed-stress", "vip-flood", "vtc-overload"):
        committed = (ROOT / "docs" / "research" / name / "summary.json").read_text()
        assert (tmp_path / "research" / name / "summary.json").read_text() == committed
    # the claims section is computed: its figures come from the runs
    assert "The claim does not hold on this model" in fresh or "The claim holds" in fresh
    # which policies ran, and the plugins they came from, with their versions
    assert "Policies run: the built-in `fifo`, `static`, `aps`, `aps+fixed`" in fresh
    assert f"the installed plugins' presets: `vtc` (plugin `vtc`, apsd-vtc {version})" in fresh
    assert "| `vtc` |" in (tmp_path / "research" / "vtc-overload" / "report.md").read_text()


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


def test_fairness_verdict_is_measured_with_and_without_vtc(tmp_path, monkeypatch):
    vtc_version()
    monkeypatch.delenv("APSD_PLUGINS", raising=False)
    md = write_research(tmp_path / "with", plots=False).read_text()
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
