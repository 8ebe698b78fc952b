"""What limits the speedup: the cost of a target forward by the number of tokens it verifies, the cost of each
drafter's proposal against it, where the decoding time goes, and the heaviest operators over a few rounds
(torch profiler).

Speculation pays when verifying k + 1 tokens costs about as much as one; on a memory-bound GPU it nearly does,
on a compute-bound CPU it may not. These figures say which case this machine is.
"""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from bench.context import Bench
from bench.runners import MethodSpec
from bench.workloads import load_workload
from service.decoding import Method, SamplingParams
from service.decoding.drafters import DraftRow
from service.executor.kv_cache import crop_cache

SD = MethodSpec("sd", "engine", Method.SD, "ngram")


def forward_cost(bench: Bench, prompt_ids: list[int], sizes: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one target forward over n new tokens after a cache holding the prompt."""
    model = bench.target.model
    device = bench.target.device
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt_ids], device=device), cache=cache, logits_to_keep=1)
        base = cache.get_seq_length()
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(repeats):
            for n in sizes:  # interleaved, like the methods
                ids = torch.tensor([prompt_ids[-n:]], device=device)
                started = time.perf_counter()
                model(input_ids=ids, cache=cache).logits.float()
                times[n].append(time.perf_counter() - started)
                crop_cache(cache, base)
    return {n: statistics.median(t) for n, t in times.items()}


def lm_head_cost(bench: Bench, sizes: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of the target's vocabulary projection alone for n rows: the largest single matmul of a
    forward, and the plainest view of how the matmul kernel's cost grows from one row (decoding) to k + 1
    rows (verification). Times the model's own output layer, so whatever kernel serves (oneDNN-packed on
    an fp32 CPU) is what is measured."""
    head = bench.target.model.get_output_embeddings()
    hidden = bench.target.model.config.hidden_size
    device = bench.target.device
    times: dict[int, list[float]] = {n: [] for n in sizes}
    with torch.inference_mode():
        dtype = bench.target.model.dtype  # the serving dtype (bf16 on a CPU that has it)
        rows = {n: torch.randn(1, n, hidden, device=device, dtype=dtype) for n in sizes}
        for _ in range(repeats):
            for n in sizes:
                started = time.perf_counter()
                head(rows[n])
                times[n].append(time.perf_counter() - started)
    return {n: statistics.median(t) for n, t in times.items()}


def drafter_cost(bench: Bench, prompt_ids: list[int], k: int, repeats: int) -> dict[str, dict]:
    """Per drafter: median seconds of one proposal for a single row drafting 1..k tokens, through the drafter's
    own `rows().propose()` (what the batch calls each round), after the target has read the prompt.

    The row's state is warmed by one untimed proposal (the n-gram index, a draft model's cache of the prompt),
    and the same committed tokens are proposed for again each time, so every timed call is a steady-state
    round. Per draft token: a full draft's time over its k tokens (fixed costs included)."""
    model = bench.target.model
    device = bench.target.device
    with torch.inference_mode():
        model(input_ids=torch.tensor([prompt_ids], device=device), logits_to_keep=1)
        latest = bench.target.final_hidden.latest
        assert latest is not None
        hidden = latest[0, -1].clone()  # what the batch hands a head drafter: [hidden]
    sampling = SamplingParams(max_tokens=k)
    costs: dict[str, dict] = {}
    for name, drafter in bench.drafters.items():
        rows = drafter.rows()
        sequence = object()
        rows.prefill(sequence, prompt_ids[:-1])

        def propose(n: int) -> None:
            rows.propose([DraftRow(sequence, prompt_ids, n, sampling, None, hidden)])  # noqa: B023

        propose(k)
        times: dict[int, list[float]] = {n: [] for n in range(1, k + 1)}
        for _ in range(repeats):
            for n in times:
                started = time.perf_counter()
                propose(n)
                times[n].append(time.perf_counter() - started)
        rows.leave(sequence)
        by_tokens = {n: statistics.median(t) for n, t in times.items()}
        costs[name] = {
            "identity": drafter.identity,
            "seconds_by_tokens": {str(n): s for n, s in by_tokens.items()},
            "seconds_per_draft_token": by_tokens[k] / k,
        }
    return costs


def time_in_forward(bench: Bench, prompt_ids: list[int]) -> dict:
    """One sd generation with the target's forward timed by hooks: the share of the decoding rounds' time
    spent inside it (the prefill forward is left out of both)."""
    model = bench.target.model
    calls: list[float] = []
    started: list[float] = []

    def before(*_: object) -> None:
        started.append(time.perf_counter())

    def after(*_: object) -> None:
        calls.append(time.perf_counter() - started.pop())

    handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
    try:
        out = bench.run(SD, bench.engines(), prompt_ids)
    finally:
        for h in handles:
            h.remove()
    rounds = calls[-out.target_forwards :] if out.target_forwards else []
    spent = sum(rounds)
    return {
        "decode_seconds": out.decode_seconds,
        "forward_seconds": spent,
        "forward_share": spent / out.decode_seconds if out.decode_seconds else None,
        "tokens": out.tokens,
        "target_forwards": out.target_forwards,
    }


def top_operators(bench: Bench, prompt_ids: list[int], max_tokens: int, n: int = 10) -> dict:
    """torch profiler over an sd generation: the operators with the most self CPU time, and how much of the
    wall time is spent inside operators at all (the rest is Python: module calls, cache bookkeeping, the loop)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        bench.run(SD, bench.engines(), prompt_ids, max_tokens=max_tokens)
        wall = time.perf_counter() - started
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events) / 1e6
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return {
        "wall_seconds": wall,
        "operator_seconds": total_self,
        "operator_share": total_self / wall if wall else None,
        "top": [{"op": e.key, "calls": e.count, "self_seconds": e.self_cpu_time_total / 1e6} for e in ranked],
    }


def run_profile(bench: Bench) -> dict:
    prompt = load_workload("grounded", 1)[0]
    ids = prompt.token_ids(bench.target.tokenizer)
    k = bench.config.num_speculative_tokens
    sizes = sorted({1, 2, 4, k + 1})
    repeats = 3 if bench.config.quick else 15
    costs = forward_cost(bench, ids, sizes, repeats=repeats)
    drafters = drafter_cost(bench, ids, k, repeats=repeats) if k else {}
    for cost in drafters.values():
        # the line the report prints: a draft token's cost in units of the one-token forward it may save
        cost["share_of_forward"] = cost["seconds_per_draft_token"] / costs[1]
    return {
        "prompt_id": prompt.id,
        "prompt_tokens": len(ids),
        "forward_seconds_by_tokens": {str(n): s for n, s in costs.items()},
        # cost of verifying a full draft relative to one plain round (a one-token forward)
        "full_draft_cost_ratio": costs[k + 1] / costs[1],
        "drafter_cost": drafters,
        "lm_head_seconds_by_tokens": {
            str(n): s for n, s in lm_head_cost(bench, sizes, repeats=3 if bench.config.quick else 15).items()
        },
        "sd_forward_share": time_in_forward(bench, ids),
        "operators": top_operators(bench, ids, max_tokens=min(32, bench.config.max_tokens)),
    }
