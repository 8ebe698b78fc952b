"""`csd generate`: one generation from a prompt, its text streamed, then its acceptance statistics."""

from __future__ import annotations

import argparse
import json
import sys

from service.cli.common import CLIError, add_engine_options, build_runtime, settings_from_args
from service.decoding.types import SamplingParams


def add_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a prompt and show acceptance statistics")
    gen.add_argument("prompt", help="the prompt ('-' reads standard input)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--system", help="system message for --chat")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object with tokens and statistics")
    add_engine_options(gen)
    gen.set_defaults(func=cmd_generate)


def _read_prompt(args: argparse.Namespace) -> str:
    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt or not prompt.strip():
        raise CLIError("prompt must not be empty")
    return prompt


def _sampling_from_args(args: argparse.Namespace, settings) -> SamplingParams:
    max_tokens = args.max_tokens if args.max_tokens is not None else settings.default_max_tokens
    if max_tokens > settings.max_tokens_cap:
        raise CLIError(
            f"max tokens {max_tokens} exceeds the cap of {settings.max_tokens_cap} (CSD_MAX_TOKENS_CAP)"
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    settings = settings_from_args(args)
    sampling = _sampling_from_args(args, settings)  # validate before the slow model load
    spec = settings.speculative_config()
    # One generation: only the single-row costs matter, and none when the method does not speculate.
    runtime = build_runtime(
        args, max_batch_size=1, adaptive_speculation=settings.adaptive_speculation and spec.speculates
    )
    from service.decoding import run_alone
    from service.decoding.text import encode_chat, encode_prompt

    try:
        tok = runtime.target.tokenizer
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            ids = encode_chat(tok, messages)
        else:
            ids = encode_prompt(tok, prompt)
        generation = runtime.engine.generate(ids, sampling, spec, drafter=settings.drafter)
        for decoded in run_alone(generation):
            if not args.json and decoded.text:
                sys.stdout.write(decoded.text)
                sys.stdout.flush()
        stats = generation.stats.as_dict()
        if args.json:
            out = {
                "model": runtime.model_id,
                "method": spec.method.value,
                "drafter": settings.drafter if spec.speculates else None,
                "text": generation.text,
                "finish_reason": generation.finish_reason,
                "tokens": [
                    {
                        "id": t.token_id,
                        "text": tok.decode([t.token_id]),
                        "provenance": t.provenance.value,
                        **(
                            {
                                "replaced": t.replaced_token_id,
                                "replaced_text": tok.decode([t.replaced_token_id]),
                            }
                            if t.replaced_token_id is not None
                            else {}
                        ),
                    }
                    for t in generation.tokens
                ],
                "stats": stats,
            }
            print(json.dumps(out, ensure_ascii=False))
        else:
            print()
            print(
                f"[{spec.method.value}] {stats['completion_tokens']} tokens, {stats['tokens_per_second']} tokens/s, "
                f"{stats['tokens_per_forward']} tokens per target forward, "
                f"acceptance {stats['acceptance_rate']:.1%}, rescue {stats['rescue_rate']:.1%} "
                f"(accepted {stats['accepted_tokens']}, rescued {stats['rescued_tokens']}, "
                f"drafted {stats['draft_tokens']}), finish: {generation.finish_reason}",
                file=sys.stderr,
            )
        # The answer is out; a cost measurement that ran out of its start budget finishes now, so the next
        # run finds it in the cache.
        while runtime.refine_costs is not None and runtime.refine_costs():
            pass
    finally:
        runtime.close()
    return 0
