"""The ``apsd`` command and its subcommands.

* ``apsd [--policy PRESET] [--host H] [--port N] [--log-level L] [--log-format F] [--log-prompts] [CONFIG]``
  runs the daemon (:mod:`apsd.serve.daemon`) until SIGTERM or SIGINT.
* ``apsd hash-key [--new]`` makes an API key's hash for the config (:mod:`apsd.serve.auth`).
* ``apsd usage [--tenant T] [--from WHEN] [--to WHEN] [--group-by hour|day] [--by-key]`` prints a
  running daemon's usage history (``GET /admin/usage``; the admin key from ``APSD_ADMIN_KEY``), spend in
  dollars included, and the budgets in force (tokens and dollars, tenants' and keys').
* ``apsd state export [CONFIG] [--output FILE]`` and ``apsd state import [CONFIG] FILE [--merge]``
  write the whole state (:mod:`apsd.state`) the config names as one JSON document, and add one to
  it: how a single daemon's SQLite state moves into Redis for replicas (:mod:`apsd.state.dump`).
* ``apsd plugins [--json]`` lists every registered plugin and what it provides.
* ``apsd simulate [--workload W | --trace FILE] [--policy P ...]`` compares policies on one workload in
  virtual time and writes a report (:mod:`apsd.sim.runner`, :mod:`apsd.sim.report`); with
  ``--replicas N`` it runs N replicas sharing a simulated store instead (:mod:`apsd.sim.replicas`).
* ``apsd research`` runs the research suite and writes ``docs/research.md`` (:mod:`apsd.sim.research`);
  ``--classes``, ``--routing``, ``--grid`` and ``--table`` run one study each and write its page under
  ``docs/research/``.
* ``apsd profile --gpu G --model M --batch B --prompt-tokens P --output-tokens O`` runs a batch on
  one continuous engine in virtual time and prints its figures (:mod:`apsd.sim.profile`).

Exit status: 0 after a clean shutdown; 2 for a bad config or command line (one message naming the
file and the key, no traceback); 1 for a plugin that cannot load, or an address the daemon cannot
serve (already in use, say); 130 for Ctrl-C before the daemon listens for signals; 141 when the
reader of standard output has gone (``apsd plugins --json | head -c 100``).

``docs/reference/cli.md`` is generated from the parsers below (:mod:`apsd.reference`).
"""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from apsd.core.config import Config, ConfigError, load_config
from apsd.core.version import VERSION as __version__
from apsd.plugins import PluginError, describe_plugins, load_policy_registry, load_profile_registry, make_plugin_manager
from apsd.serve.daemon import Daemon
from apsd.serve.logs import configure_logging

__all__ = ["main"]


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0-65535, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apsd",
        description="Multi-tenant inference scheduler daemon: per-tenant token buckets, fair share between "
                    "tenants and priority aging inside each, in front of simulated GPUs or real inference servers.",
        epilog="Without CONFIG, apsd runs on its embedded defaults (the same as config/apsd.toml). "
        "'apsd hash-key --new' makes an API key and its hash; 'apsd plugins' lists the installed policy plugins (APSD_PLUGINS=name,... limits which load); "
        "'apsd simulate --help' compares policies in virtual time; 'apsd profile --help' measures a GPU and "
        "model on the roofline model; 'apsd research' regenerates docs/research.md; 'apsd usage' prints a running "
        "daemon's usage per tenant and hour.",
    )
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="TOML config file")
    parser.add_argument("--policy", metavar="PRESET",
                        help="policy preset: fair, aps, static, fifo, or one a plugin adds (default: [policy] "
                             "preset, else fair)")
    parser.add_argument("--host", help="listen address (overrides [server] host)")
    parser.add_argument("--port", type=_port, help="listen port, 0 for any free port (overrides [server] port)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default INFO; DEBUG adds a line per finished request)")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="one line per event: text (default) or JSON")
    parser.add_argument("--log-prompts", action="store_true",
                        help="include prompt text in DEBUG request lines (never logged otherwise)")
    parser.add_argument("--version", action="version", version=f"apsd {__version__}")
    return parser


def plugins_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="apsd plugins",
                                     description="List registered plugins (built-ins first) and their policies.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        pm = make_plugin_manager()
        described = describe_plugins(pm, load_policy_registry(pm), load_profile_registry(pm))
    except PluginError as exc:
        parser.exit(1, f"apsd: plugin error: {exc}\n")
    if args.json:
        print(json.dumps(described, indent=2))
        return 0
    for plugin in described:
        origin = "built-in" if plugin["builtin"] else f"{plugin['distribution']} {plugin['version']}"
        provides = "; ".join(f"{kind}: {', '.join(names)}" for kind, names in plugin["provides"].items())
        observes = [h for h in plugin["hooks"] if h != "register_policies"]
        if observes:
            provides = "; ".join(filter(None, [provides, f"observes: {', '.join(observes)}"]))
        print(f"{plugin['name']}  [{origin}]  {provides or '(nothing)'}")
    return 0


