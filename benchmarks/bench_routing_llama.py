"""Benchmark: cache-aware routing through real llama.cpp servers, least-loaded against prefix (and prefix-hash).

Starts ``--servers`` llama-servers (default 2) with a model written by ``tests/llama_server.py`` and, per
routing policy, an ``apsd`` process (the installed command, its own config file) forwarding to all of them.
Every policy gets freshly started servers, so each starts with cold caches. Through apsd, the same
multi-turn chat workload runs under each policy:

* ``--conversations`` conversations (32; 12 with ``--quick``), each with its own system prompt of about
  2,000 tokens (1,300 with ``--quick``) that differs from every other one from its first words, and
  ``--turns`` turns (6; 3) of a short user message each. A turn sends the whole conversation so far: the
  system prompt, every earlier user message and the assistant's earlier answers, as a chat client does.
* ``--in-flight`` conversations (6) talk at once, each pausing up to ``THINK_S`` between its turns (seeded),
  the next conversation starting when one ends. Answers are ``MAX_TOKENS`` tokens (the tiny models never
  stop early), streamed.

Cache pressure. Each server runs ``-np 4 --cache-ram 0``: 4 slots and no host-memory prompt cache, so its
prompt cache is exactly its 4 slots' KV (``cache_prompt`` is on by default: a request reuses the longest
common prefix of the slot it is given; ``--slot-prompt-similarity`` stays at its default 0.1, so a request
goes to the idle slot whose cached tokens cover more than 10% of its prompt, else to the least recently
used slot, whose cache it overwrites). One server thus holds 4 conversations, the 2 together 8, against 6
talking at once and 32 in all. Routing that keeps a conversation on one server needs 6 places; routing
that spreads each conversation's turns over both servers needs up to 12, and evicts. ``--cache-reuse``
(reuse of chunks after the first mismatch, by KV shifting) is left off: a conversation's next turn
extends its last prompt, so a common prefix is all there is to reuse. ``-c`` gives each slot 4,096 tokens.

The daemon: one tenant, ``fifo`` without a batch window, ``[routing] policy`` named each time (its default
is ``prefix``), each backend's ``max_concurrency`` its slots and its ``cache_tokens`` its ``-c`` (what its
slots hold; apsd's picture of a cache counts about 4 characters a token, the tests' tokenizer about 1.6,
so the picture believes a server holds more conversations than it does).

Measured per policy, from the client and from the servers themselves:

* time to first token at the client: from sending to the first streamed content chunk (mean, p50, p90);
* the cache hit rate counted by the servers: llama.cpp's ``timings`` in the last chunk of each stream,
  ``cache_n`` (prompt tokens taken from the slot's cache) and ``prompt_n`` (prompt tokens computed);
  hit rate = sum(cache_n) / sum(cache_n + prompt_n). The servers' /metrics counters
  (``llamacpp:prompt_tokens_cached_total`` and ``llamacpp:prompt_tokens_total``, read before and after)
  give the same figure, printed beside it;
* how the requests split over the servers (from each server's ``llamacpp:tokens_predicted_total``:
  every answer is ``MAX_TOKENS`` tokens); from apsd's ``X-Apsd-Route`` header, the routing reasons and
  how many turns after the first went to another server than the turn before ("later turns moved").

    .venv/bin/python benchmarks/bench_routing_llama.py            # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/bench_routing_llama.py --quick    # under a minute
    .venv/bin/python benchmarks/bench_routing_llama.py --policies prefix least-loaded --logs /tmp/logs

The model (``MODEL``: hidden 256, 4 layers, F32) computes a prompt at ~3,000 tokens/s on one thread of a
2-core machine, so a 2,000-token prompt costs ~0.6 s when computed and ~10 ms when cached. The servers,
apsd and this client share the machine's cores: read the times as what the machine gives, and compare
the policies with each other. Every loop is bounded (requests and a deadline per policy); every process
started here is stopped by its PID, in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import attrs
import httpx
import numpy as np
import trio

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from tests.helpers import APSD
from tests.llama_server import _WORDS, LlamaServer, find_llama_server, open_llama_server, stop_process, write_tiny_model

#: The model of the benchmark: slow enough that computing a prompt of 2,000 tokens (~0.6 s) stands out from
#: reading it from the cache (~10 ms); fast enough for a run of a few minutes.
MODEL: dict[str, int] = {"hidden": 256, "layers": 4, "heads": 4, "ffn": 512}
ALIAS = "routed"
TENANT = "bench"
#: Tokens per answer (the tiny models always generate exactly ``max_tokens``).
MAX_TOKENS = 8
#: A conversation pauses between 0 and this many seconds before its next turn (seeded).
THINK_S = 0.5
#: Each slot's context, tokens (``-c`` is this times the slots).
SLOT_CTX = 4096
#: llama-server flags beyond tests/llama_server.py's (``-c``, ``-np``, ``-t 1``, ``--metrics``): no host-memory
#: prompt cache, so a server's cache is its slots.
SERVER_ARGS: tuple[str, ...] = ("--cache-ram", "0")
POLICIES = ("least-loaded", "prefix", "prefix-hash")
#: For requests straight to a llama-server: a new connection each. It may close a kept-alive connection after a
#: streamed answer just as the client reuses it ("Server disconnected without sending a response").
FRESH_CONNECTIONS = httpx.Limits(max_keepalive_connections=0)


@attrs.frozen
class Workload:
    """What one policy's run sends, and to how many servers of how many slots."""

    servers: int = 2
    slots: int = 4
    conversations: int = 32
    turns: int = 6
    in_flight: int = 6
    #: Words of each system prompt (the tests' tokenizer makes about 3.3 tokens of a word).
    system_words: int = 600
    user_words: int = 12
    max_tokens: int = MAX_TOKENS
    think_s: float = THINK_S
    seed: int = 0
    #: The deadline of one policy's workload, seconds.
    deadline_s: float = 300.0

    @property
    def requests(self) -> int:
        return self.conversations * self.turns


