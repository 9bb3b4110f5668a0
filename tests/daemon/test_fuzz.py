"""Hostile clients against the real daemon: property-based fuzzing of the HTTP API.

The daemon under test is the installed ``apsd`` command, started once for this module as a
subprocess on ``127.0.0.1`` port 0 (its URL read from its log), with built-in plugins only and a
fast GPU (``gpu.time_scale = 1e-4``). Hypothesis drives plain sync tests that post with a
synchronous ``httpx.Client``; no trio loop is shared between hypothesis and pytest-trio.

What is generated: JSON values of every kind (huge integers, NaN/Infinity, lone surrogates,
nesting), objects with the expected keys holding right and wrong values, raw byte bodies (random
and mutated valid JSON), random methods, paths, query strings and header sets, and Accept headers
for ``/metrics``. What must hold for every answer:

* never a 500, and the status is one of 200, 400, 404, 405, 413, 422, 429, 503, 504;
* the body never holds a traceback or HTML; every non-empty body is JSON, with string ``error``
  and ``message`` on errors (except the Prometheus text of ``GET /metrics``);
* ``POST /infer`` answers exactly what the rules in docs/reference/http-api.md say (an oracle below recomputes the
  expected status and error code from the body sent);
* ``POST /v1/chat/completions`` and ``/v1/completions`` (OpenAI-shaped bodies, valid or with one
  field or header wrong) answer either OpenAI's error object (string ``message``, ``type`` and
  ``code``; ``param`` a string or null) or exactly the tokens asked for, as one answer or as a
  stream that ends ``[DONE]``;
* clients that give up at random moments (queued, running, not yet read) leave the books balanced;
* afterwards the daemon still answers ``/health``, ``/metrics.json`` shows ``conservation_ok``,
  nothing in flight, no ``internal_error``, and its log holds no traceback.

A second daemon has API keys and listens on every address: callers with each key, no key, a
mutated key, a garbage ``Authorization`` or the wrong scheme get exactly the status their key
allows on every endpoint, and no key ever appears in an answer or in its DEBUG log.

Defects this file found are each pinned by a deterministic test at its end (an early answer that
left a keep-alive connection dead; an HTML redirect for "//" in a path): both are fixed.

Every loop is bounded: ``max_examples`` per test, timeouts on every request, ``fail_after`` on waits.
Run: ``/tmp/venv/bin/pytest -q -p no:cacheprovider tests/daemon/test_fuzz.py`` (about 15 s).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import attrs
import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apsd.core.models import Completion
from tests.helpers import WAIT_S, expected_prompt_tokens

APSD = str(Path(sys.executable).with_name("apsd"))
LISTENING = re.compile(r"apsd listening on (http://\S+)")

MAX_BODY = 65_536
KV_CAP = 32_768  # gpu.kv_cap_tokens (default): the micro engine's batch
#: name -> burst. Rates are huge except trickle's (1e-6 tokens per model second: after its first
#: 100 tokens it is rate limited for the rest of the run).
TENANTS = {"alpha": 5_000, "beta": 1_000_000, "trickle": 100, "ünï cødé": 50_000}
CONFIG = f"""
[server]
max_body_bytes = {MAX_BODY}
shutdown_grace_s = 5.0
[gpu]
time_scale = 0.0001
[tenants.alpha]
rate = 1e9
burst = {TENANTS["alpha"]}
[tenants.beta]
rate = 1e9
burst = {TENANTS["beta"]}
[tenants.trickle]
rate = 1e-6
burst = {TENANTS["trickle"]}
[tenants."ünï cødé"]
rate = 1e9
burst = {TENANTS["ünï cødé"]}
"""

#: (504 queue_timeout: a body's own timeout_s can expire in the queue; 502 needs fault injection, off here)
ALLOWED_STATUSES = {200, 400, 401, 403, 404, 405, 413, 422, 429, 503, 504}
FIELDS = {"tenant_id": str, "prompt": str, "tokens_requested": int, "priority_bid": int}
OPTIONAL_FIELDS = {"timeout_s"}
COMPLETION_KEYS = {field.name for field in attrs.fields(Completion)} - {"response", "response_bytes"}  # (/v1 only)

FUZZ = settings(max_examples=300, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


# -- the daemon ---------------------------------------------------------------------------------

class Apsd:
    def __init__(self, process: subprocess.Popen, url: str, log_path: Path) -> None:
        self.process, self.url, self.log_path = process, url, log_path
        self.client = httpx.Client(base_url=url, timeout=30)

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


@contextlib.contextmanager
def launch(directory: Path, config_text: str) -> Iterator[Apsd]:
    """The installed apsd on 127.0.0.1:0 with ``config_text``; SIGTERM at the end must exit 0, no traceback."""
    config = directory / "apsd.toml"
    config.write_text(config_text, encoding="utf-8")
    log_path = directory / "apsd.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen([APSD, str(config), "--port", "0", "--log-level", "DEBUG"],
                                   stdout=subprocess.DEVNULL, stderr=log_file,
                                   env={**os.environ, "APSD_PLUGINS": "", "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 30
        while not (match := LISTENING.search(log_path.read_text(encoding="utf-8", errors="replace"))):
            assert process.poll() is None, f"apsd exited before listening:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"apsd did not listen within 30 s:\n{log_path.read_text()}"
            time.sleep(0.05)
        running = Apsd(process, match.group(1), log_path)
        with running.client:
            yield running
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert "Traceback" not in running.log()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="module")
def apsd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Apsd]:
    with launch(tmp_path_factory.mktemp("fuzz"), CONFIG) as running:
        yield running


# -- strategies ---------------------------------------------------------------------------------

#: Any code point, lone surrogates included (json.dumps escapes them; json.loads gives them back).
any_text = st.text(st.characters(codec=None), max_size=40)
huge_ints = st.one_of(st.integers(), st.integers(min_value=-(10**60), max_value=10**60),
                      st.sampled_from([2**31, 2**63, 2**64 + 1, 10**18, 10**4000, -(10**4000),
                                       1_000_000_000, 1_000_000_001]))
scalars = st.one_of(st.none(), st.booleans(), huge_ints, st.floats(allow_nan=True, allow_infinity=True), any_text,
                    st.sampled_from(["NaN", "Infinity", "-0", "1e999", "0x10", "١٢٣", "5 ", " 5", "", "\x00"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(any_text, inner, max_size=4), max_leaves=12)

tenant_values = st.one_of(st.sampled_from(sorted(TENANTS)), st.sampled_from(sorted(TENANTS)),
                          any_text, st.sampled_from(["", "   ", "\t\n", "ALPHA", "alpha ", "x" * 256, "x" * 257]),
                          json_values)
prompt_values = st.one_of(any_text, st.just(""), st.integers(0, 140_000).map(lambda n: "p" * n),
                          st.integers(0, 20_000).map(lambda n: "\U0001f600" * n), json_values)
token_values = st.one_of(st.integers(-3, 40), st.integers(1, 40_000), st.integers(1, 1_200_000),
                         huge_ints, st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                         st.sampled_from(["100", "NaN", None]), json_values)
bid_values = st.one_of(st.integers(-2, 13), huge_ints, st.floats(allow_nan=True, allow_infinity=True),
                       st.booleans(), st.sampled_from(["5", None, []]), json_values)
timeout_values = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(1e-3, 1e6), huge_ints,
                           st.sampled_from([5e-324, 1e-300, 0, -0.0, 86_400, 86_401, True, "1", None]), json_values)


@st.composite
def infer_objects(draw: st.DrawFn) -> dict:
    """Objects shaped like an /infer body: usually the four fields, each right or wrong,
    sometimes with one missing or with extra keys."""
    obj = {"tenant_id": draw(tenant_values), "prompt": draw(prompt_values),
           "tokens_requested": draw(token_values), "priority_bid": draw(bid_values)}
    if draw(st.integers(0, 3)) == 0:
        obj["timeout_s"] = draw(timeout_values)
    if draw(st.integers(0, 9)) == 0:
        del obj[draw(st.sampled_from(sorted(obj)))]
    if draw(st.integers(0, 9)) == 0:
        obj.update(draw(st.dictionaries(any_text, json_values, min_size=1, max_size=2)))
    return obj


@st.composite
def valid_objects(draw: st.DrawFn) -> dict:
    """Bodies that pass validation (admission may still refuse them)."""
    return {"tenant_id": draw(st.sampled_from(sorted(TENANTS))), "prompt": draw(any_text | st.just("")),
            "tokens_requested": draw(st.integers(1, 6_000)), "priority_bid": draw(st.integers(1, 10))}


def mutate(raw: bytes, position: int, kind: int, junk: bytes) -> bytes:
    position %= len(raw) + 1
    if kind == 0:
        return raw[:position]                               # truncated
    if kind == 1:
        return raw[:position] + junk + raw[position:]       # inserted garbage
    return raw[:position] + junk + raw[position + len(junk):]  # overwritten


def encode_unescaped(obj: dict, encoding: str) -> bytes:
    """Non-ASCII text sent as is, in another encoding than UTF-8 (json.loads detects UTF-16/32)."""
    return json.dumps(obj, ensure_ascii=False).encode(encoding, "surrogatepass" if encoding.startswith("utf")
                                                      else "replace")


ODD_BODIES = [b"{" * 100_000, b"[" * 60_000, b"9" * 5_000, b'{"tenant_id": ' + b"9" * 5_000 + b"}",
              b"\xef\xbb\xbf{}", b"{}\x00", b'{"a":1,"a":2}', b"NaN", b"-Infinity", b" ", b"\n", b"\x00" * 10]

raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.builds(mutate, st.builds(lambda o: json.dumps(o).encode(), valid_objects()), st.integers(0, 400),
              st.integers(0, 2), st.binary(min_size=1, max_size=8)),
    st.builds(encode_unescaped, valid_objects(), st.sampled_from(["utf-8", "utf-16", "utf-16-le", "utf-32", "latin-1"])),
    st.sampled_from(range(len(ODD_BODIES))).map(ODD_BODIES.__getitem__),
)

TOKEN_CHARS = "!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
              "keep-alive", "expect", "proxy-connection"}
header_names = st.one_of(st.sampled_from(["content-type", "accept", "accept-encoding", "content-encoding",
                                          "user-agent", "x-forwarded-for", "authorization", "cookie", "range",
                                          "if-none-match", "origin"]),
                         st.text(TOKEN_CHARS, min_size=1, max_size=20)).filter(lambda n: n.lower() not in HOP_BY_HOP)
header_values = st.one_of(
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=60),
    st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                     "multipart/form-data; boundary=x", "application/json; charset=utf-16", "gzip", "deflate, br",
                     "*/*", "application/json;q=nan", "application/json;q=1e999", "bytes=0-1"]))
headers = st.dictionaries(header_names, header_values, max_size=4)

KNOWN_PATHS = ["/infer", "/health", "/metrics", "/metrics.json", "/tenants/alpha/status",
               "/tenants/%C3%BCn%C3%AF%20c%C3%B8d%C3%A9/status", "/", "/infer/", "/metrics.json/", "/x//y"]
paths = st.one_of(
    st.sampled_from(KNOWN_PATHS),
    st.lists(any_text.map(lambda s: quote(s.encode("utf-8", "surrogatepass"), safe="")), min_size=1,
             max_size=4).map(lambda parts: "/" + "/".join(parts)),
    st.builds(lambda name: f"/tenants/{quote(name.encode('utf-8', 'surrogatepass'), safe='')}/status", any_text),
    st.text(st.sampled_from("/.%2Fabc?&=#;"), max_size=20).map(lambda s: "/" + s),
).filter(lambda path: not path.startswith("//"))  # (httpx would read "//x" as a host)
methods = st.one_of(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
                    st.text(TOKEN_CHARS, min_size=1, max_size=10))
def percent(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


queries = st.dictionaries(st.sampled_from(["format", "tenant", "q", ""]) | any_text, any_text, max_size=3).map(
    lambda query: "&".join(f"{percent(k)}={percent(v)}" for k, v in query.items()))


# -- the oracle ---------------------------------------------------------------------------------

def expected_infer(raw: bytes) -> tuple[set[int], dict[str, str] | None]:
    """What docs/reference/http-api.md's rules say ``POST /infer`` answers for body ``raw``.

    Returns the acceptable statuses, and for a 422 the faulty fields with the error each
    would produce (the daemon names one of them; which one is not specified).
    """
    if len(raw) > MAX_BODY:
        return {413}, {"": "body_too_large"}
    repeated: list[str] = []

    def pairs(items: list[tuple[str, object]]) -> dict:
        keys = [k for k, _ in items]
        repeated.extend(k for i, k in enumerate(keys) if k in keys[:i])
        return dict(items)

    nonstandard: list[str] = []

    def constant(name: str) -> float:
        nonstandard.append(name)
        return 0.0

    try:
        data = json.loads(raw, object_pairs_hook=pairs, parse_constant=constant)
    except RecursionError:
        return {400}, {"": "too_deep"}
    except ValueError:
        return {400}, {"": "invalid_json"}
    # document-level faults: which one apsd names first depends on where each sits in the text
    document = {f"{i}": fault for i, fault in enumerate(
        (["invalid_json"] if nonstandard or _has_lone_surrogate(data) else [])
        + (["duplicate_key"] if repeated else []) + (["too_deep"] if _depth(data) > 100 else []))}
    if document:
        return {400}, document
    if not isinstance(data, dict):
        return {400}, {"": "invalid_json"}
    faults = {name: "unknown_field" for name in data if name not in FIELDS and name not in OPTIONAL_FIELDS}
    for name, kind in FIELDS.items():
        if name not in data:
            faults[name] = "missing_field"
        elif not isinstance(data[name], kind) or isinstance(data[name], bool):
            faults[name] = "invalid_field"
    if not faults:
        tenant, tokens, bid = data["tenant_id"], data["tokens_requested"], data["priority_bid"]
        if not tenant.strip() or len(tenant) > 256:
            faults["tenant_id"] = "invalid_field"
        if not 1 <= tokens <= 1_000_000_000:
            faults["tokens_requested"] = "invalid_field"
        if not 1 <= bid <= 10:
            faults["priority_bid"] = "invalid_field"
    if "timeout_s" in data:
        timeout = data["timeout_s"]
        if (not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0
                or timeout == math.inf):
            faults["timeout_s"] = "invalid_field"
    if faults:
        return {422}, faults
    tenant = data["tenant_id"]
    if tenant not in TENANTS:
        return {404}, {"tenant_id": "unknown_tenant"}
    prompt = math.ceil(expected_prompt_tokens(data["prompt"]))
    cost = prompt + data["tokens_requested"]
    if prompt > TENANTS[tenant]:   # (a larger output limit is admitted: it reserves what it will probably use)
        return {413}, {"": "exceeds_tenant_burst"}
    if cost > KV_CAP:
        return {413}, {"": "exceeds_batch_capacity"}
    if tenant == "trickle":
        return {200, 429}, {"": "rate_limited"}
    if "timeout_s" in data:  # (a tiny timeout_s may expire in the queue)
        return {200, 504}, {"": "queue_timeout"}
    return {200}, None


#: What a Python traceback in an answer looks like (a client's own text echoed in a message, a tenant named
#: "Traceback" say, is not one).
TRACEBACK = re.compile(r'Traceback \(most recent call last\)|File "[^"]*", line \d+')


def check_no_leak(response: httpx.Response) -> None:
    assert response.status_code != 500, response.text
    assert response.status_code in ALLOWED_STATUSES, (response.status_code, response.text)
    text = response.text
    assert not TRACEBACK.search(text), text
    assert not text.lstrip().lower().startswith(("<html", "<!doctype")), text   # (a framework's HTML error page)


def check_json_answer(response: httpx.Response) -> dict:
    check_no_leak(response)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    data = response.json()
    assert isinstance(data, dict)
    if response.status_code != 200:
        assert isinstance(data.get("error"), str) and data["error"], data
        assert isinstance(data.get("message"), str) and data["message"], data
        assert set(data) <= {"error", "message", "field"}, data
    return data


def post_infer(apsd: Apsd, raw: bytes, extra_headers: dict[str, str] | None = None) -> None:
    headers = {"content-type": "application/json", **(extra_headers or {})}
    if len(raw) > MAX_BODY:  # (a connection that got a 413 may be dead: see test_a_413_leaves_the_connection_usable)
        headers["connection"] = "close"
    response = apsd.client.post("/infer", content=raw, headers=headers)
    data = check_json_answer(response)
    origin = next((v for k, v in headers.items() if k.lower() == "origin"), None)
    if origin is not None and origin.lower().split("://", 1)[-1].rstrip("/") != apsd.client.base_url.netloc.decode():
        # no keys: a browser's request from another origin changes nothing, whatever its body
        assert (response.status_code, data["error"]) == (403, "cross_site_request"), (data, origin)
        return
    statuses, faults = expected_infer(raw)
    assert response.status_code in statuses, (response.status_code, data, raw[:200])
    if response.status_code == 200:
        sent = json.loads(raw)
        assert set(data) == COMPLETION_KEYS, data
        assert data["tenant_id"] == sent["tenant_id"]
        assert data["tokens_generated"] == sent["tokens_requested"]
        # the estimate (docs/reference/accounting.md)
        assert data["prompt_tokens"] == math.ceil(expected_prompt_tokens(sent["prompt"]))
        assert "RateLimit" in response.headers and "RateLimit-Policy" in response.headers
        return
    assert faults is not None
    if response.status_code == 422:
        assert data.get("field") in faults, (data, faults)
        assert data["error"] == faults[data["field"]], (data, faults)
    elif data.get("field") == "tenant_id" and response.status_code == 404:
        assert data["error"] == "unknown_tenant"
    else:
        assert data["error"] in faults.values(), (data, faults)
    if response.status_code == 429:
        assert int(response.headers["Retry-After"]) >= 1


def _depth(value: object) -> int:
    """Nesting depth of arrays and objects (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _has_lone_surrogate(value: object) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if any(0xD800 <= ord(c) <= 0xDFFF for c in item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


# -- the properties -----------------------------------------------------------------------------

@FUZZ
@given(body=st.one_of(infer_objects(), infer_objects(), valid_objects(), json_values))
def test_infer_json_bodies_get_the_documented_answer(apsd, body):
    post_infer(apsd, json.dumps(body, allow_nan=True).encode())


@FUZZ
@given(raw=raw_bodies, extra=headers)
def test_infer_raw_bodies_never_break_the_parser(apsd, raw, extra):
    post_infer(apsd, raw, extra)


@FUZZ
@given(method=methods, path=paths, query=queries, extra=headers,
       body=st.none() | st.binary(max_size=200) | valid_objects().map(lambda o: json.dumps(o).encode()))
def test_any_request_gets_a_json_answer_or_metrics_text(apsd, method, path, query, extra, body):
    target = f"{path}?{query}" if query and "?" not in path else path
    response = apsd.client.request(method, target, headers=extra, content=body)
    check_no_leak(response)
    if method == "HEAD" or (method == "OPTIONS" and response.status_code == 200):
        assert response.content == b""   # (Quart's automatic OPTIONS answer: an empty 200 with Allow)
        return
    content_type = response.headers.get("content-type", "")
    if response.status_code == 200 and not content_type.startswith("application/json"):
        # the one non-JSON answer: the Prometheus exposition of GET /metrics
        assert content_type.startswith(("text/plain", "application/openmetrics-text")), response.headers
        assert "apsd_conservation_ok" in response.text
        return
    check_json_answer(response)


@FUZZ
@given(accept=st.none() | header_values | st.lists(
           st.tuples(st.sampled_from(["application/json", "text/plain", "application/openmetrics-text", "*/*",
                                      "text/*", "application/*", "text/html"]),
                     st.none() | st.floats(-1, 2) | st.sampled_from(["nan", "inf", "1e999", "x", ""])),
           max_size=4).map(lambda parts: ", ".join(m if q is None else f"{m};q={q}" for m, q in parts)),
       fmt=st.none() | st.sampled_from(["json", "prometheus", "JSON", "", "text"]) | any_text)
def test_metrics_negotiation_never_fails(apsd, accept, fmt):
    response = apsd.client.get("/metrics" if fmt is None else f"/metrics?format={percent(fmt)}",
                               headers={} if accept is None else {"accept": accept})
    check_no_leak(response)
    if fmt is not None and fmt not in ("json", "prometheus"):
        assert response.status_code == 400 and response.json()["error"] == "invalid_format"
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("application/json"):
        assert fmt != "prometheus"
        assert response.json()["requests"]["conservation_ok"] is True
    else:
        assert fmt != "json"
        assert "apsd_conservation_ok" in response.text


@FUZZ
@given(name=st.sampled_from(sorted(TENANTS)) | any_text.filter(lambda name: "/" not in name))  # see the 308 test
def test_tenant_status_by_any_name(apsd, name):
    response = apsd.client.get(f"/tenants/{quote(name.encode('utf-8', 'surrogatepass'), safe='')}/status")
    data = check_json_answer(response)
    if name in TENANTS:
        assert response.status_code == 200 and data["tenant_id"] == name and data["burst"] == TENANTS[name]
    else:
        assert response.status_code == 404 and data["error"] in {"unknown_tenant", "not_found"}


# -- the OpenAI-compatible API ----------------------------------------------------------------------

MODEL = "apsd-batch"
message_values = st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]), json_values, max_size=3)


