"""No sequence of requests gets a tenant more than ``burst + rate·T`` of backend work, counted by the
backend, beyond what its requests in flight when its bucket was last non-negative used past their
reservations (a hypothesis property test; docs/reference/accounting.md states the bound).

Each example runs a pipeline with the ``forward`` engine in virtual time (a fresh
``MockClock(autojump_threshold=0)``, what pytest-trio's ``autojump_clock`` is: :func:`run_virtual`)
against one or two simulated servers
(:class:`~apsd.engines.backends.SimulatedServer`), and plays a sequence of steps: requests from one
tenant or two (chat or completions bodies with ASCII, CJK and emoji prompts; an output limit under
any of its names, ``max_tokens``, ``max_completion_tokens``, ``n_predict``, ``max_new_tokens``, or
none; streamed or not; clients that read or not, and that leave at random moments) and backend
faults (failures before and after the first token, stalls, recoveries). A request is built as
``apsd.serve.http.openai._complete`` builds it: its raw JSON body through ``parse_openai_body``, then
``Pipeline.new_request(..., open_ended=..., payload=...)`` and ``submit_nowait``.

**The backend's books.** :class:`CountingClient` wraps the simulated client and counts what the
servers really did, not what apsd says: a request's *work* is its prompt as the simulated tokenizer
counts it (``_simulated_prompt_tokens``), from the moment the server sent it a token, plus the output
tokens the server sent (a non-streamed answer: all of them, when it returns). The server obeys the
largest output limit under any name in the body apsd sent it (a real server reads one of them, and
the worst case is the largest), and otherwise stops where the answer naturally ends (a length drawn
per request, up to 400 tokens). What a server computed but never sent (a prefill cut short before
the first token, a non-streamed answer abandoned midway) is not work here: by apsd's rule a request
that never got a token costs nothing, but one whose client left after it was sent (the server took
its prompt in), which is charged its prompt (the server's count): that prompt is work.

**Reservations.** A request reserves its prompt estimate and the smaller of its output limit and its
tenant's output estimate (a fixed ``output_estimate_tokens``, drawn per tenant: small, or large
enough to reserve every request's worst case; or learned from the tenant's completed requests, with
``[admission] output_estimate_default`` drawn small or large), capped at the tenant's burst
(:mod:`apsd.core.reservation`). Scenarios draw output limits up to an agent's 32,000, far above the
bursts: such requests are admitted, and what they generate beyond their reservation is settled as
debt.

**The properties.** With ``W(T)`` a tenant's work up to model time ``T`` and ``A(T) = burst + rate·T``,
each is checked at every moment the books can change (each chunk a server sends, each admission,
each settlement; in between W is constant and A grows) and at the end:

1. Worst-case reservations (every request of the tenant carries an output limit, and every one it
   was admitted reserved its prompt and its whole limit: the tenant's output estimate is at least
   its limits, and no request was capped at the burst): ``W(T) <= A(T) + Σ max(0, p_i − e_i)`` over
   its requests that got a token, ``p_i`` the backend's prompt count and ``e_i`` apsd's estimate. The
   bound is generalised rather than the prompts constrained: the simulated tokenizer counts the
   prompt's JSON (ASCII-escaped), which for a short ASCII chat prompt is a few tokens more than
   apsd's estimate. For every request with a limit ``m_i``, whatever its reservation ``r_i`` (of which
   output ``o_i``), its overshoot is bounded a priori: ``work_i − r_i <= (m_i − o_i) + max(0, p_i − e_i)``.
2. Charged = work, each token once. At every moment the bucket agrees with the backend's books:
   ``W(T) = A(T) − lost(T) − level(T) + Σ_in flight (work_i − reserved_i)``, where ``lost`` is what
   refills and refunds lost to the cap at ``burst`` (:class:`RecordingBucket` keeps it). At the end:
   each request's ``used_tokens`` is its work (its prompt the backend's count), nothing for one that
   never got a token; the ledger's prompt and generated counters are the sums of the backend's; what
   the bucket took less what it gave back is the tenant's work; and the other tenant's requests are
   never in a tenant's books.
3. The bound, for every request, limited or open-ended (no limit: the backend decides, admission
   reserved at most ``default_max_tokens``): ``W(T) − A(T) <= Σ overshoot_i(T)`` over the requests in
   flight at the last moment ``<= T`` the tenant's bucket was non-negative (``T`` itself when it is),
   ``overshoot_i = max(0, work_i − reserved_i)``. Nothing is admitted while a bucket is in debt, so a
   tenant's excess is at most the overshoot of the requests already in flight when it went into
   debt, and once the debt is repaid, at most the overshoot of what runs. (The moment a refill
   brings the bucket back to zero between two events is checked too: :meth:`Books.check`.)
4. Repaid before the next request: whenever the tenant has nothing in flight, ``W(T) <= A(T) +
   debt(T)`` (``debt``: how far its bucket is below zero), that is ``W(T) <= A(T + debt(T)/rate)``: its
   work is within the allowance of the moment it may next be admitted; and no request of it is
   admitted while its bucket is below the request's reservation.

Three property tests draw 100 scenarios each: requests that all carry a limit, against small
buckets (properties 1-4; three pinned examples: an abandoned CJK stream, chats whose prompts the
backend counts above apsd's estimate, and an agent's eight sub-agent streams of ``max_tokens``
32,000 against a default-sized bucket); requests with or without one (2 and 3, and 1 for a tenant
whose requests all carry one); and roomy buckets with more faults, so that more requests run into
broken streams, departures, retries and stalls (2 above all). A scenario ends once every server
is mended and resumed and every request is answered; one whose requests stay queued with nothing
moving is cut short (the pipeline's exit answers them 503, and the books must still balance).

Two defects the property tests ran into have tests of their own, after them: a backend that comes
back at the instant it was marked down can leave the forward engine never asking for work again
(requests stranded in the queue behind an idle backend), and the engine's backend watcher spins
when model time rounds below the deadline it slept until.

Every example is deterministic (``derandomize``; trio's scheduler is seeded by hypothesis through
pytest-trio) and runs in virtual time; the file takes about 30 s. Run:
``.venv/bin/pytest tests/unit/test_token_property.py``.
"""

