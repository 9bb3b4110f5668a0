"""End to end over real HTTP against a daemon on 127.0.0.1:0."""

from __future__ import annotations

import json

import attrs
import httpx
import pytest
import trio

from apsd.config import AdmissionConfig, GpuConfig, ServerConfig, TenantConfig

from .conftest import make_config, start_daemon


def body(tenant="tenant_a", prompt="Hello world", tokens=100, bid=5, **extra):
    return {"tenant_id": tenant, "prompt": prompt, "tokens_requested": tokens, "priority_bid": bid, **extra}


#: /metrics answers Prometheus text unless the client asks for JSON (tests/test_prometheus.py)
JSON = {"Accept": "application/json"}


async def test_infer_answers_with_every_field(live):
    response = await live.client.post("/infer", json=body(prompt="x" * 40))
    assert response.status_code == 200
    data = response.json()
    assert set(data) == {"request_id", "tenant_id", "prompt_tokens", "tokens_generated", "queue_ms",
                         "prefill_ms", "decode_ms", "latency_ms", "batch_id", "batch_size",
                         "effective_priority", "cost_usd"}
    assert data["tenant_id"] == "tenant_a"
    assert data["prompt_tokens"] == 10                      # 40 characters at 4 per token
    assert data["tokens_generated"] == 100
    assert data["decode_ms"] == pytest.approx(100 / 128 * 1000)
    assert data["latency_ms"] >= data["queue_ms"] + data["prefill_ms"] + data["decode_ms"] - 1e-6
    assert data["effective_priority"] >= 5
    assert data["cost_usd"] > 0
    assert response.headers["RateLimit-Policy"] == '"tokens";q=5000;w=1'   # 10 model s = 0.01 wall s
    assert response.headers["RateLimit"].startswith('"tokens";r=')


async def test_rate_limited_gets_429_with_retry_after(live):
    ok = await live.client.post("/infer", json=body("trickle", prompt="", tokens=60))
    assert ok.status_code == 200
    limited = await live.client.post("/infer", json=body("trickle", prompt="", tokens=60))
    assert limited.status_code == 429
    assert limited.json()["error"] == "rate_limited"
    # 20 tokens short at 0.001 tokens per model second = 20000 model s = 20 wall s at time_scale 0.001
    assert int(limited.headers["Retry-After"]) in (19, 20)
    assert limited.headers["RateLimit-Policy"] == '"tokens";q=100;w=100'
    assert limited.headers["RateLimit"].startswith('"tokens";r=40;')
    status = (await live.client.get("/tenants/trickle/status")).json()
    assert (status["completed"], status["rejected"], status["rejected_by_error"]) == (1, 1, {"rate_limited": 1})


@pytest.mark.parametrize(
    ("payload", "error", "fragment"),
    [
        (body("tenant_b", prompt="", tokens=3001), "exceeds_tenant_burst", "burst"),
        (body("big", prompt="", tokens=40_000), "exceeds_batch_capacity", "kv_cap_tokens"),
    ],
)
async def test_never_admissible_gets_413_naming_the_limit(live, payload, error, fragment):
    response = await live.client.post("/infer", json=payload)
    assert response.status_code == 413
    assert response.json()["error"] == error and fragment in response.json()["message"]
    assert "Retry-After" not in response.headers


async def test_unknown_tenant_is_404(live):
    response = await live.client.post("/infer", json=body("nobody"))
    assert (response.status_code, response.json()["error"], response.json()["field"]) == (
        404, "unknown_tenant", "tenant_id")
    assert (await live.client.get("/tenants/nobody/status")).status_code == 404


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({k: v for k, v in body().items() if k != "prompt"}, "prompt"),
        ({k: v for k, v in body().items() if k != "tenant_id"}, "tenant_id"),
        (body(tokens="100"), "tokens_requested"),
        (body(tokens=1.5), "tokens_requested"),
        (body(tokens=0), "tokens_requested"),
        (body(tokens=True), "tokens_requested"),
        (body(bid=0), "priority_bid"),
        (body(bid=11), "priority_bid"),
        (body(bid=None), "priority_bid"),
        (body(tenant=""), "tenant_id"),
        (body(tenant=7), "tenant_id"),
        (body(prompt=["a"]), "prompt"),
        (body(priority=3), "priority"),
    ],
)
async def test_bad_fields_get_422_naming_the_field(live, payload, field):
    response = await live.client.post("/infer", json=payload)
    assert response.status_code == 422
    assert response.json()["field"] == field and field in response.json()["message"]


