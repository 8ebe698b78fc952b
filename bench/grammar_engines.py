"""Which grammar engine constrains decoding: llguidance vs xgrammar, measured on the served tokenizer.

    python -m bench.grammar_engines [--model embedded] [--repeats 3]   # pip install xgrammar to compare it too

Per engine: the one-off cost of preparing the tokenizer, the cost of compiling each schema, and the cost of
one next-token mask while walking a valid JSON document token by token (what each decoded token pays), plus
what speculation adds: checking a draft position by position and rolling back. Prints the machine line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.machine import describe, one_line
from service.executor.models import load_tokenizer_for_display

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"}},
        "required": ["name", "age"],
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                    "required": ["sku", "qty"],
                },
            },
            "status": {"enum": ["new", "paid", "shipped"]},
        },
        "required": ["id", "items", "status"],
    },
}
DOCUMENTS = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org"},
    "order": {"id": 7, "items": [{"sku": "A-1", "qty": 2}, {"sku": "B-22", "qty": 1}], "status": "paid"},
}


def _time(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def bench_llguidance(tokenizer, vocab: int, repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    started = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
    prepare = time.perf_counter() - started
    out = {"prepare_s": prepare, "schemas": {}}
    bitmask = lltorch.allocate_token_bitmask(8, vocab)
    for name, schema in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(DOCUMENTS[name]), add_special_tokens=False)
        compile_s, masks, spec = [], [], []
        for _ in range(repeats):
            started = time.perf_counter()
            matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(schema))
            compile_s.append(time.perf_counter() - started)
            assert not matcher.is_error(), matcher.get_error()
            for t in tokens:
                masks.append(_time(lambda m=matcher: lltorch.fill_next_token_bitmask(m, bitmask, 0)))
                assert matcher.consume_token(t), matcher.get_error()
            # speculation: 6 positions masked and consumed, then rolled back
            matcher.reset()

            def draft_check(m=matcher, tokens=tokens) -> None:
                for i, t in enumerate(tokens[:6]):
                    lltorch.fill_next_token_bitmask(m, bitmask, i)
                    m.consume_token(t)
                m.rollback(6)

            spec.append(_time(draft_check))
        out["schemas"][name] = {
            "tokens": len(tokens),
            "compile_ms": 1000 * statistics.median(compile_s),
            "mask_ms": 1000 * statistics.median(masks),
            "draft6_ms": 1000 * statistics.median(spec),
        }
    return out


def bench_xgrammar(tokenizer, vocab: int, repeats: int) -> dict:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    prepare = time.perf_counter() - started
    out = {"prepare_s": prepare, "schemas": {}}
    bitmask = xgr.allocate_token_bitmask(8, vocab)
    for name, schema in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(DOCUMENTS[name]), add_special_tokens=False)
        compile_s, masks, spec = [], [], []
        for _ in range(repeats):
            started = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(schema))
            matcher = xgr.GrammarMatcher(compiled)
            compile_s.append(time.perf_counter() - started)
            for t in tokens:
                masks.append(_time(lambda m=matcher: m.fill_next_token_bitmask(bitmask, 0)))
                assert matcher.accept_token(t)
            matcher.reset()

            def draft_check(m=matcher, tokens=tokens) -> None:
                for i, t in enumerate(tokens[:6]):
                    m.fill_next_token_bitmask(bitmask, i)
                    m.accept_token(t)
                m.rollback(6)

            spec.append(_time(draft_check))
        out["schemas"][name] = {
            "tokens": len(tokens),
            "compile_ms": 1000 * statistics.median(compile_s),
            "mask_ms": 1000 * statistics.median(masks),
            "draft6_ms": 1000 * statistics.median(spec),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer_for_display(args.model)
    vocab = len(tokenizer)
    print(one_line(describe()))
    print(f"command: python -m bench.grammar_engines --model {args.model} --repeats {args.repeats}")
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            result = fn(tokenizer, vocab, args.repeats)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        print(f"{name}: tokenizer prepared in {result['prepare_s']:.2f} s")
        for schema, r in result["schemas"].items():
            print(
                f"  {schema:8s} {r['tokens']:3d} tokens  compile {r['compile_ms']:8.2f} ms  "
                f"mask {r['mask_ms']:.3f} ms/token  6-token draft check + rollback {r['draft6_ms']:.3f} ms"
            )


if __name__ == "__main__":
    main()