from __future__ import annotations

import collections
import json
import math
import re
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, event, example, given, settings, target
from hypothesis import strategies as st

from apsd.core.bucket import TokenBucket
from apsd.core.clock import ModelClock
from apsd.core.config import Config, TenantConfig, parse_config
from apsd.core.models import LENGTH_ALIASES, Completion, InferenceRequest, Refusal
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
from apsd.pipeline import Pipeline, open_pipeline
from apsd.serve.http.openai import CHAT, COMPLETIONS, parse_openai_body, priority_bid
from apsd.store.memory import MemoryStore
from tests.helpers import build_policies

pytestmark = pytest.mark.timeout(300)

#: Every name a backend reads an output limit by.
LIMIT_NAMES = ("max_tokens", "max_completion_tokens", *LENGTH_ALIASES)
MODEL = "sim"

#: Model seconds without any progress (no token sent, nothing admitted or finished) after which the
#: requests still unanswered at the end of a scenario count as stranded (the longest silence a
#: scenario has otherwise is a non-streamed answer: 400 tokens at 0.05 s, 20 s).
STRANDED_AFTER_S = 120.0

#: Model seconds any run may take (a scenario's requests, run one at a time, take at most 240 x
#: 400 tokens x 0.05 s = 4800 s).
VIRTUAL_LIMIT_S = 4 * 3600.0

PROPERTY = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.data_too_large, HealthCheck.large_base_example])


# -- the bucket's own books ---------------------------------------------------------------------------

@attrs.define(eq=False)
class RecordingBucket(TokenBucket):
    """A tenant's bucket (apsd's own :class:`TokenBucket`, unchanged) that also keeps books: what
    admission took, what settlement gave back (negative: took more), and what refills and refunds
    lost to the cap at ``burst``; so at any moment ``level = burst + rate·T − lost − taken + given``."""

    created: float = 0.0
    taken: float = 0.0
    given: float = 0.0
    lost: float = 0.0
    #: The last settlement took the level from >= 0 to below 0 (the tenant went into debt).
    went_negative: bool = False

    def level(self, now: float) -> float:
        if now > self.updated:
            self.lost += max(0.0, self.tokens + (now - self.updated) * self.rate - self.burst)
        return super().level(now)

    def try_take(self, amount: float, now: float) -> bool:
        took = super().try_take(amount, now)
        if took:
            self.taken += amount
        return took

    def give_back(self, amount: float, now: float) -> None:
        before = self.level(max(now, self.updated))
        self.lost += max(0.0, before + amount - self.burst)
        super().give_back(amount, now)
        self.given += amount
        if before >= 0 > self.tokens:
            self.went_negative = True


class RecordingStore(MemoryStore):
    """The memory store, its buckets :class:`RecordingBucket` s."""

    def bucket(self, tenant_id: str, tenant: TenantConfig, now: float) -> RecordingBucket:
        return RecordingBucket(rate=tenant.rate, burst=float(tenant.burst), tokens=float(tenant.burst),
                               updated=now, created=now)


# -- the backend's own books ----------------------------------------------------------------------------

@attrs.define
class Run:
    """One request as the servers saw it (over all its attempts)."""

    tenant: str
    #: Where its answer ends when nothing limits it.
    natural: int
    #: apsd's estimate of its prompt, and its output limit (None: open-ended).
    estimate: int
    limit: int | None
    attempts: int = 0
    #: A server sent it a token.
    started: bool = False
    #: The server's count of its prompt (counted once it sent a token), and the output tokens it sent.
    prompt: int = 0
    sent: int = 0
    #: Its client left (before its answer).
    left: bool = False

    @property
    def work(self) -> int:
        return self.prompt + self.sent


@attrs.define(eq=False)
class CountingClient(SimulatedBackendClient):
    """The simulated client, counting each request's work as its server does it (see the module
    docstring) and calling ``on_work`` after each step, before apsd hears of it."""

    runs: dict[str, Run] = attrs.field(factory=dict)
    on_work: Callable[[Run], None] = lambda run: None
    #: Whether the forward engine took a request back for the queue (its backend went down, or it was
    #: preempted): set by :func:`play` once the engine exists.
    moved: Callable[[str], bool] = lambda request_id: False
    violations: list[str] = attrs.field(factory=list)

    async def complete(self, backend: Backend, api: str, body: dict, on_chunk: OnChunk,
                       request_id: str = "", traceparent: str = "") -> BackendAnswer:
        run = self.runs[request_id]
        run.attempts += 1
        resumes = _continues(api, body)
        if run.started and not resumes:
            self.violations.append(f"{request_id}: sent to a backend again after one had sent it tokens")
        if resumes and not run.started:
            self.violations.append(f"{request_id}: sent as a continuation before any token")
        limits = [body[name] for name in LIMIT_NAMES if body.get(name) is not None]
        if run.limit is None and limits:
            self.violations.append(f"{request_id}: open-ended, but sent upstream with a limit {limits}")
        if run.limit is not None and (not limits or max(limits) > run.limit - run.sent):
            self.violations.append(f"{request_id}: limited to {run.limit} with {run.sent} sent, but sent upstream "
                                   f"with {limits}")
        natural = run.natural - run.sent   # (a continuation goes on from where its text ends)
        tokens = min(natural, max(limits)) if limits else natural
        prompt = _simulated_prompt_tokens(body)
        # (the simulated server reads max_tokens alone: it gets the limit this server obeys)
        sent_body = {key: value for key, value in body.items() if key not in LIMIT_NAMES}
        sent_body["max_tokens"] = tokens

        def counted(chunk: BackendChunk) -> None:
            sent = chunk.tokens or 0
            if sent:
                self._sent(run, prompt, sent)
            on_chunk(chunk)

        try:
            answer = await super().complete(backend, api, sent_body, counted, request_id)
        except trio.Cancelled:
            if not run.started and run.left and not self.moved(request_id):
                self._sent(run, prompt, 0)   # its client left once the server had its prompt: charged it
            raise
        if not body.get("stream"):
            assert answer.prompt_tokens is not None and answer.completion_tokens is not None
            self._sent(run, answer.prompt_tokens, answer.completion_tokens)
        return answer

    def _sent(self, run: Run, prompt: int, tokens: int) -> None:
        if not run.started:
            run.started, run.prompt = True, prompt
        run.sent += tokens
        self.on_work(run)


