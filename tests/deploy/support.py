"""Helpers shared by the deployment tests: paths, tools that CI installs, throwaway servers, manifest lookups."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DASHBOARD = DEPLOY / "grafana" / "csd-serve.json"


def exported_registry(recorder=None):
    """A registry as the service builds one: a ServiceMetrics with a (method, drafter) pair touched, an HTTP
    response counted, its OCM collector and, given a `TrafficRecorder`, its traffic collector. The draft
    head's collector needs a loaded head: the live test (test_dashboard_live.py) reads it from a server."""
    from ocm_store.base import StoreStatus
    from service.api.metrics import OCMStoreCollector, ServiceMetrics
    from service.traffic import TrafficCollector

    metrics = ServiceMetrics(3, model_name="m")
    metrics.touch("csd", "ngram", 3)
    metrics.requests.labels("m", "/v1/completions", "200")
    status = StoreStatus(backend="memory", healthy=True, patterns=0)
    metrics.registry.register(OCMStoreCollector(lambda: status, "m"))
    if recorder is not None:
        metrics.registry.register(TrafficCollector(lambda: recorder, "m"))
    return metrics.registry


def exposition_families(text: str) -> dict[str, set[str]]:
    """Each metric family of a /metrics exposition, with the series names it exports (a counter's `_total`,
    a histogram's `_bucket`, `_sum` and `_count`). prometheus-client's `_created` timestamps are left out:
    no panel is meant to read them."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        family.name: {s.name for s in family.samples if not s.name.endswith("_created")}
        for family in text_string_to_metric_families(text)
        if not family.name.endswith("_created")  # the parser reads them as gauges of their own
    }


# What the draft head's collector exports beside a loaded head only (building one needs the target model):
# test_dashboard_live.py finds these on a real server's /metrics.
HEAD_SERIES = {"csd_draft_head_info", "csd_draft_head_reloads_total"}


def _exported() -> tuple[set[str], set[str]]:
    """(every series name, the gauges) the service's registry exports, so the dashboard and the autoscaler
    are checked against the code, not a copy of it."""
    import tempfile

    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from service.traffic import TrafficRecorder

    with tempfile.TemporaryDirectory() as folder:
        recorder = TrafficRecorder(Path(folder), max_bytes=1 << 20)  # records nothing: its counters only
        try:
            text = generate_latest(exported_registry(recorder)).decode()
        finally:
            recorder.close()
    families = list(text_string_to_metric_families(text))
    names = {sample.name for family in families for sample in family.samples} | HEAD_SERIES
    # the parser reads prometheus-client's `_created` timestamps as gauges of their own: not ones to scale on
    gauges = {f.name for f in families if f.type == "gauge" and not f.name.endswith("_created")}
    return names, gauges


# The series the service exports (histograms with their _bucket/_sum/_count, counters with _total).
KNOWN_SERIES, GAUGES = _exported()

METRIC_NAME = re.compile(r"\b(?:csd_|vllm:)[a-z0-9_:]+")


def metric_names(expr: str) -> set[str]:
    """The csd_* and vllm:* series names a PromQL expression reads."""
    return set(METRIC_NAME.findall(expr))


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_tool(binary: str, how: str) -> str:
    """Path of a tool the project's CI installs (.ci/run). Missing: skip on a developer's machine, fail in CI,
    so that a check it guards can never pass silently there."""
    path = shutil.which(binary)
    if path:
        return path
    message = f"`{binary}` is not installed ({how})"
    if in_ci():
        pytest.fail(message + "; CI must install it", pytrace=False)
    pytest.skip(message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_yaml_documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def find(resources: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict, name: str) -> dict:
    matches = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    assert len(matches) == 1, f"no container {name} in {workload['kind']}/{workload['metadata']['name']}"
    return matches[0]


def selector_matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels only; matchExpressions are not used here) against a label set."""
    assert set(selector) <= {"matchLabels"}, f"unsupported selector {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@contextmanager
