"""The ``apsd`` command.

* ``apsd [--policy P] [--host H] [--port N] [CONFIG]`` runs the daemon.
* ``apsd plugins [--json]`` lists every registered plugin and what it provides.

Exit status: 0 after a clean shutdown, 2 for a bad config or command line
(one message naming the file and the key, no traceback), 1 for a plugin that
cannot load.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

import trio

from . import __version__
from .config import ConfigError, load_config
from .daemon import Daemon
from .plugins import PluginError, describe_plugins, load_policy_registry, make_plugin_manager

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
        description="Multi-tenant inference scheduler daemon (Adaptive Priority Scheduling).",
        epilog="Without CONFIG, apsd runs on its embedded defaults (the same as config/apsd.toml). "
        "'apsd plugins' lists the installed policy plugins (APSD_PLUGINS=name,... limits which load).",
    )
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="TOML config file")
    parser.add_argument("--policy", metavar="PRESET",
                        help="policy preset: fifo, static, aps (default: [policy] preset, else aps)")
    parser.add_argument("--host", help="listen address (overrides [server] host)")
    parser.add_argument("--port", type=_port, help="listen port, 0 for any free port (overrides [server] port)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default INFO)")
    parser.add_argument("--version", action="version", version=f"apsd {__version__}")
    return parser


def plugins_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="apsd plugins",
                                     description="List registered plugins (built-ins first) and their policies.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        pm = make_plugin_manager()
        described = describe_plugins(pm, load_policy_registry(pm))
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plugins"]:
        return plugins_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config).with_overrides(host=args.host, port=args.port)
        daemon = Daemon.from_config(config, preset=args.policy)
    except ConfigError as exc:
        parser.exit(2, f"apsd: error: {exc}\n")
    except PluginError as exc:
        parser.exit(1, f"apsd: plugin error: {exc}\n")
    try:
        trio.run(daemon.run)
    except KeyboardInterrupt:  # Ctrl-C before the signal watcher was listening
        return 130
    except BaseException as exc:
        os_error = _leaf(exc, OSError)  # e.g. the address is already in use
        if os_error is None:
            raise
        parser.exit(1, f"apsd: error: cannot serve on {config.server.host}:{config.server.port}: "
                       f"{os_error.strerror or os_error}\n")
    return 0


def _leaf(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
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