def _continues(api: str, body: dict) -> bool:
    """Whether ``body`` resumes a preempted answer from its text, which ends with the simulated server's
    tokens `` t0 t1 ...`` (its work then is only the new output)."""
    if api == "chat.completions":
        messages = body.get("messages") or []
        last = messages[-1] if messages and isinstance(messages[-1], dict) else {}
        content = last.get("content") if last.get("role") == "assistant" else None
        text = content if isinstance(content, str) else "".join(
            part.get("text", "") for part in content if isinstance(part, dict)) if isinstance(content, list) else ""
    else:
        text = body.get("prompt") if isinstance(body.get("prompt"), str) else ""
    return re.search(r" t0(?: t\d+)*$", text) is not None


# -- the checks -------------------------------------------------------------------------------------------

@attrs.frozen
class Snapshot:
    """A tenant's books at its last check (for the moment a refill brings its bucket back to zero)."""

    now: float
    level: float
    work: int
    #: Σ overshoot over the requests in flight then.
    in_flight_overshoot: int


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)


@attrs.define(eq=False)
class Books:
    """Checks properties 1-3 (module docstring) against the backend's books and apsd's."""

    pipeline: Pipeline
    client: CountingClient
    #: Tenants all of whose requests carry an output limit (the a priori overshoot bound applies to them;
    #: property 1's sum, to those of them whose reservations were all worst case: not in ``partial``).
    limited: frozenset[str]
    #: Tenants a request of which was admitted reserving less than its worst case (prompt + limit).
    partial: set[str] = attrs.field(factory=set)
    requests: list[InferenceRequest] = attrs.field(factory=list)
    violations: list[str] = attrs.field(factory=list)
    checks: int = 0
    #: Per tenant: the requests in flight when its bucket last went from >= 0 into debt.
    episode: dict[str, list[InferenceRequest]] = attrs.field(factory=dict)
    previous: dict[str, Snapshot] = attrs.field(factory=dict)
    #: Requests still queued at the end with nothing moving (see :func:`drain`).
    stranded: list[str] = attrs.field(factory=list)
    #: The most of its allowance (burst + rate·T) a tenant's work reached.
    tightest: float = 0.0

    def __attrs_post_init__(self) -> None:
        self.client.on_work = lambda run: self.check(run.tenant, "work")
        events = self.pipeline.ledger.events   # (subscribed after admission: its settlement comes first)
        events.subscribe("request_admitted", self._admitted, "the token property's books")
        events.subscribe("request_finished", self._finished, "the token property's books")

    def bucket(self, tenant: str) -> RecordingBucket:
        bucket = self.pipeline.admission.buckets[tenant]
        assert isinstance(bucket, RecordingBucket)
        return bucket

    def _in_flight(self, tenant: str) -> list[InferenceRequest]:
        return [r for r in self.pipeline.ledger.outstanding if r.tenant_id == tenant]

    def _admitted(self, request: InferenceRequest) -> None:
        bucket = self.bucket(request.tenant_id)
        if bucket.level(self.pipeline.clock.now()) < 0:   # (it took the reservation: the level was >= it)
            self.violations.append(f"P4 {request.request_id}: admitted with its tenant's bucket at "
                                   f"{bucket.level(self.pipeline.clock.now()):.2f} after taking its reservation")
        if request.reserved_tokens < request.cost_tokens:
            self.partial.add(request.tenant_id)
            event("a request reserved less than its worst case")
        if request.tokens_requested > bucket.burst:
            event("an output limit above the burst was admitted")
        if self.pipeline.admission.estimates.learned(request.tenant_id) is not None \
                and not self.pipeline.config.tenants[request.tenant_id].output_estimate_tokens:
            event("a reservation from the tenant's learned estimate")
        self.check(request.tenant_id, "admitted")

    def _overshoot(self, request: InferenceRequest) -> int:
        return max(0, self.client.runs[request.request_id].work - request.reserved_tokens)

    def _finished(self, request: InferenceRequest) -> None:
        bucket = self.bucket(request.tenant_id)
        if bucket.went_negative:
            bucket.went_negative = False
            self.episode[request.tenant_id] = [request, *self._in_flight(request.tenant_id)]
            event("a tenant went into debt")
        self.check(request.tenant_id, f"{request.request_id} finished")

    def work(self, tenant: str) -> int:
        return sum(run.work for run in self.client.runs.values() if run.tenant == tenant)

    def check(self, tenant: str, when: str) -> None:
        self.checks += 1
        now = self.pipeline.clock.now()
        bucket = self.bucket(tenant)
        level = bucket.level(now)
        allowance = bucket.burst + bucket.rate * (now - bucket.created)
        work = self.work(tenant)
        in_flight = self._in_flight(tenant)
        where = f"tenant {tenant} at T={now:.4f} ({when}): work {work}, allowance {allowance:.2f}"
        self.tightest = max(self.tightest, work / allowance)

        # 2. the bucket holds, for each request in flight, its reservation; for each that ended, its work
        held = sum(self.client.runs[r.request_id].work - r.reserved_tokens for r in in_flight)
        if not _close(work, allowance - bucket.lost - level + held):
            self.violations.append(f"P2 {where}: the bucket has taken {allowance - bucket.lost - level:.2f} net "
                                   f"(burst + rate·T − lost − level), but the backend's work less what is still "
                                   f"reserved in flight is {work - held}")
        # 1. worst-case reservations: burst + rate·T, and what the backend's prompts exceeded the estimates by
        if tenant in self.limited and tenant not in self.partial:
            prompts = sum(max(0, run.prompt - run.estimate) for run in self.client.runs.values()
                          if run.tenant == tenant and run.started)
            if work > allowance + prompts + 1e-6:
                self.violations.append(f"P1 {where}: beyond burst + rate·T + {prompts} (prompts over their estimate)")
        # 1'. any reservation: a limited request's overshoot is at most its unreserved output and its prompt excess
        for request in in_flight:
            run = self.client.runs[request.request_id]
            if run.limit is not None and request.reserved_tokens:
                allowed = run.limit - request.reserved_output + max(0, run.prompt - run.estimate)
                if run.work - request.reserved_tokens > allowed:
                    self.violations.append(f"P1 {where}: {request.request_id} used {run.work - request.reserved_tokens} "
                                           f"beyond its reservation, more than its unreserved output and prompt "
                                           f"excess ({allowed})")
        # 4. nothing in flight: within the allowance of the moment its debt is repaid
        if not in_flight and work > allowance + max(0.0, -level) + 1e-6:
            self.violations.append(f"P4 {where}: nothing in flight, but beyond burst + rate·T + debt "
                                   f"({max(0.0, -level):.2f})")
        # 3. the excess: at most the overshoot of what was in flight when the bucket was last >= 0
        members = in_flight if level >= 0 else self.episode.get(tenant, [])
        bound = sum(self._overshoot(r) for r in members)
        if work - allowance > bound + 1e-6:
            self.violations.append(f"P3 {where}: excess {work - allowance:.2f} > {bound}, the overshoot of the "
                                   f"{len(members)} requests in flight when its bucket was last >= 0")
        previous = self.previous.get(tenant)
        if previous is not None and previous.level < 0 and bucket.rate > 0:
            back = previous.now + -previous.level / bucket.rate   # (refilled to 0 then, nothing else moved)
            if back < now:
                excess = previous.work - (bucket.burst + bucket.rate * (back - bucket.created))
                if excess > previous.in_flight_overshoot + 1e-6:
                    self.violations.append(f"P3 tenant {tenant} at T={back:.4f} (its bucket back to 0): excess "
                                           f"{excess:.2f} > {previous.in_flight_overshoot}, the overshoot in flight")
        self.previous[tenant] = Snapshot(now, level, work, sum(self._overshoot(r) for r in in_flight))

    def check_end(self, tenants: list[str]) -> None:
        """Property 2 request by request, and each tenant's totals, once nothing is in flight."""
        for request in self.requests:
            run = self.client.runs[request.request_id]
            outcome = request.reply.outcome
            if outcome is None:
                self.violations.append(f"{request.request_id}: never answered")
                continue
            event(f"outcome: {'200' if isinstance(outcome, Completion) else outcome.status} "
                  f"{'after' if run.started else 'without'} tokens" + (", retried" if run.attempts > 1 else ""))
            if run.started and run.prompt > run.estimate:
                event("a backend's prompt count above apsd's estimate")
            if run.limit is None and run.work > request.reserved_tokens > 0:
                event("an open-ended request overshot its reservation")
            if isinstance(outcome, Refusal) and "unexpectedly" in outcome.message:
                self.violations.append(f"{request.request_id}: apsd's last-resort guard fired: {outcome.message}")
            if request.used_tokens != run.work:
                self.violations.append(
                    f"P2 {request.request_id} ({outcome.status if isinstance(outcome, Refusal) else 200}"
                    f"{' ' + outcome.error if isinstance(outcome, Refusal) else ''}, stream "
                    f"{request.stream is not None}, {run.attempts} attempts): charged {request.used_tokens} "
                    f"(prompt {request.prompt_tokens if request.started_at is not None else 0}, output "
                    f"{request.tokens_generated}); the backend did {run.work} (prompt {run.prompt}, sent {run.sent})")
            if isinstance(outcome, Completion) and (outcome.prompt_tokens, outcome.tokens_generated) != (
                    run.prompt, run.sent):
                self.violations.append(f"P2 {request.request_id}: completed with usage ({outcome.prompt_tokens}, "
                                       f"{outcome.tokens_generated}), the backend's ({run.prompt}, {run.sent})")
        for tenant in tenants:
            self.check(tenant, "the end")
            if tenant in self.limited and tenant not in self.partial:
                event("a tenant whose reservations were all worst case (property 1's sum)")
        event(f"work reached {min(100, int(self.tightest * 10) * 10)}% of burst + rate·T (in 10% steps)")
        for tenant in tenants:
            runs = [run for run in self.client.runs.values() if run.tenant == tenant]
            stats = self.pipeline.ledger.tenants[tenant]
            prompt, sent = sum(run.prompt for run in runs), sum(run.sent for run in runs)
            if (stats.prompt_tokens, stats.generated_tokens) != (prompt, sent):
                self.violations.append(f"P2 tenant {tenant}: the ledger charged prompt {stats.prompt_tokens}, "
                                       f"output {stats.generated_tokens}; the backend's: {prompt}, {sent}")
            bucket = self.bucket(tenant)
            if not _close(bucket.taken - bucket.given, prompt + sent):
                self.violations.append(f"P2 tenant {tenant}: the bucket took {bucket.taken - bucket.given} net; "
                                       f"the backend did {prompt + sent}")
        if not self.pipeline.statistics().books.requests.conservation_ok:
            self.violations.append("the ledger's conservation does not hold")
        self.violations.extend(self.client.violations)


