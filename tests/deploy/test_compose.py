"""docker-compose.yml: parses, and references only services, volumes, networks and files that exist; the
pieces fit (Prometheus scrapes the service, Grafana finds Prometheus and the dashboard); Redis runs for real
with the compose command and its healthcheck."""

from __future__ import annotations

import os
import re
import subprocess
import urllib.parse

import pytest
import redis
import yaml

from tests.deploy.support import (
    DASHBOARD,
    DEPLOY,
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


def load(path=COMPOSE, env=None) -> dict:
    return interpolate(yaml.safe_load(path.read_text()), env or {})


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
    proc = subprocess.run([*args, "config", "-q"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


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


def test_redis_password_reaches_redis_and_the_service():
    services = load(env={"REDIS_PASSWORD": "s3cret"})["services"]
    command = services["redis"]["command"]
    assert command[command.index("--requirepass") + 1] == "s3cret"
    assert command[command.index("--appendonly") + 1] == "yes"
    assert ("redis-data", "/data") in _mounts(services["redis"])
    url = _environment(services["csd-serve"])["CSD_REDIS_URL"]
    assert urllib.parse.urlsplit(url).password == "s3cret"


def test_redis_runs_with_the_compose_command_and_healthcheck(tmp_path):
    """The real redis-server with the compose command (on a free port, in a temporary folder): password
    required, append-only file written; the healthcheck passes with the password and fails without."""
    redis_service = load(env={"REDIS_PASSWORD": "s3cret"})["services"]["redis"]
    port = free_port()
    command = redis_service["command"]
    assert command[0] == "redis-server"
    with redis_server(tmp_path, [*command[1:], "--port", str(port), "--dir", str(tmp_path)], port):
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        client = redis.Redis(port=port, password="s3cret")
        client.set("csd:probe", "1")
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert any(p.name.startswith("appendonly") for p in tmp_path.iterdir())
        kind, script = redis_service["healthcheck"]["test"]
        assert kind == "CMD-SHELL"
        script = script.replace("redis-cli", f"redis-cli -p {port}")
        container_env = {**_environment(redis_service), "PATH": os.environ["PATH"]}
        assert subprocess.run(["sh", "-c", script], env=container_env, timeout=10).returncode == 0
        wrong = {**container_env, "REDISCLI_AUTH": "wrong"}
        assert (
            subprocess.run(["sh", "-c", script], env=wrong, timeout=10, capture_output=True).returncode != 0
        )


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