def hash_key_main(argv: Sequence[str]) -> int:
    from apsd.serve.auth import MIN_KEY_CHARS, hash_key, is_usable_key, new_key

    parser = argparse.ArgumentParser(
        prog="apsd hash-key",
        description="Print the hash of an API key, for a tenant's api_key_hashes, [auth] admin_key_hashes "
                    "or [auth] metrics_key_hashes. "
                    "The key is read from standard input (or a prompt), never from the command line, "
                    "so it stays out of shell history and the process list.",
        epilog="Example: apsd hash-key --new   (prints a new random key, then its hash)")
    parser.add_argument("--new", action="store_true", help="make a new random key and print it, then its hash")
    args = parser.parse_args(argv)
    if args.new:
        key = new_key()
        print(f"key:  {key}")
        print(f"hash: {hash_key(key)}")
        print("Give the key to its owner and put the hash in the config; apsd keeps no copy of the key.",
              file=sys.stderr)
        return 0
    if sys.stdin.isatty():
        key = getpass.getpass("API key (not echoed): ")
    else:
        key = sys.stdin.readline().rstrip("\r\n")
    if not is_usable_key(key):
        parser.exit(2, f"apsd hash-key: error: a key must be at least {MIN_KEY_CHARS} characters of "
                       "A-Z a-z 0-9 - . _ ~ + / (a Bearer token); use 'apsd hash-key --new' for a random one\n")
    print(hash_key(key))
    return 0


def _state_store(parser: argparse.ArgumentParser, config_path: str | None, *, must_exist: bool) -> Any:
    """The state the config at ``config_path`` names (its SQLite file, or its Redis), or exit 2."""
    from apsd.state.keeper import state_store_for
    from apsd.state.sqlite import StateFileError

    try:
        config = load_config(config_path)
        if must_exist and config.state.kind in ("auto", "sqlite") and not config.store.shared:
            path = config.state.sqlite_path(os.environ)
            if not path.is_file():
                parser.exit(2, f"{parser.prog}: error: no state file at {path} ([state] path of "
                               f"{config.source})\n")
        store = state_store_for(config, os.environ)
    except (ConfigError, StateFileError) as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if store is None:
        parser.exit(2, f"{parser.prog}: error: {config.source}: [state] kind = \"off\": there is no state\n")
    return store


def _state_error(parser: argparse.ArgumentParser, store: Any, exc: BaseException) -> None:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    parser.exit(1, f"{parser.prog}: error: the state at {store.where} cannot be used: {type(exc).__name__}: {exc}\n")


def state_export_main(argv: Sequence[str]) -> int:
    """``apsd state export``: the whole state as one JSON document."""
    from apsd.state.dump import dump_to_json

    parser = argparse.ArgumentParser(
        prog="apsd state export",
        description="Write the whole state the config names (its [state]: the SQLite file of a single daemon, "
                    "or the Redis of replicas) as one JSON document: tenants, issued keys (their hashes, never "
                    "a key), the audit log, usage, budgets' spend and bucket levels. It may run beside the "
                    "daemon: changes made after it are not in the document.",
        epilog="Example: apsd state export /etc/apsd/apsd.toml --output apsd-state.json")
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="the daemon's config file (default: the "
                        "embedded defaults, whose state is the default SQLite file)")
    parser.add_argument("--output", "-o", metavar="FILE", help="write it here (mode 0600) instead of standard output")
    args = parser.parse_args(argv)
    store = _state_store(parser, args.config, must_exist=True)

    async def export() -> Any:
        try:
            return await store.dump()
        finally:
            await store.close()

    try:
        dump = trio.run(export)
    except Exception as exc:
        _state_error(parser, store, exc)
    text = json.dumps(dump_to_json(dump), indent=1) + "\n"
    if args.output:
        descriptor = os.open(args.output, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(text)
    else:
        sys.stdout.write(text)
    print(f"apsd state export: {dump.counts()} from {store.where}", file=sys.stderr)
    return 0


def state_import_main(argv: Sequence[str]) -> int:
    """``apsd state import``: add a JSON document of ``apsd state export`` to a state."""
    from apsd.state.dump import DumpError, dump_from_json

    parser = argparse.ArgumentParser(
        prog="apsd state import",
        description="Add a document written by 'apsd state export' to the state the config names: its "
                    "tenants and keys (replacing those of the same name or id), its audit log (its ids kept "
                    "in Redis), its usage, budgets' spend and bucket levels. Running replicas see the tenants "
                    "and keys within [state] poll_interval_s. A state that already holds tenants, audit "
                    "entries or usage is refused unless --merge is given (importing twice counts usage twice).",
        epilog="Example: apsd state import /etc/apsd/replicas.toml apsd-state.json")
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="the config file whose [state] receives it")
    parser.add_argument("file", metavar="FILE", help="the document ('-': standard input)")
    parser.add_argument("--merge", action="store_true", help="add it to a state that is not empty")
    args = parser.parse_args(argv)
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text(encoding="utf-8")
        dump = dump_from_json(json.loads(text))
    except OSError as exc:
        parser.exit(2, f"apsd state import: error: {args.file}: {exc.strerror or exc}\n")
    except (ValueError, DumpError) as exc:
        parser.exit(2, f"apsd state import: error: {args.file}: {exc}\n")
    store = _state_store(parser, args.config, must_exist=False)

    async def add() -> str | None:
        try:
            if not args.merge:
                here = await store.dump()
                if here.tenants or here.audit or here.usage:
                    return (f"the state at {store.where} is not empty ({here.counts()}); import into an empty "
                            "state (before the replicas first start), or give --merge to add to it")
            await store.import_dump(dump)
            return None
        finally:
            await store.close()

    try:
        refused = trio.run(add)
    except Exception as exc:
        _state_error(parser, store, exc)
    if refused:
        parser.exit(1, f"apsd state import: error: {refused}\n")
    print(f"apsd state import: {dump.counts()} into {store.where}", file=sys.stderr)
    return 0