# -- scenarios --------------------------------------------------------------------------------------------

@attrs.frozen
class ServerSpec:
    slots: int
    ttft_s: float
    tpot_s: float
    max_concurrency: int


@attrs.frozen
class Ask:
    """A client sends ``body`` to ``api`` as ``tenant``, ``after`` s after the previous step, ``copies``
    times at once."""

    after: float
    tenant: str
    api: str
    body: dict[str, Any]
    #: The raw JSON escapes non-ASCII (``\\uXXXX``) or not.
    ascii: bool
    natural: int
    #: It reads its stream (a streamed request), and leaves this long after sending (None: never).
    reads: bool
    leave_after: float | None
    copies: int = 1


@attrs.frozen
class Fault:
    """Server ``server`` changes, ``after`` s after the previous step: ``fail_next`` (that many requests
    fail before their first token), ``fail_after`` (streams break after ``value`` tokens), ``mend``
    (they no longer do), ``stall`` (it answers nothing, health checks included), ``resume``."""

    after: float
    server: str
    what: str
    value: int = 0


@attrs.frozen
class Scenario:
    tenants: dict[str, TenantConfig]
    servers: dict[str, ServerSpec]
    default_max_tokens: int
    steps: tuple[Ask | Fault, ...]
    #: ``[admission] output_estimate_default``: what a tenant's requests reserve before it has history.
    output_estimate_default: int = 1024


