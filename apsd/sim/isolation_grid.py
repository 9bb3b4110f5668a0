"""The isolation grid: a steady tenant beside a same-bid flood, over the range of workloads
and engine limits the isolation claim must hold on.

Each cell is one shape of contention: the flood's rate (a multiple of what the engine can serve
of its requests), both tenants' prompt length, the flood's output length, and how many requests
the steady tenant keeps running. Three runs measure it, on the same engine and policies:

- the steady tenant **alone** (the flood's rate 0: the very same steady arrivals);
- the flood **solo** (the steady tenant sends one request, at t = 0);
- **both**;

and the cell reports the steady tenant's p99 time to first token both / alone (the isolation
ratio), the flood's throughput both / solo, and the engine's useful work both / solo (what
isolating them costs: the steady tenant's own requests take their part of the engine, so the
flood's throughput alone cannot tell waste from sharing). Work weighs each token by what it costs a
full engine: a prompt token the marginal seconds of a prefill chunk, an output token a full batch's
decode step over its sequences (:func:`_token_costs`). Which of the engine's
limits binds the flood (sequences, KV cache, or the step's prefill tokens) is named per cell.

The flood is open-loop and overloads the engine, so its queue would grow without end: every run
gives queued requests :data:`QUEUE_TIMEOUT_S` (a client's patience) and measures throughput as
the output tokens of flood requests finished by the end of the arrivals.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import attrs
import numpy as np

from apsd.core.config import Config
from apsd.engines import deployment_for
from apsd.engines.continuous import prefill_chunk_for
from apsd.engines.roofline import Deployment
from apsd.sim.records import PolicyRun
from apsd.sim.runner import parse_policy_choice, run_policy
from apsd.sim.workloads import build_workload

__all__ = ["AXES", "CELLS", "CellResult", "GridCell", "cell_runs", "engine_limit", "heat_map", "measure_cell", "measure_runs", "sweep"]

#: The flood's rate, as a multiple of what the engine serves of its requests.
FLOOD_LOADS = (2.0, 10.0, 50.0)
#: Both tenants' prompt tokens.
PROMPTS = (64, 512, 4096)
#: The flood's output tokens.
OUTPUTS = (64, 512, 2048)
#: Requests the steady tenant keeps running (it sends them at the rate that keeps about this many
#: in flight alone).
CONCURRENCIES = (1, 10, 30)
#: The most the steady tenant asks of the engine: this share of what a full engine serves of its requests.
STEADY_LOAD = 0.25
#: The steady tenant's output tokens.
STEADY_OUTPUT_TOKENS = 128
#: Model seconds of arrivals per run.
DURATION_S = 20.0
#: Longest a request waits in the queue in the grid's runs (``[queue] timeout_s``).
QUEUE_TIMEOUT_S = 10.0
#: The isolation claim: the steady tenant's p99 TTFT beside the flood at most this many times alone ...
RATIO_GOAL = 2.0
#: ... at this share of the flood's solo throughput or more.
THROUGHPUT_GOAL = 0.9

AXES = {"flood load (x capacity)": FLOOD_LOADS, "prompt tokens": PROMPTS, "flood output tokens": OUTPUTS,
        "steady concurrency": CONCURRENCIES}


@attrs.frozen
class GridCell:
    flood_load: float
    prompt_tokens: int
    output_tokens: int
    steady_concurrency: int

    def label(self) -> str:
        return (f"{self.flood_load:g}x, {self.prompt_tokens} in, {self.output_tokens} out, "
                f"{self.steady_concurrency} steady")


#: The full factorial grid: every combination of the axes (81 cells).
CELLS = tuple(GridCell(load, prompt, output, concurrency) for load in FLOOD_LOADS for prompt in PROMPTS
              for output in OUTPUTS for concurrency in CONCURRENCIES)


@attrs.frozen
class CellResult:
    cell: GridCell
    #: The engine limit that binds the flood: "sequences", "KV cache" or "step tokens".
    limit: str
    steady_alone_p99_ms: float
    steady_both_p99_ms: float
    flood_solo_tokens_per_s: float
    flood_both_tokens_per_s: float
    #: The steady tenant's output tokens/s beside the flood.
    steady_both_tokens_per_s: float
    #: Engine work done per second (:func:`_work_per_s`): by the flood alone, and by both tenants.
    solo_work: float
    both_work: float

    @property
    def ratio(self) -> float:
        return self.steady_both_p99_ms / self.steady_alone_p99_ms

    @property
    def flood_kept(self) -> float:
        """The flood's throughput beside the steady tenant over its throughput alone."""
        return self.flood_both_tokens_per_s / self.flood_solo_tokens_per_s if self.flood_solo_tokens_per_s else math.nan

    @property
    def work_kept(self) -> float:
        """The engine's useful work with both tenants over the flood's alone (which fills the engine):
        below 1 by what isolating them wastes."""
        return self.both_work / self.solo_work if self.solo_work else math.nan

    @property
    def holds(self) -> bool:
        return self.ratio <= RATIO_GOAL and self.work_kept >= THROUGHPUT_GOAL


