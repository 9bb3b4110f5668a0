"""The operators' examples that query apsd's metrics: the Grafana dashboard (``deploy/grafana/``) and the
KEDA autoscaler (``deploy/kubernetes/keda/``). Every metric a PromQL expression of theirs names must be a
series a real daemon exports (read from ``GET /metrics`` after some traffic, not from a list kept here),
and every label it matches or groups by a label that series carries (or one Prometheus adds to every
target)."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import yaml
from prometheus_client.parser import text_string_to_metric_families

from apsd.core.config import TenantConfig
from tests.helpers import backends_up, forwarding_config, infer_body, start_daemon, wait_until
from tests.standin_backend import start_standin_backend

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "apsd-dashboard.json"
KUBERNETES = ROOT / "deploy" / "kubernetes"
SCALED_OBJECT = KUBERNETES / "keda" / "scaledobject.yaml"

#: Labels Prometheus adds to every series of a scraped target (the job's name, the target, and
#: those the usual Kubernetes service discovery relabelling adds).
TARGET_LABELS = frozenset({"job", "instance", "namespace", "pod", "node", "container", "service"})
#: The series each kind of family is exposed as (``name`` is the family's name as the parser gives it:
#: counters without ``_total``).
SERIES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "untyped": ("",)}
#: PromQL words that are neither metrics nor functions.
KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                      "offset", "inf", "nan"})


@attrs.frozen
class Exported:
    """What a daemon exports: series name -> the label names its samples carry (``le`` for buckets)."""

    series: dict[str, frozenset[str]]

    @classmethod
    def from_texts(cls, texts: list[str]) -> Exported:
        """The series of expositions (``GET /metrics`` bodies) together."""
        series: dict[str, set[str]] = {}
        for text in texts:
            for family in text_string_to_metric_families(text):
                for suffix in SERIES[family.type]:
                    series.setdefault(family.name + suffix, set())
                for sample in family.samples:
                    series.setdefault(sample.name, set()).update(sample.labels)
        return cls({name: frozenset(labels) for name, labels in series.items()})


@attrs.frozen
class Selector:
    metric: str
    labels: frozenset[str]


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_NAME = re.compile(r"(?<![\w.:$])[A-Za-z_:][A-Za-z0-9_:]*")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def parse_promql(expr: str) -> tuple[list[Selector], set[str]]:
    """The vector selectors of a PromQL expression (metric, label names matched) and the label names
    its ``by``/``without``/``on``/``ignoring``/``group_*`` clauses name. Grafana's variables
    (``$job``, ``$__rate_interval``) are left where they are: inside strings and ranges."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\[[^\]]*\]", " ", text)                       # ranges and subqueries
    grouped: set[str] = set()
    for match in _GROUPING.finditer(text):
        grouped.update(label.strip() for label in match.group(2).split(",") if label.strip())
    text = _GROUPING.sub(" ", text)
    matchers: list[tuple[int, int, frozenset[str]]] = []
    for match in re.finditer(r"\{([^}]*)\}", text):
        matchers.append((match.start(), match.end(), frozenset(_MATCHER.findall(match.group(1)))))
    bare = re.sub(r"\{[^}]*\}", lambda m: " " * len(m.group()), text)   # (positions kept)
    selectors = []
    for match in _NAME.finditer(bare):
        word, after = match.group(), bare[match.end():].lstrip()
        if after.startswith("(") or word.lower() in KEYWORDS:      # a function or an aggregation
            continue
        labels = next((found for start, _, found in matchers
                       if start >= match.end() and not bare[match.end():start].strip()), frozenset())
        selectors.append(Selector(word, labels))
    return selectors, grouped


def problems(expr: str, exported: Exported) -> list[str]:
    """What ``expr`` names that a daemon does not export (empty: every name is real)."""
    selectors, grouped = parse_promql(expr)
    found = []
    if not selectors:
        found.append(f"no metric in {expr!r}")
    carried: set[str] = set(TARGET_LABELS)
    for selector in selectors:
        if selector.metric not in exported.series:
            found.append(f"{selector.metric} is not exported")
            continue
        labels = exported.series[selector.metric]
        carried |= labels
        unknown = selector.labels - labels - TARGET_LABELS
        if unknown:
            found.append(f"{selector.metric} has no label {sorted(unknown)}")
    unknown = grouped - carried
    if unknown:
        found.append(f"no series of {expr!r} carries {sorted(unknown)}")
    return found


