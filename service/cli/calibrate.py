"""`csd calibrate`: warm the OCM by strict speculative decoding over in-domain prompts."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from service.cli.common import CLIError, add_engine_options, build_runtime, settings_from_args
from service.decoding.types import SamplingParams


def add_parser(sub) -> None:
    cal = sub.add_parser(
        "calibrate", help="warm the OCM by strict speculative decoding over in-domain prompts"
    )
    cal.add_argument("--prompts", type=Path, required=True, help="JSON lines or one prompt per line")
    cal.add_argument("--max-tokens", type=int, default=128)
    add_engine_options(cal)
    cal.set_defaults(func=cmd_calibrate)


def read_prompt_file(path: Path) -> Iterator[dict]:
    """JSON lines with "prompt" (chat user message), "messages" or "text" (raw completion); or plain text
    with one prompt per line."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise CLIError(f"cannot read prompts file {str(path)!r}: {exc.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CLIError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            if not any(k in item for k in ("prompt", "messages", "text")):
                raise CLIError(f"{path}:{number}: needs a 'prompt', 'messages' or 'text' field")
            yield item
        else:
            yield {"prompt": line}


def cmd_calibrate(args: argparse.Namespace) -> int:
    items = list(read_prompt_file(args.prompts))
    if not items:
        raise CLIError(f"prompts file {str(args.prompts)!r} holds no prompts")
    settings = settings_from_args(args)
    SamplingParams(max_tokens=args.max_tokens)  # validates the budget before the slow model load
    # Verify every draft in full: calibration is there to record divergences, and the adaptive policy
    # would skip the drafts it expects to lose, which are exactly the ones that teach the memory.
    runtime = build_runtime(args, adaptive_speculation=False)
    from service.calibration import calibrate  # imports torch: only once the arguments are known good

    try:
        namespace = runtime.namespaces[settings.drafter]
        before = runtime.store.status().patterns
        started = time.perf_counter()

        def progress(done) -> None:
            print(
                f"\rcalibrating {done.prompts}/{len(items)}: {done.divergences} divergences recorded",
                end="",
                file=sys.stderr,
                flush=True,
            )

        result = calibrate(
            runtime.engine,
            items,
            drafter=settings.drafter,
            num_speculative_tokens=settings.num_speculative_tokens,
            max_tokens=args.max_tokens,
            on_prompt=progress,
        )
        print(file=sys.stderr)
        runtime.store.close()
        after = runtime.store.status().patterns
        print(
            f"calibrated {result.prompts} prompts in {time.perf_counter() - started:.1f}s: "
            f"{result.divergences} divergences, {after - before} new patterns ({after} in the store) "
            f"for {namespace.key}"
        )
    finally:
        runtime.close()
    return 0
