"""Replay prompt-lookup strategies on recorded greedy outputs: tokens per target forward without timing.

Strict greedy speculative decoding emits the target's greedy output whatever the drafter proposes, so a
lookup strategy's tokens per forward follows from the prompt and that output alone: per round, propose from
prompt + output so far, keep the longest draft prefix that equals the next output tokens, emit it plus the
target's own token (one forward). This replays any strategy on the same outputs in milliseconds.

    PYTHONPATH=. python tools/lookup_replay.py record --workloads grounded,chat --out /tmp/outputs.json
    PYTHONPATH=. python tools/lookup_replay.py replay /tmp/outputs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

Proposer = Callable[[Sequence[int], int], list[int]]


def hf_prompt_lookup(max_n: int = 2) -> Proposer:
    """transformers' PromptLookupCandidateGenerator.get_candidates: n = max_n..1, the earliest match with a
    continuation, over the whole sequence."""

    def propose(seq: Sequence[int], k: int) -> list[int]:
        length = len(seq)
        for n in range(min(max_n, length - 1), 0, -1):
            suffix = list(seq[length - n :])
            for start in range(0, length - n + 1):
                if list(seq[start : start + n]) == suffix and start + n < length:
                    return list(seq[start + n : min(start + n + k, length)])
        return []

    return propose


def ours(min_n: int, max_n: int) -> Proposer:
    from service.decoding.drafters.ngram import NgramIndex

    def propose(seq: Sequence[int], k: int) -> list[int]:
        # a fresh index per call: slower than the drafter's incremental one, the same proposals
        return NgramIndex(min_n, max_n).propose(seq, k).tokens

    return propose


def replay(
    prompt: list[int], output: list[int], propose: Proposer, k: int, max_tokens: int
) -> tuple[int, int]:
    """(tokens, target forwards); `output` ends with the EOS the target chose, if it chose one."""
    done, forwards = 0, 0
    while done < len(output):
        budget = min(k, max_tokens - done - 1)
        draft = propose(prompt + output[:done], budget)[:budget] if budget > 0 else []
        kept = 0
        while kept < len(draft) and done + kept < len(output) and draft[kept] == output[done + kept]:
            kept += 1
        done += kept + 1
        forwards += 1
    return done, forwards


def record(args: argparse.Namespace) -> None:
    import torch

    from bench.workloads import Prompt, load_workload
    from service.decoding import (
        Engine,
        Method,
        NgramDrafter,
        SamplingParams,
        SpeculativeConfig,
        load_model,
        run_alone,
    )

    torch.set_num_threads(args.threads)
    target = load_model(args.model)
    engine = Engine(target, {"ngram": NgramDrafter()})
    eos = sorted(target.eos_token_ids())
    records = []
    prompts = []
    for name in args.workloads.split(",") if args.workloads else []:
        prompts += [(name, p.id, p.token_ids(target.tokenizer)) for p in load_workload(name, args.limit)]
    for path in args.jsonl or []:
        for line in Path(path).read_text().splitlines():
            x = json.loads(line)
            prompts.append(
                (Path(path).stem, x["id"], Prompt(x["id"], "x", x["prompt"]).token_ids(target.tokenizer))
            )
    for workload, pid, ids in prompts:
        g = engine.generate(
            ids, SamplingParams(max_tokens=args.max_tokens), SpeculativeConfig(method=Method.SD)
        )
        for _ in run_alone(g):
            pass
        out = [t.token_id for t in g.tokens]
        finished_eos = bool(g.stats.num_eos)
        records.append(
            {
                "workload": workload,
                "id": pid,
                "prompt": ids,
                "output": out + ([eos[0]] if finished_eos else []),
            }
        )
        print(workload, pid, len(out), g.finish_reason, file=sys.stderr)
        # written after every prompt: a long recording can be stopped and still replayed
        Path(args.out).write_text(json.dumps({"max_tokens": args.max_tokens, "records": records}))


STRATEGIES: dict[str, Callable[[], Proposer]] = {
    "hf-pld (n=2..1, earliest)": lambda: hf_prompt_lookup(2),
    "n=4..1, earliest (hf-style)": lambda: hf_prompt_lookup(4),
    "ours n=4..2, latest (before: no 1-gram)": lambda: ours(2, 4),
    "ours n=4..1, latest (after)": lambda: ours(1, 4),
    "ours n=2..1, latest": lambda: ours(1, 2),
    "ours n=3..1, latest": lambda: ours(1, 3),
    "ours n=6..1, latest": lambda: ours(1, 6),
    "ours n=8..1, latest": lambda: ours(1, 8),
}


def replay_all(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.outputs).read_text())
    workloads = sorted({r["workload"] for r in data["records"]})
    names = list(STRATEGIES)
    print("| strategy | " + " | ".join(workloads) + " |")
    print("|---|" + "---|" * len(workloads))
    for name in names:
        cells = []
        for w in workloads:
            tokens = forwards = 0
            for r in data["records"]:
                if r["workload"] == w:
                    t, f = replay(r["prompt"], r["output"], STRATEGIES[name](), args.k, data["max_tokens"])
                    tokens += t
                    forwards += f
            cells.append(f"{tokens / forwards:.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("--model", default="embedded")
    r.add_argument("--workloads", default="grounded,chat")
    r.add_argument("--jsonl", action="append", help="extra prompts: one {id, prompt} object a line")
    r.add_argument("--limit", type=int)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--out", required=True)
    s = sub.add_parser("replay")
    s.add_argument("outputs")
    s.add_argument("-k", type=int, default=6, help="num_speculative_tokens")
    args = p.parse_args()
    record(args) if args.command == "record" else replay_all(args)


if __name__ == "__main__":
    main()
