"""The number of tenants does not slow serving: work per request, and scrapes at 10,000 tenants.

Nothing here is timed. Work is counted (lines of apsd's code executed per request, traced), and
"does not hold up" is an order of events: requests answered while a scrape is known to be
rendering (its rendering held until they are).
"""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import apsd
import apsd.serve.prometheus
from apsd.core.config import QueueConfig, ServerConfig, StateConfig, TenantConfig
from apsd.core.ledger import ChangeLog
from apsd.pipeline import Pipeline
from apsd.serve.http.ui import StatusSampler
from tests.helpers import FAST_GPU, LiveDaemon, infer_body, make_config, start_daemon

MANY = 10_000
APSD_DIR = str(Path(apsd.__file__).parent)


def tenants_config(count: int) -> Any:
    """A daemon's config on 127.0.0.1:0 with ``count`` tenants t00000... that admission never throttles,
    keeping no state (the state's periodic flush, every tenant's bucket each time, is background work on
    a timer: not the request path, and how often it falls inside a measurement depends on the machine)."""
    return make_config(server=ServerConfig(host="127.0.0.1", port=0), gpu=FAST_GPU, state=StateConfig(kind="off"),
                       queue=QueueConfig(max_requests=100_000, max_requests_per_tenant=100_000,
                                         ingress_buffer=100_000),
                       tenants={f"t{i:05d}": TenantConfig(rate=1e12, burst=10**12) for i in range(count)})


def tenant(index: int, count: int) -> str:
    """Request ``index``'s tenant: consecutive requests name tenants far apart."""
    return f"t{index * 7919 % count:05d}"


def infer(index: int, count: int) -> dict[str, Any]:
    return infer_body(tenant(index, count), tokens=8)


#: Work on a timer, not on the request path: the status page's fairness sample (every tenant, every few
#: seconds of wall time). Lines run under it are not counted.
BACKGROUND = {StatusSampler.record.__code__}


