"""The report: the issues' goals judged against the measured figures, a markdown version, and the JSON file.

Nothing here invents a number: every figure comes from the run's report dict, and a goal that the run did not
measure (its workload was left out, or there was no draft head) is "not measured", never met.

Goals of issue 8 judge CSD with the n-gram drafter (prompt lookup); those of issue 11 the trained draft head
(`sd-head`, `csd-head`); those of issue 19 what CSD may change (turns, lengths, facts) and its gain per
drafter at high similarity.

Nothing here flatters: a speed goal is judged on equal work (each prompt's time to emit as many tokens as
the shorter of the two outputs) with a 95 % bootstrap interval over prompts, and is "within noise" when that
interval straddles its threshold; a quality or overhead goal of a csd column that rescued nothing is "not
measured" (the column did not do what the goal is about).
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.forward_report import forward_markdown
from bench.metrics import bootstrap_interval
from bench.sweep import sweep_markdown

GOAL_WORKLOAD = "grounded"
HEAD_WORKLOAD = "chat"  # where prompt lookup has nothing to copy: the head's reason to exist
# the drafters compared per workload: drafter -> (strict column, csd column)
DRAFTER_COLUMNS = {"ngram": ("sd", "csd"), "head": ("sd-head", "csd-head"), "combined": ("sd-combined", "csd-combined")}  # fmt: skip


# ---------------------------------------------------------------- goals


def _row(report: dict, workload: str, method: str) -> dict | None:
    return report["workloads"].get(workload, {}).get("methods", {}).get(method)


NOISE = "noise"  # `_goal`'s verdict when the interval straddles the threshold


def _goal(goal: str, met: bool | str | None, measured: str, note: str = "", issue: int = 8) -> dict:
    return {
        "goal": goal,
        "issue": issue,
        "status": {True: "met", False: "missed", None: "not measured", NOISE: "within noise"}[met],
        "measured": measured,
        "note": note,
    }


def _pooled(report: dict, method: str, key: str) -> float | None:
    """Prompt-weighted mean of a per-prompt average over every workload."""
    rows = [w["methods"][method] for w in report["workloads"].values() if method in w["methods"]]
    rows = [r for r in rows if r.get(key) is not None]
    n = sum(r["prompts"] for r in rows)
    return sum(r[key] * r["prompts"] for r in rows) / n if n else None


def _totals(report: dict, method: str) -> dict | None:
    """tokens, seconds and target forwards of `method` summed over every workload, with the two ratios."""
    rows = [w["methods"][method] for w in report["workloads"].values() if method in w["methods"]]
    if not rows:
        return None
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    forwards = sum(r.get("target_forwards") or r["tokens"] * r["forwards_per_token"] for r in rows)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "target_forwards": forwards,
        "tokens_per_forward": tokens / forwards if forwards else None,
        "tokens_per_second": tokens / seconds if seconds else None,
    }


def _ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or a.get(key) is None or not b.get(key):
        return None
    return a[key] / b[key]


def _rescued(report: dict, method: str) -> int | None:
    """Tokens `method` rescued over every workload (None: the column did not run)."""
    rows = [w["methods"][method] for w in report["workloads"].values() if method in w["methods"]]
    return sum(r.get("rescued") or 0 for r in rows) if rows else None


def _idle(report: dict, method: str) -> bool:
    """A csd column that rescued nothing: its similarity, QA and OCM figures say nothing about CSD."""
    return _rescued(report, method) == 0


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


def _head_cost(report: dict) -> dict | None:
    """The profile's cost of the head drafter, with the full draft's verification cost beside it."""
    profile = report.get("profile") or {}
    cost = (profile.get("drafter_cost") or {}).get("head")
    if not cost:
        return None
    return {**cost, "full_draft_cost_ratio": profile["full_draft_cost_ratio"]}


def _interpolate(points: list[tuple[int, float]], x: float) -> float:
    """The value at x on the line through sorted (x, y) points, held flat beyond the last one."""
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (max(x, x0) - x0) / (x1 - x0) * (y1 - y0)
    return points[-1][1]


def _speed_reason(report: dict, row: dict) -> str:
    """Why a head column runs at the speed it does: tokens per forward against what its rounds cost (a
    forward over one token plus the draft tokens the column verified per round on average, and the head
    steps that drafted them)."""
    cost = _head_cost(report)
    tpf = row["tokens_per_forward"]
    kept = f"{tpf:.2f} tokens per forward"
    if row.get("acceptance_rate") is not None:
        kept += f" ({row['acceptance_rate']:.0%} of draft tokens accepted)"
    forwards = (report.get("profile") or {}).get("forward_seconds_by_tokens")
    if not cost or not forwards or not row.get("target_forwards") or row.get("draft_tokens") is None:
        return kept
    drafted = row["draft_tokens"] / row["target_forwards"]  # draft tokens verified per round
    points = sorted((int(n), s) for n, s in forwards.items())  # measured sizes, e.g. 1, 2, 4, 7 tokens
    forward = _interpolate(points, 1 + drafted) / points[0][1]
    round_cost = forward + drafted * cost["share_of_forward"]
    return (
        f"{kept}; a round verified {drafted:.2f} draft tokens on average: a {1 + drafted:.2f}-token forward "
        f"({forward:.2f}x a one-token one) plus as many head steps (x {cost['share_of_forward']:.1%}), about "
        f"{round_cost:.2f} one-token forwards' time: about {tpf / round_cost:.2f}x vanilla expected"
    )


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


def drafter_comparison(report: dict) -> dict[str, dict]:
    """workload -> per drafter (n-gram, head, combined) the strict and the csd column's tok/s and tok/fwd, and
    the best drafter of each by tok/s (what a user waits for); drafters that did not run are left out."""
    comparison: dict[str, dict] = {}
    for workload, data in report["workloads"].items():
        rows = data["methods"]
        entry: dict = {}
        for kind, index in (("strict", 0), ("csd", 1)):
            figures = {
                drafter: {
                    "method": columns[index],
                    "tokens_per_second": rows[columns[index]]["tokens_per_second"],
                    "tokens_per_forward": rows[columns[index]]["tokens_per_forward"],
                }
                for drafter, columns in DRAFTER_COLUMNS.items()
                if columns[index] in rows
            }
            entry[kind] = figures
            entry[f"best_{kind}"] = (
                max(figures, key=lambda d: figures[d]["tokens_per_second"]) if figures else None
            )
        comparison[workload] = entry
    return comparison


def fact_guard_effect(
    report: dict, guarded: str = "csd-head", unguarded: str = "csd-head-unguarded"
) -> dict | None:
    """The guard's benefit (fact-changing rescues with vs without it, per 1000 generated tokens) and cost
    (tokens per forward and tokens/s with vs without), pooled over every workload."""
    facts = report.get("fact_changes") or {}
    if guarded not in facts or unguarded not in facts:
        return None
    with_, without = _totals(report, guarded), _totals(report, unguarded)
    if not with_ or not without:
        return None

    def side(label: str, totals: dict) -> dict:
        changed = facts[label]["fact_changing"]
        return {
            "method": label,
            "rescues": facts[label]["rescues"],
            "fact_changing": changed,
            "fact_changing_per_1000_tokens": 1000 * changed / totals["tokens"] if totals["tokens"] else None,
            "tokens_per_forward": totals["tokens_per_forward"],
            "tokens_per_second": totals["tokens_per_second"],
        }

    return {
        "with": side(guarded, with_),
        "without": side(unguarded, without),
        "tokens_per_forward_ratio": _ratio(with_, without, "tokens_per_forward"),
        "tokens_per_second_ratio": _ratio(with_, without, "tokens_per_second"),
    }


def limits(report: dict) -> list[str]:
    """Plain sentences on what bounds the speed, from the profile; shown when a speed goal is missed."""
    profile = report.get("profile")
    if not profile:
        return []
    costs = profile["forward_seconds_by_tokens"]
    one = costs["1"]
    lines = [
        "Target forward time by tokens verified (cache = one grounded prompt, "
        f"{profile['prompt_tokens']} tokens): "
        + ", ".join(f"{n} -> {s * 1000:.1f} ms" for n, s in costs.items())
        + f". Verifying a full draft costs {profile['full_draft_cost_ratio']:.2f}x a one-token step, so a round "
        "must keep that many tokens just to break even.",
    ]
    head = profile.get("lm_head_seconds_by_tokens")
    if head:
        last = max(head, key=int)
        lines.append(
            "The vocabulary projection alone (one matmul) takes "
            + ", ".join(f"{n} -> {s * 1000:.1f} ms" for n, s in head.items())
            + f": {head[last] / head['1']:.2f}x for {last} rows over one. Where that ratio is well above 1, the "
            "matmul kernel for several rows, not the arithmetic, makes verification expensive."
        )
    share = profile["sd_forward_share"]
    if share.get("forward_share") is not None:
        lines.append(
            f"In an sd generation, {share['forward_share']:.0%} of the decoding time is inside the target's forward "
            f"({share['target_forwards']} forwards, {share['forward_seconds'] / max(1, share['target_forwards']) * 1000:.1f} ms each); "
            "the rest is drafting, verification and the loop."
        )
    ops = profile["operators"]
    if ops.get("operator_share") is not None:
        top = ", ".join(
            f"{o['op']} {o['self_seconds'] / ops['operator_seconds']:.0%}" for o in ops["top"][:5]
        )
        lines.append(
            f"torch profiler over an sd generation: {ops['operator_share']:.0%} of the wall time is inside torch "
            f"operators (the rest is Python around them: module calls, cache bookkeeping); heaviest: {top}."
        )
    csd = _row(report, GOAL_WORKLOAD, "csd")
    if csd and csd.get("rescued") is not None and csd.get("recovered") is not None:
        divergences = csd["rescued"] + csd["recovered"]
        cal = report.get("calibration", {}).get("drafters", {}).get("ngram")
        memory = (
            f"; the calibrated OCM held {cal['patterns']} patterns, {cal['patterns_over_lambda']} of them seen more "
            f"than lambda times"
            if cal
            else ""
        )
        lines.append(
            f"csd rescued {csd['rescued']} of {divergences} divergences on the grounded suite "
            f"({csd['rescued'] / divergences if divergences else 0:.0%}){memory}: a rescue needs a recurring "
            "pattern (count > lambda) that the target also finds plausible (p ratio >= tau)."
        )
    sd = _row(report, GOAL_WORKLOAD, "sd")
    if sd and one:
        lines.append(
            f"sd keeps {sd['tokens_per_forward']:.2f} tokens per forward on the grounded suite; at the measured forward "
            f"costs that bounds its speedup near {sd['tokens_per_forward'] / profile['full_draft_cost_ratio']:.2f}x "
            f"(full drafts) to {sd['tokens_per_forward']:.2f}x (free verification)."
        )
    head = _row(report, HEAD_WORKLOAD, "sd-head")
    if head and _head_cost(report):
        lines.append(f"sd-head on the {HEAD_WORKLOAD} suite: {_speed_reason(report, head)}.")
    return lines


def drafter_cost_lines(report: dict) -> list[str]:
    """Per drafter, from the profile: "drafter cost per draft token = X ms = Y % of a target forward"."""
    profile = report.get("profile") or {}
    one = profile.get("forward_seconds_by_tokens", {}).get("1")
    lines = []
    for name, cost in (profile.get("drafter_cost") or {}).items():
        by_tokens = ", ".join(f"{n} -> {s * 1000:.3g} ms" for n, s in cost["seconds_by_tokens"].items())
        lines.append(
            f"{name}: drafter cost per draft token = {cost['seconds_per_draft_token'] * 1000:.3g} ms = "
            f"{cost['share_of_forward']:.2%} of a target forward ({one * 1000:.1f} ms for one token); one "
            f"proposal of 1..k tokens: {by_tokens}"
        )
    return lines


# ---------------------------------------------------------------- markdown


def _pct(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v * 100:.{digits}f}%"


def _num(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _task(row: dict) -> str:
    if row.get("task_score") is None:
        return "–"
    low, high = row["task_interval"]
    return f"{row['task_score'] * 100:.1f}% [{low * 100:.0f}–{high * 100:.0f}]"


COLUMNS = (
    "| workload | method | tokens (vs vanilla) | tok/s | speedup | equal-work speedup | tok/fwd | accept | kept | "
    "rescue | fwd/tok | OCM | task [95% CI] | task cut at vanilla's length | exact | loglik/tok | sim |"
)


def _length(row: dict) -> str:
    ratio = row.get("length_ratio")
    if ratio is None:
        return str(row["tokens"])
    return f"{row['tokens']} ({ratio:.0%})"


def main_table(report: dict) -> str:
    lines = [COLUMNS, "|" + "---|" * (COLUMNS.count("|") - 1)]
    for workload, data in report["workloads"].items():
        for method, r in data["methods"].items():
            task = _task(r)
            if r.get("task_metric") and task != "–":
                task = f"{r['task_metric']} {task}"
            cut = "–" if r.get("task_score_cut") is None else f"{r['task_score_cut'] * 100:.1f}%"
            lines.append(
                f"| {workload} ({r['prompts']}) | {method} | {_length(r)} | {r['tokens_per_second']:.1f} | "
                f"{_num(r['speedup'], '.2f')}x | {_num(r.get('equal_work_speedup'), '.2f')}x | "
                f"{r['tokens_per_forward']:.2f} | {_pct(r['acceptance_rate'])} | "
                f"{_pct(r.get('kept_rate'))} | {_pct(r['rescue_rate'])} | {r['forwards_per_token']:.3f} | "
                f"{_pct(r['ocm_share'], 3)} | {task} | {cut} | {_pct(r['exact_match'], 0)} | "
                f"{_num(r['loglik_per_token'], '.3f')} | {_num(r['similarity'], '.3f')} |"
            )
    return "\n".join(lines)


def fp32_table(report: dict) -> str | None:
    """Equal-work speedups over float32 vanilla, where the target was served in another dtype."""
    rows = [
        (workload, method, r["equal_work_speedup_vs_fp32"], r.get("equal_work_speedup"))
        for workload, data in report["workloads"].items()
        for method, r in data["methods"].items()
        if r.get("equal_work_speedup_vs_fp32") is not None
    ]
    if not rows:
        return None
    lines = [
        "| workload | method | equal-work speedup over float32 vanilla | over vanilla in the serving dtype |",
        "|---|---|---|---|",
    ]
    for workload, method, vs_fp32, vs_own in rows:
        lines.append(f"| {workload} | {method} | {vs_fp32:.2f}x | {_num(vs_own, '.2f')}x |")
    return "\n".join(lines)


def goals_table(goals: list[dict]) -> str:
    lines = ["| issue | goal | status | measured |", "|---|---|---|---|"]
    for g in goals:
        note = f" ({g['note']})" if g["note"] else ""
        lines.append(f"| {g.get('issue', 8)} | {g['goal']} | **{g['status']}** | {g['measured']}{note} |")
    return "\n".join(lines)


COLUMN_HELP = """\
Columns: **tokens** generated over the workload's prompts, with the share of vanilla's (a lossy method that
writes more is not faster, it does other work); **tok/s** generated tokens over wall time of the whole call
(prefill included), summed over the workload's prompts; **speedup** tok/s over vanilla's on the same prompts;
**equal-work speedup** vanilla's time over the method's to emit, per prompt, as many tokens as the shorter of
the two outputs (the speed goals judge this, with a bootstrap interval over prompts); **tok/fwd** mean tokens emitted per
target forward (accepted + rescued + the recovered/bonus token; about 1.00 for vanilla); **accept** accepted /
drafted (strict, vLLM's acceptance rate: a rescued token is not accepted); **kept** (accepted + rescued) /
drafted; **rescue** rescued / drafted; **fwd/tok** target forwards per generated token; **OCM** time in
the correction memory over decoding time; **task** QA accuracy (answer string in the output), HumanEval
pass@1 (its own harness) or math accuracy (last number), with a 95% Wilson interval; **task cut** QA accuracy
of the output cut at vanilla's length (a longer answer has more chances to contain the string); **exact** share of prompts
whose tokens equal vanilla's; **loglik/tok** mean target log-likelihood per generated token (one teacher-forced
forward; by the float32 copy of a target served in bf16); **sim** mean cosine similarity to vanilla's text (all-MiniLM-L6-v2). Methods: `vanilla` plain target
decoding; `sd` strict speculative decoding; `lossy` the paper's static baseline (p(draft) >= 0.6 p(top));
`csd-cold` CSD from an empty OCM; `csd` CSD from the calibrated OCM (both keep learning online per workload);
`vanilla-fp32` plain decoding with a float32 copy of a target served in bf16;
`*-adaptive` with the service's cost-aware draft policy; `hf-greedy` / `hf-pld` transformers' `generate` plain /
with `prompt_lookup_num_tokens`; `*-head` the trained draft head as drafter, `*-combined` prompt lookup where it
matches >= 3 tokens and the head elsewhere (each calibrated on its own OCM namespace), `csd-head-unguarded`
csd-head without the rescue guards (the paper's CSD); `*-model` the draft model; `hf-assisted` transformers with `assistant_model`.
n-gram drafter (prompt lookup) unless marked. Every csd column has its own OCM, calibrated the same way. CSD
never rescues over a special token (the turn guard) nor a rescue that starts, ends, breaks or changes a
number, date, negation or name (the fact guard, judged with the tokens before it) except in `-unguarded`
columns."""


def comparison_table(comparison: dict[str, dict]) -> str:
    """Per workload, each drafter's strict and csd column (tok/s, tok/fwd) and the best by tok/s."""
    drafters = [
        d for d in DRAFTER_COLUMNS if any(d in c["strict"] or d in c["csd"] for c in comparison.values())
    ]
    header = "| workload | " + " | ".join(
        f"{DRAFTER_COLUMNS[d][0]} | {DRAFTER_COLUMNS[d][1]}" for d in drafters
    )
    lines = [header + " | best strict | best csd |", "|---" * (2 * len(drafters) + 3) + "|"]
    for workload, c in comparison.items():
        cells = []
        for d in drafters:
            for kind in ("strict", "csd"):
                f = c[kind].get(d)
                cells.append(
                    "–" if f is None else f"{f['tokens_per_second']:.1f} tok/s, {f['tokens_per_forward']:.2f}"
                )
        lines.append(
            f"| {workload} | "
            + " | ".join(cells)
            + f" | {c['best_strict'] or '–'} | {c['best_csd'] or '–'} |"
        )
    return "\n".join(lines)


def fact_changes_section(report: dict) -> list[str]:
    facts = report.get("fact_changes") or {}
    if not facts:
        return []
    parts = [
        "",
        "## Rescues that change facts",
        "",
        "Rescues whose kept draft token or replaced target token is a number, a negation or a name "
        "(`service/decoding/fact_guard.py`, on the two tokens' texts), counted over every workload's outputs.",
        "",
        "| method | fact guard | rescues | fact-changing | share | number | negation | name | most frequent |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, f in facts.items():
        examples = ", ".join(f"{e['kept']!r}->{e['replaced']!r} x{e['count']}" for e in f["examples"][:4])
        parts.append(
            f"| {label} | {'on' if f['guarded'] else 'off'} | {f['rescues']} | {f['fact_changing']} | "
            f"{_pct(f['share'])} | {f['by_class']['number']} | {f['by_class']['negation']} | "
            f"{f['by_class']['name']} | {examples or '–'} |"
        )
    guard = report.get("fact_guard")
    if guard:
        w, wo = guard["with"], guard["without"]
        parts += [
            "",
            f"The guard's benefit: {w['fact_changing']} fact-changing rescues in `{w['method']}` "
            f"({_num(w['fact_changing_per_1000_tokens'], '.2f')} per 1000 tokens) against {wo['fact_changing']} in "
            f"`{wo['method']}` ({_num(wo['fact_changing_per_1000_tokens'], '.2f')}). Its cost: "
            f"{_num(w['tokens_per_forward'], '.2f')} vs {_num(wo['tokens_per_forward'], '.2f')} tokens per "
            f"forward ({_num(guard['tokens_per_forward_ratio'], '.3f')}x), {_num(w['tokens_per_second'], '.1f')} vs "
            f"{_num(wo['tokens_per_second'], '.1f')} tok/s ({_num(guard['tokens_per_second_ratio'], '.3f')}x); "
            "all workloads pooled.",
        ]
    return parts


def rescued_section(report: dict) -> list[str]:
    rescued = {label: r for label, r in (report.get("rescued") or {}).items() if r.get("patterns")}
    if not rescued:
        return []
    parts = [
        "",
        "## Most rescued patterns (kept draft token -> the target's choice it replaced)",
        "",
        "Kinds by the two tokens' texts (`bench.metrics.rescue_kind`): the paper's kinds are formatting, "
        "punctuation, spelling and connectives; `word` is another word, a synonym or a change of content (the "
        "texts alone cannot tell those apart).",
        "",
    ]
    for label, r in rescued.items():
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["by_kind"].items(), key=lambda kv: -kv[1]))
        parts.append(
            f"- `{label}` ({r['rescues']} rescues; paper's kinds {_pct(r['paper_kind_share'], 0)}: {kinds}; "
            f"over a special token: {r['turn_rescues']}): "
            + ", ".join(
                f"{p['kept']!r}->{p['replaced']!r} x{p['count']} ({p['kind']})" for p in r["patterns"][:10]
            )
        )
    return parts