_ASCII = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
_CJK = st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF)
_EMOJI = st.characters(min_codepoint=0x1F300, max_codepoint=0x1F64F)
texts = st.one_of(st.text(_ASCII, min_size=1, max_size=12), st.text(_ASCII, min_size=1, max_size=300),
                  st.text(_CJK, min_size=1, max_size=80),
                  st.text(_EMOJI, min_size=1, max_size=60), st.text(_ASCII | _CJK | _EMOJI, min_size=1, max_size=120))
#: Mostly bursts (a tenant pushing against its bucket), sometimes a pause long enough to refill it.
delays = st.sampled_from([0.0, 0.0, 0.0, 0.001, 0.05, 0.3, 1.0, 8.0]) | st.floats(0.0, 3.0)


@st.composite
def message(draw: st.DrawFn) -> dict[str, Any]:
    text = draw(texts)
    content: Any = [{"type": "text", "text": text}] if draw(st.booleans()) else text
    return {"role": draw(st.sampled_from(["system", "user", "assistant"])), "content": content}


@st.composite
def asks(draw: st.DrawFn, tenants: list[str], open_ended: bool) -> Ask:
    api = draw(st.sampled_from([CHAT, COMPLETIONS]))
    if api == CHAT:
        body: dict[str, Any] = {"model": MODEL, "messages": draw(st.lists(message(), min_size=1, max_size=3))}
    else:
        prompt = draw(texts)
        body = {"model": MODEL, "prompt": [prompt] if draw(st.booleans()) else prompt}
    limits = st.integers(1, 40) | st.integers(1, 300) | st.sampled_from([32_000]) | st.integers(1_000, 40_000)
    limit = None if open_ended and draw(st.booleans()) else draw(limits)
    if limit is not None:
        for name in draw(st.lists(st.sampled_from(LIMIT_NAMES), min_size=1, max_size=4, unique=True)):
            body[name] = limit
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    return Ask(after=draw(delays), tenant=draw(st.sampled_from(tenants)), api=api, body=body,
               ascii=draw(st.booleans()), natural=draw(st.integers(1, 400)), reads=draw(st.booleans()),
               leave_after=draw(st.none() | st.floats(0.0, 8.0)),
               copies=draw(st.sampled_from([1, 1, 1, 2, 3, 6])))


@st.composite
def faults(draw: st.DrawFn, servers: list[str]) -> Fault:
    what = draw(st.sampled_from(["fail_next", "fail_after", "fail_after", "mend", "stall", "resume"]))
    value = draw(st.integers(1, 3)) if what == "fail_next" else draw(st.integers(0, 40)) if what == "fail_after" else 0
    return Fault(after=draw(delays), server=draw(st.sampled_from(servers)), what=what, value=value)


@st.composite
def scenarios(draw: st.DrawFn, open_ended: bool, roomy: bool = False) -> Scenario:
    """Tenants pushing against small buckets, or (``roomy``) with room for most of what they send,
    so that more requests run into the backends' faults and their clients' leaving."""
    rates, bursts = ([50.0, 200.0], [2000, 8000]) if roomy else ([1.0, 5.0, 20.0], [150, 400, 1000])
    # output_estimate_tokens: learned (0), small, or enough for every request's worst case
    tenants = {name: TenantConfig(rate=draw(st.sampled_from(rates)), burst=draw(st.sampled_from(bursts)),
                                  output_estimate_tokens=draw(st.sampled_from([0, 0, 16, 10**6])))
               for name in (["a", "b"] if draw(st.booleans()) else ["a"])}
    servers = {f"s{i}": ServerSpec(slots=draw(st.sampled_from([1, 2, 4])),
                                   ttft_s=draw(st.sampled_from([0.02, 0.2, 1.0])),
                                   tpot_s=draw(st.sampled_from([0.005, 0.02, 0.05])),
                                   max_concurrency=draw(st.integers(1, 4)))
               for i in range(draw(st.integers(1, 2)))}
    step = asks(list(tenants), open_ended)
    fault = faults(list(servers))
    steps = draw(st.lists(st.one_of(step, fault), min_size=4, max_size=40) if roomy else
                 st.lists(st.one_of(step, step, fault), min_size=1, max_size=40))
    return Scenario(tenants=tenants, servers=servers, default_max_tokens=draw(st.sampled_from([8, 32, 128])),
                    steps=tuple(steps), output_estimate_default=draw(st.sampled_from([8, 64, 1024])))