def _in_background(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code in BACKGROUND:
            return True
        frame = frame.f_back
    return False


@contextmanager
def counting_apsd_lines(lines: collections.Counter[str] | None = None) -> Iterator[collections.Counter[str]]:
    """Count the lines of apsd's own code executed in this thread meanwhile, by function (into
    ``lines`` if given), but for :data:`BACKGROUND` work."""
    lines = collections.Counter() if lines is None else lines

    def local(frame: Any, event: str, arg: Any) -> Callable[..., Any]:
        if event == "line":
            lines[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1
        return local

    def calls(frame: Any, event: str, arg: Any) -> Callable[..., Any] | None:
        return local if frame.f_code.co_filename.startswith(APSD_DIR) and not _in_background(frame) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield lines
    finally:
        sys.settrace(previous)


async def touch_every_tenant(pipeline: Pipeline, count: int) -> None:
    """One request of every tenant through the pipeline (no HTTP), so that whatever keeps state per
    tenant it has seen (the fair-share queue, the histograms, the ledger) holds all of them."""
    requests = []
    for index in range(count):
        request = pipeline.new_request(tenant_id=f"t{index:05d}", prompt="", tokens_requested=2, priority_bid=5,
                                       prompt_tokens=1)
        assert pipeline.admit_now(request)
        requests.append(request)
    for request in requests:
        await request.reply.wait()


async def lines_per_request(daemon: LiveDaemon, count: int, requests: int = 30) -> tuple[float, collections.Counter]:
    """Lines of apsd's code per request of: POST /infer (spread over the tenants), GET /health
    and GET /tenants/<id>/status, one after the other over real HTTP."""
    client = daemon.client
    for index in range(5):  # (first requests on a connection, first dispatches: not counted)
        assert (await client.post("/infer", json=infer(index, count))).status_code == 200
    with counting_apsd_lines() as lines:
        for index in range(100, 100 + requests):
            assert (await client.post("/infer", json=infer(index, count))).status_code == 200
            assert (await client.get("/health")).status_code == 200
            assert (await client.get(f"/tenants/{tenant(index, count)}/status")).status_code == 200
    return sum(lines.values()) / requests, lines


@pytest.mark.timeout(300)   # (10,000 tenants and a tracer: a minute alone, several on a loaded machine)
@pytest.mark.parametrize("preset", ["aps", "fair"])
async def test_the_request_path_does_no_more_work_at_10000_tenants(preset):
    """Admission, the ledger, the scheduler, the engine, the histograms and the HTTP handlers of
    POST /infer, /health and a tenant's status execute as many lines of apsd's code per request
    with 10,000 tenants (every one of them seen before) as with one. A loop over the tenants would
    add at least 10,000 lines per request."""
    measured = {}
    with trio.fail_after(280):
        for count in (1, MANY):
            async with trio.open_nursery() as nursery:
                daemon = await start_daemon(nursery, tenants_config(count), preset)
                async with daemon.client:
                    await touch_every_tenant(daemon.daemon.pipeline, count)
                    measured[count] = await lines_per_request(daemon, count)
                daemon.daemon.request_shutdown()
    (one, one_lines), (many, many_lines) = measured[1], measured[MANY]
    grown = sorted(((many_lines[f] - one_lines[f], f) for f in many_lines.keys() | one_lines.keys()), reverse=True)
    assert many <= 1.2 * one + 20, (f"{many:.0f} lines per request at {MANY} tenants, {one:.0f} at one; "
                                    f"grown most: {grown[:5]}")


async def test_admission_does_the_same_work_at_1_and_10000_tenants(virtual_pipeline, autojump_clock):
    """Deciding and booking a request (admission's checks, its bucket, the ledger's counters and
    totals) runs exactly the same lines of admission.py and ledger.py whatever the number of tenants.
    (Model time moves between requests, so every bucket refills before each, as a busy tenant's does.)"""
    counted = {}
    for count in (1, MANY):
        pipeline = await virtual_pipeline(tenants_config(count), "aps")
        await touch_every_tenant(pipeline, count)
        lines: collections.Counter[str] = collections.Counter()
        for index in range(50):
            await trio.sleep(1.0)
            request = pipeline.new_request(tenant_id=tenant(index, count), prompt="", tokens_requested=8,
                                           priority_bid=5, prompt_tokens=3)
            with counting_apsd_lines(lines):
                assert pipeline.admission.handle(request)
        counted[count] = {f: n for f, n in lines.items() if f.startswith(("admission.py", "ledger.py"))}
    assert counted[1] == counted[MANY]
    assert sum(counted[1].values()) > 50 * 10   # (the trace did see them)


async def test_a_scrape_being_rendered_does_not_hold_up_requests(monkeypatch):
    """GET /metrics of a 10,000-tenant daemon is rendered in a worker thread: while its rendering is
    held (until the test lets it go), the daemon answers /health, POST /infer and a tenant's status.
    The scrape then shows the moment it was asked for (without the request answered meanwhile)."""
    rendering = trio.Event()
    release = threading.Event()
    threads: list[threading.Thread] = []
    render = apsd.serve.prometheus.lines.render

    def held_render(*args: Any, **kwargs: Any) -> bytes:
        threads.append(threading.current_thread())
        if threading.current_thread() is threading.main_thread():   # in the event loop: holding would freeze it
            rendering.set()
        else:
            trio.from_thread.run_sync(rendering.set)
            assert release.wait(timeout=30), "the test never released the rendering"
        return render(*args, **kwargs)

    monkeypatch.setattr(apsd.serve.prometheus.lines, "render", held_render)
    order: list[str] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            daemon = await start_daemon(nursery, tenants_config(MANY))
            async with daemon.client as client:
                assert (await client.post("/infer", json=infer(1, MANY))).status_code == 200
                scraped: dict[str, Any] = {}

                async def scrape() -> None:
                    scraped["response"] = await client.get("/metrics")
                    order.append("scrape")

                async with trio.open_nursery() as requests:
                    requests.start_soon(scrape)
                    await rendering.wait()
                    assert threads and threads[0] is not threading.main_thread(), "rendered in the event loop"
                    assert (await client.get("/health")).status_code == 200
                    order.append("health")
                    assert (await client.post("/infer", json=infer(1, MANY))).status_code == 200
                    order.append("infer")
                    status = await client.get(f"/tenants/{tenant(1, MANY)}/status")
                    assert status.status_code == 200 and status.json()["completed"] == 2
                    order.append("status")
                    release.set()
            daemon.daemon.request_shutdown()
    assert order == ["health", "infer", "status", "scrape"]
    response = scraped["response"]
    assert response.status_code == 200
    text = response.text
    assert text.count('apsd_requests_total{outcome="admitted",') == MANY
    # the moment the scrape was asked for: one completed request of t07919, not the second
    assert f'apsd_requests_total{{outcome="completed",tenant="{tenant(1, MANY)}"}} 1.0\n' in text


def test_change_log_names_each_changed_key_once_newest_first():
    log = ChangeLog()
    assert (log.mark, log.since(0)) == (0, [])
    for key in ("a", "b", "a", "c"):
        log.touch(key)
    assert log.mark == 4
    assert log.since(0) == ["c", "a", "b"]
    assert log.since(2) == ["c", "a"]            # b's only touch was the 2nd; a moved on to the 3rd
    assert log.since(4) == []
    log.touch("b")
    assert log.since(4) == ["b"]
