"""`python -m bench.forward`: what one target forward costs on the engine's own path, and where its time goes.

The shapes are the ones speculation and batching run: `width` new tokens per row (1 = plain decoding, k + 1 =
a full verification) in `rows` sequences batched, after ~100 tokens of context, in each weight format the
engine serves today:

- `fp32`: `load_model(dtype="float32")`, the linear layers packed for oneDNN (`cpu_kernels`), SDPA attention;
- `bf16`: `load_model(dtype="bfloat16")`, made batch-invariant (`batch_invariant`): matmuls in row blocks of
  2-32, row-aligned eager attention, the final norm and LM head in fp32;
- `int4`: `load_model(weights="int4")` (what `--weights auto` serves for a 4-bit GGUF on the CPU): the linear
  layers' 4-bit groups (`int4_weights`) in the body `--dtype auto` picks; `int4-bf16` the same in bf16's
  batch-invariant body, `int4-fp32` in an fp32 body (row-aligned attention), both with the LM head from the
  GGUF's 8-bit blocks (`q8_head`), the two
  bodies `auto` chooses between by the CPU's native bf16;
- `hf-fp32` / `hf-bf16` (references, not served): the stock transformers model (`nn.Linear`, SDPA) through the
  same cache, to show what the engine's kernels change.

Every forward goes through `BatchKV.forward` as a round of `Batch` runs it: rows prefilled one by one into
their own cache and joined (left padding), logits for every fed position, the fed tokens rolled back with
`keep()` + `settle()` afterwards so every repeat sees the same cache. One row is dense (no mask, the path of a
request served alone); several rows get ragged contexts (100 + 0, 5, -5, 10, ... tokens), so the padding mask,
the position ids and bf16's key alignment run as they do in a real batch.

Per shape: the median wall time of `repeats` forwards (one untimed forward first: oneDNN picks its kernels on
a shape's first call; the repeats go round-robin over the shapes so a burst of load spreads over all of them,
each timed forward right after an untimed one of its own shape),
then a few forwards under `torch.profiler`, whose per-operator self time splits the forward into
- matmul: the weight matmuls (aten::mm / addmm / linear, oneDNN's mkldnn_linear and its layout conversions,
  the _weight_int* kernels of quantised linears);
- attention: every operator inside the model's attention function (SDPA, or the row-aligned gathers, matmuls
  and softmax), found by a `record_function` scope around it (only while profiled);
- other: the rest (norms, RoPE, SiLU, the cache's concatenation, masks, dtype casts);
- host: the median wall time less all operators' self time: Python, module calls, dispatch, allocation. A
  fused decoder runs its layers as one C++ call (`fused_layers`' `DecoderStack`) when timed, and one by one
  under the profiler (the stack is one span it cannot split): its host time is the stack's wall time less the
  per-layer path's operators, so it can read below zero.

The bound beside them: the bytes of weights one forward reads once (every linear layer, the norms, the LM
head; the embedding only by the rows it looks up, left out) over this run's memory read bandwidth (the best
of a few sums over a 512 MiB array, same threads, before and after the forwards). A forward at the bound is memory-bound; far above it, it
is compute- or overhead-bound. bf16 reads its weights once per 32-row block (`weight passes`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from bench.forward_report import forward_markdown

CONTEXT = 100
WIDTHS = (1, 2, 4, 8, 16)
ROWS = (1, 4, 8)
QUICK_WIDTHS = (1, 8)
QUICK_ROWS = (1, 4)
# per row, tokens of context beyond CONTEXT: a batch's rows joined at different lengths (left padding)
ROW_OFFSETS = (0, 5, -5, 10, -10, 3, -3, 8)
REPEATS = 15
QUICK_REPEATS = 3
PROFILE_REPEATS = 3
BANDWIDTH_MIB = 512
ATTENTION_SCOPE = "bench.forward::attention"
FORWARD_SCOPE = "bench.forward::forward"  # the profiled forward, without its rollback
HEAD_SCOPE = "bench.forward::lm_head"
SCOPES = (ATTENTION_SCOPE, FORWARD_SCOPE, HEAD_SCOPE)
# a PackedLinear (mkldnn::_linear_pointwise) and the layout conversions of older packings are matmul
MATMUL_OPS = {
    *("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm"),
    *("aten::_to_dense", "aten::to_dense", "aten::to_mkldnn"),
}
# the project's C++ kernels are no aten operators: their profiler spans stand for them. The fused layers'
# halves (`fused_layers.PROFILE_SCOPES`) count as matmul: their norms, RoPE and SiLU run inside them
MATMUL_MARKERS = (
    "mkldnn",
    "_weight_int",
    "onednn",
    "q8_linear",
    "int4_linear",
    "csd::norm_qkv_rope",
    "csd::output_mlp",
)
FUSED_ATTENTION = "csd::attention"  # the fused layers' C++ attention


@dataclass(frozen=True)
class Format:
    name: str
    dtype: str
    engine: bool  # the engine's own kernels (load_model's defaults), or the stock transformers model
    what: str
    weights: str = "dense"


FORMATS = {
    f.name: f
    for f in (
        Format("fp32", "float32", True, "oneDNN-packed linear layers, SDPA"),
        Format(
            "bf16", "bfloat16", True, "row-blocked bf16 matmuls, row-aligned eager attention, fp32 LM head"
        ),
        Format(
            "int4",
            "auto",
            True,
            "4-bit weights in groups of 32 (the GGUF's Q4_1 blocks) in the body `--dtype auto` picks (as served)",
            weights="int4",
        ),
        Format(
            "int4-bf16",
            "bfloat16",
            True,
            "4-bit weights in groups of 32, bf16 body as bf16's, LM head from the GGUF's 8-bit blocks (fp32 logits)",
            weights="int4",
        ),
        Format(
            "int4-fp32",
            "float32",
            True,
            "4-bit weights in groups of 32, fp32 body: the fused C++ layers (`fused_layers`) where the kernel builds, LM head from the GGUF's 8-bit blocks",
            weights="int4",
        ),
        Format("hf-fp32", "float32", False, "stock transformers: nn.Linear, SDPA (reference)"),
        Format("hf-bf16", "bfloat16", False, "stock transformers: nn.Linear, SDPA (reference)"),
    )
}
DEFAULT_FORMATS = ("fp32", "bf16", "int4-bf16", "int4-fp32", "hf-fp32")
QUICK_FORMATS = ("fp32", "bf16", "int4")


def load_format(spec: str, fmt: Format):
    from service.decoding import load_model

    return load_model(
        spec,
        dtype=fmt.dtype,
        pack_cpu_weights=fmt.engine,
        batch_invariant=fmt.engine,
        weights=fmt.weights if fmt.engine else "dense",
    )


# ---------------------------------------------------------------- bytes and bandwidth


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of weights one forward reads once: {"total", "head"}. Each module's own parameters and buffers
    (packed copies included, each tensor once); embeddings are left out (a forward reads only the rows it
    looks up), and so is an fp32 LM head's tied bf16 `weight`, which its packed copy replaces. An 8-bit head
    (`Q8Head`) counts its packed blocks (weights, scales and weight sums), not the tied fp32 weight."""
    from service.executor.batch_invariant import FP32LogitsHead
    from service.executor.q8_head import Q8Head

    head = model.get_output_embeddings()
    seen: set[int] = set()
    total = head_bytes = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        if isinstance(module, FP32LogitsHead):
            tensors = list(module.packed.buffers())  # counted here, as the head's: its submodule adds 0
        if isinstance(module, Q8Head):
            tensors = list(module.matrix.buffers())  # counted here, as the head's: its submodule adds 0
            seen.add(id(module.weight))
        size = 0
        for tensor in tensors:
            if id(tensor) not in seen:
                seen.add(id(tensor))
                size += tensor.numel() * tensor.element_size()
        total += size
        if module is head:
            head_bytes = size
    return {"total": total, "head": head_bytes}


