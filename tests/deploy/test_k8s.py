"""deploy/k8s: every manifest, base and rendered overlays, validates against the Kubernetes schemas offline
(kubernetes-validate, strict), the ServiceMonitor against a schema checked in here; the pieces fit together
(selectors, ports, names, settings); and Redis really runs with the StatefulSet's arguments."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.parse
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import redis
import yaml
from kubernetes_validate.utils import latest_version

from tests.deploy.kustomize_lite import render
from tests.deploy.support import (
    GAUGES,
    K8S,
    container,
    container_environment,
    dockerfile_env,
    dockerfile_user,
    find,
    free_port,
    load_yaml_documents,
    metric_names,
    pod_spec,
    redis_server,
    selector_matches,
    settings_from_environment,
)

KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/gpu"]
OVERLAYS = ["overlays/cpu", "overlays/gpu"]
# The oldest schemas kubernetes-validate ships, and the newest.
KUBERNETES_VERSIONS = ["1.25", latest_version()]
SECRET_EXAMPLE = K8S / "secret.example.yaml"
ADAPTER_VALUES = K8S / "prometheus-adapter" / "values.yaml"
SERVICE_MONITOR_SCHEMA = json.loads(
    (K8S.parents[1] / "tests/deploy/schemas/servicemonitor-monitoring-v1.json").read_text()
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {k: render(K8S / k) for k in KUSTOMIZATIONS}


@pytest.fixture(scope="module")
def example_secrets() -> dict[str, dict[str, str]]:
    (secret,) = load_yaml_documents(SECRET_EXAMPLE)
    return {secret["metadata"]["name"]: secret["stringData"]}


def _serve(resources):
    return find(resources, "Deployment", "csd-serve")


def _redis(resources):
    return find(resources, "StatefulSet", "csd-redis")


# ---------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_rendered_manifests_validate_against_kubernetes_schemas(rendered, kustomization, version):
    resources = rendered[kustomization]
    assert resources
    for resource in resources:
        if resource["kind"] == "ServiceMonitor":
            continue  # a CRD: see the next test
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(
                f"{kustomization}: {resource['kind']}/{resource['metadata']['name']} at {path}: {exc.message}"
            )


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_secret_example_validates(version):
    for resource in load_yaml_documents(SECRET_EXAMPLE):
        kubernetes_validate.validate(resource, version, strict=True)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_service_monitor_validates_against_the_checked_in_schema(rendered, kustomization):
    monitor = find(rendered[kustomization], "ServiceMonitor")
    jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


def test_service_monitor_schema_catches_mistakes(rendered):
    monitor = find(rendered["base"], "ServiceMonitor")
    for mistake in ({"intervall": "15s"}, {"interval": "15 seconds"}, {"path": "metrics"}):
        broken = json.loads(json.dumps(monitor))
        broken["spec"]["endpoints"][0].update(mistake)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SERVICE_MONITOR_SCHEMA)


def test_schema_validation_catches_mistakes(rendered):
    """The strict validation is not a formality: a misspelt field and a wrongly typed one are refused."""
    deployment = _serve(rendered["base"])
    for mutate in (
        lambda d: pod_spec(d).update(terminationGracePeriod=150),
        lambda d: container(d, "csd-serve")["ports"][0].update(containerPort="8000"),
    ):
        broken = json.loads(json.dumps(deployment))
        mutate(broken)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[-1], strict=True)


# ---------------------------------------------------------------- the service


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_settings_are_valid(rendered, example_secrets, overlay):
    resources = rendered[overlay]
    env = container_environment(resources, container(_serve(resources), "csd-serve"), example_secrets)
    settings = settings_from_environment(env)
    assert settings.host == "0.0.0.0"
    port = container(_serve(resources), "csd-serve")["ports"][0]
    assert settings.port == port["containerPort"]
    mounts = {m["mountPath"] for m in container(_serve(resources), "csd-serve")["volumeMounts"]}
    assert settings.cache_dir.as_posix() in mounts
    # The Redis URL carries the Secret's password and names the Redis Service and its port.
    url = urllib.parse.urlsplit(settings.redis_url.get_secret_value())
    redis_service = find(resources, "Service", url.hostname)
    redis_labels = _redis(resources)["spec"]["template"]["metadata"]["labels"]
    assert selector_matches({"matchLabels": redis_service["spec"]["selector"]}, redis_labels)
    assert url.port in {p["port"] for p in redis_service["spec"]["ports"]}
    assert url.password == example_secrets["csd-serve-secrets"]["redis-password"]
    keys = example_secrets["csd-serve-secrets"]["api-keys"].split(",")
    assert [k.get_secret_value() for k in settings.api_keys] == keys


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_and_graceful_termination(rendered, example_secrets, overlay):
    resources = rendered[overlay]
    deployment = _serve(resources)
    spec = container(deployment, "csd-serve")
    port_names = {p["name"] for p in spec["ports"]}
    probes = {kind: spec[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"]["httpGet"]["path"] == "/ready"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/health"
    assert all(p["httpGet"]["port"] in port_names for p in probes.values())
    startup_budget_s = probes["startupProbe"]["periodSeconds"] * probes["startupProbe"]["failureThreshold"]
    assert startup_budget_s >= 600, "a first model load (conversion or download) needs minutes"

    settings = settings_from_environment(container_environment(resources, spec, example_secrets))
    pre_stop = spec["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    grace = pod_spec(deployment)["terminationGracePeriodSeconds"]
    assert settings.shutdown_grace_s >= settings.request_timeout_s, (
        "draining must outlast the longest request"
    )
    assert grace > int(pre_stop[1]) + settings.shutdown_grace_s, "SIGKILL would cut the drain short"


def test_gpu_overlay_asks_for_a_gpu_and_cpu_overlay_does_not(rendered, example_secrets):
    gpu, cpu = rendered["overlays/gpu"], rendered["overlays/cpu"]
    gpu_spec = container(_serve(gpu), "csd-serve")
    assert int(gpu_spec["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    gpu_toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert gpu_toleration in pod_spec(_serve(gpu))["tolerations"]
    assert pod_spec(_serve(gpu))["nodeSelector"]
    assert settings_from_environment(container_environment(gpu, gpu_spec, example_secrets)).device == "cuda"
    gpu_startup = gpu_spec["startupProbe"]["failureThreshold"] * gpu_spec["startupProbe"]["periodSeconds"]

    cpu_spec = container(_serve(cpu), "csd-serve")
    assert "nvidia.com/gpu" not in cpu_spec["resources"].get("limits", {})
    assert "tolerations" not in pod_spec(_serve(cpu))
    assert settings_from_environment(container_environment(cpu, cpu_spec, example_secrets)).device == "cpu"
    cpu_startup = cpu_spec["startupProbe"]["failureThreshold"] * cpu_spec["startupProbe"]["periodSeconds"]
    assert gpu_startup >= cpu_startup


def _mounted(path: str, spec: dict) -> bool:
    return any(
        path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
        for m in spec["volumeMounts"]
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_root_filesystem_is_read_only_and_every_written_path_is_a_volume(rendered, example_secrets, overlay):
    """The service writes its model cache (converted weights, the in-process OCM file), hub downloads
    (HF_HOME) and temporary files: each under a mounted volume, with the image's environment and the pod's."""
    resources = rendered[overlay]
    spec = container(_serve(resources), "csd-serve")
    assert spec["securityContext"]["readOnlyRootFilesystem"] is True
    env = {**dockerfile_env(), **container_environment(resources, spec, example_secrets)}
    settings = settings_from_environment(env)
    assert env["HF_HOME"].startswith(str(settings.cache_dir) + "/"), "hub models go to the cache volume"
    for path in (str(settings.cache_dir), env["HF_HOME"], str(settings.ocm_file), "/tmp"):
        assert _mounted(path, spec), f"{path} is written but on the read-only root filesystem"
    redis_container = container(_redis(resources), "redis")
    assert redis_container["securityContext"]["readOnlyRootFilesystem"] is True
    assert _mounted("/data", redis_container), "Redis writes only its data folder"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_rollout_has_time_for_the_startup_probe(rendered, overlay):
    """progressDeadlineSeconds outlasts a new pod's startup probe budget (20 minutes on GPU), with time to be
    scheduled and pull the image: a slow model load is not reported as a failed rollout."""
    deployment = _serve(rendered[overlay])
    probe = container(deployment, "csd-serve")["startupProbe"]
    budget = probe.get("initialDelaySeconds", 0) + probe["periodSeconds"] * probe["failureThreshold"]
    assert deployment["spec"]["progressDeadlineSeconds"] >= budget + 300


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_spread_over_nodes_and_zones(rendered, overlay):
    deployment = _serve(rendered[overlay])
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    spread = {c["topologyKey"]: c for c in pod_spec(deployment)["topologySpreadConstraints"]}
    assert {"kubernetes.io/hostname", "topology.kubernetes.io/zone"} <= set(spread)
    for constraint in spread.values():
        assert selector_matches(constraint["labelSelector"], labels), "the spread must count csd-serve pods"
        assert constraint["maxSkew"] == 1
        # a cluster with fewer nodes than replicas must still run them all
        assert constraint["whenUnsatisfiable"] == "ScheduleAnyway"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_worker_non_root_and_a_tagged_image(rendered, overlay):
    deployment = _serve(rendered[overlay])
    spec = container(deployment, "csd-serve")
    assert spec["args"] == ["serve"], "the image's entrypoint is `csd`: one `csd serve` process per pod"
    image = spec["image"]
    assert re.fullmatch(r"[^:@]+(:[\w.-]+|@sha256:[0-9a-f]{64})", image) and not image.endswith(":latest")
    uid, gid = dockerfile_user()
    security = pod_spec(deployment)["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == uid and security["runAsGroup"] == gid
    assert spec["securityContext"]["allowPrivilegeEscalation"] is False
    assert "replicas" not in deployment["spec"], "the HorizontalPodAutoscaler owns the replica count"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_service_and_service_monitor_reach_the_pods(rendered, kustomization):
    resources = rendered[kustomization]
    deployment = _serve(resources)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector_matches(deployment["spec"]["selector"], labels)
    service = find(resources, "Service", "csd-serve")
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, labels)
    container_ports = {p["name"] for p in container(deployment, "csd-serve")["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports
    monitor = find(resources, "ServiceMonitor")
    assert selector_matches(monitor["spec"]["selector"], service["metadata"]["labels"])
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports and endpoint["path"] == "/metrics"


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_autoscaler_and_disruption_budget(rendered, kustomization):
    resources = rendered[kustomization]
    deployment = _serve(resources)
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    hpa = find(resources, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    # The metric the adapter serves, from the series the service exports.
    adapter_rules = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]
    served = {rule["name"]["as"]: rule for rule in adapter_rules}
    assert metric["pods"]["metric"]["name"] in served
    series = metric_names(served[metric["pods"]["metric"]["name"]]["seriesQuery"])
    assert series and series <= GAUGES

    pdb = find(resources, "PodDisruptionBudget")
    assert selector_matches(pdb["spec"]["selector"], labels)
    if "maxUnavailable" in pdb["spec"]:
        assert int(pdb["spec"]["maxUnavailable"]) >= 1, "a budget of 0 blocks every node drain"
    else:
        assert int(pdb["spec"]["minAvailable"]) < hpa["spec"]["minReplicas"]


# ---------------------------------------------------------------- Redis


REDIS_START = re.compile(r"exec redis-server (\S+) - <<EOF\n")


def _redis_conf(resources, statefulset) -> tuple[str, dict[str, str]]:
    """The redis.conf the StatefulSet's command starts Redis with (from its ConfigMap), as text and as
    directive -> value."""
    spec = container(statefulset, "redis")
    assert spec["command"][:2] == ["sh", "-c"] and "args" not in spec
    conf_path = REDIS_START.search(spec["command"][2]).group(1)
    mounts = {m["mountPath"]: m["name"] for m in spec["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(statefulset)["volumes"]}
    conf_dir, conf_file = conf_path.rsplit("/", 1)
    config_map = find(resources, "ConfigMap", volumes[mounts[conf_dir]]["configMap"]["name"])
    text = config_map["data"][conf_file]
    directives = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.strip().partition(" ")
            directives[key] = value
    return text, directives


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "kb": 2**10, "mb": 2**20, "gb": 2**30}
    for unit, factor in units.items():
        if quantity.lower().endswith(unit.lower()):
            return int(quantity[: -len(unit)]) * factor
    return int(quantity)


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_redis_persists_and_only_the_service_reaches_it(rendered, kustomization):
    resources = rendered[kustomization]
    statefulset = _redis(resources)
    spec = container(statefulset, "redis")
    _, option = _redis_conf(resources, statefulset)
    assert option["appendonly"] == "yes"
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert {"name": claim["metadata"]["name"], "mountPath": option["dir"]} in spec["volumeMounts"]
    service = find(resources, "Service", statefulset["spec"]["serviceName"])
    redis_labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, redis_labels)
    redis_port = spec["ports"][0]["containerPort"]
    assert int(option["port"]) == redis_port
    # bounded memory, below the container's limit, and never silent eviction of learned patterns
    assert option["maxmemory-policy"] == "noeviction"
    assert 0 < _bytes(option["maxmemory"]) <= 0.8 * _bytes(spec["resources"]["limits"]["memory"])

    policy = find(resources, "NetworkPolicy")
    assert selector_matches(policy["spec"]["podSelector"], redis_labels)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": redis_port}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "same-namespace pods only"
    workloads = [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")]
    admitted = {
        w["metadata"]["name"]
        for w in workloads
        if selector_matches(peer["podSelector"], w["spec"]["template"]["metadata"]["labels"])
    }
    assert admitted == {"csd-serve"}


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_redis_password_is_in_no_command_line_and_no_config_map(rendered, kustomization):
    resources = rendered[kustomization]
    statefulset = _redis(resources)
    text, option = _redis_conf(resources, statefulset)
    assert "requirepass" not in option and "REDIS_PASSWORD" not in text
    spec = container(statefulset, "redis")
    # a shell variable, expanded by the shell into Redis's stdin; $(VAR) would be expanded by Kubernetes into
    # the command line
    assert "requirepass $REDIS_PASSWORD\nEOF" in spec["command"][2]
    assert "$(REDIS_PASSWORD)" not in " ".join(spec["command"])
    password_ref = next(e for e in spec["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
    assert password_ref == {"name": "csd-serve-secrets", "key": "redis-password"}


def test_secret_example_holds_every_referenced_key_and_is_never_applied(rendered, example_secrets):
    referenced = set()
    for resources in rendered.values():
        for workload in (r for r in resources if r["kind"] in ("Deployment", "StatefulSet")):
            for c in pod_spec(workload)["containers"] + pod_spec(workload).get("initContainers", []):
                for item in c.get("env", []):
                    ref = item.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        referenced.add((ref["name"], ref["key"]))
        assert not [r for r in resources if r["kind"] == "Secret"], (
            "no Secret may be rendered from the repository"
        )
    assert referenced == {(name, key) for name, data in example_secrets.items() for key in data}
    assert all("CHANGE-ME" in value for data in example_secrets.values() for value in data.values())
    for path in K8S.rglob("kustomization.yaml"):
        assert SECRET_EXAMPLE.name not in path.read_text().split("#")[0]


def test_redis_starts_with_the_statefulset_configuration(rendered, example_secrets, tmp_path):
    """Run the manifest's start command (a real sh) and the real redis-server with the ConfigMap's redis.conf
    (port and data folder moved to a free port and a temporary folder): it requires the password, which its
    command line does not hold, is PID 1's process itself (exec: SIGTERM reaches it), bounds its memory without
    eviction, writes an append-only file, and the probes' command says healthy only with the password."""
    resources = rendered["overlays/cpu"]
    statefulset = _redis(resources)
    spec = container(statefulset, "redis")
    env = container_environment(resources, spec, example_secrets)
    password = env["REDIS_PASSWORD"]
    text, option = _redis_conf(resources, statefulset)
    port = free_port()
    conf = text.replace(f"port {option['port']}", f"port {port}").replace(
        f"dir {option['dir']}", f"dir {tmp_path}"
    )
    (tmp_path / "redis.conf").write_text(conf)
    script = spec["command"][2].replace(
        REDIS_START.search(spec["command"][2]).group(1), str(tmp_path / "redis.conf")
    )
    shell_env = {"PATH": os.environ["PATH"], "REDIS_PASSWORD": password}
    with redis_server(tmp_path, [], port, shell=script, env=shell_env) as proc:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        client = redis.Redis(port=port, password=password)
        assert client.ping()
        assert client.info("server")["process_id"] == proc.pid, "exec: redis-server replaced the shell"
        assert password.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert int(client.config_get("maxmemory")["maxmemory"]) == _bytes(option["maxmemory"])
        client.set("csd:probe", "1")
        assert any(p.name.startswith("appendonly") for p in tmp_path.iterdir())
        probe = spec["readinessProbe"]["exec"]["command"]
        assert probe == spec["livenessProbe"]["exec"]["command"]
        probe = [p.replace("redis-cli", f"redis-cli -p {port}") for p in probe]
        ok = subprocess.run(
            probe, env={"PATH": os.environ["PATH"], "REDISCLI_AUTH": env["REDISCLI_AUTH"]}, timeout=10
        )
        assert ok.returncode == 0
        bad = subprocess.run(
            probe, env={"PATH": os.environ["PATH"], "REDISCLI_AUTH": "wrong"}, timeout=10, capture_output=True
        )
        assert bad.returncode != 0


