"""The main table: every method on every workload, interleaved per prompt, then scored.

Per prompt the methods run back to back in an order rotated from prompt to prompt, so machine noise (another
process waking up, a thermal change) spreads over all methods instead of landing on one. Each workload gets
fresh OCMs, one per column: `csd-cold` starts empty, every other csd column from its own copy of the
calibrated memory; each learns online from its own rescues only while the workload is served, as the service
would, so no column learns from another and the order of the columns changes nothing.

What cannot flatter a lossy method: every row carries its output length against vanilla's, a speedup on
equal work (per prompt, the time to emit as many tokens as the shorter of the two outputs), QA scored on the
whole answer and on the answer cut at vanilla's length, and per-prompt figures from which the goals draw
bootstrap noise bands.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench import humaneval
from bench.context import Bench
from bench.metrics import (
    PAPER_KINDS,
    Aggregate,
    Mismatch,
    explain_mismatch,
    extract_facts,
    paired_bootstrap_difference,
    rescue_kind,
    wilson_interval,
)
from bench.runners import MethodSpec, RunOutput
from bench.workloads import Prompt, answer_in_output, last_number_is, load_workload, truncate_completion
from service.decoding import Method
from service.decoding.fact_guard import changes_fact, model_special_ids

FACT_CLASSES = ("number", "negation", "name")
OUTPUT_FACT_CLASSES = ("number", "date", "name")

TASK_SCORES = {"qa": "accuracy", "math": "accuracy", "humaneval": "pass@1"}
FP32_VANILLA = "vanilla-fp32"  # the float32 reference column, present where the target is served in bf16


@dataclass
class PromptRun:
    prompt: Prompt
    prompt_ids: list[int]
    outputs: dict[str, RunOutput] = field(default_factory=dict)
    correct: dict[str, bool] = field(default_factory=dict)
    # QA scored on the output cut at vanilla's length (a longer answer has more chances to contain the string)
    correct_cut: dict[str, bool] = field(default_factory=dict)
    similarity: dict[str, float] = field(default_factory=dict)
    loglik: dict[str, float | None] = field(default_factory=dict)


@dataclass
class WorkloadResult:
    name: str
    runs: list[PromptRun]
    rows: dict[str, dict]  # method label -> the report's figures


def rotated(specs: list[MethodSpec], shift: int) -> list[MethodSpec]:
    shift %= len(specs)
    return specs[shift:] + specs[:shift]


def warm_up(bench: Bench, specs: list[MethodSpec], prompt_ids: list[int]) -> None:
    """One short untimed generation per method: first-call costs (allocator, lazy imports) stay out of the
    timings. Runs on throwaway OCMs."""
    engines = bench.engines(specs)
    for spec in specs:
        bench.run(spec, engines, prompt_ids, max_tokens=8)


def run_workload(bench: Bench, name: str, specs: list[MethodSpec], workdir: Path) -> WorkloadResult:
    prompts = load_workload(name, bench.config.limit)
    engines = bench.engines(specs)  # every column with an OCM has its own (calibrated the same way)
    tokenizer = bench.target.tokenizer
    runs = []
    for i, prompt in enumerate(prompts):
        run = PromptRun(prompt, prompt.token_ids(tokenizer))
        for spec in rotated(specs, i):
            bench.progress.set_postfix_str(f"{name} {prompt.id} {spec.label}", refresh=False)
            run.outputs[spec.label] = bench.run(spec, engines, run.prompt_ids)
            bench.progress.update()
        runs.append(run)
    score_quality(bench, name, runs, specs, workdir)
    return WorkloadResult(name, runs, summarise(name, runs, specs))


def score_quality(
    bench: Bench, name: str, runs: list[PromptRun], specs: list[MethodSpec], workdir: Path
) -> None:
    """Task scores, log-likelihood under the target, and similarity to vanilla, for every output."""
    pairs = []
    for run in runs:
        vanilla = run.outputs["vanilla"]
        for spec in specs:
            out = run.outputs[spec.label]
            run.loglik[spec.label] = bench.scorer(run.prompt_ids, out.token_ids)
            pairs.append((vanilla.text, out.text))
            if name == "qa":
                run.correct[spec.label] = answer_in_output(run.prompt.answer or "", out.text)
                cut = bench.target.tokenizer.decode(out.token_ids[: vanilla.tokens], skip_special_tokens=True)
                run.correct_cut[spec.label] = answer_in_output(run.prompt.answer or "", cut)
            elif name == "math":
                run.correct[spec.label] = last_number_is(run.prompt.answer or "", out.text)
    similarities = iter(bench.embedder.similarity(pairs))
    for run in runs:
        for spec in specs:
            run.similarity[spec.label] = next(similarities)
    if name == "humaneval":
        files = {}
        for spec in specs:
            path = workdir / f"humaneval-{spec.label}.jsonl"
            humaneval.write_samples(
                path,
                {r.prompt.id: truncate_completion(r.outputs[spec.label].text) for r in runs},
            )
            files[spec.label] = path
        passed = humaneval.evaluate(list(files.values()), timeout=bench.config.humaneval_timeout)
        for label, path in files.items():
            for run in runs:
                run.correct[label] = passed[path][run.prompt.id]


def equal_work(
    outs: list[RunOutput], references: list[RunOutput]
) -> tuple[list[int], list[float], list[float]]:
    """Per prompt, min(its length, the reference's) tokens, and the seconds each output and its reference
    took to emit that many: speed compared on the same amount of work, whatever the lengths."""
    equal = [min(o.tokens, v.tokens) for o, v in zip(outs, references, strict=True)]
    return (
        equal,
        [o.seconds_to(e) for o, e in zip(outs, equal, strict=True)],
        [v.seconds_to(e) for v, e in zip(references, equal, strict=True)],
    )


def summarise(name: str, runs: list[PromptRun], specs: list[MethodSpec]) -> dict[str, dict]:
    rows: dict[str, dict] = {}
    base = Aggregate()
    for run in runs:
        base.add(run.outputs["vanilla"])
    for spec in specs:
        agg = Aggregate()
        for run in runs:
            agg.add(run.outputs[spec.label])
        n = len(runs)
        logliks = [r.loglik[spec.label] for r in runs if r.loglik[spec.label] is not None]
        outs = [r.outputs[spec.label] for r in runs]
        vanillas = [r.outputs["vanilla"] for r in runs]
        equal, equal_seconds, vanilla_equal_seconds = equal_work(outs, vanillas)
        refused: Counter = Counter()
        for o in outs:
            refused.update(o.refused_rescues)
        row = {
            "prompts": n,
            "tokens": agg.tokens,
            "vanilla_tokens": base.tokens,
            "length_ratio": agg.tokens / base.tokens if base.tokens else None,
            # prompts whose output is more than 5 % longer / shorter than vanilla's
            "longer_prompts": sum(o.tokens > 1.05 * v.tokens for o, v in zip(outs, vanillas, strict=True)),
            "shorter_prompts": sum(o.tokens < 0.95 * v.tokens for o, v in zip(outs, vanillas, strict=True)),
            "equal_work_tokens": sum(equal),
            "equal_work_seconds": sum(equal_seconds),
            "equal_work_speedup": sum(vanilla_equal_seconds) / sum(equal_seconds)
            if sum(equal_seconds)
            else None,
            "per_prompt": {
                "tokens": [o.tokens for o in outs],
                "vanilla_tokens": [v.tokens for v in vanillas],
                "seconds": [o.seconds for o in outs],
                "vanilla_seconds": [v.seconds for v in vanillas],
                "equal_work_seconds": equal_seconds,
                "vanilla_equal_work_seconds": vanilla_equal_seconds,
                "target_forwards": [o.target_forwards for o in outs],
            },
            "refused_rescues": dict(refused),
            "seconds": agg.seconds,
            "tokens_per_second": agg.tokens_per_second,
            "speedup": agg.tokens_per_second / base.tokens_per_second if base.tokens_per_second else None,
            "tokens_per_forward": agg.tokens_per_forward,
            "forwards_per_token": agg.forwards_per_token,
            "target_forwards": agg.target_forwards,
            "acceptance_rate": agg.acceptance_rate,  # strict: accepted / drafted
            "kept_rate": agg.kept_rate,  # (accepted + rescued) / drafted
            "rescue_rate": agg.rescue_rate,
            "draft_tokens": agg.draft_tokens,
            "accepted": agg.accepted,
            "rescued": agg.rescued,
            "ocm_seconds": agg.ocm_seconds if spec.is_ours else None,
            "decode_seconds": agg.decode_seconds if spec.is_ours else None,
            "ocm_share": agg.ocm_share if spec.method is Method.CSD else None,
            "recovered": agg.recovered,
            "exact_match": sum(
                r.outputs[spec.label].token_ids == r.outputs["vanilla"].token_ids for r in runs
            )
            / n
            if n
            else None,
            "loglik_per_token": sum(logliks) / len(logliks) if logliks else None,
            "similarity": sum(r.similarity[spec.label] for r in runs) / n if n else None,
            "task_metric": TASK_SCORES.get(name),
            "task_score": None,
        }
        if FP32_VANILLA in runs[0].outputs:  # served in bf16: the speedup over float32 vanilla too
            _, mine, theirs = equal_work(outs, [r.outputs[FP32_VANILLA] for r in runs])
            row["equal_work_speedup_vs_fp32"] = sum(theirs) / sum(mine) if sum(mine) else None
        if name in TASK_SCORES and n:
            correct = [r.correct[spec.label] for r in runs]
            low, high = wilson_interval(sum(correct), n)
            diff, diff_low, diff_high = paired_bootstrap_difference(
                correct, [r.correct["vanilla"] for r in runs]
            )
            row.update(
                task_score=sum(correct) / n,
                task_correct=sum(correct),
                task_interval=[low, high],
                task_diff_vs_vanilla=diff,
                task_diff_interval=[diff_low, diff_high],
            )
            if runs[0].correct_cut:
                cut = [r.correct_cut[spec.label] for r in runs]
                diff, diff_low, diff_high = paired_bootstrap_difference(
                    cut, [r.correct["vanilla"] for r in runs]
                )
                row.update(
                    task_score_cut=sum(cut) / n,
                    task_diff_cut_vs_vanilla=diff,
                    task_diff_cut_interval=[diff_low, diff_high],
                )
        rows[spec.label] = row
    return rows


def lossless_check(bench: Bench, results: list[WorkloadResult], specs: list[MethodSpec]) -> dict:
    """Our strict SD (every drafter) must reproduce vanilla greedy on every prompt; the peer's lossless modes
    are shown too. `methods` breaks the count down per column (a goal judges the head's on its own)."""
    ours: list[Mismatch] = []
    peer: list[Mismatch] = []
    checked = 0
    per_method: dict[str, dict] = {}
    for result in results:
        for run in result.runs:
            vanilla = run.outputs["vanilla"].token_ids
            for spec in specs:
                if not spec.lossless or spec.label == "vanilla":
                    continue
                mismatch = explain_mismatch(
                    bench.target,
                    run.prompt.id,
                    spec.label,
                    run.prompt_ids,
                    vanilla,
                    run.outputs[spec.label].token_ids,
                )
                if spec.is_ours:
                    checked += 1
                    counts = per_method.setdefault(spec.label, {"checked": 0, "mismatches": 0})
                    counts["checked"] += 1
                    if mismatch:
                        counts["mismatches"] += 1
                        ours.append(mismatch)
                elif mismatch:
                    peer.append(mismatch)
    return {
        "checked": checked,
        "passed": not ours,
        "methods": per_method,
        "mismatches": [m.as_dict() for m in ours],
        "peer_mismatches": [m.as_dict() for m in peer],
    }


def acceptance_histograms(results: list[WorkloadResult], specs: list[MethodSpec]) -> dict[str, dict]:
    """Method -> kept draft tokens per drafted round {kept: rounds}, and the rounds without a draft, pooled over
    every workload (our engine only: the peer does not expose its rounds)."""
    histograms: dict[str, dict] = {}
    for spec in specs:
        if not spec.is_ours or spec.label == "vanilla":
            continue
        total: Counter = Counter()
        undrafted = 0
        for result in results:
            for run in result.runs:
                total.update(run.outputs[spec.label].kept_per_round)
                undrafted += run.outputs[spec.label].undrafted_rounds
        histograms[spec.label] = {
            "drafted_rounds": dict(sorted(total.items())),
            "undrafted_rounds": undrafted,
        }
    return histograms


def _rescues(results: list[WorkloadResult], label: str) -> Counter:
    """(draft token kept, target token it replaced) -> rescues, over every workload's outputs of `label`."""
    counts: Counter = Counter()
    for result in results:
        for run in result.runs:
            if label in run.outputs:
                counts.update(run.outputs[label].rescues)
    return counts


def rescued_examples(
    bench: Bench, results: list[WorkloadResult], specs: list[MethodSpec], n: int = 15
) -> dict[str, dict]:
    """csd column -> its most frequent rescued patterns as text (draft token kept, target token replaced),
    each with its kind (`metrics.rescue_kind`), and the share of all its rescues that are of the paper's kinds
    (formatting, punctuation, spelling, connectives) against other words (synonyms or content changes), and
    the rescues that crossed a special token (the turn guard's concern)."""
    decode = bench.target.tokenizer.decode
    special = model_special_ids(bench.target)
    out: dict[str, dict] = {}
    for spec in specs:
        if spec.method is not Method.CSD:
            continue
        counts = _rescues(results, spec.label)
        kinds: Counter = Counter()
        for (d, t), c in counts.items():
            kinds[rescue_kind(decode([d]), decode([t]))] += c
        total = sum(counts.values())
        paper = sum(kinds[k] for k in PAPER_KINDS)
        out[spec.label] = {
            "rescues": total,
            "by_kind": dict(kinds),
            "paper_kind_share": paper / total if total else None,
            "turn_rescues": sum(c for (d, t), c in counts.items() if d in special or t in special),
            "patterns": [
                {
                    "kept": decode([d]),
                    "replaced": decode([t]),
                    "count": c,
                    "kind": rescue_kind(decode([d]), decode([t])),
                }
                for (d, t), c in counts.most_common(n)
            ],
        }
    return out


def output_fact_changes(results: list[WorkloadResult], specs: list[MethodSpec]) -> dict[str, dict]:
    """Per column: the numbers, dates and names of vanilla's output that are missing or changed in the
    column's output (`metrics.extract_facts`), counted over every workload's prompts, by class, with the
    prompts where any changed and a few examples. A lossless column must show none."""
    out: dict[str, dict] = {}
    for spec in specs:
        if spec.label == "vanilla":
            continue
        by_class: Counter = Counter()
        examples: list[dict] = []
        prompts = changed_prompts = vanilla_facts = 0
        for result in results:
            for run in result.runs:
                if spec.label not in run.outputs:
                    continue
                prompts += 1
                reference = extract_facts(run.outputs["vanilla"].text)
                vanilla_facts += sum(reference.values())
                missing = reference - extract_facts(run.outputs[spec.label].text)
                if missing:
                    changed_prompts += 1
                    for (kind, text), c in missing.items():
                        by_class[kind] += c
                        if len(examples) < 8:
                            examples.append({"prompt_id": run.prompt.id, "class": kind, "vanilla": text})
        out[spec.label] = {
            "guarded": spec.method is Method.CSD and spec.guard_facts,
            "prompts": prompts,
            "vanilla_facts": vanilla_facts,
            "changed": sum(by_class.values()),
            "changed_prompts": changed_prompts,
            "by_class": {k: by_class.get(k, 0) for k in OUTPUT_FACT_CLASSES},
            "examples": examples,
        }
    return out


def fact_changes(bench: Bench, results: list[WorkloadResult], specs: list[MethodSpec]) -> dict[str, dict]:
    """Per column that rescues (csd, and the lossy baseline for reference): how many of its rescues put a
    different number, negation or name in the target's place (`fact_guard.changes_fact` on the two tokens'
    texts), by class, with the most frequent such rescues."""
    decode = bench.target.tokenizer.decode
    out: dict[str, dict] = {}
    for spec in specs:
        if spec.method not in (Method.CSD, Method.LOSSY):
            continue
        counts = _rescues(results, spec.label)
        by_class: Counter = Counter()
        changing: Counter = Counter()
        for (d, t), c in counts.items():
            kind = changes_fact(decode([d]), decode([t]))
            if kind is not None:
                by_class[kind] += c
                changing[(d, t)] += c
        rescues = sum(counts.values())
        fact_changing = sum(by_class.values())
        out[spec.label] = {
            "guarded": spec.method is Method.CSD and spec.guard_facts,
            "rescues": rescues,
            "fact_changing": fact_changing,
            "share": fact_changing / rescues if rescues else None,
            "by_class": {k: by_class.get(k, 0) for k in FACT_CLASSES},
            "examples": [
                {"kept": decode([d]), "replaced": decode([t]), "count": c}
                for (d, t), c in changing.most_common(8)
            ],
        }
    return out
