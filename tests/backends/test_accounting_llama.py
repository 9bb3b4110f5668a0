"""What a tenant is charged for its prompt, against a real llama.cpp ``llama-server``: the estimate
admission reserves is never far below the backend's count (adversarial prompts: digits, punctuation,
CJK and emoji, whitespace runs, code, random letters), concurrent symbol-heavy requests stay within
the tenant's bucket and budget, and a client that leaves before the first token is charged the
prompt the backend took in. Real HTTP both ways, real processes, stopped by their PIDs."""

from __future__ import annotations

import os
import random
import signal
import string

import httpx
import pytest
import trio

from apsd.core.admission import estimate_tokens
from apsd.core.config import AdmissionConfig, TenantConfig
from tests.helpers import backends_up, bucket_level, forwarding_config, start_daemon, wait_until
from tests.llama_server import (  # noqa: F401  (fixtures)
    llama_server,
    llama_server_binary,
    open_llama_server,
    slow_model,
    tiny_model,
)

pytestmark = pytest.mark.timeout(180)

#: What a backend adds to any prompt beyond its text: a start-of-text token, and SentencePiece's
#: leading space (docs/reference/accounting.md states the bound with it).
START_TOKENS = 2

_rng = random.Random(34)
ADVERSARIAL = {
    "digits": "".join(_rng.choice(string.digits) for _ in range(600)),
    "punctuation": "".join(_rng.choice(string.punctuation) for _ in range(600)),
    "cjk and emoji": "天地玄黄🙂宇宙洪荒👍🏽日月盈昃é" * 20,
    "whitespace runs": "  \t\n   \r\n" * 60,
    "code": "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # ok\n" * 10,
    "printable": "".join(_rng.choice(string.printable) for _ in range(600)),
    "prose": "The quick brown fox jumps over the lazy dog. " * 12,
    "random letters": "".join(_rng.choice(string.ascii_letters) for _ in range(600)),
}


def letter_bound(text: str) -> float:
    """How far the backend's count may pass the estimate on letters (docs/reference/accounting.md):
    a tokenizer that spells each letter out, and the spaces that begin words."""
    letters = sum(c.isascii() and c.isalpha() for c in text)
    word_spaces = sum(1 for a, b in zip(text, text[1:]) if a == " " and b.isascii() and b.isalpha())
    return letters * (1 - 1 / AdmissionConfig().chars_per_token) + word_spaces


async def test_the_estimate_is_never_far_below_the_backends_count(llama_server):
    """The backend's count of each adversarial prompt (its usage for a completion of it) is at most
    the estimate plus the start tokens; with letters, plus the letters' bound. The old estimate
    (every ASCII character at 4 a token) was 4x below on digits and punctuation."""
    settings = AdmissionConfig()
    async with httpx.AsyncClient(base_url=llama_server.url, timeout=60) as client:
        for name, prompt in ADVERSARIAL.items():
            answer = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            counted = answer.json()["usage"]["prompt_tokens"]
            estimate = estimate_tokens(prompt, settings)
            print(f"{name}: the backend counts {counted}, apsd estimates {estimate}")
            assert counted <= estimate + START_TOKENS + letter_bound(prompt), name
            if not any(c.isascii() and c.isalpha() for c in prompt):
                assert estimate <= counted, name  # (and no more than the worst case: this tokenizer's)


