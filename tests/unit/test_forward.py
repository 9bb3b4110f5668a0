"""The forward engine in virtual time, against simulated backends: routing, saturation, stale metrics,
retries before the first token, failures after it, backends going down and coming back, cancellation
and settlement against usage. (tests/backends/test_gateway.py runs it against real llama.cpp servers.)"""

from __future__ import annotations

import contextlib

import attrs
import pytest
import trio
import trio.testing

from apsd.core.clock import ModelClock
from apsd.core.config import BackendConfig, ForwardConfig, TenantConfig, parse_config
from apsd.core.models import Completion
from apsd.core.streams import TokenStream
from apsd.engines.backends import SimulatedBackendClient, SimulatedServer, parse_load
from apsd.pipeline import open_pipeline
from tests.helpers import build_policies

TENANTS = {name: TenantConfig(rate=1e9, burst=10**9) for name in ("t", "flood", "steady")}


def forward_config(names, *, preset="fifo", max_concurrency=2, isolation=True, priority="off", **forward):
    config = parse_config({"policy": {"preset": preset, "fixed": {"window_ms": 0.0}},
                           "engine": {"isolation": isolation},
                           "backends": [{"url": f"http://{name}.test", "name": name, "priority": priority,
                                         "max_concurrency": max_concurrency} for name in names]}, "<test>")
    settings = {"health_interval_s": 1.0, "metrics_interval_s": 0.1, **forward}
    return attrs.evolve(config, tenants=TENANTS, forward=ForwardConfig(**settings))


def request(pipeline, *, tokens=20, bid=5, stream=False, model="sim", prompt="hello", tenant="t"):
    r = pipeline.new_request(tenant_id=tenant, prompt=prompt, tokens_requested=tokens, priority_bid=bid, model=model,
                             api="chat.completions",
                             payload={"model": model, "messages": [{"role": "user", "content": prompt}],
                                      "temperature": 0.5, "user": f"bid{bid}"})
    if stream:
        r.stream = TokenStream()
    return r


@contextlib.asynccontextmanager
async def forwarding(servers, **settings):
    """A pipeline whose forward engine talks to ``servers`` (simulated in model time), once it has
    seen them healthy."""
    config = forward_config(servers, **settings)
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), servers)) as pipeline:
        await started(pipeline, servers)
        yield pipeline


async def started(pipeline, servers):
    """Let the engine see its backends healthy (their first health check) before requests come."""
    await trio.testing.wait_all_tasks_blocked()
    await pipeline.clock.sleep(0.01)
    engine = pipeline.engines[0]
    assert all(b.healthy for b in engine.backends if not servers[b.name].down)


async def test_requests_go_to_the_least_loaded_backend_and_pass_parameters_through(autojump_clock):
    servers = {"a": SimulatedServer(), "b": SimulatedServer()}
    async with forwarding(servers) as pipeline:
        requests = [request(pipeline) for _ in range(4)]
        for r in requests:
            assert pipeline.admit_now(r)
        await trio.testing.wait_all_tasks_blocked()
        assert [b.in_flight for b in pipeline.engines[0].backends] == [2, 2]
        outcomes = [await r.reply.wait() for r in requests]
        assert all(isinstance(o, Completion) and o.response is not None for o in outcomes)
        assert outcomes[0].response["usage"]["completion_tokens"] == 20
        statistics = pipeline.statistics()
        assert [(b.name, b.requests, b.in_flight, b.healthy) for b in statistics.backends] == [
            ("a", 2, 0, True), ("b", 2, 0, True)]
        assert pipeline.models() == ["sim"]


