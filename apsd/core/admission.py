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
3. can never be admitted    -> 413 (cost above the tenant's burst, above what the
                               engines can hold — they say, and the batching policy
                               may cap it further — or above the queue's ``max_tokens``)
4. tenant's queue share full -> 429 ``tenant_queue_full`` with ``Retry-After``
   queue full               -> 503 ``queue_full`` with ``Retry-After`` (``max_requests``
                               requests queued, or this one would pass ``max_tokens``)
5. budget would be passed   -> 429 ``budget_exhausted`` with ``Retry-After`` (the period's
                               end; :mod:`apsd.core.budget`)
5b. deadline unmeetable    -> 503 ``deadline_unmeetable`` with ``Retry-After`` (a ``refuse`` class whose
                               estimated wait passes its ``ttft_s``; :mod:`apsd.core.classes`)
6. bucket short of tokens   -> 429 ``rate_limited`` with ``Retry-After`` and
                               the IETF ``RateLimit``/``RateLimit-Policy`` fields

A policy that raises in ``refuse_reason`` (check 3) answers 500 ``policy_error``; any
other exception while deciding answers 500 ``internal_error`` (:meth:`Admission.handle`).

Buckets fill in model time (so ``gpu.time_scale`` speeds tenants up with the
GPU); the seconds in headers are wall seconds, what a real client must wait.
The buckets come from the store (:mod:`apsd.store`): this process's own by default, or slices
leased from buckets shared by every replica (Redis). A request a shared bucket cannot cover
while the store is unreachable may be answered 503 ``store_unavailable`` instead of 429. With a
shared bucket, a 429's ``Retry-After`` comes from the shared bucket's last known level, not from
this replica's slice alone (:mod:`apsd.store.leasing`, "Refusals tell the shared truth").

Settlement: admission takes a request's whole ``cost_tokens`` (prompt + requested)
from its bucket. When the request ends, :meth:`Admission.settle` (called by
:meth:`apsd.core.ledger.Ledger.finish`) gives back what it did not use: everything if it
never started, the unused output otherwise (see :func:`apsd.core.ledger.billed_tokens`). A tenant's
budget is reserved and settled the same way.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import trio

from apsd.core.clock import ModelClock
from apsd.core.bucket import TokenBucket
from apsd.core.budget import Budgets
from apsd.core.config import AdmissionConfig, QueueConfig, TenantConfig
from apsd.core.ledger import billed_tokens
from apsd.core.models import InferenceRequest, Outcome, Refusal

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
_SETTINGS_REPORTED = ("max_bid", "default_bid", "weight", "models", "budget_tokens", "budget_period", "disabled")

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
    #: Tenants' budgets (``budget_tokens``): reserved at admission, settled with the bucket.
    budgets: Budgets = attrs.field(factory=Budgets)
    accepting: bool = True
    #: The service classes (:mod:`apsd.core.classes`); None: requests have no class.
    classes: ServiceClasses | None = None
    _next_seq: int = 0

    def __attrs_post_init__(self) -> None:
        now = self.clock.now()
        self.buckets = {name: self._new_bucket(name, t, now) for name, t in self.tenants.items()}

    def _new_bucket(self, name: str, tenant: TenantConfig, now: float) -> Bucket:
        return self.store.bucket(name, tenant, now) if self.store is not None else TokenBucket.full(tenant, now)

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
        if self.classes is not None and (wrong_class := self.classes.resolve(request, tenant)) is not None:
            return wrong_class
        cost = request.cost_tokens
        if cost > tenant.burst:
            return Refusal(413, "exceeds_tenant_burst",
                           f"request costs {cost} tokens (prompt {request.prompt_tokens} + requested "
                           f"{request.tokens_requested}) but tenant {request.tenant_id!r} can bank at most "
                           f"{tenant.burst} (its burst); it could never be admitted")
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
        if (over_budget := self.budgets.refusal(request.tenant_id, tenant, cost)) is not None:
            return over_budget
        now = request.arrival = self.clock.now()   # (a class's deadline, and engines' estimates, count from it)
        if request.service_class is not None and self.classes is not None \
                and (unmeetable := self.classes.refuse_unmeetable(request, now)) is not None:
            return unmeetable
        bucket = self.buckets[request.tenant_id]
        if not bucket.try_take(cost, now):
            unavailable = self.store.refusal() if self.store is not None else None
            if unavailable is not None:
                return unavailable
            # what the client waits (a shared bucket: from its last known level, see apsd.store.leasing)
            wait = self.clock.wall_seconds(bucket.seconds_until(cost, now))
            headers = {"Retry-After": _retry_after(wait), **self.rate_limit_headers(request.tenant_id)}
            has = f"has {int(bucket.level(now))} of the {cost} tokens this request costs"
            view = self.store.bucket_view(bucket, now) if self.store is not None else None
            if view is not None and view.shared_tokens is not None:
                has += f" on this replica ({int(view.tokens)} in its shared bucket, as last known)"
            return Refusal(429, "rate_limited", f"tenant {request.tenant_id!r} {has}; enough accrue in {wait:.2f} s",
                           headers=headers)
        request.reserved_tokens = cost
        self.budgets.reserve(request.tenant_id, tenant, cost)
        request.seq = self._next_seq
        self._next_seq += 1
        return None

    def reconfigure(self, tenants: dict[str, TenantConfig], batching: BatchingPolicy,
                    queue: QueueConfig) -> list[str]:
        """Take new tenants, batching policy and queue limits (see Pipeline.reconfigure); returns changes."""
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
        return changes

    def settle(self, request: InferenceRequest, outcome: Outcome, now: float) -> None:
        """Settle the bucket of an admitted request that ended (step 3 of
        :meth:`apsd.core.ledger.Ledger.finish`):
        give back what it reserved and did not use, or take what it used beyond (a backend's actual
        prompt can exceed apsd's estimate; the bucket may then go below zero, and the tenant waits
        longer for its next request)."""
        used = billed_tokens(request, outcome)
        difference = request.reserved_tokens - used
        self.budgets.settle(request.tenant_id, self.tenants.get(request.tenant_id), request.reserved_tokens, used)
        bucket = self.buckets.get(request.tenant_id)
        if difference and bucket is not None:
            bucket.give_back(difference, now)

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
