"""The deployment examples under ``deploy/``: the Kubernetes manifests and the nginx load balancer.

Kubernetes: every document validates offline against kubernetes-validate's bundled schemas in
strict mode (an unknown or misspelt field fails), for the oldest Kubernetes the manifests need
and the newest the pinned package knows; and the values that must agree between documents do
(ports, the drain time, the config apsd reads, the Redis it shares). nginx: ``nginx -t`` on the
example, the way an unprivileged user can run it (everything nginx writes goes under tmp_path).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit

import attrs
import kubernetes_validate
import pytest
import yaml

import apsd
from apsd.cli import build_parser
from apsd.core.config import Config
from apsd.serve.auth import check_exposure
from apsd.serve.daemon import HTTP_GRACEFUL_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
NGINX_CONF = ROOT / "deploy" / "nginx" / "apsd.conf"

#: 1.30: the oldest the manifests need (the preStop ``sleep`` action is on by default from 1.30);
#: 1.37: the newest whose schemas kubernetes-validate 1.37.0 bundles.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
#: What ``kubectl apply -f deploy/kubernetes/`` creates.
EXPECTED = {("ConfigMap", "apsd-config"), ("Deployment", "apsd"), ("Service", "apsd"),
            ("PodDisruptionBudget", "apsd"), ("Deployment", "apsd-redis"), ("Service", "apsd-redis"),
            ("NetworkPolicy", "apsd-redis")}
#: What ``apsd hash-key --new`` prints as a key: it must never be in a manifest (hashes only).
API_KEY = re.compile(r"apsd_[A-Za-z0-9_-]{20,}")


# -- helpers ---------------------------------------------------------------------------------
def manifests() -> list[tuple[str, dict[str, Any]]]:
    """Every document of every manifest, with its file name."""
    found = []
    for path in sorted(KUBERNETES.glob("*.y*ml")):
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return found


def resource(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [doc for _, doc in manifests() if doc["kind"] == kind and doc["metadata"]["name"] == name]
    return doc


def only_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def container_port(container: dict[str, Any], port: int | str) -> int:
    """``port`` (a number, or the name of one of ``container``'s ports) as a number; it must be one
    of the container's ports."""
    by_name = {p["name"]: p["containerPort"] for p in container["ports"]}
    number = by_name[port] if isinstance(port, str) else port
    assert number in by_name.values(), f"{port!r} is not a port of container {container['name']}"
    return number


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def apsd_command() -> Any:
    """The apsd Deployment's command, parsed by apsd's own command line parser."""
    command = only_container(resource("Deployment", "apsd"))["command"]
    assert command[0] == "apsd"
    return build_parser().parse_args(command[1:])


def configmap_text() -> str:
    return resource("ConfigMap", "apsd-config")["data"]["apsd.toml"]


def configmap_config() -> Config:
    """The ConfigMap's apsd.toml through apsd's own loader, as the pods will read it."""
    return apsd.parse_config(tomllib.loads(configmap_text()), "<configmap>")


# -- Kubernetes ----------------------------------------------------------------------------------
def test_the_manifests_hold_what_the_readme_says():
    found = [(doc["kind"], doc["metadata"]["name"]) for _, doc in manifests()]
    assert sorted(found) == sorted(EXPECTED)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("filename,doc", manifests(),
                         ids=lambda v: v if isinstance(v, str) else f"{v['kind']}/{v['metadata']['name']}")
def test_every_manifest_validates_strictly(filename, doc, version):
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{filename}: {doc['kind']}/{doc['metadata']['name']} (Kubernetes {version}): "
                    f"{'.'.join(map(str, exc.path))}: {exc.message}", pytrace=False)


def test_strict_validation_catches_a_misspelt_field():
    doc = resource("Deployment", "apsd")
    misspelt = {**doc, "spec": {**doc["spec"], "replica": 3}}
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSIONS[0], strict=True)


def test_selectors_select_their_pods():
    for name in ("apsd", "apsd-redis"):
        deployment = resource("Deployment", name)
        assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels(deployment)), name
        assert selects(resource("Service", name)["spec"]["selector"], pod_labels(deployment)), name
    apsd_pods = pod_labels(resource("Deployment", "apsd"))
    assert selects(resource("PodDisruptionBudget", "apsd")["spec"]["selector"]["matchLabels"], apsd_pods)
    policy = resource("NetworkPolicy", "apsd-redis")["spec"]
    assert selects(policy["podSelector"]["matchLabels"], pod_labels(resource("Deployment", "apsd-redis")))
    (rule,) = policy["ingress"]
    (source,) = rule["from"]
    assert selects(source["podSelector"]["matchLabels"], apsd_pods)
    assert not selects(source["podSelector"]["matchLabels"], pod_labels(resource("Deployment", "apsd-redis")))


def test_apsd_runs_three_replicas_listening_beyond_loopback():
    assert resource("Deployment", "apsd")["spec"]["replicas"] == 3
    args = apsd_command()
    assert args.host == "0.0.0.0"


def test_one_port_everywhere():
    """The command's --port = the container port = the probes' port = the Service's targetPort =
    the Prometheus annotation = the ConfigMap's [server] port."""
    deployment = resource("Deployment", "apsd")
    container = only_container(deployment)
    port = apsd_command().port
    assert container_port(container, port) == port
    for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health")):  # (not the same question)
        assert container[probe]["httpGet"]["path"] == path, probe
        assert container_port(container, container[probe]["httpGet"]["port"]) == port, probe
    (service_port,) = resource("Service", "apsd")["spec"]["ports"]
    assert container_port(container, service_port["targetPort"]) == port
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert int(annotations["prometheus.io/port"]) == port
    assert configmap_config().server.port == port


