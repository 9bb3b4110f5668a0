"""Helpers the tests share: configs, policies, submitting requests, daemons in-process and as a
subprocess. Fixtures live in ``conftest.py``; tests import helpers from here, never from each other."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from apsd.core.config import Config, GpuConfig, parse_config
from apsd.serve.daemon import Daemon
from apsd.core.models import InferenceRequest
from apsd.pipeline import Pipeline
from apsd.plugins import load_policy_registry, make_plugin_manager
from apsd.core.policy import PolicySet

ROOT = Path(__file__).resolve().parents[1]
#: The installed ``apsd`` command of the interpreter running the tests.
APSD = str(Path(sys.executable).with_name("apsd"))
LISTENING = re.compile(rb"apsd listening on (http://\S+)")
#: A simulated GPU 1000x faster than real time, for daemons over real HTTP.
FAST_GPU = GpuConfig(time_scale=0.001)


def make_config(toml_data: dict[str, Any] | None = None, **sections: Any) -> Config:
    """A Config from TOML-shaped data, then attrs sections replaced wholesale."""
    config = parse_config(toml_data or {}, "<test>")
    return attrs.evolve(config, **sections)


def build_policies(config: Config, preset: str | None = None) -> PolicySet:
    """The policies ``config`` selects, from the built-ins only (whatever else is installed)."""
    return load_policy_registry(make_plugin_manager(load_entry_points=False)).build(config, preset)


def submit(pipeline: Pipeline, *, tenant: str = "a", tokens: int, prompt_tokens: int = 0, bid: int = 5,
           timeout_s: float | None = None) -> InferenceRequest:
    """Hand a request to the pipeline's ingress now; it must be taken in."""
    request = pipeline.new_request(tenant_id=tenant, prompt="", tokens_requested=tokens, priority_bid=bid,
                                   prompt_tokens=prompt_tokens, timeout_s=timeout_s)
    refusal = pipeline.submit_nowait(request)
    assert refusal is None, refusal
    return request


async def submit_at(pipeline: Pipeline, at: float, **kwargs: Any) -> InferenceRequest:
    """:func:`submit` at model time ``at`` (virtual time friendly); returns the request."""
    await pipeline.clock.sleep_until(at)
    return submit(pipeline, **kwargs)


@attrs.define
class LiveDaemon:
    daemon: Daemon
    url: str
    client: httpx.AsyncClient


async def start_daemon(nursery: trio.Nursery, config: Config, preset: str | None = None,
                       plugins: Sequence[object] = ()) -> LiveDaemon:
    """A daemon in this process on the config's address (port 0: any free one), built-in plugins
    only, and ``plugins`` (objects with ``@apsd.core.hookspecs.hookimpl`` methods, e.g. recorders)."""
    plugin_manager = make_plugin_manager(load_entry_points=False)
    for plugin in plugins:
        plugin_manager.register(plugin)
    daemon = Daemon.from_config(config, preset=preset, handle_signals=False, plugin_manager=plugin_manager)
    binds = await nursery.start(daemon.run)
    url = binds[0]
    return LiveDaemon(daemon, url, httpx.AsyncClient(base_url=url, timeout=30))


def run_cli(*args: str, input: str | None = None, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """Run the ``apsd`` command with only the built-in plugins (whatever else is installed)."""
    return subprocess.run([APSD, *args], capture_output=True, text=True, timeout=60, input=input,
                          env={**os.environ, "APSD_PLUGINS": "", **(env or {})})


async def start_apsd(*args: str, **popen: Any) -> tuple[trio.Process, str, list[bytes]]:
    """Start the ``apsd`` command; return the process, its URL and the stderr read so far (kept filling).

    ``popen`` goes to :class:`subprocess.Popen` (e.g. ``preexec_fn``)."""
    process = await trio.lowlevel.open_process([APSD, *args], stderr=subprocess.PIPE,
                                               env={**os.environ, "PYTHONUNBUFFERED": "1"}, **popen)
    seen: list[bytes] = []
    try:
        with trio.fail_after(30):
            while not (match := LISTENING.search(b"".join(seen))):
                chunk = await process.stderr.receive_some()
                if not chunk:
                    raise AssertionError(f"apsd exited before listening: {b''.join(seen).decode()}")
                seen.append(chunk)
    except BaseException:  # never leave a daemon behind
        process.kill()
        raise
    return process, match.group(1).decode(), seen


async def stop_apsd(process: trio.Process, seen: list[bytes]) -> str:
    """SIGTERM apsd, require exit status 0, and return its whole stderr (``seen`` plus the rest)."""
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        assert await process.wait() == 0
    while chunk := await process.stderr.receive_some():
        seen.append(chunk)
    return b"".join(seen).decode(errors="replace")
