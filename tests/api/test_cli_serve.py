"""`csd serve` fails fast with one line and exit status 2 when it cannot serve."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tests.api.conftest import REPO_ROOT, server_env


def run_serve(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "--log-level", "warning", *flags],
        cwd=REPO_ROOT,
        env=server_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_model_that_cannot_load_stops_the_server(tmp_path: Path) -> None:
    result = run_serve(tmp_path, "--port", "0", "--model", str(tmp_path / "missing.gguf"))
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("csd: error: cannot start: model file") and "does not exist" in last
    assert "Traceback" not in result.stderr


def test_a_busy_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_serve(tmp_path, "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.strip() == f"csd: error: cannot listen on 127.0.0.1:{port}: Address already in use"
