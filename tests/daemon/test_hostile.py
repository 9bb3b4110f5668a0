"""Hostile clients and hostile backends against the daemon and its ``forward`` engine:
nothing either sends may stop the daemon, every client is answered, a client's own error is never
a 5xx, and a tenant's books stay balanced.

Every test runs a real daemon in this process (``start_daemon``) in front of a real HTTP server on
127.0.0.1 port 0, the stand-in backend of ``tests/standin_backend.py``, whose answers the test
scripts. The daemon and the stand-in run in the test's nursery; both stop when the test ends.

* Reproductions of two crashes found by an outside tester (both failed on the code before its fix, commit
  9397ce3): a ``/v1`` body nested 700 or 800 levels deep; a backend's ``usage`` that is not a
  believable count (``"abc"``, ``1e400``, ``[1]``, negative, ``10**12``, beyond ``max_tokens``),
  answered whole or streamed.
* A fuzz test of ``/v1`` bodies (hypothesis): JSON values nested up to 1000 deep, huge, negative,
  fractional and non-standard numbers (``NaN``, ``Infinity``, ``1e400``), lone surrogates, known
  fields of the wrong type, bodies that are not objects at all, in front of a strict stand-in.
* A fuzz test of backend answers: JSON that is not an object, nested deep, cut short, garbage;
  event streams without ``[DONE]``, with error events, non-JSON data, odd ``choices``, cut short,
  stalled; and fuzzed ``usage``.
* Defects the backend fuzz test found, each pinned by a deterministic test after the usage
  reproductions: a stream longer than ``max_tokens`` charged beyond it; ``"choices": 5``
  in a chunk and a 5xx body nested 5000 deep caught only by the last-resort guard; a backend's
  ``NaN`` relayed to the client.

What every answer must satisfy, and the books after it: see :func:`check_answer` and :func:`check_books`.

Hypothesis runs in a worker thread (``trio.to_thread``) posting with a synchronous httpx client,
while the daemon and the stand-in run on the test's trio loop; the thread reads the daemon's books
on that loop (``trio.from_thread``). Every loop is bounded: ``max_examples``, httpx timeouts,
``fail_after`` on every wait. The fuzz tests take 5-20 s each on two loaded cores (more while one
fails: hypothesis shrinks the failing case); the rest of the file about 10 s.
Run: ``.venv/bin/pytest tests/daemon/test_hostile.py``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apsd.core.config import TenantConfig
from apsd.core.hookspecs import hookimpl
from apsd.core.strictjson import MAX_DEPTH
from tests.helpers import (
    WAIT_S,
    LiveDaemon,
    backends_up,
    bucket_level,
    expected_prompt_tokens,
    forwarding_config,
    start_daemon,
    wait_until,
)
from tests.standin_backend import (
    DONE,
    Exchange,
    Reply,
    StandinBackend,
    chat_answer,
    open_standin_backend,
    sse,
    start_standin_backend,
    stream_chunks,
    well_behaved,
)

pytestmark = pytest.mark.timeout(240)

MODEL = "standin"
TENANT = {"X-Apsd-Tenant": "t"}
#: A bucket that holds far more than the tests use and does not refill during a test: what is missing
#: from it at the end is exactly what its requests were charged.
BURST = 10**9
TENANTS = {"t": TenantConfig(rate=1e-6, burst=BURST)}
#: 20 characters: 5 estimated tokens, 9 for a chat message (4 more per message). The stand-in reports
#: fewer (standin_backend.TRUE_PROMPT_TOKENS, or at most PLAUSIBLE_PROMPT below), so a truthful
#: answer never charges a tenant beyond what admission reserved.
PROMPT = "hello there stand-in"
PLAUSIBLE_PROMPT = 5
MESSAGES = [{"role": "user", "content": PROMPT}]
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
#: The longest a fuzzed client may wait for its answer (real seconds, on a loaded machine).
ANSWER_S = 30.0

FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much, HealthCheck.large_base_example])


# -- the daemon in front of the stand-in --------------------------------------------------------------

class Books:
    """A plugin keeping how each request ended: the most it may be charged (its prompt as admission
    estimated it, which the stand-in's truthful counts never pass, and its ``max_tokens``: a request
    reserves an estimate of its output, and is charged beyond that when it generates more, never beyond
    its limit), and what it was charged."""

    def __init__(self) -> None:
        self.finished: list[tuple[str, int, int, Any]] = []

    @hookimpl
    def request_finished(self, request: Any, outcome: Any, now: float) -> None:
        ceiling = request.reserved_tokens - request.reserved_output + request.tokens_requested
        self.finished.append((request.request_id, ceiling, request.used_tokens, outcome))


@attrs.define
class Gateway:
    running: LiveDaemon
    backend: StandinBackend
    books: Books

    @property
    def pipeline(self) -> Any:
        return self.running.daemon.pipeline

    def level(self) -> float:
        """Tokens left in tenant t's bucket (as tests/backends/test_gateway.py reads it)."""
        return bucket_level(self.running.daemon, "t")

    def backend_up(self) -> bool:
        return backends_up(self.running.daemon)()


async def start_gateway(nursery: trio.Nursery, script: Callable[[Exchange], Reply] = well_behaved,
                        **forward: Any) -> Gateway:
    """The stand-in, then a daemon forwarding to it (one backend, ``b0``), once it is up."""
    backend = await start_standin_backend(nursery, script, model=MODEL)
    config = forwarding_config([backend.url], TENANTS, shutdown_grace_s=1.0,
                               **{"metrics_interval_s": 0.5, **forward})
    books = Books()
    running = await start_daemon(nursery, config, plugins=(books,))
    gateway = Gateway(running, backend, books)
    await wait_until(gateway.backend_up, step_s=0.02)
    return gateway