async def test_saturated_backends_keep_the_queue_and_its_priority_order_in_apsd(autojump_clock):
    """A backend reporting requests waiting in its own queue gets nothing more; the requests wait in
    apsd's queue, where a late high bid overtakes earlier low ones."""
    servers = {"a": SimulatedServer(slots=1, ttft_s=0.5, tpot_s=0.05)}
    async with forwarding(servers, preset="static", max_concurrency=8, max_waiting=1) as pipeline:
        low = [request(pipeline, bid=1) for _ in range(6)]
        for r in low[:2]:
            assert pipeline.admit_now(r)
        await pipeline.clock.sleep(0.3)         # one runs, one waits in the backend, and it says so
        backend = pipeline.engines[0].backends[0]
        assert backend.saturated(pipeline.clock.now(), pipeline.config.forward) and backend.in_flight == 2
        for r in low[2:]:
            assert pipeline.admit_now(r)
        await pipeline.clock.sleep(0.1)
        assert pipeline.scheduler.queue_depth == 4 and backend.in_flight == 2  # they wait in apsd
        vip = request(pipeline, bid=10)
        assert pipeline.admit_now(vip)
        for r in [*low, vip]:
            assert isinstance(await r.reply.wait(), Completion)
        assert servers["a"].started == ["bid1", "bid1", "bid10", "bid1", "bid1", "bid1", "bid1"]


async def test_metrics_too_old_to_trust_leave_max_concurrency_to_bound_the_backend(autojump_clock):
    """A reading that says the backend is saturated holds requests in apsd while it is fresh; once it is
    older than ``metrics_max_age_s`` (a server too busy to answer ``/metrics`` in time), max_concurrency
    alone bounds the backend: the held request goes at that moment, not at the next reading."""
    server = SimulatedServer(waiting=5)   # (another client's requests queue there)
    async with forwarding({"a": server}, metrics_interval_s=1.0, metrics_max_age_s=2.0) as pipeline:
        await pipeline.clock.sleep(1.5)
        backend = pipeline.engines[0].backends[0]
        assert backend.saturated(pipeline.clock.now(), pipeline.config.forward)
        held = request(pipeline)
        assert pipeline.admit_now(held)
        await pipeline.clock.sleep(1.2)
        assert held.dispatched_at is None and backend.in_flight == 0   # a fresh reading: it waits in apsd
        server.metrics_delay_s = 60.0             # the next reading takes a minute
        read_at = backend.load_at
        assert read_at is not None
        outcome = await held.reply.wait()
        assert isinstance(outcome, Completion)
        assert held.dispatched_at == pytest.approx(read_at + 2.0, abs=0.01)
        assert not backend.saturated(pipeline.clock.now(), pipeline.config.forward)


async def test_a_backend_that_fails_before_the_first_token_sends_the_request_elsewhere(autojump_clock):
    servers = {"a": SimulatedServer(fail_next=1), "b": SimulatedServer()}
    async with forwarding(servers, max_concurrency=1, max_retries=2) as pipeline:
        r = request(pipeline, stream=True)
        assert pipeline.admit_now(r)
        outcome = await r.reply.wait()
        assert isinstance(outcome, Completion) and r.retries == 1
        chunks = [c async for c in r.stream]
        assert sum(c.tokens for c in chunks) == 20 and r.stream.error is None
        a, b = pipeline.statistics().backends
        assert (a.failures, a.retries, b.requests) == (1, 1, 1)


async def test_retries_are_bounded_then_502(autojump_clock):
    servers = {"a": SimulatedServer(fail_next=10)}
    async with forwarding(servers, max_retries=2) as pipeline:
        r = request(pipeline)
        assert pipeline.admit_now(r)
        outcome = await r.reply.wait()
        assert (outcome.status, outcome.error, outcome.kind, r.retries) == (502, "backend_failed", "failed", 2)
        assert pipeline.admission.buckets["t"].level(pipeline.clock.now()) == 10**9   # failed: nothing charged


