"""Print the project's requirements (and those of the named extras) one per line, for `pip install -r`.

The Dockerfile installs them from pyproject.toml alone, before it copies the source, so that editing the code
does not rebuild the dependency layer. Usage: python pyproject_requirements.py pyproject.toml [EXTRA ...]
"""

from __future__ import annotations

import sys

import tomllib  # Python 3.11+: the image's Python


def requirements(pyproject: str, extras: list[str]) -> list[str]:
    with open(pyproject, "rb") as f:
        project = tomllib.load(f)["project"]
    optional = project.get("optional-dependencies", {})
    unknown = [e for e in extras if e not in optional]
    if unknown:
        raise SystemExit(f"pyproject_requirements: error: no extra named {', '.join(unknown)} in {pyproject}")
    return list(project.get("dependencies", [])) + [r for e in extras for r in optional[e]]


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: pyproject_requirements.py PYPROJECT [EXTRA ...]")
    print("\n".join(requirements(sys.argv[1], sys.argv[2:])))
