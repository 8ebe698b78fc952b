"""Would a longer draft pay? Strict SD at several draft lengths k: tokens per target forward and the speedup
the measured costs predict, for a fixed draft and for the served adaptive policy; wall tok/s beside them, for
what it is worth on a busy machine. The prediction prices every round's forward from the cost table,
c(1 + verified), and adds the drafter's own time, measured call by call (the head's small forward a
position, which the adaptive policy weighs and a fixed length does not): tokens x c(1) / (forwards +
drafting).

    python -m bench.draft_length --k 6,10,16 --workloads grounded --limit 8 --threads 1

Greedy strict SD writes vanilla's tokens whatever k is, so tokens per forward does not depend on load; the
prediction does only through the cost table and drafting times, the wall column wholly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from service.decoding.drafter_registry import DRAFTERS as REGISTRY  # no torch: the CLI checks stay fast

# The registry's drafters this bench can build: it loads the embedded model's head, never a draft model.
DRAFTERS = tuple(entry.name for entry in REGISTRY if entry.needs != "draft_model")


def _lengths(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated draft lengths, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"draft lengths must be >= 1, got {text!r}")
    return values


def _drafters(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or any(n not in DRAFTERS for n in names):
        raise argparse.ArgumentTypeError(f"expected drafters from {','.join(DRAFTERS)}, got {text!r}")
    return names


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class TimedDrafter:
    """A drafter whose proposals are timed (`seconds`): the bench's measure of what drafting cost."""

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.seconds = 0.0

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)

    def rows(self):
        rows, timer = self.drafter.rows(), self

        class Rows:
            def __getattr__(self, name: str):
                return getattr(rows, name)

            def propose(self, asks):
                started = time.perf_counter()
                try:
                    return rows.propose(asks)
                finally:
                    timer.seconds += time.perf_counter() - started

        return Rows()


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from bench.cli import _workloads  # the main bench's workload check: one list of names, one message

    parser = argparse.ArgumentParser(prog="python -m bench.draft_length", description=__doc__.split("\n")[0])
    parser.add_argument("--k", type=_lengths, default="6,10,16", help="comma-separated draft lengths")
    parser.add_argument("--workloads", type=_workloads, default="grounded,chat")
    parser.add_argument("--limit", type=_positive, default=8, help="prompts per workload")
    parser.add_argument("--max-tokens", type=_positive, default=128)
    parser.add_argument(
        "--drafters", type=_drafters, default="combined,ngram", help=f"any of {', '.join(DRAFTERS)}"
    )
    parser.add_argument("--threads", type=_positive, default=1)
    args = parser.parse_args(argv)

    import torch

    from bench.config import BenchConfig
    from bench.machine import describe, one_line
    from bench.workloads import load_workload
    from service.decoding import Engine, Method, SamplingParams, SpeculativeConfig, load_model, run_alone
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR
    from service.decoding.draft_policy import DraftPolicy, measure_forward_costs
    from service.decoding.drafter_registry import DrafterInputs, build_drafters
    from service.decoding.drafters.head import HeadDrafter

    torch.set_num_threads(args.threads)
    ks = args.k
    target = load_model("embedded")
    defaults = BenchConfig()
    head = HeadDrafter(target, EMBEDDED_HEAD_DIR)
    # built as the server builds them, with the service's n-gram settings as the main bench uses them
    drafters = build_drafters(DrafterInputs(target, defaults.ngram_min, defaults.ngram_max, head=head))
    costs = measure_forward_costs(target.model, max(ks) + 1)
    one = costs(1, 1)
    print(f"Machine: {one_line(describe())}; target {target.model.dtype}")
    print(f"Command: python -m bench.draft_length {' '.join(argv if argv is not None else sys.argv[1:])}")
    print(
        "Cost table c(n) / c(1): " + " ".join(f"{n}:{costs(1, n) / one:.3f}" for n in range(1, max(ks) + 2))
    )
    print("| workload | drafter | k | policy | tok/fwd | predicted speedup | wall tok/s |")
    print("|---|---|---|---|---|---|---|")
    for workload in args.workloads:
        prompts = [p.token_ids(target.tokenizer) for p in load_workload(workload, args.limit)]
        for drafter in args.drafters:
            for k in ks:
                for adaptive in (False, True):
                    timed = {name: TimedDrafter(d) for name, d in drafters.items()}
                    engine = Engine(target, timed, policy=DraftPolicy(costs) if adaptive else None)
                    config = SpeculativeConfig(method=Method.SD, num_speculative_tokens=k)
                    tokens = forwards = 0
                    priced = wall = 0.0
                    for ids in prompts:
                        started = time.perf_counter()
                        generation = engine.generate(
                            ids, SamplingParams(max_tokens=args.max_tokens), config, drafter=drafter
                        )
                        for decoded in run_alone(generation):
                            tokens += len(decoded.tokens)
                            forwards += 1
                            priced += costs(1, 1 + decoded.round.num_draft_tokens)
                        wall += time.perf_counter() - started
                    print(
                        f"| {workload} | {drafter} | {k} | {'adaptive' if adaptive else 'fixed'} | "
                        f"{tokens / forwards:.3f} | {tokens * one / (priced + timed[drafter].seconds):.2f}x | "
                        f"{tokens / wall:.1f} |",
                        flush=True,
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
