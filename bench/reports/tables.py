"""The markdown tables: every workload's methods, the speedups over float32 vanilla, the goals, the drafters
compared, and the legend of the main table's columns.

The cell formatters (`_pct`, `_num`) live here and are shared with the sections, so that a figure the run
did not measure reads "–" in every table alike.
"""

from __future__ import annotations

from bench.reports.measured import DRAFTER_COLUMNS


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
