"""`python -m bench`: one command runs every experiment and writes the report.

Phases: calibrate an OCM on the calibration prompts, once per drafter (exactly `csd calibrate`'s code path),
warm up, run every method on every workload interleaved per prompt, check losslessness, sweep tau / lambda
(on held-out calibration prompts),
replay the grounded suite through CSD from a cold OCM, profile the forward and each drafter, then write
bench/results/<timestamp>/ (report.json, report.md, outputs.jsonl, PNG plots) and print the markdown table.

The draft head's columns (sd-head, csd-head, ...) run when the target is the embedded model and the embedded
head's weights exist, or with --draft-head FOLDER; otherwise the report says, in one line, why they were
skipped.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bench.config import BenchConfig, BenchError
from bench.workloads import WORKLOADS

EXIT_USAGE = 2


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _workloads(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown workload {unknown[0] if unknown else text!r}; choose from {','.join(WORKLOADS)}"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Speed, acceptance and quality of CSD against vanilla, strict SD, the lossy baseline and "
        "transformers' prompt-lookup generation.",
    )
    p.add_argument("--quick", action="store_true", help="a few prompts per workload, short outputs (minutes)")
    p.add_argument(
        "--model", default="embedded", help="target model spec (default: the embedded SmolLM2-135M)"
    )
    p.add_argument("--draft-model", help="also run every speculative method with this draft model")
    p.add_argument(
        "--draft-head",
        help="folder of a trained draft head for the head / combined columns (default: the embedded head, "
        "when the target is the embedded model and its weights exist)",
    )
    p.add_argument("--no-draft-head", action="store_true", help="skip the head / combined columns")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--workloads", type=_workloads, help=f"comma-separated subset of {','.join(WORKLOADS)}")
    p.add_argument("--limit", type=int, help="prompts per workload (default: all; --quick: 2)")
    p.add_argument("--max-tokens", type=int, help="tokens per generation (default 128; --quick 32)")
    p.add_argument("--num-speculative-tokens", type=int)
    p.add_argument("--lambda", dest="lambda_", type=float)
    p.add_argument("--tau", type=float)
    p.add_argument("--calibration-prompts", type=int, help="how many calibration prompts (default: all 85)")
    p.add_argument("--calibration-max-tokens", type=int)
    p.add_argument("--sweep-taus", type=_floats, help="comma-separated (default 0.01,0.05,0.1,0.3)")
    p.add_argument("--sweep-lambdas", type=_floats, help="comma-separated (default 2,6,12)")
    p.add_argument(
        "--sweep-prompts",
        type=int,
        help="held-out calibration prompts in the tau / lambda sweep (default 8; 0: no sweep)",
    )
    p.add_argument(
        "--replay-passes", type=int, help="online-learning passes over the grounded suite (0: none)"
    )
    p.add_argument("--replay-prompts", type=int, help="grounded prompts in the online-learning replay")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' own generate")
    p.add_argument(
        "--methods",
        help="comma-separated method columns to run (default: all; vanilla always runs, it is the baseline)",
    )
    p.add_argument(
        "--no-profile", action="store_true", help="skip the forward-cost profile and the forward section"
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--seed", type=int, help="shuffle seed of the replay")
    p.add_argument("--out", type=Path, help="output folder (default: bench/results/<timestamp>)")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    overrides = {
        "model": args.model,
        "draft_model": args.draft_model,
        "draft_head": args.draft_head,
        "workloads": args.workloads,
        "limit": args.limit,
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "lambda_": args.lambda_,
        "tau": args.tau,
        "calibration_prompts": args.calibration_prompts,
        "calibration_max_tokens": args.calibration_max_tokens,
        "sweep_taus": args.sweep_taus,
        "sweep_lambdas": args.sweep_lambdas,
        "sweep_prompts": args.sweep_prompts,
        "replay_passes": args.replay_passes,
        "replay_prompts": args.replay_prompts,
        "threads": args.threads,
        "seed": args.seed,
        "out_dir": args.out,
    }
    overrides = {k: v for k, v in overrides.items() if v is not None}
    config = BenchConfig.quick_preset(**overrides) if args.quick else BenchConfig(**overrides)
    config.peer = not args.no_peer
    if args.methods:
        config.methods = tuple(
            dict.fromkeys(["vanilla", *(m.strip() for m in args.methods.split(",") if m.strip())])
        )
    if args.no_draft_head:
        config.draft_head = None
    elif config.draft_head not in (None, "embedded") and not Path(config.draft_head).is_dir():
        raise BenchError(f"--draft-head {config.draft_head}: no such folder")
    config.extra = {"device": args.device, "dtype": args.dtype, "profile": not args.no_profile}
    for name in ("limit", "max_tokens", "calibration_prompts", "calibration_max_tokens", "threads"):
        value = getattr(config, name)
        if value is not None and value < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("sweep_prompts", "replay_passes", "replay_prompts"):
        value = getattr(config, name)
        if value is not None and value < 0:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 0")
    if not all(0 < t <= 1 for t in config.sweep_taus) or not all(lam >= 0 for lam in config.sweep_lambdas):
        raise BenchError("sweep taus must be in (0, 1] and lambdas >= 0")
    if "grounded" not in config.workloads:
        raise BenchError("the grounded workload is the goals' reference and cannot be left out")
    try:
        config.speculative()  # validates k, tau, lambda
    except ValueError as exc:  # DecodingError
        raise BenchError(str(exc)) from None
    return config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        config = config_from_args(args)  # before the heavy imports: a bad option answers at once
    except BenchError as exc:
        return _fail(exc)
    import transformers

    from bench.reports import drafter_cost_lines, goals_table, main_table
    from bench.run import run_benchmark
    from service.decoding.types import DecodingError

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        report, out_dir = run_benchmark(config, argv)
    except (BenchError, DecodingError) as exc:  # a missing package, a bad model spec, a vocabulary mismatch
        return _fail(exc)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    print()
    print(main_table(report))
    print()
    print(goals_table(report["goals"]))
    print()
    skipped = report["draft_head"]["skipped"]
    for line in ([f"head / combined columns skipped: {skipped}"] if skipped else []) + drafter_cost_lines(
        report
    ):
        print(line)
    print(f"wall time {report['meta']['wall_seconds']:.0f} s; report in {out_dir}")
    return 0


def _fail(exc: Exception) -> int:
    print(f"bench: error: {exc}", file=sys.stderr)
    return EXIT_USAGE