DEFAULT = Workload()
QUICK = Workload(conversations=12, turns=3, system_words=400, deadline_s=150.0)


@attrs.frozen
class Record:
    """One request, as the client saw it and as the server counted it."""

    conversation: int
    turn: int
    ttft_ms: float
    cache_n: int
    prompt_n: int
    prompt_tokens: int
    route: str  #: apsd's ``X-Apsd-Route`` header ("" without one)


@attrs.frozen
class ServerCounts:
    """A server's /metrics counters."""

    processed: float  #: ``llamacpp:prompt_tokens_total``: prompt tokens computed
    cached: float  #: ``llamacpp:prompt_tokens_cached_total``: prompt tokens read from the cache
    predicted: float  #: ``llamacpp:tokens_predicted_total``

    def __sub__(self, other: ServerCounts) -> ServerCounts:
        return ServerCounts(self.processed - other.processed, self.cached - other.cached,
                            self.predicted - other.predicted)


@attrs.frozen
class PolicyResult:
    policy: str
    records: list[Record]
    errors: list[str]
    #: Per server, its counters' change over the workload.
    counts: list[ServerCounts]
    seconds: float

    def ttft(self, q: float | None = None) -> float:
        values = [r.ttft_ms for r in self.records]
        if not values:
            return math.nan
        return float(np.mean(values)) if q is None else float(np.percentile(values, q))

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / all prompt tokens, from the servers' per-response ``timings``."""
        cached = sum(r.cache_n for r in self.records)
        total = cached + sum(r.prompt_n for r in self.records)
        return cached / total if total else math.nan

    @property
    def metrics_hit_rate(self) -> float:
        """The same from the servers' /metrics counters."""
        cached = sum(c.cached for c in self.counts)
        total = cached + sum(c.processed for c in self.counts)
        return cached / total if total else math.nan

    def split(self, max_tokens: int) -> list[int]:
        """Requests each server answered, by its own count of generated tokens."""
        return [round(c.predicted / max_tokens) for c in self.counts]

    def moved(self) -> tuple[int, int]:
        """(later turns sent to another server than the turn before, later turns), from ``X-Apsd-Route``."""
        where = {(r.conversation, r.turn): r.route.partition(";")[0] for r in self.records}
        later = [(c, t) for (c, t) in where if t > 0 and (c, t - 1) in where]
        return sum(where[(c, t)] != where[(c, t - 1)] for c, t in later), len(later)

    def reasons(self) -> Counter[str]:
        return Counter(r.route.partition("reason=")[2] or "-" for r in self.records)