def memory_bandwidth(mib: int = BANDWIDTH_MIB, repeats: int = 7) -> dict:
    """Bytes per second this process reads and copies (best of `repeats`) on `mib` MiB arrays, far larger
    than any cache: a sum over an fp32 array (read) and a copy of half of it (read + write, both counted)."""
    data = torch.ones(mib * 2**20 // 4)
    half = data[: data.numel() // 2]
    dest = torch.empty_like(half)

    def best(run: Callable[[], object]) -> float:
        fastest = math.inf
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            fastest = min(fastest, time.perf_counter() - started)
        return fastest

    read = data.numel() * 4 / best(data.sum)
    copy = 2 * half.numel() * 4 / best(lambda: dest.copy_(half))
    return {"array_mib": mib, "repeats": repeats, "read_bytes_per_s": read, "copy_bytes_per_s": copy}


# ---------------------------------------------------------------- the forward


class RowBatch:
    """`rows` sequences prefilled one by one and joined into one `BatchKV`, as `Batch` joins requests; each
    `forward(width)` feeds every row its next `width` tokens in one forward and rolls them back."""

    def __init__(self, target, stream: Sequence[int], rows: int, context: int, max_width: int) -> None:
        from service.executor.batch_kv import BatchKV

        self.contexts = [max(1, context + ROW_OFFSETS[b % len(ROW_OFFSETS)]) for b in range(rows)]
        need = max(self.contexts) + max_width
        self.tokens = [[stream[(37 * b + i) % len(stream)] for i in range(need)] for b in range(rows)]
        self.kv = BatchKV(target.model, target.device)
        for b, n in enumerate(self.contexts):
            own = BatchKV(target.model, target.device, rows=1)
            own.forward([self.tokens[b][:n]], logits_to_keep=1)  # prefill: only the cache is wanted
            self.kv.add(own)
        self.width = self.kv.width

    def forward(self, width: int, scoped: bool = False) -> float:
        """Seconds of one forward of `width` tokens a row (logits for all of them, as verification needs);
        `scoped`: inside a profiler scope (FORWARD_SCOPE), which the rollback after it is not."""
        feeds = [row[n : n + width] for row, n in zip(self.tokens, self.contexts, strict=True)]
        started = time.perf_counter()
        if scoped:
            with torch.profiler.record_function(FORWARD_SCOPE):
                self.kv.forward(feeds)
        else:
            self.kv.forward(feeds)
        seconds = time.perf_counter() - started
        for b, n in enumerate(self.contexts):
            self.kv.keep(b, n)
        self.kv.settle()
        assert self.kv.width == self.width, "the rollback must restore the cache"
        return seconds

    def kv_bytes(self) -> int:
        """Bytes of keys and values one forward's attention reads (the cache before it)."""
        return sum(
            layer.keys.numel() * layer.keys.element_size() * 2
            for layer in getattr(self.kv.cache, "layers", [])
        )


@contextmanager
def profiler_scopes(model: torch.nn.Module) -> Iterator[None]:
    """The model's attention function and its LM head wrapped in profiler scopes, so their operators can be
    told apart from the rest: a local override of transformers' attention registry and an instance `forward`
    on the head, both removed on exit."""
    from torch.profiler import record_function
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = model.config._attn_implementation
    registry = ALL_ATTENTION_FUNCTIONS
    had_local = name in registry._local_mapping
    if name in registry:
        original = registry[name]
    else:  # "eager": the model's own module-level function, which get_interface falls back to
        layer = model.get_decoder().layers[0].self_attn
        original = sys.modules[type(layer).__module__].eager_attention_forward

    def scoped(*args, **kwargs):
        with record_function(ATTENTION_SCOPE):
            return original(*args, **kwargs)

    head = model.get_output_embeddings()
    head_forward = head.forward

    def scoped_head(*args, **kwargs):
        with record_function(HEAD_SCOPE):
            return head_forward(*args, **kwargs)

    registry[name] = scoped
    head.forward = scoped_head
    try:
        yield
    finally:
        del head.forward  # the class's forward again
        if had_local:
            registry[name] = original
        else:
            del registry[name]


def category(name: str, in_attention: bool) -> str:
    if in_attention or name == FUSED_ATTENTION:
        return "attention"
    if name in MATMUL_OPS or any(marker in name for marker in MATMUL_MARKERS):
        return "matmul"
    return "other"


def profile_split(run: Callable[[], float], model: torch.nn.Module, repeats: int) -> dict:
    """Operator self time per forward by category (seconds), from `repeats` forwards under the profiler, and
    the heaviest operators."""
    from torch.profiler import ProfilerActivity, profile

    with profiler_scopes(model), profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = sum(run() for _ in range(repeats))
    by_category: Counter = Counter()
    by_op: Counter = Counter()
    head = 0.0  # the LM head's operators (its matmul, and the fp32 head's cast), whatever their category
    for event in prof.events():
        if event.name in SCOPES:  # scopes, not operators: their own time is host
            continue
        scopes = set()
        parent = event.cpu_parent
        while parent is not None:
            scopes.add(parent.name)
            parent = parent.cpu_parent
        if FORWARD_SCOPE not in scopes:  # the rollback between forwards
            continue
        kind = category(event.name, ATTENTION_SCOPE in scopes)
        seconds = event.self_cpu_time_total / 1e6 / repeats
        by_category[kind] += seconds
        by_op[(event.name, kind)] += seconds
        if HEAD_SCOPE in scopes:
            head += seconds
    return {
        "profiled_wall_seconds": wall / repeats,
        "seconds": {k: by_category.get(k, 0.0) for k in ("matmul", "attention", "other")},
        "head_seconds": head,
        "top_ops": [
            {"op": op, "category": kind, "seconds": s} for (op, kind), s in by_op.most_common(8) if s > 0
        ],
    }


def context_stream(tokenizer, n: int = 8) -> list[int]:
    """Token ids of real prompts (the grounded workload's first n), end to end: what the rows read."""
    from bench.workloads import load_workload

    return [t for prompt in load_workload("grounded", n) for t in prompt.token_ids(tokenizer)]


def measure_format(
    target,
    fmt: Format,
    widths: Sequence[int],
    rows: Sequence[int],
    context: int,
    repeats: int,
    profile_repeats: int,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """Every (rows, width) shape of one loaded format: its rows of the table and the format's bytes."""
    weights = weight_bytes(target.model)
    stream = context_stream(target.tokenizer)
    shapes = [(r, w) for r in rows for w in widths]
    samples: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    with torch.inference_mode():
        batches = {r: RowBatch(target, stream, r, context, max(widths)) for r in rows}
        for r, w in shapes:  # untimed: oneDNN picks and caches its kernels on a shape's first call
            batches[r].forward(w)
        for i in range(repeats):
            log(f"{fmt.name}: repeat {i + 1}/{repeats}")
            for r, w in shapes:
                # an untimed forward of the same shape first: a timed one after another shape (the widest
                # before the narrowest in the round) paid for the caches and pages that shape left it, which
                # read width 1 above width 2 (4.8 against 4.3 ms on a Zen 5 EPYC)
                batches[r].forward(w)
                samples[(r, w)].append(batches[r].forward(w))
        out_rows = []
        for r, w in shapes:
            log(f"{fmt.name}: profile rows {r} width {w}")
            split = profile_split(
                lambda r=r, w=w: batches[r].forward(w, scoped=True), target.model, profile_repeats
            )
            wall = statistics.median(samples[(r, w)])
            ops = sum(split["seconds"].values())
            tokens = r * w
            passes = math.ceil(tokens / 32) if fmt.engine and fmt.dtype == "bfloat16" else 1
            out_rows.append(
                {
                    "rows": r,
                    "width": w,
                    "tokens": tokens,
                    "context": batches[r].contexts,
                    "seconds": wall,
                    "min_seconds": min(samples[(r, w)]),
                    "max_seconds": max(samples[(r, w)]),
                    "samples": len(samples[(r, w)]),
                    **{f"{k}_seconds": v for k, v in split["seconds"].items()},
                    "host_seconds": wall - ops,
                    "lm_head_seconds": split["head_seconds"],
                    "profiled_wall_seconds": split["profiled_wall_seconds"],
                    "kv_bytes": batches[r].kv_bytes(),
                    "weight_passes": passes,
                    "top_ops": split["top_ops"],
                }
            )
    width1 = {row["rows"]: row["seconds"] for row in out_rows if row["width"] == 1}
    for row in out_rows:
        row["vs_width_1"] = row["seconds"] / width1[row["rows"]] if row["rows"] in width1 else None
    return {
        "format": fmt.name,
        "what": fmt.what,
        "engine": fmt.engine,
        "dtype": str(target.model.dtype).removeprefix("torch."),
        "attention": target.model.config._attn_implementation,
        "executor": target.executor,
        "weight_bytes": weights["total"],
        "head_bytes": weights["head"],
        "rows": out_rows,
    }


def run_forward_bench(
    model: str = "embedded",
    formats: Sequence[str] = DEFAULT_FORMATS,
    widths: Sequence[int] = WIDTHS,
    rows: Sequence[int] = ROWS,
    context: int = CONTEXT,
    repeats: int = REPEATS,
    profile_repeats: int = PROFILE_REPEATS,
    bandwidth_mib: int = BANDWIDTH_MIB,
    log: Callable[[str], None] = lambda _: None,
) -> dict:
    """The whole measurement, one format loaded at a time (each freed before the next)."""
    from service.executor.cpu_kernels import default_cpu_dtype, has_native_bf16

    started = time.perf_counter()
    log("memory bandwidth")
    before = memory_bandwidth(bandwidth_mib)
    results = []
    for name in formats:
        fmt = FORMATS[name]
        log(f"{name}: loading {model}")
        target = load_format(model, fmt)
        results.append(
            measure_format(
                target,
                fmt,
                widths,
                rows,
                context,
                repeats,
                profile_repeats,
                log,
            )
        )
        del target
    # measured before and after the forwards, the best of both: other work on the machine only slows it
    after = memory_bandwidth(bandwidth_mib)
    bandwidth = {
        **before,
        "read_bytes_per_s": max(before["read_bytes_per_s"], after["read_bytes_per_s"]),
        "copy_bytes_per_s": max(before["copy_bytes_per_s"], after["copy_bytes_per_s"]),
        "read_before_after": [before["read_bytes_per_s"], after["read_bytes_per_s"]],
    }
    for fmt in results:
        fmt["bound_seconds"] = fmt["weight_bytes"] / bandwidth["read_bytes_per_s"]
    return {
        "model": model,
        "served_dtype": str(default_cpu_dtype()).removeprefix("torch."),  # what --dtype auto serves here
        "native_bf16": has_native_bf16(),
        "threads": torch.get_num_threads(),
        "context": context,
        "widths": list(widths),
        "row_counts": list(rows),
        "repeats": repeats,
        "profile_repeats": profile_repeats,
        "bandwidth": bandwidth,
        "formats": results,
        "wall_seconds": time.perf_counter() - started,
    }


def run_section(model: str, quick: bool, log: Callable[[str], None] = lambda _: None) -> dict:
    """The `forward` section of `python -m bench` (the quick grid under --quick), at the bench's threads."""
    if quick:
        return run_forward_bench(
            model, QUICK_FORMATS, QUICK_WIDTHS, QUICK_ROWS, repeats=QUICK_REPEATS, profile_repeats=1, log=log
        )
    return run_forward_bench(model, log=log)


# ---------------------------------------------------------------- command line


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("expected integers >= 1")
    return values


def _formats(text: str) -> tuple[str, ...]:
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown format {unknown[0] if unknown else text!r}; choose from "
                                         f"{','.join(FORMATS)}")  # fmt: skip
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.forward",
        description="Milliseconds per target forward through the engine's path, by width, rows and weight "
        "format, split by the torch profiler, beside the memory-bandwidth bound.",
    )
    p.add_argument(
        "--quick", action="store_true", help="widths 1,8, rows 1,4, fp32, bf16 and int4, 3 repeats"
    )
    p.add_argument(
        "--model", default="embedded", help="target model spec (default: the embedded SmolLM2-135M)"
    )
    p.add_argument("--formats", type=_formats, help=f"comma-separated subset of {','.join(FORMATS)} "
                   f"(default {','.join(DEFAULT_FORMATS)})")  # fmt: skip
    p.add_argument("--widths", type=_ints, help=f"new tokens per row (default {','.join(map(str, WIDTHS))})")
    p.add_argument("--rows", type=_ints, help=f"sequences batched (default {','.join(map(str, ROWS))})")
    p.add_argument("--context", type=int, default=CONTEXT, help="tokens cached per row before the forward")
    p.add_argument("--repeats", type=int, help=f"timed forwards per shape (default {REPEATS}; --quick 3)")
    p.add_argument(
        "--profile-repeats", type=int, help=f"profiled forwards per shape (default {PROFILE_REPEATS})"
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--out", type=Path, help="output folder (default bench/results/forward-<timestamp>)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.threads < 1 or args.context < 1 or (args.repeats or 1) < 1 or (args.profile_repeats or 1) < 1:
        print("bench.forward: error: --threads, --context and the repeats must be >= 1", file=sys.stderr)
        return 2
    from bench.machine import start_run, write_run

    command, machine = start_run("bench.forward", argv, args.threads)
    started = datetime.now()
    result = run_forward_bench(
        args.model,
        args.formats or (QUICK_FORMATS if args.quick else DEFAULT_FORMATS),
        args.widths or (QUICK_WIDTHS if args.quick else WIDTHS),
        args.rows or (QUICK_ROWS if args.quick else ROWS),
        context=args.context,
        repeats=args.repeats or (QUICK_REPEATS if args.quick else REPEATS),
        profile_repeats=args.profile_repeats or (1 if args.quick else PROFILE_REPEATS),
        log=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )
    result.update(
        command=command, machine_line=machine, quick=args.quick, started=started.isoformat(timespec="seconds")
    )
    write_run("forward", args.out, result, forward_markdown(result), started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
