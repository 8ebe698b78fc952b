"""The `csd` parser, one subcommand per module, and `main`: the entry point (`csd`, `python -m service.cli`)."""

from __future__ import annotations

import argparse
import math
import os
import sys

from ocm_store.base import OCMStoreError
from service.cli import calibrate, generate, ocm, serve
from service.cli.common import EXIT_USAGE, LOG_LEVELS, CLIError
from service.decoding.types import DecodingError
from service.executor.threads import prepare_wait_policy
from service.log_format import configure_root


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="csd", description="Calibrated Speculative Decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, calibrate, serve, ocm):  # the order `csd --help` lists them in
        command.add_parser(sub)
    return parser


def _requested_threads(args: argparse.Namespace) -> int | None:
    """--torch-threads, else CSD_TORCH_THREADS where it is a number (Settings validates it later)."""
    if args.torch_threads is not None:
        return args.torch_threads
    try:
        return int(os.environ["CSD_TORCH_THREADS"])
    except (KeyError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    log_level = os.environ.get("CSD_LOG_LEVEL", "WARNING")
    if log_level.lower() not in LOG_LEVELS:
        print(f"csd: error: CSD_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}", file=sys.stderr)
        return EXIT_USAGE
    configure_root(log_level)
    args = build_parser().parse_args(argv)
    if hasattr(args, "torch_threads"):  # a command that runs a model (the others never load torch)
        # before anything loads torch's OpenMP, which reads its wait policy once (service/executor/threads.py)
        prepare_wait_policy(_requested_threads(args))
    if getattr(args, "lambda_", None) is not None and math.isnan(args.lambda_):
        print("csd: error: lambda must be a number >= 0", file=sys.stderr)
        return EXIT_USAGE
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return args.func(args)
    except (CLIError, DecodingError, OCMStoreError) as exc:
        # one line, whatever a library put in the message
        print(f"csd: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
