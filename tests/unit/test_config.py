from pathlib import Path

import attrs
import pytest

from apsd.core.config import Config, ConfigError, load_config
from tests.helpers import build_policies, make_config

ROOT = Path(__file__).resolve().parents[2]


def test_shipped_config_equals_embedded_defaults():
    shipped = load_config(ROOT / "config" / "apsd.toml")
    assert attrs.evolve(shipped, source="<defaults>", policy=attrs.evolve(shipped.policy, params={})) == Config()
    # and every policy table in it builds with the defaults the policies would pick anyway
    assert build_policies(shipped).names == build_policies(Config()).names


def test_seed_tenants_are_the_defaults():
    tenants = Config().tenants
    assert {n: (t.rate, t.burst) for n, t in tenants.items()} == {
        "tenant_a": (500.0, 5000), "tenant_b": (300.0, 3000), "tenant_c": (1000.0, 10000)}


def write(tmp_path, text):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[server]\nport = 'eighty'\n", "server.port: must be an integer"),
        ("[server]\nport = 70000\n", "server.port: must be a port number"),
        ("[server]\nprot = 1\n", "server.prot: unknown key"),
        ("[sever]\n", "sever: unknown key"),
        ("[engine]\nreserved_sequences = 16\n", "engine.reserved_sequences: no longer a setting: a continuous engine isolates"),
        ("[tenants.a]\nrate = -5\nburst = 10\n", "tenants.a.rate: must be between 1e-06 and 1e+12, got -5"),
        ("[tenants.a]\nrate = 0\nburst = 10\n", "tenants.a.rate: must be between 1e-06 and 1e+12, got 0"),
        ("[tenants.a]\nrate = 5\n", "tenants.a.burst: required key is missing"),
        ("[tenants.a]\nrate = true\nburst = 10\n", "tenants.a.rate: must be a number"),
        ("[engine]\ncount = 1.5\n", "engine.count: must be an integer"),
        ("[engine]\ncount = 'two'\n", "engine.count: must be an integer"),
        ("[gpu]\ncount = 2\n", "gpu.count: moved to [engine] count"),
        ("[engine]\nkind = 'turbo'\n", "engine.kind: must be one of batch, continuous, forward, got 'turbo'"),
        ("[engine]\nkind = 'micro'\n", "engine.kind: 'micro' is now called 'batch'"),
        ("[gpu]\ntime_scale = 0\n", "gpu.time_scale: must be between 1e-06 and 1e+06"),
        ("tenants = 3\n", "tenants: must be a table"),
        ("[tenants]\n", "tenants: at least one tenant is required"),
        ("[server\n", "TOML syntax error"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert expected in message
    assert "\n" not in message   # (the command prints it as its one line: tests/daemon/test_cli.py)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("toml", "preset", "expected"),
    [
        ({"policy": {"aging": "lifo"}}, None, "policy.aging: unknown aging policy 'lifo' (available: aps, fair, fifo, static)"),
        ({"policy": {"governor": "pid"}}, None, "unknown governor policy 'pid' (available: entropy, fixed)"),
        ({}, "random", "policy preset 'random' is unknown (available: aps, fair, fifo, static)"),
        ({"policy": {"aps": {"alfa": 1}}}, None, "policy.aps.alfa: unknown key (known keys: alpha)"),
        ({"policy": {"aps": {"alpha": -1.0}}}, None, "policy.aps.alpha: must be between 0 and 1e+06"),
        ({"policy": {"micro": {"max_batch_size": 0}}}, None, "policy.micro.max_batch_size: must be"),
        ({"policy": {"nosuch": {"x": 1}}}, None, "policy.nosuch: no policy of that name has parameters"),
        ({"policy": {"fifo": {"x": 1}}}, "fifo", "policy.fifo.x: unknown key"),
    ],
)
def test_bad_policy_names_the_problem(toml, preset, expected):
    config = make_config(toml)
    with pytest.raises(ConfigError) as info:
        build_policies(config, preset)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_preset_and_overrides():
    config = make_config({"policy": {"preset": "static", "governor": "entropy"}})
    assert build_policies(config).names == {"preset": "static", "aging": "static", "governor": "entropy",
                                            "batching": "micro"}
    # the command line's preset wins over the file's, explicit kinds still apply
    assert build_policies(config, "fifo").names["aging"] == "fifo"
    assert build_policies(config, "fifo").names["governor"] == "entropy"


def test_zero_decode_rate_is_refused(tmp_path):
    path = write(tmp_path, "[gpu]\ndecode_batch_base = 0\ndecode_batch_sqrt = 0\n")
    with pytest.raises(ConfigError, match="decode_batch_base \\+ decode_batch_sqrt must be > 0"):
        load_config(path)


def test_typo_in_an_unselected_policy_table_is_caught():
    with pytest.raises(ConfigError, match="policy.fixed.windw_ms: unknown key"):
        build_policies(make_config({"policy": {"fixed": {"windw_ms": 5}}}), "aps")
