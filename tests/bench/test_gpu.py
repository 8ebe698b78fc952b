"""`python -m bench.gpu --tiny`: the GPU check's own code, on the CPU with tiny random models, as CI runs
it (the real run needs a CUDA GPU). A subprocess, as a user runs it: the report it writes is checked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_tiny_mode_runs_every_part_and_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--tiny", "--threads", "1", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["device"] == "cpu" and report["tiny"]
    names = [c["name"] for c in report["checks"]]
    assert names == ["lossless: sd == vanilla (greedy)", "batched == alone (greedy)", "csd runs"]
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    rows = {(r["drafter"], r["prefix_cache"]): r for r in report["speed"]}
    assert set(rows) == {("none", "off"), ("small random draft", "off"), ("draft = target", "off")}
    same = rows[("draft = target", "off")]
    # draft = target: every draft accepted, k + 1 tokens per forward except where the budget cuts a round
    assert same["acceptance_rate"] == 1.0 and same["tokens_per_forward"] > 3
    assert rows[("none", "off")]["tokens_per_forward"] == 1.0 and rows[("none", "off")]["speedup"] == 1.0
    assert all(r["tokens"] == 16 and r["tokens_per_second"] > 0 for r in rows.values())
    markdown = (out / "report.md").read_text()
    assert "| vanilla | none | 0 | off | 16 |" in markdown and "Overall: PASS" in markdown


def test_without_a_gpu_the_full_mode_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        return  # a GPU machine runs the real check instead
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
