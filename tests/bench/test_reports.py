"""Goals are judged from the measured figures only: met, missed, or not measured when a workload is absent."""

from __future__ import annotations

import pytest

from bench.reports import evaluate_goals, main_table, markdown


def row(tps: float, tpf: float = 1.0, **extra) -> dict:
    base = {
        "prompts": 10, "tokens": 1000, "seconds": 1000 / tps, "tokens_per_second": tps, "speedup": None,
        "tokens_per_forward": tpf, "forwards_per_token": 1 / tpf, "acceptance_rate": None, "rescue_rate": None,
        "ocm_share": None, "ocm_seconds": 0.0, "decode_seconds": 10.0, "exact_match": 1.0,
        "loglik_per_token": -0.5, "similarity": 0.95, "task_metric": None, "task_score": None,
        "rescued": None, "recovered": None,
    }  # fmt: skip
    base.update(extra)
    return base


def report(sd_tps: float, csd_tps: float, peer_tps: float, qa_diff: float, with_qa: bool = True) -> dict:
    workloads = {
        "grounded": {
            "prompts": 10,
            "methods": {
                "vanilla": row(10.0),
                "sd": row(sd_tps, 2.0),
                "csd": row(csd_tps, 2.8, ocm_seconds=0.01, decode_seconds=5.0),
                "hf-pld": row(peer_tps, 2.0),
            },
        }
    }
    if with_qa:
        qa = {"task_metric": "accuracy", "task_interval": [0.4, 0.6]}
        workloads["qa"] = {
            "prompts": 10,
            "methods": {
                "vanilla": row(
                    10.0, task_score=0.5, task_diff_vs_vanilla=0.0, task_diff_interval=[0, 0], **qa
                ),
                "csd": row(
                    20.0,
                    2.0,
                    task_score=0.5 + qa_diff,
                    task_diff_vs_vanilla=qa_diff,
                    task_diff_interval=[qa_diff - 0.1, qa_diff + 0.1],
                    ocm_seconds=0.0,
                    decode_seconds=5.0,
                    **qa,
                ),  # fmt: skip
            },
        }
    return {
        "workloads": workloads,
        "lossless": {"checked": 20, "passed": True, "mismatches": [], "peer_mismatches": []},
    }


def by_goal(goals: list[dict]) -> dict[str, str]:
    return {g["goal"]: g["status"] for g in goals}


def test_goals_met_and_missed_follow_the_figures():
    met = by_goal(evaluate_goals(report(sd_tps=16.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0)))
    assert met["sd throughput >= 1.5x vanilla on the grounded suite"] == "met"
    assert met["csd throughput >= 2x vanilla on the grounded suite"] == "met"
    assert met["sd throughput >= transformers prompt-lookup (hf-pld) on the grounded suite"] == "met"
    assert met["csd throughput >= 1.3x transformers prompt-lookup (hf-pld) on the grounded suite"] == "met"
    assert met["csd mean accepted tokens per target forward >= 1.3x sd's (grounded)"] == "met"  # 2.8 / 2.0
    assert met["csd QA accuracy not below vanilla by more than 2 points"] == "met"
    assert met["csd OCM share of decoding time < 1 % (all workloads)"] == "met"  # 0.01 s of 10 s
    assert met["sd output identical to vanilla at temperature 0 on every prompt"] == "met"

    missed = by_goal(evaluate_goals(report(sd_tps=14.0, csd_tps=19.0, peer_tps=16.0, qa_diff=-0.03)))
    assert missed["sd throughput >= 1.5x vanilla on the grounded suite"] == "missed"
    assert missed["csd throughput >= 2x vanilla on the grounded suite"] == "missed"
    assert missed["sd throughput >= transformers prompt-lookup (hf-pld) on the grounded suite"] == "missed"
    assert (
        missed["csd throughput >= 1.3x transformers prompt-lookup (hf-pld) on the grounded suite"] == "missed"
    )
    assert missed["csd QA accuracy not below vanilla by more than 2 points"] == "missed"


def test_unmeasured_goals_are_not_met():
    goals = by_goal(
        evaluate_goals(report(sd_tps=16.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0, with_qa=False))
    )
    assert goals["csd QA accuracy not below vanilla by more than 2 points"] == "not measured"
    assert goals["csd HumanEval pass@1 not below vanilla"] == "not measured"


def test_a_lossless_mismatch_is_a_missed_goal_with_its_logit_gap():
    r = report(sd_tps=16.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0)
    r["lossless"] = {
        "checked": 20,
        "passed": False,
        "mismatches": [{"prompt_id": "gr-007", "position": 41, "logit_gap": 3.1e-06}],
        "peer_mismatches": [],
    }
    (goal,) = [g for g in evaluate_goals(r) if g["goal"].startswith("sd output identical")]
    assert goal["status"] == "missed"
    assert goal["measured"] == "19/20 identical"
    assert "gr-007" in goal["note"] and "3.1e-06" in goal["note"]


@pytest.mark.parametrize("quick", [True, False])
def test_markdown_has_the_table_and_the_goals(quick):
    r = report(sd_tps=14.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0)
    r["goals"] = evaluate_goals(r)
    r["limits"] = ["a reason"]
    r["config"] = {"quick": quick, "max_tokens": 128, "num_speculative_tokens": 6, "lambda_": 6, "tau": 0.01}
    r["meta"] = {"started": "now", "command": "python -m bench", "machine_line": "a machine", "target": "m",
                 "wall_seconds": 1.0, "phase_seconds": {}}  # fmt: skip
    text = markdown(r)
    assert main_table(r) in text
    assert "| grounded (10) | sd | 14.0 |" in text
    assert "**missed**" in text and "a reason" in text  # a missed goal brings the limits section
    assert ("indicative only" in text) is quick
