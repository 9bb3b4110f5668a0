"""Gateway preemption: which running request gives its slot to a tenant below its share.

Real servers do not preempt for a gateway: llama.cpp never does, and vLLM's priority scheduling
only orders its own waiting queue (and picks victims under KV-cache pressure); neither stops a
running request to admit a waiting one. So the forward engine preempts for them. The rule, the
same as the ``continuous`` engine's isolation (:mod:`apsd.engines.continuous`), over the slots of
the backends that serve a request's model, counting every sender's leases (:mod:`apsd.core.slots`):

* **Shares.** With ``T`` tenants holding slots there (the newcomer included) and ``S`` slots, a tenant
  of weight ``w`` (``[tenants.<name>] weight``) out of the tenants' total ``W`` is entitled to
  ``S * w / W`` slots. It is *below its share* while it holds fewer, *above* while it holds more.
* **When.** A request whose tenant is below its share finds no free slot: one slot held by a tenant
  above its share is freed for it, if that tenant keeps at least as many slots per weight as the
  newcomer's tenant will hold (``(held_v - 1) / w_v >= (held_n + 1) / w_n``), so that the swap can
  never be undone by the same rule (no ping-pong: on a one-slot server a tenant waits for the request
  in progress).
* **Which** (:func:`choose_victim`): among the leases of tenants above their share that may be
  preempted (:func:`eligible`): one without a first token first (nothing is lost: it goes back to
  the queue at its place, uncharged); then the tenant furthest above its share (the largest
  ``held / w``); then, of its requests, the one preempted least often, and of those the newest run (so
  preemptions spread over a flood's streams instead of pausing one stream again and again). A started request is *resumed* later as a continuation of its
  own text (:mod:`apsd.engines.relay`): only a stream that can be continued safely is chosen
  (:func:`resumable`).
* **Service classes.** A classed request that can still meet its deadline, due sooner than
  ``preempt_min_run_s`` (a looser class is served by the slots that free and the share rule), first
  takes the slot of a
  request of its own tenant of a looser class (or none), or of its own class with its first token out
  already, whatever the shares and however short that request's run (the cap still holds): the tenant
  trades places with itself (as on the ``continuous`` engine), and a class's promise is its first token. Failing that, its tenant below its share preempts as above (looser classes first among the
  victims); at or above its share, it may *borrow* one slot beyond its share from a looser request of a
  tenant holding at least its share, which that tenant, below its share then, takes back by the rule
  above (from the borrower's loosest requests first). So a tenant holds at most one slot beyond its
  share for its tight class, and a tight request's first token does not wait for the tenant's own
  tight requests to end.
* **Churn is bounded** (``[forward] preempt_min_run_s``, ``max_preemptions``): a request is preempted
  at most that many times, and once it has been, its resumed run lasts that long before it can be again.

What it guarantees (docs/how-to/real-servers.md): while some slot of the model's backends is held by
a tenant above its share with an eligible request, a request of a tenant below its share is sent
within one cancellation round trip (plus, across replicas, one order through the store), and its
first token comes after the server's step in progress and its own prefill. When every such request
is a resumed run younger than ``preempt_min_run_s``, it waits at most until the oldest of them
reaches it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from apsd.core.models import InferenceRequest
from apsd.core.slots import Lease

__all__ = ["PreemptionRules", "Shares", "choose_victim", "eligible", "resumable"]


@attrs.frozen
class PreemptionRules:
    """``[forward] preempt``, ``preempt_min_run_s`` and ``max_preemptions``."""

    enabled: bool = True
    min_run_s: float = 1.0
    max_preemptions: int = 4


@attrs.define
class Shares:
    """Who holds the slots of a group of backends (those serving one model), and what each tenant is
    entitled to there."""

    slots: int
    held: collections.Counter[str]
    weights: Mapping[str, float]

    @classmethod
    def of(cls, leases: Sequence[Lease], slots: int, weights: Mapping[str, float]) -> Shares:
        return cls(slots, collections.Counter(lease.tenant for lease in leases), weights)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def _total_weight(self, newcomer: str | None) -> float:
        total = sum(self.weight(t) for t in self.held)
        if newcomer is not None and newcomer not in self.held:
            total += self.weight(newcomer)
        return total

    def below(self, tenant: str) -> bool:
        """Whether ``tenant`` holds fewer slots than its share (counting it among the tenants)."""
        return self.held[tenant] * self._total_weight(tenant) < self.slots * self.weight(tenant)

    def above(self, tenant: str, newcomer: str | None) -> bool:
        """Whether ``tenant`` holds more than its share once ``newcomer`` is counted among the tenants."""
        return self.held[tenant] * self._total_weight(newcomer) > self.slots * self.weight(tenant)

    def may_borrow(self, tenant: str) -> bool:
        """Whether ``tenant`` holds fewer than its share plus one slot: it may borrow one for a request of
        a tight service class."""
        total = self._total_weight(tenant)
        return self.held[tenant] * total < self.slots * self.weight(tenant) + total

    def lends(self, tenant: str, newcomer: str) -> bool:
        """Whether ``tenant`` holds at least its share once ``newcomer`` is counted among the tenants."""
        return self.held[tenant] * self._total_weight(newcomer) >= self.slots * self.weight(tenant)

    def yields_to(self, tenant: str, newcomer: str) -> bool:
        """Whether ``tenant`` may give one of its slots to ``newcomer``: it is above its share, and keeps
        at least as many slots per weight as ``newcomer`` will hold."""
        return self.above(tenant, newcomer) and \
            (self.held[tenant] - 1) * self.weight(newcomer) >= (self.held[newcomer] + 1) * self.weight(tenant)


def resumable(request: InferenceRequest) -> bool:
    """Whether ``request`` can be continued from its own text after a preemption: a stream of one chat,
    Anthropic message or text completion, without log probabilities, a grammar or a schema, several
    choices, an echo or a suffix; a message without extended thinking, a forced tool call or a structured
    output. (A tool call or reasoning seen in its stream makes it unresumable from then on: the relay
    says so; and the backend must be able to continue it: :func:`apsd.engines.relay.continues`.)"""
    if request.stream is None or request.api not in ("chat.completions", "completions", "messages"):
        return False
    body = request.payload
    if body is None:   # POST /infer: a plain completion of its prompt
        return True
    if request.api == "messages" and not _message_resumable(body):
        return False
    if body.get("n", 1) not in (1, None) or body.get("best_of", 1) not in (1, None):
        return False
    if body.get("logprobs") or body.get("top_logprobs") or body.get("echo") or body.get("suffix"):
        return False
    if any(body.get(key) for key in _CONSTRAINED):
        return False
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") not in (None, "text"):
        return False
    if request.api == "completions" and not isinstance(body.get("prompt"), str):
        return False   # (a list or token ids: nothing to append the text to)
    return True


def _message_resumable(body: dict[str, Any]) -> bool:
    """An Anthropic message that thinks first (``thinking`` enabled), must call a tool (``tool_choice``
    ``any`` or ``tool``) or follows a schema (``output_format``, ``output_config.format``) streams what a
    continuation of its text could not carry on."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") not in (None, "disabled"):
        return False
    tool_choice = body.get("tool_choice")
    if isinstance(tool_choice, dict) and tool_choice.get("type") in ("any", "tool"):
        return False
    output = body.get("output_config")
    return not body.get("output_format") and not (isinstance(output, dict) and output.get("format"))