@attrs.frozen
class Snapshot:
    """Tenant t's bucket and counters at one moment, and how many requests had ended then."""

    level: float
    prompt_tokens: int
    generated_tokens: int
    finished: int


def snapshot(gateway: Gateway) -> Snapshot:
    stats = gateway.pipeline.ledger.tenants["t"]
    return Snapshot(gateway.level(), stats.prompt_tokens, stats.generated_tokens, len(gateway.books.finished))


START = Snapshot(level=BURST, prompt_tokens=0, generated_tokens=0, finished=0)


def check_books(gateway: Gateway, since: Snapshot = START) -> None:
    """Nothing outstanding; the counts conserved; tenant t's counters never negative; since
    ``since``, its bucket charged exactly what its counters grew by, and no request that ended
    charged beyond its estimated prompt and its ``max_tokens`` (:class:`Books`)."""
    pipeline = gateway.pipeline
    assert not pipeline.ledger.outstanding
    counts = pipeline.statistics().books.requests
    assert counts.conservation_ok and counts.in_flight == 0, counts
    stats = pipeline.ledger.tenants["t"]
    negative = {k: v for k, v in attrs.asdict(stats).items() if isinstance(v, (int, float)) and v < 0}
    assert not negative, f"tenant t's counters went negative: {negative}"
    now = snapshot(gateway)
    grown = (now.prompt_tokens - since.prompt_tokens, now.generated_tokens - since.generated_tokens)
    assert min(grown) >= 0, f"tenant t's token counters went down: {since} -> {now}"
    charged = since.level - now.level
    assert charged == pytest.approx(sum(grown), abs=1), f"bucket charged {charged}, counters grew {grown}"
    beyond = [(rid, ceiling, used, outcome) for rid, ceiling, used, outcome in gateway.books.finished[since.finished:]
              if not 0 <= used <= ceiling]
    assert not beyond, f"requests charged beyond their prompt and max_tokens (id, most, charged, outcome): {beyond}"


def chat(**extra: Any) -> dict:
    return {"model": MODEL, "messages": MESSAGES, **extra}


def error_of(response: httpx.Response) -> dict:
    """OpenAI's error object of an error answer (asserting its shape)."""
    error = response.json()["error"]
    assert isinstance(error["message"], str) and isinstance(error["code"], str) and isinstance(error["type"], str)
    return error


def strict_json(text: str | bytes) -> Any:
    """JSON as every client reads it: ``NaN`` and ``Infinity`` (Python's extension) refused."""
    def refuse(name: str) -> Any:
        raise AssertionError(f"the answer holds {name}, which is not JSON: {text[:300]!r}")

    return json.loads(text, parse_constant=refuse)


def events_of(text: str, *, strict: bool = False) -> list[Any]:
    """The data of each event of an SSE body: JSON (``strict``: :func:`strict_json`), or ``[DONE]``."""
    data = []
    for event in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line[len("data:"):].strip() for line in event.split("\n") if line.startswith("data:")]
        if lines:
            joined = "\n".join(lines)
            data.append(joined if joined == "[DONE]" else strict_json(joined) if strict else json.loads(joined))
    return data


def nested(depth: int, inner: str = "1", kind: str = "[") -> str:
    """``inner`` inside ``depth`` arrays (or objects ``{"a": ...}``), as JSON text."""
    if kind == "[":
        return "[" * depth + inner + "]" * depth
    return '{"a":' * depth + inner + "}" * depth


def document(fields: dict[str, str]) -> bytes:
    """A JSON object from raw JSON texts of its values (which may be what no encoder writes)."""
    return ("{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in fields.items()) + "}").encode("utf-8", "surrogatepass")


# -- 1a. a body nested deep (a RecursionError in the forward engine's copy used to end the daemon) ----

DEEP_BODIES = {
    "an unknown field 700 deep": document({"model": '"standin"', "messages": json.dumps(MESSAGES),
                                           "max_tokens": "4", "x": nested(700)}),
    "tool_calls 800 deep": document({"model": '"standin"', "max_tokens": "4", "messages": json.dumps(MESSAGES)[:-1]
                                     + ',{"role":"assistant","content":null,"tool_calls":' + nested(800, "{}")
                                     + "}]"}),
    "an unknown object field 980 deep, streamed": document({"model": '"standin"', "messages": json.dumps(MESSAGES),
                                                            "max_tokens": "4", "stream": "true",
                                                            "x": nested(980, "null", kind="{")}),
}


