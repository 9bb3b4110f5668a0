"""The service-class study (apsd research --classes), short: the tight class keeps its promise."""

from apsd.sim.research.classes import TIGHT_TARGET, classes_markdown, run_classes_study


def test_the_tight_class_meets_its_target_under_twice_the_load_and_does_not_without_classes():
    result = run_classes_study(duration=30.0, seed=1)
    assert result.overload == 2.0
    tight = result.attainment("interactive")
    assert tight is not None and tight >= TIGHT_TARGET
    assert result.attainment("interactive", classes=False) < 0.5
    loose = next(r for r in result.with_classes if r.name == "batch")
    assert loose.refused == 0 and loose.requests > 3 * next(r.requests for r in result.with_classes
                                                            if r.name == "interactive")
    assert "holds" in classes_markdown(result)
