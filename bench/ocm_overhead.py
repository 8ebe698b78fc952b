"""What the Online Correction Memory costs CSD decoding with the shared Redis backend.

Runs CSD generation (embedded model, n-gram drafter, greedy) over prompts from bench/data/grounded.jsonl
with the OCM in Redis, and reports the time spent inside the rescue rule (`ocm_seconds`: record the
divergence pattern, the semantic gate, read the count) as a share of decoding time, per round (one target
forward verifying the draft) and in total. The CSD paper reports 0.01-0.02 %; our goal is under 1 %.

    python -m bench.ocm_overhead                        # starts a throwaway redis-server (AOF on)
    python -m bench.ocm_overhead --redis-url redis://host:6379/0
    python -m bench.ocm_overhead --backend memory       # the in-process store, to compare
    python -m bench.ocm_overhead --torch-threads 1      # on a small shared CPU, one thread is much faster

The counts go to a namespace of their own (drafter "<id>+bench"), so pointing this at a shared Redis never
changes the counts a service uses. The first pass over the prompts teaches the memory (with lambda 6 nothing
is rescued before a pattern was seen 7 times); every pass is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from bench.redis_process import RedisProcess  # noqa: E402
from ocm_store import InMemoryStore, Namespace  # noqa: E402
from ocm_store.redaction import mask_url  # noqa: E402
from ocm_store.redis_store import RedisStore  # noqa: E402
from service.decoding import (  # noqa: E402
    Engine,
    Method,
    NgramDrafter,
    SamplingParams,
    SpeculativeConfig,
    load_model,
    run_alone,
    vocabulary_hash,
)
from service.decoding.text import encode_chat  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "grounded.jsonl"


def load_prompts(n: int) -> list[str]:
    items = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [item["prompt"] for item in items[:n]]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(args: argparse.Namespace, url: str | None) -> dict:
    """url None: the in-process store instead, for comparison."""
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    target = load_model(args.model)
    drafter = NgramDrafter()
    namespace = Namespace(target.identity, f"{drafter.identity}+bench", vocabulary_hash(target.tokenizer))
    if url is None:
        store = InMemoryStore()
    else:
        store = RedisStore(
            url, flush_interval_s=args.flush_interval, refresh_interval_s=args.refresh_interval
        )
    if not store.reachable():
        store.close()
        raise SystemExit(f"ocm_overhead: error: {store.status().detail}")
    store.reset(namespace)  # measure from an empty memory, the same every run
    engine = Engine(target, {"ngram": drafter}, {"ngram": store.memory(namespace)})
    spec = SpeculativeConfig(
        method=Method.CSD,
        num_speculative_tokens=args.num_speculative_tokens,
        lambda_=args.lambda_,
        tau=args.tau,
    )
    sampling = SamplingParams(max_tokens=args.max_tokens)
    inputs = [
        encode_chat(target.tokenizer, [{"role": "user", "content": p}]) for p in load_prompts(args.prompts)
    ]

    ocm_total = decode_total = 0.0
    rounds = rejecting_rounds = rescued = tokens = 0
    round_ocm: list[float] = []  # per round with OCM work: seconds in the rescue rule
    round_share: list[float] = []  # ... and as a share of that round's time
    for pass_ in range(args.passes):
        for i, ids in enumerate(inputs):
            generation = engine.generate(ids, sampling, spec)
            before = 0.0
            for decoded in run_alone(generation):
                round_seconds = generation.stats.decode_seconds - before
                before = generation.stats.decode_seconds
                rounds += 1
                if decoded.round.ocm_seconds > 0 and round_seconds > 0:
                    rejecting_rounds += 1
                    round_ocm.append(decoded.round.ocm_seconds)
                    round_share.append(decoded.round.ocm_seconds / round_seconds)
            stats = generation.stats
            ocm_total += stats.ocm_seconds
            decode_total += stats.decode_seconds
            rescued += stats.num_rescued
            tokens += stats.completion_tokens
            print(
                f"\rpass {pass_ + 1}/{args.passes}, prompt {i + 1}/{len(inputs)}: {tokens} tokens, "
                f"OCM {ocm_total / decode_total:.4%} of decoding so far",
                end="",
                file=sys.stderr,
                flush=True,
            )
    print(file=sys.stderr)
    if isinstance(store, RedisStore):
        store.flush()  # so the background figures below include the last increments
    status = store.status()
    store.close()
    return {
        "backend": store.backend,
        "model": target.identity,
        "torch_threads": torch.get_num_threads(),
        "prompts": len(inputs),
        "passes": args.passes,
        "max_tokens": args.max_tokens,
        "completion_tokens": tokens,
        "rounds": rounds,
        "rounds_with_ocm_work": rejecting_rounds,
        "rescued_tokens": rescued,
        "ocm_seconds": ocm_total,
        "decode_seconds": decode_total,
        "ocm_share_total": ocm_total / decode_total if decode_total else 0.0,
        "ocm_seconds_per_round": ocm_total / rounds if rounds else 0.0,
        "round_seconds_mean": decode_total / rounds if rounds else 0.0,
        "ocm_share_per_round_median": statistics.median(round_share) if round_share else 0.0,
        "ocm_share_per_round_p99": percentile(round_share, 0.99),
        "ocm_share_per_round_max": max(round_share, default=0.0),
        "ocm_seconds_per_rejecting_round_mean": statistics.fmean(round_ocm) if round_ocm else 0.0,
        "background_flushes": status.extra["flushes"],
        "background_flush_seconds": status.extra["flush_seconds_total"],
        "dropped_increments": status.extra["dropped_increments"],
    }


def report(result: dict, command: str, url_shown: str) -> str:
    r = result
    goal = "met" if r["ocm_share_total"] < 0.01 else "NOT met"
    return "\n".join(
        [
            f"OCM overhead with the {r['backend']} backend ({url_shown}); {r['model']}, csd, n-gram drafter, "
            f"greedy, {r['torch_threads']} torch threads",
            f"  {r['prompts']} prompts from bench/data/grounded.jsonl x {r['passes']} passes, max_tokens "
            f"{r['max_tokens']}: {r['completion_tokens']} tokens, {r['rounds']} verification rounds "
            f"({r['rounds_with_ocm_work']} with a rejection), {r['rescued_tokens']} rescued tokens",
            f"  total:    OCM {r['ocm_seconds'] * 1e3:.2f} ms of {r['decode_seconds']:.2f} s decoding = "
            f"{r['ocm_share_total']:.4%} (goal < 1 %: {goal})",
            f"  per round: OCM {r['ocm_seconds_per_round'] * 1e6:.1f} us of a "
            f"{r['round_seconds_mean'] * 1e3:.1f} ms round on average; rounds with a rejection: "
            f"{r['ocm_seconds_per_rejecting_round_mean'] * 1e6:.1f} us, "
            f"share median {r['ocm_share_per_round_median']:.4%}, p99 {r['ocm_share_per_round_p99']:.4%}, "
            f"max {r['ocm_share_per_round_max']:.4%}",
            f"  off the decoding thread: {r['background_flushes']} pipelined flushes, "
            f"{r['background_flush_seconds'] * 1e3:.1f} ms in total; dropped increments: {r['dropped_increments']}",
            f"  reproduce: {command}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ocm_overhead", description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", help="an existing Redis (default: start a throwaway redis-server)")
    parser.add_argument("--backend", choices=["redis", "memory"], default="redis",
                        help="memory: the in-process store, to compare")  # fmt: skip
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--prompts", type=int, default=8, help="how many prompts of grounded.jsonl")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-speculative-tokens", type=int, default=6)
    parser.add_argument("--lambda", dest="lambda_", type=float, default=6.0)
    parser.add_argument("--tau", type=float, default=0.01)
    parser.add_argument("--flush-interval", type=float, default=0.1)
    parser.add_argument("--refresh-interval", type=float, default=0.5)
    parser.add_argument("--torch-threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    # A plain `kill` must still stop the throwaway redis-server (the `with` below only unwinds on exceptions).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    command = (
        f"python -m bench.ocm_overhead --prompts {args.prompts} --passes {args.passes} "
        f"--max-tokens {args.max_tokens} --num-speculative-tokens {args.num_speculative_tokens} "
        f"--lambda {args.lambda_:g} --tau {args.tau:g}"
        + (f" --torch-threads {args.torch_threads}" if args.torch_threads else "")
    )
    if args.backend == "memory":
        command += " --backend memory"
        result = run(args, None)
        shown = "in-process store, for comparison"
    elif args.redis_url:
        shown = mask_url(args.redis_url)
        command += f" --redis-url '{shown}'"
        result = run(args, args.redis_url)
    else:
        with tempfile.TemporaryDirectory(prefix="csd-bench-redis-") as tmp, RedisProcess(Path(tmp)) as server:
            result = run(args, server.url)
        shown = "throwaway redis-server, AOF fsync always"
    print(json.dumps(result) if args.json else report(result, command, shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
