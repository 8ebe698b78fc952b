"""The decoding core imports torch and transformers only: no web framework, Redis, metrics or settings, and
nothing of the service or the OCM store (they meet it through its small interfaces)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "service" / "decoding"
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
ALLOWED_THIRD_PARTY = {"torch", "transformers"}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_core_sources_import_only_stdlib_torch_transformers_and_the_core():
    files = sorted(CORE.glob("*.py"))
    assert files
    for path in files:
        for name in imported_modules(path):
            top = name.split(".")[0]
            allowed = (
                top in sys.stdlib_module_names
                or top in ALLOWED_THIRD_PARTY
                or name == "service.decoding"
                or name.startswith("service.decoding.")
            )
            assert allowed, f"{path.relative_to(ROOT)} imports {name}"


def test_importing_the_core_loads_nothing_forbidden():
    """What actually ends up in sys.modules (catches an indirect import through another module)."""
    code = "import json, sys; import service.decoding; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    loaded = json.loads(out.stdout)
    assert "torch" in loaded and "service.decoding.engine" in loaded
    bad = [m for m in loaded if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == []
