"""`python -m bench.draft_length`: strict SD at several draft lengths, priced by the measured cost table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_draft_lengths_are_compared_fixed_and_adaptive():
    done = subprocess.run(
        [sys.executable, "-m", "bench.draft_length", "--k", "2,4", "--workloads", "grounded", "--limit", "1",
         "--max-tokens", "16", "--drafters", "ngram"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Machine: ") and "threads" in lines[0]
    assert lines[1] == "Command: python -m bench.draft_length " + " ".join(
        ["--k", "2,4", "--workloads", "grounded", "--limit", "1", "--max-tokens", "16", "--drafters", "ngram"]
    )
    assert lines[2].startswith("Cost table c(n) / c(1): 1:1.000 ")
    rows = [line.split(" | ") for line in lines if line.startswith("| grounded |")]
    assert [(r[2], r[3]) for r in rows] == [
        ("2", "fixed"),
        ("2", "adaptive"),
        ("4", "fixed"),
        ("4", "adaptive"),
    ]
    for row in rows:
        tokens_per_forward, predicted = float(row[4]), float(row[5].rstrip("x"))
        # every forward emits at least its own token and at most the draft plus one
        assert 1.0 <= tokens_per_forward <= 1 + int(row[2])
        assert predicted > 0


def test_bad_options_are_one_line_and_exit_2():
    for bad in (
        ["--k", "6,x"],
        ["--k", "0"],
        ["--limit", "0"],
        ["--workloads", "poetry"],
        ["--drafters", "oracle"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "bench.draft_length", *bad],
            cwd=REPO, capture_output=True, text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )  # fmt: skip
        assert done.returncode == 2, bad
        assert "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1].startswith(
            "python -m bench.draft_length: error:"
        )
