"""Online learning as it happens in serving: the grounded suite, shuffled, replayed several times through CSD
with a cold OCM (empty at the start, learning from every request it serves)."""

from __future__ import annotations

import random

from bench.calibration import engine_with_store, namespaces
from bench.context import Bench
from bench.runners import CSD_COLD
from bench.workloads import load_workload
from ocm_store.memory import InMemoryStore


def run_replay(bench: Bench) -> dict:
    config = bench.config
    prompts = load_workload("grounded", config.replay_prompts)
    store = InMemoryStore()
    engine = {"cold": engine_with_store(bench.target, bench.drafters, store)}
    namespace = namespaces(bench.target, bench.drafters)["ngram"]
    rng = random.Random(config.seed)
    requests = []
    totals = {"drafted": 0, "kept": 0, "rescued": 0}
    for epoch in range(config.replay_passes):
        order = list(prompts)
        rng.shuffle(order)
        for prompt in order:
            bench.progress.set_postfix_str(f"replay {epoch + 1} {prompt.id}", refresh=False)
            out = bench.run(CSD_COLD, engine, prompt.token_ids(bench.target.tokenizer))
            bench.progress.update()
            drafted = out.draft_tokens or 0
            totals["drafted"] += drafted
            totals["kept"] += (out.accepted or 0) + (out.rescued or 0)
            totals["rescued"] += out.rescued or 0
            patterns = store.top(namespace, 10**9)
            requests.append(
                {
                    "request": len(requests) + 1,
                    "pass": epoch + 1,
                    "prompt_id": prompt.id,
                    "tokens": out.tokens,
                    "tokens_per_second": out.tokens / out.seconds if out.seconds > 0 else 0.0,
                    "tokens_per_forward": out.tokens / out.target_forwards if out.target_forwards else 0.0,
                    # (accepted + rescued) / drafted: rescues are what the OCM learns to add
                    "kept_rate": ((out.accepted or 0) + (out.rescued or 0)) / drafted if drafted else None,
                    "rescue_rate": (out.rescued or 0) / drafted if drafted else None,
                    # over every request so far: what a dashboard counter would show
                    "cumulative_kept_rate": totals["kept"] / totals["drafted"] if totals["drafted"] else None,
                    "cumulative_rescue_rate": totals["rescued"] / totals["drafted"]
                    if totals["drafted"]
                    else None,
                    "patterns": len(patterns),
                    "patterns_over_lambda": sum(p.count > config.lambda_ for p in patterns),
                }
            )
    return {"prompts": len(prompts), "passes": config.replay_passes, "requests": requests}