def test_termination_grace_covers_the_drain():
    """preStop, then [server] shutdown_grace_s for queued and running requests, then up to
    HTTP_GRACEFUL_TIMEOUT_S for the last answers: all before Kubernetes' SIGKILL."""
    spec = resource("Deployment", "apsd")["spec"]["template"]["spec"]
    pre_stop = only_container(resource("Deployment", "apsd"))["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = configmap_config().server.shutdown_grace_s
    assert spec["terminationGracePeriodSeconds"] > pre_stop + grace + HTTP_GRACEFUL_TIMEOUT_S


def test_the_configmap_is_the_file_apsd_reads():
    spec = resource("Deployment", "apsd")["spec"]["template"]["spec"]
    (mount,) = [m for m in only_container(resource("Deployment", "apsd"))["volumeMounts"] if m["name"] == "config"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == "apsd-config"
    (item,) = volume["configMap"]["items"]
    assert item["key"] in resource("ConfigMap", "apsd-config")["data"]
    assert mount["readOnly"] is True and "subPath" not in mount   # a subPath mount never sees edits
    assert PurePosixPath(mount["mountPath"]) / item["path"] == PurePosixPath(apsd_command().config)


def test_the_configmap_config_loads_and_may_listen_beyond_loopback():
    config = configmap_config()
    args = apsd_command()
    served = attrs.evolve(config, server=attrs.evolve(config.server, host=args.host, port=args.port))
    check_exposure(served)          # API key hashes are configured: apsd starts on 0.0.0.0
    assert config.auth.admin_key_hashes and config.auth.metrics_key_hashes  # (Prometheus's: not the admin's)
    assert all(tenant.api_key_hashes for tenant in config.tenants.values())


def test_no_api_key_in_any_manifest():
    for path in KUBERNETES.glob("*.y*ml"):
        assert not API_KEY.search(path.read_text()), f"{path.name} holds an API key: only hashes belong there"


def test_the_store_is_the_redis_service():
    store = configmap_config().store
    assert store.kind == "redis"
    url = urlsplit(store.url)
    (service_port,) = resource("Service", "apsd-redis")["spec"]["ports"]
    assert url.hostname == resource("Service", "apsd-redis")["metadata"]["name"]
    assert (url.port or 6379) == service_port["port"]
    redis = only_container(resource("Deployment", "apsd-redis"))
    assert container_port(redis, service_port["targetPort"]) == 6379
    (rule,) = resource("NetworkPolicy", "apsd-redis")["spec"]["ingress"]
    (allowed,) = rule["ports"]
    assert container_port(redis, allowed["port"]) == 6379


# -- nginx -------------------------------------------------------------------------------------
def nginx_directives(text: str, name: str) -> list[str]:
    """The arguments of every ``name`` directive in ``text`` (comments left out)."""
    text = re.sub(r"#[^\n]*", "", text)
    pattern = rf"(?m)^\s*{re.escape(name)}(?:\s+([^;{{]*))?\s*[;{{]"
    return [(m.group(1) or "").strip() for m in re.finditer(pattern, text)]


def test_nginx_spreads_over_the_template_units_ports():
    text = NGINX_CONF.read_text()
    assert nginx_directives(text, "least_conn") == [""]
    servers = [args.split()[0] for args in nginx_directives(text, "server") if args]
    assert servers == ["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"]
    template_header = (ROOT / "systemd" / "apsd@.service").read_text().partition("[Unit]")[0]
    assert "apsd@8001 apsd@8002 apsd@8003" in template_header


def test_nginx_streams_and_waits_long_enough():
    text = NGINX_CONF.read_text()
    server = Config().server
    assert nginx_directives(text, "proxy_buffering") == ["off"]
    assert nginx_directives(text, "proxy_http_version") == ["1.1"]
    assert nginx_directives(text, "proxy_set_header X-Request-Id") == ["$apsd_request_id"]
    (read_timeout,) = nginx_directives(text, "proxy_read_timeout")
    assert int(read_timeout.removesuffix("s")) >= 300           # a 5-minute queue wait, then generation
    # nginx must drop idle upstream connections before apsd does, or it sends on a closing one.
    (keepalive_timeout,) = nginx_directives(text, "keepalive_timeout")
    assert float(keepalive_timeout.removesuffix("s")) < server.keep_alive_timeout_s
    (body,) = nginx_directives(text, "client_max_body_size")
    assert int(body.removesuffix("m")) * 1024 * 1024 == server.max_body_bytes


def nginx_binary() -> str | None:
    # /usr/sbin is not on every user's PATH.
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")


@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed (Debian package 'nginx'; .ci/run unpacks it)")
def test_nginx_accepts_the_example(tmp_path):
    """The example is an http-level snippet (/etc/nginx/conf.d/): include it in a minimal main
    config whose every path (logs, pid, temporary files) is under tmp_path."""
    snippet = NGINX_CONF.read_text()
    assert "/var/log/nginx/" in snippet
    (tmp_path / "logs").mkdir()
    (tmp_path / "apsd.conf").write_text(snippet.replace("/var/log/nginx/", f"{tmp_path}/logs/"))
    temporary = "\n".join(f"    {kind}_temp_path {tmp_path}/{kind};"
                          for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    main = tmp_path / "nginx.conf"
    main.write_text(f"error_log stderr;\npid {tmp_path}/nginx.pid;\nevents {{}}\nhttp {{\n{temporary}\n"
                    f"    access_log {tmp_path}/logs/access.log;\n    include {tmp_path}/apsd.conf;\n}}\n")
    result = subprocess.run([nginx_binary(), "-t", "-p", str(tmp_path), "-e", "stderr", "-c", str(main)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "test is successful" in result.stderr, result.stderr
