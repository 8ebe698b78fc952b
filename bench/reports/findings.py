"""What the run's figures add up to beside the goals: the drafters compared, the fact guard's benefit and
cost, what limits the speed, and each drafter's cost.

`bench.run` stores the first three in the report (so the JSON holds them too); the markdown only shows them.
"""

from __future__ import annotations

from bench.reports.measured import (
    DRAFTER_COLUMNS,
    GOAL_WORKLOAD,
    HEAD_WORKLOAD,
    _head_cost,
    _ratio,
    _row,
    _speed_reason,
    _totals,
)


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
        + f". Verifying a full draft costs {profile['full_draft_cost_ratio']:.2f}x a one-token forward, so a "
        "round must keep that many tokens just to break even.",
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
