"""The issues' goals judged against the measured figures: one verdict dict per goal.

Goals of issue 8 judge CSD with the n-gram drafter (prompt lookup); those of issue 11 the trained draft head
(`sd-head`, `csd-head`); those of issue 18 the served default on unseen prompts; those of issue 19 what CSD
may change (turns, lengths, facts) and its gain per drafter at high similarity.

Nothing here flatters: a speed goal is judged on equal work (each prompt's time to emit as many tokens as
the shorter of the two outputs) with a 95 % bootstrap interval over prompts, and is "within noise" when that
interval straddles its threshold; a quality or overhead goal of a csd column that rescued nothing is "not
measured" (the column did not do what the goal is about).
"""

from __future__ import annotations

from bench.metrics import bootstrap_interval
from bench.reports.measured import (
    DRAFTER_COLUMNS,
    GOAL_WORKLOAD,
    HEAD_WORKLOAD,
    _idle,
    _pooled,
    _ratio,
    _row,
    _speed_reason,
    _totals,
)

NOISE = "noise"  # `_goal`'s verdict when the interval straddles the threshold


def _goal(goal: str, met: bool | str | None, measured: str, note: str = "", issue: int = 8) -> dict:
    return {
        "goal": goal,
        "issue": issue,
        "status": {True: "met", False: "missed", None: "not measured", NOISE: "within noise"}[met],
        "measured": measured,
        "note": note,
    }


IDLE_NOTE = "the column rescued nothing: CSD's rescue was never exercised, so this says nothing about it"


def _equal_work_speedup(row: dict, indices) -> float | None:
    per = row["per_prompt"]
    den = sum(per["equal_work_seconds"][i] for i in indices)
    return sum(per["vanilla_equal_work_seconds"][i] for i in indices) / den if den else None


def _speed_goal(
    report: dict,
    workload: str,
    method: str,
    threshold: float,
    goal: str,
    against: str | None = None,
    issue: int = 8,
) -> dict:
    """`method`'s speedup over vanilla on equal work (or over `against`'s, both on equal work against vanilla),
    judged with a 95 % bootstrap interval over prompts: met when the interval clears the threshold, missed
    when it lies below, "within noise" when it straddles it."""
    row, other = _row(report, workload, method), _row(report, workload, against) if against else None
    if not row or "per_prompt" not in row or (against and (not other or "per_prompt" not in other)):
        return _goal(goal, None, "-", issue=issue)
    n = row["prompts"]

    def statistic(indices) -> float | None:
        mine = _equal_work_speedup(row, indices)
        if other is None or mine is None:
            return mine
        theirs = _equal_work_speedup(other, indices)
        return mine / theirs if theirs else None

    value, low, high = bootstrap_interval(n, statistic)
    if value is None:
        return _goal(goal, None, "-", issue=issue)
    verdict: bool | str = NOISE
    if low is not None and low >= threshold:
        verdict = True
    elif high is not None and high < threshold:
        verdict = False
    whole = _ratio(row, other or _row(report, workload, "vanilla"), "tokens_per_second")
    lengths = f"length {row['length_ratio']:.0%} of vanilla's" if row.get("length_ratio") else ""
    if other is not None and other.get("length_ratio"):
        lengths += f", {against}'s {other['length_ratio']:.0%}"
    band = "" if low is None else f" [{low:.2f}, {high:.2f}]"
    return _goal(
        goal,
        verdict,
        f"{value:.2f}x{band} on equal work, 95% bootstrap over {n} prompts",
        f"whole outputs: {whole:.2f}x tok/s; {lengths}" if whole is not None else lengths,
        issue,
    )


