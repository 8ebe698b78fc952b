"""The test-side kustomize renderer: equal to the real `kubectl kustomize` on our manifests where a kubectl is
installed, and on its own for the rules it implements (hash suffix, strategic merge, refusals)."""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.deploy.kustomize_lite import Unsupported, config_map_hash, render, strategic_merge
from tests.deploy.support import K8S

KUSTOMIZATIONS = ["base", "overlays/cpu", "overlays/gpu", "inference-gateway"]


def _by_identity(resources: list[dict]) -> dict:
    return {(r["apiVersion"], r["kind"], r["metadata"]["name"]): r for r in resources}


def _kubectl_kustomize(directory: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("no kubectl here to cross-check the renderer against")
    version = subprocess.run([kubectl, "version", "--client"], capture_output=True, text=True, timeout=60)
    if "Kustomize Version: v" not in version.stdout:
        # kubectl < 1.24 (e.g. Debian's kubernetes-client 1.20) embeds kustomize v2, which predates `patches`.
        pytest.skip(f"this kubectl embeds a kustomize too old for our overlays: {version.stdout.strip()}")
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed: {proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_renders_exactly_what_kubectl_kustomize_renders(kustomization):
    real = _by_identity(_kubectl_kustomize(K8S / kustomization))
    ours = _by_identity(render(K8S / kustomization))
    assert sorted(ours) == sorted(real)
    for identity, resource in real.items():
        assert ours[identity] == resource, f"{identity} differs from kubectl kustomize"


# Suffixes that `kubectl kustomize` (kustomize v5.5) gave for these generators; the second covers the
# characters that Go's JSON encoder escapes.
@pytest.mark.parametrize(
    "name, data, suffix",
    [
        ("x", {"A": "1"}, "89g4tffbfk"),
        ("settings", {"URL": "http://a/?b=1&c=<d>", "EMPTY": "", "B": "two words"}, "t5dbt68976"),
    ],
)
def test_config_map_hash_is_kustomizes(name, data, suffix):
    assert config_map_hash({"metadata": {"name": name}, "data": data}) == suffix


def test_generated_config_map_is_renamed_where_pods_reference_it(tmp_path):
    (tmp_path / "kustomization.yaml").write_text(
        textwrap.dedent(
            """
            resources: [pod.yaml]
            namespace: demo
            configMapGenerator:
              - name: settings
                literals: [A=1]
            images:
              - name: app
                newName: registry.example/app
                newTag: v2
            """
        )
    )
    (tmp_path / "pod.yaml").write_text(
        textwrap.dedent(
            """
            apiVersion: v1
            kind: Pod
            metadata: {name: p}
            spec:
              containers:
                - name: c
                  image: app:v1
                  envFrom: [{configMapRef: {name: settings}}]
                  env: [{name: X, valueFrom: {configMapKeyRef: {name: settings, key: A}}}]
              volumes: [{name: v, configMap: {name: settings}}, {name: w, configMap: {name: other}}]
            """
        )
    )
    resources = _by_identity(render(tmp_path))
    config_map = resources[("v1", "ConfigMap", "settings-89g4tffbfk")]
    assert config_map["data"] == {"A": "1"} and config_map["metadata"]["namespace"] == "demo"
    pod = resources[("v1", "Pod", "p")]["spec"]
    assert pod["containers"][0]["envFrom"][0]["configMapRef"]["name"] == "settings-89g4tffbfk"
    assert pod["containers"][0]["env"][0]["valueFrom"]["configMapKeyRef"]["name"] == "settings-89g4tffbfk"
    assert [v["configMap"]["name"] for v in pod["volumes"]] == ["settings-89g4tffbfk", "other"]
    assert pod["containers"][0]["image"] == "registry.example/app:v2"


def test_strategic_merge_follows_the_merge_keys():
    original = {
        "spec": {
            "containers": [
                {
                    "name": "a",
                    "image": "a:1",
                    "env": [{"name": "X", "value": "1"}],
                    "ports": [{"containerPort": 80}],
                },
                {"name": "b", "image": "b:1"},
            ],
            "tolerations": [{"key": "old"}],
            "nodeSelector": {"zone": "1"},
        }
    }
    patch = {
        "spec": {
            "containers": [
                {
                    "name": "a",
                    "env": [{"name": "Y", "value": "2"}],
                    "ports": [{"containerPort": 80, "name": "h"}],
                }
            ],
            "tolerations": [{"key": "new"}],
            "nodeSelector": None,
        }
    }
    merged = strategic_merge(original, patch)
    a, b = merged["spec"]["containers"]
    assert a["image"] == "a:1" and a["env"] == [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}]
    assert a["ports"] == [{"containerPort": 80, "name": "h"}]
    assert b == {"name": "b", "image": "b:1"}
    assert merged["spec"]["tolerations"] == [{"key": "new"}]  # no merge key: replaced
    assert "nodeSelector" not in merged["spec"]  # null deletes
    assert original["spec"]["nodeSelector"] == {"zone": "1"}  # inputs untouched


@pytest.mark.parametrize(
    "patch",
    [
        {"spec": {"containers": [{"name": "a", "$patch": "delete"}]}},
        {"spec": {"hostAliases": [{"ip": "1.2.3.4"}]}},  # a list whose merge rule the renderer does not know
    ],
)
def test_strategic_merge_refuses_what_it_does_not_implement(patch):
    original = {"spec": {"containers": [{"name": "a"}], "hostAliases": [{"ip": "5.6.7.8"}]}}
    with pytest.raises(Unsupported):
        strategic_merge(original, patch)


def test_unknown_kustomization_fields_are_refused(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nnamePrefix: dev-\n")
    with pytest.raises(Unsupported, match="namePrefix"):
        render(tmp_path)