def label_values_query(query: str) -> tuple[str, str]:
    """``label_values(<selector>, <label>)`` (a Grafana variable's query) as (the selector, the label)."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", query)
    assert match, f"not a label_values() query: {query!r}"
    return match.group(1), match.group(2)


async def scrape(client: Any) -> str:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return response.text


@pytest.fixture
async def exported(live, nursery) -> Exported:
    """The series of two live daemons after traffic: one on the simulated engine (completions of two
    tenants, a refusal by a tenant's bucket, one for an unknown tenant), one forwarding to a stand-in
    inference server (a chat completion), so that the backends' families have samples too."""
    client = live.client
    for tenant in ("tenant_a", "tenant_a", "tenant_b", "trickle"):
        body = infer_body(tenant, prompt="", tokens=60) if tenant == "trickle" else infer_body(tenant, tokens=50)
        assert (await client.post("/infer", json=body)).status_code == 200
    assert (await client.post("/infer", json=infer_body("trickle", prompt="", tokens=60))).status_code == 429
    assert (await client.post("/infer", json=infer_body("nobody"))).status_code == 404
    texts = [await scrape(client)]
    backend = await start_standin_backend(nursery, model="standin")
    config = forwarding_config([backend.url], {"t": TenantConfig(rate=1e6, burst=10**9)}, shutdown_grace_s=1.0)
    gateway = await start_daemon(nursery, config)
    async with gateway.client as client:
        await wait_until(backends_up(gateway.daemon), step_s=0.02)
        answer = await client.post("/v1/chat/completions", headers={"X-Apsd-Tenant": "t"}, json={
            "model": "standin", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
        assert answer.status_code == 200, answer.text
        texts.append(await scrape(client))
    gateway.daemon.request_shutdown()
    return Exported.from_texts(texts)


# -- the checker itself ------------------------------------------------------------------------------

async def test_the_checker_knows_histograms_counters_and_labels(exported):
    assert exported.series["apsd_ttft_seconds_bucket"] == {"tenant", "le"}
    assert "apsd_requests_total" in exported.series and "apsd_requests" not in exported.series
    assert exported.series["apsd_backend_up"] == {"backend"}       # (from the forwarding daemon)
    assert exported.series["apsd_queue_depth_band"] == {"band"}
    good = ('sum by (tenant, le) (rate(apsd_ttft_seconds_bucket{job=~"$job", tenant=~"$tenant"}[$__rate_interval]))'
            ' / ignoring (le) group_left sum(apsd_queue_depth offset 5m) > bool 1e3')
    assert parse_promql(good)[0] == [Selector("apsd_ttft_seconds_bucket", frozenset({"job", "tenant"})),
                                     Selector("apsd_queue_depth", frozenset())]
    assert problems(good, exported) == []
    for bad, why in (("rate(apsd_queue_depth_bucket[5m])", "apsd_queue_depth_bucket is not exported"),  # a gauge
                     ("apsd_ttft_seconds", "apsd_ttft_seconds is not exported"),           # a histogram's name
                     ("rate(apsd_requests[5m])", "apsd_requests is not exported"),         # a counter's family
                     ("apsd_fairness_jain_windows", "apsd_fairness_jain_windows is not exported"),
                     ('apsd_rejections_total{reason="rate_limited"}', "apsd_rejections_total has no label"),
                     ("sum by (reason) (apsd_rejections_total)", "carries ['reason']"),
                     ("vector(1)", "no metric")):
        assert any(why in problem for problem in problems(bad, exported)), bad


# -- the Grafana dashboard ---------------------------------------------------------------------------

def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(container: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows (collapsed rows keep theirs) included."""
    for panel in container.get("panels", []):
        yield panel
        yield from panels(panel)


def test_the_dashboard_is_a_grafana_10_model_with_a_datasource_variable():
    model = dashboard()
    assert model["schemaVersion"] >= 38 and model["uid"] and model["title"]    # 38: Grafana 10.0
    variables = {v["name"]: v for v in model["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in panels(model)]
    assert len(ids) == len(set(ids))
    for panel in panels(model):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and panel.get("description"), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target.get("datasource", panel["datasource"]) == panel["datasource"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_the_dashboard_has_the_panels_operators_need():
    """Each question has a panel, and the panel asks the metric that answers it."""
    exprs = {panel["title"]: " ".join(t["expr"] for t in panel["targets"])
             for panel in panels(dashboard()) if panel["type"] != "row"}
    wanted = {  # a word of the title -> metrics its panel must query
        "outcome": {"apsd_requests_total"}, "Refusals": {"apsd_rejections_total"},
        "first token": {"apsd_ttft_seconds_bucket"}, "Queue depth by tenant": {"apsd_tenant_queue_depth"},
        "band": {"apsd_queue_depth_band"},
        "weight share": {"apsd_tenant_service_share", "apsd_tenant_weight_share"},
        "Jain": {"apsd_fairness_jain_window", "apsd_fairness_jain"},
        "Backend health": {"apsd_backend_up", "apsd_backend_saturated"},
        "store": {"apsd_store_available"},
    }
    for word, metrics in wanted.items():
        queried = {s.metric for title, expr in exprs.items() if word.lower() in title.lower()
                   for s in parse_promql(expr)[0]}
        assert metrics <= queried, (word, queried)


async def test_every_metric_the_dashboard_queries_is_exported(exported):
    model = dashboard()
    found = {}
    for panel in panels(model):
        for target in panel.get("targets", []):
            found[f"{panel['title']} {target['refId']}"] = problems(target["expr"], exported)
    for variable in model["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = label_values_query(variable["query"]["query"])
            assert variable["definition"] == variable["query"]["query"]
            found[f"${variable['name']}"] = problems(selector, exported)
            (metric,) = {s.metric for s in parse_promql(selector)[0]}
            if label not in exported.series.get(metric, frozenset()) | TARGET_LABELS:
                found[f"${variable['name']}"].append(f"{metric} has no label {label}")
    assert len(found) > 20
    assert {where: p for where, p in found.items() if p} == {}


# -- KEDA --------------------------------------------------------------------------------------------

def scaled_object() -> dict[str, Any]:
    (doc,) = [doc for doc in yaml.safe_load_all(SCALED_OBJECT.read_text()) if doc is not None]
    return doc


def apsd_deployment() -> dict[str, Any]:
    docs = [doc for doc in yaml.safe_load_all((KUBERNETES / "apsd.yaml").read_text()) if doc is not None]
    (deployment,) = [doc for doc in docs if doc["kind"] == "Deployment"]
    return deployment


def test_the_scaled_object_scales_the_apsd_deployment():
    doc = scaled_object()
    assert (doc["apiVersion"], doc["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    deployment = apsd_deployment()
    target = doc["spec"]["scaleTargetRef"]
    assert target["name"] == deployment["metadata"]["name"] == "apsd"
    assert target.get("kind", "Deployment") == "Deployment" and target.get("apiVersion", "apps/v1") == "apps/v1"
    assert doc["metadata"].get("namespace") == deployment["metadata"].get("namespace")   # (KEDA: the same one)
    spec = doc["spec"]
    # never below the Deployment's replicas (the PodDisruptionBudget lets one of them go at a time)
    assert spec["minReplicaCount"] == deployment["spec"]["replicas"] < spec["maxReplicaCount"]
    assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "apsd"


async def test_every_metric_the_scaled_object_queries_is_exported(exported):
    triggers = scaled_object()["spec"]["triggers"]
    assert triggers and {t["type"] for t in triggers} == {"prometheus"}
    queried = set()
    for trigger in triggers:
        metadata = trigger["metadata"]
        assert float(metadata["threshold"]) > 0 and metadata["serverAddress"].startswith("http")
        assert problems(metadata["query"], exported) == [], metadata["query"]
        queried |= {s.metric for s in parse_promql(metadata["query"])[0]}
    assert "apsd_queue_depth" in queried


def test_the_scaled_object_stays_out_of_the_manifests_kubectl_applies():
    """``kubectl apply -f deploy/kubernetes/`` (not recursive) must work on a cluster without KEDA's CRDs:
    the ScaledObject is applied on its own, so it is in a directory of its own, which the manifests'
    strict validation (tests/daemon/test_deploy.py, against Kubernetes' own schemas) does not read."""
    assert SCALED_OBJECT.parent != KUBERNETES
    assert SCALED_OBJECT not in set(KUBERNETES.glob("*.y*ml"))
    assert not [path for path in KUBERNETES.glob("*.y*ml") if "keda.sh" in path.read_text()]


# -- the PromQL parses -------------------------------------------------------------------------------

def every_query() -> dict[str, str]:
    """Every PromQL expression of the dashboard and the ScaledObject, by where it is."""
    queries = {f"{panel['title']} {target['refId']}": target["expr"]
               for panel in panels(dashboard()) for target in panel.get("targets", [])}
    for index, trigger in enumerate(scaled_object()["spec"]["triggers"]):
        queries[f"trigger {index}"] = trigger["metadata"]["query"]
    return queries


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian package 'prometheus'; .ci/run installs it)")
async def test_promtool_parses_every_query(tmp_path):
    """Each expression as a recording rule, Grafana's variables replaced by values (``promtool check
    rules`` parses PromQL the way Prometheus does)."""
    values = {"$__rate_interval": "1m", "$job": ".*", "$tenant": ".*"}
    rules = []
    for index, expr in enumerate(every_query().values()):
        for variable, value in values.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        rules.append({"record": f"apsd:query_{index}", "expr": expr})
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "apsd", "rules": rules}]}))
    result = await trio.run_process([shutil.which("promtool"), "check", "rules", str(path)], capture_stdout=True,
                                    capture_stderr=True, check=False)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