# ---------------------------------------------------------------- the inference gateway example

GATEWAY = K8S / "inference-gateway"
SCHEMAS = K8S.parents[1] / "tests/deploy/schemas"
CRD_SCHEMAS = {
    "InferencePool": json.loads((SCHEMAS / "inferencepool-inference-v1.json").read_text()),
    "HTTPRoute": json.loads((SCHEMAS / "httproute-gateway-v1.json").read_text()),
}
PROTOCOL = yaml.safe_load((K8S.parents[1] / "tests/deploy/fixtures/model-server-protocol.yaml").read_text())


@pytest.fixture(scope="module")
def gateway() -> list[dict]:
    return render(GATEWAY)


def test_inference_gateway_example_validates_against_the_checked_in_schemas(gateway):
    assert sorted(r["kind"] for r in gateway) == ["HTTPRoute", "InferencePool"]
    for resource in gateway:
        jsonschema.validate(resource, CRD_SCHEMAS[resource["kind"]])


def test_inference_gateway_schemas_catch_mistakes(gateway):
    pool, route = find(gateway, "InferencePool"), find(gateway, "HTTPRoute")
    mistakes = [
        (pool, lambda p: p["spec"].update(targetPortNumber=8000)),  # the v1alpha2 field, gone in v1
        (
            pool,
            lambda p: p["spec"].update(selector={"app.kubernetes.io/name": "csd-serve"}),
        ),  # no matchLabels
        (pool, lambda p: p["spec"]["targetPorts"][0].update(number=70000)),
        (pool, lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Open")),
        (route, lambda r: r["spec"]["rules"][0].update(backendRef=r["spec"]["rules"][0]["backendRefs"])),
        (route, lambda r: r["spec"]["rules"][0]["matches"][0]["path"].update(type="Prefix")),
    ]
    for resource, mutate in mistakes:
        broken = json.loads(json.dumps(resource))
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, CRD_SCHEMAS[resource["kind"]])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pool_routes_to_the_csd_serve_pods(rendered, example_secrets, gateway, overlay):
    resources = rendered[overlay]
    pool, route = find(gateway, "InferencePool"), find(gateway, "HTTPRoute")
    deployment = _serve(resources)
    assert pool["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    workloads = [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")]
    members = [
        w["metadata"]["name"]
        for w in workloads
        if selector_matches(pool["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])
    ]
    assert members == ["csd-serve"], "the pool holds the csd-serve replicas and nothing else"
    spec = container(deployment, "csd-serve")
    (target,) = pool["spec"]["targetPorts"]
    assert target["number"] == next(p["containerPort"] for p in spec["ports"] if p["name"] == "http")
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    api_paths = [m["path"]["value"] for m in rule["matches"]]
    assert all(any(path.startswith(prefix) for prefix in api_paths) for path in PROTOCOL["api"])
    settings = settings_from_environment(container_environment(resources, spec, example_secrets))
    timeout = rule["timeouts"]["request"]
    assert timeout.endswith("s") and int(timeout[:-1]) > settings.request_timeout_s, (
        "the service times out first"
    )


def test_the_pool_members_export_what_the_endpoint_picker_reads():
    """The model server protocol's metrics, under the names the endpoint picker scrapes, of the types it
    expects (checked on the running service by test_dashboard_live.py)."""
    for metric in PROTOCOL["metrics"]:
        assert metric["type"] == "gauge" and metric["name"] in GAUGES, metric


def test_a_full_redis_refuses_writes_and_the_store_says_so(rendered, tmp_path):
    """Why noeviction (redis.conf): at maxmemory Redis refuses the OCM's writes instead of silently dropping
    keys, and the store keeps serving what it learned, keeps the increments buffered and reports itself
    degraded. The real redis-server with the ConfigMap's redis.conf; once data is in, maxmemory is lowered
    below it, as if the patterns had filled Redis."""
    from ocm_store import Namespace
    from ocm_store.redis_store import RedisStore

    resources = rendered["overlays/cpu"]
    text, option = _redis_conf(resources, _redis(resources))
    port = free_port()
    conf = text.replace(f"port {option['port']}", f"port {port}").replace(
        f"dir {option['dir']}", f"dir {tmp_path}"
    )
    (tmp_path / "redis.conf").write_text(conf)
    namespace = Namespace("target@rev", "ngram", "vocab")
    with redis_server(tmp_path, [str(tmp_path / "redis.conf")], port):
        client = redis.Redis(port=port)
        client.set("csd:learned", "x" * 2_000_000)  # stands for the patterns already stored
        client.config_set("maxmemory", "1mb")
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            client.set("csd:probe", "x")
        store = RedisStore(f"redis://127.0.0.1:{port}/0", flush_interval_s=0.05, max_backoff_s=0.2)
        try:
            memory = store.memory(namespace)
            for _ in range(3):
                memory.record([(7, 1007)])
            deadline = time.monotonic() + 10
            while store.status().healthy and time.monotonic() < deadline:
                time.sleep(0.05)
            status = store.status()
            assert not status.healthy, status
            assert memory.counts([(7, 1007)]) == [3], "what the replica learned still rescues"
            # nothing evicted (an LRU policy would have dropped the stored key to make room), nothing written
            assert client.keys("*") == [b"csd:learned"]
        finally:
            store.close()