@st.composite
def openai_requests(draw: st.DrawFn) -> tuple[str, dict, dict]:
    """A path, a body shaped like an OpenAI request and its headers: valid, or with one field or
    header wrong or missing (hypothesis favours small draws: "== 3" makes a rarer branch)."""
    chat = draw(st.booleans())
    body: dict = {"model": MODEL}
    if chat:
        body["messages"] = draw(st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]),
             "content": any_text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": any_text}),
                                            max_size=3)}), min_size=1, max_size=3))
    else:
        body["prompt"] = draw(any_text | st.lists(any_text, min_size=1, max_size=1))
    optional = {"max_tokens": st.integers(1, 60), "stream": st.booleans(), "priority": st.integers(-20, 20),
                "temperature": st.floats(0, 2), "stop": st.lists(any_text, max_size=2), "n": st.just(1)}
    for name, values in optional.items():
        if draw(st.booleans()):
            body[name] = draw(values)
    if body.get("stream") and draw(st.booleans()):
        body["stream_options"] = {"include_usage": draw(st.booleans())}
    if draw(st.integers(0, 1)) == 1:  # one field made wrong, or taken out, or a key added
        name = draw(st.sampled_from([*sorted(body), "max_completion_tokens", "stream_options", "n", "best_of"]))
        how = draw(st.integers(0, 2))
        if how == 0:
            body.pop(name, None)
        elif how == 1:
            body[name] = draw(json_values | token_values | st.lists(message_values, min_size=1, max_size=2)
                              | st.sampled_from([[{"role": "user", "content": [{"type": "image_url"}]}],
                                                 ["a", "b"], 0, 2]))
        else:
            body[draw(any_text)] = draw(json_values)
    headers = {"content-type": "application/json"}
    tenant = draw(st.sampled_from(sorted(TENANTS)))
    if draw(st.integers(0, 5)) == 5:
        tenant = draw(header_values | st.none())
    if tenant is not None:
        headers["x-apsd-tenant"] = tenant.encode()  # (UTF-8: "ünï cødé" too)
    if draw(st.integers(0, 5)) == 5:
        headers["x-apsd-priority"] = draw(st.integers(-3, 13).map(str) | header_values)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, headers