# -- playing a scenario -----------------------------------------------------------------------------------

def scenario_config(scenario: Scenario) -> Config:
    config = parse_config({
        "policy": {"preset": "fifo", "fixed": {"window_ms": 0.0}},
        "backends": [{"url": f"http://{name}.test", "name": name, "models": [MODEL],
                      "max_concurrency": spec.max_concurrency} for name, spec in scenario.servers.items()],
        "forward": {"health_interval_s": 1.0, "metrics_interval_s": 0.5},
        "gateway": {"default_max_tokens": scenario.default_max_tokens},
        "admission": {"output_estimate_default": scenario.output_estimate_default},
    }, "<test>")
    return attrs.evolve(config, tenants=dict(scenario.tenants))


async def client(pipeline: Pipeline, request: InferenceRequest, ask: Ask, run: Run) -> None:
    """A client: reads its stream (or not) and waits for the answer; leaving after ``leave_after``
    cancels its request, as the HTTP layer does when a client disconnects."""
    with trio.move_on_after(math.inf if ask.leave_after is None else ask.leave_after):
        if request.stream is not None and ask.reads:
            async for _ in request.stream:
                pass
        await request.reply.wait()
    if not request.answered:
        run.left = True
        pipeline.cancel(request)


def submit(pipeline: Pipeline, books: Books, ask: Ask, number: str) -> InferenceRequest:
    """Submit ``ask`` as ``apsd.serve.http.openai._complete`` does."""
    raw = json.dumps(ask.body, ensure_ascii=ask.ascii).encode()
    body = parse_openai_body(raw, ask.api, pipeline.config)
    request = pipeline.new_request(
        tenant_id=ask.tenant, prompt=body.prompt, tokens_requested=body.max_tokens,
        priority_bid=priority_bid(pipeline.config.tenants.get(ask.tenant), priority=body.priority),
        prompt_tokens=body.prompt_tokens, model=body.model, api=ask.api, payload=body.payload,
        open_ended=body.open_ended, request_id=f"{ask.tenant}-{number}")
    if body.stream:
        request.stream = TokenStream()
    books.client.runs[request.request_id] = Run(
        tenant=ask.tenant, natural=ask.natural, estimate=body.prompt_tokens,
        limit=None if body.open_ended else body.max_tokens)
    books.requests.append(request)
    pipeline.submit_nowait(request)
    return request


def apply(fault: Fault, server: SimulatedServer) -> None:
    if fault.what == "fail_next":
        server.fail_next = fault.value
    elif fault.what == "fail_after":
        server.fail_after_tokens = fault.value
    elif fault.what == "mend":
        server.fail_next, server.fail_after_tokens = 0, None
    else:
        server.stalled = fault.what == "stall"


async def play(scenario: Scenario) -> Books:
    """Run ``scenario`` to its end (every server mended and resumed, every request answered) and
    return its books, checked."""
    config = scenario_config(scenario)
    servers = {name: SimulatedServer(models=(MODEL,), slots=spec.slots, ttft_s=spec.ttft_s, tpot_s=spec.tpot_s)
               for name, spec in scenario.servers.items()}
    backend_client = CountingClient(ModelClock(), servers)
    limited = frozenset(scenario.tenants) - {step.tenant for step in scenario.steps if isinstance(step, Ask)
                                              and not any(name in step.body for name in LIMIT_NAMES)}
    async with open_pipeline(config, build_policies(config), backend_client=backend_client,
                             store=RecordingStore()) as pipeline:
        books = Books(pipeline, backend_client, limited)
        engine = pipeline.engines[0]
        backend_client.moved = lambda request_id: any(a.request.request_id == request_id and a.stop is not None
                                                      for a in engine._running.values())
        await trio.testing.wait_all_tasks_blocked()   # (the first health checks find the servers up)
        await pipeline.clock.sleep(0.01)
        async with trio.open_nursery() as clients:
            for number, step in enumerate(scenario.steps):
                await pipeline.clock.sleep(step.after)
                if isinstance(step, Fault):
                    apply(step, servers[step.server])
                else:
                    for copy in range(step.copies):
                        request = submit(pipeline, books, step, f"{number}.{copy}")
                        clients.start_soon(client, pipeline, request, step, backend_client.runs[request.request_id])
            for server in servers.values():
                server.fail_next, server.fail_after_tokens, server.stalled = 0, None, False
            books.stranded = [r.request_id for r in await drain(books)]
            if books.stranded:   # (their clients would wait for ever: the pipeline's exit answers them)
                clients.cancel_scope.cancel()
        if books.stranded:   # (test_a_backend_back_at_once_after_a_failed_health_check_runs_its_requests_again)
            event("stranded: a request never dispatched again (the pipeline's exit answers it 503)")
        else:
            await pipeline.ledger.wait_idle()
    books.check_end(list(scenario.tenants))   # (after the exit: a stranded request is answered, refunded)
    return books


async def drain(books: Books) -> list[InferenceRequest]:
    """Wait for every request's answer (one may not even be admitted yet); return those still
    unanswered once nothing has moved for :data:`STRANDED_AFTER_S` (model seconds)."""
    while pending := [r for r in books.requests if not r.answered]:
        checks = books.checks
        with trio.move_on_after(STRANDED_AFTER_S):
            await pending[0].reply.wait()
        if not pending[0].answered and books.checks == checks:
            return pending
    return []


def report(books: Books) -> str:
    return f"{len(books.violations)} violations in {books.checks} checks:\n" + "\n".join(books.violations[:20])


