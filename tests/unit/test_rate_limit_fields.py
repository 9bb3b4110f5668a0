"""The IETF ``RateLimit-Policy`` / ``RateLimit`` fields, in virtual time: their values follow the
tenant's bucket (full, drained, refilling, in debt; wall seconds whatever ``gpu.time_scale``), and the
HTTP answers of a tenant's requests carry the bucket as of the answer."""

from __future__ import annotations

import math
import re

import httpx
import trio
import trio.testing

from apsd.core.admission import Admission
from apsd.core.clock import ModelClock
from apsd.core.config import GpuConfig, TenantConfig
from apsd.core.ledger import Ledger
from apsd.core.models import InferenceRequest
from apsd.pipeline import open_pipeline
from apsd.policies.batching import MicroBatching, MicroParams
from apsd.serve.http import create_app, create_asgi
from tests.helpers import build_policies, make_config

FIELDS = re.compile(r'"tokens";r=(\d+);t=(\d+)')


def admission(clock: ModelClock) -> Admission:
    return Admission(tenants={"t": TenantConfig(rate=100.0, burst=1000)},
                     batching=MicroBatching(MicroParams()), ledger=Ledger(tenant_names=["t"]), clock=clock,
                     engine_refuse=lambda request: None, max_queued=100, max_queued_per_tenant=100)


def fields(admission: Admission) -> tuple[str, tuple[int, int]]:
    headers = admission.rate_limit_headers("t")
    match = FIELDS.fullmatch(headers["RateLimit"])
    assert match is not None, headers
    return headers["RateLimit-Policy"], (int(match[1]), int(match[2]))


async def test_the_fields_follow_the_bucket_full_drained_refilling_and_in_debt(autojump_clock):
    a = admission(ModelClock(time_scale=1.0))
    assert fields(a) == ('"tokens";q=1000;w=10', (1000, 0))          # full: nothing to wait for
    assert a.decide(InferenceRequest("r1", "t", 5, 500, 5)) is None    # 505 taken
    assert fields(a)[1] == (495, 6)                                    # full again in 5.05 s
    await trio.sleep(2.0)
    assert fields(a)[1] == (695, 4)                                    # 200 more, 3.05 s to go
    a.buckets["t"].give_back(-1000, trio.current_time())               # settled above its reservation: in debt
    assert fields(a)[1] == (0, 14)                                     # -305 left: 13.05 s to full, r never < 0
    await trio.sleep(13.05)
    assert fields(a)[1] == (1000, 0)


async def test_the_seconds_are_wall_seconds(autojump_clock):
    a = admission(ModelClock(time_scale=0.1))   # (a model second lasts 0.1 wall seconds)
    assert a.decide(InferenceRequest("r1", "t", 0, 800, 5)) is None
    policy, (remaining, reset) = fields(a)
    assert policy == '"tokens";q=1000;w=1' and (remaining, reset) == (200, 1)   # 8 model s = 0.8 wall s
    refusal = a.decide(InferenceRequest("r2", "t", 0, 800, 5))
    assert refusal.status == 429 and refusal.headers["RateLimit"] == '"tokens";r=200;t=1'


async def test_http_answers_carry_the_bucket_as_of_the_answer(autojump_clock):
    """Through the app (the ASGI app the daemon serves, called in process, in virtual time): a message's 200 carries the bucket after its
    settlement, at the moment of the answer; a 429's and a 413's the bucket at the refusal."""
    config = make_config(gpu=GpuConfig(time_scale=1.0), tenants={"t": TenantConfig(rate=2.0, burst=1000)})
    async with open_pipeline(config, build_policies(config)) as pipeline:
        transport = httpx.ASGITransport(app=create_asgi(create_app(pipeline)))
        http = httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1")
        body = {"model": "apsd-batch", "max_tokens": 400, "messages": [{"role": "user", "content": "Hi"}]}
        sent_at = pipeline.clock.now()   # (admitted at once: nothing waits in virtual time before admission)
        answer = await http.post("/v1/messages", json=body, headers={"X-Apsd-Tenant": "t"})
        assert answer.status_code == 200
        cost = answer.json()["usage"]["input_tokens"] + 400
        now, bucket = pipeline.clock.now(), pipeline.admission.buckets["t"]
        level = 1000 - cost + 2.0 * (now - sent_at)   # (taken at admission, refilling at 2 a second since)
        assert now > sent_at and level < 1000
        assert answer.headers["RateLimit-Policy"] == '"tokens";q=1000;w=500'
        assert tuple(map(int, FIELDS.fullmatch(answer.headers["RateLimit"]).groups())) == (
            math.floor(level), math.ceil((1000 - level) / 2.0))
        limited = await http.post("/v1/messages", json={**body, "max_tokens": 900}, headers={"X-Apsd-Tenant": "t"})
        assert limited.status_code == 429
        missing = 900 + cost - 400 - bucket.level(pipeline.clock.now())
        assert limited.headers["Retry-After"] == str(math.ceil(missing / 2.0))
        assert limited.headers["RateLimit"] == answer.headers["RateLimit"]   # (no time passed, nothing taken)
        too_big = await http.post("/v1/messages", headers={"X-Apsd-Tenant": "t"},   # (a prompt beyond the burst)
                                  json={**body, "messages": [{"role": "user", "content": "9 " * 800}]})
        assert too_big.status_code == 413 and too_big.headers["RateLimit"] == answer.headers["RateLimit"]
        await trio.sleep(600)
        later = await http.post("/v1/messages/count_tokens", json=body, headers={"X-Apsd-Tenant": "t"})
        assert later.status_code == 200 and later.headers["RateLimit"] == '"tokens";r=1000;t=0'
