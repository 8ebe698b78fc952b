"""The tau / lambda sweep: calibrated CSD at every grid point on the first grounded and QA prompts.

Per prompt, vanilla and every grid point run back to back (order rotated per prompt); each grid point has
its own copy of the calibrated OCM, so points never learn from each other.
"""

from __future__ import annotations

from dataclasses import replace

from bench.calibration import copy_store, engine_with_store
from bench.config import BenchConfig
from bench.context import Bench
from bench.metrics import Aggregate
from bench.runners import CSD, VANILLA, RunOutput
from bench.workloads import Prompt, answer_in_output, load_workload


def sweep_prompts(config: BenchConfig) -> list[Prompt]:
    n = config.sweep_prompts
    return load_workload("grounded", n) + load_workload("qa", n)


def run_sweep(bench: Bench) -> dict:
    config = bench.config
    prompts = sweep_prompts(config)
    grid = [(tau, lam) for tau in config.sweep_taus for lam in config.sweep_lambdas]
    engines = {
        point: {"calibrated": engine_with_store(bench.target, bench.drafters, copy_store(bench.calibrated))}
        for point in grid
    }
    plain = bench.engines()
    outputs: dict[object, list[RunOutput]] = {point: [] for point in grid}
    outputs["vanilla"] = []
    keys: list[object] = ["vanilla", *grid]
    for i, prompt in enumerate(prompts):
        ids = prompt.token_ids(bench.target.tokenizer)
        shift = i % len(keys)
        for key in keys[shift:] + keys[:shift]:
            bench.progress.set_postfix_str(f"sweep {prompt.id} {key}", refresh=False)
            if key == "vanilla":
                outputs[key].append(bench.run(VANILLA, plain, ids))
            else:
                tau, lam = key  # type: ignore[misc]
                spec = replace(bench.speculative, tau=tau, lambda_=lam)
                outputs[key].append(bench.run(CSD, engines[key], ids, speculative=spec))
            bench.progress.update()

    vanilla = outputs["vanilla"]
    base = Aggregate()
    for out in vanilla:
        base.add(out)
    similarity_pairs = [
        (v.text, o.text) for point in grid for v, o in zip(vanilla, outputs[point], strict=True)
    ]
    similarities = iter(bench.embedder.similarity(similarity_pairs))
    points = []
    for tau, lam in grid:
        outs = outputs[(tau, lam)]
        agg = Aggregate()
        for out in outs:
            agg.add(out)
        sims = [next(similarities) for _ in outs]
        qa = [(p, o) for p, o in zip(prompts, outs, strict=True) if p.workload == "qa"]
        points.append(
            {
                "tau": tau,
                "lambda": lam,
                "tokens_per_forward": agg.tokens_per_forward,
                "speedup": agg.tokens_per_second / base.tokens_per_second if base.tokens_per_second else None,
                "acceptance_rate": agg.acceptance_rate,  # strict: accepted / drafted
                "kept_rate": agg.kept_rate,  # (accepted + rescued) / drafted
                "rescue_rate": agg.rescue_rate,
                "exact_match": sum(o.token_ids == v.token_ids for o, v in zip(outs, vanilla, strict=True))
                / len(outs),
                "similarity": sum(sims) / len(sims),
                "qa_accuracy": sum(answer_in_output(p.answer or "", o.text) for p, o in qa) / len(qa)
                if qa
                else None,
            }
        )
    qa_vanilla = [(p, o) for p, o in zip(prompts, vanilla, strict=True) if p.workload == "qa"]
    return {
        "prompts": [p.id for p in prompts],
        "taus": list(config.sweep_taus),
        "lambdas": list(config.sweep_lambdas),
        "vanilla_qa_accuracy": sum(answer_in_output(p.answer or "", o.text) for p, o in qa_vanilla)
        / len(qa_vanilla)
        if qa_vanilla
        else None,
        "points": points,
    }
