"""docs/research.md is what `apsd research` writes today: measured, not edited by hand."""

from pathlib import Path

from apsd.plugins import make_plugin_manager
from apsd.research import write_research

ROOT = Path(__file__).resolve().parents[1]


def test_committed_research_report_is_current(tmp_path):
    path = write_research(tmp_path, plots=False, plugin_manager=make_plugin_manager(load_entry_points=False))
    fresh = path.read_text()
    assert fresh == (ROOT / "docs" / "research.md").read_text(), (
        "docs/research.md is stale: regenerate it with `apsd research`")
    for name in ("seed-stress", "vip-flood", "vtc-overload"):
        committed = (ROOT / "docs" / "research" / name / "summary.json").read_text()
        assert (tmp_path / "research" / name / "summary.json").read_text() == committed
    # the claims section is computed: its figures come from the runs
    assert "The claim does not hold on this model" in fresh or "The claim holds" in fresh