# -- the tests --------------------------------------------------------------------------------------------

#: The issue's case: an abandoned CJK stream, charged the backend's count of its prompt (apsd's
#: estimate is 3 tokens per character, the simulated tokenizer's 1.5), with a second tenant's
#: chat beside it.
CJK_ABANDONED = Scenario(
    tenants={"a": TenantConfig(rate=5.0, burst=1000), "b": TenantConfig(rate=50.0, burst=300)},
    servers={"s0": ServerSpec(slots=2, ttft_s=0.2, tpot_s=0.05, max_concurrency=2)},
    default_max_tokens=64,
    steps=(Ask(after=0.0, tenant="a", api=CHAT, body={"model": MODEL, "messages": [
               {"role": "user", "content": "汉字日本語の文" * 20}], "n_predict": 200, "stream": True},
               ascii=False, natural=400, reads=True, leave_after=1.0),
           Ask(after=0.0, tenant="b", api=COMPLETIONS, body={"model": MODEL, "prompt": "hello 😀 " * 10,
               "max_new_tokens": 50}, ascii=True, natural=30, reads=False, leave_after=None),
           Fault(after=0.5, server="s0", what="fail_after", value=20),
           Ask(after=0.0, tenant="a", api=CHAT, body={"model": MODEL, "messages": [
               {"role": "user", "content": "x"}], "max_completion_tokens": 100, "stream": True},
               ascii=True, natural=100, reads=True, leave_after=None)))


class Livelock(trio.abc.Instrument):
    """Stops a run whose tasks keep running while virtual time stands still (a loop that never
    sleeps long enough for the autojump clock to move on): after ``limit`` task steps at one moment
    it cancels ``scope`` and says which task took the most of them."""

    def __init__(self, limit: int = 200_000) -> None:
        self.limit, self.at, self.steps = limit, -1.0, 0
        self.scope = trio.CancelScope()
        self.spinning: collections.Counter[str] = collections.Counter()
        self.tripped: str | None = None

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        now = trio.current_time()
        if now != self.at:
            self.at, self.steps = now, 0
            self.spinning.clear()
        self.steps += 1
        if self.steps > self.limit - 1_000:
            self.spinning[task.name] += 1
        if self.steps == self.limit:
            name, steps = self.spinning.most_common(1)[0]
            self.tripped = f"{self.limit} task steps at trio time {now!r}, {steps} of the last 1000 in {name}"
            self.scope.cancel()


