"""A small Python renderer for the subset of kustomize that deploy/k8s uses, so that the tests can render the
overlays on a machine without a `kustomize` or `kubectl` binary (Debian has no kustomize package, and its
`kubernetes-client` is too old for `patches:`).

Supported, as kustomize v5 does it:
- `resources`: YAML files and directories holding a kustomization;
- `namespace`: set on every resource (namespaced kinds only; a cluster-scoped kind is refused);
- `images`: `name` -> `newName` / `newTag` / `digest` on containers and init containers of pod templates;
- `configMapGenerator`: `envs` files, `files` (`path` or `key=path`, inside the kustomization's folder as
  kustomize's load restrictor demands) and `literals`, `behavior` create / merge / replace, and the content-hash
  name suffix (kustomize's algorithm), with references from pod templates renamed to the suffixed name;
- `patches`: strategic-merge patches from `path` (or inline `patch`), targeted by the patch's kind and name;
  lists merge by the Kubernetes patch-merge keys of the fields below, other lists are replaced.

Anything else (an unknown kustomization field, a patch `target`, `$patch` directives) raises
`Unsupported`, so a manifest change that needs more of kustomize fails loudly instead of rendering wrongly.
`tests/deploy/test_kustomize_lite.py` checks the output against the real `kubectl kustomize` where one exists.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "configMapGenerator", "patches"}
CLUSTER_SCOPED = {
    "Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume",
    "StorageClass", "PriorityClass", "APIService", "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
}  # fmt: skip
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job", "CronJob", "Pod"}

# Kubernetes' patch-merge keys (the `x-kubernetes-patch-merge-key` of each list field) for the fields we patch.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "envFrom": None,  # no merge key: replaced
    "volumes": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
    "tolerations": None,
    "ingress": None,  # NetworkPolicySpec.ingress has no patch strategy: replaced
    "args": None,
    "command": None,
}

Resource = dict[str, Any]


class Unsupported(Exception):
    """The kustomization uses a feature this renderer does not implement."""


def render(directory: str | Path) -> list[Resource]:
    """Render the kustomization in `directory`, like `kustomize build directory` (order aside)."""
    resources = _build(Path(directory))
    _apply_hash_suffixes(resources)
    for r in resources:
        r.pop("__generated__", None)
    return resources


def _kustomization(directory: Path) -> dict:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            data = yaml.safe_load(path.read_text()) or {}
            unknown = set(data) - SUPPORTED_FIELDS
            if unknown:
                raise Unsupported(f"{path}: fields {sorted(unknown)} are not supported")
            return data
    raise FileNotFoundError(f"no kustomization file in {directory}")


def _build(directory: Path) -> list[Resource]:
    k = _kustomization(directory)
    resources: list[Resource] = []
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            resources.extend(_build(path))
        else:
            resources.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for generator in k.get("configMapGenerator", []):
        _generate_config_map(directory, generator, resources)
    for patch in k.get("patches", []):
        _apply_patch(directory, patch, resources)
    for image in k.get("images", []):
        _set_image(image, resources)
    if "namespace" in k:
        for r in resources:
            if r["kind"] in CLUSTER_SCOPED or r["kind"].endswith("Binding"):
                raise Unsupported(f"namespace on {r['kind']} is not supported")
            r.setdefault("metadata", {})["namespace"] = k["namespace"]
    return resources


# ------------------------------------------------------------------ configMapGenerator


def _parse_env_file(path: Path) -> dict[str, str]:
    data = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise Unsupported(f"{path}: line {line!r} has no '=' (kustomize would read the environment)")
        data[key] = value
    return data


def _generate_config_map(directory: Path, generator: dict, resources: list[Resource]) -> None:
    unknown = set(generator) - {"name", "envs", "files", "literals", "behavior"}
    if unknown:
        raise Unsupported(f"configMapGenerator fields {sorted(unknown)} are not supported")
    data: dict[str, str] = {}
    for env in generator.get("envs", []):
        data.update(_parse_env_file(directory / env))
    for entry in generator.get("files", []):
        key, sep, file = entry.partition("=")
        path = (directory / (file if sep else key)).resolve()
        if not path.is_relative_to(directory.resolve()):
            raise ValueError(f"{entry}: kustomize loads no file outside {directory}")
        data[key if sep else path.name] = path.read_text()
    for literal in generator.get("literals", []):
        key, sep, value = literal.partition("=")
        if not sep:
            raise Unsupported(f"literal {literal!r} has no '='")
        data[key] = value
    behavior = generator.get("behavior", "create")
    name = generator["name"]
    existing = [r for r in resources if r["kind"] == "ConfigMap" and r["metadata"]["name"] == name]
    if behavior == "create":
        if existing:
            raise ValueError(f"ConfigMap {name} exists already (use behavior: merge)")
        resources.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": name},
                "data": data,
                "__generated__": True,
            }
        )
    elif behavior in ("merge", "replace"):
        if len(existing) != 1:
            raise ValueError(f"behavior {behavior}: no generated ConfigMap {name} to {behavior}")
        if behavior == "merge":
            existing[0]["data"].update(data)
        else:
            existing[0]["data"] = data
    else:
        raise Unsupported(f"behavior {behavior!r}")


def config_map_hash(config_map: Resource) -> str:
    """kustomize's name suffix: sha256 of the JSON of {kind, name, data}, first 10 hex digits, 5 of them remapped
    so that the suffix never looks like a number or a word (api/hasher in kustomize).

    The name is hashed as "": kustomize v5 looks it up with the single path segment "metadata/name", which finds
    nothing (checked against kubectl kustomize, v5.5). Matching that keeps our names equal to kustomize's."""
    encoded = {"kind": "ConfigMap", "name": "", "data": config_map.get("data", {})}
    if config_map.get("binaryData"):
        encoded["binaryData"] = config_map["binaryData"]
    # Go's json.Marshal: sorted keys, no spaces, and <, >, & escaped.
    text = json.dumps(encoded, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans({"0": "g", "1": "h", "3": "k", "a": "m", "e": "t"}))