@pytest.mark.parametrize("body", DEEP_BODIES.values(), ids=DEEP_BODIES.keys())
async def test_a_body_nested_too_deep_is_refused_and_the_daemon_stays_up(nursery, body):
    gateway = await start_gateway(nursery)
    client = gateway.running.client
    response = await client.post("/v1/chat/completions", content=body,
                                 headers={**TENANT, "Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert error["code"] == "too_deep" and str(MAX_DEPTH) in error["message"], error
    assert gateway.backend.completions == 0          # (nothing of it went upstream)
    again = await client.post("/v1/chat/completions", json=chat(max_tokens=3), headers=TENANT)
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 3
    assert (await client.get("/health")).status_code == 200
    check_books(gateway)
    gateway.running.daemon.request_shutdown()


async def test_a_body_nested_to_the_limit_passes_through_intact(nursery):
    gateway = await start_gateway(nursery)
    client = gateway.running.client
    # the object is level 1: "x" holds MAX_DEPTH - 1 more levels; one more is refused
    fine = document({"model": '"standin"', "messages": json.dumps(MESSAGES), "max_tokens": "2",
                     "x": nested(MAX_DEPTH - 1)})
    response = await client.post("/v1/chat/completions", content=fine, headers=TENANT)
    assert response.status_code == 200, response.text
    assert gateway.backend.last_completion.json["x"] == json.loads(nested(MAX_DEPTH - 1))
    deeper = document({"model": '"standin"', "messages": json.dumps(MESSAGES), "max_tokens": "2",
                       "x": nested(MAX_DEPTH)})
    response = await client.post("/v1/chat/completions", content=deeper, headers=TENANT)
    assert response.status_code == 400 and error_of(response)["code"] == "too_deep"
    check_books(gateway)
    gateway.running.daemon.request_shutdown()


# -- 1b. a backend's usage that is not a believable count (int("abc") used to end the daemon) -------

MAX_TOKENS = 8
BAD_USAGES = {
    "prompt_tokens is a string": '{"prompt_tokens": "abc", "completion_tokens": 2, "total_tokens": 2}',
    "prompt_tokens is 1e400": '{"prompt_tokens": 1e400, "completion_tokens": 2}',
    "prompt_tokens is a list": '{"prompt_tokens": [1], "completion_tokens": 2}',
    "prompt_tokens is negative": '{"prompt_tokens": -5, "completion_tokens": 2, "total_tokens": -3}',
    "prompt_tokens is 10**12": '{"prompt_tokens": 1000000000000, "completion_tokens": 2}',
    "completion_tokens is negative": '{"prompt_tokens": 3, "completion_tokens": -7, "total_tokens": -4}',
    "completion_tokens exceeds max_tokens": f'{{"prompt_tokens": 3, "completion_tokens": {MAX_TOKENS + 1}}}',
}
USAGE_HOLE = '"__usage__"'


def usage_error(name: str) -> str:
    """The code apsd answers for a bad usage: 1e400 is no finite number, so the whole answer is not
    the JSON apsd accepts from a backend (``backend_failed``, malformed); the rest parse, and are
    impossible counts."""
    return "backend_failed" if "1e400" in name else "backend_invalid_usage"


def with_usage(data: dict, usage: str) -> bytes:
    """``data`` (holding ``usage: "__usage__"``) as JSON text, with the raw ``usage`` text in its place."""
    return json.dumps(data).replace(USAGE_HOLE, usage).encode()


def answer_with_usage(usage: str, *, streamed_tokens: int = 2) -> Callable[[Exchange], Reply]:
    """A script answering every completion request with ``usage`` (raw JSON text): whole, or streamed
    as ``streamed_tokens`` tokens then a usage chunk and ``[DONE]``."""
    def script(exchange: Exchange) -> Reply:
        request = exchange.json
        if not request.get("stream"):
            return Reply(body=with_usage(chat_answer(request, "__usage__"), usage))
        chunks = [sse(chunk) for chunk in stream_chunks(request, streamed_tokens)]
        usage_chunk = {"id": "standin-1", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                       "choices": [], "usage": "__usage__"}
        return Reply(events=[*chunks, b"data: " + with_usage(usage_chunk, usage) + b"\n\n", DONE])
    return script


async def ask_normally_after_recovery(gateway: Gateway) -> None:
    """The daemon is up and serves again once its suspected backend passes its health check."""
    gateway.backend.script = well_behaved
    await wait_until(gateway.backend_up)
    response = await gateway.running.client.post("/v1/chat/completions", json=chat(max_tokens=3), headers=TENANT)
    assert response.status_code == 200, response.text
    assert (await gateway.running.client.get("/health")).status_code == 200


@pytest.mark.parametrize("name", BAD_USAGES)
async def test_an_impossible_usage_fails_the_request_and_charges_nothing_it_did_not_reserve(nursery, name):
    usage = BAD_USAGES[name]
    gateway = await start_gateway(nursery, answer_with_usage(usage))
    client = gateway.running.client
    before = gateway.level()
    response = await client.post("/v1/chat/completions", json=chat(max_tokens=MAX_TOKENS), headers=TENANT)
    assert response.status_code == 502, response.text
    assert error_of(response)["code"] == usage_error(name)
    assert gateway.backend.completions == 1          # (not retried: it is no fault of a backend being down)
    status = gateway.pipeline.tenant_status("t")
    assert status.failed == 1 and status.prompt_tokens == 0 and status.generated_tokens == 0
    assert gateway.level() == pytest.approx(before, abs=1)    # nothing ran that the client received
    assert gateway.pipeline.statistics().backends[0].failures == 1
    check_books(gateway)
    await ask_normally_after_recovery(gateway)
    check_books(gateway)
    gateway.running.daemon.request_shutdown()


@pytest.mark.parametrize("name", BAD_USAGES)
async def test_an_impossible_usage_in_a_streams_last_chunk_ends_it_with_an_error(nursery, name):
    usage = BAD_USAGES[name]
    gateway = await start_gateway(nursery, answer_with_usage(usage, streamed_tokens=2))
    client = gateway.running.client
    response = await client.post("/v1/chat/completions", json=chat(max_tokens=MAX_TOKENS, stream=True),
                                 headers=TENANT)
    # the tokens reached the client (so 200) before the usage came: the stream ends with the error
    # (OpenAI's shape, the 502's code), without [DONE]
    assert response.status_code == 200, response.text
    events = events_of(response.text)
    assert "[DONE]" not in events
    assert events[-1]["error"]["code"] == usage_error(name), events[-1]
    assert events[-1]["error"]["type"] == "server_error"
    text = "".join(c["delta"].get("content") or "" for e in events[:-1] for c in e.get("choices", []))
    assert text == " t0 t1"
    status = gateway.pipeline.tenant_status("t")
    # charged what arrived (apsd's prompt estimate and the 2 tokens), never the backend's figures
    estimate = math.ceil(expected_prompt_tokens("".join(m["content"] for m in MESSAGES))) + 4 * len(MESSAGES)
    assert status.failed == 1 and status.generated_tokens == 2 and 0 <= status.prompt_tokens <= estimate
    check_books(gateway)
    await ask_normally_after_recovery(gateway)
    check_books(gateway)
    gateway.running.daemon.request_shutdown()


async def test_an_impossible_usage_in_a_stream_without_tokens_is_a_502(nursery):
    gateway = await start_gateway(nursery, answer_with_usage(BAD_USAGES["prompt_tokens is a string"],
                                                             streamed_tokens=0))
    response = await gateway.running.client.post("/v1/chat/completions",
                                                 json=chat(max_tokens=MAX_TOKENS, stream=True), headers=TENANT)
    assert response.status_code == 502, response.text
    assert error_of(response)["code"] == "backend_invalid_usage"
    check_books(gateway)
    await ask_normally_after_recovery(gateway)
    gateway.running.daemon.request_shutdown()


async def test_a_stream_longer_than_max_tokens_charges_no_more_than_max_tokens(nursery):
    """A backend that streams more text chunks than the ``max_tokens`` apsd sent, and no usage: the
    tenant must not pay beyond its ``max_tokens`` for the backend's overrun."""
    def script(exchange: Exchange) -> Reply:
        return Reply(events=[sse(c) for c in stream_chunks(exchange.json, MAX_TOKENS + 6)] + [DONE])

    gateway = await start_gateway(nursery, script)
    response = await gateway.running.client.post("/v1/chat/completions",
                                                 json=chat(max_tokens=MAX_TOKENS, stream=True), headers=TENANT)
    assert response.status_code == 200, response.text
    check_books(gateway)
    gateway.running.daemon.request_shutdown()


def unexpected_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What apsd logged at ERROR: its last-resort guard's catches, each a case it did not foresee."""
    return [f"{r.getMessage()}: {r.exc_info[1]!r}" if r.exc_info else r.getMessage()
            for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith("apsd")]


async def test_a_stream_chunk_whose_choices_are_not_a_list_fails_the_request_cleanly(nursery, caplog):
    """``"choices": 5`` in a chunk is a malformed answer like any other: 502 ``backend_failed``, the
    backend suspected; not an unexpected error caught by the last-resort guard."""
    def script(exchange: Exchange) -> Reply:
        return Reply(events=[b'data: {"object": "chat.completion.chunk", "choices": 5}\n\n', DONE])

    gateway = await start_gateway(nursery, script, max_retries=0)
    response = await gateway.running.client.post("/v1/chat/completions",
                                                 json=chat(max_tokens=MAX_TOKENS, stream=True), headers=TENANT)
    assert response.status_code == 502 and error_of(response)["code"] == "backend_failed", response.text
    assert not unexpected_errors(caplog)
    check_books(gateway)
    await ask_normally_after_recovery(gateway)
    gateway.running.daemon.request_shutdown()


async def test_a_5xx_whose_body_is_nested_too_deep_to_read_is_still_a_5xx(nursery, caplog):
    """A backend's 500 answer nested 5000 deep: a 5xx like any other (retried, then 502
    ``backend_failed``), not an unexpected error caught by the last-resort guard."""
    gateway = await start_gateway(nursery, lambda exchange: Reply(status=500, body=nested(5000).encode()),
                                  max_retries=2)
    response = await gateway.running.client.post("/v1/chat/completions", json=chat(max_tokens=MAX_TOKENS),
                                                 headers=TENANT)
    assert response.status_code == 502 and error_of(response)["code"] == "backend_failed", response.text
    assert not unexpected_errors(caplog)
    assert gateway.backend.completions == 3          # (a 5xx is retried: max_retries = 2)
    check_books(gateway)
    gateway.running.daemon.request_shutdown()


NAN_ANSWER = b'{"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", ' \
             b'"content": "x"}, "finish_reason": "length", "logprobs": {"content": [{"logprob": NaN}]}}], ' \
             b'"usage": {"prompt_tokens": 1, "completion_tokens": 1}}'
NAN_CHUNK = b'data: {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "x"}, ' \
            b'"logprobs": {"content": [{"logprob": -Infinity}]}}]}\n\n'


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_non_standard_json_from_a_backend_never_reaches_the_client(nursery, stream):
    """A backend's ``NaN``/``Infinity`` (which Python's parser accepts) must not be relayed: no
    client's JSON parser reads it. A failed request (502) or a standard answer are both fine."""
    gateway = await start_gateway(nursery, lambda exchange: Reply(events=[NAN_CHUNK, DONE]) if stream
                                  else Reply(body=NAN_ANSWER), max_retries=0)
    response = await gateway.running.client.post("/v1/chat/completions",
                                                 json=chat(max_tokens=MAX_TOKENS, stream=stream), headers=TENANT)
    check_answer(response, {200, 502})
    check_books(gateway)
    gateway.running.daemon.request_shutdown()


# -- 2. the stand-in itself -----------------------------------------------------------------------------

async def test_the_standin_speaks_enough_openai_over_real_http_and_stops_with_its_block():
    async with open_standin_backend(model="m") as backend:
        async with httpx.AsyncClient(base_url=backend.url, timeout=10) as client:
            assert (await client.get("/health")).status_code == 200
            assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["m"]
            whole = (await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES,
                                                                      "max_tokens": 2})).json()
            assert whole["usage"]["completion_tokens"] == 2 and whole["choices"][0]["message"]["content"] == "tok tok"
            streamed = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
            events = events_of(streamed.text)
            assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 3
            assert (await client.post("/v1/completions", content=b'{"prompt": NaN}')).status_code == 500
            backend.script = lambda exchange: Reply(body=b'{"cut', cut=True)
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post("/v1/completions", json={})
            assert backend.completions == 4 and backend.last_completion.json == {}
        url = backend.url
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(timeout=5) as client:
            await client.get(url + "/health")


