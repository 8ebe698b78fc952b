"""deploy/k8s/overlays/ha-sentinel: a Sentinel-managed Redis for the shared OCM, validated offline (schemas,
the pieces fitting together) and its Sentinel configuration run for real by a local redis-server."""

from __future__ import annotations

import re
import subprocess

import kubernetes_validate
import pytest
import redis
from kubernetes_validate.utils import latest_version

from bench.redis_process import RedisProcess, free_port
from ocm_store.urls import parse_redis_url
from tests.deploy.kustomize_lite import render
from tests.deploy.support import K8S, container, container_environment, find, load_yaml_documents, pod_spec

OVERLAY = K8S / "overlays" / "ha-sentinel"


@pytest.fixture(scope="module")
def resources() -> list[dict]:
    return render(OVERLAY)


@pytest.fixture(scope="module")
def secrets() -> dict[str, dict[str, str]]:
    (secret,) = load_yaml_documents(K8S / "secret.example.yaml")
    return {secret["metadata"]["name"]: secret["stringData"]}


@pytest.mark.parametrize("version", ["1.25", latest_version()])
def test_the_overlay_validates_against_kubernetes_schemas(resources, version):
    for resource in resources:
        if resource["kind"] != "ServiceMonitor":  # a CRD, checked by test_k8s
            kubernetes_validate.validate(resource, version, strict=True)


def test_the_service_finds_the_master_through_every_sentinel(resources, secrets):
    redis_set = find(resources, "StatefulSet", "csd-redis")
    serve = container(find(resources, "Deployment", "csd-serve"), "csd-serve")
    env = container_environment(resources, serve, secrets)
    target = parse_redis_url(env["CSD_REDIS_URL"])
    replicas = redis_set["spec"]["replicas"]
    assert replicas == 3
    assert target.kind == "sentinel"
    assert target.nodes == tuple((f"csd-redis-{i}.csd-redis", 26379) for i in range(replicas))
    assert target.options["password"] == secrets["csd-serve-secrets"]["redis-password"]
    sentinel = " ".join(container(redis_set, "sentinel")["command"])
    server = " ".join(container(redis_set, "redis")["command"])
    assert f"sentinel monitor {target.service} " in sentinel
    assert f"get-master-addr-by-name {target.service}" in sentinel
    assert f"get-master-addr-by-name {target.service}" in server
    # a quorum of sentinels can stand while one pod is away
    quorum = int(re.search(rf"sentinel monitor {target.service} \S+ 6379 (\d+)", sentinel).group(1))
    assert quorum == replicas // 2 + 1
    assert find(resources, "PodDisruptionBudget", "csd-redis")["spec"]["maxUnavailable"] == 1


def test_sentinel_ports_services_and_network_policy_fit(resources):
    redis_set = find(resources, "StatefulSet", "csd-redis")
    ports = {p["name"]: p["containerPort"] for p in container(redis_set, "sentinel")["ports"]}
    assert ports == {"sentinel": 26379}
    for name in ("csd-redis", "csd-redis-sentinel"):
        service = find(resources, "Service", name)
        assert service["spec"]["publishNotReadyAddresses"] is True
        assert {"port": 26379, "targetPort": "sentinel"}.items() <= next(
            p for p in service["spec"]["ports"] if p["port"] == 26379
        ).items()
    (rule,) = find(resources, "NetworkPolicy", "csd-redis")["spec"]["ingress"]
    assert {p["port"] for p in rule["ports"]} == {6379, 26379}
    sources = [s["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for s in rule["from"]]
    assert sorted(sources) == ["csd-redis", "csd-serve"]
    volumes = {m["name"] for m in container(redis_set, "sentinel")["volumeMounts"]}
    assert volumes == {"data", "config"}  # the config is copied to /data: Sentinel rewrites it
    assert pod_spec(redis_set)["securityContext"]["runAsNonRoot"] is True


def test_the_sentinel_configuration_runs(resources, tmp_path):
    """sentinel.conf from the ConfigMap plus what the start script appends, run by a real redis-server in
    sentinel mode against a local master: it starts, monitors the master and answers for the service."""
    config_map = next(
        r
        for r in resources
        if r["kind"] == "ConfigMap" and r["metadata"]["name"].startswith("csd-redis-config")
    )
    assert "redis.conf" in config_map["data"]  # the base's Redis settings are still there
    master = RedisProcess(tmp_path / "master").start()
    port = free_port()
    conf = config_map["data"]["sentinel.conf"].replace("port 26379", f"port {port}")
    conf = conf.replace("dir /data", f"dir {tmp_path}")
    conf += (
        f"sentinel monitor csd-ocm 127.0.0.1 {master.port} 2\nsentinel down-after-milliseconds csd-ocm 5000\n"
    )
    path = tmp_path / "sentinel.conf"
    path.write_text(conf)
    process = subprocess.Popen([master.binary, str(path), "--sentinel"], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.5)
    try:
        for _ in range(200):
            try:
                addr = client.sentinel_get_master_addr_by_name("csd-ocm")
                break
            except redis.ConnectionError:
                assert process.poll() is None, "the sentinel exited at start"
                subprocess.run(["sleep", "0.05"])
        assert addr is not None and int(addr[1]) == master.port
    finally:
        client.close()
        process.terminate()
        process.wait(timeout=20)
        master.stop()
