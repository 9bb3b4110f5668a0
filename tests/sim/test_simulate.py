"""apsd simulate: the real pipeline in virtual time, through its command line and its API."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from apsd.core.config import Config
from apsd.core.models import Completion
from apsd.pipeline import open_pipeline
from apsd.plugins import build_policies, make_plugin_manager
from apsd.sim.records import Arrival, Workload
from apsd.sim.report import summarize
from apsd.sim.runner import parse_policy_choice, run_policy, simulation_config
from apsd.sim.workloads import UNTHROTTLED, build_workload, list_workloads

APSD = str(Path(sys.executable).with_name("apsd"))
BUILTIN_PM = make_plugin_manager(load_entry_points=False)

#: Small versions of every built-in workload, for CI.
SMALL = {
    "seed-stress": {"vip_requests": 10, "free_requests": 10},
    "burst-50": {"tenants": 10, "duration": 20.0, "burst_at": 10.0},
    "poisson": {"duration": 20.0},
    "periodic": {"duration": 20.0},
    "bursty": {"duration": 20.0},
    "vip-flood": {"duration": 20.0},
    "vtc-overload": {"duration": 30.0},
    "head-of-line": {"duration": 30.0},
    "noisy-neighbor": {"duration": 20.0},
    "proportional": {"duration": 20.0},
    "on-off": {"duration": 40.0, "period_s": 10.0},
    "increase": {"duration": 30.0},
    "dist-shift": {"duration": 20.0, "shift_at": 10.0},
    "shared-prefixes": {"duration": 10.0, "rate": 1.0, "prefixes": 8, "prefix_tokens": 1024},
    "multi-turn": {"duration": 10.0, "rate": 0.5, "turns": 3, "system_tokens": 512, "think_s": 1.0},
}


def apsd_cli(*args, cwd=None):
    return subprocess.run([APSD, *args], capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={"PATH": "/usr/bin:/bin", "APSD_PLUGINS": ""})


def test_every_builtin_has_a_small_version():
    assert set(SMALL) == {name for name, _, _ in list_workloads()}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_every_builtin_workload_runs_and_every_request_is_accounted_for(name):
    workload = build_workload(name, SMALL[name], seed=5)
    for policy in ("fifo", "aps"):
        run = run_policy(workload, parse_policy_choice(policy), plugin_manager=BUILTIN_PM)
        assert len(run.requests) == len(workload.arrivals)
        assert {r.outcome for r in run.requests} <= {"completed", "rejected"}
        completed = [r for r in run.requests if r.outcome == "completed"]
        assert sum(b.size for b in run.batches) == len(completed)
        assert all(r.arrival <= r.dispatched_at <= r.finished_at <= run.duration_s + 1e-9 for r in completed)
        assert all(b.kv_tokens <= 32_768 and b.size <= 16 for b in run.batches)


def test_tiny_workload_numbers_match_the_seed_model_by_hand():
    # one request alone: 10 ms window, 1 s prefill (1024 tokens), 1 s decode (128 tokens at b=1)
    workload = Workload(name="tiny", description="", arrivals=(Arrival(0.0, "t", 1024, 128, 5),),
                        tenants={"t": UNTHROTTLED}, params={})
    run = run_policy(workload, parse_policy_choice("fifo"), plugin_manager=BUILTIN_PM)
    (record,) = run.requests
    assert (record.queue_wait, record.latency) == (pytest.approx(0.010), pytest.approx(2.010))
    s = summarize(run).overall
    assert s.gpu_utilization == pytest.approx(2.0 / 2.01, rel=1e-5)
    assert s.throughput_tokens_per_s == pytest.approx(128 / 2.01, rel=1e-5)
    assert s.cost_per_1m_tokens_usd == pytest.approx(2.0 * 3.0 / 3600 / 128 * 1e6, rel=1e-5)
    assert s.batch_sizes.distribution == {"1": 1}


def test_two_batches_under_static_and_aps():
    # a long job occupies the GPU; then a low bid arrives, then two high bids: static serves the
    # high bids first, APS with a large alpha lets the older low bid go first.
    arrivals = (Arrival(0.0, "a", 0, 512, 5), Arrival(0.5, "low", 0, 10, 1),
                Arrival(3.0, "high", 0, 10, 10), Arrival(3.0, "high", 0, 10, 10))
    workload = Workload(name="order", description="", arrivals=arrivals,
                        tenants={t: UNTHROTTLED for t in ("a", "low", "high")}, params={})
    config = Config()
    for policy, low_first in (("static", False), ("aps", True)):
        base = config if policy == "static" else simulation_config(config, workload, parse_policy_choice("aps"))
        choice = parse_policy_choice(policy)
        run = run_policy(workload, choice, base_config=_with_small_batches(base, 1),
                         plugin_manager=BUILTIN_PM)
        low, high1, high2 = run.requests[1:]
        assert (low.batch_id < high1.batch_id) is low_first


def _with_small_batches(config, size):
    import attrs

    params = {**config.policy.params, "micro": {"max_batch_size": size}, "aps": {"alpha": 100.0}}
    return attrs.evolve(config, policy=attrs.evolve(config.policy, params=params))


def test_simulator_fast_path_decides_like_the_daemons_channels():
    """admit_now (the simulator) and submit_nowait through the ingress channel (the daemon) agree."""
    workload = build_workload("bursty", {"duration": 30.0}, seed=2)
    choice = parse_policy_choice("aps")
    simulated = run_policy(workload, choice, plugin_manager=BUILTIN_PM)
    config = simulation_config(Config(), workload, choice)

    async def through_channels():
        async with open_pipeline(config, build_policies(config, plugin_manager=BUILTIN_PM)) as pipeline:
            requests = []
            for arrival in workload.arrivals:
                await pipeline.clock.sleep_until(arrival.at)
                r = pipeline.new_request(tenant_id=arrival.tenant, prompt="", tokens_requested=arrival.output_tokens,
                                         priority_bid=arrival.bid, prompt_tokens=arrival.prompt_tokens)
                assert pipeline.submit_nowait(r) is None
                requests.append(r)
            return requests, [await r.reply.wait() for r in requests]

    requests, outcomes = trio.run(through_channels, clock=trio.testing.MockClock(autojump_threshold=0))
    assert all(isinstance(o, Completion) for o in outcomes)
    assert [o.batch_id for o in outcomes] == [r.batch_id for r in simulated.requests]
    assert [round(r.arrival + o.latency_ms / 1000, 6) for r, o in zip(requests, outcomes)] == [
        round(r.finished_at, 6) for r in simulated.requests]


# -- the command ----------------------------------------------------------------------------------

def test_same_seed_same_report_byte_for_byte(tmp_path):
    args = ["simulate", "--workload", "vip-flood", "--set", "duration=30", "--policy", "static",
            "--policy", "aps:governor=fixed", "--quiet"]
    for out in ("a", "b", "c"):
        seed = "7" if out != "c" else "8"
        result = apsd_cli(*args, "--seed", seed, "--out", str(tmp_path / out))
        assert result.returncode == 0, result.stderr
        assert "simulated requests per wall-clock second" in result.stdout
    for name in ("summary.json", "report.md", "queue_wait.png", "governor.png", "latency_cdf.png",
                 "gpu_busy.png", "service.png"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "summary.json").read_bytes() != (tmp_path / "c" / "summary.json").read_bytes()
    report = (tmp_path / "a" / "report.md").read_text()
    assert "`static`" in report and "`aps+fixed`" in report


def test_cli_lists_workloads_and_prints_the_table(tmp_path):
    listed = apsd_cli("simulate", "--list")
    assert listed.returncode == 0 and all(name in listed.stdout for name in SMALL)
    result = apsd_cli("simulate", "--workload", "seed-stress", "--no-plots", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "| `fifo` |" in result.stdout and "| `aps` |" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md", "summary.json"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--workload", "poisson", "--set", "rat=3"], "unknown parameter 'rat'"),
        (["--workload", "poisson", "--set", "rate=-1"], "rate"),
        (["--policy", "lottery"], "policy preset 'lottery' is unknown"),
        (["--policy", "aps:gov=fixed"], "expected PRESET[:KIND=NAME,...]"),
        (["--policy", "aps", "--policy", "aps"], "the same policy is given twice"),
    ],
)
def test_cli_errors_are_one_line_exit_2(tmp_path, args, message):
    result = apsd_cli("simulate", *args, "--no-plots", "--out", str(tmp_path))
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_traces_replay_and_bad_rows_name_the_line(tmp_path):
    good = tmp_path / "good.csv"
    good.write_text("at,tenant,prompt_tokens,output_tokens,bid\n0,a,10,20,5\n0.5,b,10,20,1\n")
    result = apsd_cli("simulate", "--trace", str(good), "--no-plots", "--quiet", "--out", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    assert "simulated 6 requests (2 arrivals x 3 policies)" in result.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"at": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": 2}\n'
                   '{"at": 1, "tenant": "a", "prompt_tokens": 1, "output_tokens": "many"}\n')
    result = apsd_cli("simulate", "--trace", str(bad), "--no-plots")
    assert result.returncode == 2
    assert f"{bad}:2: output_tokens" in result.stderr and "Traceback" not in result.stderr


def test_simulating_the_forward_engine_runs_its_routing_over_simulated_backends(tmp_path):
    """[[backends]] in the config: apsd simulate runs the forward engine's own code against backends
    simulated in model time (each running max_concurrency requests at sim_ttft_s and sim_tpot_s)."""
    config = tmp_path / "gateway.toml"
    config.write_text('[[backends]]\nurl = "http://a.test"\nmax_concurrency = 4\nsim_ttft_s = 0.1\nsim_tpot_s = 0.01\n'
                      '[[backends]]\nurl = "http://b.test"\nmax_concurrency = 4\nsim_ttft_s = 0.1\nsim_tpot_s = 0.01\n')
    result = apsd_cli("simulate", "--workload", "seed-stress", "--config", str(config), "--policy", "fifo",
                 "--no-plots", "--quiet", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["runs"][0]
    assert summary["engine"]["kind"] == "forward" and summary["overall"]["completed"] == 100
    # 100 requests arrive together; 8 slots over two backends: at least 100/8 rounds of 0.1 + 99 x 0.01 s
    assert summary["duration_s"] >= 100 / 8 * (0.1 + 0.99) * 0.99
    assert summary["overall"]["ttft_ms"]["p50"] > 100 and summary["overall"]["tpot_ms"]["p50"] == pytest.approx(10)


def test_the_summary_leads_with_each_tenant_beside_the_others_against_alone(tmp_path):
    """noisy-neighbor on the continuous engine: the steady tenant's row shows its p99 TTFT alone and
    beside the flood, from runs of its own arrivals alone; the report leads with the same table."""
    config = tmp_path / "apsd.toml"
    config.write_text('[engine]\nkind = "continuous"\n')
    out = tmp_path / "report"
    result = apsd_cli("simulate", "--workload", "noisy-neighbor", "--set", "duration=20", "--set", "neighbor_rate=200",
                     "--policy", "fifo", "--policy", "fair", "--config", str(config), "--no-plots", "--out", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Each tenant beside the others against alone")
    rows = {tuple(c.strip(" `") for c in line.split("|")[1:3]): line.split("|") for line in lines if line.startswith("| `")}
    fifo_ratio = float(rows[("fifo", "steady")][5].strip(" x"))
    fair_ratio = float(rows[("fair", "steady")][5].strip(" x"))
    assert 1.0 <= fair_ratio and 10 * fair_ratio < fifo_ratio   # (what fair's ratio is bounded by: test_isolation.py)
    report = (out / "report.md").read_text()
    assert report.index("### Isolation") < report.index("### Comparison")
    summary = json.loads((out / "summary.json").read_text())
    steady = [row for row in summary["runs"][1]["isolation"] if row["tenant"] == "steady"][0]
    assert steady["ratio"] == pytest.approx(fair_ratio, abs=0.01)
    quiet = apsd_cli("simulate", "--workload", "noisy-neighbor", "--set", "duration=5", "--no-alone", "--no-plots",
                    "--out", str(tmp_path / "quiet"))
    assert quiet.returncode == 0 and "beside the others" not in quiet.stdout