async def test_a_failure_after_the_first_token_ends_the_stream_with_an_error(autojump_clock):
    servers = {"a": SimulatedServer(fail_after_tokens=5)}
    async with forwarding(servers) as pipeline:
        r = request(pipeline, stream=True)
        assert pipeline.admit_now(r)
        outcome = await r.reply.wait()
        assert (outcome.status, outcome.kind, r.retries) == (502, "failed", 0)
        chunks = [c async for c in r.stream]
        assert 0 < sum(c.tokens for c in chunks) <= 5 and "broke" in r.stream.error


async def test_a_down_backend_takes_no_work_and_comes_back_by_itself(autojump_clock):
    servers = {"a": SimulatedServer(down=True), "b": SimulatedServer()}
    async with forwarding(servers) as pipeline:
        a, b = pipeline.engines[0].backends
        assert (a.healthy, b.healthy) == (False, True)
        first = [request(pipeline) for _ in range(3)]
        for r in first:
            assert pipeline.admit_now(r)
        for r in first:
            await r.reply.wait()
        assert (a.requests, b.requests) == (0, 3)
        servers["a"].down = False
        await pipeline.clock.sleep(1.5)          # the next health check finds it up
        assert a.healthy and a.models == ("sim",)
        more = [request(pipeline) for _ in range(4)]
        for r in more:
            assert pipeline.admit_now(r)
        for r in more:
            await r.reply.wait()
        assert a.requests == 2 and b.requests == 5


async def test_a_client_that_leaves_mid_stream_frees_the_slot_and_is_billed_what_arrived(autojump_clock):
    servers = {"a": SimulatedServer(tpot_s=0.1)}
    async with forwarding(servers, max_concurrency=1) as pipeline:
        r = request(pipeline, tokens=200, stream=True, prompt="x" * 400)   # about 100 prompt tokens
        assert pipeline.admit_now(r)
        waiting = request(pipeline, tokens=5)
        assert pipeline.admit_now(waiting)
        await pipeline.clock.sleep(2.0)
        assert 0 < r.tokens_generated < 200 and waiting.dispatched_at is None
        assert pipeline.cancel(r)
        outcome = await r.reply.wait()
        assert (outcome.status, outcome.error, outcome.kind) == (499, "client_disconnected", "cancelled")
        bucket = pipeline.admission.buckets["t"]
        assert bucket.level(pipeline.clock.now()) == pytest.approx(10**9 - r.prompt_tokens - r.tokens_generated)
        assert isinstance(await waiting.reply.wait(), Completion)      # the freed slot went to it


async def test_chunks_that_do_not_say_their_tokens_are_settled_on_the_backends_count(autojump_clock):
    """A real server's chunks do not say how many tokens they carry, and vLLM's carry several when its
    output falls behind: a client that leaves is charged the backend's count of the text that arrived,
    not a token per chunk; a stream that ends with usage is charged the usage."""
    servers = {"a": SimulatedServer(tpot_s=0.1, says_chunk_tokens=False, server="vllm")}  # 1 token, then 8 a chunk
    async with forwarding(servers, max_concurrency=1) as pipeline:
        left = request(pipeline, tokens=200, stream=True)
        assert pipeline.admit_now(left)
        await pipeline.clock.sleep(2.0)
        chunks = left.tokens_generated            # the live count: one per chunk with text
        assert 2 < chunks < 200 // 8
        assert pipeline.cancel(left)
        outcome = await left.reply.wait()
        assert outcome.error == "client_disconnected"
        assert left.tokens_generated == 1 + 8 * (chunks - 1)
        level = pipeline.admission.buckets["t"].level(pipeline.clock.now())
        assert level == pytest.approx(10**9 - left.prompt_tokens - left.tokens_generated)
        whole = request(pipeline, tokens=50, stream=True)
        assert pipeline.admit_now(whole)
        assert isinstance(await whole.reply.wait(), Completion) and whole.tokens_generated == 50