# -- the workload ----------------------------------------------------------------------------------------


def system_prompt(conversation: int, words: int) -> str:
    """A system prompt of its own from the first word on (so no two conversations share a cached prefix
    beyond the chat template's first tokens)."""
    rng = random.Random(f"system-{conversation}")
    return f"Conversation {conversation} of the routing benchmark. " + " ".join(rng.choice(_WORDS)
                                                                               for _ in range(words))


def user_message(conversation: int, turn: int, words: int) -> str:
    rng = random.Random(f"user-{conversation}-{turn}")
    return f"Question {turn}: " + " ".join(rng.choice(_WORDS) for _ in range(words))


async def stream_turn(client: httpx.AsyncClient, messages: list[dict], max_tokens: int
                      ) -> tuple[float, str, dict, dict, str]:
    """Stream one chat completion; (ms to the first content chunk, the answer, the last ``timings``, the
    ``usage``, the ``X-Apsd-Route`` header)."""
    body = {"model": ALIAS, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    timings: dict = {}
    usage: dict = {}
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"X-Apsd-Tenant": TENANT}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        route = response.headers.get("x-apsd-route", "")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(content)
            timings = chunk.get("timings") or timings
            usage = chunk.get("usage") or usage
    if first is None:
        raise RuntimeError("no content streamed")
    return (first - started) * 1000, "".join(parts), timings, usage, route


async def run_workload(url: str, w: Workload) -> tuple[list[Record], list[str]]:
    """Every conversation, ``w.in_flight`` at once, each turn after the last; stops at ``w.deadline_s``."""
    records: list[Record] = []
    errors: list[str] = []
    queue = list(range(w.conversations))
    limits = httpx.Limits(max_connections=w.in_flight + 2, max_keepalive_connections=w.in_flight + 2)

    async def talk(client: httpx.AsyncClient, conversation: int) -> None:
        rng = random.Random(f"think-{w.seed}-{conversation}")
        messages = [{"role": "system", "content": system_prompt(conversation, w.system_words)}]
        for turn in range(w.turns):
            messages.append({"role": "user", "content": user_message(conversation, turn, w.user_words)})
            try:
                ttft, answer, timings, usage, route = await stream_turn(client, messages, w.max_tokens)
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                errors.append(f"conversation {conversation} turn {turn}: {type(exc).__name__}: {exc}")
                return
            records.append(Record(conversation, turn, ttft, int(timings.get("cache_n", 0)),
                                  int(timings.get("prompt_n", 0)), int(usage.get("prompt_tokens", 0)), route))
            messages.append({"role": "assistant", "content": answer})
            await trio.sleep(rng.uniform(0, w.think_s))

    async def user(client: httpx.AsyncClient) -> None:
        while queue:  # bounded: each pass takes one of the w.conversations
            await talk(client, queue.pop(0))

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        with trio.move_on_after(w.deadline_s) as scope:
            async with trio.open_nursery() as nursery:
                for _ in range(w.in_flight):
                    nursery.start_soon(user, client)
        if scope.cancelled_caught:
            errors.append(f"deadline of {w.deadline_s:.0f} s reached: {w.requests - len(records)} requests not done")
    return records, errors


