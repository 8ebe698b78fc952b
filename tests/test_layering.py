"""The decoding core and its executor import torch and transformers only: no web framework, Redis, metrics or
settings, and nothing of the service or the OCM store (they meet them through their small interfaces). The
executor sits below the model boundary: it knows nothing of drafters, verification or the generation loop."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "service" / "decoding"
EXECUTOR = ROOT / "service" / "executor"
CORE_PACKAGES = ("service.decoding", "service.executor")
# named for the failure message; the rule itself is the allow-list below
FORBIDDEN = (
    "fastapi",
    "starlette",
    "uvicorn",
    "redis",
    "prometheus_client",
    "pydantic_settings",
    "ocm_store",
    "service.api",
    "service.config",
    "service.runtime",
    "service.cli",
)
# safetensors: the weights format of transformers itself (a dependency of it), for the draft head's files;
# llguidance: the grammar engine that structured output masks logits with (a decoding concern, no I/O);
# gguf: the GGUF reader transformers loads GGUF files with, for a file's tensor types (int4_weights)
ALLOWED_THIRD_PARTY = {"torch", "transformers", "safetensors", "llguidance", "gguf"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif isinstance(node, ast.ImportFrom):  # relative: stays inside the core package
            assert node.level == 1, f"{path.name}: relative import above the core package"
    return names


def test_core_sources_import_only_stdlib_torch_transformers_and_the_core():
    """Every import statement of every core module (also those inside functions and TYPE_CHECKING blocks),
    read from the source. Since a core module may import only the standard library, torch, transformers
    and other core modules, nothing of the service can reach the core indirectly either."""
    files = sorted([*CORE.rglob("*.py"), *EXECUTOR.rglob("*.py")])
    assert len(files) > 5 and CORE / "drafters" / "head.py" in files and EXECUTOR / "models.py" in files
    for path in files:
        for name in imported_modules(path):
            top = name.split(".")[0]
            assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), (
                f"{path.relative_to(ROOT)} imports {name}"
            )
            allowed = (
                top in sys.stdlib_module_names
                or top in ALLOWED_THIRD_PARTY
                or any(name == p or name.startswith(p + ".") for p in CORE_PACKAGES)
            )
            assert allowed, f"{path.relative_to(ROOT)} imports {name}"


def test_the_executor_knows_nothing_above_the_model_boundary():
    """A new executor must not change drafters, verification or batching, so the executor imports none of
    them: of the decoding core only `types`, for the one error type (`DecodingError`) the API maps to a 400."""
    files = sorted(EXECUTOR.rglob("*.py"))
    assert EXECUTOR / "kv_cache.py" in files
    for path in files:
        for name in imported_modules(path):
            if name == "service.decoding" or name.startswith("service.decoding."):
                assert name == "service.decoding.types", f"{path.relative_to(ROOT)} imports {name}"


def core_module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_core_modules_import_each_other_without_a_cycle():
    """Every import between core modules (also lazy ones inside functions; TYPE_CHECKING ones too) goes one
    way: the round reads top to bottom through generation -> batch -> engine, drafters below them. The
    package's own `__init__` only re-exports, lazily, so it is left out."""
    paths = [*CORE.rglob("*.py"), *EXECUTOR.rglob("*.py")]
    modules = {core_module(p): p for p in paths if p.name != "__init__.py"}
    graph = {
        name: {m for m in imported_modules(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    for name, path in modules.items():  # importing a subpackage (`drafters`) imports its modules
        for imported in imported_modules(path):
            if ROOT.joinpath(*imported.split(".")).is_dir() and imported not in CORE_PACKAGES:
                graph[name] |= {m for m in modules if m.startswith(imported + ".")}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        assert name not in trail, "import cycle: " + " -> ".join([*trail[trail.index(name) :], name])
        if name in done:
            return
        for nxt in sorted(graph[name]):
            visit(nxt, [*trail, name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert "service.decoding.batch" in graph["service.decoding.engine"]
    assert "service.decoding.engine" not in graph["service.decoding.batch"]
    assert "service.executor.models" in graph["service.decoding.engine"]


def test_the_cli_and_settings_import_without_torch():
    """The CLI refuses bad arguments before the ~10 s import of torch and transformers: the modules it
    needs for that (settings, the core's plain types and paths) must stay light."""
    code = (
        "import json, sys, service.cli, service.config, service.decoding.types, service.executor.paths; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    loaded = json.loads(out.stdout)
    assert "service.cli" in loaded
    assert [m for m in loaded if m.split(".")[0] in ("torch", "transformers")] == []


def test_bad_cli_arguments_are_refused_before_torch_is_imported():
    """A user's typo costs well under a second, not the ~10 s of CPU torch and transformers take to import
    (a check on what gets imported, not on time)."""
    bad = [
        ["generate", ""],
        ["generate", "hi", "--tau", "0"],
        ["generate", "hi", "--max-tokens", "0"],
        ["generate", "hi", "--model", "/nonexistent/model.gguf"],
        ["calibrate", "--prompts", "/nonexistent/prompts.jsonl"],
    ]
    code = (
        "import json, sys; from service.cli import main; "
        f"codes = [main(argv) for argv in {bad!r}]; "
        "print(json.dumps([codes, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    codes, torch_modules = json.loads(out.stdout)
    assert codes == [2] * len(bad)
    assert out.stderr.count("csd: error: ") == len(bad)
    assert torch_modules == []