# -- 3. fuzzed /v1 bodies ------------------------------------------------------------------------------

def raw(value: Any) -> str:
    return json.dumps(value)   # (ensure_ascii: a lone surrogate becomes its escape, \ud800)


#: Number texts Python's parser reads into what JSON has no room for, or refuses.
ODD_NUMBERS = ["NaN", "-NaN", "Infinity", "-Infinity", "1e400", "-1e400", "-0", "0e0", "1E+2", "4.0", "1.5",
               "-1", "0", "2147483648", "9223372036854775808", "1" + "0" * 30, "9" * 4301, "5e-324", "-0.0"]
#: Strings with UTF-16 surrogate escapes: lone ones (not text), and one valid pair.
SURROGATES = ['"\\ud800"', '"a\\udc00b"', '"\\udbff\\udbff"', '"\\ud83d\\ude00"', '"\\udfff"']

scalars = st.one_of(
    st.none().map(raw), st.booleans().map(raw), st.integers().map(str),
    st.integers(-(10**40), 10**40).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(raw),
    st.sampled_from(ODD_NUMBERS), st.sampled_from(SURROGATES),
    st.text(st.characters(codec=None), max_size=12).map(raw),
)


def array(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


def obj(pairs: dict[str, str]) -> str:
    return "{" + ",".join(f"{raw(k)}:{v}" for k, v in pairs.items()) + "}"


shallow = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4).map(array)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=4).map(obj), max_leaves=8)
deep = st.builds(nested, st.integers(1, 1000), shallow, st.sampled_from(["[", "{"]))
values = st.one_of(shallow, shallow, shallow, deep)

