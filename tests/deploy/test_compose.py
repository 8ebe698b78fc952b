"""docker-compose.yml: parses, and references only services, volumes, networks and files that exist; the
pieces fit (Prometheus scrapes the service, Grafana finds Prometheus and the dashboard); Redis runs for real
with the compose command and its healthcheck."""

from __future__ import annotations

import os
import re
import subprocess
import urllib.parse
from pathlib import Path

import pytest
import redis
import yaml

from tests.deploy.support import (
    DASHBOARD,
    DEPLOY,
    K8S,
    REPO,
    dockerfile_instructions,
    free_port,
    redis_server,
    require_tool,
    settings_from_environment,
)

COMPOSE = REPO / "docker-compose.yml"
COMPOSE_GPU = REPO / "docker-compose.gpu.yml"
VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value, env: dict[str, str]):
    """Compose's variable interpolation (${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, $VAR, $$)."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3)
        current = env.get(name)
        if op in (":-", "-"):
            return arg if current is None or (op == ":-" and current == "") else current
        if op in (":?", "?") and (current is None or (op == ":?" and current == "")):
            raise AssertionError(f"compose requires {name}: {arg}")
        return current or ""

    return VARIABLE.sub(substitute, value)


# What compose refuses to start without (no default password is ever used).
REQUIRED_ENV = {"REDIS_PASSWORD": "s3cret", "GRAFANA_ADMIN_PASSWORD": "grafana-s3cret"}


def load(path=COMPOSE, env=None) -> dict:
    return interpolate(yaml.safe_load(path.read_text()), REQUIRED_ENV if env is None else env)


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _mounts(service: dict) -> list[tuple[str, str]]:
    return [tuple(v.split(":")[:2]) for v in service.get("volumes", [])]


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration):
        total += float(number) * units[unit]
    return total


def test_references_only_what_exists():
    compose = load()
    services = compose["services"]
    volumes = set(compose.get("volumes", {}))
    networks = set(compose.get("networks", {}))
    assert {"csd-serve", "redis", "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        depends = service.get("depends_on", [])
        assert set(depends) <= set(services), f"{name} depends on a service that does not exist"
        assert set(service.get("networks", [])) <= networks, f"{name} joins an undeclared network"
        for source, target in _mounts(service):
            assert target.startswith("/"), f"{name}: mount target {target!r}"
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in volumes, f"{name} uses an undeclared volume {source}"
        if "build" in service:
            context = REPO / service["build"]["context"]
            assert (context / service["build"].get("dockerfile", "Dockerfile")).is_file()
            arg_names = {a.split("=")[0] for k, a in dockerfile_instructions() if k == "ARG"}
            assert set(service["build"].get("args", {})) <= arg_names, (
                "build args the Dockerfile does not declare"
            )
    # every declared volume and network is used
    used = {source for s in services.values() for source, _ in _mounts(s)}
    assert volumes <= used
    assert networks <= {n for s in services.values() for n in s.get("networks", [])}


def test_gpu_override_extends_existing_services_only():
    override = load(COMPOSE_GPU)
    assert set(override["services"]) <= set(load()["services"])
    serve = override["services"]["csd-serve"]
    (device,) = serve["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert serve["environment"]["CSD_DEVICE"] == "cuda"
    assert serve["build"]["args"]["TORCH_VARIANT"].startswith("cu")


@pytest.mark.parametrize("files", [[COMPOSE], [COMPOSE, COMPOSE_GPU]], ids=["cpu", "gpu"])
def test_docker_compose_accepts_the_files(files):
    """The compose tool itself validates the files against the Compose specification (no daemon needed)."""
    binary = require_tool("docker-compose", "Debian package docker-compose")
    args = [binary, "--project-directory", str(REPO)]
    for f in files:
        args += ["-f", str(f)]
    env = {**os.environ, **REQUIRED_ENV}
    proc = subprocess.run([*args, "config", "-q"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    # and the tool itself refuses to start without the passwords
    env = {k: v for k, v in os.environ.items() if k not in REQUIRED_ENV}
    refused = subprocess.run([*args, "config", "-q"], capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode != 0 and "REDIS_PASSWORD" in refused.stderr + refused.stdout


def test_service_waits_for_healthy_redis_and_drains_on_stop():
    services = load()["services"]
    serve = services["csd-serve"]
    assert serve["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["redis"]["healthcheck"]["test"]
    settings = settings_from_environment(_environment(serve))
    assert settings.host == "0.0.0.0"
    assert f"{settings.port}" in {p.split(":")[-1] for p in serve["ports"]}
    url = urllib.parse.urlsplit(settings.redis_url.get_secret_value())
    assert url.hostname == "redis" and url.port == 6379
    assert (settings.cache_dir.as_posix()) in {t for _, t in _mounts(serve)}
    assert settings.shutdown_grace_s >= settings.request_timeout_s
    assert _seconds(serve["stop_grace_period"]) > settings.shutdown_grace_s
    # Redis is not published on the host, and shares a network only with the service.
    assert "ports" not in services["redis"]
    redis_networks = set(services["redis"]["networks"])
    others = {n for n, s in services.items() if n != "redis" and redis_networks & set(s.get("networks", []))}
    assert others == {"csd-serve"}


def _redis_start(redis_service: dict) -> tuple[str, Path]:
    """The redis service's start script and the redis.conf (in the repository) it starts with."""
    assert redis_service["command"][:2] == ["sh", "-c"]
    script = redis_service["command"][2]
    conf_target = re.search(r"exec redis-server (\S+) - <<EOF\n", script).group(1)
    mounts = {t: s for s, t in _mounts(redis_service)}
    return script, REPO / mounts[conf_target]