def output_facts_section(report: dict) -> list[str]:
    facts = report.get("output_fact_changes") or {}
    if not facts:
        return []
    parts = [
        "",
        "## Facts of vanilla's outputs missing or changed in each method's",
        "",
        "Numbers, dates and names in vanilla's output (`bench.metrics.extract_facts`) that the method's output of "
        "the same prompt lacks, over every workload. Strict columns can differ only at genuine near-ties.",
        "",
        "| method | guarded | vanilla facts | changed | prompts with a change | number | date | name | examples |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, f in facts.items():
        examples = ", ".join(f"{e['vanilla']!r} ({e['prompt_id']})" for e in f["examples"][:4])
        parts.append(
            f"| {label} | {'yes' if f['guarded'] else '–'} | {f['vanilla_facts']} | {f['changed']} | "
            f"{f['changed_prompts']}/{f['prompts']} | {f['by_class']['number']} | {f['by_class']['date']} | "
            f"{f['by_class']['name']} | {examples or '–'} |"
        )
    return parts


def refusals_section(report: dict) -> list[str]:
    """What the guards refused (rescues both gates had passed), per csd column, pooled over workloads."""
    totals: dict[str, dict[str, int]] = {}
    for data in report["workloads"].values():
        for label, row in data["methods"].items():
            for reason, n in (row.get("refused_rescues") or {}).items():
                totals.setdefault(label, {}).setdefault(reason, 0)
                totals[label][reason] += n
    if not totals:
        return []
    parts = [
        "",
        "## Rescues the guards refused (both gates had passed them)",
        "",
        "`turn`: over or with a special token; `fact`: a number, date, negation or name token; `number`: a "
        "digit's joiner or suffix after a digit; `word`: continuing a name or number; `determiner`: one "
        "determiner for another.",
        "",
    ]
    for label, reasons in totals.items():
        rescued = _rescued(report, label) or 0
        parts.append(
            f"- `{label}`: "
            + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1]))
            + f" (against {rescued} rescued)"
        )
    return parts