# -- servers and the daemon ------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_METRIC = re.compile(r"^(llamacpp:\w+)\s+(\S+)$", re.MULTILINE)


async def server_counts(client: httpx.AsyncClient, server: LlamaServer) -> ServerCounts:
    values = {name: float(value) for name, value in _METRIC.findall((await client.get(server.url + "/metrics")).text)}
    return ServerCounts(values.get("llamacpp:prompt_tokens_total", 0.0),
                        values.get("llamacpp:prompt_tokens_cached_total", 0.0),
                        values.get("llamacpp:tokens_predicted_total", 0.0))


async def warm_up(client: httpx.AsyncClient, server: LlamaServer, slots: int) -> None:
    """One short request per slot, all at once, straight to the server: a slot's first request is slow."""
    body = {"model": ALIAS, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2}

    async def one() -> None:
        (await client.post(server.url + "/v1/chat/completions", json=body)).raise_for_status()

    async with trio.open_nursery() as nursery:
        for _ in range(slots):
            nursery.start_soon(one)


def daemon_config(policy: str, servers: Sequence[LlamaServer], w: Workload, port: int) -> str:
    backends = "".join(f"""
[[backends]]
name = "s{i}"
url = "{server.url}"
max_concurrency = {w.slots}
cache_tokens = {w.slots * SLOT_CTX}
""" for i, server in enumerate(servers))
    routing = f'[routing]\npolicy = "{policy}"\n'   # (always named: the default is prefix)
    return f"""
[server]
host = "127.0.0.1"
port = {port}
[policy]
preset = "fifo"
[policy.fixed]
window_ms = 0.0
[tenants.{TENANT}]
rate = 1e9
burst = 1000000000
[forward]
health_interval_s = 0.5
metrics_interval_s = 0.25
first_token_timeout_s = 120.0
{routing}{backends}"""


async def wait_backends_up(client: httpx.AsyncClient, url: str, n: int, process: trio.Process, log: Path) -> None:
    """Until apsd's /metrics says all ``n`` backends are up (at most 30 s)."""
    with trio.move_on_after(30):
        for _ in range(300):
            if process.poll() is not None:
                raise RuntimeError(f"apsd exited with {process.returncode}:\n{log.read_text()[-3000:]}")
            try:
                text = (await client.get(url + "/metrics")).text
            except httpx.HTTPError:
                text = ""
            if len(re.findall(r'^apsd_backend_up\{backend="s\d+"\} 1(\.0)?$', text, re.MULTILINE)) == n:
                return
            await trio.sleep(0.1)
    raise RuntimeError(f"apsd's backends were not all up within 30 s:\n{log.read_text()[-3000:]}")


async def run_policy(policy: str, w: Workload, model: Path, binary: str, logs: Path) -> PolicyResult:
    """Fresh servers (cold caches), a daemon with ``policy`` in front of them, the workload through it."""
    async with AsyncExitStack() as stack, httpx.AsyncClient(timeout=60, limits=FRESH_CONNECTIONS) as client:
        servers = [await stack.enter_async_context(open_llama_server(
            model, alias=ALIAS, binary=binary, parallel=w.slots, ctx=w.slots * SLOT_CTX,
            extra_args=SERVER_ARGS, log_dir=logs)) for _ in range(w.servers)]
        for server in servers:
            await warm_up(client, server, w.slots)
        port = free_port()
        config = logs / f"apsd-{policy}.toml"
        config.write_text(daemon_config(policy, servers, w, port))
        log_path = logs / f"apsd-{policy}.log"
        with open(log_path, "wb") as log:
            process = await trio.lowlevel.open_process(
                [APSD, str(config)], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "APSD_PLUGINS": "", "PYTHONUNBUFFERED": "1"})
        try:
            url = f"http://127.0.0.1:{port}"
            await wait_backends_up(client, url, len(servers), process, log_path)
            before = [await server_counts(client, s) for s in servers]
            started = time.perf_counter()
            records, errors = await run_workload(url, w)
            seconds = time.perf_counter() - started
            after = [await server_counts(client, s) for s in servers]
        finally:
            await stop_process(process)
    return PolicyResult(policy, records, errors, [a - b for a, b in zip(after, before)], seconds)


