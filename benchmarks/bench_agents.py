"""Claude-Code-shaped traffic against a default tenant: admitted, and held to ``burst + rate·T``.

A coding agent fans out into 8 sub-agent streams that each send chat requests one after another,
with ``max_tokens`` 32,000 (what Claude Code asks for), a 6,000-character system prompt and an answer
whose length is drawn from a log-normal (median 400 tokens, a few thousand at most). It runs on one
tenant with the default ``tenant_a``'s contract (rate 500 tokens/s, burst 5,000), in front of a
simulated server (the forward engine's own code, ``SimulatedServer``: 16 slots, 0.3 s to the first
token, 50 tokens/s a stream), in virtual time, for ``--duration`` model seconds. A stream refused 429
waits its ``Retry-After`` and sends again; one refused 413 gives up.

It runs the same traffic (the same seed) three ways:

- **413 above the burst**: ``max_request_tokens`` = the burst, which refuses what apsd refused
  before reservations fit agents (a request whose prompt + ``max_tokens`` passed the burst: "it could
  never be admitted");
- **worst-case reservations**: ``output_estimate_tokens`` = 32,000: every request reserves its whole
  ``max_tokens`` (capped at the burst), so one runs at a time;
- **probable-use reservations** (the default): the smaller of ``max_tokens`` and the tenant's learned
  estimate (the 90th percentile of its recent answers; 1,024 before it has ten).

and prints, per way: requests sent, completed and refused; the streams in flight on average; the
backend's work W(T) (prompts at the simulated tokenizer's count from their first token, and every
output token the server sent, counted by a wrapper around the server, not by apsd) against the
allowance A(T) = burst + rate·T at the end; the largest excess W(t) − A(t) at any moment and, for
comparison, the largest answer; and the largest excess at a moment with nothing in flight (which
the bound says is at most the tenant's debt then).

How to run (from the repository root; not collected by pytest)::

    .venv/bin/python benchmarks/bench_agents.py                  # 600 model seconds, a few seconds
    .venv/bin/python benchmarks/bench_agents.py --duration 3600 --seed 7
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import attrs
import trio
import trio.testing

from apsd.core.clock import ModelClock
from apsd.core.config import TenantConfig, parse_config
from apsd.core.models import Completion, Refusal
from apsd.core.streams import TokenStream
from apsd.engines.backends import (
    Backend,
    BackendAnswer,
    BackendChunk,
    OnChunk,
    SimulatedBackendClient,
    SimulatedServer,
    _simulated_prompt_tokens,
)
from apsd.pipeline import open_pipeline
from apsd.serve.http.openai import CHAT, parse_openai_body
from tests.helpers import build_policies

MODEL = "claude-shaped"
RATE, BURST = 500.0, 5000
STREAMS = 8
MAX_TOKENS = 32_000
SYSTEM_PROMPT = "You are a coding agent. Read the files, plan, then edit with care. " * 90  # ~6,000 characters


@attrs.define(eq=False)
class MeasuredClient(SimulatedBackendClient):
    """The simulated server, generating each request's drawn answer length (at most its limit), and
    counting the work it does: a prompt at its first token, each output token as it is sent."""

    lengths: dict[str, int] = attrs.field(factory=dict)
    work: float = 0.0
    #: (model time, work so far) after each change.
    timeline: list[tuple[float, float]] = attrs.field(factory=list)

    async def complete(self, backend: Backend, api: str, body: dict, on_chunk: OnChunk,
                       request_id: str = "", traceparent: str = "") -> BackendAnswer:
        limit = int(body.get("max_tokens") or MAX_TOKENS)
        sent_body = dict(body, max_tokens=min(limit, self.lengths[request_id]))
        started = False
        prompt = _simulated_prompt_tokens(body)

        def counted(chunk: BackendChunk) -> None:
            nonlocal started
            if chunk.tokens:
                self.work += chunk.tokens + (0 if started else prompt)
                started = True
                self.timeline.append((self.clock.now(), self.work))
            on_chunk(chunk)

        return await super().complete(backend, api, sent_body, counted, request_id)


@attrs.define
class Outcomes:
    sent: int = 0
    completed: int = 0
    refused_413: int = 0
    refused_429: int = 0
    largest_answer: int = 0
    #: (model time, requests in flight) after each change.
    in_flight: list[tuple[float, int]] = attrs.field(factory=list)
    running: int = 0


async def run_way(tenant: TenantConfig, duration: float, seed: int) -> tuple[Outcomes, MeasuredClient]:
    config = parse_config({
        "policy": {"preset": "fair"},
        "backends": [{"url": "http://sim.test", "name": "sim", "models": [MODEL], "max_concurrency": 16}],
        "forward": {"health_interval_s": 1.0, "metrics_interval_s": 0.5},
    }, "<bench>")
    config = attrs.evolve(config, tenants={"agent": tenant})
    server = SimulatedServer(models=(MODEL,), slots=16, ttft_s=0.3, tpot_s=0.02)
    client = MeasuredClient(ModelClock(), {"sim": server})
    outcomes = Outcomes()
    rng = random.Random(seed)
    async with open_pipeline(config, build_policies(config), backend_client=client) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        await pipeline.clock.sleep(0.01)
        end = pipeline.clock.now() + duration

        async def stream(number: int) -> None:
            turn = 0
            while pipeline.clock.now() < end:
                turn += 1
                raw = json.dumps({"model": MODEL, "max_tokens": MAX_TOKENS, "stream": True,
                                  "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                                               {"role": "user", "content": f"sub-agent {number}, step {turn}"}]})
                body = parse_openai_body(raw.encode(), CHAT, pipeline.config)
                request = pipeline.new_request(tenant_id="agent", prompt=body.prompt, tokens_requested=body.max_tokens,
                                               priority_bid=5, prompt_tokens=body.prompt_tokens, model=MODEL,
                                               api=CHAT, payload=body.payload, request_id=f"s{number}-{turn}")
                request.stream = TokenStream()
                length = min(MAX_TOKENS, max(1, int(rng.lognormvariate(math.log(400), 1.0))))
                client.lengths[request.request_id] = length
                outcomes.sent += 1
                pipeline.submit_nowait(request)
                outcomes.running += 1
                outcomes.in_flight.append((pipeline.clock.now(), outcomes.running))
                async for _ in request.stream:
                    pass
                outcome = await request.reply.wait()
                outcomes.running -= 1
                outcomes.in_flight.append((pipeline.clock.now(), outcomes.running))
                if isinstance(outcome, Completion):
                    outcomes.completed += 1
                    outcomes.largest_answer = max(outcomes.largest_answer, outcome.tokens_generated)
                elif isinstance(outcome, Refusal) and outcome.status == 413:
                    outcomes.refused_413 += 1
                    return
                elif isinstance(outcome, Refusal) and outcome.status == 429:
                    outcomes.refused_429 += 1
                    await pipeline.clock.sleep(float(outcome.headers.get("Retry-After", "1")))

        async with trio.open_nursery() as nursery:
            for number in range(STREAMS):
                nursery.start_soon(stream, number)
        outcomes.in_flight.append((pipeline.clock.now(), 0))
        await pipeline.ledger.wait_idle()
    return outcomes, client


def summarize(name: str, tenant: TenantConfig, outcomes: Outcomes, client: MeasuredClient) -> str:
    timeline, flights = client.timeline, outcomes.in_flight
    end = max([t for t, _ in timeline] + [t for t, _ in flights] + [0.0])

    def allowance(t: float) -> float:
        return tenant.burst + tenant.rate * t

    excess = max((work - allowance(t) for t, work in timeline), default=0.0)
    # the work at moments with nothing in flight (between the streams' requests)
    idle_excess = -math.inf
    work_at = 0.0
    events = sorted([(t, 0, w) for t, w in timeline] + [(t, 1, n) for t, n in flights])
    for t, kind, value in events:
        if kind == 0:
            work_at = value
        elif value == 0:
            idle_excess = max(idle_excess, work_at - allowance(t))
    busy = sum((t2 - t1) * n for (t1, n), (t2, _) in zip(flights, flights[1:]))
    mean_in_flight = busy / end if end else 0.0
    work = client.work
    return (f"| {name} | {outcomes.sent} | {outcomes.completed} | {outcomes.refused_413} | {outcomes.refused_429} "
            f"| {mean_in_flight:.1f} | {work:,.0f} / {allowance(end):,.0f} ({work / allowance(end):.3f}) "
            f"| {excess:+,.0f} (largest answer {outcomes.largest_answer:,}) "
            f"| {'n/a' if idle_excess == -math.inf else f'{idle_excess:+,.0f}'} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="model seconds of traffic (default 600)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    ways = [("413 above the burst", TenantConfig(rate=RATE, burst=BURST, max_request_tokens=BURST)),
            ("worst-case reservations", TenantConfig(rate=RATE, burst=BURST, output_estimate_tokens=MAX_TOKENS)),
            ("probable-use reservations (default)", TenantConfig(rate=RATE, burst=BURST))]
    print(f"{STREAMS} sub-agent streams, max_tokens {MAX_TOKENS:,}, one tenant at rate {RATE:g} burst {BURST:,}, "
          f"{args.duration:g} model seconds, seed {args.seed}\n")
    print("| reservations | sent | completed | 413 | 429 | streams in flight (mean) | backend work W(T) / "
          "burst + rate·T | largest W(t) − A(t) | largest W − A with nothing in flight |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, tenant in ways:
        outcomes, client = trio.run(run_way, tenant, args.duration, args.seed,
                                    clock=trio.testing.MockClock(autojump_threshold=0))
        print(summarize(name, tenant, outcomes, client))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
