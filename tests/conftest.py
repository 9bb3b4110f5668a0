"""Fixtures: a policy registry without third-party plugins, a live daemon on port 0, and pipelines
in virtual time. Helpers are in ``tests/helpers.py``.

Also a real-time deadline for every trio test (:func:`pytest_collection_modifyitems`): pytest-timeout
interrupts a test with a signal, and when the signal lands in trio's run loop (a test waiting on a
hung process or socket, the usual case) the exception leaves ``trio.run`` without unwinding it: the
test's processes are never stopped and the next test fails with "Attempted to call run() from inside
a run()" (or pytest stops with an INTERNALERROR). So a trio test still running
:data:`DEADLINE_MARGIN_S` before its pytest-timeout limit is cancelled from inside trio instead: it
unwinds like any cancelled code (its ``finally`` blocks stop what it started) and fails, naming the
deadline, and the next test starts clean. pytest-timeout stays the last resort for a test that does
not heed cancellation.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio

from apsd.core.config import Config, ServerConfig, TenantConfig
from apsd.core.policy import PolicyRegistry
from apsd.pipeline import Pipeline, open_pipeline
from apsd.plugins import load_policy_registry, make_plugin_manager

from .helpers import FAST_GPU, LiveDaemon, build_policies, make_config, start_daemon

#: A trio test is cancelled this long (real seconds) before its pytest-timeout limit.
DEADLINE_MARGIN_S = 10.0


def _timeout_s(item: pytest.Item) -> float:
    """The item's pytest-timeout limit in seconds (its marker, else ``--timeout``, else the ini's); 0: none."""
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        value = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        if value is not None:
            return float(value)
    option = item.config.getoption("timeout", None)
    if option is not None:
        return float(option)
    return float(item.config.getini("timeout") or 0)


def trio_run_with_deadline(limit_s: float) -> Callable[..., Any]:
    """A ``trio.run`` for pytest-trio that cancels the whole test (fixtures included) after ``limit_s``
    real seconds, whatever the test's clock (a thread's timer, not trio's), and then fails it."""
    def run(async_fn: Callable[[], Awaitable[Any]], *, clock: Any = None, instruments: Any = ()) -> Any:
        scope = trio.CancelScope()
        fired = threading.Event()
        timers: list[threading.Timer] = []

        def fire(token: trio.lowlevel.TrioToken) -> None:
            fired.set()
            try:
                token.run_sync_soon(scope.cancel)
            except trio.RunFinishedError:
                pass

        async def guarded() -> Any:
            timer = threading.Timer(limit_s, fire, args=(trio.lowlevel.current_trio_token(),))
            timer.daemon = True
            timers.append(timer)
            timer.start()
            with scope:
                return await async_fn()

        try:
            result = trio.run(guarded, clock=clock, instruments=instruments)
        except BaseException as exc:
            if fired.is_set():
                exc.add_note(f"(the test was cancelled after {limit_s:.0f} s of real time: its deadline, "
                             f"{DEADLINE_MARGIN_S:.0f} s before pytest-timeout's)")
            raise
        finally:
            for timer in timers:
                timer.cancel()
        if fired.is_set():
            pytest.fail(f"still running after {limit_s:.0f} s of real time: cancelled inside trio "
                        f"{DEADLINE_MARGIN_S:.0f} s before pytest-timeout's limit", pytrace=False)
        return result

    return run


def pytest_configure(config: pytest.Config) -> None:
    """Every daemon the tests start, in this process or as a subprocess, keeps its default state in a
    directory of this run's own, never in the user's ``~/.local/state/apsd`` (whose file a newer or
    older apsd may have written, and which the tests must not change)."""
    os.environ.pop("STATE_DIRECTORY", None)
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="apsd-tests-state-")


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's state directory goes with the run."""
    state_home = os.environ.get("XDG_STATE_HOME", "")
    if "apsd-tests-state-" in state_home:
        shutil.rmtree(state_home, ignore_errors=True)


@pytest.hookimpl(trylast=True)  # after pytest-trio has marked the async tests (trio_mode)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run every trio test under :func:`trio_run_with_deadline` (a ``trio`` marker naming its run,
    first among the item's markers: pytest-trio takes the first that names one)."""
    for item in items:
        if item.get_closest_marker("trio") is None:
            continue
        timeout = _timeout_s(item)
        if timeout > DEADLINE_MARGIN_S:
            item.add_marker(pytest.mark.trio(run=trio_run_with_deadline(timeout - DEADLINE_MARGIN_S)), append=False)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A trio run left behind by a test that pytest-timeout interrupted anyway (one that ignored its
    cancellation) is closed here, once nothing refers to it, rather than fail every later test."""
    if trio.lowlevel.in_trio_run():
        gc.collect()
    if trio.lowlevel.in_trio_run():
        pytest.fail("a trio run left behind by an earlier test (interrupted by pytest-timeout) is still "
                    "open; see that test's failure", pytrace=False)


@pytest.fixture
def registry() -> PolicyRegistry:
    return load_policy_registry(make_plugin_manager(load_entry_points=False))


@pytest.fixture
async def live(nursery: trio.Nursery) -> AsyncIterator[LiveDaemon]:
    """A real daemon on 127.0.0.1:0 with a fast GPU and a small, slow-filling tenant."""
    config = make_config(
        server=ServerConfig(host="127.0.0.1", port=0, shutdown_grace_s=5.0, max_body_bytes=65_536),
        gpu=FAST_GPU,
        tenants={
            "tenant_a": TenantConfig(rate=500.0, burst=5000),
            "tenant_b": TenantConfig(rate=300.0, burst=3000),
            # refills 1 token per 1000 model s, i.e. per wall second at time_scale 0.001
            "trickle": TenantConfig(rate=0.001, burst=100),
            "big": TenantConfig(rate=1e6, burst=100_000),
        },
    )
    running = await start_daemon(nursery, config)
    async with running.client:
        yield running
    running.daemon.request_shutdown()


@pytest.fixture
def virtual_pipeline(nursery: trio.Nursery) -> Callable[..., Awaitable[Pipeline]]:
    """Start pipelines (no HTTP) in virtual time: ``pipeline = await virtual_pipeline(config, preset)``.
    The test must name ``autojump_clock`` too: pytest-trio takes the clock from the test's own
    arguments, not from its fixtures' (without it, "virtual" time is the real clock).

    Built-in policies only. Each runs in a task of the test's ``nursery`` (pytest-trio's), which is
    cancelled after the test: requests still unfinished then are answered 503 as the pipeline stops.
    """
    async def start(config: Config | None = None, preset: str | None = None, **kwargs: Any) -> Pipeline:
        config = config or make_config()
        policies = build_policies(config, preset)

        async def run(task_status: trio.TaskStatus[Pipeline] = trio.TASK_STATUS_IGNORED) -> None:
            async with open_pipeline(config, policies, **kwargs) as pipeline:
                task_status.started(pipeline)
                await trio.sleep_forever()

        return await nursery.start(run)

    return start
