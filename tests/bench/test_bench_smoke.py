"""`python -m bench` end to end on a few prompts with tiny outputs: the machinery, not the figures.

Runs the real command in a subprocess (the embedded target, the real OCM calibration, HumanEval execution,
MiniLM similarity, plots) and checks the report it leaves behind. The head / combined columns run with an
untrained head saved for the test (conftest.py): the trained one may not exist on this machine, and the
columns' machinery is the same with any head. The draft-model runners are covered by test_runners.py; here
they would double the run's time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.executor.int4_weights import int4_supported
from service.executor.models import auto_cpu_dtype

REPO = Path(__file__).resolve().parents[2]
ROW_FIELDS = {
    "prompts", "tokens", "seconds", "tokens_per_second", "speedup", "tokens_per_forward", "forwards_per_token",
    "acceptance_rate", "kept_rate", "rescue_rate", "target_forwards", "ocm_share", "exact_match", "loglik_per_token", "similarity", "task_score",
    "vanilla_tokens", "length_ratio", "equal_work_speedup", "per_prompt", "refused_rescues",
}  # fmt: skip
METHODS = {"vanilla", "sd", "lossy", "csd-cold", "csd", "sd-adaptive", "csd-adaptive", "hf-greedy", "hf-pld"}
HEAD_METHODS = {
    "sd-head", "csd-head", "csd-head-unguarded", "sd-combined", "csd-combined", "sd-combined-adaptive",
    "csd-combined-adaptive",
}  # fmt: skip


def fp32_methods() -> set[str]:
    """`vanilla-fp32` where the bench serves the embedded target in another body than fp32: bf16 on a CPU
    that multiplies it natively, unless its 4-bit weights run the fused fp32 layers (`auto_cpu_dtype`)."""
    weights = "int4" if int4_supported() else "dense"
    return {"vanilla-fp32"} if auto_cpu_dtype(weights) != torch.float32 else set()


def run_bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"},
    )


def test_bench_end_to_end(tmp_path, embedded_head):
    fp32 = fp32_methods()
    # One torch thread: this checks the machinery, not speed, and one thread never spins against other
    # processes on a shared machine.
    out = tmp_path / "results"
    done = run_bench(
        "--quick", "--workloads", "grounded,qa,humaneval", "--limit", "1", "--max-tokens", "6",
        "--calibration-prompts", "2", "--calibration-max-tokens", "8",
        "--sweep-taus", "0.01", "--sweep-lambdas", "2,6", "--sweep-prompts", "1", "--threads", "1",
        "--replay-passes", "2", "--replay-prompts", "1", "--draft-head", str(embedded_head), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reproduce: " in done.stderr and "-m bench --quick" in done.stderr
    assert "machine: " in done.stderr and "torch" in done.stderr
    assert "| workload | method |" in done.stdout  # the markdown table is printed

    for name in ("report.json", "report.md", "outputs.jsonl", "speedup.png", "acceptance_length.png", "sweep.png",
                 "online_learning.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "report.json").read_text())
    assert set(report["workloads"]) == {"grounded", "qa", "humaneval"}
    for workload in report["workloads"].values():
        assert set(workload["methods"]) == METHODS | HEAD_METHODS | fp32
        for method, row in workload["methods"].items():
            assert set(row) >= ROW_FIELDS, method
            assert row["tokens"] > 0 and row["tokens_per_second"] > 0
    grounded = report["workloads"]["grounded"]["methods"]
    assert grounded["vanilla"]["speedup"] == pytest.approx(1.0)
    # speedup is each method's tok/s over vanilla's on the same prompts
    assert grounded["sd"]["speedup"] == pytest.approx(
        grounded["sd"]["tokens_per_second"] / grounded["vanilla"]["tokens_per_second"]
    )
    assert grounded["vanilla"]["tokens_per_forward"] == pytest.approx(1.0)
    assert report["workloads"]["humaneval"]["methods"]["csd"]["task_metric"] == "pass@1"
    assert report["workloads"]["qa"]["methods"]["csd"]["task_metric"] == "accuracy"

    assert report["lossless"]["passed"], report["lossless"]["mismatches"]
    # sd, sd-adaptive, sd-head, sd-combined and sd-combined-adaptive on three prompts
    assert report["lossless"]["checked"] == 15
    assert report["lossless"]["methods"]["sd-head"] == {"checked": 3, "mismatches": 0}
    # one calibration per drafter: patterns are per model pair
    assert set(report["calibration"]["drafters"]) == {"ngram", "head", "combined"}
    assert all(c["prompts"] == 2 for c in report["calibration"]["drafters"].values())
    assert report["draft_head"]["skipped"] is None and report["draft_head"]["identity"].startswith("head:")
    assert set(report["rescued"]) == {"csd-cold", "csd", "csd-adaptive", "csd-head", "csd-head-unguarded",
                                      "csd-combined", "csd-combined-adaptive"}  # fmt: skip
    facts = report["fact_changes"]
    assert set(facts) == set(report["rescued"]) | {"lossy"}
    assert facts["csd-head"]["guarded"] and not facts["csd-head-unguarded"]["guarded"]
    for f in facts.values():
        assert f["fact_changing"] == sum(f["by_class"].values()) <= f["rescues"]
        if f["guarded"]:
            assert f["fact_changing"] == 0  # the guard never rescues a number, negation or name
    guard = report["fact_guard"]
    assert guard["with"]["method"] == "csd-head" and guard["without"]["method"] == "csd-head-unguarded"
    comparison = report["drafter_comparison"]["grounded"]
    assert set(comparison["strict"]) == {"ngram", "head", "combined"}
    assert comparison["best_strict"] in comparison["strict"]
    cost = report["profile"]["drafter_cost"]
    assert set(cost) == {"ngram", "head", "combined"}
    assert set(cost["head"]["seconds_by_tokens"]) == {str(n) for n in range(1, 7)}
    assert cost["head"]["share_of_forward"] > 0
    assert "head: drafter cost per draft token = " in done.stdout
    assert len(report["sweep"]["points"]) == 6  # 3 drafters x 1 tau x 2 lambdas
    assert set(report["sweep"]["chosen"]) == {"ngram", "head", "combined"}
    assert report["sweep"]["prompts"] == [
        "cal-085"
    ]  # held out of the calibration, never an evaluation prompt
    assert len(report["replay"]["requests"]) == 2
    assert len(report["goals"]) == 26  # issue 8's ten, issue 11's seven, issue 18's three, issue 19's six
    goals = {g["goal"]: g["status"] for g in report["goals"]}
    lossless = next(status for goal, status in goals.items() if goal.startswith("sd output identical"))
    assert lossless == "met"  # the lossless check above passed, so its goal must say so
    # every goal this run has the data for is judged, not left "not measured", unless its column rescued nothing
    for goal in report["goals"]:
        if goal["goal"].startswith(("csd mean semantic", "csd OCM", "csd-head mean semantic")):
            column = goal["goal"].split()[0]
            idle = sum(w["methods"][column]["rescued"] for w in report["workloads"].values()) == 0
            assert (goal["status"] == "not measured") is idle, goal
    # lossless columns change no fact of vanilla's output; every column is counted
    facts_out = report["output_fact_changes"]
    assert set(facts_out) == (METHODS | HEAD_METHODS | fp32) - {"vanilla"}
    assert facts_out["sd"]["changed"] == 0 and facts_out["sd"]["vanilla_facts"] >= 0
    assert all(
        r["turn_rescues"] == 0 for label, r in report["rescued"].items() if label != "csd-head-unguarded"
    )
    qa_rows = report["workloads"]["qa"]["methods"]
    assert qa_rows["vanilla"]["task_score_cut"] == qa_rows["vanilla"]["task_score"]
    assert goals["sd-head output identical to vanilla at temperature 0 on every prompt"] == "met"
    # the chat workload was left out: the head's chat goals are not measured, never met
    assert goals["sd-head >= 2.2 tokens per target forward on chat"] == "not measured"
    markdown = (out / "report.md").read_text()
    for section in (
        "## Drafters compared",
        "## Drafter cost",
        "## Rescues that change facts",
        "guard's benefit",
        "## Facts of vanilla's outputs missing or changed",
    ):
        assert section in markdown, section
    assert report["meta"]["machine"]["torch_threads"] == 1  # --threads 1
    lines = (out / "outputs.jsonl").read_text().splitlines()
    assert len(lines) == 3 * len(METHODS | HEAD_METHODS | fp32)
    if fp32:  # every column's speed is also quoted against float32 vanilla
        assert report["meta"]["target_dtype"] == "bfloat16"
        assert "## Against float32 vanilla" in markdown and "(target, bfloat16)" in markdown
        for row in grounded.values():
            assert row["equal_work_speedup_vs_fp32"] > 0
        assert "vanilla-fp32" not in report["lossless"]["methods"]  # another dtype: compared, not required


def test_bad_option_is_one_line_and_exit_2():
    done = run_bench("--workloads", "grounded,poetry", timeout=60)
    assert done.returncode == 2
    assert "poetry" in done.stderr and "Traceback" not in done.stderr
    done = run_bench("--limit", "0", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["bench: error: --limit must be >= 1"]
    done = run_bench("--methods", "sd,poetry", "--no-draft-head", timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "bench: error: --methods: unknown or unavailable poetry"
    done = run_bench("--draft-head", "/nonexistent/head", timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "bench: error: --draft-head /nonexistent/head: no such folder"
    ]