#: The wrong, odd or hostile values tried for each field apsd knows (besides any value at all).
FIELD_VALUES: dict[str, list[str]] = {
    "model": ['"standin"', '""', '"other"', "5", "null", '["standin"]', '"\\ud800"'],
    "max_tokens": ["-1", "0", "1", "4", "16", "1000000", "1000001", "true", '"4"', "4.0", "4.5", "1e400", "NaN"],
    "max_completion_tokens": ["-1", "0", "3", "4", "true", "1e3"],
    "n_predict": ["-1", "0", "4", "5", "100000", '"4"', "NaN"],
    "max_new_tokens": ["-1", "0", "4", "6", "1.0"],
    "min_tokens": ["-1", "0", "2", "4", "99", '"1"'],
    "temperature": ["0", "0.7", "2", "-1", '"x"', "NaN", "Infinity", "1e400", "true", "[]"],
    "top_p": ["1", "0.5", '"x"', "NaN", "null"],
    "seed": ["1", "-1", "1.5", '"1"', "1" + "0" * 30],
    "stream": ["true", "false", '"yes"', "1", "null"],
    "stream_options": ['{"include_usage": true}', '{"include_usage": false}', '{"include_usage": "yes"}', "[]", "5",
                      '{"x": 1}'],
    "n": ["1", "2", "-1", '"1"', "1.0"],
    "best_of": ["1", "3"],
    "stop": ['"\\n"', '["a", "b"]', "[1]", "5", '"\\ud800"'],
    "user": ['"u"', "5", '"\\udfff"'],
    "tools": ["[]", '[{"type": "function", "function": {"name": "f"}}]', "{}", '"x"'],
    "priority": ["0", "-3", "7", '"high"', "1.5", "1" + "0" * 25],
    "logprobs": ["true", "false", '"yes"', "1"],
    "x": [],
    "extra_body": [],
}
MESSAGE_VALUES: dict[str, list[str]] = {
    "role": ['"user"', '"assistant"', '"system"', '""', "5", "null", '"\\ud800"'],
    "content": [raw(PROMPT), '""', "3", "null", '[{"type": "text", "text": "hi"}]', '[{"type": "image_url", '
                '"image_url": {"url": "http://x"}}]', '[{"type": "image_url", "image_url": 5}]', '[{"type": "x"}]',
                '"\\ud800 lone"', '"\\ud83d\\ude00 pair"'],
    "name": ['"bob"', "5", "null", "[]", '"\\udc00"'],
    "tool_calls": ["[]", '[{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]', "{}",
                   "5"],
}