def _lossless_goal(lossless: dict, goal: str, methods: set[str] | None, issue: int) -> dict:
    """`methods`: the columns judged (None: every strict-SD column of ours)."""
    if methods is None:
        checked, bad = lossless["checked"], lossless["mismatches"]
    else:
        counts = [c for m, c in lossless.get("methods", {}).items() if m in methods]
        checked = sum(c["checked"] for c in counts)
        bad = [m for m in lossless["mismatches"] if m.get("method") in methods]
    if not checked:
        return _goal(goal, None, "-", issue=issue)
    return _goal(
        goal,
        not bad,
        f"{checked - len(bad)}/{checked} identical",
        "; ".join(
            f"{m.get('method', 'sd')} on {m['prompt_id']}: token {m['position']}, logit gap {m['logit_gap']}"
            for m in bad[:5]
        ),
        issue,
    )


def _qa_goal(report: dict, label: str, issue: int) -> dict:
    goal = f"{label} QA accuracy not below vanilla by more than 2 points (whole answer and cut at vanilla's length)"
    qa_v, qa_c = _row(report, "qa", "vanilla"), _row(report, "qa", label)
    if not (qa_v and qa_c and qa_c.get("task_diff_vs_vanilla") is not None):
        return _goal(goal, None, "-", issue=issue)
    diff = qa_c["task_diff_vs_vanilla"]
    low, high = qa_c["task_diff_interval"]
    cut = qa_c.get("task_diff_cut_vs_vanilla")
    measured = (
        f"{qa_c['task_score']:.1%} vs {qa_v['task_score']:.1%} (difference {diff * 100:+.1f} points, "
        f"95% paired bootstrap [{low * 100:+.1f}, {high * 100:+.1f}], n={qa_c['prompts']})"
    )
    if cut is not None:
        c_low, c_high = qa_c["task_diff_cut_interval"]
        measured += (
            f"; cut at vanilla's length {qa_c['task_score_cut']:.1%} ({cut * 100:+.1f} points "
            f"[{c_low * 100:+.1f}, {c_high * 100:+.1f}])"
        )
    if _idle(report, label):
        return _goal(goal, None, measured, IDLE_NOTE, issue)
    worst = min(diff, cut if cut is not None else diff)
    return _goal(
        goal,
        worst >= -0.02,
        measured,
        "judged on the point estimates; "
        + (
            "the interval clears -2 points" if low >= -0.02 else "the interval does not exclude a larger drop"
        ),
        issue,
    )


def _similarity_goal(report: dict, label: str, issue: int, threshold: float = 0.9) -> dict:
    sim = _pooled(report, label, "similarity")
    goal = f"{label} mean semantic similarity to vanilla >= {threshold:g} (all workloads)"
    if sim is not None and _idle(report, label):
        return _goal(goal, None, f"{sim:.3f}", IDLE_NOTE, issue)
    return _goal(
        goal, None if sim is None else sim >= threshold, "-" if sim is None else f"{sim:.3f}", issue=issue
    )


def evaluate_goals(report: dict) -> list[dict]:
    return ngram_goals(report) + head_goals(report) + served_goals(report) + quality_goals(report)


SERVED = "csd-combined-adaptive"  # what `csd serve` runs by default on the embedded model


def served_goals(report: dict) -> list[dict]:
    """Issue 18: the served default on prompts no training saw, against vanilla in the serving dtype and
    against transformers' prompt lookup."""
    return [
        _speed_goal(
            report, "chat", SERVED, 1.6, f"{SERVED} (served default) >= 1.6x vanilla on chat", issue=18
        ),
        _speed_goal(
            report,
            "grounded",
            SERVED,
            2.0,
            f"{SERVED} (served default) >= 2.0x vanilla on grounded",
            issue=18,
        ),
        _speed_goal(
            report,
            "grounded",
            SERVED,
            1.3,
            f"{SERVED} (served default) >= 1.3x transformers prompt-lookup (hf-pld) on grounded",
            against="hf-pld",
            issue=18,
        ),
    ]


