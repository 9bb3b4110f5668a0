"""Structured logs of the installed command: one line per event, text or JSON, no prompts by default."""

from __future__ import annotations

import json

import httpx

from tests.helpers import start_apsd, stop_apsd

SECRET = "the secret prompt text"


async def run_and_collect(*args: str) -> str:
    process, url, seen = await start_apsd("--port", "0", *args)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            ok = await client.post("/infer", json={"tenant_id": "tenant_c", "prompt": SECRET,
                                                   "tokens_requested": 2, "priority_bid": 5})
            assert ok.status_code == 200
            assert (await client.post("/infer", json={"tenant_id": "nobody", "prompt": SECRET,
                                                      "tokens_requested": 2, "priority_bid": 5})).status_code == 404
        return await stop_apsd(process, seen)
    finally:
        if process.returncode is None:
            process.kill()


async def test_json_logs_one_object_per_line_with_events_and_no_prompt():
    text = await run_and_collect("--log-format", "json", "--log-level", "DEBUG")
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    events = {r.get("event") for r in records}
    assert {"start", "ready", "reject", "batch", "request", "shutdown", "stopped"} <= events
    reject = next(r for r in records if r.get("event") == "reject")
    assert (reject["tenant"], reject["status"], reject["error"]) == ("nobody", 404, "unknown_tenant")
    request = next(r for r in records if r.get("event") == "request")
    assert request["tenant"] == "tenant_c" and request["request_id"] and "prompt" not in request
    assert SECRET not in text


async def test_text_logs_and_prompts_only_when_asked():
    text = await run_and_collect("--log-level", "DEBUG", "--log-prompts")
    assert "event=batch" in text and "event=reject" in text
    assert f"prompt=\"{SECRET}\"" in text
    default = await run_and_collect()                      # INFO: rejects; no batch or request lines
    assert "event=reject" in default and SECRET not in default
    assert "event=batch" not in default and "event=request" not in default


def test_text_fields_are_quoted_so_client_values_cannot_forge_lines():
    import logging

    from apsd.serve.logs import TextFormatter

    record = logging.LogRecord("apsd.core.events", logging.INFO, __file__, 1, "request rejected", None, None)
    record.event, record.tenant = "reject", "x\n2026-01-01 00:00:00 INFO apsd: forged event=ready"
    line = TextFormatter().format(record)
    assert "\n" not in line and 'tenant="x\\n2026' in line and "event=reject" in line
