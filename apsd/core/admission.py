"""Admission stage: per-tenant token buckets decide admit or refuse, now.

Ownership: :meth:`Admission.serve_admission` owns the receive end of the
ingress channel. A refused request is answered immediately (its slot resolved
through the ledger); an admitted one is stamped with its arrival time and
sequence number and put straight into the scheduler's queue (``enqueue``).

Checks, in order (the first that fails answers):

1. shutting down            -> 503 ``shutting_down`` with ``Retry-After``
   its client already left  -> 499 ``client_disconnected`` (no one reads the answer)
2. unknown tenant           -> 404 ``unknown_tenant``
   tenant disabled          -> 403 ``tenant_disabled``
   model not in its list    -> 403 ``model_not_allowed`` (its ``models``, when it has one)
   class unknown / not its  -> 400 ``unknown_class`` / 403 ``class_not_allowed`` (:mod:`apsd.core.classes`)
   key may not use the model -> 403 ``model_not_allowed`` (its key's ``models``, when it has one)
3. can never be admitted    -> 413 (prompt + output limit above the tenant's ``max_request_tokens``:
                               ``exceeds_max_request_tokens``; the prompt alone above the tenant's
                               burst (or its key's): ``exceeds_tenant_burst``; above what the
                               engines can hold — they say, and the batching policy
                               may cap it further — or above the queue's ``max_tokens``)
4. tenant's queue share full -> 429 ``tenant_queue_full`` with ``Retry-After``
   queue full               -> 503 ``queue_full`` with ``Retry-After`` (``max_requests``
                               requests queued, or this one would pass ``max_tokens``)
5. model without a price    -> 403 ``model_not_priced`` (the tenant or its key has a dollar budget)
   budget would be passed   -> 429 ``budget_exhausted`` with ``Retry-After`` (the period's
                               end; the tenant's or its key's, tokens or dollars: :mod:`apsd.core.budget`)
5b. deadline unmeetable    -> 503 ``deadline_unmeetable`` with ``Retry-After`` (a ``refuse`` class whose
                               estimated wait passes its ``ttft_s``; :mod:`apsd.core.classes`)
6. bucket short of tokens   -> 429 ``rate_limited`` with ``Retry-After`` and
                               the IETF ``RateLimit``/``RateLimit-Policy`` fields (the key's own
                               bucket first, when it has one, then the tenant's)

A policy that raises in ``refuse_reason`` (check 3) answers 500 ``policy_error``; any
other exception while deciding answers 500 ``internal_error`` (:meth:`Admission.handle`).

Buckets fill in model time (so ``gpu.time_scale`` speeds tenants up with the
GPU); the seconds in headers are wall seconds, what a real client must wait.
The buckets come from the store (:mod:`apsd.store`): this process's own by default, or slices
leased from buckets shared by every replica (Redis). A request a shared bucket cannot cover
while the store is unreachable may be answered 503 ``store_unavailable`` instead of 429. With a
shared bucket, a 429's ``Retry-After`` comes from the shared bucket's last known level, not from
this replica's slice alone (:mod:`apsd.store.leasing`, "Refusals tell the shared truth").

Reservation and settlement: admission takes a request's reservation from its bucket (and its key's):
its prompt estimate and the output it will probably generate, not its whole ``max_tokens``
(:mod:`apsd.core.reservation`). When the request ends, :meth:`Admission.settle` (called by
:meth:`apsd.core.ledger.Ledger.finish`) charges what it used (see :func:`apsd.core.ledger.billed_tokens`):
it gives back what it did not use (everything if it never started), or takes what it used beyond,
into debt if need be, which the tenant repays before its next request is admitted. Budgets
(the tenant's and its key's, in tokens or dollars) are reserved and settled the same way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import trio

from apsd.core.bucket import TokenBucket
from apsd.core.budget import MICRO, TOKENS, USD, BudgetLimit, Budgets, all_limits, limits_for
from apsd.core.clock import ModelClock
from apsd.core.config import AdmissionConfig, KeyConfig, PriceConfig, QueueConfig, TenantConfig
from apsd.core.ledger import billed_tokens
from apsd.core.models import Completion, InferenceRequest, Outcome, Refusal
from apsd.core.prices import Prices
from apsd.core.reservation import OutputEstimates

if TYPE_CHECKING:
    from apsd.core.classes import ServiceClasses
    from apsd.core.ledger import Ledger
    from apsd.core.policy import BatchingPolicy
    from apsd.core.store import Bucket, Store

__all__ = ["Admission", "estimate_tokens"]

log = logging.getLogger("apsd.core.admission")


#: ASCII letters: the only characters estimated at ``chars_per_token``.
_LETTERS = bytes(range(ord("A"), ord("Z") + 1)) + bytes(range(ord("a"), ord("z") + 1))
#: Bytes of UTF-8 text outside ASCII.
_NON_ASCII = bytes(range(128, 256))
#: Every ASCII letter as ``a`` (a space that begins a word is then ``b" a"``: tokenizers fold it into
#: the word's first token).
_LETTERS_AS_A = bytes(ord("a") if chr(b).isascii() and chr(b).isalpha() else b for b in range(256))


def estimate_tokens(text: str, settings: AdmissionConfig) -> int:
    """A prompt's tokens before any tokenizer has seen it, never far below what a backend counts:
    ASCII letters at ``chars_per_token``; every other ASCII character (digits, punctuation, symbols,
    whitespace) one token, but a space that begins a word (it goes with the word); every UTF-8 byte
    outside ASCII at ``non_ascii_bytes_per_token``.

    All but letters are counted at the worst case of a tokenizer that spends at least one character
    (one byte, beyond ASCII) per token: text without letters is never estimated below such a
    tokenizer's count, and a backend can count more than the estimate only on letters (at most
    ``chars_per_token`` times their part: docs/reference/accounting.md states the bound). Characters
    alone (an old rule) let digit- and symbol-heavy prompts, which tokenizers cut into one token a
    character or nearly, pass a bucket or a budget several times over before settlement caught up."""
    data = text.encode("utf-8", "surrogatepass")
    size = len(data)
    letters = size - len(data.translate(None, _LETTERS))
    non_ascii = 0 if text.isascii() else size - len(data.translate(None, _NON_ASCII))
    word_spaces = data.translate(_LETTERS_AS_A).count(b" a") if letters else 0
    others = size - letters - non_ascii - word_spaces
    return math.ceil(letters / settings.chars_per_token + others + non_ascii / settings.non_ascii_bytes_per_token)


#: A tenant's settings a reconfiguration reports by name when they change (rate and burst are
#: reported as a re-rating; key hashes never).
_SETTINGS_REPORTED = ("max_bid", "default_bid", "weight", "models", "budget_tokens", "budget_usd", "budget_period",
                      "disabled", "output_estimate_tokens", "max_request_tokens", "max_concurrency")

_MAX_HEADER_SECONDS = 2**31 - 1  # what HTTP delta-seconds parsers are required to handle


def _seconds(seconds: float) -> int:
    return min(_MAX_HEADER_SECONDS, math.ceil(seconds))


def _retry_after(seconds: float) -> str:
    return str(max(1, _seconds(seconds)))


@attrs.define(eq=False)
class Admission:
    """The admission stage and the tenants' buckets it owns."""

    tenants: dict[str, TenantConfig]
    batching: BatchingPolicy
    ledger: Ledger
    clock: ModelClock
    #: The engines' verdict on a request that could never run on them (a 413), else None.
    engine_refuse: Callable[[InferenceRequest], Refusal | None]
    max_queued: int
    max_queued_per_tenant: int
    #: Most tokens (prompt + requested) the queue may hold; None: unbounded.
    max_queued_tokens: int | None = None
    #: Where the buckets come from (:mod:`apsd.store`); None: this process's own, full at start.
    store: Store | None = None
    buckets: dict[str, Bucket] = attrs.field(init=False)
    #: Budgets (tenants' and keys', tokens and dollars): reserved at admission, settled with the bucket.
    budgets: Budgets = attrs.field(factory=Budgets)
    accepting: bool = True
    #: The service classes (:mod:`apsd.core.classes`); None: requests have no class.
    classes: ServiceClasses | None = None
    #: The keys issued through ``/admin`` in force, by id (their limits), and the own buckets of those
    #: with a ``rate``.
    keys: dict[str, KeyConfig] = attrs.field(factory=dict)
    key_buckets: dict[str, Bucket] = attrs.field(init=False, factory=dict)
    #: ``[admission]``: the output a request reserves (:mod:`apsd.core.reservation`).
    settings: AdmissionConfig = attrs.field(factory=AdmissionConfig)
    estimates: OutputEstimates = attrs.field(init=False)
    #: ``[prices]``: what a request's tokens cost in dollars.
    prices: Prices = attrs.field(factory=Prices)
    _limits: dict[str, BudgetLimit] = attrs.field(init=False, factory=dict)
    _next_seq: int = 0

    def __attrs_post_init__(self) -> None:
        now = self.clock.now()
        self.buckets = {name: self._new_bucket(name, t, now) for name, t in self.tenants.items()}
        self.estimates = OutputEstimates(self.settings)
        self._use_keys(self.keys, now)
        self.budgets.limits = lambda: self._limits

    def _new_bucket(self, name: str, tenant: TenantConfig, now: float) -> Bucket:
        return self.store.bucket(name, tenant, now) if self.store is not None else TokenBucket.full(tenant, now)

    @staticmethod
    def key_bucket_name(key: KeyConfig) -> str:
        """A key's own bucket, as the store names it (beside its tenant's)."""
        return f"{key.tenant}:key:{key.key_id}"

    def _key_contract(self, key: KeyConfig) -> TenantConfig | None:
        """The rate and burst of the key's own bucket (None: it has none): its ``burst``, or its tenant's,
        never above its tenant's."""
        tenant = self.tenants.get(key.tenant)
        if not key.limits.rate or tenant is None:
            return None
        burst = min(key.limits.burst or tenant.burst, tenant.burst)
        return TenantConfig(rate=key.limits.rate, burst=burst)

    def _use_keys(self, keys: dict[str, KeyConfig], now: float) -> list[str]:
        """Take the keys in force: their buckets made, re-rated (level kept, up to the new burst) or
        dropped, and the budgets in force recomputed; returns what changed."""
        changes = []
        for key_id in sorted(set(self.key_buckets)):
            key = keys.get(key_id)
            if key is None or self._key_contract(key) is None:
                del self.key_buckets[key_id]
                if key is not None:
                    changes.append(f"key {key.label} of tenant {key.tenant}: no bucket of its own")
        for key_id, key in sorted(keys.items()):
            contract = self._key_contract(key)
            if contract is None:
                continue
            bucket = self.key_buckets.get(key_id)
            if bucket is not None and (bucket.rate, bucket.burst) == (contract.rate, float(contract.burst)):
                continue
            if bucket is None or (self.store is not None and self.store.kind != "memory"):
                self.key_buckets[key_id] = self._new_bucket(self.key_bucket_name(key), contract, now)
            else:
                self.key_buckets[key_id] = TokenBucket(rate=contract.rate, burst=float(contract.burst),
                                                       tokens=min(bucket.level(now), float(contract.burst)), updated=now)
            changes.append(f"key {key.label} of tenant {key.tenant}: rate {contract.rate:g}, burst {contract.burst}")
        self.keys = dict(keys)
        self._limits = all_limits(self.tenants, self.keys)
        return changes

    def key_of(self, request: InferenceRequest) -> KeyConfig | None:
        """The issued key ``request`` came with, if it is still in force (and its tenant's)."""
        if request.key_id is None:
            return None
        key = self.keys.get(request.key_id)
        return key if key is not None and key.tenant == request.tenant_id else None

    def concurrency_limits(self, request: InferenceRequest) -> tuple[int, int]:
        """(the tenant's ``max_concurrency``, its key's) for ``request`` (0: none): what the scheduler's
        gate holds it to (:mod:`apsd.core.concurrency`)."""
        tenant = self.tenants.get(request.tenant_id)
        key = self.key_of(request)
        return (tenant.max_concurrency if tenant is not None else 0,
                key.limits.max_concurrency if key is not None else 0)

    def budget_limits(self) -> dict[str, BudgetLimit]:
        """Every budget in force, by account."""
        return self._limits

    def rate_limit_headers(self, tenant_id: str) -> dict[str, str]:
        """The tenant's bucket as of now, in the IETF httpapi draft's structured fields (a List of one
        Item, the policy ``"tokens"``, with Integer parameters; seconds are wall seconds, rounded up):

        * ``RateLimit-Policy: "tokens";q=<burst>;w=<seconds an empty bucket takes to fill>``
        * ``RateLimit: "tokens";r=<tokens in it now>;t=<seconds until it is full>``

        ``r`` is never negative (a bucket in debt has 0 left, and ``t`` counts the debt's repayment too);
        ``t`` is 0 for a full bucket. ``t`` is the draft's reset: after it the whole quota ``q`` is there.
        When the next request may go is its own cost's business: a 429's ``Retry-After`` says it exactly.
        Empty for a tenant a reload removed while its request was in flight: no bucket to describe.
        """
        bucket = self.buckets.get(tenant_id)
        if bucket is None:
            return {}
        now = self.clock.now()
        remaining = max(0, math.floor(bucket.level(now)))
        window = self.clock.wall_seconds(bucket.burst / bucket.rate)
        until_full = self.clock.wall_seconds(bucket.seconds_until(bucket.burst, now))
        return {
            "RateLimit-Policy": f'"tokens";q={int(bucket.burst)};w={max(1, _seconds(window))}',
            "RateLimit": f'"tokens";r={remaining};t={_seconds(until_full)}',
        }

    def decide(self, request: InferenceRequest) -> Refusal | None:
        """Admit (stamp arrival and seq, take tokens; return None) or refuse."""
        if not self.accepting:
            return Refusal(503, "shutting_down", "apsd is shutting down and accepts no new requests",
                           headers={"Retry-After": "5"})
        if request.abandoned:
            return Refusal(499, "client_disconnected", "the client disconnected before admission")
        tenant = self.tenants.get(request.tenant_id)
        if tenant is None:
            return Refusal(404, "unknown_tenant", f"no tenant named {request.tenant_id!r}", field="tenant_id")
        if tenant.disabled:
            return Refusal(403, "tenant_disabled", f"tenant {request.tenant_id!r} is disabled; ask the operator")
        if tenant.models and request.model is not None and request.model not in tenant.models:
            return Refusal(403, "model_not_allowed", f"tenant {request.tenant_id!r} may not use model "
                           f"{request.model!r} (it may use: {', '.join(tenant.models)})", field="model")
        key = self.key_of(request)
        if key is not None and key.limits.models and request.model is not None \
                and request.model not in key.limits.models:
            return Refusal(403, "model_not_allowed", f"key {key.label!r} of tenant {request.tenant_id!r} may not use "
                           f"model {request.model!r} (it may use: {', '.join(key.limits.models)})", field="model")
        if self.classes is not None and (wrong_class := self.classes.resolve(request, tenant)) is not None:
            return wrong_class
        cost = request.cost_tokens
        if tenant.max_request_tokens and cost > tenant.max_request_tokens:
            return Refusal(413, "exceeds_max_request_tokens",
                           f"request may use {cost} tokens (prompt {request.prompt_tokens} + output limit "
                           f"{request.tokens_requested}) but tenant {request.tenant_id!r} sends at most "
                           f"{tenant.max_request_tokens} a request (its max_request_tokens); lower max_tokens",
                           field="max_tokens")
        key_bucket = self.key_buckets.get(key.key_id) if key is not None else None
        burst = tenant.burst if key_bucket is None else min(tenant.burst, int(key_bucket.burst))
        if request.prompt_tokens > burst:
            whose = (f"tenant {request.tenant_id!r}" if burst == tenant.burst
                     else f"key {key.label!r} of tenant {request.tenant_id!r}" if key is not None else "")
            return Refusal(413, "exceeds_tenant_burst",
                           f"the prompt alone is {request.prompt_tokens} tokens but {whose} can bank at most "
                           f"{burst} (its burst); it could never be admitted")
        try:
            never = self.batching.refuse_reason(request)
        except Exception as exc:
            log.error("batching policy raised in refuse_reason", exc_info=exc)
            return Refusal(500, "policy_error",
                           f"batching policy raised {type(exc).__name__} in refuse_reason: {exc}")
        if never is not None:
            return Refusal(413, "exceeds_batch_capacity", never)
        engine_refusal = self.engine_refuse(request)
        if engine_refusal is not None:
            return engine_refusal
        if self.max_queued_tokens is not None and cost > self.max_queued_tokens:
            return Refusal(413, "exceeds_queue_capacity",
                           f"request costs {cost} tokens but the whole queue holds at most {self.max_queued_tokens} "
                           "(queue.max_tokens); it could never be admitted")
        if self.ledger.tenants[request.tenant_id].queued >= self.max_queued_per_tenant:
            return Refusal(429, "tenant_queue_full",
                           f"tenant {request.tenant_id!r} already has {self.max_queued_per_tenant} requests queued "
                           "(queue.max_requests_per_tenant); retry when some have run",
                           headers={"Retry-After": "1"})
        if self.ledger.queued_total >= self.max_queued:
            return Refusal(503, "queue_full",
                           f"the queue holds its maximum of {self.max_queued} requests; retry later",
                           headers={"Retry-After": "1"})
        if self.max_queued_tokens is not None and self.ledger.queued_tokens + cost > self.max_queued_tokens:
            return Refusal(503, "queue_full",
                           f"the queue holds {self.ledger.queued_tokens} tokens and this request's {cost} would "
                           f"pass its maximum of {self.max_queued_tokens} (queue.max_tokens); retry later",
                           headers={"Retry-After": "1"})
        reserved, output = self.estimates.reservation(request.tenant_id, tenant, request.prompt_tokens,
                                                      request.tokens_requested, burst)
        holds: list[tuple[BudgetLimit, int]] = []
        for limit in limits_for(request.tenant_id, tenant, key):
            if limit.unit == TOKENS:
                amount = reserved
            else:
                priced = self.prices.reserve_micro_usd(request, request.prompt_tokens, output)
                if priced is None:
                    return Refusal(403, "model_not_priced",
                                   f"{limit.who} has a dollar budget and the model "
                                   f"{self.prices.model_name(request.model)!r} has no price ([prices] in the "
                                   "config: ask the operator, or use a priced model)", field="model")
                amount = priced
            if (over_budget := self.budgets.refusal(limit, amount)) is not None:
                return over_budget
            holds.append((limit, amount))
        now = request.arrival = self.clock.now()   # (a class's deadline, and engines' estimates, count from it)
        if request.service_class is not None and self.classes is not None \
                and (unmeetable := self.classes.refuse_unmeetable(request, now)) is not None:
            return unmeetable
        if key_bucket is not None and key is not None and not key_bucket.try_take(reserved, now):
            unavailable = self.store.refusal() if self.store is not None else None
            if unavailable is not None:
                return unavailable
            wait = self.clock.wall_seconds(key_bucket.seconds_until(reserved, now))
            return Refusal(429, "rate_limited",
                           f"key {key.label!r} of tenant {request.tenant_id!r} has {int(key_bucket.level(now))} of the "
                           f"{reserved} tokens this request reserves in its own bucket; enough accrue in {wait:.2f} s",
                           headers={"Retry-After": _retry_after(wait)})
        cost = reserved
        bucket = self.buckets[request.tenant_id]
        if not bucket.try_take(cost, now):
            if key_bucket is not None:
                key_bucket.give_back(cost, now)
            unavailable = self.store.refusal() if self.store is not None else None
            if unavailable is not None:
                return unavailable
            # what the client waits (a shared bucket: from its last known level, see apsd.store.leasing)
            wait = self.clock.wall_seconds(bucket.seconds_until(cost, now))
            headers = {"Retry-After": _retry_after(wait), **self.rate_limit_headers(request.tenant_id)}
            has = f"has {int(bucket.level(now))} of the {cost} tokens this request reserves"
            view = self.store.bucket_view(bucket, now) if self.store is not None else None
            if view is not None and view.shared_tokens is not None:
                has += f" on this replica ({int(view.tokens)} in its shared bucket, as last known)"
            return Refusal(429, "rate_limited", f"tenant {request.tenant_id!r} {has}; enough accrue in {wait:.2f} s",
                           headers=headers)
        request.reserved_tokens, request.reserved_output = reserved, output
        request.key_reserved = reserved if key_bucket is not None else 0
        for limit, amount in holds:
            self.budgets.reserve(limit, amount)
        request.budget_holds = tuple((limit.account, limit.unit, amount) for limit, amount in holds)
        request.seq = self._next_seq
        self._next_seq += 1
        return None

    def reconfigure(self, tenants: dict[str, TenantConfig], batching: BatchingPolicy, queue: QueueConfig, *,
                    keys: dict[str, KeyConfig] | None = None, admission: AdmissionConfig | None = None,
                    prices: dict[str, PriceConfig] | None = None) -> list[str]:
        """Take new tenants, batching policy, queue limits, and (when given) issued keys, ``[admission]``
        settings and ``[prices]`` (see Pipeline.reconfigure); returns changes."""
        now = self.clock.now()
        changes = []
        for name in sorted(set(self.tenants) - set(tenants)):
            del self.buckets[name]
            changes.append(f"tenant {name} removed")
        for name, tenant in sorted(tenants.items()):
            bucket = self.buckets.get(name)
            if bucket is None:
                self.buckets[name] = self._new_bucket(name, tenant, now)
                changes.append(f"tenant {name} added (rate {tenant.rate:g}, burst {tenant.burst})")
            elif (bucket.rate, bucket.burst) != (tenant.rate, float(tenant.burst)):
                if self.store is not None and self.store.kind != "memory":
                    self.buckets[name] = self.store.bucket(name, tenant, now)  # (the shared level stays)
                else:
                    level = bucket.level(now)
                    self.buckets[name] = TokenBucket(rate=tenant.rate, burst=float(tenant.burst),
                                                     tokens=min(level, float(tenant.burst)), updated=now)
                changes.append(f"tenant {name} re-rated (rate {tenant.rate:g}, burst {tenant.burst})")
            old = self.tenants.get(name)
            settings = [f"{field} {getattr(tenant, field)!r}" for field in _SETTINGS_REPORTED
                        if old is not None and getattr(old, field) != getattr(tenant, field)]
            if settings:
                changes.append(f"tenant {name}: {', '.join(settings)}")
        limits = (queue.max_requests, queue.max_requests_per_tenant, queue.max_tokens)
        if limits != (self.max_queued, self.max_queued_per_tenant, self.max_queued_tokens):
            changes.append(f"queue limits {queue.max_requests} requests, {queue.max_requests_per_tenant} per tenant, "
                           f"{queue.max_tokens} tokens")
        self.tenants, self.batching = dict(tenants), batching
        self.max_queued, self.max_queued_per_tenant, self.max_queued_tokens = limits
        self.estimates.forget(tenants)
        if admission is not None:
            self.settings = self.estimates.settings = admission
        if prices is not None and dict(prices) != dict(self.prices.table):
            changes.append(f"prices: {len(prices)} models priced" if prices else "prices: none")
            self.prices.table = dict(prices)
        changes += self._use_keys(self.keys if keys is None else keys, now)
        return changes

    def settle(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        """Settle the bucket of an admitted request that ended (step 3 of
        :meth:`apsd.core.ledger.Ledger.finish`):
        give back what it reserved and did not use, or take what it used beyond (it generated more than
        the output it reserved, or a backend's actual prompt exceeded apsd's estimate; the bucket may then
        go below zero, and the tenant waits longer for its next request), in its tenant's bucket, its key's
        and every budget it reserved from. A completed request's output length teaches the tenant's
        estimate (:mod:`apsd.core.reservation`)."""
        used = billed_tokens(request, outcome)
        if isinstance(outcome, Completion) and request.started_at is not None:
            self.estimates.observe(request.tenant_id, request.tokens_generated)
        for account, unit, reserved in request.budget_holds:
            spent = used if unit == TOKENS else round(request.spend_usd * MICRO) if unit == USD else 0
            self.budgets.settle(account, reserved, spent, self._limits.get(account))
        difference = request.reserved_tokens - used
        bucket = self.buckets.get(request.tenant_id)
        if difference and bucket is not None:
            bucket.give_back(difference, now)
        if request.key_reserved and request.key_id is not None:
            key_bucket = self.key_buckets.get(request.key_id)
            if key_bucket is not None and request.key_reserved != used:
                key_bucket.give_back(request.key_reserved - used, now)

    def handle(self, request: InferenceRequest) -> bool:
        """Decide ``request`` and book it: admitted (True) or answered with its refusal (False)."""
        try:
            refusal = self.decide(request)
        except Exception:  # a bug deciding one request must not stop admission
            log.exception("admission failed on request %s", request.request_id)
            refusal = Refusal(500, "internal_error", "admission failed on this request; see the log")
        if refusal is None:
            self.ledger.admit(request)
            return True
        self.ledger.refuse_unadmitted(request, refusal)
        return False

    async def serve_admission(
        self,
        ingress: trio.MemoryReceiveChannel[InferenceRequest],
        enqueue: Callable[[InferenceRequest], None],
    ) -> None:
        """Decide every request from ``ingress`` and ``enqueue`` the admitted ones at once, in this
        task (``Scheduler.enqueue``: no channel and no task switch between admission and the
        queue). Runs until cancelled or ``ingress`` closes.

        Whatever is waiting in ``ingress`` is decided in one go (``receive_nowait``) before the
        task yields again: one scheduler pass per burst of arrivals instead of one per request.
        """
        async with ingress:
            async for request in ingress:
                while True:
                    if self.handle(request):
                        enqueue(request)
                    try:
                        request = ingress.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):  # (closed: the async for ends next)
                        break