def ngram_goals(report: dict) -> list[dict]:
    """Issue 8: CSD with the calibrated OCM and the n-gram drafter."""
    goals = []
    lossless = report.get("lossless")
    if lossless:
        goals.append(
            _lossless_goal(
                lossless,
                "sd output identical to vanilla at temperature 0 on every prompt (every strict-SD column)",
                None,
                8,
            )
        )
    w = GOAL_WORKLOAD
    sd, csd = (_row(report, w, m) for m in ("sd", "csd"))

    for label, goal_text, threshold in (
        ("sd", "sd throughput >= 1.5x vanilla on the grounded suite", 1.5),
        ("csd", "csd throughput >= 2x vanilla on the grounded suite", 2.0),
    ):
        goals.append(_speed_goal(report, w, label, threshold, goal_text))
    for label, goal_text, threshold in (
        ("sd", "sd throughput >= transformers prompt-lookup (hf-pld) on the grounded suite", 1.0),
        ("csd", "csd throughput >= 1.3x transformers prompt-lookup (hf-pld) on the grounded suite", 1.3),
    ):
        goals.append(_speed_goal(report, w, label, threshold, goal_text, against="hf-pld"))
    value = _ratio(csd, sd, "tokens_per_forward")
    goals.append(
        _goal(
            "csd mean accepted tokens per target forward >= 1.3x sd's (grounded)",
            None if value is None else value >= 1.3,
            "-"
            if value is None
            else f"{value:.2f}x ({csd['tokens_per_forward']:.2f} vs {sd['tokens_per_forward']:.2f})",  # type: ignore[index]
        )
    )
    goals.append(_qa_goal(report, "csd", 8))
    he_v, he_c = _row(report, "humaneval", "vanilla"), _row(report, "humaneval", "csd")
    goals.append(
        _goal(
            "csd HumanEval pass@1 not below vanilla",
            None if not (he_v and he_c) else he_c["task_score"] >= he_v["task_score"],
            "-"
            if not (he_v and he_c)
            else f"{he_c['task_score']:.1%} vs {he_v['task_score']:.1%} (n={he_c['prompts']})",
        )
    )
    goals.append(_similarity_goal(report, "csd", 8))
    rows = [wl["methods"]["csd"] for wl in report["workloads"].values() if "csd" in wl["methods"]]
    ocm = sum(r["ocm_seconds"] for r in rows)
    decode = sum(r["decode_seconds"] for r in rows)
    goals.append(
        _goal(
            "csd OCM share of decoding time < 1 % (all workloads)",
            None if not decode or _idle(report, "csd") else ocm / decode < 0.01,
            "-" if not decode else f"{ocm / decode:.3%} ({ocm * 1000:.1f} ms of {decode:.1f} s)",
            IDLE_NOTE if decode and _idle(report, "csd") else "",
        )
    )
    return goals