def usage_main(argv: Sequence[str]) -> int:
    """``apsd usage``: a running daemon's usage history (``GET /admin/usage``), as a table, CSV or JSON."""
    import httpx

    from apsd.state.usage import CSV_COLUMNS

    parser = argparse.ArgumentParser(
        prog="apsd usage",
        description="Print a running daemon's usage per tenant (and issued key) and hour or day (GET /admin/usage): "
                    "requests by outcome, refusals, tokens, cost, spend at the configured prices and latency "
                    "percentiles; then the budgets in force this period (tenants' and keys', in tokens and "
                    "dollars: spent of limit). The admin key is read from "
                    "the environment variable APSD_ADMIN_KEY (not from the command line, where the process "
                    "list would show it); without keys configured (loopback) none is needed.",
        epilog="Example: APSD_ADMIN_KEY=... apsd usage --tenant team-a --from 2026-11-01 --group-by day --format csv")
    parser.add_argument("--url", default="http://127.0.0.1:8002", help="the daemon (default: %(default)s)")
    parser.add_argument("--tenant", help="one tenant (default: every tenant)")
    parser.add_argument("--from", dest="start", metavar="WHEN",
                        help="start: Unix seconds or an ISO 8601 date or time, UTC (default: 24 hours before --to)")
    parser.add_argument("--to", dest="end", metavar="WHEN", help="end (default: now)")
    parser.add_argument("--group-by", choices=("hour", "day"), default="hour", help="(default: %(default)s)")
    parser.add_argument("--by-model", action="store_true", help="one row per model and backend too")
    parser.add_argument("--by-key", action="store_true", help="one row per issued API key too (its name; "
                        "requests without an issued key on a row of their own)")
    parser.add_argument("--key", metavar="ID", help="one issued key's usage (its id, key_...)")
    parser.add_argument("--format", choices=("table", "csv", "json"), default="table", help="(default: %(default)s)")
    args = parser.parse_args(argv)
    params = {"group_by": args.group_by, "format": "csv" if args.format == "csv" else "json"}
    for name, value in (("tenant", args.tenant), ("from", args.start), ("to", args.end), ("key", args.key)):
        if value:
            params[name] = value
    by = [name for name, wanted in (("model", args.by_model), ("key", args.by_key or args.key)) if wanted]
    if by:
        params["by"] = ",".join(by)
    key = os.environ.get("APSD_ADMIN_KEY", "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}

    def get(path: str, query: dict[str, str] | None = None) -> httpx.Response:
        try:
            answer = httpx.get(args.url.rstrip("/") + path, params=query, headers=headers, timeout=30, trust_env=False)
        except httpx.HTTPError as exc:
            parser.exit(1, f"apsd usage: error: cannot reach {args.url}: {exc}\n")
        if answer.status_code != 200:
            try:
                message = answer.json().get("message", answer.text)
            except ValueError:
                message = answer.text[:200]
            parser.exit(1, f"apsd usage: error: {args.url} answered {answer.status_code}: {message}\n")
        return answer

    answer = get("/admin/usage", params)
    if args.format != "table":
        sys.stdout.write(answer.text if args.format == "csv" else json.dumps(answer.json(), indent=2) + "\n")
        return 0
    rows = answer.json()["rows"]
    text = {"period", "tenant", "model", "backend", "key_name"}
    columns = ["period", "tenant", *(["model", "backend"] if args.by_model else []),
               *(["key_name"] if "key" in by else []),
               *[c for c in CSV_COLUMNS if c not in text | {"refused_by_error", "key", "key_name", "spend_usd",
                                                             "unpriced", "cost_usd"}
                 and not c.startswith(("ttft", "latency"))],
               "cost_usd", "spend_usd", *[c for c in CSV_COLUMNS if c.startswith(("ttft", "latency"))]]
    _print_table(columns, [[("" if row[c] is None else str(row[c])) for c in columns] for row in rows], text)
    if not rows:
        print("(no usage in that period)", file=sys.stderr)
    budgets = _budget_rows(get, args.tenant, args.key)
    if budgets:
        print("\nbudgets this period (spent of limit, as this daemon knows it now):")
        _print_table(["tenant", "key", "unit", "spent", "limit", "used", "period", "resets_at"], budgets,
                     {"tenant", "key", "unit", "period", "resets_at"})
    return 0


def _print_table(columns: Sequence[str], cells: Sequence[Sequence[str]], text: set[str]) -> None:
    """Columns aligned: text to the left, figures to the right."""
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]
    for line in [list(columns), *cells]:
        print("  ".join(value.ljust(width) if column in text else value.rjust(width)
                        for column, value, width in zip(columns, line, widths)).rstrip())