def test_redis_password_reaches_redis_and_the_service():
    services = load(env={"REDIS_PASSWORD": "s3cret", "GRAFANA_ADMIN_PASSWORD": "x"})["services"]
    script, conf = _redis_start(services["redis"])
    # the container's shell reads it from the environment ($$ in the file): it is in no command line
    assert "requirepass $REDIS_PASSWORD\nEOF" in script and "s3cret" not in script
    assert _environment(services["redis"])["REDIS_PASSWORD"] == "s3cret"
    assert conf.resolve() == (K8S / "base" / "redis.conf").resolve(), "one redis.conf for compose and k8s"
    assert ("redis-data", "/data") in _mounts(services["redis"])
    url = _environment(services["csd-serve"])["CSD_REDIS_URL"]
    assert urllib.parse.urlsplit(url).password == "s3cret"


@pytest.mark.parametrize("missing", sorted(REQUIRED_ENV))
def test_no_default_passwords(missing):
    """Compose refuses to start without each password, rather than run with one everybody knows."""
    with pytest.raises(AssertionError, match=f"compose requires {missing}"):
        load(env={k: v for k, v in REQUIRED_ENV.items() if k != missing})
    text = COMPOSE.read_text()
    assert "csd-dev-password" not in text and ":-admin}" not in text


def test_ports_are_published_on_localhost_unless_asked():
    for env, address in (
        (REQUIRED_ENV, "127.0.0.1"),
        ({**REQUIRED_ENV, "PUBLISH_ADDRESS": "0.0.0.0"}, "0.0.0.0"),
    ):
        services = load(env=env)["services"]
        published = [p for s in services.values() for p in s.get("ports", [])]
        assert published and all(str(p).startswith(f"{address}:") for p in published), published


