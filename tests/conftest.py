"""Fixtures: a policy registry without third-party plugins, a live daemon on port 0, and pipelines
in virtual time. Helpers are in ``tests/helpers.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import trio

from apsd.core.config import Config, ServerConfig, TenantConfig
from apsd.pipeline import Pipeline, open_pipeline
from apsd.plugins import load_policy_registry, make_plugin_manager
from apsd.core.policy import PolicyRegistry

from .helpers import FAST_GPU, LiveDaemon, build_policies, make_config, start_daemon


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