def head_goals(report: dict) -> list[dict]:
    """Issue 11: the trained draft head, strict (`sd-head`) and calibrated (`csd-head`)."""
    skipped = (report.get("draft_head") or {}).get("skipped")
    texts = [
        f"sd-head >= 2.2 tokens per target forward on {HEAD_WORKLOAD}",
        f"sd-head tokens per target forward > sd's (prompt lookup) on {GOAL_WORKLOAD}",
        f"sd-head throughput >= 1.4x vanilla on {HEAD_WORKLOAD}",
        "sd-head output identical to vanilla at temperature 0 on every prompt",
        "csd-head tokens per target forward >= 1.2x sd-head's (all workloads)",
        "csd-head QA accuracy not below vanilla by more than 2 points (whole answer and cut at vanilla's length)",
        "csd-head mean semantic similarity to vanilla >= 0.9 (all workloads)",
    ]
    if skipped:
        return [_goal(text, None, "-", f"no draft head: {skipped}", 11) for text in texts]
    goals = []
    head_chat = _row(report, HEAD_WORKLOAD, "sd-head")
    goals.append(
        _goal(
            texts[0],
            None if not head_chat else head_chat["tokens_per_forward"] >= 2.2,
            "-" if not head_chat else f"{head_chat['tokens_per_forward']:.2f}",
            f"{head_chat['acceptance_rate']:.0%} of draft tokens accepted, "
            f"{head_chat['accepted']} of {head_chat['draft_tokens']}"
            if head_chat and head_chat.get("acceptance_rate") is not None
            else "",
            11,
        )
    )
    head_g, sd_g = _row(report, GOAL_WORKLOAD, "sd-head"), _row(report, GOAL_WORKLOAD, "sd")
    goals.append(
        _goal(
            texts[1],
            None if not (head_g and sd_g) else head_g["tokens_per_forward"] > sd_g["tokens_per_forward"],
            "-"
            if not (head_g and sd_g)
            else f"{head_g['tokens_per_forward']:.2f} vs {sd_g['tokens_per_forward']:.2f}",
            issue=11,
        )
    )
    speed = _speed_goal(report, HEAD_WORKLOAD, "sd-head", 1.4, texts[2], issue=11)
    if head_chat and speed["status"] != "not measured":
        speed["note"] = "; ".join(x for x in (speed["note"], _speed_reason(report, head_chat)) if x)
    goals.append(speed)
    lossless = report.get("lossless")
    goals.append(
        _lossless_goal(lossless, texts[3], {"sd-head"}, 11)
        if lossless
        else _goal(texts[3], None, "-", issue=11)
    )
    csd_t, sd_t = _totals(report, "csd-head"), _totals(report, "sd-head")
    value = _ratio(csd_t, sd_t, "tokens_per_forward")
    rows = [w["methods"]["csd-head"] for w in report["workloads"].values() if "csd-head" in w["methods"]]
    drafted = sum(r.get("draft_tokens") or 0 for r in rows)
    rescue = sum(r.get("rescued") or 0 for r in rows) / drafted if drafted else None
    goals.append(
        _goal(
            texts[4],
            None if value is None else value >= 1.2,
            "-"
            if value is None
            else f"{value:.2f}x ({csd_t['tokens_per_forward']:.2f} vs {sd_t['tokens_per_forward']:.2f})",  # type: ignore[index]
            "" if rescue is None else f"{rescue:.1%} of draft tokens rescued",
            11,
        )
    )
    goals.append(_qa_goal(report, "csd-head", 11))
    goals.append(_similarity_goal(report, "csd-head", 11))
    return goals


def _csd_columns(report: dict, guarded: bool = True) -> list[str]:
    """The csd columns that ran, with (guarded) or without (not guarded) both rescue guards."""
    return [
        m["label"]
        for m in report.get("methods", [])
        if m.get("method") == "csd"
        and bool(m.get("guard_facts", True) and m.get("guard_turns", True)) is guarded
        and any(m["label"] in w["methods"] for w in report["workloads"].values())
    ]


GAIN_WORKLOADS = ("grounded", "chat")


