"""Benchmark: the queue's and admission's share of a request's CPU time on the daemon's path.

``bench_queue.py`` times the fair-share queue against raw ``heapq`` (2.8-3.8x at every depth and
tenant count). Whether that matters depends on what else a request costs (the goal is the share,
not a ratio to heapq): this benchmark runs a
daemon in this process (the shipped defaults: ``fair``, the batch engine, its model clock sped up
1,000x so that the GPU's simulated time is not what is measured) and a load generator in another
process (so its CPU is not counted), sends ``--requests`` ``POST /infer`` over real HTTP with
``--tenants`` tenants and ``--concurrency`` in flight, and reports:

- the daemon process's CPU time per request (``time.process_time``);
- the time spent inside the queue's methods per request (push, pop, peek, ``pop_first``,
  ``effective_priority``, ``on_finish``; each call wrapped in two ``perf_counter_ns`` reads, which
  are counted too, so the figure is an upper bound), and inside admission's (``handle``: the
  bucket, the limits, the booking; ``settle``: the bucket's settlement at the end);
- their share of the request's CPU. The goal: under 2% together.

    .venv/bin/python benchmarks/bench_queue_share.py              # about half a minute
    .venv/bin/python benchmarks/bench_queue_share.py --requests 20000 --tenants 1000
"""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import trio

if __package__ in (None, ""):  # run as a script, benchmarks/bench_x.py: import from the repository root
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from apsd.core.admission import Admission
from apsd.core.config import TenantConfig
from tests.helpers import make_config, start_daemon

QUEUE_METHODS = ("push", "pop", "peek", "pop_first", "effective_priority", "on_finish")
ADMISSION_METHODS = ("handle", "settle")

CLIENT = textwrap.dedent("""
    import sys, trio, httpx
    url, n, concurrency, tenants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    async def main():
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
            left = iter(range(n))
            async def worker():
                for i in left:
                    body = {"tenant_id": f"t{i % tenants}", "prompt": "hello there", "tokens_requested": 4,
                            "priority_bid": 1 + i % 10}
                    r = await client.post("/infer", json=body)
                    assert r.status_code == 200, r.text
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(worker)
    trio.run(main)
""")


class Timer:
    """Wraps methods to add up the nanoseconds spent in them."""

    def __init__(self) -> None:
        self.ns = 0
        self.calls = 0

    def wrap(self, owner: Any, names: Sequence[str]) -> None:
        """``owner``'s methods ``names`` (an instance's, or a slotted class's for all its instances)."""
        for name in names:
            method = getattr(owner, name, None)
            if method is not None:
                setattr(owner, name, self._timed(method))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter_ns

        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return method(*args, **kwargs)
            finally:
                self.ns += clock() - started
                self.calls += 1
        return timed


async def measure(requests: int, concurrency: int, tenants: int) -> tuple[float, float, int, float, int]:
    """(Daemon CPU seconds per request; queue seconds and calls per request; admission seconds and
    calls per request.)"""
    config = make_config({"gpu": {"time_scale": 0.001}, "server": {"port": 0}},
                         tenants={f"t{i}": TenantConfig(rate=1e9, burst=10**12) for i in range(tenants)})
    queue, admission = Timer(), Timer()
    admission.wrap(Admission, ADMISSION_METHODS)   # (slotted: wrapped on the class)
    async with trio.open_nursery() as nursery:
        running = await start_daemon(nursery, config)
        queue.wrap(running.daemon.pipeline.scheduler.queue, QUEUE_METHODS)
        cpu = time.process_time()
        client = await trio.run_process([sys.executable, "-c", CLIENT, running.url, str(requests), str(concurrency),
                                         str(tenants)], check=False)
        cpu = time.process_time() - cpu
        nursery.cancel_scope.cancel()
    if client.returncode:
        raise SystemExit(f"the load generator failed (exit {client.returncode})")
    return (cpu / requests, queue.ns / 1e9 / requests, queue.calls // requests,
            admission.ns / 1e9 / requests, admission.calls // requests)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tenants", type=int, default=100)
    args = parser.parse_args(argv)
    per_request, in_queue, calls, in_admission, admission_calls = trio.run(
        measure, args.requests, args.concurrency, args.tenants)
    print(f"{args.requests} requests, {args.tenants} tenants, {args.concurrency} in flight (fair, batch engine)")
    print(f"daemon CPU per request:       {per_request * 1e6:8.1f} us")
    print(f"in the queue per request:     {in_queue * 1e6:8.1f} us ({calls} calls, timing included)")
    print(f"in admission per request:     {in_admission * 1e6:8.1f} us ({admission_calls} calls, timing included)")
    print(f"the queue's share:            {in_queue / per_request:8.2%}")
    print(f"admission's share:            {in_admission / per_request:8.2%}")
    print(f"together:                     {(in_queue + in_admission) / per_request:8.2%}  (goal: under 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
