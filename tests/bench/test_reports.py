"""Goals are judged from the measured figures only: met, missed, or not measured when a workload is absent
(or, for issue 11's, when the run had no draft head)."""

from __future__ import annotations

import pytest

from bench.config import BenchConfig
from bench.context import head_folder
from bench.reports import (
    drafter_comparison,
    evaluate_goals,
    fact_guard_effect,
    goals_table,
    main_table,
    markdown,
)


def per_prompt(tps: float, tokens: int = 1000, prompts: int = 10, spread: float = 0.0) -> dict:
    """Per-prompt figures against a vanilla at 10 tok/s with as many tokens; `spread` varies the method's
    seconds from prompt to prompt (+-spread around the mean), keeping their sum."""
    each = tokens / prompts
    seconds = [
        each / tps * (1 + spread * (i - (prompts - 1) / 2) / ((prompts - 1) / 2)) for i in range(prompts)
    ]
    return {
        "tokens": [each] * prompts, "vanilla_tokens": [each] * prompts, "seconds": seconds,
        "vanilla_seconds": [each / 10.0] * prompts, "equal_work_seconds": seconds,
        "vanilla_equal_work_seconds": [each / 10.0] * prompts, "target_forwards": [each] * prompts,
    }  # fmt: skip


def row(tps: float, tpf: float = 1.0, spread: float = 0.0, **extra) -> dict:
    base = {
        "prompts": 10, "tokens": 1000, "seconds": 1000 / tps, "tokens_per_second": tps, "speedup": None,
        "tokens_per_forward": tpf, "forwards_per_token": 1 / tpf, "target_forwards": 1000 / tpf,
        "acceptance_rate": None, "kept_rate": None, "rescue_rate": None,
        "ocm_share": None, "ocm_seconds": 0.0, "decode_seconds": 10.0, "exact_match": 1.0,
        "loglik_per_token": -0.5, "similarity": 0.95, "task_metric": None, "task_score": None,
        "rescued": None, "recovered": None, "length_ratio": 1.0, "vanilla_tokens": 1000,
        "equal_work_speedup": tps / 10.0, "per_prompt": per_prompt(tps, spread=spread),
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
                "csd": row(csd_tps, 2.8, ocm_seconds=0.01, decode_seconds=5.0, rescued=80),
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
                    rescued=40,
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
    assert (
        met["sd output identical to vanilla at temperature 0 on every prompt (every strict-SD column)"]
        == "met"
    )
    assert met["sd throughput >= 1.5x vanilla on the grounded suite"] == "met"
    assert met["csd throughput >= 2x vanilla on the grounded suite"] == "met"
    assert met["sd throughput >= transformers prompt-lookup (hf-pld) on the grounded suite"] == "met"
    assert met["csd throughput >= 1.3x transformers prompt-lookup (hf-pld) on the grounded suite"] == "met"
    assert met["csd mean accepted tokens per target forward >= 1.3x sd's (grounded)"] == "met"  # 2.8 / 2.0
    assert (
        met[
            "csd QA accuracy not below vanilla by more than 2 points (whole answer and cut at vanilla's length)"
        ]
        == "met"
    )
    assert met["csd OCM share of decoding time < 1 % (all workloads)"] == "met"  # 0.01 s of 10 s

    missed = by_goal(evaluate_goals(report(sd_tps=14.0, csd_tps=19.0, peer_tps=16.0, qa_diff=-0.03)))
    assert missed["sd throughput >= 1.5x vanilla on the grounded suite"] == "missed"
    assert missed["csd throughput >= 2x vanilla on the grounded suite"] == "missed"
    assert missed["sd throughput >= transformers prompt-lookup (hf-pld) on the grounded suite"] == "missed"
    assert (
        missed["csd throughput >= 1.3x transformers prompt-lookup (hf-pld) on the grounded suite"] == "missed"
    )
    assert (
        missed[
            "csd QA accuracy not below vanilla by more than 2 points (whole answer and cut at vanilla's length)"
        ]
        == "missed"
    )


def test_unmeasured_goals_are_not_met():
    goals = by_goal(
        evaluate_goals(report(sd_tps=16.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0, with_qa=False))
    )
    assert (
        goals[
            "csd QA accuracy not below vanilla by more than 2 points (whole answer and cut at vanilla's length)"
        ]
        == "not measured"
    )
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
    assert "| grounded (10) | sd | 1000 (100%) | 14.0 |" in text
    assert "**missed**" in text and "a reason" in text  # a missed goal brings the limits section
    assert ("indicative only" in text) is quick
    words = " ".join(text.split())  # the column help is wrapped
    assert (
        "**accept** accepted / drafted (strict" in words
        and "**kept** (accepted + rescued) / drafted" in words
    )


# ---------------------------------------------------------------- issue 11: the draft head


def head_report(
    head_chat_tpf: float = 2.5,
    head_chat_tps: float = 15.0,
    head_grounded_tpf: float = 2.2,
    csd_head_tpf_gain: float = 1.25,
    qa_diff: float = 0.0,
    similarity: float = 0.95,
    head_mismatches: int = 0,
) -> dict:
    """A run with every head column; sd (prompt lookup) keeps 2.0 tokens per forward on grounded."""
    r = report(sd_tps=16.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0)
    drafted = {"draft_tokens": 600, "accepted": 300, "acceptance_rate": 0.5}
    grounded, qa = r["workloads"]["grounded"]["methods"], r["workloads"]["qa"]["methods"]
    grounded["sd-head"] = row(14.0, head_grounded_tpf, **drafted)
    grounded["csd-head"] = row(16.0, head_grounded_tpf * csd_head_tpf_gain, similarity=similarity, rescued=30)
    r["workloads"]["chat"] = {
        "prompts": 10,
        "methods": {
            "vanilla": row(10.0),
            "sd-head": row(head_chat_tps, head_chat_tpf, **drafted),
            "csd-head": row(
                head_chat_tps * 1.1, head_chat_tpf * csd_head_tpf_gain, similarity=similarity, rescued=30
            ),
        },
    }
    qa["csd-head"] = dict(
        qa["csd"], task_score=0.5 + qa_diff, task_diff_vs_vanilla=qa_diff, similarity=similarity,
        task_diff_interval=[qa_diff - 0.1, qa_diff + 0.1], tokens_per_forward=2.0 * csd_head_tpf_gain,
        target_forwards=1000 / (2.0 * csd_head_tpf_gain),
    )  # fmt: skip
    qa["sd-head"] = row(15.0, 2.0)
    mismatches = [
        {"method": "sd-head", "prompt_id": f"ch-{i}", "position": 3, "logit_gap": 2e-6}
        for i in range(head_mismatches)
    ]
    r["lossless"] = {
        "checked": 40,
        "passed": not mismatches,
        "methods": {
            "sd": {"checked": 20, "mismatches": 0},
            "sd-head": {"checked": 20, "mismatches": len(mismatches)},
        },
        "mismatches": mismatches,
        "peer_mismatches": [],
    }
    r["draft_head"] = {"folder": "f", "identity": "head:f@abc", "skipped": None}
    return r


HEAD_GOALS = {
    "tpf_chat": "sd-head >= 2.2 tokens per target forward on chat",
    "vs_ngram": "sd-head tokens per target forward > sd's (prompt lookup) on grounded",
    "speed": "sd-head throughput >= 1.4x vanilla on chat",
    "lossless": "sd-head output identical to vanilla at temperature 0 on every prompt",
    "csd_gain": "csd-head tokens per target forward >= 1.2x sd-head's (all workloads)",
    "qa": "csd-head QA accuracy not below vanilla by more than 2 points (whole answer and cut at vanilla's "
    "length)",
    "similarity": "csd-head mean semantic similarity to vanilla >= 0.9 (all workloads)",
}


def test_head_goals_met():
    goals = evaluate_goals(head_report())
    status = by_goal(goals)
    assert {status[text] for text in HEAD_GOALS.values()} == {"met"}
    assert {g["issue"] for g in goals if g["goal"] in HEAD_GOALS.values()} == {11}
    # issue 8's goals are judged beside them, unchanged
    assert status["csd throughput >= 2x vanilla on the grounded suite"] == "met"


@pytest.mark.parametrize(
    ("changes", "missed"),
    [
        ({"head_chat_tpf": 2.1}, "tpf_chat"),
        ({"head_grounded_tpf": 2.0}, "vs_ngram"),  # equal to prompt lookup's 2.0 is not more
        ({"head_chat_tps": 13.9}, "speed"),
        ({"head_mismatches": 1}, "lossless"),
        ({"csd_head_tpf_gain": 1.15}, "csd_gain"),
        ({"qa_diff": -0.03}, "qa"),
        ({"similarity": 0.85}, "similarity"),
    ],
)
def test_each_head_goal_is_missed_on_its_own_figure(changes, missed):
    goals = evaluate_goals(head_report(**changes))
    status = by_goal(goals)
    assert status[HEAD_GOALS[missed]] == "missed"
    assert all(status[text] == "met" for key, text in HEAD_GOALS.items() if key != missed)
    (goal,) = [g for g in goals if g["goal"] == HEAD_GOALS[missed]]
    assert goal["measured"] != "-"


def test_head_speed_goal_gives_its_reason_from_the_profile():
    r = head_report(head_chat_tps=12.0)
    r["profile"] = {
        "full_draft_cost_ratio": 1.5,
        "forward_seconds_by_tokens": {"1": 0.10, "2": 0.11, "4": 0.13, "7": 0.15},
        "drafter_cost": {"head": {"seconds_by_tokens": {str(n): n * 1e-4 for n in range(1, 7)},
                                  "seconds_per_draft_token": 1e-4, "share_of_forward": 0.05}},
    }  # fmt: skip
    row = r["workloads"]["chat"]["methods"]["sd-head"]
    row["draft_tokens"] = 3 * row["target_forwards"]  # 3 draft tokens verified per round
    (goal,) = [g for g in evaluate_goals(r) if g["goal"] == HEAD_GOALS["speed"]]
    assert goal["status"] == "missed" and goal["measured"].startswith("1.20x [1.20, 1.20] on equal work")
    # 2.5 tokens per forward over a round costing a 4-token forward (1.3x) + 3 drafted positions of the head
    # x 0.05 = 1.45
    assert "2.50 tokens per forward" in goal["note"] and "a 4.00-token forward (1.30x" in goal["note"]
    assert "about 1.45 one-token forwards' time: about 1.72x vanilla expected" in goal["note"]


def test_head_goals_are_not_measured_without_a_head():
    r = report(sd_tps=16.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0)
    r["draft_head"] = {"folder": None, "identity": None, "skipped": "no draft head weights in X"}
    goals = evaluate_goals(r)
    head = [g for g in goals if g["issue"] == 11]
    assert [g["goal"] for g in head] == list(HEAD_GOALS.values())
    assert all(
        g["status"] == "not measured" and g["note"] == "no draft head: no draft head weights in X"
        for g in head
    )
    assert "| 11 | sd-head >= 2.2" in goals_table(goals)
    r["goals"] = goals
    r["config"] = {"quick": False, "max_tokens": 128, "num_speculative_tokens": 6, "lambda_": 6, "tau": 0.01}
    r["meta"] = {"started": "now", "command": "python -m bench", "machine_line": "a machine", "target": "m",
                 "wall_seconds": 1.0, "phase_seconds": {}}  # fmt: skip
    # one line under the table says why the columns are missing
    assert markdown(r).count("_Head / combined columns skipped: no draft head weights in X._") == 1


def test_head_folder_skips_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr("bench.context.EMBEDDED_HEAD_DIR", tmp_path / "missing")
    folder, note = head_folder(BenchConfig())
    assert folder is None and "no draft head weights" in note
    folder, note = head_folder(BenchConfig(model="HuggingFaceTB/SmolLM2-360M-Instruct"))
    assert folder is None and "trained for the embedded model" in note
    assert head_folder(BenchConfig(draft_head=None)) == (None, "--no-draft-head")
    (tmp_path / "present").mkdir()
    (tmp_path / "present" / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr("bench.context.EMBEDDED_HEAD_DIR", tmp_path / "present")
    assert head_folder(BenchConfig()) == (tmp_path / "present", None)
    assert head_folder(BenchConfig(draft_head=str(tmp_path))) == (tmp_path, None)


def test_drafter_comparison_names_the_best_per_workload():
    r = head_report()
    r["workloads"]["grounded"]["methods"]["sd-combined"] = row(18.0, 2.4)
    comparison = drafter_comparison(r)
    assert comparison["grounded"]["best_strict"] == "combined"  # 18 tok/s over sd's 16 and sd-head's 14
    assert comparison["grounded"]["best_csd"] == "ngram"  # csd 21 tok/s, csd-head 16
    assert set(comparison["chat"]["strict"]) == {"head"}
    assert comparison["chat"]["best_strict"] == "head"


def test_fact_guard_effect_and_its_section():
    r = head_report()
    for workload in r["workloads"].values():
        if "csd-head" in workload["methods"]:
            workload["methods"]["csd-head-unguarded"] = dict(
                workload["methods"]["csd-head"], tokens_per_second=30.0, seconds=1000 / 30.0
            )
    fact = {"number": 0, "negation": 0, "name": 0}
    r["fact_changes"] = {
        "csd-head": {"guarded": True, "rescues": 40, "fact_changing": 0, "share": 0.0, "by_class": fact,
                     "examples": []},
        "csd-head-unguarded": {"guarded": False, "rescues": 50, "fact_changing": 6, "share": 0.12,
                               "by_class": {**fact, "number": 5, "name": 1},
                               "examples": [{"kept": "1", "replaced": "2", "count": 5}]},
    }  # fmt: skip
    guard = fact_guard_effect(r)
    assert guard["with"]["fact_changing"] == 0 and guard["without"]["fact_changing"] == 6
    assert guard["without"]["fact_changing_per_1000_tokens"] == pytest.approx(6 / 3)  # 3000 tokens pooled
    assert guard["tokens_per_forward_ratio"] == pytest.approx(1.0)
    assert guard["tokens_per_second_ratio"] < 1  # the unguarded column ran faster here
    r["fact_guard"] = guard
    r["drafter_comparison"] = drafter_comparison(r)
    r["goals"] = evaluate_goals(r)
    r["config"] = {"quick": False, "max_tokens": 128, "num_speculative_tokens": 6, "lambda_": 6, "tau": 0.01}
    r["meta"] = {"started": "now", "command": "python -m bench", "machine_line": "a machine", "target": "m",
                 "wall_seconds": 1.0, "phase_seconds": {}}  # fmt: skip
    text = markdown(r)
    assert "## Rescues that change facts" in text
    assert "| csd-head-unguarded | off | 50 | 6 | 12.0% | 5 | 0 | 1 | '1'->'2' x5 |" in text
    assert "The guard's benefit: 0 fact-changing rescues" in text
    assert "## Drafters compared" in text


# ---------------------------------------------------------------- issue 19: goals that cannot flatter


def goal_of(goals: list[dict], start: str) -> dict:
    (goal,) = [g for g in goals if g["goal"].startswith(start)]
    return goal


def test_a_speed_goal_near_its_threshold_is_within_noise():
    # 1.55x on average, but the prompts' times vary by +-40 %: the interval straddles 1.5
    r = report(sd_tps=15.5, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0)
    r["workloads"]["grounded"]["methods"]["sd"] = row(15.5, 2.0, spread=0.4)
    goal = goal_of(evaluate_goals(r), "sd throughput >= 1.5x vanilla")
    assert goal["status"] == "within noise", goal
    low, high = (float(x) for x in goal["measured"].split("[")[1].split("]")[0].split(","))
    assert low < 1.5 < high
    # the same mean with steady prompts is judged
    r["workloads"]["grounded"]["methods"]["sd"] = row(15.5, 2.0)
    assert goal_of(evaluate_goals(r), "sd throughput >= 1.5x vanilla")["status"] == "met"


def test_a_column_that_rescued_nothing_does_not_meet_quality_goals():
    r = report(sd_tps=16.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0)
    for workload in r["workloads"].values():
        workload["methods"]["csd"]["rescued"] = 0
    goals = evaluate_goals(r)
    for start in ("csd mean semantic similarity", "csd OCM share", "csd QA accuracy"):
        goal = goal_of(goals, start)
        assert goal["status"] == "not measured" and "rescued nothing" in goal["note"], goal


def test_qa_is_judged_on_the_answer_cut_at_vanillas_length_too():
    r = report(sd_tps=16.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0)
    # the whole answers score as vanilla's, but cut at vanilla's length 5 points are lost (longer outputs)
    r["workloads"]["qa"]["methods"]["csd"].update(
        task_score_cut=0.45, task_diff_cut_vs_vanilla=-0.05, task_diff_cut_interval=[-0.1, 0.0]
    )
    goal = goal_of(evaluate_goals(r), "csd QA accuracy")
    assert goal["status"] == "missed" and "cut at vanilla's length 45.0%" in goal["measured"]


def quality_report(length_ratio: float = 1.0, turn_rescues: int = 0, changed: int = 0) -> dict:
    r = head_report()
    for workload in r["workloads"].values():
        for label in ("sd", "csd", "sd-head", "csd-head"):
            if label in workload["methods"]:
                workload["methods"][label]["length_ratio"] = length_ratio if label.startswith("csd") else 1.0
    r["workloads"]["chat"]["methods"]["sd"] = row(12.0, 1.5)
    r["workloads"]["chat"]["methods"]["csd"] = row(13.0, 1.8, rescued=20)
    r["methods"] = [
        {"label": "csd", "method": "csd", "guard_facts": True, "guard_turns": True},
        {"label": "csd-head", "method": "csd", "guard_facts": True, "guard_turns": True},
        {"label": "csd-head-unguarded", "method": "csd", "guard_facts": False, "guard_turns": False},
    ]
    r["workloads"]["grounded"]["methods"]["csd-head-unguarded"] = row(16.0, 2.9, rescued=50, length_ratio=1.4)
    r["rescued"] = {
        "csd": {"turn_rescues": 0},
        "csd-head": {"turn_rescues": turn_rescues},
        "csd-head-unguarded": {"turn_rescues": 15},
    }
    r["output_fact_changes"] = {
        "csd": {"changed": 0},
        "csd-head": {"changed": changed},
        "csd-head-unguarded": {"changed": 9},
        "sd": {"changed": 0},
    }
    return r


def test_issue_19_goals_follow_turns_lengths_and_facts():
    goals = evaluate_goals(quality_report())
    turn = goal_of(goals, "no rescue over an end-of-turn")
    assert turn["status"] == "met" and "csd-head-unguarded 15" in turn["note"]
    assert goal_of(goals, "output length of every guarded csd column")["status"] == "met"
    facts = goal_of(goals, "no number, date or name")
    assert facts["status"] == "met" and "csd-head-unguarded 9" in facts["note"]
    # the unguarded column (140 % of vanilla's length) is not judged by the length goal, only shown
    goals = evaluate_goals(quality_report(length_ratio=1.06, turn_rescues=2, changed=3))
    assert goal_of(goals, "no rescue over an end-of-turn")["status"] == "missed"
    length = goal_of(goals, "output length of every guarded csd column")
    assert length["status"] == "missed" and "106.0%" in length["measured"]
    assert goal_of(goals, "no number, date or name")["status"] == "missed"


def test_the_gain_goal_needs_tokens_per_forward_similarity_and_qa_on_both_workloads():
    goals = evaluate_goals(quality_report())
    # csd over sd: grounded 2.8 / 2.0 = 1.4x, chat 1.8 / 1.5 = 1.2x, similarity 0.95, QA +0.0
    assert goal_of(goals, "csd >= 1.1x sd's tokens per forward")["status"] == "met"
    r = quality_report()
    r["workloads"]["chat"]["methods"]["csd"]["similarity"] = 0.94
    assert goal_of(evaluate_goals(r), "csd >= 1.1x sd's tokens per forward")["status"] == "missed"
    # no combined columns ran: not measured
    assert goal_of(goals, "csd-combined >= 1.1x")["status"] == "not measured"


def test_served_default_goals_follow_the_figures_and_need_their_column():
    r = report(sd_tps=16.0, csd_tps=21.0, peer_tps=15.0, qa_diff=0.0)
    served = "csd-combined-adaptive (served default)"
    goals = by_goal(evaluate_goals(r))
    assert goals[f"{served} >= 2.0x vanilla on grounded"] == "not measured"  # the column did not run
    r["workloads"]["grounded"]["methods"]["csd-combined-adaptive"] = row(21.0, 2.6)
    r["workloads"]["chat"] = {
        "prompts": 10,
        "methods": {"vanilla": row(10.0), "csd-combined-adaptive": row(15.0)},
    }
    goals = by_goal(evaluate_goals(r))
    assert goals[f"{served} >= 2.0x vanilla on grounded"] == "met"  # 2.1x
    assert goals[f"{served} >= 1.3x transformers prompt-lookup (hf-pld) on grounded"] == "met"  # 21 / 15
    assert goals[f"{served} >= 1.6x vanilla on chat"] == "missed"  # 1.5x
