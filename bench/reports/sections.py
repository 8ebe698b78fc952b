"""The markdown sections on what CSD changed: rescues that change facts, the most rescued patterns, facts
of vanilla's outputs missing in a method's, and the rescues the guards refused.

Each returns its lines, or none when the run measured nothing of it, so the document leaves it out.
"""

from __future__ import annotations

from bench.reports.measured import _rescued
from bench.reports.tables import _num, _pct


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
