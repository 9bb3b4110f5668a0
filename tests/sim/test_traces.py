"""Traces (apsd.sim.traces): apsd's own format and every error message, the Mooncake / Dynamo, Azure and
BurstGPT formats (each on a small file this test writes with the json and csv modules), detection,
tenant rules, block ids as routing keys and prefix-cache blocks, and the columns the arrivals live in."""

from __future__ import annotations

import collections
import csv
import json

import attrs
import numpy as np
import pytest

from apsd import cli
from apsd.core.config import Config, EngineConfig, RoutingConfig, TenantConfig
from apsd.sim.records import Arrival
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.traces import TraceArrivals, detect_format, load_trace
from apsd.sim.traces.columns import chain_ids
from apsd.sim.traces.reuse import infinite_cache_share
from apsd.sim.traces.synthetic import MooncakeShape, write_mooncake_trace
from apsd.sim.workloads import WorkloadError

# --------------------------------------------------------------------------- apsd's own format


def test_jsonl_trace(tmp_path):
    path = tmp_path / "morning.jsonl"
    path.write_text(
        '{"at": 2.5, "tenant": "b", "prompt_tokens": 10, "output_tokens": 20, "bid": 3}\n'
        "\n"
        '{"time": 1, "tenant": "a", "prompt_tokens": 5, "output_tokens": 6}\n'
        '   \n'
        '{"arrival": 1.0, "tenant": "c", "prompt_tokens": 7, "output_tokens": 8, "bid": 10}\n'
    )
    workload = load_trace(path)
    assert workload.name == "morning"
    assert str(path) in workload.description
    assert workload.arrivals == (
        Arrival(at=1.0, tenant="a", prompt_tokens=5, output_tokens=6, bid=1),  # tie: file order kept
        Arrival(at=1.0, tenant="c", prompt_tokens=7, output_tokens=8, bid=10),
        Arrival(at=2.5, tenant="b", prompt_tokens=10, output_tokens=20, bid=3),
    )
    assert set(workload.tenants) == {"a", "b", "c"}
    assert all(t == TenantConfig(rate=1e6, burst=10**9) for t in workload.tenants.values())


def test_csv_trace(tmp_path):
    path = tmp_path / "replay.csv"
    path.write_text("arrival,tenant,prompt_tokens,output_tokens,bid\n"
                    "0.5,alice,16,100,10\n"
                    "\n"
                    "0.25, bob ,8,50,\n")
    workload = load_trace(str(path))
    assert workload.name == "replay"
    assert workload.arrivals == (
        Arrival(at=0.25, tenant="bob", prompt_tokens=8, output_tokens=50, bid=1),
        Arrival(at=0.5, tenant="alice", prompt_tokens=16, output_tokens=100, bid=10),
    )
    assert list(workload.tenants) == ["alice", "bob"]