def _budget_rows(get: Any, tenant: str | None, key_id: str | None) -> list[list[str]]:
    """The budgets of the tenants (and issued keys) in force, as table cells: tokens, or dollars."""
    import datetime

    def cells(owner: str, key: str, budget: dict[str, Any]) -> list[str]:
        usd = budget["unit"] == "usd"
        spent, limit = (budget["spent_usd"], budget["limit_usd"]) if usd else (budget["spent"], budget["limit"])

        def amount(value: float) -> str:
            return f"${value:,.4f}" if usd else f"{value:,}"

        resets = datetime.datetime.fromtimestamp(budget["resets_at"], datetime.UTC).strftime("%Y-%m-%dT%H:%MZ")
        return [owner, key, budget["unit"], amount(spent), amount(limit), f"{budget['used_ratio']:.1%}",
                budget["period"], resets]

    rows = []
    if key_id is None:
        for view in get("/admin/tenants").json()["tenants"]:
            if tenant and view["name"] != tenant:
                continue
            rows += [cells(view["name"], "", view["live"][kind]) for kind in ("budget", "budget_usd")
                     if view["live"] and view["live"].get(kind)]
    for view in get("/admin/keys", {"tenant": tenant} if tenant else None).json()["keys"]:
        if key_id and view["id"] != key_id:
            continue
        live = view.get("live") or {}
        rows += [cells(view["tenant"], view["name"], live[kind]) for kind in ("budget", "budget_usd") if live.get(kind)]
    return rows


def simulate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="apsd simulate",
        description="Run policies on the identical generated workload through apsd's own pipeline in "
                    "virtual time, and write a report (Markdown, JSON and PNG plots).",
        epilog="Example: apsd simulate --workload vip-flood --policy static --policy aps --set duration=300")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", default="seed-stress", metavar="NAME",
                        help="built-in workload (default seed-stress; --list shows them)")
    source.add_argument("--trace", metavar="FILE", help="replay a trace (.jsonl or .csv): apsd's own (at, tenant, "
                        "prompt_tokens, output_tokens[, bid, service_class, prefix, prefix_tokens, hash_ids]), "
                        "Mooncake / Dynamo JSON lines, the Azure LLM inference CSV or BurstGPT's CSV, detected "
                        "from the file")
    parser.add_argument("--policy", action="append", metavar="P",
                        help="PRESET or PRESET:KIND=NAME,... (repeatable; default: fifo, static, aps)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a workload parameter (repeatable), e.g. --set rate=5")
    parser.add_argument("--params", metavar="FILE", help="workload parameters from a TOML file (--set wins)")
    parser.add_argument("--seed", type=int, help="random seed of a built-in workload, or of a trace's zipf "
                        "tenant rule (default 1)")
    trace = parser.add_argument_group("traces", "with --trace FILE")
    trace.add_argument("--trace-format", choices=("auto", "apsd", "mooncake", "azure", "burstgpt"), default="auto",
                       help="the trace's format (default auto: detected from its first row)")
    trace.add_argument("--block-tokens", type=int, default=512, metavar="N",
                       help="tokens per block id of hash_ids (default 512, the Mooncake traces')")
    trace.add_argument("--trace-tenants", metavar="RULE",
                       help="tenants for requests whose row names none: round-robin:N, hash:FIELD:N (e.g. "
                            "hash:hash_ids:8, by the first block) or zipf:N[:S] (default: all to tenant_00; "
                            "apsd's own format requires tenant without a rule)")
    parser.add_argument("--config", metavar="FILE", help="apsd config for the engines ([engine], [gpu], [[backends]]), "
                        "queue limits and policy parameters (the workload brings its own tenants)")
    parser.add_argument("--out", metavar="DIR", help="report directory (default apsd-sim/<workload>)")
    parser.add_argument("--no-plots", action="store_true", help="write report.md and summary.json only")
    parser.add_argument("--no-alone", action="store_true",
                        help="do not also run each tenant alone (the isolation table that leads the summary; "
                             "workloads of 2 to 8 tenants)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar and no table")
    parser.add_argument("--list", action="store_true", help="list the built-in workloads and their parameters")
    replicas = parser.add_argument_group(
        "replicas sharing a store", "with --replicas N: N pipelines share tenants' buckets and fair share through "
        "a simulated store, once per --sync-interval; prints what each tenant was offered, admitted and served "
        "against what its bucket grants (tenants' buckets from --config when it names the workload's tenants)")
    replicas.add_argument("--replicas", type=int, metavar="N", help="replicas (2 or more)")
    replicas.add_argument("--sync-interval", type=float, action="append", metavar="S",
                          help="[store] sync_interval_s to compare, in seconds (repeatable; default 0.01, 0.05, 0.2, 1)")
    replicas.add_argument("--store-delay", type=float, default=0.001, metavar="S",
                          help="model seconds each exchange with the store takes (default 0.001)")
    return parser