async def test_settlement_uses_the_backends_usage(autojump_clock):
    servers = {"a": SimulatedServer()}
    async with forwarding(servers) as pipeline:
        r = request(pipeline, tokens=30, prompt="y" * 2000)
        estimate = r.prompt_tokens
        assert pipeline.admit_now(r)
        assert r.reserved_tokens == estimate + 30
        outcome = await r.reply.wait()
        usage = outcome.response["usage"]
        assert r.prompt_tokens == usage["prompt_tokens"] != estimate   # the backend's count, not apsd's estimate
        level = pipeline.admission.buckets["t"].level(pipeline.clock.now())
        assert level == pytest.approx(10**9 - usage["prompt_tokens"] - usage["completion_tokens"])
        assert pipeline.tenant_status("t").prompt_tokens == usage["prompt_tokens"]


def test_load_is_read_from_vllm_and_llama_cpp_metrics():
    vllm = ('# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 7.0\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'
            '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.42\n')
    load = parse_load(vllm)
    assert (load.waiting, load.running, load.kv_usage) == (7.0, 3.0, 0.42)
    llama = ("# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 2\n"
             "# TYPE llamacpp:requests_deferred gauge\nllamacpp:requests_deferred 1\n")
    load = parse_load(llama)
    assert (load.waiting, load.running, load.kv_usage) == (1.0, 2.0, None)
    assert parse_load("# TYPE other gauge\nother 1\n") is None


def test_load_is_read_from_a_large_exposition_without_its_lookalikes():
    """vLLM's exposition is mostly histograms; only the load metrics' samples count, summed over their label
    sets, and a metric whose name merely begins like one of them is not one of them."""
    noise = "".join(f'# TYPE vllm:hist_{h} histogram\n' + "".join(
        f'vllm:hist_{h}_bucket{{engine="0",le="{b}"}} {b}.0\n' for b in range(40)) for h in range(30))
    text = (noise + '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine="0"} 2.0\n'
            'vllm:num_requests_waiting{engine="1"} 3.0\n'
            '# TYPE vllm:num_requests_waiting_by_reason gauge\nvllm:num_requests_waiting_by_reason{reason="x"} 50\n'
            '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4\n')
    load = parse_load(text)
    assert (load.waiting, load.running, load.kv_usage) == (5.0, 4.0, None)


def test_backends_config_is_checked():
    from apsd.core.config import ConfigError

    with pytest.raises(ConfigError, match=r"backends\[0\].max_concurrency: must be between 1"):
        parse_config({"backends": [{"url": "http://a", "max_concurrency": 0}]}, "x")
    with pytest.raises(ConfigError, match="gpu.time_scale: real backends run in real time"):
        parse_config({"backends": [{"url": "http://a"}], "gpu": {"time_scale": 0.5}}, "x")
    config = parse_config({"backends": [{"url": "http://a", "models": ["m"]}]}, "x")
    assert config.engine.kind == "forward" and config.backends[0] == BackendConfig(url="http://a", models=("m",))


async def test_per_backend_statistics_reach_prometheus(autojump_clock):
    from prometheus_client.parser import text_string_to_metric_families

    from apsd.serve.prometheus import exporter_for

    servers = {"a": SimulatedServer(), "b": SimulatedServer(down=True)}
    config = forward_config(servers)
    async with open_pipeline(config, build_policies(config),
                             backend_client=SimulatedBackendClient(ModelClock(), servers)) as pipeline:
        exporter = exporter_for(pipeline)
        await started(pipeline, servers)
        r = request(pipeline, tokens=7)
        assert pipeline.admit_now(r)
        await r.reply.wait()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(exporter.exposition().decode())
                   for s in family.samples}
    assert samples[("apsd_backend_up", (("backend", "a"),))] == 1
    assert samples[("apsd_backend_up", (("backend", "b"),))] == 0
    assert samples[("apsd_backend_requests_total", (("backend", "a"),))] == 1
    assert samples[("apsd_backend_tokens_total", (("backend", "a"), ("phase", "completion")))] == 7
    assert samples[("apsd_backend_in_flight", (("backend", "a"),))] == 0


