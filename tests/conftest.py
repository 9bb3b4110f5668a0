"""Shared fixtures: configs, a policy registry without third-party plugins, a live daemon on port 0."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import pytest
import trio

from apsd.config import Config, GpuConfig, ServerConfig, TenantConfig, parse_config
from apsd.daemon import Daemon
from apsd.models import InferenceRequest
from apsd.pipeline import Pipeline
from apsd.plugins import load_policy_registry, make_plugin_manager
from apsd.policy import PolicyRegistry, PolicySet


@pytest.fixture
def registry() -> PolicyRegistry:
    return load_policy_registry(make_plugin_manager(load_entry_points=False))


def make_config(toml_data: dict[str, Any] | None = None, **sections: Any) -> Config:
    """A Config from TOML-shaped data, then attrs sections replaced wholesale."""
    config = parse_config(toml_data or {}, "<test>")
    return attrs.evolve(config, **sections)


def build_policies(config: Config, preset: str | None = None) -> PolicySet:
    return load_policy_registry(make_plugin_manager(load_entry_points=False)).build(config, preset)


async def submit_at(pipeline: Pipeline, at: float, *, tenant: str, prompt_tokens: int, tokens: int,
                    bid: int) -> InferenceRequest:
    """Submit a request at model time ``at`` (virtual time friendly); returns it."""
    await pipeline.clock.sleep_until(at)
    request = pipeline.new_request(tenant_id=tenant, prompt="", tokens_requested=tokens, priority_bid=bid,
                                   prompt_tokens=prompt_tokens)
    refusal = pipeline.submit_nowait(request)
    assert refusal is None, refusal
    return request


FAST_GPU = GpuConfig(time_scale=0.001)


@attrs.define
class LiveDaemon:
    daemon: Daemon
    url: str
    client: httpx.AsyncClient


async def _start_daemon(nursery: trio.Nursery, config: Config, preset: str | None = None) -> LiveDaemon:
    daemon = Daemon.from_config(config, preset=preset, handle_signals=False,
                                plugin_manager=make_plugin_manager(load_entry_points=False))
    binds = await nursery.start(daemon.run)
    url = binds[0]
    return LiveDaemon(daemon, url, httpx.AsyncClient(base_url=url, timeout=30))


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
    running = await _start_daemon(nursery, config)
    async with running.client:
        yield running
    running.daemon.request_shutdown()


start_daemon = _start_daemon