def engine_limit(deployment: Deployment, config: Config, prompt: int, output: int) -> tuple[str, float]:
    """(The limit that binds a flood of ``prompt``/``output`` requests, the requests/s a full engine serves.)

    The flood runs as many sequences as the KV cache holds or ``max_sequences``, whichever is
    fewer; each step decodes them all and prefills the rest of the step's tokens. Its rate is
    bounded by the decode steps (``sequences / output`` requests per step) and by the prefill
    tokens per step (``tokens_left / prompt``); the lower one binds, and between the sequences
    and the KV cache, the one that set the count."""
    engine = config.engine
    by_kv = deployment.kv_capacity_tokens // (prompt + output)
    sequences = max(1, min(engine.max_sequences, by_kv))
    context = sequences * (prompt + output // 2)
    chunk = engine.prefill_chunk_tokens or prefill_chunk_for(deployment, engine.max_batched_tokens)
    chunk = max(1, min(engine.max_batched_tokens - sequences, chunk if engine.isolation else engine.max_batched_tokens))
    step = deployment.step_s([(chunk, prompt // 2)], sequences, context)
    per_step = min(sequences / output, chunk / prompt)
    if chunk / prompt < sequences / output:
        limit = "step tokens"
    else:
        limit = "KV cache" if by_kv < engine.max_sequences else "sequences"
    return limit, per_step / step


def _steady_rate(deployment: Deployment, config: Config, prompt: int, concurrency: int) -> float:
    """Requests/s that keep about ``concurrency`` of the steady tenant's requests running alone, at
    most ``STEADY_LOAD`` of what a full engine serves of them (a tenant within its share)."""
    latency = (deployment.step_s([(prompt, 0)], 0, 0)
               + STEADY_OUTPUT_TOKENS * deployment.step_s((), concurrency, concurrency * (prompt + 64)))
    _, capacity = engine_limit(deployment, config, prompt, STEADY_OUTPUT_TOKENS)
    return min(concurrency / latency, STEADY_LOAD * capacity)


def _run(config: Config, preset: str, seed: int, **params: float) -> PolicyRun:
    return run_policy(build_workload("noisy-neighbor", params, seed), parse_policy_choice(preset),
                      base_config=config)


def _p99_ttft_ms(run: PolicyRun) -> float:
    ttfts = [r.ttft for r in run.requests if r.tenant == "steady" and r.ttft is not None]
    return float(np.percentile(ttfts, 99)) * 1000 if ttfts else math.inf


def _token_costs(deployment: Deployment, config: Config) -> tuple[float, float]:
    """(Seconds per prompt token, seconds per output token) of a full engine: the cost a 512-token chunk
    adds to a step of ``max_sequences`` decodes at 512 tokens of context each, and that step over them."""
    n = config.engine.max_sequences
    context = min(n * 512, deployment.kv_capacity_tokens)
    decode = deployment.step_s((), n, context)
    return (deployment.step_s([(512, 0)], n, context) - decode) / 512, decode / n


def _work_per_s(run: PolicyRun, costs: tuple[float, float]) -> float:
    """Engine seconds of useful work per second of arrivals: both tenants' prompt and output tokens
    produced by their end (:func:`_tokens_per_s`), weighed by ``costs``."""
    prompt_cost, output_cost = costs
    prompts = sum(r.prompt_tokens for r in run.requests if r.started_at is not None and r.started_at <= DURATION_S)
    outputs = sum(_tokens_per_s(run, tenant) for tenant in ("steady", "neighbor")) * DURATION_S
    return (prompts * prompt_cost + outputs * output_cost) / DURATION_S


def _tokens_per_s(run: PolicyRun, tenant: str) -> float:
    """``tenant``'s output tokens produced by the end of the arrivals, per second: a request still running
    then counts the share of its tokens its first-to-last-token span had covered."""
    served = 0.0
    for r in run.requests:
        if r.tenant != tenant or r.started_at is None or r.started_at > DURATION_S:
            continue
        end = r.finished_at if r.finished_at is not None else math.inf
        generated = r.output_tokens if r.outcome == "completed" else 0
        if not generated:
            continue
        if end <= DURATION_S or end == r.started_at:
            served += generated
        else:
            served += 1 + (generated - 1) * (DURATION_S - r.started_at) / (end - r.started_at)
    return served / DURATION_S


def grid_config(config: Config) -> Config:
    """``config`` with the grid's queue timeout."""
    return attrs.evolve(config, queue=attrs.evolve(config.queue, timeout_s=QUEUE_TIMEOUT_S))


def cell_runs(config: Config, preset: str, cell: GridCell, seed: int = 0) -> tuple[str, PolicyRun, PolicyRun, PolicyRun]:
    """(The limit binding the flood, and the cell's runs: the steady tenant alone, the flood solo, both.)"""
    config = grid_config(config)
    deployment = deployment_for(config)
    limit, capacity = engine_limit(deployment, config, cell.prompt_tokens, cell.output_tokens)
    params = {"duration": DURATION_S, "steady_rate": _steady_rate(deployment, config, cell.prompt_tokens,
                                                                  cell.steady_concurrency),
              "steady_prompt_tokens": cell.prompt_tokens, "steady_output_tokens": STEADY_OUTPUT_TOKENS,
              "neighbor_rate": cell.flood_load * capacity, "neighbor_prompt_tokens": cell.prompt_tokens,
              "neighbor_output_tokens": cell.output_tokens}
    alone = _run(config, preset, seed, **{**params, "neighbor_rate": 0.0})
    solo = _run(config, preset, seed, **{**params, "steady_rate": 1.0 / (2 * DURATION_S)})
    both = _run(config, preset, seed, **params)
    return limit, alone, solo, both


def measure_cell(config: Config, preset: str, cell: GridCell, seed: int = 0) -> CellResult:
    """The cell's three runs under ``preset`` on ``config``'s engine (a continuous one), measured."""
    return measure_runs(config, cell, *cell_runs(config, preset, cell, seed))


def measure_runs(config: Config, cell: GridCell, limit: str, alone: PolicyRun, solo: PolicyRun,
                 both: PolicyRun) -> CellResult:
    """The figures of a cell's runs (:func:`cell_runs`)."""
    costs = _token_costs(deployment_for(config), config)
    return CellResult(cell, limit, _p99_ttft_ms(alone), _p99_ttft_ms(both), _tokens_per_s(solo, "neighbor"),
                      _tokens_per_s(both, "neighbor"), _tokens_per_s(both, "steady"),
                      _work_per_s(solo, costs), _work_per_s(both, costs))


def sweep(config: Config, presets: Sequence[str], cells: Iterable[GridCell] = CELLS, seed: int = 0,
          progress: Callable[[str, CellResult], None] | None = None) -> dict[str, list[CellResult]]:
    """Every cell under every preset."""
    results: dict[str, list[CellResult]] = {}
    cells = list(cells)
    for preset in presets:
        for cell in cells:
            result = measure_cell(config, preset, cell, seed)
            results.setdefault(preset, []).append(result)
            if progress is not None:
                progress(preset, result)
    return results


def heat_map(results: Sequence[CellResult]) -> str:
    """One preset's results as a text heat map: a block per flood load, prompt x output rows, a column
    per steady concurrency; each cell ``ratio / work kept / limit`` and a mark where the claim fails."""
    by_cell = {r.cell: r for r in results}
    lines = []
    for load in FLOOD_LOADS:
        lines.append(f"flood at {load:g}x capacity: steady p99 TTFT both/alone, engine work both/flood solo "
                     f"(! where ratio > {RATIO_GOAL:g} or work < {THROUGHPUT_GOAL:.0%})")
        lines.append(f"  {'prompt/output':<16}" + "".join(f"{f'{c} steady':>22}" for c in CONCURRENCIES))
        for prompt in PROMPTS:
            for output in OUTPUTS:
                row = []
                for concurrency in CONCURRENCIES:
                    r = by_cell.get(GridCell(load, prompt, output, concurrency))
                    row.append(" " * 22 if r is None else
                               f"{'!' if not r.holds else ' '}{r.ratio:5.2f}x {r.work_kept:5.0%} "
                               f"{_limit_mark(r.limit)}".rjust(22))
                lines.append(f"  {f'{prompt}/{output}':<16}" + "".join(row))
        lines.append("")
    lines.append("limits: S sequences, K KV cache, T step tokens")
    return "\n".join(lines)


def _limit_mark(limit: str) -> str:
    return {"sequences": "S", "KV cache": "K", "step tokens": "T"}[limit]