async def test_twenty_concurrent_symbol_heavy_requests_stay_within_the_bucket_and_the_budget(nursery, llama_server):
    """20 concurrent completions of 600 digits and symbols (602 tokens to the backend, 150 to the old
    estimate) + 8 output tokens, for a tenant whose bucket and budget hold 3,000: what the backend
    counted for the admitted ones stays within both (the old estimate admitted all 20: 12,200 tokens,
    4x the bucket)."""
    prompt = ADVERSARIAL["digits"][:300] + ADVERSARIAL["punctuation"][:300]
    tenants = {"t": TenantConfig(rate=1e-6, burst=3000, budget_tokens=3000)}
    running = await start_daemon(nursery, forwarding_config([llama_server.url], tenants))
    await wait_until(backends_up(running.daemon, 1))
    answers: list[httpx.Response] = []
    async with running.client as client:
        async def one() -> None:
            answers.append(await client.post("/v1/completions", headers={"X-Apsd-Tenant": "t"},
                                             json={"model": "tiny", "prompt": prompt, "max_tokens": 8}))

        async with trio.open_nursery() as senders:
            for _ in range(20):
                senders.start_soon(one)
        done = [a.json()["usage"] for a in answers if a.status_code == 200]
        refused = {a.json()["error"]["code"] for a in answers if a.status_code != 200}
        used = sum(u["prompt_tokens"] + u["completion_tokens"] for u in done)
        print(f"{len(done)} of 20 admitted, {used} tokens used; refused: {refused}")
        assert done and refused <= {"rate_limited", "budget_exhausted"}
        assert used <= 3000
        assert bucket_level(running.daemon, "t") >= 0
        budget = (await client.get("/admin/tenants/t")).json()["live"]["budget"]
        assert budget["spent"] == used <= budget["limit"]
    running.daemon.request_shutdown()


async def test_a_client_that_leaves_before_the_first_token_is_charged_the_prompt_the_backend_took(
        nursery, llama_server_binary, slow_model, tmp_path):
    """The outside tester got 180k prompt tokens prefilled for nothing by leaving before the first
    token. Now: a streamed completion of 3,000 digits is sent; the server is held (SIGSTOP) so that no
    token can come; the client leaves; the server is let go. The tenant is charged the backend's own
    count of the prompt (asked of it), and no output."""
    prompt = "".join(random.Random(7).choice(string.digits) for _ in range(3000))
    async with open_llama_server(slow_model, alias="slow", binary=llama_server_binary, log_dir=tmp_path,
                                 parallel=1) as server:
        running = await start_daemon(nursery, forwarding_config(
            [server.url], {"t": TenantConfig(rate=1e-6, burst=10**9)}, max_concurrency=1, health_timeout_s=10.0,
            health_interval_s=30.0))
        daemon = running.daemon
        await wait_until(backends_up(daemon, 1))
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
            truth = await client.post("/v1/completions", headers={"X-Apsd-Tenant": "t"},
                                      json={"model": "slow", "prompt": prompt, "max_tokens": 1})
            backend_count = truth.json()["usage"]["prompt_tokens"]
            before = daemon.pipeline.tenant_status("t")
            engine = daemon.pipeline.engines[0]
            backend = engine.backends[0]
            sent_before = backend.requests

            async def leave_early(task_status=trio.TASK_STATUS_IGNORED) -> None:
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    async with client.stream("POST", "/v1/completions", headers={"X-Apsd-Tenant": "t"},
                                             json={"model": "slow", "prompt": prompt, "max_tokens": 50,
                                                   "stream": True}) as response:
                        await response.aread()

            async with trio.open_nursery() as inner:
                scope = await inner.start(leave_early)
                await wait_until(lambda: backend.requests > sent_before, step_s=0.005)   # it was sent
                os.kill(server.process.pid, signal.SIGSTOP)
                try:
                    scope.cancel()                                   # the client leaves
                    await wait_until(lambda: not engine._running or all(
                        attempt.scope.cancel_called for attempt in engine._running.values()))
                finally:
                    os.kill(server.process.pid, signal.SIGCONT)
            await wait_until(lambda: daemon.pipeline.tenant_status("t").cancelled == before.cancelled + 1)
        after = daemon.pipeline.tenant_status("t")
        assert after.generated_tokens == before.generated_tokens      # no token came
        charged = after.prompt_tokens - before.prompt_tokens
        assert abs(charged - backend_count) <= 2, (charged, backend_count)
        daemon.request_shutdown()