async def test_a_head_request_whose_model_has_no_free_slot_waits_without_spinning(autojump_clock):
    """Strict queue order: a request for a model whose backends are full holds the head; the engine
    does not ask again (and again) until a slot frees, then serves it before the requests behind it."""
    servers = {"a": SimulatedServer(models=("m1",), tpot_s=0.1), "b": SimulatedServer(models=("m2",))}
    async with forwarding(servers, max_concurrency=1) as pipeline:
        busy = request(pipeline, tokens=50, model="m1")
        assert pipeline.admit_now(busy)
        await pipeline.clock.sleep(0.5)
        head = request(pipeline, tokens=5, model="m1")
        behind = request(pipeline, tokens=5, model="m2")
        for r in (head, behind):
            assert pipeline.admit_now(r)
        decisions = pipeline.scheduler.decisions
        await pipeline.clock.sleep(2.0)
        assert pipeline.scheduler.decisions - decisions < 10       # no spin while m1 is full
        for r in (busy, head, behind):
            assert isinstance(await r.reply.wait(), Completion)
        assert head.dispatched_at <= behind.dispatched_at


# -- bounded waits: stalled and missing backends ----------------------------------------------------

async def test_a_stalled_backend_is_marked_down_and_its_waiting_requests_go_elsewhere_without_a_retry(
        autojump_clock):
    servers = {"a": SimulatedServer(ttft_s=30.0), "b": SimulatedServer(ttft_s=0.05)}
    async with forwarding(servers, max_concurrency=1) as pipeline:
        first, second = request(pipeline, stream=True), request(pipeline, stream=True)
        assert pipeline.admit_now(first) and pipeline.admit_now(second)
        await pipeline.clock.sleep(0.02)
        on_a = next(r for r in (first, second) if servers["a"].running and r.started_at is None
                    and r.dispatched_at is not None and servers["a"].bodies[-1]["user"] == "bid5")
        servers["a"].stalled = True           # a stopped process: connections hang, health checks time out
        start = pipeline.clock.now()
        outcome = await on_a.reply.wait()
        a, b = pipeline.engines[0].backends
        assert isinstance(outcome, Completion) and on_a.retries == 0 and not a.healthy
        # found out by one health check (interval 1 s) that timed out (5 s), then run on b
        assert pipeline.clock.now() - start < 1.0 + servers["a"].stall_s + 1.0
        assert len(servers["b"].bodies) == 2


async def test_with_no_backend_new_requests_get_503_at_once_and_queued_ones_within_the_wait(autojump_clock):
    servers = {"a": SimulatedServer(ttft_s=30.0)}
    async with forwarding(servers, max_concurrency=1, no_backend_wait_s=30.0) as pipeline:
        held = [request(pipeline) for _ in range(3)]      # one on the backend, two queued behind it
        for r in held:
            assert pipeline.admit_now(r)
        await pipeline.clock.sleep(0.02)
        servers["a"].stalled = True
        start = pipeline.clock.now()
        await pipeline.clock.sleep(10.0)                  # marked down by now: refused at once
        late = request(pipeline)
        assert not pipeline.admit_now(late)
        refusal = await late.reply.wait()
        assert (refusal.status, refusal.error) == (503, "no_backend") and "Retry-After" in refusal.headers
        for r in held:                                    # answered within the health check + the wait
            outcome = await r.reply.wait()
            assert (outcome.status, outcome.error) == (503, "no_backend")
        assert pipeline.clock.now() - start <= 1.0 + servers["a"].stall_s + 30.0 + 0.1
        assert pipeline.admission.buckets["t"].level(pipeline.clock.now()) == 10**9   # nothing charged
        assert not pipeline.ledger.outstanding
        servers["a"].stalled = False                      # back: its next health check finds it up
        await pipeline.clock.sleep(1.0 + servers["a"].stall_s + 0.5)
        again = request(pipeline, tokens=3)
        assert pipeline.admit_now(again)
        assert isinstance(await again.reply.wait(), Completion)


