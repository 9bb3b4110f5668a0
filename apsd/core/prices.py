"""Prices: what a request's tokens cost its tenant in US dollars, by the ``[prices]`` of its model.

A plain value (the config's table, swapped whole by a reload): no I/O, no clock. A model is priced
by its own ``[prices.<model>]`` table, else by ``[prices."*"]``; a request that names no model
(``POST /infer``) by the table of the one model its engines serve, else ``"*"``. A request is charged:

    spend_usd = ((prompt - cached) * input + cached * cached_input + output * output_price) / 10^6

where ``prompt`` counts only once the prompt was used (:attr:`~apsd.core.models.InferenceRequest.prompt_used`,
the same rule as the tokens it is charged: :func:`apsd.core.ledger.billed_tokens`), ``cached`` is the
part of it a backend found in its prefix cache, and prices are per million tokens. What a dollar
budget reserves at admission is the same sum over the request's reservation (its prompt estimate, no
part of it cached, and the output it reserves), in micro-dollars (:data:`apsd.core.budget.MICRO`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import attrs

from apsd.core.config import ANY_MODEL, PriceConfig
from apsd.core.models import InferenceRequest

__all__ = ["Prices"]


@attrs.define(eq=False)
class Prices:
    """The price table in force, and the model a request without one is priced as."""

    table: Mapping[str, PriceConfig] = attrs.field(factory=dict)
    #: The model a request naming none runs as (None: the engines serve several, or none yet).
    default_model: Callable[[], str | None] = lambda: None

    def of(self, model: str | None) -> PriceConfig | None:
        """The price of ``model`` (None: it has none, and there is no ``"*"`` entry)."""
        if model is None:
            model = self.default_model()
        price = self.table.get(model) if model is not None else None
        return price if price is not None else self.table.get(ANY_MODEL)

    def model_name(self, model: str | None) -> str:
        """The model a request is priced as, for messages."""
        if model is None:
            model = self.default_model()
        return model if model is not None else "(none named)"

    def reserve_micro_usd(self, request: InferenceRequest, prompt: int, output: int) -> int | None:
        """Micro-dollars a request reserves for ``prompt`` prompt tokens and ``output`` output tokens
        (None: its model has no price)."""
        price = self.of(request.model)
        if price is None:
            return None
        return math.ceil(prompt * price.input_per_1m_usd + output * price.output_per_1m_usd)

    def spend_usd(self, request: InferenceRequest) -> float | None:
        """What ``request`` cost its tenant so far, in dollars (None: its model has no price)."""
        price = self.of(request.model)
        if price is None:
            return None
        prompt = request.prompt_tokens if request.prompt_used else 0
        cached = min(request.cached_tokens, prompt)
        return ((prompt - cached) * price.input_per_1m_usd + cached * price.cached_input
                + request.tokens_generated * price.output_per_1m_usd) / 1e6
