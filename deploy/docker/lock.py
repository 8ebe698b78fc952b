"""Write deploy/docker/requirements.lock: every Python package the image installs besides torch, pinned.

The image installs torch first (its build depends on TORCH_VARIANT: PyTorch's own index), then the lock with
`pip install --no-deps`, so an image built today and one built next year hold the same packages. The lock is
pip's own resolution of the project's dependencies and its `serve` extra (`pyproject_requirements.py`), with
torch pinned to the Dockerfile's TORCH_VERSION so that torch's own dependencies are resolved (and locked) too.
Run it with the image's Python (3.11) on Linux, from the repository root, after changing a dependency:

    python deploy/docker/lock.py            # rewrites deploy/docker/requirements.lock
    python deploy/docker/lock.py --check    # exit 1 if the lock is not what pip resolves now

`tests/deploy/test_dockerfile.py` checks that the lock is complete and consistent: resolved against the
package index of the machine, the lock plus torch yields exactly the lock.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOCK = HERE / "requirements.lock"
EXTRAS = ["serve"]
# Installed by the torch layer from PyTorch's index, not from the lock: torch itself, and what only a CUDA
# build of it pulls in (its exact pins come with the torch wheel).
TORCH_LAYER = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def torch_version() -> str:
    match = re.search(r"^ARG TORCH_VERSION=(\S+)$", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    if match is None:
        raise SystemExit("lock: the Dockerfile has no ARG TORCH_VERSION=...")
    return match.group(1)


def resolve(requirements: list[str], pip_args: list[str] = ()) -> dict[str, str]:
    """What `pip install` would install for `requirements` on an empty environment: {name: version}. pip's
    dry run reads metadata only (no wheel is installed) from the configured index."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "in.txt").write_text("\n".join(requirements) + "\n")
        report = Path(tmp) / "report.json"
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
             "--report", str(report), *pip_args, "-r", str(Path(tmp) / "in.txt")],
            capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"pip could not resolve the requirements:\n{proc.stderr}")
        installed = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installed}


def project_requirements() -> list[str]:
    sys.path.insert(0, str(HERE))
    from pyproject_requirements import requirements

    # torch at the Dockerfile's version: its dependencies are part of what the lock must pin
    reqs = requirements(str(REPO / "pyproject.toml"), EXTRAS)
    return [
        f"torch=={torch_version()}" if canonical(re.split(r"[<>=!~\[ ;]", r)[0]) == "torch" else r
        for r in reqs
    ]


def read_lock(path: Path = LOCK) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name)] = version
    return pins


def lock_text(resolved: dict[str, str]) -> str:
    header = [
        "# The image's Python packages besides torch, pinned: written by deploy/docker/lock.py (do not edit by",
        f"# hand). pip's resolution of pyproject.toml's dependencies and extras {EXTRAS}, with",
        f"# torch=={torch_version()} (the Dockerfile's TORCH_VERSION; installed by its own layer, so not listed),",
        f"# for CPython {sys.version_info.major}.{sys.version_info.minor} on Linux. The Dockerfile installs it with",
        "# `pip install --no-deps -r`, so nothing outside it is installed.",
    ]
    pins = [f"{name}=={version}" for name, version in sorted(resolved.items()) if not TORCH_LAYER.match(name)]
    return "\n".join(header + pins) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the lock instead of writing it")
    args = parser.parse_args()
    text = lock_text(resolve(project_requirements()))
    if args.check:
        if LOCK.read_text() != text:
            print("lock: deploy/docker/requirements.lock is not what pip resolves now", file=sys.stderr)
            return 1
        return 0
    LOCK.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