def check_openai_error(response: httpx.Response) -> dict:
    check_no_leak(response)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert all(isinstance(error[k], str) and error[k] for k in ("message", "type", "code")), error
    assert error["param"] is None or isinstance(error["param"], str), error
    return error


def check_openai_answer(response: httpx.Response, body: dict) -> None:
    """A 200: every token announced is delivered, as one answer or as a stream ending [DONE]."""
    asked = body.get("max_completion_tokens") or body.get("max_tokens") or 256
    if body.get("stream") is True:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(event) for event in events[:-1]]
        text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                       for c in chunks if c["choices"])
        if (body.get("stream_options") or {}).get("include_usage"):
            assert chunks[-1]["usage"]["completion_tokens"] == asked
    else:
        data = response.json()
        choice = data["choices"][0]
        text = choice["text"] if "text" in choice else choice["message"]["content"]
        assert data["usage"]["completion_tokens"] == asked and data["model"] == MODEL
    assert len(text.split()) == asked


@FUZZ
@given(request=openai_requests())
def test_openai_bodies_get_an_openai_answer(apsd, request):
    path, body, headers = request
    response = apsd.client.post(path, content=json.dumps(body, allow_nan=True).encode(), headers=headers)
    assert response.status_code in ALLOWED_STATUSES, (response.status_code, response.text)
    if response.status_code == 200:
        check_no_leak(response)
        check_openai_answer(response, body)
        return
    error = check_openai_error(response)
    if "x-apsd-tenant" not in headers and response.status_code == 400 and error["param"] == "X-Apsd-Tenant":
        assert error["code"] == "missing_tenant"
    if response.status_code == 429:
        assert int(response.headers["Retry-After"]) >= 1