def field_value(values_of: dict[str, list[str]], name: str) -> st.SearchStrategy[str]:
    listed = values_of.get(name, [])
    return st.one_of(st.sampled_from(listed), st.sampled_from(listed), values) if listed else values


@st.composite
def messages(draw: st.DrawFn) -> str:
    """A list of messages: valid, or with a few of their fields odd."""
    count = draw(st.integers(1, 3))
    items = []
    for _ in range(count):
        message = {"role": '"user"', "content": raw(PROMPT)}
        for name in draw(st.lists(st.sampled_from(sorted(MESSAGE_VALUES)), unique=True, max_size=2)):
            message[name] = draw(field_value(MESSAGE_VALUES, name))
        if draw(st.integers(0, 9)) == 0:
            del message[draw(st.sampled_from(sorted(message)))]
        items.append(obj(message))
    return array(items)


#: Values apsd must accept for the fields it knows (and forward untouched where it does not interpret them).
VALID_VALUES: dict[str, list[str]] = {
    "temperature": ["0", "0.7", "2", "1e-3"], "top_p": ["1", "0.5"], "seed": ["1", "-1", "123456789"],
    "stream": ["true", "false"], "n": ["1"], "stop": ['"\\n"', '["a", "b"]'], "user": ['"u"', '"ünï"'],
    "tools": ["[]", '[{"type": "function", "function": {"name": "f"}}]'], "priority": ["0", "-3", "7"],
    "logprobs": ["true", "false"],
}
#: JSON any parser reads back as it was: finite numbers, real text, nesting well within MAX_DEPTH.
plain = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=10),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8).map(raw)
plain_values = st.one_of(plain, st.builds(nested, st.integers(1, MAX_DEPTH - 10), plain, st.sampled_from(["[", "{"])))
VALID_CONTENTS = [raw(PROMPT), '[{"type": "text", "text": "hi"}]', raw("\U0001f600 ünï"),
                  '[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "text", "text": "what?"}]']


@st.composite
def v1_requests(draw: st.DrawFn) -> tuple[str, bytes, bool]:
    """A path, a body, and whether the body is valid. Mostly a request with a few fields wrong or
    hostile; a third of them valid (odd but valid values, fields apsd does not know); sometimes no
    object at all."""
    api = draw(st.sampled_from(sorted(PATHS)))
    shape = draw(st.integers(0, 19))
    if shape == 0:
        return PATHS[api], draw(values).encode("utf-8", "surrogatepass"), False
    if shape == 1:
        return PATHS[api], draw(st.binary(max_size=40)), False
    fields = {"model": '"standin"'}
    if draw(st.integers(0, 2)) == 0:        # valid
        if api == "chat":
            fields["messages"] = array([obj({"role": '"user"', "content": draw(st.sampled_from(VALID_CONTENTS))})
                                        for _ in range(draw(st.integers(1, 3)))])
        else:
            fields["prompt"] = draw(st.sampled_from([raw(PROMPT), raw([PROMPT]), raw("ünï \U0001f600")]))
        if draw(st.integers(0, 3)):
            fields["max_tokens"] = str(draw(st.integers(1, 8)))
        for name in draw(st.lists(st.sampled_from(sorted(VALID_VALUES)), unique=True, max_size=4)):
            fields[name] = draw(st.sampled_from(VALID_VALUES[name]))
        for name in draw(st.lists(st.sampled_from(["x", "extra_body", "chat_template_kwargs"]), unique=True,
                                  max_size=2)):
            fields[name] = draw(plain_values)
        return PATHS[api], document(fields), True
    if api == "chat":
        fields["messages"] = draw(messages()) if draw(st.booleans()) else raw(MESSAGES)
    else:
        fields["prompt"] = draw(st.sampled_from([raw(PROMPT), raw([PROMPT]), '"\\ud800"', "[1, 2]", '["a", "b"]',
                                                 "5", "null", '""']))
    if draw(st.integers(0, 3)):
        fields["max_tokens"] = str(draw(st.integers(1, 8)))
    if draw(st.booleans()):
        fields["stream"] = "true"
    for name in draw(st.lists(st.sampled_from(sorted(FIELD_VALUES)), unique=True, max_size=4)):
        fields[name] = draw(field_value(FIELD_VALUES, name))
    if draw(st.integers(0, 14)) == 0:
        del fields[draw(st.sampled_from(sorted(fields)))]
    body = document(fields)
    if shape == 2:     # cut short
        body = body[:draw(st.integers(0, len(body) - 1))]
    return PATHS[api], body, False


#: What a client's own error may get (404: a model not served; 413: a prompt too long). A 5xx is the
#: backend's fault or apsd's, never the client's; the stand-in here is strict but never fails.
CLIENT_STATUSES = {200, 400, 404, 413, 422}


def check_answer(response: httpx.Response, allowed: set[int]) -> None:
    """A status in ``allowed``; JSON (standard JSON: no ``NaN``, which Python's parser would take)
    in OpenAI's error shape for an error; a stream whose every event is a JSON object, ending
    ``[DONE]`` or with an error event."""
    assert response.status_code in allowed, (response.status_code, response.text[:500])
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.status_code == 200
        events = events_of(response.text, strict=True)
        assert events, response.text[:500]
        assert "[DONE]" not in events[:-1], events
        assert events[-1] == "[DONE]" or "error" in events[-1], events[-1]
        assert all(isinstance(e, dict) for e in events if e != "[DONE]")
        return
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    data = strict_json(response.content)
    assert isinstance(data, dict), data
    if response.status_code != 200:
        error_of(response)