def run_virtual(function: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Run ``function(*args)`` in a trio run of its own, in virtual time, its clock starting at 0 (what
    pytest-trio's ``autojump_clock`` is, but fresh: that fixture's clock is shared by every hypothesis
    example of a test, so later examples would start at an arbitrary time, where the backend watcher
    spins: see :func:`test_the_backend_watcher_keeps_time_whatever_the_clock_started_at`). Under
    pytest-trio, trio's scheduling is seeded by hypothesis: each run is deterministic. A run that
    spins without time moving fails (:class:`Livelock`) instead of hanging, and so does one still
    waiting after :data:`VIRTUAL_LIMIT_S`."""
    guard = Livelock()

    async def guarded() -> Any:
        with guard.scope, trio.fail_after(VIRTUAL_LIMIT_S):
            return await function(*args)

    result = trio.run(guarded, clock=trio.testing.MockClock(autojump_threshold=0), instruments=[guard])
    assert guard.tripped is None, f"livelock: {guard.tripped}"
    return result


#: A tenant that spends its whole burst on short chats, each of which the backend counts 3 prompt
#: tokens above apsd's estimate (the JSON of the message: 8 tokens; the estimate: 1 + 4): its work
#: passes burst + rate·T by those 3 tokens a request, and its bucket goes into debt.
CHATS_OVER_THE_ESTIMATE = Scenario(
    tenants={"a": TenantConfig(rate=1.0, burst=150)},
    servers={"s0": ServerSpec(slots=4, ttft_s=0.02, tpot_s=0.01, max_concurrency=4)},
    default_max_tokens=32,
    steps=(Ask(after=0.0, tenant="a", api=CHAT, body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 20, "stream": True},
               ascii=True, natural=20, reads=True, leave_after=None, copies=6),
           Ask(after=1.0, tenant="a", api=CHAT, body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 20},
               ascii=True, natural=20, reads=False, leave_after=None, copies=2)))


#: A coding agent on a default-sized tenant (tenant_a's rate and burst): eight sub-agent streams at once,
#: each asking for max_tokens 32,000 (six times the burst) and generating a few hundred, in three
#: waves; the tenant's estimate is learned from its first completions. Each is admitted (none is
#: refused 413), reserving its prompt and the estimate; what it generates beyond is settled as debt.
AGENT_FAN_OUT = Scenario(
    tenants={"a": TenantConfig(rate=500.0, burst=5000)},
    servers={"s0": ServerSpec(slots=8, ttft_s=0.2, tpot_s=0.02, max_concurrency=8)},
    default_max_tokens=256, output_estimate_default=1024,
    steps=tuple(Ask(after=wave * 3.0, tenant="a", api=CHAT,
                    body={"model": MODEL, "messages": [{"role": "system", "content": "You are a careful agent. " * 40},
                                                       {"role": "user", "content": f"Sub-task {wave}: read the code."}],
                          "max_tokens": 32_000, "stream": True, "stream_options": {"include_usage": True}},
                    ascii=True, natural=natural, reads=True, leave_after=None, copies=8)
                for wave, natural in enumerate([120, 400, 300])))


@given(scenario=scenarios(open_ended=False))
@example(scenario=CJK_ABANDONED)
@example(scenario=CHATS_OVER_THE_ESTIMATE)
@example(scenario=AGENT_FAN_OUT)
@PROPERTY
def test_limited_requests_get_at_most_burst_plus_rate_t_of_backend_work(scenario: Scenario) -> None:
    """Properties 1-4 for requests that all carry an output limit."""
    books = run_virtual(play, scenario)
    target(books.tightest, label="work / (burst + rate·T)")
    assert not books.violations, report(books)


@given(scenario=scenarios(open_ended=True))
@PROPERTY
def test_open_ended_requests_overshoot_only_by_what_was_in_flight(scenario: Scenario) -> None:
    """Properties 2 and 3 (and 1 for a tenant whose requests all carry a limit) when requests may
    set no limit and the backend generates past what admission reserved."""
    books = run_virtual(play, scenario)
    target(books.tightest, label="work / (burst + rate·T)")
    assert not books.violations, report(books)


@given(scenario=scenarios(open_ended=True, roomy=True))
@PROPERTY
def test_every_token_a_backend_sent_is_charged_once_through_faults_and_departures(scenario: Scenario) -> None:
    """Properties 1-3 again, with buckets that admit most requests and more backend faults: more
    streams broken after tokens, clients leaving mid-stream, retries and stalls for property 2."""
    books = run_virtual(play, scenario)
    assert not books.violations, report(books)


# -- defects the property test found ----------------------------------------------------------------------

def one_backend_config(**forward: Any) -> Config:
    config = parse_config({"policy": {"preset": "fifo", "fixed": {"window_ms": 0.0}},
                           "backends": [{"url": "http://a.test", "name": "a", "models": [MODEL], "max_concurrency": 2}],
                           "forward": {"health_interval_s": 1.0, "metrics_interval_s": 0.5, **forward}}, "<test>")
    return attrs.evolve(config, tenants={"t": TenantConfig(rate=100.0, burst=10_000)})


async def stall_then_resume(seed: int) -> tuple | None:
    """The scenario of the test below under scheduling seed ``seed``: None when the request ran
    again, else what was left: (backend healthy, in flight, queued, engine blocked)."""
    import trio._core._run as trio_run  # (private: only to pin the order trio runs ready tasks in)

    trio_run._r.seed(seed)
    config = one_backend_config()
    server = SimulatedServer(models=(MODEL,), slots=1, ttft_s=0.02, tpot_s=0.02)
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), {"a": server})) as pipeline:
        await trio.testing.wait_all_tasks_blocked()
        await pipeline.clock.sleep(0.5)
        server.stalled = True          # (its health check at 1 s times out at 6 s, stall_s 5)
        await pipeline.clock.sleep(0.1)
        request = pipeline.new_request(tenant_id="t", prompt="hello", tokens_requested=500, priority_bid=5,
                                       model=MODEL, api=COMPLETIONS,
                                       payload={"model": MODEL, "prompt": "hello", "max_tokens": 500})
        assert pipeline.admit_now(request)
        await pipeline.clock.sleep(2.4)
        server.stalled = False         # (back before that check times out: the next one passes)
        with trio.move_on_after(120.0):
            await request.reply.wait()
        if request.answered:
            return None
        engine = pipeline.engines[0]
        return engine.backends[0].healthy, engine.backends[0].in_flight, pipeline.scheduler.queue_depth, engine._blocked


def test_a_backend_back_at_once_after_a_failed_health_check_runs_its_requests_again() -> None:
    """A backend stalls with a non-streamed request on it (no token yet) while the engine, with room
    on it, has an ask outstanding with the scheduler. Its health check times out (``stall_s``) and
    marks it down, which hands the request back to the queue; the next check, due already, finds it
    up again at the same instant. The request must run again.

    Whether it does depends on the order trio runs the tasks in that instant: when the scheduler
    answers the outstanding ask while the backend is down (an empty dispatch: no room) and the
    backend's recovery (``ForwardEngine._changed_now``) comes before the engine takes that answer,
    the recovery is dropped (an ask is outstanding), then the empty answer sets ``_blocked`` and the
    engine never asks again: the request stays queued, and so does every later one, while the
    backend sits idle. So the scenario runs under 10 fixed scheduling seeds (pytest-trio makes
    trio's scheduling deterministic; ``trio._core._run._r`` is the generator it draws from)."""
    stranded = [(seed, left) for seed in range(10) if (left := run_virtual(stall_then_resume, seed)) is not None]
    assert not stranded, ("requests left queued for 120 s behind an idle, healthy backend "
                          f"(seed, (healthy, in flight, queued, engine blocked)): {stranded}")


async def watch_for(seconds: float) -> None:
    await trio.sleep(0.1)   # (a daemon's clock starts at whatever trio.current_time() is)
    config = one_backend_config()
    async with open_pipeline(config, build_policies(config), backend_client=SimulatedBackendClient(
            ModelClock(), {"a": SimulatedServer(models=(MODEL,))})) as pipeline:
        await pipeline.clock.sleep(seconds)


def test_the_backend_watcher_keeps_time_whatever_the_clock_started_at() -> None:
    """``ForwardEngine._watch`` decides a health check or a metrics read is due by comparing
    ``clock.now()`` with the model time it is due at, then sleeps until ``clock.deadline()`` of it.
    The two disagree by a rounding error when the pipeline's clock did not start at trio time 0:
    started at 0.1, model time 4.0 is trio time 4.1, but 4.1 - 0.1 is 3.9999999999999996 < 4.0. So
    at trio time 4.1 the check is not due, the sleep returns at once, and the loop spins: in virtual
    time, time stops (an autojump clock never jumps while a task is runnable: :class:`Livelock`
    stops it); in real time it burns a core until the clock passes. (:meth:`ModelClock.reached
    <apsd.core.clock.ModelClock.reached>` is the comparison that agrees with the sleep.)"""
    run_virtual(watch_for, 10.0)   # 10 health checks and 20 metrics reads