def quality_goals(report: dict) -> list[dict]:
    """Issue 19: a guarded csd never crosses a turn, writes as much as vanilla, keeps vanilla's facts, and
    earns its keep per drafter at high similarity."""
    goals = []
    guarded = _csd_columns(report)
    unguarded = _csd_columns(report, guarded=False)
    rescued = report.get("rescued") or {}
    active = [c for c in guarded if not _idle(report, c)]
    text = "no rescue over an end-of-turn or other special token (every guarded csd column)"
    turns = {c: (rescued.get(c) or {}).get("turn_rescues", 0) for c in guarded}
    reference = ", ".join(f"{c} {(rescued.get(c) or {}).get('turn_rescues', 0)}" for c in unguarded)
    goals.append(
        _goal(
            text,
            None if not active else not any(turns.values()),
            "-" if not guarded else ", ".join(f"{c} {n}" for c, n in turns.items()),
            "; ".join(
                x for x in (f"unguarded: {reference}" if reference else "", "" if active else IDLE_NOTE) if x
            ),
            19,
        )
    )
    text = "output length of every guarded csd column within 5 % of vanilla's (each workload)"
    ratios = [
        (c, w, row["length_ratio"])
        for w, data in report["workloads"].items()
        for c, row in data["methods"].items()
        if c in guarded and row.get("length_ratio") is not None
    ]
    if ratios:
        worst = sorted(ratios, key=lambda x: -abs(x[2] - 1))
        off = [x for x in worst if abs(x[2] - 1) > 0.05]
        goals.append(
            _goal(
                text,
                not off,
                f"worst {worst[0][0]} on {worst[0][1]}: {worst[0][2]:.1%} of vanilla's tokens",
                "; ".join(f"{c} on {w} {r:.1%}" for c, w, r in off[:6]),
                19,
            )
        )
    else:
        goals.append(_goal(text, None, "-", issue=19))
    text = "no number, date or name of vanilla's output changed in a guarded csd run (counted in outputs)"
    facts = report.get("output_fact_changes") or {}
    changed = {c: facts[c]["changed"] for c in guarded if c in facts}
    notes = []
    if any(c in facts for c in unguarded):
        notes.append("unguarded: " + ", ".join(f"{c} {facts[c]['changed']}" for c in unguarded if c in facts))
    strict = [c for c in ("sd", "sd-head") if c in facts]
    if strict:
        notes.append("strict (near-ties only): " + ", ".join(f"{c} {facts[c]['changed']}" for c in strict))
    if not active:
        notes.append(IDLE_NOTE)
    goals.append(
        _goal(
            text,
            None if not changed or not active else not any(changed[c] for c in active),
            "-" if not changed else ", ".join(f"{c} {n}" for c, n in changed.items()),
            "; ".join(notes),
            19,
        )
    )
    for drafter, (strict, calibrated) in DRAFTER_COLUMNS.items():
        goals.append(_gain_goal(report, drafter, strict, calibrated))
    return goals


def _gain_goal(report: dict, drafter: str, strict: str, calibrated: str) -> dict:
    """csd >= 1.1x sd's tokens per forward (same drafter) at similarity >= 0.95 and QA within 2 points,
    on grounded and chat."""
    text = (
        f"{calibrated} >= 1.1x {strict}'s tokens per forward at similarity >= 0.95 and QA within 2 points "
        f"(both ways), on {' and '.join(GAIN_WORKLOADS)}"
    )
    parts, verdicts = [], []
    for w in GAIN_WORKLOADS:
        c, s = _row(report, w, calibrated), _row(report, w, strict)
        if not (c and s):
            return _goal(text, None, "-", f"{calibrated} or {strict} did not run on {w}", 19)
        ratio = c["tokens_per_forward"] / s["tokens_per_forward"] if s["tokens_per_forward"] else 0.0
        parts.append(
            f"{w}: {ratio:.2f}x ({c['tokens_per_forward']:.2f} vs {s['tokens_per_forward']:.2f}), sim {c['similarity']:.3f}"
        )
        verdicts += [ratio >= 1.1, c["similarity"] >= 0.95]
    qa = _row(report, "qa", calibrated)
    if qa and qa.get("task_diff_vs_vanilla") is not None:
        diffs = [qa["task_diff_vs_vanilla"], qa.get("task_diff_cut_vs_vanilla", qa["task_diff_vs_vanilla"])]
        parts.append("QA " + " / ".join(f"{d * 100:+.1f}" for d in diffs) + " points (whole / cut)")
        verdicts.append(min(diffs) >= -0.02)
    else:
        parts.append("QA not run")
        return _goal(text, None, "; ".join(parts), issue=19)
    return _goal(text, all(verdicts), "; ".join(parts), IDLE_NOTE if _idle(report, calibrated) else "", 19)
