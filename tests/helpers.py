"""Helpers the tests share: configs, policies, submitting requests, ``/infer`` bodies, daemons
in-process and as a subprocess, daemons forwarding to backends, waiting for a condition, and the
simulator's isolation measures. Fixtures live in ``conftest.py`` and in the real-server modules
(``llama_server.py``, ``redis_server.py``, ``standin_backend.py``); tests import helpers from here,
never from each other (the benchmarks under ``benchmarks/`` import them too)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx
import numpy as np
import trio

from apsd.core.config import Config, GpuConfig, PriceConfig, ServerConfig, TenantConfig, parse_config
from apsd.core.models import InferenceRequest
from apsd.core.policy import PolicySet
from apsd.pipeline import Pipeline
from apsd.plugins import load_policy_registry, make_plugin_manager
from apsd.serve.daemon import Daemon
from tests.budget_spender import INPUT_PER_1M_USD, OUTPUT_PER_1M_USD
from tests.standin_backend import Exchange, Reply, chat_answer, json_reply

ROOT = Path(__file__).resolve().parents[1]
#: The installed ``apsd`` command of the interpreter running the tests.
APSD = str(Path(sys.executable).with_name("apsd"))
LISTENING = re.compile(rb"apsd listening on (http://\S+)")
#: A simulated GPU 1000x faster than real time, for daemons over real HTTP.
FAST_GPU = GpuConfig(time_scale=0.001)
#: ``[server] port`` when a config names none.
DEFAULT_PORT = ServerConfig().port
#: How long :func:`wait_until` waits by default (real seconds): a condition that takes longer on a
#: loaded machine is a failure, well inside pytest's 120 s timeout.
WAIT_S = 60.0


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


def infer_body(tenant: str | None = "tenant_a", prompt: str = "Hello world", tokens: int = 100, bid: int = 5,
               **extra: Any) -> dict[str, Any]:
    """A ``POST /infer`` body; ``tenant=None`` leaves ``tenant_id`` out (it comes from an API key),
    ``extra``: more fields (``timeout_s``, or ones the daemon must refuse)."""
    body: dict[str, Any] = {"prompt": prompt, "tokens_requested": tokens, "priority_bid": bid, **extra}
    if tenant is not None:
        body = {"tenant_id": tenant, **body}
    return body


def expected_prompt_tokens(text: str) -> float:
    """The documented estimate of a prompt (docs/reference/accounting.md), written out independently of
    apsd's: ASCII letters at 4 a token, every other ASCII character one token but a space that begins
    a word, each UTF-8 byte beyond ASCII one token. Not rounded (callers add, then round up)."""
    letters = sum(1 for c in text if c.isascii() and c.isalpha())
    word_spaces = sum(1 for a, b in zip(text, text[1:]) if a == " " and b.isascii() and b.isalpha())
    ascii_chars = sum(1 for c in text if ord(c) < 128)
    other_bytes = len(text.encode("utf-8", "surrogatepass")) - ascii_chars
    return letters / 4 + (ascii_chars - letters - word_spaces) + other_bytes


async def wait_until(predicate: Callable[[], bool], limit_s: float = WAIT_S, step_s: float = 0.05) -> None:
    """Poll ``predicate`` every ``step_s`` (trio's clock) until it holds; fail after ``limit_s``."""
    with trio.fail_after(limit_s):
        while not predicate():
            await trio.sleep(step_s)


@attrs.define
class LiveDaemon:
    daemon: Daemon
    url: str
    client: httpx.AsyncClient


async def start_daemon(nursery: trio.Nursery, config: Config, preset: str | None = None,
                       plugins: Sequence[object] = ()) -> LiveDaemon:
    """A daemon in this process on the config's host and port, built-in plugins only, and ``plugins``
    (objects with ``@apsd.core.hookspecs.hookimpl`` methods, e.g. recorders). A config that leaves the
    port at its default (8002) gets a free one instead: a test never takes a fixed port by accident;
    one that names a port (a second daemon on the first one's, with ``reuse_port``) keeps it."""
    if config.server.port == DEFAULT_PORT:
        config = attrs.evolve(config, server=attrs.evolve(config.server, port=0))
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


async def wait_for_log(process: trio.Process, seen: list[bytes], pattern: bytes, after: int = 0) -> str:
    """Read apsd's stderr (into ``seen``) until ``pattern`` appears past byte ``after`` of it; the text
    read so far. Fails after :data:`WAIT_S`, or if apsd exits first."""
    with trio.fail_after(WAIT_S):
        while pattern not in b"".join(seen)[after:]:
            chunk = await process.stderr.receive_some()
            if not chunk:
                raise AssertionError(f"apsd exited before logging {pattern!r}: {b''.join(seen).decode()}")
            seen.append(chunk)
    return b"".join(seen).decode(errors="replace")


async def stop_apsd(process: trio.Process, seen: list[bytes]) -> str:
    """SIGTERM apsd, require exit status 0, and return its whole stderr (``seen`` plus the rest)."""
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(30):
        assert await process.wait() == 0
    while chunk := await process.stderr.receive_some():
        seen.append(chunk)
    return b"".join(seen).decode(errors="replace")


# -- daemons in front of backends (the forward engine) ------------------------------------------------

def forwarding_config(urls: Sequence[str], tenants: dict[str, TenantConfig], *, preset: str | None = None,
                      max_concurrency: int = 4, shutdown_grace_s: float = 2.0, backend: dict[str, Any] | None = None,
                      sections: dict[str, dict[str, Any]] | None = None, **forward: Any) -> Config:
    """A daemon on 127.0.0.1:0 forwarding to the backends at ``urls`` (named b0, b1, ...), health
    checked every 0.2 s and their metrics read every 0.1 s unless ``forward`` says otherwise.
    ``backend``: more keys for every ``[[backends]]`` entry; ``sections``: more TOML sections
    (``{"admission": {...}}``)."""
    toml: dict[str, Any] = {"backends": [{"url": url, "name": f"b{i}", "max_concurrency": max_concurrency,
                                          **(backend or {})} for i, url in enumerate(urls)],
                            "forward": {"health_interval_s": 0.2, "metrics_interval_s": 0.1, **forward}}
    if preset is not None:
        toml["policy"] = {"preset": preset}
    toml.update(sections or {})
    return make_config(toml, server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=shutdown_grace_s),
                       tenants=tenants)


