"""The two files a run writes: `report.md` (every table and section in reading order) and `report.json`.

Only the order and the headings live here; the tables, sections and sentences come from their own modules.
"""

from __future__ import annotations

import json
from pathlib import Path

from bench.forward_report import forward_markdown
from bench.reports.findings import drafter_cost_lines
from bench.reports.sections import (
    fact_changes_section,
    output_facts_section,
    refusals_section,
    rescued_section,
)
from bench.reports.tables import COLUMN_HELP, _pct, comparison_table, fp32_table, goals_table, main_table
from bench.sweep import sweep_markdown


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
