"""Service classes over real HTTP: the header and the body field, 403 and 400, and the metrics."""

import trio
from prometheus_client.parser import text_string_to_metric_families

from apsd.core.config import ServerConfig
from tests.helpers import infer_body, make_config, start_daemon

CONFIG = {"classes": {"interactive": {"ttft_s": 60.0}, "batch": {"ttft_s": 600.0, "on_miss": "best_effort"}},
          "tenants": {"tenant_a": {"rate": 1e6, "burst": 10**9, "classes": ["interactive"]},
                      "tenant_b": {"rate": 1e6, "burst": 10**9, "classes": ["interactive", "batch"],
                                   "default_class": "batch"}}}


async def test_classes_through_infer_and_openai_and_their_metrics():
    config = make_config(CONFIG, server=ServerConfig(host="127.0.0.1", port=0))
    async with trio.open_nursery() as nursery:
        running = await start_daemon(nursery, config)
        async with running.client as client:
            ok = await client.post("/infer", json=infer_body("tenant_a", tokens=4, service_class="interactive"))
            assert ok.status_code == 200, ok.text
            by_header = await client.post("/infer", json=infer_body("tenant_b", tokens=4),
                                          headers={"X-Apsd-Class": "interactive"})
            assert by_header.status_code == 200
            default = await client.post("/infer", json=infer_body("tenant_b", tokens=4))
            assert default.status_code == 200
            forbidden = await client.post("/infer", json=infer_body("tenant_a", tokens=4),
                                          headers={"X-Apsd-Class": "batch"})
            assert forbidden.status_code == 403
            assert forbidden.json()["error"] == "class_not_allowed" and forbidden.json()["field"] == "service_class"
            unknown = await client.post("/infer", json=infer_body("tenant_a", tokens=4, service_class="gold"))
            assert unknown.status_code == 400
            assert unknown.json()["error"] == "unknown_class" and unknown.json()["field"] == "service_class"
            chat = {"model": (await client.get("/v1/models")).json()["data"][0]["id"], "max_tokens": 4,
                    "messages": [{"role": "user", "content": "hi"}], "service_class": "batch"}
            refused = await client.post("/v1/chat/completions", json=chat, headers={"X-Apsd-Tenant": "tenant_a"})
            assert refused.status_code == 403 and refused.json()["error"]["code"] == "class_not_allowed"
            assert refused.json()["error"]["param"] == "service_class"
            served = await client.post("/v1/chat/completions", json=chat, headers={"X-Apsd-Tenant": "tenant_b"})
            assert served.status_code == 200, served.text
            text = (await client.get("/metrics")).text
        running.daemon.request_shutdown()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples
               if s.name.startswith("apsd_class")}
    assert samples[("apsd_class_requests_total", (("class", "interactive"), ("result", "met")))] == 2
    assert samples[("apsd_class_requests_total", (("class", "batch"), ("result", "met")))] == 2
    assert samples[("apsd_class_requests_total", (("class", "batch"), ("result", "refused")))] == 0
    assert samples[("apsd_class_attainment", (("class", "interactive"),))] == 1.0
