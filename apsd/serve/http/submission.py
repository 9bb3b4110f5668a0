"""Submitting a checked request of the ``/v1`` API and answering it: the part the OpenAI and Anthropic
protocols share once each has read its body (:mod:`apsd.serve.http.openai`, :mod:`apsd.serve.http.anthropic`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from apsd.core.models import Completion, InferenceRequest, Refusal
from apsd.core.streams import TokenStream
from apsd.serve.http.common import HeaderFields, HttpState, begin_trace, finish_trace, outcome_or_cancel
from apsd.serve.http.exchange import Answer

__all__ = ["answer_submitted"]


async def answer_submitted(state: HttpState, inference: InferenceRequest, headers: HeaderFields, *, stream: bool,
                           refused: Callable[[Refusal], Answer],
                           streamed: Callable[[], Awaitable[Answer]],
                           whole: Callable[[Completion], Answer]) -> Answer:
    """Trace, submit and answer ``inference`` (an OpenAI or Anthropic request, its body checked, sent with
    ``headers``): its refusal (``refused``), its event stream (``streamed``: a 200 whose last event ends
    the trace), or its whole answer (``whole``); a client that leaves cancels it. The trace ends with
    the answer, or with the stream's last event (:func:`~apsd.serve.http.common.begin_trace`,
    :func:`~apsd.serve.http.common.finish_trace`)."""
    pipeline = state.pipeline
    begin_trace(state, inference, headers)
    streams = False
    refusal = None
    try:
        if stream:
            inference.stream = TokenStream()
        refusal = pipeline.submit_nowait(inference)
        if refusal is not None:
            return refused(refusal)
        if stream:
            answer = await streamed()
            streams = answer.stream is not None
            return answer
        outcome = await outcome_or_cancel(pipeline, inference)
        return refused(outcome) if isinstance(outcome, Refusal) else whole(outcome)
    finally:
        if not streams:
            finish_trace(inference, refusal)