async def run_fuzz(gateway: Gateway, caplog: pytest.LogCaptureFixture, strategy: st.SearchStrategy,
                   max_examples: int, example: Callable[[httpx.Client, Any], None]) -> None:
    """Hypothesis runs ``example`` (with a client of the daemon and a case drawn from ``strategy``)
    in a worker thread; after each, once nothing is outstanding, :func:`check_books` since the
    example began, and no ERROR in apsd's log (its last-resort guard catches what it did not expect)."""
    def on_loop(function: Callable[..., Any], *args: Any) -> Any:
        return trio.from_thread.run_sync(function, *args)

    def settle_and_check(before: Snapshot, errors_before: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while on_loop(lambda: bool(gateway.pipeline.ledger.outstanding)):
            assert time.monotonic() < deadline, f"requests still outstanding {WAIT_S:.0f} s after their answers"
            time.sleep(0.005)
        on_loop(check_books, gateway, before)
        unexpected = unexpected_errors(caplog)[errors_before:]
        assert not unexpected, f"apsd logged errors (its last-resort guard fired?): {unexpected}"

    def fuzz() -> None:
        with httpx.Client(base_url=gateway.running.url, timeout=httpx.Timeout(ANSWER_S + 10)) as client:
            def one(case: Any) -> None:
                before = on_loop(snapshot, gateway)
                errors_before = len(unexpected_errors(caplog))
                example(client, case)
                settle_and_check(before, errors_before)

            given(strategy)(settings(FUZZ, max_examples=max_examples)(one))()

    await trio.to_thread.run_sync(fuzz)


async def test_fuzzed_v1_bodies_never_crash_the_daemon_nor_get_a_5xx(nursery, caplog):
    caplog.set_level(logging.WARNING, logger="apsd")
    gateway = await start_gateway(nursery)

    def example(client: httpx.Client, case: tuple[str, bytes, bool]) -> None:
        path, body, valid = case
        sent = gateway.backend.completions
        response = client.post(path, content=body, headers={**TENANT, "Content-Type": "application/json"})
        check_answer(response, CLIENT_STATUSES)
        failures = trio.from_thread.run_sync(lambda: gateway.pipeline.statistics().backends[0].failures)
        assert failures == 0, f"a client's body was blamed on the backend: {response.status_code} {response.text[:300]}"
        if not valid:
            return
        # a valid body is answered, and what apsd does not interpret reaches the backend untouched
        assert response.status_code == 200, response.text[:500]
        assert gateway.backend.completions == sent + 1
        forwarded = gateway.backend.last_completion.json
        for key, value in json.loads(body).items():
            if key not in ("max_tokens", "stream", "priority"):
                assert forwarded[key] == value, key

    await run_fuzz(gateway, caplog, v1_requests(), 150, example)
    assert (await gateway.running.client.get("/health")).status_code == 200
    backend = gateway.pipeline.statistics().backends[0]
    assert backend.failures == 0 and backend.healthy      # (no client's error was blamed on it)
    gateway.running.daemon.request_shutdown()


# -- 4. fuzzed backend answers ---------------------------------------------------------------------------

usage_counts = st.one_of(st.integers(0, PLAUSIBLE_PROMPT).map(str), st.sampled_from(
    ["-1", "-5", '"3"', '"abc"', "1e400", "NaN", "Infinity", "[1]", "{}", "null", "true", "2.0", "2.5",
     "1000000000000", "1" + "0" * 40, "9" * 4301]))


@st.composite
def usages(draw: st.DrawFn, max_tokens: int) -> str:
    """A ``usage``: believable (prompt <= PLAUSIBLE_PROMPT, completion <= max_tokens) or not."""
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.sampled_from(["null", "5", '"x"', "[]", '{"prompt_tokens": {"a": [1]}}', nested(900)]))
    fields = {}
    for key, plausible in (("prompt_tokens", st.integers(0, PLAUSIBLE_PROMPT)),
                           ("completion_tokens", st.integers(0, max_tokens + 2))):
        if draw(st.integers(0, 9)):
            fields[key] = draw(st.one_of(plausible.map(str), usage_counts))
    if draw(st.booleans()):
        fields["total_tokens"] = draw(usage_counts)
    return obj(fields)


ODD_CHOICES = ["5", "null", "[1]", '[{"delta": 5}]', '[{"delta": {"content": 5}}]', '[{"text": ["a"]}]',
               '[{"delta": {"content": "\\ud800"}}]', "[" + nested(500, "{}") + "]", '[{"index": 0}]', "{}",
               '[{"delta": {"content": "x"}}, {"delta": {"content": "y"}}]']
GARBAGE = [b"", b"null", b"[]", b'"text"', b"42", b"{", b'{"choices": ', b"<html>502</html>", b"\xff\xfe\x00",
           b"NaN", b"data: {}", b'{"error": "overloaded"}', b'{"error": {"message": "oops"}}']