@pytest.mark.parametrize("raw", [b"{", b"", b"[1, 2]", b"null", b"\xff\xfe", b"[" * 50_000])
async def test_malformed_body_is_400(live, raw):
    response = await live.client.post("/infer", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_json"


async def test_a_prompt_over_the_limit_is_413(live):
    # max_prompt_tokens defaults to 32768: 131072 characters at 4 per token fit, one more does not
    # (tenant "big" can afford it; the body limit of this daemon is 64 KiB, so the limit is lowered)
    live.daemon.pipeline.config = attrs.evolve(live.daemon.pipeline.config, admission=AdmissionConfig(
        max_prompt_tokens=1000))
    fits = await live.client.post("/infer", json=body("big", prompt="x" * 4000, tokens=1))
    assert fits.status_code == 200
    too_long = await live.client.post("/infer", json=body("big", prompt="x" * 4001, tokens=1))
    assert (too_long.status_code, too_long.json()["error"], too_long.json()["field"]) == (413, "prompt_too_long", "prompt")
    assert "admission.max_prompt_tokens" in too_long.json()["message"] and "1001 tokens" in too_long.json()["message"]
    assert "Retry-After" not in too_long.headers


async def test_http_errors_are_json(live):
    # (small enough to sit in socket buffers: httpx sends the whole body before reading the answer)
    too_big = await live.client.post("/infer", content=b"x" * (65_536 + 1))
    assert too_big.status_code == 413 and too_big.json()["error"] == "body_too_large"
    assert (await live.client.get("/infer")).json()["error"] == "method_not_allowed"
    assert (await live.client.get("/nope")).json()["error"] == "not_found"


async def test_metrics_health_and_tenant_status(live):
    for tenant in ("tenant_a", "tenant_a", "tenant_b"):
        assert (await live.client.post("/infer", json=body(tenant, tokens=50))).status_code == 200
    await live.client.post("/infer", json=body("nobody"))
    metrics = (await live.client.get("/metrics", headers=JSON)).json()
    assert metrics["requests"] | {"conservation_ok": None} == {
        "admitted": 3, "rejected": 1, "completed": 3, "failed": 0, "cancelled": 0, "queued": 0,
        "running": 0, "in_flight": 0, "conservation_ok": None, "rejected_by_error": {"unknown_tenant": 1}}
    assert metrics["requests"]["conservation_ok"] is True
    assert metrics["tokens"]["generated"] == 150 and metrics["tokens"]["queued"] == 0
    assert 0 < metrics["gpu_utilization"] <= 1
    assert metrics["cost_per_1m_tokens_usd"] == pytest.approx(metrics["cost_usd"] / 150 * 1e6)
    assert 0 < metrics["fairness"]["jain_index"] <= 1 and "rate" in metrics["fairness"]["definition"]
    assert set(metrics["governor"]) == {"state", "entropy_bits", "window_ms"}
    assert metrics["policy"]["aging"] == "aps" and metrics["queue_depth"] == 0
    health = (await live.client.get("/health")).json()
    assert health["status"] == "ok" and health["queue_depth"] == 0 and "state" in health["governor"]
    status = (await live.client.get("/tenants/tenant_a/status")).json()
    assert (status["rate"], status["burst"], status["completed"], status["generated_tokens"]) == (500.0, 5000, 2, 100)
    assert 0 <= status["tokens_available"] <= 5000
    assert status["queued"] == status["running"] == 0


# -- shutdown -------------------------------------------------------------------------------------

def slow_config(grace_s: float):
    # a model second lasts 0.05 wall s: a 100-token request decodes in about 0.04 s of wall time per
    # request in a batch of 1, long enough to catch several in flight
    return make_config(server=ServerConfig(port=0, shutdown_grace_s=grace_s), gpu=GpuConfig(time_scale=0.05),
                       tenants={"t": TenantConfig(rate=1e6, burst=10**6)})


async def send_and_wait_in_flight(nursery: trio.Nursery, client: httpx.AsyncClient, n: int, tokens: int,
                                  answers: list[httpx.Response]) -> None:
    """Start ``n`` requests in ``nursery`` (answers appended to ``answers``); return once all are in flight."""
    async def one() -> None:
        answers.append(await client.post("/infer", json=body("t", prompt="", tokens=tokens)))

    for _ in range(n):
        nursery.start_soon(one)
    while (await client.get("/metrics", headers=JSON)).json()["requests"]["in_flight"] < n:
        await trio.sleep(0.01)


async def test_shutdown_finishes_accepted_work_and_refuses_new(nursery):
    running = await start_daemon(nursery, slow_config(grace_s=30.0))
    answers = []
    async with running.client as client:
        async with trio.open_nursery() as requests:
            await send_and_wait_in_flight(requests, client, 20, 400, answers)
            running.daemon.request_shutdown()
            await trio.sleep(0.05)
            late = await client.post("/infer", json=body("t", prompt="", tokens=10))
            assert late.status_code == 503 and late.json()["error"] == "shutting_down"
            assert "Retry-After" in late.headers
            assert (await client.get("/health")).json()["status"] == "draining"
    assert [a.status_code for a in answers] == [200] * 20
    # while draining, every answer tells the client not to reuse its connection: hypercorn would
    # otherwise hold a next request on it unanswered until the connection is dropped at the end
    assert late.headers["connection"] == "close"
    assert all(a.headers["connection"] == "close" for a in answers)


async def test_shutdown_after_grace_answers_the_rest_with_503(nursery):
    running = await start_daemon(nursery, slow_config(grace_s=0.2))
    answers = []
    async with running.client as client:
        async with trio.open_nursery() as requests:
            await send_and_wait_in_flight(requests, client, 40, 2000, answers)
            pipeline = running.daemon.pipeline
            running.daemon.request_shutdown()
    codes = sorted(a.status_code for a in answers)
    assert len(codes) == 40 and set(codes) == {503}   # 2000 tokens take ~0.8 wall s: none finish in 0.2 s
    assert all(a.json()["error"] == "shutting_down" for a in answers)
    counts = pipeline.metrics()["requests"]
    assert counts["cancelled"] == 40 and counts["conservation_ok"] and counts["in_flight"] == 0
    await trio.sleep(1.0)              # the batch that was running would have ended by now...
    assert pipeline.ledger.batches == 0 and pipeline.ledger.cost_usd == 0   # ...but it was stopped
    # tokens of requests that never ran went back to the bucket
    assert pipeline.admission.buckets["t"].level(pipeline.clock.now()) == 10**6


async def test_refusals_before_admission_are_counted_without_growing_per_name_state(live):
    for i in range(50):
        await live.client.post("/infer", json=body(f"stranger-{i}"))
    await live.client.post("/infer", content=b"{")
    metrics = (await live.client.get("/metrics", headers=JSON)).json()
    assert metrics["requests"]["rejected"] == 51
    assert metrics["requests"]["rejected_by_error"] == {"unknown_tenant": 50, "invalid_json": 1}
    assert set(live.daemon.pipeline.ledger.tenants) == {"tenant_a", "tenant_b", "trickle", "big"}


@pytest.mark.parametrize("tokens", [10**1000, 2**31, 1_000_000_001])
async def test_huge_integers_are_422_and_the_daemon_lives_on(live, tokens):
    raw = ('{"tenant_id": "tenant_a", "prompt": "abcd", "tokens_requested": %d, "priority_bid": 5}' % tokens
           if tokens < 10**999 else
           '{"tenant_id": "tenant_a", "prompt": "abcd", "tokens_requested": %s, "priority_bid": 5}' % ("9" * 4300))
    response = await live.client.post("/infer", content=raw.encode(), headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["field"] == "tokens_requested"
    assert (await live.client.post("/infer", json=body(tokens=5))).status_code == 200


async def test_client_that_disconnects_while_queued_cancels_and_is_refunded(nursery):
    running = await start_daemon(nursery, slow_config(grace_s=5.0))
    async with running.client as client:
        async with trio.open_nursery() as requests:
            answers: list[httpx.Response] = []
            await send_and_wait_in_flight(requests, client, 1, 2000, answers)    # ~0.8 s on the GPU
            while (await client.get("/metrics", headers=JSON)).json()["requests"]["running"] < 1:
                await trio.sleep(0.01)
            with trio.move_on_after(0.2):                                     # gives up while queued
                await client.post("/infer", json=body("t", prompt="", tokens=5000))
            with trio.fail_after(5):
                while (await client.get("/tenants/t/status")).json()["cancelled"] < 1:
                    await trio.sleep(0.01)
        status = (await client.get("/tenants/t/status")).json()
        metrics = (await client.get("/metrics", headers=JSON)).json()["requests"]
    assert [a.status_code for a in answers] == [200]
    assert (status["cancelled"], status["completed"], status["generated_tokens"]) == (1, 1, 2000)
    assert metrics["conservation_ok"] and metrics["in_flight"] == 0
    assert status["tokens_available"] > 10**6 - 2000 - 100         # the cancelled 5000 came back
    running.daemon.request_shutdown()


async def test_405_names_the_allowed_methods(live):
    response = await live.client.get("/infer")
    assert response.status_code == 405 and "POST" in response.headers["Allow"]
    assert response.headers["content-type"] == "application/json"