def redis_server(
    workdir: Path, args: list[str], port: int, *, shell: str | None = None, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """A throwaway redis-server (never the machine's shared one) run with `args`, stopped afterwards. With
    `shell`, that `sh -c` script starts it instead (a manifest's command), with `env` as its environment."""
    binary = require_tool("redis-server", "Debian package redis-server")
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "redis.log"
    argv = ["sh", "-c", shell] if shell is not None else [binary, *args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {log_path.read_text()}") from None
                time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- settings in manifests

# CSD_* variables read outside the Settings object (service/cli.py).
NON_SETTINGS_VARIABLES = {"CSD_LOG_LEVEL"}


def settings_from_environment(env: dict[str, str]):
    """The service's Settings built from the CSD_* variables in `env`, as the container would see them.

    Fails on a CSD_* name that no setting reads (pydantic-settings would silently ignore it). Values go in as
    keyword arguments, which pydantic coerces as it does environment strings."""
    from pydantic import AliasChoices

    from service.config import Settings

    by_variable = {}
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            for choice in alias.choices:
                if isinstance(choice, str) and choice.upper().startswith("CSD_"):
                    by_variable[choice.upper()] = alias.choices[0]
        else:
            by_variable[f"CSD_{name.upper()}"] = name
    unknown = {k for k in env if k.startswith("CSD_")} - set(by_variable) - NON_SETTINGS_VARIABLES
    assert not unknown, f"variables that no setting reads: {sorted(unknown)}"
    return Settings(**{by_variable[k]: v for k, v in env.items() if k in by_variable})


def expand_kubernetes_variables(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in env values, command and args: defined variables only; $$ escapes."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        value,
    )


def container_environment(
    resources: list[dict], spec: dict, secrets: dict[str, dict[str, str]]
) -> dict[str, str]:
    """A container's environment as Kubernetes builds it: envFrom ConfigMaps (rendered alongside), then env
    entries in order (values, secretKeyRef from `secrets`, configMapKeyRef), each expanded with the ones before."""
    config_maps = {r["metadata"]["name"]: r.get("data", {}) for r in resources if r["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        ref = source.get("configMapRef") or {}
        assert ref.get("name") in config_maps, f"envFrom refers to a missing ConfigMap {ref}"
        env.update(config_maps[ref["name"]])
    for item in spec.get("env", []):
        if "value" in item:
            env[item["name"]] = expand_kubernetes_variables(item["value"], env)
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
        elif "configMapKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["configMapKeyRef"]
            env[item["name"]] = config_maps[ref["name"]][ref["key"]]
        else:
            raise AssertionError(f"unsupported env source {item}")
    return env


# ---------------------------------------------------------------- Dockerfile

DOCKERFILE = REPO / "Dockerfile"


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with line continuations joined and comments dropped (no heredocs)."""
    instructions, current = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, rest = current.partition(" ")
        assert "<<" not in rest, "heredocs are not parsed here"
        instructions.append((keyword.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return instructions


def dockerfile_env() -> dict[str, str]:
    """The image's environment: every ENV instruction's KEY=VALUE pairs."""
    import shlex

    env = {}
    for keyword, args in dockerfile_instructions():
        if keyword == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def dockerfile_user() -> tuple[int, int]:
    users = [args for keyword, args in dockerfile_instructions() if keyword == "USER"]
    assert users, "the Dockerfile sets no USER (it would run as root)"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and gid.isdigit(), (
        "USER should be numeric uid:gid so Kubernetes can check runAsNonRoot"
    )
    return int(uid), int(gid)


# ---------------------------------------------------------------- Grafana dashboard

GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
TEMPLATE_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def load_dashboard() -> dict:
    import json

    return json.loads(DASHBOARD.read_text())


def load_dashboards() -> dict[str, dict]:
    """Every dashboard Grafana is provisioned with (deploy/grafana/*.json), by file name."""
    import json

    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARD.parent.glob("*.json"))}


# Exported series that no dashboard shows, each with the reason; the coverage tests fail on any other.
NOT_ON_A_DASHBOARD = {
    "vllm:lora_requests_info": "a constant for the inference gateway's LoRA-affinity scorer: no adapters are "
    "served (max_lora 0), and its value is a timestamp",
    "vllm:num_preemptions": "always 0: a generation keeps its batch row until it ends; exported under vLLM's "
    "name so that tools which read it find it",
}
SERIES_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count")


def families_on_no_dashboard(families: dict[str, set[str]]) -> list[str]:
    """The families (name -> its series, as `exposition_families` gives them) that no query of any dashboard
    reads, less NOT_ON_A_DASHBOARD. A family counts as shown when a query reads any of its series; one with no
    series yet (a labelled metric nothing has set) by the names it will have."""
    shown = set()
    for dashboard in load_dashboards().values():
        shown |= set().union(*(metric_names(expr) for _, expr in dashboard_queries(dashboard)))
    return sorted(
        name
        for name, series in families.items()
        if name not in NOT_ON_A_DASHBOARD
        and not (series or {name + suffix for suffix in SERIES_SUFFIXES}) & shown
    )


def dashboard_panels(dashboard: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows; rows themselves excluded."""
    panels = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL expression) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in dashboard_panels(dashboard) for t in p.get("targets", [])]


def instantiate(expr: str, dashboard: dict, rate_interval: str) -> str:
    """The expression Grafana sends with every template variable at "All" and the interval variables set."""
    all_values = {
        v["name"]: v.get("allValue", ".*") for v in dashboard["templating"]["list"] if v["type"] == "query"
    }
    values = {
        "__rate_interval": rate_interval,
        "__interval": rate_interval,
        "__range": rate_interval,
        **all_values,
    }

    def substitute(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"undefined template variable ${name} in {expr}"
        return values[name]

    return TEMPLATE_VARIABLE.sub(substitute, expr)