#: Body fields that constrain what a server may generate: a continuation would restart the grammar.
_CONSTRAINED = ("grammar", "json_schema", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs", "regex", "ebnf")


def eligible(lease: Lease, now: float, rules: PreemptionRules) -> bool:
    """Whether ``lease``'s request may be preempted now (its tenant's share aside): not already chosen,
    preemptible (no first token yet, or resumable), under the cap, and, if it was preempted before and
    has started again, run ``min_run_s`` since."""
    if lease.yield_to is not None or not lease.preemptible or lease.preemptions >= rules.max_preemptions:
        return False
    return not lease.started or not lease.preemptions or now - lease.since >= rules.min_run_s


def choose_victim(leases: Sequence[Lease], shares: Shares, tenant: str, now: float, rules: PreemptionRules,
                  ttft_s: float = math.inf) -> Lease | None:
    """The lease to preempt for a request of ``tenant`` (see the module docstring), or None. ``ttft_s``:
    the request's service class's target, while it can still meet its deadline (``math.inf``: no class,
    or late)."""
    if ttft_s < math.inf:   # (its own tenant's looser requests, or as tight but started: no minimum run)
        own = [lease for lease in leases if lease.tenant == tenant and eligible(lease, math.inf, rules)
               and (lease.ttft_s > ttft_s or lease.ttft_s == ttft_s and lease.started)]
        if own:
            return min(own, key=lambda l: (l.started, -l.ttft_s, l.preemptions, -l.since, l.lease_id))
    if shares.below(tenant):
        candidates = [lease for lease in leases if lease.tenant != tenant and eligible(lease, now, rules)
                      and shares.yields_to(lease.tenant, tenant)]
    elif ttft_s < math.inf and shares.may_borrow(tenant):
        candidates = [lease for lease in leases if lease.tenant != tenant and lease.ttft_s > ttft_s
                      and eligible(lease, now, rules) and shares.lends(lease.tenant, tenant)]
    else:
        return None
    return min(candidates, default=None, key=lambda l: (
        l.started, -shares.held[l.tenant] / shares.weight(l.tenant), -l.ttft_s, l.preemptions, -l.since, l.lease_id))


def next_eligible_at(leases: Sequence[Lease], rules: PreemptionRules) -> float | None:
    """The earliest model time a resumed lease that is not eligible yet becomes so by its run time (None:
    none will)."""
    times = [lease.since + rules.min_run_s for lease in leases
             if lease.started and lease.preemptions and lease.preemptible and lease.yield_to is None
             and lease.preemptions < rules.max_preemptions]
    return min(times) if times else None