def simulate_main(argv: Sequence[str]) -> int:
    from apsd.sim import workloads
    from apsd.sim.runner import parse_policy_choice, run_policy, simulation_config

    parser = simulate_parser()
    args = parser.parse_args(argv)
    if args.list:
        for name, description, defaults in workloads.list_workloads():
            print(f"{name}: {description}")
            print("    " + ", ".join(f"{k}={v}" for k, v in defaults.items()))
        return 0
    try:
        if args.trace:
            from apsd.sim.traces import load_trace

            if args.set or args.params:
                raise workloads.WorkloadError("--set and --params apply to built-in workloads, not --trace")
            workload = load_trace(args.trace, format=None if args.trace_format == "auto" else args.trace_format,
                                  block_tokens=args.block_tokens, tenants=args.trace_tenants,
                                  seed=1 if args.seed is None else args.seed)
        else:
            if args.trace_format != "auto" or args.trace_tenants or args.block_tokens != 512:
                raise workloads.WorkloadError("--trace-format, --block-tokens and --trace-tenants apply to --trace")
            params = workloads.load_params_file(args.params) if args.params else {}
            params.update(workloads.parse_param_assignments(args.set))
            workload = workloads.build_workload(args.workload, params, seed=1 if args.seed is None else args.seed)
        choices = [parse_policy_choice(p) for p in (args.policy or ["fifo", "static", "aps"])]
        if len({c.label for c in choices}) != len(choices):
            raise ConfigError("--policy: the same policy is given twice")
        config = load_config(args.config)
        if args.replicas is not None:
            return _simulate_replicas(args, workload, choices, config)
        pm = make_plugin_manager()
        registry = load_policy_registry(pm)
        for choice in choices:  # every policy must build before anything runs
            registry.build(simulation_config(config, workload, choice))
        if not args.no_plots:
            _require_plotting(parser)
        from apsd.sim.alone import alone_runs

        total = len(workload.arrivals) * len(choices)
        runs, alone = [], []
        with _progress(total * (1 if args.no_alone else 2), args.quiet) as advance:
            for choice in choices:
                runs.append(run_policy(workload, choice, base_config=config, plugin_manager=pm, progress=advance))
                alone.append(None if args.no_alone else alone_runs(workload, choice, base_config=config,
                                                                   plugin_manager=pm, progress=advance))
    except (workloads.WorkloadError, ConfigError) as exc:
        parser.exit(2, f"apsd simulate: error: {exc}\n")
    except PluginError as exc:
        parser.exit(1, f"apsd simulate: plugin error: {exc}\n")
    from apsd.sim.report import format_summary_table, summarize, write_report
    from apsd.sim.report.tables import isolation_table

    out = Path(args.out or Path("apsd-sim") / workload.name)
    written = write_report(runs, out, plots=not args.no_plots, alone=alone)
    for stale in out.glob("*.png"):  # plots of an earlier run would no longer match the report
        if stale not in written:
            stale.unlink()
    wall = sum(run.wall_s for run in runs)
    if not args.quiet:
        summaries = [summarize(run, solo) for run, solo in zip(runs, alone)]
        isolated = isolation_table(summaries)
        if isolated is not None:
            print("Each tenant beside the others against alone (its own arrivals, nobody else's):\n")
            print(isolated + "\n")
        print(format_summary_table(summaries))
        print(f"\nreport: {out / 'report.md'}")
    print(f"simulated {total} requests ({len(workload.arrivals)} arrivals x {len(runs)} policies) in {wall:.2f} s: "
          f"{total / wall if wall else 0:,.0f} simulated requests per wall-clock second")
    return 0