def backends_up(daemon: Daemon, n: int | None = None) -> Callable[[], bool]:
    """A predicate: ``n`` of the forward engine's backends are healthy (None: all of them)."""
    def up() -> bool:
        backends = daemon.pipeline.engines[0].backends
        healthy = sum(b.healthy for b in backends)
        return healthy == (len(backends) if n is None else n)
    return up


def bucket_level(daemon: Daemon, tenant: str) -> float:
    """Tokens left in ``tenant``'s bucket now."""
    pipeline = daemon.pipeline
    return pipeline.admission.buckets[tenant].level(pipeline.clock.now())


def openai_client(url: str, tenant: str = "t") -> Any:
    """The official (synchronous) OpenAI client of the daemon at ``url``, as ``tenant``: no retries,
    30 s timeouts (call it in a thread: ``trio.to_thread.run_sync``)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", default_headers={"X-Apsd-Tenant": tenant},
                         max_retries=0, timeout=30)


# -- the simulator's isolation measures (tests/sim/test_isolation.py, benchmarks/bench_isolation.py) ----

#: noisy-neighbor on the continuous engine: a steady tenant sending a 512/128-token request every 0.5 s
#: beside a same-bid tenant flooding 512/512 at 40 req/s (about ten times what the default continuous
#: engine serves of them), for 30 s.
CONTINUOUS_FLOOD = {"duration": 30.0, "steady_rate": 2.0, "steady_prompt_tokens": 512, "steady_output_tokens": 128,
                    "neighbor_rate": 40.0, "neighbor_prompt_tokens": 512, "neighbor_output_tokens": 512}


def steady(run: Any, measure: Callable[[Any], float]) -> list[float]:
    """``measure`` of every completed request of the ``steady`` tenant of a simulated run."""
    return [measure(r) for r in run.requests if r.tenant == "steady" and r.outcome == "completed"]


def p99(values: Sequence[float]) -> float:
    return float(np.percentile(values, 99))


def ttft(r: Any) -> float:
    return r.started_at - r.arrival


def latency(r: Any) -> float:
    return r.finished_at - r.arrival


def max_backlogged_service_gap(run: Any) -> float:
    """The largest difference, after any dispatch while both tenants have requests queued, between the
    service (prompt + 2 x output tokens) dispatched to each since both last became backlogged. The
    requests of one dispatch leave at one instant: the gap is read once they all have."""
    events = sorted([(r.arrival, 0, i) for i, r in enumerate(run.requests)]
                    + [(r.dispatched_at, 1, i) for i, r in enumerate(run.requests) if r.dispatched_at is not None])
    queued = {"tenant_a": 0, "tenant_b": 0}
    served = {"tenant_a": 0.0, "tenant_b": 0.0}
    gap = 0.0
    for at, group in itertools.groupby(events, key=lambda e: (e[0], e[1])):
        for _, kind, i in group:
            r = run.requests[i]
            if kind == 0:
                queued[r.tenant] += 1
                if queued[r.tenant] == 1:  # a new continuously backlogged period may start
                    served = {t: 0.0 for t in served}
            else:
                queued[r.tenant] -= 1
                served[r.tenant] += r.prompt_tokens + 2 * r.output_tokens
        if at[1] == 1 and all(queued.values()):
            gap = max(gap, abs(served["tenant_a"] - served["tenant_b"]))
    return gap


@contextlib.contextmanager
def small_filesystem(path: Path, size: str = "1m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (made if missing) for the body of a ``with``, unmounted
    after: a disk that really fills up (ENOSPC). Needs root (CAP_SYS_ADMIN): the test is skipped
    without it."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root needed): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path) -> Path:
    """Fill the filesystem of ``directory`` to the last byte with one file; returns it (delete it to
    free the space)."""
    filler = directory / "filler"
    descriptor = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for block in (65536, 4096, 1):
            try:
                while True:
                    os.write(descriptor, b"\0" * block)
            except OSError:
                pass
    finally:
        os.close(descriptor)
    return filler


# -- spending a dollar budget (tests/daemon/test_money.py, tests/backends/test_money_redis.py) ----------------

#: What the stand-in's model costs in the money tests: $2 per million prompt tokens, $10 per million output.
PRICES = {"standin": PriceConfig(input_per_1m_usd=INPUT_PER_1M_USD, output_per_1m_usd=OUTPUT_PER_1M_USD)}
#: The dollar budget the concurrency tests spend (about 600 requests of 4 + 20-100 tokens).
BUDGET_USD = 0.36
#: The prompt tokens the stand-in reports (below apsd's estimate of "request NNNNN": no prompt excess).
PROMPT_TOKENS = 4


def varied_length(exchange: Exchange) -> Reply:
    """An answer of 20 to 100 tokens (at most the request's limit), fixed by the prompt's text, with a
    truthful usage: so requests use less than, and sometimes more than, what apsd learns to reserve."""
    request = json.loads(exchange.body)
    tokens = min(int(request.get("max_tokens") or 100), 20 + zlib.crc32(request["prompt"].encode()) % 81)
    usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": tokens, "total_tokens": PROMPT_TOKENS + tokens}
    return json_reply(chat_answer(request, usage, content=" ".join(["tok"] * tokens)))