@st.composite
def stream_events(draw: st.DrawFn, request: dict, max_tokens: int) -> list[bytes]:
    """The raw events of a fuzzed stream: tokens, odd chunks, error events, garbage; usage or not."""
    tokens = draw(st.integers(0, max_tokens))
    chunks = [sse(c) for c in stream_chunks(request, tokens)]
    for _ in range(draw(st.integers(0, 3))):
        odd = draw(st.one_of(
            st.sampled_from(ODD_CHOICES).map(lambda c: b'data: {"object": "chat.completion.chunk", "choices": '
                                             + c.encode() + b"}\n\n"),
            st.sampled_from(GARBAGE).map(lambda g: b"data: " + g + b"\n\n"),
            st.sampled_from([b": ping\n\n", b"event: error\ndata: {\"error\": {\"message\": \"boom\"}}\n\n",
                             b"retry: 5\n\n", b"data: [DONE]\n\n", b"\n\n", b"data:\n\n", b"id: 1\n\n",
                             b"data: " + nested(3000).encode() + b"\n\n",
                             b"data: " + nested(200, "1", "{").encode() + b"\n\n"]),
        ))
        chunks.insert(draw(st.integers(0, len(chunks))), odd)
    if draw(st.integers(0, 3)):
        usage_chunk = ('{"object": "chat.completion.chunk", "choices": [], "usage": '
                       + draw(usages(max_tokens)) + "}")
        chunks.append(b"data: " + usage_chunk.encode() + b"\n\n")
    if draw(st.integers(0, 3)):
        chunks.append(DONE)
    return chunks


@st.composite
def whole_bodies(draw: st.DrawFn, request: dict, max_tokens: int) -> bytes:
    kind = draw(st.integers(0, 4))
    if kind == 0:
        return draw(st.sampled_from(GARBAGE + [nested(5000).encode(), nested(950, "{}", "{").encode(),
                                               b'{"choices": ' + nested(990).encode() + b"}"]))
    if kind == 1:
        return draw(st.binary(max_size=30))
    answer = chat_answer(request, "__usage__")
    if kind == 2:
        answer["choices"] = "__choices__"
        return with_usage(answer, draw(usages(max_tokens))).replace(
            b'"__choices__"', draw(st.sampled_from(ODD_CHOICES)).encode())
    return with_usage(answer, draw(usages(max_tokens)))


@st.composite
def backend_cases(draw: st.DrawFn) -> tuple[str, dict, Reply]:
    """A client's valid request and the stand-in's (fuzzed) answer to it."""
    api = draw(st.sampled_from(sorted(PATHS)))
    max_tokens = draw(st.integers(1, 6))
    stream = draw(st.booleans())
    request: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens}
    if api == "chat":
        request["messages"] = MESSAGES
    else:
        request["prompt"] = PROMPT
    if stream:
        request["stream"] = True
        if draw(st.booleans()):
            request["stream_options"] = {"include_usage": True}
    stall = draw(st.sampled_from([0.0] * 12 + [STALL_S]))
    cut = draw(st.integers(0, 7)) == 0
    if stream and draw(st.integers(0, 7)):
        gap = draw(st.sampled_from([0.0] * 12 + [STALL_S]))
        reply = Reply(events=draw(stream_events(request, max_tokens)), stall_s=stall, gap_s=gap, cut=cut)
    else:
        # (a 4xx is the backend saying the request is at fault: relayed, by design; not fuzzed here)
        status = draw(st.sampled_from([200, 200, 200, 200, 200, 500, 503, 429]))
        reply = Reply(status=status, body=draw(whole_bodies(request, max_tokens)), stall_s=stall, cut=cut,
                      content_type=draw(st.sampled_from(["application/json", "text/plain", "text/event-stream"])))
    return PATHS[api], request, reply


#: Silence longer than the daemon's first_token_timeout_s and read_timeout_s below (BACKEND_TIMEOUT_S).
STALL_S = 0.4
BACKEND_TIMEOUT_S = 0.25
#: What a client may get for a backend's fault: its request failed (502), timed out (504), or found
#: the backend marked down (503); never a 4xx.
BACKEND_FAULT_STATUSES = {200, 502, 503, 504}


async def test_fuzzed_backend_answers_never_crash_the_daemon_and_keep_the_books(nursery, caplog):
    caplog.set_level(logging.WARNING, logger="apsd")
    current: list[Reply] = [Reply()]
    gateway = await start_gateway(nursery, lambda exchange: current[0], health_interval_s=0.05,
                                  first_token_timeout_s=BACKEND_TIMEOUT_S, read_timeout_s=BACKEND_TIMEOUT_S,
                                  max_retries=1, no_backend_wait_s=5.0)

    def example(client: httpx.Client, case: tuple[str, dict, Reply]) -> None:
        path, request, reply = case
        deadline = time.monotonic() + WAIT_S
        while not trio.from_thread.run_sync(gateway.backend_up):   # (suspected by the example before)
            assert time.monotonic() < deadline, f"the stand-in was not found healthy again within {WAIT_S:.0f} s"
            time.sleep(0.01)
        current[0] = reply
        started = time.monotonic()
        response = client.post(path, json=request, headers=TENANT)
        # bounded by the timeouts above (seconds), far below the defaults' (first token: 120 s)
        assert time.monotonic() - started < ANSWER_S, f"a client waited more than {ANSWER_S:.0f} s for its answer"
        check_answer(response, BACKEND_FAULT_STATUSES)

    await run_fuzz(gateway, caplog, backend_cases(), 100, example)
    current[0] = Reply()
    gateway.backend.script = well_behaved
    await wait_until(gateway.backend_up)
    response = await gateway.running.client.post("/v1/chat/completions", json=chat(max_tokens=2), headers=TENANT)
    assert response.status_code == 200, response.text
    check_books(gateway)
    gateway.running.daemon.request_shutdown()