def _simulate_replicas(args: argparse.Namespace, workload: Any, choices: Sequence[Any], config: Config) -> int:
    """``apsd simulate --replicas``: the sync periods compared, as a table on stdout."""
    from apsd.sim.replicas import run_replicas

    if args.replicas < 2:
        raise ConfigError(f"--replicas: must be 2 or more, got {args.replicas}")
    intervals = args.sync_interval or [0.01, 0.05, 0.2, 1.0]
    if not all(0.001 <= i <= 60 for i in intervals) or not 0 <= args.store_delay <= 10:
        raise ConfigError("--sync-interval: each must be 0.001-60 s; --store-delay: 0-10 s")
    names = {a.tenant for a in workload.arrivals}
    tenants = config.tenants if names <= set(config.tenants) else None
    print(f"{workload.name}: {len(workload.arrivals)} arrivals over {args.replicas} replicas, "
          f"each exchange taking {args.store_delay:g} s" + ("" if tenants else
          " (the workload's tenants are unthrottled: pass --config with their buckets to compare quotas)"))
    print(f"{'policy':<10} {'sync s':>7} {'tenant':<12} {'offered':>9} {'admitted':>9} {'bucket grants':>13} "
          f"{'admitted/grants':>15} {'served':>9} {'p99 latency s':>13}")
    for choice in choices:
        for interval in intervals:
            run = run_replicas(workload, choice, replicas=args.replicas, sync_interval_s=interval,
                               delay_s=args.store_delay, base_config=config, tenants=tenants)
            for t in run.tenants:
                grants = t.bound(run.duration_s)
                latency = "-" if t.latency_p99_s is None else f"{t.latency_p99_s:.3f}"
                print(f"{choice.label:<10} {interval:>7g} {t.tenant:<12} {t.offered_tokens:>9} {t.admitted_tokens:>9} "
                      f"{grants:>13.0f} {t.admitted_tokens / grants:>15.3f} {t.served_tokens:>9} {latency:>13}")
    return 0


def _require_plotting(parser: argparse.ArgumentParser) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.exit(2, "apsd simulate: error: plots need matplotlib: pip install 'apsd[sim]' (or use --no-plots)\n")


