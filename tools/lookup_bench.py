"""Prompt lookup before / after / transformers' peer in one run, interleaved per prompt (a shared machine's
load hits every column alike): tokens per target forward and speed against vanilla.

    PYTHONPATH=. python tools/lookup_bench.py --workloads grounded,chat --limit 12 --max-tokens 96 \
        --jsonl my_prompts.jsonl --threads 1

`sd (before)` is the n-gram drafter as it was (min_n 2), `sd` today's default (min_n 1); both strict and
without the adaptive draft policy, as the bench's `sd` column; `hf-pld` is the bench's own peer runner.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.config import BenchConfig
from bench.machine import describe, one_line
from bench.runners import MethodSpec, run_engine, run_hf
from bench.workloads import Prompt, load_workload
from service.decoding import Engine, Method, NgramDrafter, load_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="embedded")
    p.add_argument("--workloads", default="grounded,chat")
    p.add_argument("--jsonl", action="append", default=[])
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    machine = one_line(describe())
    target = load_model(args.model)
    config = BenchConfig().speculative()
    sd = MethodSpec("sd", "engine", Method.SD, "ngram")
    vanilla = MethodSpec("vanilla", "engine", Method.VANILLA)
    hf_pld = MethodSpec("hf-pld", "hf", hf_mode="prompt_lookup")  # as bench.runners.method_specs builds it
    engines = {
        "vanilla": Engine(target, {"ngram": NgramDrafter()}),
        "sd (before: min_n 2)": Engine(target, {"ngram": NgramDrafter(2, 4)}),
        "sd (after: min_n 1)": Engine(target, {"ngram": NgramDrafter()}),
    }
    prompts = [(w, p) for w in args.workloads.split(",") if w for p in load_workload(w, args.limit)]
    for path in args.jsonl:
        for line in Path(path).read_text().splitlines():
            x = json.loads(line)
            prompts.append((Path(path).stem, Prompt(x["id"], Path(path).stem, x["prompt"])))
    totals: dict[tuple[str, str], list[float]] = {}
    for workload, prompt in prompts:
        ids = prompt.token_ids(target.tokenizer)
        for column, engine in engines.items():
            out = run_engine(engine, vanilla if column == "vanilla" else sd, ids, args.max_tokens, config)
            t = totals.setdefault((workload, column), [0, 0, 0.0])
            t[0] += out.tokens
            t[1] += out.target_forwards
            t[2] += out.seconds
        out = run_hf(target, hf_pld, ids, args.max_tokens, config.num_speculative_tokens)
        t = totals.setdefault((workload, "hf-pld"), [0, 0, 0.0])
        t[0] += out.tokens
        t[1] += out.target_forwards
        t[2] += out.seconds
    print(machine + "; shared machine (timings noisy)")
    print("| workload | column | tokens | tokens per forward | tokens/s | speed vs vanilla |")
    print("|---|---|---|---|---|---|")
    for workload in dict.fromkeys(w for w, _ in totals):
        base = totals[(workload, "vanilla")]
        for (w, column), (tokens, forwards, seconds) in totals.items():
            if w == workload:
                rate = tokens / seconds
                speed = rate / (base[0] / base[2])
                print(f"| {w} | {column} | {tokens} | {tokens / forwards:.2f} | {rate:.1f} | {speed:.2f}x |")


if __name__ == "__main__":
    main()
