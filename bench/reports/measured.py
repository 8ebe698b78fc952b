"""The run's measured figures, read out of the report dict the same way by the goals and the findings.

Every figure a goal or a sentence quotes comes through here, so that "the column did not run" (None) and
"the column rescued nothing" are told apart in one place, not in each caller.
"""

from __future__ import annotations

GOAL_WORKLOAD = "grounded"
HEAD_WORKLOAD = "chat"  # where prompt lookup has nothing to copy: the head's reason to exist

# the drafters compared per workload: drafter -> (strict column, csd column)
DRAFTER_COLUMNS = {"ngram": ("sd", "csd"), "head": ("sd-head", "csd-head"), "combined": ("sd-combined", "csd-combined")}  # fmt: skip


def _row(report: dict, workload: str, method: str) -> dict | None:
    return report["workloads"].get(workload, {}).get("methods", {}).get(method)


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
    forward over one token plus the draft tokens the column verified per round on average, and the
    drafted positions of the head that proposed them)."""
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
        f"({forward:.2f}x a one-token one) plus as many drafted positions of the head "
        f"(x {cost['share_of_forward']:.1%}), about "
        f"{round_cost:.2f} one-token forwards' time: about {tpf / round_cost:.2f}x vanilla expected"
    )
