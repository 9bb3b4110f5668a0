"""Clients that spend a dollar budget through running daemons, in a process of their own.

The money tests' 200 concurrent clients run here, not in the test's process: there they would share one
event loop with the daemons under test, and on a loaded machine the daemons' exchanges with the shared
store would wait behind the clients (a lease answered late is no lease). :func:`spend` starts this module
as ``python -m tests.budget_spender URL... --tenant T``; it prints one JSON line: what was spent (priced
from the answers' own usage with :data:`tests.helpers.PRICES`' rates), how many were served, and the
refusals by error code.

A client refused ``budget_exhausted`` while requests are still in flight on some daemon (its budget shows
them reserved) tries again, since they may give back part of what they reserved; it stops once every
daemon has nothing reserved. ``budget_leasing`` waits its ``Retry-After``. Every loop is bounded: a
client sends at most :data:`MAX_SENDS` requests.
"""

from __future__ import annotations

import argparse
import json
import sys

import attrs
import httpx
import trio

#: The stand-in's prices in the money tests ($ per million prompt and output tokens: tests.helpers.PRICES).
INPUT_PER_1M_USD, OUTPUT_PER_1M_USD = 2.0, 10.0
#: Requests one client sends at most (a budget of ~600 requests among 200 clients needs a few each).
MAX_SENDS = 400


def priced(usage: dict) -> float:
    return (usage["prompt_tokens"] * INPUT_PER_1M_USD + usage["completion_tokens"] * OUTPUT_PER_1M_USD) / 1e6


@attrs.define
class Spender:
    spent: float = 0.0
    served: int = 0
    refusals: dict[str, int] = attrs.field(factory=dict)
    sent: int = 0

    async def nothing_reserved(self, admins: list[httpx.AsyncClient], tenant: str) -> bool:
        for admin in admins:
            budget = (await admin.get(f"/admin/tenants/{tenant}")).json()["live"]["budget_usd"]
            if budget["reserved_usd"]:
                return False
        return True

    async def client(self, http: httpx.AsyncClient, admins: list[httpx.AsyncClient], tenant: str) -> None:
        for _ in range(MAX_SENDS):
            self.sent += 1
            answer = await http.post("/v1/completions", headers={"X-Apsd-Tenant": tenant},
                                     json={"model": "standin", "prompt": f"request {self.sent:05d}", "max_tokens": 100})
            if answer.status_code == 200:
                self.served += 1
                self.spent += priced(answer.json()["usage"])
                continue
            error = answer.json()["error"]["code"]
            self.refusals[error] = self.refusals.get(error, 0) + 1
            if answer.status_code != 429 or error not in ("budget_exhausted", "budget_leasing"):
                raise AssertionError(f"unexpected answer {answer.status_code}: {answer.text}")
            if error == "budget_leasing":
                await trio.sleep(float(answer.headers["Retry-After"]))
            elif await self.nothing_reserved(admins, tenant):
                return
            else:
                await trio.sleep(0.05)
        raise AssertionError(f"a client sent {MAX_SENDS} requests and the budget was still not spent")

    async def spend(self, urls: list[str], tenant: str, count: int = 200, per_pool: int = 10) -> None:
        """``count`` clients at once, spread over the daemons at ``urls`` (httpx pools of ``per_pool``
        clients each: one pool of 200 connections costs more than the daemon)."""
        # (no connection kept alive: a daemon closes one idle for 5 s, and a request sent on it as it closes
        # gets no answer at all, on a loaded machine now and then)
        fresh = httpx.Limits(max_keepalive_connections=0)
        pools = [httpx.AsyncClient(base_url=urls[i % len(urls)], timeout=60, limits=fresh)
                 for i in range(count // per_pool)]
        admins = [httpx.AsyncClient(base_url=url, timeout=60, limits=fresh) for url in urls]
        try:
            async with trio.open_nursery() as nursery:
                for number in range(count):
                    mine = admins[number % len(urls)]
                    nursery.start_soon(self.client, pools[number % len(pools)],
                                       [mine, *[a for a in admins if a is not mine]], tenant)
        finally:
            for client in pools + admins:
                await client.aclose()


@attrs.frozen
class Spent:
    spent: float
    served: int
    refusals: dict[str, int]


async def spend(urls: list[str], tenant: str, *, count: int = 200, limit_s: float = 180.0) -> Spent:
    """Run ``count`` clients in a process of their own against the daemons at ``urls`` until ``tenant``'s
    dollar budget is spent (killed after ``limit_s``)."""
    command = [sys.executable, "-m", "tests.budget_spender", *urls, "--tenant", tenant, "--count", str(count)]
    with trio.fail_after(limit_s):
        done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    if done.returncode != 0:
        raise AssertionError(f"the spending clients failed ({done.returncode}): {done.stderr.decode()[-4000:]}")
    return Spent(**json.loads(done.stdout.decode().strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("urls", nargs="+")
    parser.add_argument("--tenant", required=True)
    parser.add_argument("--count", type=int, default=200)
    args = parser.parse_args()
    spender = Spender()
    trio.run(spender.spend, args.urls, args.tenant, args.count)
    print(json.dumps({"spent": spender.spent, "served": spender.served, "refusals": spender.refusals}))


if __name__ == "__main__":
    main()