async def test_clients_that_give_up_at_random_moments_leave_the_books_balanced(apsd):
    """32 clients send 10 requests each, valid and not; half the requests are given up after 0-100 ms.

    Most go to beta with large requests (a 20,000-token request fills a batch for ~16 ms of wall
    time), so a queue builds and requests are given up while queued, while running, or before
    the server has read them.
    """
    rng = random.Random(20241121)
    before = apsd.client.get("/metrics.json").json()["requests"]
    outcomes: list[int | str] = []

    async def client_task(client: httpx.AsyncClient) -> None:
        for _ in range(10):
            body = {"tenant_id": rng.choice(["beta", "beta", "beta", "alpha", "nobody"]),
                    "prompt": "x" * rng.randrange(200),
                    "tokens_requested": rng.choice([1, 2_000, 20_000, 20_000, 20_000, 0]),
                    "priority_bid": rng.randrange(1, 11)}
            with trio.move_on_after(rng.random() * 0.1 if rng.random() < 0.5 else 30.0) as scope:
                response = await client.post("/infer", json=body)
                check_json_answer(response)
                outcomes.append(response.status_code)
            if scope.cancelled_caught:
                outcomes.append("abandoned")

    async with httpx.AsyncClient(base_url=apsd.url, timeout=30, limits=httpx.Limits(max_connections=32)) as client:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for _ in range(32):
                    nursery.start_soon(client_task, client)
    assert len(outcomes) == 320
    assert set(outcomes) <= {200, 404, 413, 422, "abandoned"}, set(outcomes)
    assert 200 in outcomes and "abandoned" in outcomes
    after = wait_until_idle(apsd)["requests"]
    assert after["in_flight"] == 0 and after["conservation_ok"] is True
    assert after["cancelled"] > before["cancelled"]      # some were given up while queued...
    assert after["failed"] == before["failed"]          # ...and nothing failed
    # every request admitted during this test ended as exactly one of completed or cancelled
    assert after["admitted"] - before["admitted"] == (after["completed"] - before["completed"]
                                                      + after["cancelled"] - before["cancelled"])