def markdown(report: dict) -> str:
    meta = report["meta"]
    skipped = (report.get("draft_head") or {}).get("skipped")
    parts = [
        f"# Benchmark {meta['started']}{' (--quick)' if report['config']['quick'] else ''}",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Machine: {meta['machine_line']}",
        "",
        f"Model: {meta['target']} (target, {meta.get('target_dtype', 'float32')}){', ' + meta['draft'] + ' (draft)' if meta.get('draft') else ''}"
        f"{', ' + report['draft_head']['identity'] + ' (draft head)' if (report.get('draft_head') or {}).get('identity') else ''}; "
        f"greedy; max_tokens {report['config']['max_tokens']}; num_speculative_tokens "
        f"{report['config']['num_speculative_tokens']}, lambda {report['config']['lambda_']:g}, tau "
        f"{report['config']['tau']:g}; wall time {meta['wall_seconds']:.0f} s ("
        + ", ".join(f"{k} {v:.0f} s" for k, v in meta.get("phase_seconds", {}).items())
        + ").",
        "",
        main_table(report),
        "",
    ]
    if skipped:
        parts += [f"_Head / combined columns skipped: {skipped}._", ""]
    against_fp32 = fp32_table(report)
    if against_fp32:
        parts += [
            "## Against float32 vanilla",
            "",
            "The target was served in another dtype; `vanilla-fp32` is plain decoding with a float32 copy of it "
            "(its exact / loglik / sim columns above are that dtype's own quality against the serving one).",
            "",
            against_fp32,
            "",
        ]
    parts += [
        COLUMN_HELP,
        "",
        "## Goals (issue 8: CSD with the calibrated OCM, n-gram drafter; issue 11: the trained draft head; "
        "issue 18: the served default on unseen prompts; issue 19: what CSD may change)",
        "",
        'Speed goals are judged on equal work with a 95% bootstrap interval over prompts ("within noise" when '
        'it straddles the threshold); a quality goal of a column that rescued nothing is "not measured". A '
        '"met" should survive a second run of the same command: run it twice before quoting one.',
        "",
        goals_table(report["goals"]),
    ]
    if report["config"]["quick"]:
        parts += [
            "",
            "_A --quick run measures a few prompts per workload: the goals above are indicative only._",
        ]
    if any(g["status"] == "missed" for g in report["goals"]) and report.get("limits"):
        parts += ["", "## What limits the speed", ""] + [f"- {line}" for line in report["limits"]]
    comparison = report.get("drafter_comparison")
    if comparison and any(len(c["strict"]) > 1 for c in comparison.values()):
        parts += [
            "",
            "## Drafters compared (tok/s, tokens per forward; best by tok/s)",
            "",
            comparison_table(comparison),
        ]
    costs = drafter_cost_lines(report)
    if costs:
        parts += ["", "## Drafter cost (profile)", ""] + [f"- {line}" for line in costs]
        if "combined" in report["profile"]["drafter_cost"]:
            parts.append(
                "- (combined: the cost of whichever drafter it picks on the profile's prompt, plus the n-gram "
                "lookup.)"
            )
    if report.get("forward"):
        parts += ["", *forward_markdown(report["forward"])]
    lossless = report.get("lossless")
    if lossless:
        parts += ["", "## Lossless check", ""]
        per_method = ", ".join(
            f"{m} {c['checked'] - c['mismatches']}/{c['checked']}"
            for m, c in lossless.get("methods", {}).items()
        )
        parts.append(
            f"Strict SD vs vanilla on {lossless['checked']} prompt runs"
            + (f" ({per_method})" if per_method else "")
            + ": "
            + ("all identical." if lossless["passed"] else f"{len(lossless['mismatches'])} differ:")
        )
        for m in lossless["mismatches"] + lossless["peer_mismatches"]:
            parts.append(
                f"- {m['method']} on {m['prompt_id']}: first difference at output token {m['position']}: vanilla "
                f"{m['vanilla_text']!r} vs {m['method_text']!r}, teacher-forced logit gap z[vanilla] - z[other] = "
                f"{m['logit_gap']}"
            )
        if lossless["peer_mismatches"]:
            parts.append("(hf-* rows: the peer's own lossless modes, shown for comparison, not a goal.)")
    cal = report.get("calibration")
    if cal:
        parts += ["", "## Calibration (one OCM namespace per drafter)", ""]
        for name, c in cal["drafters"].items():
            parts.append(
                f"- {name}: {c['prompts']} prompts, {c['divergences']} divergences recorded, {c['patterns']} "
                f"distinct patterns, {c['patterns_over_lambda']} seen more than lambda times."
                + (
                    " Most frequent (draft -> target): "
                    + ", ".join(f"{p['draft']!r}->{p['target']!r} x{p['count']}" for p in c["top"][:10])
                    if c.get("top")
                    else ""
                )
            )
        parts.append(f"- {cal['seconds']:.0f} s in all.")
    parts += rescued_section(report)
    parts += fact_changes_section(report)
    parts += output_facts_section(report)
    parts += refusals_section(report)
    sweep = report.get("sweep")
    if sweep:
        parts += ["", *sweep_markdown(sweep)]
    replay = report.get("replay")
    if replay and replay["requests"]:
        reqs = replay["requests"]
        per_pass: dict[int, list[dict]] = {}
        for r in reqs:
            per_pass.setdefault(r["pass"], []).append(r)
        parts += [
            "",
            f"## Online learning ({replay['prompts']} grounded prompts x {replay['passes']} passes, cold OCM)",
            "",
        ]
        parts += ["| pass | kept | rescue | tok/s | patterns at end |", "|---|---|---|---|---|"]
        for number, rs in per_pass.items():
            drafted = [r for r in rs if r["kept_rate"] is not None]
            kept = sum(r["kept_rate"] for r in drafted) / len(drafted) if drafted else None
            resc = sum(r["rescue_rate"] for r in drafted) / len(drafted) if drafted else None
            tps = sum(r["tokens_per_second"] for r in rs) / len(rs)
            parts.append(f"| {number} | {_pct(kept)} | {_pct(resc)} | {tps:.1f} | {rs[-1]['patterns']} |")
    parts += ["", "Plots: " + ", ".join(report.get("plots", [])), ""]
    return "\n".join(parts)


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, ensure_ascii=False, default=str), encoding="utf-8")
