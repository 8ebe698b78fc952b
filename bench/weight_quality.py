"""`python -m bench.weight_quality`: what each weight format the engine serves costs in quality, against fp32.

The reference is the fp32 model with the dense weights transformers dequantises from the GGUF file. Each other
format (`bf16`: bf16 weights and body; `int4-bf16` / `int4-fp32`: the file's 4-bit blocks in a bf16 or an fp32
body, and `int4` in the body `--dtype auto` picks on this CPU; all with fp32 logits, as the engine serves them) is scored on prompts no drafter or head was fitted on (the bench's chat and grounded
workloads) and on a text:

- **greedy agreement**: each format decodes every prompt greedily; the share of fp32's tokens it reproduces
  before its first different token (1.0: the same answer), and how many answers are identical;
- **top-1 agreement**: fp32's greedy answer fed to the format (teacher-forced); the share of positions where
  the format's top token is fp32's;
- **perplexity** of the format on a text (the grounded workload's passages, raw, in windows of 512 tokens),
  beside fp32's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

FORMATS = {
    "bf16": {"dtype": "bfloat16", "weights": "dense"},
    "int4": {"dtype": "auto", "weights": "int4"},  # as served: the body `--dtype auto` picks on this CPU
    "int4-bf16": {"dtype": "bfloat16", "weights": "int4"},
    "int4-fp32": {"dtype": "float32", "weights": "int4"},
}
DEFAULT_FORMATS = ("bf16", "int4-bf16", "int4-fp32")
WINDOW = 512


def _load(spec: str, dtype: str, weights: str):
    from service.decoding import load_model

    return load_model(spec, dtype=dtype, weights=weights)


def _greedy(model, ids: list[int], tokens: int, eos: set[int]) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache()
    out: list[int] = []
    feed = ids
    with torch.inference_mode():
        for _ in range(tokens):
            logits = model(input_ids=torch.tensor([feed]), cache=cache, use_cache=True).logits
            token = int(logits[0, -1].float().argmax())
            out.append(token)
            if token in eos:
                break
            feed = [token]
    return out


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def _perplexity(model, ids: list[int]) -> float:
    nll, count = 0.0, 0
    for first in range(0, len(ids) - 1, WINDOW):
        window = ids[first : first + WINDOW + 1]
        if len(window) < 2:
            break
        logprobs = torch.log_softmax(_logits(model, window[:-1]), dim=-1)
        target = torch.tensor(window[1:])
        nll -= float(logprobs.gather(1, target[:, None]).sum())
        count += len(target)
    return math.exp(nll / count)


def run(
    spec: str, formats: list[str], limit: int, tokens: int, text_tokens: int | None = None, log=lambda _: None
) -> dict:
    """`text_tokens`: score perplexity on the text's first this many tokens (default: all of it)."""
    from bench.workloads import load_workload

    started = time.perf_counter()
    reference = _load(spec, "float32", "dense")
    tokenizer = reference.tokenizer
    eos = reference.eos_token_ids()
    prompts = [p for name in ("chat", "grounded") for p in load_workload(name, limit)]
    text = "\n\n".join(p.text.split("\n\n", 1)[-1] for p in load_workload("grounded"))
    text_ids = tokenizer(text)["input_ids"][:text_tokens]
    log(f"fp32 reference: {len(prompts)} prompts, {tokens} tokens each; text of {len(text_ids)} tokens")
    cases = []
    for prompt in prompts:
        ids = prompt.token_ids(tokenizer)
        cases.append((prompt, ids, _greedy(reference.model, ids, tokens, eos)))
    result = {
        "model": reference.identity,
        "prompts": [p.id for p, _, _ in cases],
        "tokens": tokens,
        "text_tokens": len(text_ids),
        "formats": {"fp32": {"perplexity": _perplexity(reference.model, text_ids)}},
    }
    del reference
    for name in formats:
        model = _load(spec, **FORMATS[name])
        log(f"{name}: {str(model.model.dtype).removeprefix('torch.')} body, {model.weights} weights")
        prefix_shares, identical, agree, positions = [], 0, 0, 0
        for _, ids, want in cases:
            got = _greedy(model.model, ids, tokens, eos)
            same = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                min(len(got), len(want)),
            )
            identical += got == want
            prefix_shares.append(same / len(want))
            top = _logits(model.model, ids + want[:-1])[len(ids) - 1 :].argmax(-1)
            agree += int((top == torch.tensor(want)).sum())
            positions += len(want)
        result["formats"][name] = {
            "dtype": str(model.model.dtype).removeprefix("torch."),
            "weights": model.weights,
            "greedy_prefix_share": sum(prefix_shares) / len(prefix_shares),
            "identical_answers": identical,
            "top1_agreement": agree / positions,
            "positions": positions,
            "perplexity": _perplexity(model.model, text_ids),
        }
        del model
    result["wall_seconds"] = time.perf_counter() - started
    return result


def markdown(result: dict) -> list[str]:
    ref = result["formats"]["fp32"]["perplexity"]
    lines = [
        f"{len(result['prompts'])} prompts (bench chat and grounded), {result['tokens']} greedy tokens each; "
        f"perplexity on {result['text_tokens']} tokens of the grounded passages (fp32: {ref:.3f}).",
        "",
        "| format | body | weights | fp32's greedy answer kept (share before the first change) | identical "
        "answers | top-1 agreement (teacher-forced) | perplexity | vs fp32 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    n = len(result["prompts"])
    for name, f in result["formats"].items():
        if name == "fp32":
            continue
        lines.append(
            f"| {name} | {f['dtype']} | {f['weights']} | {f['greedy_prefix_share']:.3f} | "
            f"{f['identical_answers']}/{n} | {f['top1_agreement']:.4f} ({f['positions']} positions) | "
            f"{f['perplexity']:.3f} | {f['perplexity'] / ref - 1:+.2%} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.weight_quality", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument(
        "--formats",
        default=",".join(DEFAULT_FORMATS),
        help=f"comma-separated subset of {','.join(FORMATS)} (default {','.join(DEFAULT_FORMATS)})",
    )
    p.add_argument("--limit", type=int, default=8, help="prompts per workload (chat, grounded)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--out", type=Path, help="output folder (default bench/results/weight-quality-<timestamp>)"
    )
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    if (
        not formats
        or any(f not in FORMATS for f in formats)
        or min(args.limit, args.tokens, args.threads) < 1
    ):
        print(
            f"bench.weight_quality: error: --formats takes {','.join(FORMATS)}; --limit, --tokens and "
            "--threads must be >= 1",
            file=sys.stderr,
        )
        return 2
    from bench.machine import start_run, write_run

    command, machine = start_run("bench.weight_quality", argv, args.threads)
    started = datetime.now()
    result = run(
        args.model,
        formats,
        args.limit,
        args.tokens,
        log=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )
    result.update(command=command, machine_line=machine, started=started.isoformat(timespec="seconds"))
    write_run("weight-quality", args.out, result, markdown(result), started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