# -- the report ------------------------------------------------------------------------------------------


def table(results: Sequence[PolicyResult], w: Workload) -> str:
    lines = [("| policy | requests | TTFT mean (ms) | p50 (ms) | p90 (ms) | hit rate (timings) | hit rate (/metrics) "
              "| split over servers | later turns moved | routing reasons | seconds |"),
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|"]
    for r in results:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons().items()))
        moved, later = r.moved()
        lines.append(f"| {r.policy} | {len(r.records)} | {r.ttft():.0f} | {r.ttft(50):.0f} | {r.ttft(90):.0f} | "
                     f"{r.hit_rate:.1%} | {r.metrics_hit_rate:.1%} | {' / '.join(map(str, r.split(w.max_tokens)))} "
                     f"| {moved}/{later} | {reasons} | {r.seconds:.0f} |")
    return "\n".join(lines)


def ratios(results: Sequence[PolicyResult]) -> str:
    by = {r.policy: r for r in results}
    base = by.get("least-loaded")
    if base is None:
        return ""
    out = []
    for r in results:
        if r is base:
            continue
        out.append(f"{r.policy} vs least-loaded: TTFT mean x{r.ttft() / base.ttft():.2f}, "
                   f"p50 x{r.ttft(50) / base.ttft(50):.2f}, p90 x{r.ttft(90) / base.ttft(90):.2f}; "
                   f"hit rate {r.hit_rate:.1%} vs {base.hit_rate:.1%} (x{r.hit_rate / base.hit_rate:.2f})")
    return "\n".join(out)


async def run(policies: Sequence[str], w: Workload, logs: Path) -> list[PolicyResult]:
    """Each policy in turn against fresh servers; prints each row as it comes."""
    binary = find_llama_server()
    if binary is None:
        raise SystemExit("no llama-server: build it with .ci/build-llama-server or set APSD_LLAMA_SERVER")
    model = write_tiny_model(logs / "routed.gguf", **MODEL, context_length=SLOT_CTX * w.slots)
    results = []
    for policy in policies:
        results.append(await run_policy(policy, w, model, binary, logs))
        print(f"  {policy}: {len(results[-1].records)} requests in {results[-1].seconds:.0f} s", flush=True)
        for error in results[-1].errors[:5]:
            print(f"  {policy}: {error}", file=sys.stderr)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller workload (under a minute)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), metavar="POLICY")
    parser.add_argument("--servers", type=int)
    parser.add_argument("--conversations", type=int)
    parser.add_argument("--turns", type=int)
    parser.add_argument("--in-flight", type=int)
    parser.add_argument("--logs", type=Path, help="keep the servers' and daemons' logs and configs here")
    args = parser.parse_args(argv)
    w = QUICK if args.quick else DEFAULT
    w = attrs.evolve(w, **{k: v for k, v in (("servers", args.servers), ("conversations", args.conversations),
                                             ("turns", args.turns), ("in_flight", args.in_flight)) if v is not None})
    print(f"{w.servers} llama-servers ({' '.join(SERVER_ARGS)}, -np {w.slots}, -c {w.slots * SLOT_CTX}, model "
          f"{MODEL}); {w.conversations} conversations x {w.turns} turns, {w.in_flight} at once, "
          f"system prompts of {w.system_words} words, {w.max_tokens} tokens an answer\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="apsd-bench-routing-") as own:
        logs = args.logs or Path(own)
        logs.mkdir(parents=True, exist_ok=True)
        results = trio.run(run, args.policies, w, logs)
    print(table(results, w))
    if line := ratios(results):
        print("\n" + line)
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
