"""A Mooncake-format trace with the structure of the published ones, generated (``apsd research`` and
the benchmarks use it: the published traces cannot be downloaded where apsd is built and tested).

What it imitates (Mooncake's conversation trace, FAST '25: about 12,000 requests in an hour, a mean
prompt of about 12,000 tokens and a mean output of about 340): most requests are turns of
conversations, each turn's prompt the conversation so far (a system prompt, the earlier questions and
answers, a new question), so a conversation's next turn repeats the block ids of the turn before; the
system prompts are shared between conversations with a Zipf popularity (a common first id, as an
application's prompt shows in the real traces); the rest are one-off requests over documents of their
own, which nothing else shares. Block ids are integers numbered in order of first use, as the published
traces number theirs; a prompt's last block is partial (its id is its own).

What it does not claim to be: any real trace. Sizes are lognormal, conversation starts Poisson, the
time between a conversation's turns its answer's decoding plus an exponential think time; the
parameters below are chosen to land near the published means, not fitted to a trace.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, overload

import attrs
import numpy as np
from numpy.typing import NDArray

__all__ = ["MooncakeShape", "write_mooncake_trace"]


@attrs.frozen
class MooncakeShape:
    """The generator's parameters (defaults: close to Mooncake's conversation trace)."""

    requests: int = 12_000
    #: Mean arrivals per second over the trace (12,000 in an hour).
    rate: float = 12_000 / 3600
    block_tokens: int = 512
    #: Shared system prompts, their popularity Zipf with this exponent, their mean length.
    system_prompts: int = 64
    zipf: float = 1.1
    system_tokens: float = 7_500.0
    #: Turns per conversation (geometric, this mean), tokens per question, per answer (the output).
    turns: float = 5.0
    question_tokens: float = 600.0
    answer_tokens: float = 340.0
    #: Mean seconds a user thinks between an answer and the next question.
    think_s: float = 30.0
    #: The share of requests that are one-off documents (nothing shared), and their mean prompt.
    one_off_share: float = 0.2
    one_off_tokens: float = 12_000.0
    #: The largest prompt (a model's context).
    max_prompt_tokens: int = 30_000


@overload
def _lognormal(rng: np.random.Generator, mean: float, size: None = None, sigma: float = 0.6) -> float: ...
@overload
def _lognormal(rng: np.random.Generator, mean: float, size: int, sigma: float = 0.6) -> NDArray[np.float64]: ...
def _lognormal(rng: np.random.Generator, mean: float, size: int | None = None,
               sigma: float = 0.6) -> float | NDArray[np.float64]:
    """Draws of mean ``mean``: one (a float), or ``size`` of them."""
    return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, size)


def write_mooncake_trace(path: str | Path, shape: MooncakeShape = MooncakeShape(), seed: int = 1) -> Path:
    """Write ``shape.requests`` requests to ``path`` (JSON lines, sorted by timestamp); same shape and
    seed, same bytes. Memory grows with the request count (the requests are sorted before writing)."""
    rng = np.random.default_rng(seed)
    ids: dict[tuple[object, ...], int] = {}
    size = shape.block_tokens

    def block_id(key: tuple[object, ...]) -> int:
        return ids.setdefault(key, len(ids))

    system_lengths = np.maximum(size, _lognormal(rng, shape.system_tokens, shape.system_prompts)).astype(int)
    weights = 1.0 / np.arange(1, shape.system_prompts + 1) ** shape.zipf
    weights /= weights.sum()
    requests: list[tuple[float, int, dict[str, Any]]] = []
    one_offs = round(shape.requests * shape.one_off_share)
    conversation_rate = (shape.rate - shape.rate * shape.one_off_share) / shape.turns
    session = 0
    t = 0.0
    while len(requests) < shape.requests - one_offs:  # conversations, started as a Poisson process
        t += rng.exponential(1 / conversation_rate)
        session += 1
        system = int(rng.choice(shape.system_prompts, p=weights))
        history = int(system_lengths[system])
        at = t
        for turn in range(int(rng.geometric(1 / shape.turns))):
            question = max(1, int(_lognormal(rng, shape.question_tokens)))
            answer = max(1, int(_lognormal(rng, shape.answer_tokens)))
            prompt = history + question
            if prompt > shape.max_prompt_tokens:
                break
            blocks = []
            for i in range(math.ceil(prompt / size)):
                if (i + 1) * size <= system_lengths[system]:
                    blocks.append(block_id(("system", system, i)))
                elif (i + 1) * size <= prompt:
                    blocks.append(block_id(("conversation", session, i)))
                else:
                    blocks.append(block_id(("last", session, turn, i)))
            requests.append((at, len(requests), {"timestamp": int(at * 1000), "input_length": prompt,
                                                 "output_length": answer, "hash_ids": blocks}))
            history = prompt + answer
            at += answer * 0.03 + rng.exponential(shape.think_s)
    for n, at in enumerate(np.sort(rng.uniform(0, t, one_offs))):  # one-off documents, over the same span
        prompt = int(min(shape.max_prompt_tokens, max(1, _lognormal(rng, shape.one_off_tokens))))
        answer = max(1, int(_lognormal(rng, shape.answer_tokens)))
        blocks = [block_id(("document", n, i)) for i in range(math.ceil(prompt / size))]
        requests.append((float(at), len(requests), {"timestamp": int(at * 1000), "input_length": prompt,
                                                    "output_length": answer, "hash_ids": blocks}))
    requests.sort(key=lambda r: (r[2]["timestamp"], r[1]))
    path = Path(path)
    with path.open("w", encoding="utf-8") as file:
        for _, _, record in requests[:shape.requests]:
            file.write(json.dumps(record, separators=(",", ":")) + "\n")
    return path