# -- what is sent upstream, and what is charged -------------------------------------------------------

def openai_request(pipeline, payload, *, tokens, open_ended=False):
    return pipeline.new_request(tenant_id="t", prompt="hello", tokens_requested=tokens, priority_bid=5, model="sim",
                                api="chat.completions", open_ended=open_ended,
                                payload={"model": "sim", "messages": [{"role": "user", "content": "hello"}],
                                         **payload})


async def test_a_request_without_a_limit_is_sent_without_one_and_charged_what_ran(autojump_clock):
    servers = {"a": SimulatedServer()}
    async with forwarding(servers) as pipeline:
        r = openai_request(pipeline, {}, tokens=5, open_ended=True)   # 5: admission's estimate only
        assert pipeline.admit_now(r)
        outcome = await r.reply.wait()
        sent = servers["a"].bodies[-1]
        assert "max_tokens" not in sent and "max_completion_tokens" not in sent
        assert outcome.tokens_generated == 16             # the simulated server's own default, beyond the estimate
        level = pipeline.admission.buckets["t"].level(pipeline.clock.now())
        assert level == pytest.approx(10**9 - r.prompt_tokens - 16)


async def test_backend_length_parameters_carry_the_reservation(autojump_clock):
    servers = {"a": SimulatedServer()}
    async with forwarding(servers) as pipeline:
        r = openai_request(pipeline, {"n_predict": 7, "max_new_tokens": 7}, tokens=7)
        assert pipeline.admit_now(r)
        await r.reply.wait()
        sent = servers["a"].bodies[-1]
        assert (sent["max_tokens"], sent["n_predict"], sent["max_new_tokens"]) == (7, 7, 7)
        assert r.payload == {"model": "sim", "messages": [{"role": "user", "content": "hello"}],
                             "n_predict": 7, "max_new_tokens": 7}        # the client's body is not touched


async def test_a_stream_that_breaks_after_tokens_is_charged_what_arrived(autojump_clock):
    servers = {"a": SimulatedServer(fail_after_tokens=9)}
    async with forwarding(servers) as pipeline:
        r = request(pipeline, stream=True, tokens=20)
        assert pipeline.admit_now(r)
        outcome = await r.reply.wait()
        assert (outcome.status, outcome.kind) == (502, "failed") and 0 < r.tokens_generated <= 9
        level = pipeline.admission.buckets["t"].level(pipeline.clock.now())
        assert level == pytest.approx(10**9 - r.prompt_tokens - r.tokens_generated)
        assert pipeline.tenant_status("t").generated_tokens == r.tokens_generated


async def test_a_client_that_stops_reading_does_not_hold_the_backend(autojump_clock):
    servers = {"a": SimulatedServer(tpot_s=0.01)}
    async with forwarding(servers, max_concurrency=1, read_timeout_s=1.0) as pipeline:
        r = request(pipeline, stream=True, tokens=500)    # nobody reads its stream
        assert pipeline.admit_now(r)
        outcome = await r.reply.wait()
        assert isinstance(outcome, Completion) and outcome.tokens_generated == 500   # not a backend failure
        assert pipeline.statistics().backends[0].failures == 0
        level = pipeline.admission.buckets["t"].level(pipeline.clock.now())
        assert level == pytest.approx(10**9 - r.prompt_tokens - 500)


