"""Streaming quality of experience as Andes defines it (Liu et al., "Andes: Defining and Enhancing
Quality-of-Experience in LLM-Based Text Streaming Services", arXiv 2404.16283, §3).

A user expects a response's first token within an *expected TTFT* and then tokens at an *expected
token delivery speed* (TDS: the pace at which they read, or listen): the *expected timeline* ``E(t)``,
the tokens they expect to have by time ``t`` after sending. What they get is the *actual timeline*,
but they cannot digest tokens faster than the expected pace (Andes' client buffers the excess), so
what counts is the digested timeline ``D(t)``: the tokens delivered, at most at the expected pace.
QoE compares the two areas up to ``T``, when both timelines have the whole response::

    QoE = ∫₀ᵀ min(D(t), E(t)) dt / ∫₀ᵀ E(t) dt

1 when the user is never behind the expected timeline; lower the longer and further behind; 0 for a
request that produced nothing (refused, failed, cancelled). The simulator knows each request's first
token and its end, not every token's time: its tokens after the first are taken as delivered evenly in
between (the mean time per output token), so ``D`` is a line from the first token at the slower of
that pace and the expected one. Timelines are exact piecewise-linear functions; the integral is exact.

The targets (:data:`EXPECTED_TTFT_S`, :data:`EXPECTED_TDS`) are ours, not the paper's workloads': a
chat reader expecting a first token within a second and reading about 5 tokens a second (some 200
words a minute).
"""

from __future__ import annotations

from collections.abc import Iterable

from apsd.sim.records import RequestRecord

__all__ = ["EXPECTED_TDS", "EXPECTED_TTFT_S", "QOE_DEFINITION", "mean_qoe", "qoe"]

#: The expected time to first token, model seconds.
EXPECTED_TTFT_S = 1.0
#: The expected token delivery speed (the reading pace), tokens per second.
EXPECTED_TDS = 5.0

QOE_DEFINITION = (
    f"Andes' streaming QoE (arXiv 2404.16283): the area under the tokens a user could have read by each "
    f"moment (delivered, at most at the reading pace) over the area under the expected timeline (a first "
    f"token within {EXPECTED_TTFT_S:g} s, then {EXPECTED_TDS:g} tokens/s), until both have the whole "
    f"response; 1 = never behind, 0 for a request that was not served; the mean over every request sent"
)


def _timeline(start: float, pace: float, tokens: int) -> tuple[float, float, float]:
    """A timeline: 0 before ``start``, then ``1 + pace * (t - start)`` up to ``tokens``; (start, pace, end)."""
    end = start if tokens <= 1 else start + (tokens - 1) / pace
    return start, pace, end


def _value(line: tuple[float, float, float], tokens: int, t: float, right: bool) -> float:
    """The timeline at ``t``: its limit from the right (``right``) or from the left."""
    start, pace, end = line
    if t < start or (t == start and not right):
        return 0.0
    if t >= end:
        return float(tokens)
    return 1.0 + pace * (t - start)


def _area(lines: list[tuple[float, float, float]], tokens: int, horizon: float) -> float:
    """∫₀^horizon of the least of ``lines`` (exact: linear between breakpoints, split where they cross)."""
    points = sorted({0.0, horizon, *(p for s, _, e in lines for p in (s, e) if 0.0 < p < horizon)})
    area = 0.0
    for a, b in zip(points, points[1:]):
        at_a = [_value(line, tokens, a, right=True) for line in lines]
        at_b = [_value(line, tokens, b, right=False) for line in lines]
        if len(lines) == 2:
            gap_a, gap_b = at_a[0] - at_a[1], at_b[0] - at_b[1]
            if gap_a * gap_b < 0:  # they cross inside: split there
                x = a + (b - a) * gap_a / (gap_a - gap_b)
                meet = at_a[0] + (at_b[0] - at_a[0]) * (x - a) / (b - a)
                area += (x - a) * (min(at_a) + meet) / 2 + (b - x) * (meet + min(at_b)) / 2
                continue
        area += (b - a) * (min(at_a) + min(at_b)) / 2
    return area


def qoe(record: RequestRecord, expected_ttft_s: float = EXPECTED_TTFT_S, expected_tds: float = EXPECTED_TDS) -> float:
    """The QoE of one request (the module docstring): 0 when it produced no first token."""
    if record.outcome != "completed" or record.ttft is None or record.latency is None:
        return 0.0
    tokens = max(1, record.output_tokens)
    delivered = (tokens - 1) / (record.latency - record.ttft) if tokens > 1 and record.latency > record.ttft \
        else expected_tds
    expected = _timeline(expected_ttft_s, expected_tds, tokens)
    digested = _timeline(record.ttft, min(delivered, expected_tds), tokens)
    horizon = max(expected[2], digested[2])
    whole = _area([expected], tokens, horizon)
    if whole <= 0:
        return 1.0
    return min(1.0, _area([digested, expected], tokens, horizon) / whole)


def mean_qoe(records: Iterable[RequestRecord], **targets: float) -> float | None:
    """The mean QoE over ``records`` (None: none)."""
    values = [qoe(r, **targets) for r in records]
    return sum(values) / len(values) if values else None
