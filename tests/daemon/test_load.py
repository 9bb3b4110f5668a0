"""Bounded load on loopback, in the test suite: nothing lost, no unexpected status, signals included.

The same machinery as ``benchmarks/bench_http.py`` (which prints the throughput figures and the ratio to a
bare quart-trio app), with fewer requests so it fits CI: the installed ``apsd`` as a subprocess,
raw keep-alive HTTP/1.1 clients, every answer reconciled with apsd's books. Speed is not asserted
here (shared, noisy machines); what is asserted is that every request was answered as it should be.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.bench_http import compare, signals_under_load


def test_load_loses_nothing(tmp_path: Path):
    """1,500 requests at concurrency 32: every one admitted, completed and answered 200 exactly once;
    the books balance (conservation) and the daemon exits 0 on SIGTERM with no traceback."""
    apsd, bare, problems = compare(tmp_path, 1_500, 32, "raw", time_limit_s=60.0, rounds=1)
    assert problems == []
    assert apsd.statuses == {200: 1_500} and bare.statuses == {200: 1_500}


def test_sighup_and_sigterm_under_load_answer_every_accepted_request(tmp_path: Path):
    """SIGHUP (config rewritten) after a third of the answers, SIGTERM after two thirds, 30 s grace:
    every request apsd admitted got exactly one answer, the one apsd logged (request by request)."""
    run = signals_under_load(tmp_path, "graceful", 900, 32, grace_s=30.0, time_scale=0.05, tokens=16,
                             time_limit_s=60.0)
    assert run.problems == []
    assert run.exit_code == 0


def test_sigterm_with_no_grace_under_load_answers_the_rest_503(tmp_path: Path):
    """The same with a 0.01 s grace period: what is queued or running at the end is answered 503
    ``shutting_down`` (tokens refunded), never dropped."""
    run = signals_under_load(tmp_path, "abort", 400, 32, grace_s=0.01, time_scale=0.05, tokens=64,
                             time_limit_s=60.0)
    assert run.problems == []
    assert any("aborted at the end of the grace period" in row[0] or "refused at the door" in row[0]
               for row in run.rows)