@contextlib.contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Callable[[int], None] | None]:
    """A tqdm bar on stderr (None when quiet or tqdm is missing)."""
    try:
        from tqdm import tqdm
    except ImportError:
        quiet = True  # (no bar without tqdm)
    if quiet:
        yield None
        return
    with tqdm(total=total, unit="req", desc="simulating", file=sys.stderr, leave=False, disable=None) as bar:
        def advance(n: int) -> None:
            bar.update(n)
        yield advance


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def profile_main(argv: Sequence[str]) -> int:
    from apsd.engines.profiles import ProfileError
    from apsd.plugins import load_profile_registry
    from apsd.sim.profile import profile_deployment

    parser = argparse.ArgumentParser(
        prog="apsd profile",
        description="Run BATCH identical requests, arriving together, on one continuous engine (the roofline model "
                    "of GPU x MODEL over TP GPUs) in virtual time, and print time to first token, time per output "
                    "token, throughput, KV cache capacity, MFU and MBU.",
        epilog="Example: apsd profile --gpu a100-80gb --model llama-2-7b --batch 1 --prompt-tokens 2048 "
               "--output-tokens 128")
    parser.add_argument("--list", action="store_true", help="list the GPU and model profiles (plugins' included)")
    parser.add_argument("--gpu", help="GPU profile, e.g. a100-80gb")
    parser.add_argument("--model", help="model profile, e.g. llama-3-8b")
    parser.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel GPUs: 1, 2, 4 or 8 (default 1)")
    parser.add_argument("--batch", type=_positive_int, help="identical requests arriving together")
    parser.add_argument("--prompt-tokens", type=_positive_int, help="prompt tokens per request")
    parser.add_argument("--output-tokens", type=_positive_int, help="output tokens per request")
    parser.add_argument("--max-batched-tokens", type=_positive_int, default=8192,
                        help="tokens per engine iteration (default 8192)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        profiles = load_profile_registry(make_plugin_manager())
    except PluginError as exc:
        parser.exit(1, f"apsd profile: plugin error: {exc}\n")
    if args.list:
        for gpu in profiles.gpus():
            print(f"gpu {gpu.name}: {gpu.bf16_tflops:g} TFLOP/s bf16, {gpu.hbm_gb_s:g} GB/s, {gpu.memory_gib:g} GiB, "
                  f"${gpu.price_per_hour_usd:g}/hour")
        for model in profiles.models():
            print(f"model {model.name}: {model.params / 1e9:.1f}B parameters, {model.layers} layers, "
                  f"{model.kv_heads} KV heads, context {model.max_context}")
        return 0
    missing = [f"--{name.replace('_', '-')}" for name in ("gpu", "model", "batch", "prompt_tokens", "output_tokens")
               if getattr(args, name) is None]
    if missing:
        parser.error(f"missing {', '.join(missing)} (or --list)")
    try:
        result = profile_deployment(args.gpu, args.model, tp=args.tp, batch=args.batch,
                                    prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                                    max_batched_tokens=args.max_batched_tokens, profiles=profiles)
    except (ConfigError, ProfileError, ValueError) as exc:
        parser.exit(2, f"apsd profile: error: {exc}\n")
    figures = attrs.asdict(result)
    if args.json:
        print(json.dumps(figures))
        return 0
    for name, value in figures.items():
        print(f"{name:<20} {value:,.4g}" if isinstance(value, float) else f"{name:<20} {value:,}")
    return 0


def research_main(argv: Sequence[str]) -> int:
    from apsd.sim.research import (
        CONTINUOUS_ENGINE,
        ISOLATION_SCALED,
        ISOLATION_WORKLOADS,
        POLICIES,
        SCALED,
        WORKLOADS,
        write_research,
    )

    engine = CONTINUOUS_ENGINE
    parser = argparse.ArgumentParser(
        prog="apsd research",
        description="Regenerate the research report: policies "
                    f"{', '.join(POLICIES)}, then the presets of installed plugins (APSD_PLUGINS applies), "
                    f"on workloads {', '.join(WORKLOADS)} and the isolation workloads "
                    f"{', '.join(ISOLATION_WORKLOADS)}, in virtual time, on the batch engine and on "
                    f"the continuous engine ({engine['gpu']}, {engine['model']}), plus "
                    f"{', '.join(s.name for s in (*SCALED, *ISOLATION_SCALED))} on the continuous engine only.")
    parser.add_argument("--out", default="docs", metavar="DIR", help="where research.md and research/ go "
                        "(default docs)")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    parser.add_argument("--grid", action="store_true",
                        help="instead, sweep the isolation grid (a steady tenant beside a flood, 81 workloads, on the "
                             "default continuous engine) under fifo, aps, fair and the plugins' presets: print a heat "
                             "map per policy and write research/isolation-grid.md (about 2 minutes per policy)")
    parser.add_argument("--presets", metavar="P,P", help="with --grid: these presets only")
    parser.add_argument("--routing", action="store_true",
                        help="instead, compare the routing policies least-loaded, prefix and prefix-hash between 4 "
                             "continuous engines with prefix caches on shared-prefix workloads and a Mooncake-format "
                             "trace: print the tables and write research/routing.md (a few minutes)")
    parser.add_argument("--classes", action="store_true",
                        help="instead, run the service-class study: two tenants, a tight and a loose class, at twice "
                             "what a continuous engine serves, under fair with and without classes: print the table "
                             "and write research/service-classes.md (about a minute at 120 s)")
    parser.add_argument("--table", action="store_true",
                        help="instead, run the benchmark table: FCFS, static priority, a per-tenant requests-per-"
                             "minute limit, least counter first, fair, fair with prefix routing and fair with "
                             "classes on VTC's suites, QLM's interactive + batch mix, shared prefixes, a "
                             "Mooncake-format trace and two replicas with skewed ingress; print it and write "
                             "research/benchmark.md (a few minutes)")
    parser.add_argument("--duration", type=float, default=None, metavar="S",
                        help="with --routing or --classes: model seconds of each workload (default 600 and 120)")
    args = parser.parse_args(argv)
    if args.table:
        return _research_table(args)
    if args.routing:
        return _research_routing(parser, args)
    if args.classes:
        return _research_classes(parser, args)
    _require_plotting(parser)
    if args.grid:
        return _research_grid(parser, args)
    try:
        # Installed plugins too, as the daemon loads them: research.md names them and their versions.
        pm = make_plugin_manager()
        with _progress(0, args.quiet) as advance:
            path = write_research(Path(args.out), seed=args.seed, progress=advance, plugin_manager=pm)
    except PluginError as exc:
        parser.exit(1, f"apsd research: plugin error: {exc}\n")
    print(f"wrote {path}")
    return 0


def _research_classes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from apsd.sim.research.classes import classes_document, run_classes_study

    return _write_study(parser, args, "service-classes.md", 120.0, run_classes_study, classes_document)


def _research_routing(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from apsd.sim.research.routing import routing_document, run_routing_study
    from apsd.sim.research.trace_routing import run_trace_routing, trace_routing_markdown

    def run(*, duration: float, seed: int, progress: Callable[[str], None] | None) -> tuple[Any, Any]:
        return (run_routing_study(duration=duration, seed=seed, progress=progress),
                run_trace_routing(seed=seed, progress=progress))

    def document(result: tuple[Any, Any], *, duration: float, seed: int) -> str:
        rows, trace = result
        return routing_document(rows, duration=duration, seed=seed) + "\n" + trace_routing_markdown(trace)

    return _write_study(parser, args, "routing.md", 600.0, run, document)


def _research_table(args: argparse.Namespace) -> int:
    from apsd.sim.research.table import run_table, versions
    from apsd.sim.research.table_page import benchmark_document, definition_fingerprint

    result = run_table(seed=args.seed, progress=None if args.quiet else lambda what: print(f"  {what}", file=sys.stderr))
    text = benchmark_document(result, versions(), definition_fingerprint(args.seed))
    path = Path(args.out) / "research" / "benchmark.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    print(f"wrote {path}")
    return 0


def _write_study(parser: argparse.ArgumentParser, args: argparse.Namespace, page: str, default_duration: float,
                 run: Callable[..., Any], document: Callable[..., str]) -> int:
    """Run a study (``run(duration=, seed=, progress=)``), print its page (``document(result, duration=,
    seed=)``) and write it to ``<out>/research/<page>``."""
    duration = default_duration if args.duration is None else args.duration
    if not 10 <= duration <= 86_400:
        parser.exit(2, f"apsd research: error: --duration: must be 10 to 86400 model seconds, got {duration:g}\n")
    result = run(duration=duration, seed=args.seed,
                 progress=None if args.quiet else lambda what: print(f"  {what}", file=sys.stderr))
    text = document(result, duration=duration, seed=args.seed)
    path = Path(args.out) / "research" / page
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(text)
    print(f"wrote {path}")
    return 0


def _research_grid(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from apsd.sim.isolation_grid import CELLS
    from apsd.sim.research.grid import GRID_PRESETS, print_heat_maps, write_grid
    from apsd.sim.research.suite import plugin_presets
    from apsd.sim.runner import parse_policy_choice

    try:
        presets = (tuple(p.strip() for p in args.presets.split(",") if p.strip()) if args.presets
                   else (*GRID_PRESETS, *plugin_presets(load_policy_registry(make_plugin_manager()))))
        for preset in presets:
            parse_policy_choice(preset)
        with _progress(len(CELLS) * len(presets), args.quiet) as advance:
            path, results = write_grid(Path(args.out), presets, seed=args.seed,
                                       progress=(lambda *_: advance(1)) if advance else None)
    except (ValueError, ConfigError) as exc:
        parser.exit(2, f"apsd research: error: {exc}\n")
    except PluginError as exc:
        parser.exit(1, f"apsd research: plugin error: {exc}\n")
    print(print_heat_maps(results))
    print(f"wrote {path}")
    return 0


#: Exit status after the reader of standard output went away (128 + SIGPIPE, as a shell reports it).
EXIT_CLOSED_PIPE = 128 + 13


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``apsd`` command; returns its exit status.

    Output to a pipe whose reader has gone (``apsd plugins --json | head -c 100``) ends the
    command quietly with status 141, as a Unix tool killed by SIGPIPE would, instead of a
    BrokenPipeError traceback.
    """
    try:
        status = _main(argv)
        sys.stdout.flush()  # (a closed pipe may only show here)
        return status
    except BrokenPipeError:
        # Python would try to flush stdout again at exit and fail loudly: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_CLOSED_PIPE


def _main(argv: Sequence[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["research"]:
        return research_main(argv[1:])
    if argv[:1] == ["plugins"]:
        return plugins_main(argv[1:])
    if argv[:1] == ["simulate"]:
        return simulate_main(argv[1:])
    if argv[:1] == ["hash-key"]:
        return hash_key_main(argv[1:])
    if argv[:1] == ["profile"]:
        return profile_main(argv[1:])
    if argv[:1] == ["usage"]:
        return usage_main(argv[1:])
    if argv[:2] == ["state", "export"]:
        return state_export_main(argv[2:])
    if argv[:2] == ["state", "import"]:
        return state_import_main(argv[2:])
    if argv[:1] == ["state"]:
        print("apsd state: error: say 'apsd state export' or 'apsd state import' (--help for each)", file=sys.stderr)
        return 2
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format, prompts=args.log_prompts)
    try:
        config = load_config(args.config).with_overrides(host=args.host, port=args.port)
        daemon = Daemon.from_config(config, preset=args.policy, config_path=args.config,
                                    overrides={"host": args.host, "port": args.port})
    except ConfigError as exc:
        parser.exit(2, f"apsd: error: {exc}\n")
    except PluginError as exc:
        parser.exit(1, f"apsd: plugin error: {exc}\n")
    try:
        trio.run(daemon.run)
    except KeyboardInterrupt:  # Ctrl-C before the signal watcher was listening
        return 130
    except BaseException as exc:
        config_error = _leaf(exc, ConfigError)  # e.g. a state file that cannot be opened
        if config_error is not None:
            parser.exit(2, f"apsd: error: {config_error}\n")
        os_error = _leaf(exc, OSError)  # e.g. the address is already in use
        if os_error is None:
            raise
        parser.exit(1, f"apsd: error: cannot serve on {config.server.host}:{config.server.port}: "
                       f"{os_error.strerror or os_error}\n")
    return 0


E = TypeVar("E", bound=BaseException)


def _leaf(exc: BaseException, kind: type[E]) -> E | None:
    """The first ``kind`` exception in ``exc`` or, for an exception group, in its leaves."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := _leaf(inner, kind)) is not None:
                return found
    return None


if __name__ == "__main__":
    sys.exit(main())