def _apply_hash_suffixes(resources: list[Resource]) -> None:
    renamed: dict[str, str] = {}
    for r in resources:
        if r.get("__generated__"):
            old = r["metadata"]["name"]
            r["metadata"]["name"] = f"{old}-{config_map_hash(r)}"
            renamed[old] = r["metadata"]["name"]
    for r in resources:
        spec = _pod_spec(r)
        if spec is not None:
            _rename_config_map_refs(spec, renamed)


def _pod_spec(resource: Resource) -> dict | None:
    kind = resource["kind"]
    if kind not in WORKLOAD_KINDS:
        return None
    if kind == "Pod":
        return resource["spec"]
    if kind == "CronJob":
        return resource["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return resource["spec"]["template"]["spec"]


def _rename_config_map_refs(spec: dict, renamed: dict[str, str]) -> None:
    def rename(ref: dict | None) -> None:
        if ref and ref.get("name") in renamed:
            ref["name"] = renamed[ref["name"]]

    for container in spec.get("containers", []) + spec.get("initContainers", []):
        for source in container.get("envFrom", []):
            rename(source.get("configMapRef"))
        for env in container.get("env", []):
            rename(env.get("valueFrom", {}).get("configMapKeyRef"))
    for volume in spec.get("volumes", []):
        rename(volume.get("configMap"))
        for source in volume.get("projected", {}).get("sources", []):
            rename(source.get("configMap"))


# ------------------------------------------------------------------ images


def _split_image(image: str) -> tuple[str, str]:
    """'repo/name:tag' -> ('repo/name', ':tag'); a digest stays with the tag part."""
    if "@" in image:
        name, digest = image.split("@", 1)
        return name, "@" + digest
    slash = image.rfind("/")
    colon = image.rfind(":")
    if colon > slash:
        return image[:colon], image[colon:]
    return image, ""


def _set_image(rule: dict, resources: list[Resource]) -> None:
    unknown = set(rule) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise Unsupported(f"images fields {sorted(unknown)} are not supported")
    for r in resources:
        spec = _pod_spec(r)
        if spec is None:
            continue
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            name, suffix = _split_image(container["image"])
            if name != rule["name"]:
                continue
            name = rule.get("newName", name)
            if "digest" in rule:
                suffix = "@" + rule["digest"]
            elif "newTag" in rule:
                suffix = ":" + str(rule["newTag"])
            container["image"] = name + suffix


# ------------------------------------------------------------------ strategic-merge patches


def _apply_patch(directory: Path, entry: dict, resources: list[Resource]) -> None:
    unknown = set(entry) - {"path", "patch"}
    if unknown:
        raise Unsupported(f"patch fields {sorted(unknown)} are not supported (only path / patch)")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    for patch in (d for d in yaml.safe_load_all(text) if d):
        if patch.get("op") or isinstance(patch, list):
            raise Unsupported("JSON 6902 patches are not supported")
        kind, name = patch["kind"], patch["metadata"]["name"]
        group = patch["apiVersion"].rpartition("/")[0]
        targets = [
            r
            for r in resources
            if r["kind"] == kind
            and r["metadata"]["name"] == name
            and r["apiVersion"].rpartition("/")[0] == group
        ]
        if len(targets) != 1:
            raise ValueError(f"patch for {kind}/{name} matches {len(targets)} resources")
        body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
        merged = strategic_merge(targets[0], body)
        targets[0].clear()
        targets[0].update(merged)


def strategic_merge(
    original: Any, patch: Any, field: str | None = None, parent_field: str | None = None
) -> Any:
    """Merge `patch` into `original` (neither is modified) by the strategic-merge rules for our fields."""
    if isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise Unsupported(f"patch directives {[k for k in patch if k.startswith('$')]} are not supported")
        if not isinstance(original, dict):
            return copy.deepcopy(patch)
        result = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                result.pop(key, None)  # null deletes the field
            elif key in result:
                result[key] = strategic_merge(result[key], value, key, field)
            else:
                result[key] = copy.deepcopy(value)
        return result
    if isinstance(patch, list):
        key = _merge_key(field, parent_field)
        if key is None or not isinstance(original, list):
            return copy.deepcopy(patch)
        result = copy.deepcopy(original)
        for item in patch:
            index = next((i for i, old in enumerate(result) if old.get(key) == item.get(key)), None)
            if index is None:
                result.append(copy.deepcopy(item))
            else:
                result[index] = strategic_merge(result[index], item, field, parent_field)
        return result
    return copy.deepcopy(patch)


def _merge_key(field: str | None, parent_field: str | None) -> str | None:
    if field == "ports":
        # Container ports merge by containerPort, Service ports by port.
        return "containerPort" if parent_field in ("containers", "initContainers") else "port"
    if field in MERGE_KEYS:
        return MERGE_KEYS[field]
    raise Unsupported(f"patching the list {field!r}: its merge rule is not known here")