GOOD_JSON = '{"at": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1}'


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ('{"at": -1, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1}', "at: must be >= 0, got -1"),
        ('{"at": "1", "tenant": "a", "prompt_tokens": 1, "output_tokens": 1}', "at: must be a number, got '1'"),
        ('{"time": NaN, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1}',
         "invalid JSON: NaN is not JSON (numbers must be finite)"),
        ('{"time": 1e400, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1}',
         "time: must be a finite number, got inf"),
        ('{"at": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1, "x": ' + "[" * 101 + "]" * 101 + "}",
         "invalid JSON: arrays and objects are nested more than 100 levels deep"),
        ('{"tenant": "a", "prompt_tokens": 1, "output_tokens": 1}', "at: missing"),
        ('{"at": 0, "time": 1, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1}',
         "at: give the arrival time once (found at, time)"),
        ('{"at": 0, "tenant": 7, "prompt_tokens": 1, "output_tokens": 1}', "tenant: must be a string, got 7"),
        ('{"at": 0, "tenant": " ", "prompt_tokens": 1, "output_tokens": 1}', "tenant: must not be empty"),
        ('{"at": 0, "tenant": "a", "prompt_tokens": 0, "output_tokens": 1}',
         "prompt_tokens: must be between 1 and 1000000000, got 0"),
        ('{"at": 0, "tenant": "a", "prompt_tokens": 1.5, "output_tokens": 1}',
         "prompt_tokens: must be an integer, got 1.5"),
        ('{"at": 0, "tenant": "a", "prompt_tokens": 1}', "output_tokens: missing"),
        ('{"at": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": true}',
         "output_tokens: must be an integer, got True"),
        ('{"at": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1, "bid": 11}',
         "bid: must be between 1 and 10, got 11"),
        ('{"at": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1, "prio": 3}',
         "unknown field 'prio' (fields: at (or arrival, time), tenant, prompt_tokens, output_tokens, bid, "
         "service_class, prefix, prefix_tokens, hash_ids)"),
        ('{"at": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1,', "invalid JSON: "),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"at": 0, "tenant": "a", "prompt_tokens": 1, "output_tokens": 1, "bid": 9, "bid": 1}',
         "the field 'bid' appears twice"),
    ],
)
def test_bad_jsonl_row_names_file_line_and_field(tmp_path, row, problem):
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD_JSON}\n\n{row}\n{GOOD_JSON}\n")  # the bad row is on line 3
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    if problem.endswith(": "):
        assert str(info.value).startswith(f"{path}:3: {problem}")
    else:
        assert str(info.value) == f"{path}:3: {problem}"


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ("x,a,1,1,1", "at: must be a number, got 'x'"),
        ("-0.5,a,1,1,1", "at: must be >= 0, got '-0.5'"),
        ("inf,a,1,1,1", "at: must be a finite number, got 'inf'"),
        (",a,1,1,1", "at: missing"),
        ("0,,1,1,1", "tenant: missing"),
        ("0,a,1.5,1,1", "prompt_tokens: must be an integer, got '1.5'"),
        ("0,a,1,0,1", "output_tokens: must be between 1 and 1000000000, got 0"),
        ("0,a,1", "output_tokens: missing"),
        ("0,a,1,1,0", "bid: must be between 1 and 10, got 0"),
        ("0,a,1,1,1,9", "6 values but the header has 5 columns"),
    ],
)
def test_bad_csv_row_names_file_line_and_field(tmp_path, row, problem):
    path = tmp_path / "t.csv"
    path.write_text(f"at,tenant,prompt_tokens,output_tokens,bid\n0,a,1,1,1\n{row}\n0,a,1,1,1\n")
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:3: {problem}"