async def test_with_the_shipped_defaults_a_stalled_backends_client_is_answered_within_two_minutes(autojump_clock):
    defaults = ForwardConfig()
    servers = {"a": SimulatedServer(ttft_s=30.0, stall_s=defaults.health_timeout_s)}
    settings = {name: getattr(defaults, name) for name in
                ("health_interval_s", "metrics_interval_s", "health_timeout_s", "no_backend_wait_s", "max_retries")}
    async with forwarding(servers, max_concurrency=1, **settings) as pipeline:
        held = [request(pipeline, stream=True) for _ in range(2)]   # one sent to it, one queued behind
        for r in held:
            assert pipeline.admit_now(r)
        await pipeline.clock.sleep(0.02)
        servers["a"].stalled = True
        start = pipeline.clock.now()
        for r in held:
            outcome = await r.reply.wait()
            assert (outcome.status, outcome.error) == (503, "no_backend")
        answered_in = pipeline.clock.now() - start
        assert answered_in <= defaults.health_interval_s + defaults.health_timeout_s + defaults.no_backend_wait_s + 0.1
        assert answered_in < 120
        late = request(pipeline)
        assert not pipeline.admit_now(late)              # and a new one is refused at once
        assert (await late.reply.wait()).error == "no_backend" and pipeline.clock.now() - start == answered_in


@pytest.mark.parametrize("polarity", ["lower-first", "higher-first"])
async def test_a_backend_that_schedules_by_priority_is_sent_the_tenants_outstanding_requests_then_bid(
        autojump_clock, polarity):
    """A flood that starts alone (with its backlog queued) is sent less urgent priorities than a tenant
    with one request, and a client's own ``priority`` never reaches the backend."""
    servers = {"a": SimulatedServer(slots=4, tpot_s=0.05)}
    async with forwarding(servers, preset="fair", max_concurrency=4, priority=polarity) as pipeline:
        def send(tenant, tag, tokens):
            r = request(pipeline, tenant=tenant, tokens=tokens)
            r.payload.update(user=tag, priority=-100)
            assert pipeline.admit_now(r)
            return r

        floods = [send("flood", f"flood-{i}", 20) for i in range(8)]
        await pipeline.clock.sleep(0.2)
        await send("steady", "steady", 5).reply.wait()
        for r in floods:
            await r.reply.wait()
    urgency = (lambda p: -p) if polarity == "lower-first" else (lambda p: p)   # higher: sooner
    sent = {body["user"]: urgency(body["priority"]) for body in servers["a"].bodies}
    assert -100 not in [body["priority"] for body in servers["a"].bodies]
    assert all(sent["steady"] > u for user, u in sent.items() if user.startswith("flood"))


@pytest.mark.parametrize("polarity", ["lower-first", "higher-first"])
def test_the_priority_ranks_outstanding_requests_first_then_higher_bids(polarity):
    from apsd.engines.relay import priority_for

    def urgency(bid, outstanding):
        value = priority_for(_Bid(bid), outstanding, polarity)
        return -value if polarity == "lower-first" else value

    order = [urgency(bid, outstanding) for outstanding in (0, 1, 7) for bid in (10, 5, 1)]
    assert order == sorted(order, reverse=True) and len(set(order)) == 9
    assert urgency(10, 10**6) == urgency(10, 10**7)   # (beyond the depth it tells apart, the same rank)

    def classed(ttft, outstanding, now=0.0):   # (a service class that can still meet its deadline goes first)
        request = _Bid(1)
        request.class_deadline, request.arrival = ttft, 0.0
        value = priority_for(request, outstanding, polarity, now)
        return -value if polarity == "lower-first" else value

    assert classed(0.5, 900) > classed(30.0, 0) > urgency(10, 0)
    assert classed(0.5, 0, now=1.0) == urgency(1, 0)   # (late: as if it had no class)


@attrs.define
class _Bid:
    priority_bid: int
    class_deadline: float | None = None
    arrival: float = 0.0


async def test_by_default_a_clients_priority_does_not_reach_the_backend(autojump_clock):
    servers = {"a": SimulatedServer()}
    async with forwarding(servers) as pipeline:
        r = request(pipeline)
        r.payload["priority"] = -5
        assert pipeline.admit_now(r)
        await r.reply.wait()
    assert "priority" not in servers["a"].bodies[0]