def wait_until_idle(apsd: Apsd) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        metrics = apsd.client.get("/metrics.json").json()
        if metrics["requests"]["in_flight"] == 0 or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_daemon_survives_the_fuzzing(apsd):
    """Runs last (tests run in file order): the daemon still serves and its books balance."""
    health = apsd.client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = wait_until_idle(apsd)
    counts = metrics["requests"]
    print(f"after the fuzzing: {json.dumps(counts, sort_keys=True)}")   # (shown with -s, or on failure)
    assert counts["in_flight"] == 0 and counts["queued"] == 0 and counts["running"] == 0
    assert counts["conservation_ok"] is True
    assert counts["failed"] == 0
    assert "internal_error" not in counts["rejected_by_error"]
    assert "policy_error" not in counts["rejected_by_error"]
    assert counts["completed"] > 0 and counts["rejected"] > 0
    ok = apsd.client.post("/infer", json={"tenant_id": "alpha", "prompt": "still alive?", "tokens_requested": 3,
                                          "priority_bid": 5})
    assert ok.status_code == 200 and ok.json()["tokens_generated"] == 3
    log = apsd.log()
    assert "Traceback" not in log and "internal error" not in log and "Logging error" not in log


def test_a_tenant_id_cannot_forge_log_lines(apsd):
    forged = "2099-01-01 00:00:00,000 INFO apsd: apsd stopped event=stopped"
    response = apsd.client.post("/infer", json={"tenant_id": f"x\n{forged}", "prompt": "", "tokens_requested": 1,
                                                "priority_bid": 1})
    assert response.status_code == 404
    deadline = time.monotonic() + WAIT_S
    while "2099-01-01" not in (log := apsd.log()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "2099-01-01" in log                                   # the rejection was logged...
    assert not any(line.startswith("2099-01-01") for line in log.splitlines())   # ...on its own line


def test_405_names_the_allowed_methods(apsd):
    response = apsd.client.get("/infer")
    assert response.status_code == 405 and response.json()["error"] == "method_not_allowed"
    assert "POST" in response.headers.get("Allow", "")


# -- with API keys ---------------------------------------------------------------------------------

KEYS = {"alpha": "apsd_" + "A1" * 20, "beta": "apsd_" + "B2" * 20, "admin": "apsd_" + "C3" * 20}


def sha256_hash(key: str) -> str:
    import hashlib
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


KEYED_CONFIG = f"""
[server]
host = "0.0.0.0"
[auth]
admin_key_hashes = ["{sha256_hash(KEYS['admin'])}"]
[gpu]
time_scale = 0.0001
[tenants.alpha]
rate = 1e9
burst = 1000000
api_key_hashes = ["{sha256_hash(KEYS['alpha'])}"]
[tenants.beta]
rate = 1e9
burst = 1000000
api_key_hashes = ["{sha256_hash(KEYS['beta'])}"]
"""


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Apsd]:
    """apsd with API keys, listening on every address (allowed: keys are configured)."""
    with launch(tmp_path_factory.mktemp("keyed"), KEYED_CONFIG) as running:
        running.client.base_url = running.url.replace("0.0.0.0", "127.0.0.1")
        yield running
    log = running.log()
    assert not any(key in log for key in KEYS.values())