def test_csv_line_numbers_count_blank_lines_and_multiline_cells(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text('at,tenant,prompt_tokens,output_tokens\n"0",a,1,1\n\n0,"two\nlines",1,1\n0,a,1,x\n')
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:6: output_tokens: must be an integer, got 'x'"
    # a record spanning lines is reported at the line where it starts
    path.write_text('at,tenant,prompt_tokens,output_tokens\n\n0,"two\nlines",1,x\n')
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:3: output_tokens: must be an integer, got 'x'"


def test_csv_unknown_and_duplicate_columns(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("at,tenant,prompt,output_tokens,priority\n0,a,1,1,1\n")
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert str(info.value) == (f"{path}:1: unknown fields 'prompt', 'priority' "
                               "(fields: at (or arrival, time), tenant, prompt_tokens, output_tokens, bid, "
                               "service_class, prefix, prefix_tokens, hash_ids)")
    path.write_text("at,tenant,tenant,prompt_tokens,output_tokens\n0,a,b,1,1\n")
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:1: duplicate column 'tenant'"


@pytest.mark.parametrize(("filename", "text"), [
    ("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.csv", ""),
    ("header-only.csv", "at,tenant,prompt_tokens,output_tokens\n"),
])
def test_empty_trace(tmp_path, filename, text):
    path = tmp_path / filename
    path.write_text(text)
    with pytest.raises(WorkloadError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}: empty trace (no arrivals)"


def test_trace_file_problems(tmp_path):
    missing = tmp_path / "gone.jsonl"
    with pytest.raises(WorkloadError) as info:
        load_trace(missing)
    assert str(info.value) == f"{missing}: no such trace file"
    wrong = tmp_path / "trace.txt"
    wrong.write_text(GOOD_JSON)
    with pytest.raises(WorkloadError) as info:
        load_trace(wrong)
    assert str(info.value) == f"{wrong}: unknown trace format '.txt' (use .jsonl or .csv)"


def test_own_format_takes_a_class_a_named_prefix_and_block_ids(tmp_path):
    path = tmp_path / "classes.jsonl"
    rows = [{"at": 0, "tenant": "a", "prompt_tokens": 400, "output_tokens": 4, "service_class": "tight",
             "prefix": "system-1", "prefix_tokens": 256},
            {"at": 1, "tenant": "b", "prompt_tokens": 400, "output_tokens": 4, "prefix": "system-1",
             "prefix_tokens": 256, "bid": 7},
            {"at": 2, "tenant": "b", "prompt_tokens": 1100, "output_tokens": 4, "hash_ids": [5, 6, 7]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second, third = load_trace(path, block_tokens=500).arrivals
    assert first.service_class == "tight" and second.service_class is None and second.bid == 7
    assert first.prefix_blocks[:4] == second.prefix_blocks[:4]               # 256 shared tokens: 4 blocks of 64
    assert len(first.prefix_blocks) == 400 // 64 and first.prefix_blocks[4] != second.prefix_blocks[4]
    assert third.prefix_blocks == tuple(chain_ids([5, 6, 7])) and third.prefix_block_tokens == 500
    workload = load_trace(path)
    assert all(t.classes == ("tight",) for t in workload.tenants.values())   # (tenants may use what it names)
    path = tmp_path / "bad.csv"
    path.write_text("at,tenant,prompt_tokens,output_tokens,prefix\n0,a,10,1,sys\n")
    with pytest.raises(WorkloadError, match=r"bad\.csv:2: prefix_tokens: missing \(prefix and prefix_tokens go "):
        load_trace(path)


# --------------------------------------------------------------------------- foreign formats


def write_jsonl(path, rows):
    with path.open("w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")
    return path


def write_csv(path, header, rows):
    with path.open("w", encoding="utf-8", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(header)
        writer.writerows(rows)
    return path


MOONCAKE_ROWS = [
    {"timestamp": 1000, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 1500, "input_length": 1300, "output_length": 0, "hash_ids": [0, 1, 3]},      # no output: skipped
    {"timestamp": 3000, "input_length": 1300, "output_length": 20, "hash_ids": [0, 1, 4], "session": "s2"},
    {"timestamp": 2500, "input_length": 600, "output_length": 30, "hash_ids": [9, 10], "tenant": "own"},
]


def test_mooncake(tmp_path):
    path = write_jsonl(tmp_path / "mooncake.jsonl", MOONCAKE_ROWS)
    assert detect_format(path).name == "mooncake"
    workload = load_trace(path)
    arrivals = list(workload.arrivals)
    assert [a.at for a in arrivals] == [0.0, 1.5, 2.0]                       # ms, sorted, shifted to 0
    assert [(a.prompt_tokens, a.output_tokens) for a in arrivals] == [(1100, 10), (600, 30), (1300, 20)]
    assert [a.tenant for a in arrivals] == ["tenant_00", "own", "tenant_00"]    # a row's own tenant is kept
    assert all(a.prefix_block_tokens == 512 for a in arrivals)
    assert arrivals[0].prefix_blocks[:2] == arrivals[2].prefix_blocks[:2] == tuple(chain_ids([0, 1]))
    assert arrivals[0].prefix_blocks[2] != arrivals[2].prefix_blocks[2]
    assert "1 rows without output skipped" in workload.description
    # an infinite cache holds the two shared 512-token blocks of the third request: 1,024 of 3,000 tokens
    assert infinite_cache_share(arrivals) == pytest.approx(1024 / 3000)
    assert load_trace(path, block_tokens=256).arrivals[0].prefix_block_tokens == 256
    bad = write_jsonl(tmp_path / "bad.jsonl", [MOONCAKE_ROWS[0], {**MOONCAKE_ROWS[0], "hash_ids": [1, -2]}])
    with pytest.raises(WorkloadError) as info:
        load_trace(bad)
    assert str(info.value) == f"{bad}:2: hash_ids: item 1: must be an integer between 0 and {2**64 - 1}, got -2"


def test_azure(tmp_path):
    path = write_csv(tmp_path / "AzureLLMInferenceTrace_conv.csv", ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
                     [["2023-11-16 18:15:46.6805900", 374, 44], ["2023-11-16 18:15:50.9951690", 396, 109],
                      ["2023-11-16 18:15:51.0000000", 10, 0], ["2023-11-16 18:15:47.1805900", 1200, 7]])
    assert detect_format(path).name == "azure"
    arrivals = list(load_trace(path, tenants="round-robin:2").arrivals)
    assert [round(a.at, 6) for a in arrivals] == [0.0, 0.5, 4.314579]
    assert [(a.prompt_tokens, a.output_tokens) for a in arrivals] == [(374, 44), (1200, 7), (396, 109)]
    assert [a.tenant for a in arrivals] == ["tenant_00", "tenant_00", "tenant_01"]  # (file order: the 3rd row is 0)
    assert all(a.prefix_blocks is None for a in arrivals)
    bad = write_csv(tmp_path / "bad.csv", ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
                    [["2023-11-16 18:15:46", 1, 1], ["yesterday", 1, 1]])
    with pytest.raises(WorkloadError) as info:
        load_trace(bad)
    assert str(info.value) == (f"{bad}:3: TIMESTAMP: must be a number of seconds or a date and time, "
                               "got 'yesterday'")


def test_burstgpt(tmp_path):
    header = ["Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"]
    path = write_csv(tmp_path / "BurstGPT_1.csv", header,
                     [[5, "ChatGPT", 472, 18, 490, "Conversation log"], [45, "ChatGPT", 1087, 0, 1087, "API log"],
                      [118, "GPT-4", 417, 276, 693, "Conversation log"], [118.5, "ChatGPT", 90, 12, 102, "API log"]])
    assert detect_format(path).name == "burstgpt"
    workload = load_trace(path, tenants="hash:Model:16")
    arrivals = list(workload.arrivals)
    assert [a.at for a in arrivals] == [0.0, 113.0, 113.5]                   # failed request (0 tokens) skipped
    assert [(a.prompt_tokens, a.output_tokens) for a in arrivals] == [(472, 18), (417, 276), (90, 12)]
    assert arrivals[0].tenant == arrivals[2].tenant != arrivals[1].tenant     # by model: ChatGPT, GPT-4
    assert "tenants by hash:Model:16" in workload.description
    with pytest.raises(WorkloadError, match="the BurstGPT format needs the columns"):
        load_trace(write_csv(tmp_path / "b.csv", ["Timestamp", "Model", "Request tokens"], [[1, "x", 2]]),
                   format="burstgpt")


def test_the_format_can_be_named_and_must_fit_the_layout(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", MOONCAKE_ROWS[:1])
    with pytest.raises(WorkloadError, match=r"unknown fields 'timestamp', 'input_length'"):
        load_trace(path, format="apsd")
    with pytest.raises(WorkloadError, match=r"the azure format is csv, not jsonl"):
        load_trace(path, format="azure")
    with pytest.raises(WorkloadError, match=r"--trace-format 'x': unknown \(formats: mooncake, azure, burstgpt"):
        load_trace(path, format="x")


# --------------------------------------------------------------------------- tenant rules


def test_tenant_rules(tmp_path):
    rows = [{"timestamp": i * 10, "input_length": 600, "output_length": 5, "hash_ids": [i % 3, 100 + i]}
            for i in range(3000)]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    round_robin = [a.tenant for a in load_trace(path, tenants="round-robin:3").arrivals]
    assert round_robin[:4] == ["tenant_00", "tenant_01", "tenant_02", "tenant_00"]
    by_first_block = list(load_trace(path, tenants="hash:hash_ids:50").arrivals)
    groups = collections.defaultdict(set)
    for a, row in zip(by_first_block, rows):
        groups[row["hash_ids"][0]].add(a.tenant)
    assert all(len(g) == 1 for g in groups.values()) and len(set().union(*groups.values())) > 1
    counts = collections.Counter(a.tenant for a in load_trace(path, tenants="zipf:3:1", seed=4).arrivals)
    share = [counts[f"tenant_0{k}"] / 3000 for k in range(3)]
    assert share == pytest.approx([6 / 11, 3 / 11, 2 / 11], abs=0.03)       # 1, 1/2, 1/3 normalised
    assert [a.tenant for a in load_trace(path, tenants="zipf:3", seed=4).arrivals] == \
        [a.tenant for a in load_trace(path, tenants="zipf:3:1", seed=4).arrivals]
    for rule, problem in [("round-robin", "expected round-robin:N, hash:FIELD:N or zipf:N[:S]"),
                          ("zipf:0", "the number of tenants must be 1 to 10000, got 0"),
                          ("zipf:2:x", "the Zipf exponent must be a number 0 to 10, got 'x'"),
                          ("hash::3", "expected")]:
        with pytest.raises(WorkloadError) as info:
            load_trace(path, tenants=rule)
        assert str(info.value).startswith(f"--trace-tenants {rule!r}: ") and problem in str(info.value)


def test_own_format_needs_a_tenant_unless_a_rule_gives_one(tmp_path):
    path = write_csv(tmp_path / "t.csv", ["at", "prompt_tokens", "output_tokens"], [[0, 1, 1], [1, 1, 1]])
    with pytest.raises(WorkloadError, match=r"t\.csv:2: tenant: missing"):
        load_trace(path)
    assert [a.tenant for a in load_trace(path, tenants="round-robin:2").arrivals] == ["tenant_00", "tenant_01"]


# --------------------------------------------------------------------------- columns and replay


def test_arrivals_live_in_columns_and_are_made_when_read(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [MOONCAKE_ROWS[2], MOONCAKE_ROWS[0], MOONCAKE_ROWS[3]])
    arrivals = load_trace(path).arrivals
    assert isinstance(arrivals, TraceArrivals) and not isinstance(arrivals, tuple)
    assert len(arrivals) == 3 and arrivals[-1] == arrivals[2] and arrivals[0] is not arrivals[0]
    assert arrivals[1:] == tuple(list(arrivals)[1:])
    # rows out of time order are sorted with their blocks
    assert [a.prefix_blocks for a in arrivals] == [tuple(chain_ids(ids)) for ids in ([0, 1, 2], [9, 10], [0, 1, 4])]


def mooncake_config(policy: str, engines: int = 2) -> Config:
    return attrs.evolve(Config(), engine=EngineConfig(kind="continuous", count=engines, model="llama-3.1-8b"),
                        routing=RoutingConfig(policy=policy))


def test_block_ids_route_a_conversation_to_its_cache_and_the_engine_skips_their_prefill(tmp_path):
    """Four conversations of four turns, each turn's hash_ids those of the turn before and a new block:
    with ``prefix`` routing every turn after the first goes where its conversation is cached, and the
    engine reads the cached blocks (512 tokens each) from its cache."""
    rows = []
    for turn in range(4):
        for c in range(4):
            ids = [1000 * c + i for i in range(3 * turn + 3)]
            rows.append({"timestamp": 10_000 * turn + 100 * c, "input_length": 512 * len(ids) + 100,
                         "output_length": 8, "hash_ids": ids + [10**6 + 10 * turn + c]})
    path = write_jsonl(tmp_path / "conversations.jsonl", rows)
    workload = load_trace(path, tenants="round-robin:2")
    run = run_policy(workload, parse_policy_choice("fair"), base_config=mooncake_config("prefix", engines=3))
    assert all(r.outcome == "completed" for r in run.requests)
    by_conversation = collections.defaultdict(set)
    for record, row in zip(run.requests, rows):
        by_conversation[row["hash_ids"][0] // 1000].add(record.engine_id)
    assert all(len(engines) == 1 for engines in by_conversation.values())
    later = run.requests[4:]
    assert [r.cached_tokens for r in later] == [512 * 3 * (k // 4 + 1) for k in range(12)]
    assert sum(r.cached_tokens for r in run.requests) / sum(r.prompt_tokens for r in run.requests) == \
        pytest.approx(infinite_cache_share(workload.arrivals))
    assert all(r.route.endswith("reason=cache_match") for r in later)


def test_simulate_replays_a_mooncake_trace_and_reports_cache_routes_and_classes(tmp_path, capsys):
    path = write_mooncake_trace(tmp_path / "trace.jsonl", MooncakeShape(requests=300, rate=1.0), seed=2)
    config = tmp_path / "engines.toml"
    config.write_text('[engine]\nkind = "continuous"\ncount = 2\nmodel = "llama-3.1-8b"\n')
    out = tmp_path / "out"
    assert cli.main(["simulate", "--trace", str(path), "--trace-tenants", "hash:hash_ids:3", "--config", str(config),
                     "--policy", "fair", "--no-plots", "--no-alone", "--quiet", "--out", str(out)]) == 0
    run = json.loads((out / "summary.json").read_text())["runs"][0]
    assert run["workload"]["params"]["format"] == "mooncake" and run["workload"]["arrivals"] == 300
    assert 0.3 < run["overall"]["cached_prompt_share"] < 1
    assert set(run["routing"]) == {"engine-0", "engine-1"}
    assert sum(n for reasons in run["routing"].values() for n in reasons.values()) == 300
    report = (out / "report.md").read_text()
    assert "#### Prefix cache and routing" in report and "| `engine-0` | `cache_match` |" in report
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate", "--workload", "poisson", "--trace-tenants", "round-robin:2"])
    assert exc.value.code == 2
    assert "--trace-format, --block-tokens and --trace-tenants apply to --trace" in capsys.readouterr().err


def test_the_synthetic_trace_has_the_published_shape(tmp_path):
    path = write_mooncake_trace(tmp_path / "t.jsonl", MooncakeShape(requests=3000))
    assert path.read_bytes() == write_mooncake_trace(tmp_path / "u.jsonl", MooncakeShape(requests=3000)).read_bytes()
    arrivals = list(load_trace(path).arrivals)
    prompts = np.array([a.prompt_tokens for a in arrivals])
    outputs = np.array([a.output_tokens for a in arrivals])
    assert len(arrivals) == 3000 and 9_000 < prompts.mean() < 15_000 and 250 < outputs.mean() < 450
    assert 0.5 < infinite_cache_share(arrivals) < 0.85
    firsts = collections.Counter(a.prefix_blocks[0] for a in arrivals)
    assert firsts.most_common(1)[0][1] > 0.05 * len(arrivals)                 # a popular system prompt