def test_image_tags_match_the_kubernetes_overlays():
    """The compose images are the ones deploy/k8s runs: csd-serve:cpu, and csd-serve:cuda for the GPU."""
    overlays = {}
    for name in ("cpu", "gpu"):
        kustomization = yaml.safe_load((K8S / "overlays" / name / "kustomization.yaml").read_text())
        (image,) = kustomization["images"]
        overlays[name] = f"{image['newName']}:{image['newTag']}"
    assert load()["services"]["csd-serve"]["image"] == overlays["cpu"] == "csd-serve:cpu"
    gpu = load(COMPOSE_GPU, env={})["services"]["csd-serve"]
    assert gpu["image"] == overlays["gpu"] == "csd-serve:cuda"
    assert gpu["build"]["args"]["TORCH_VARIANT"] == "cu128"
    # and the build commands the Dockerfile, README and deploy/README show tag the same images
    for path in (REPO / "Dockerfile", REPO / "README.md", DEPLOY / "README.md"):
        tags = set(re.findall(r"-t (?:REGISTRY/)?(csd-serve:[\w.-]+)", path.read_text()))
        assert tags <= {"csd-serve:cpu", "csd-serve:cuda"}, f"{path.name}: {tags}"
    assert "csd-serve:cu128" not in COMPOSE_GPU.read_text()


def test_redis_runs_with_the_compose_command_and_healthcheck(tmp_path):
    """The real redis-server started by the compose command (a real sh; on a free port, in a temporary
    folder): password required and in no command line, the shared redis.conf's memory bound, append-only
    file written; the healthcheck passes with the password and fails without."""
    redis_service = load()["services"]["redis"]
    script, conf_path = _redis_start(redis_service)
    port = free_port()
    conf = conf_path.read_text().replace("port 6379", f"port {port}").replace("dir /data", f"dir {tmp_path}")
    (tmp_path / "redis.conf").write_text(conf)
    script = re.sub(r"redis-server \S+ -", f"redis-server {tmp_path / 'redis.conf'} -", script)
    container_env = {**_environment(redis_service), "PATH": os.environ["PATH"]}
    with redis_server(tmp_path, [], port, shell=script, env=container_env) as proc:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        client = redis.Redis(port=port, password="s3cret")
        client.set("csd:probe", "1")
        assert b"s3cret" not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert any(p.name.startswith("appendonly") for p in tmp_path.iterdir())
        kind, check = redis_service["healthcheck"]["test"]
        assert kind == "CMD-SHELL"
        check = check.replace("redis-cli", f"redis-cli -p {port}")
        assert subprocess.run(["sh", "-c", check], env=container_env, timeout=10).returncode == 0
        wrong = {**container_env, "REDISCLI_AUTH": "wrong"}
        assert subprocess.run(["sh", "-c", check], env=wrong, timeout=10, capture_output=True).returncode != 0


def test_prometheus_scrapes_the_service():
    services = load()["services"]
    mounts = dict((t, s) for s, t in _mounts(services["prometheus"]))
    config_path = REPO / mounts["/etc/prometheus/prometheus.yml"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    config = yaml.safe_load(config_path.read_text())
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "csd-serve"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (target,) = [t for c in job["static_configs"] for t in c["targets"]]
    host, port = target.split(":")
    assert host in services and set(services[host]["networks"]) & set(services["prometheus"]["networks"])
    assert int(port) == settings_from_environment(_environment(services[host])).port


def test_prometheus_config_is_valid():
    promtool = require_tool("promtool", "Debian package prometheus")
    proc = subprocess.run(
        [promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_is_provisioned_with_prometheus_and_the_dashboard():
    services = load()["services"]
    grafana = services["grafana"]
    mounts = dict((t, s) for s, t in _mounts(grafana))
    provisioning = REPO / mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"
    ]
    assert datasource["type"] == "prometheus" and datasource["isDefault"] is True
    url = urllib.parse.urlsplit(datasource["url"])
    assert url.hostname == "prometheus" and url.port == 9090
    assert set(services["prometheus"]["networks"]) & set(grafana["networks"])
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "csd-serve.yml").read_text())["providers"]
    dashboards_dir = provider["options"]["path"]
    mounted = {target: REPO / source for target, source in mounts.items()}
    dashboard_target = f"{dashboards_dir}/{DASHBOARD.name}"
    assert mounted[dashboard_target].resolve() == DASHBOARD.resolve()
    assert _environment(grafana)["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == dashboard_target