def mutate(key: str, data: st.DataObject) -> str:
    i = data.draw(st.integers(0, len(key) - 1))
    other = data.draw(st.sampled_from([c for c in "xyz09-_" if c != key[i]]))  # (always a different key)
    return key[:i] + other + key[i + 1:]


@FUZZ
@given(who=st.sampled_from(["alpha", "beta", "admin", None, "mutated", "garbage", "scheme"]),
       path=st.sampled_from(["/infer", "/metrics", "/metrics.json", "/tenants/alpha/status",
                             "/tenants/beta/status", "/tenants/nobody/status", "/health"]),
       named=st.sampled_from([None, "alpha", "beta", "nobody"]), data=st.data())
def test_every_caller_gets_exactly_what_its_key_allows(keyed, who, path, named, data):
    """The key, not the body, says who calls: 401 without a valid key, 403 beyond its rights."""
    headers = {}
    if who in KEYS:
        headers["Authorization"] = f"Bearer {KEYS[who]}"
    elif who == "mutated":
        headers["Authorization"] = f"Bearer {mutate(data.draw(st.sampled_from(list(KEYS.values()))), data)}"
    elif who == "garbage":
        headers["Authorization"] = data.draw(header_values)
    elif who == "scheme":
        headers["Authorization"] = f"{data.draw(st.sampled_from(['Basic', 'Token', 'bearer', 'Bearer:']))} " \
                                   f"{KEYS['alpha']}"
    valid = who in KEYS or (who == "scheme" and headers["Authorization"].lower().startswith("bearer "))
    caller = who if who in KEYS else "alpha" if valid else None
    if path == "/infer":
        fields = {"prompt": "hi", "tokens_requested": 3, "priority_bid": 5}
        if named is not None:
            fields["tenant_id"] = named
        response = keyed.client.post(path, json=fields, headers=headers)
    else:
        response = keyed.client.get(path, headers=headers)
    data_ = check_json_answer(response) if response.headers.get("content-type", "").startswith(
        "application/json") else None
    if path == "/health":
        expected = 200
    elif caller is None:
        expected = 401
        assert response.headers["WWW-Authenticate"].startswith('Bearer realm="apsd"')
    elif path == "/infer":
        expected = 403 if caller == "admin" or named not in (None, caller) else 200
    elif path.startswith("/metrics"):
        expected = 200 if caller == "admin" else 403
    else:
        tenant = path.split("/")[2]
        expected = (404 if tenant == "nobody" else 200) if caller == "admin" else 200 if tenant == caller else 403
    assert response.status_code == expected, (who, path, named, response.status_code, response.text)
    if expected == 200 and path == "/infer":
        assert data_["tenant_id"] == caller
    for key in KEYS.values():
        assert key not in response.text


# -- defects found here, fixed: each test reproduces one deterministically ----------------------------

def read_answer(sock: socket.socket) -> bytes | None:
    """One HTTP/1.1 answer (head and Content-Length body); None if nothing came within the timeout."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        if match := re.search(rb"content-length: *(\d+)", head.lower()):
            if len(body) >= int(match.group(1)):
                return data


# (Before the fix the connection stayed open, was never read again, and the answer carried no
# "Connection: close": a pooling client's next request on it hung until its timeout. A bare
# quart-trio app on hypercorn 0.18 does the same; apsd now says "Connection: close".)
@pytest.mark.parametrize(("head", "status"), [
    (b"DELETE /tenants/alpha/status HTTP/1.1\r\nhost: localhost\r\ncontent-length: 80\r\n\r\n", b"405"),
    (b"POST /no/such/path HTTP/1.1\r\nhost: localhost\r\ncontent-length: 80\r\n\r\n", b"404"),
    (b"POST /infer HTTP/1.1\r\nhost: localhost\r\ncontent-length: 100000\r\n\r\n", b"413"),
], ids=["405-method", "404-path", "413-body-too-large"])
def test_an_early_answer_leaves_the_connection_usable(apsd, head, status):
    """The next request on the connection gets an answer, or the answer said ``Connection: close``
    (or the server closed the connection): never silence."""
    host, port = apsd.url.removeprefix("http://").rsplit(":", 1)
    length = int(re.search(rb"content-length: (\d+)", head).group(1))
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head)                                   # the head alone: apsd answers at once...
        time.sleep(0.1)
        sock.sendall(b"x" * length)                          # ...and the body follows
        sock.settimeout(10)
        answer = read_answer(sock)
        assert answer is not None and answer.startswith(b"HTTP/1.1 " + status), answer
        if b"connection: close" in answer.lower():
            return                                           # the client knows not to reuse it: fine
        try:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            return                                           # closed: the client sees it at once
        second = read_answer(sock)
        assert second is not None, "the connection stayed open and the server sent nothing for 10 s"
        assert second == b"" or second.startswith(b"HTTP/1.1 200"), second


# (werkzeug's merge_slashes used to answer these with a 308 redirect whose body was HTML.)
@pytest.mark.parametrize("path", ["/tenants/alpha//status", "/tenants/alpha%2F/status"])
def test_a_doubled_slash_gets_json_not_an_html_redirect(apsd, path):
    response = apsd.client.get(path)
    check_json_answer(response)


def test_a_client_that_pipelines_after_a_413_leaves_no_traceback(apsd):
    """A body over the limit is answered 413 with ``Connection: close``; a client that sends another
    request anyway and hangs up made hypercorn 0.18 send twice on one socket: an ERROR traceback
    (``BusyResourceError``) in about half of the tries. apsd now logs one line, without a traceback
    (the fixture checks the whole log for tracebacks when the module ends)."""
    host, port = apsd.url.removeprefix("http://").rsplit(":", 1)
    for _ in range(30):
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /infer HTTP/1.1\r\nhost: localhost\r\ncontent-length: 2000000\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:                     # the head of the answer, no more...
                chunk = sock.recv(65536)
                assert chunk, head
                head += chunk
            assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower(), head
            with contextlib.suppress(OSError):                 # ...then at once the next request
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n")
    assert apsd.client.get("/health").status_code == 200
    time.sleep(0.2)
    assert "Traceback" not in apsd.log() and "Error in ASGI" not in apsd.log()
