"""The agentic benchmark (issue 34): prompt lookup, the head, combined and the suffix drafter, cold and pooled
from a second replica's earlier traffic, on multi-turn agent loops (bench/agentic_workload.py).

    python -m bench.agentic --threads 1

Every column serves the same conversations in the same order with strict speculative decoding (`sd`,
greedy), so every column's output must equal vanilla's token for token (checked: a mismatch is reported with
the turn it happened in), and each turn's answer is fed back into the next turn's prompt as a client would.
Each column has an engine of its own (its draft policy on the measured forward costs, as `csd serve` runs,
and a prefix cache of its own: a turn's prompt resends the conversation so far), so no column learns from
another's traffic. The suffix drafter's columns:
- `suffix`: a fresh replica serving the workload; its global tree learns from the workload's own earlier
  conversations as it goes (the cold start);
- `suffix-pooled`: replica A serves another set of conversations of the same families (another seed: other
  customers, files and invoices), publishing to a real redis-server (ocm_store/draft_pool.py); then a fresh
  replica B reads the stream back and serves the measured workload. Without redis-server on the PATH the
  column is skipped, never faked.

Figures: tokens per target forward (tokens the rounds decided per forward, vanilla 1.0) and speed (tokens
per second of the whole call, prefill included, and of decoding alone), per column and per family.

`--workload chat` (or grounded, any of bench/workloads.py's chat workloads) serves that workload's prompts
instead, one turn each, through the same columns and checks: the issue's "chat and grounded no worse than
the served default" (`combined`) compared drafter against drafter under the same strict method. Its pooled
column's earlier traffic is the workload's next `--limit` prompts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

GOAL_SUFFIX_OVER_NGRAM = 2.0  # tokens per forward, suffix / prompt lookup
GOAL_SUFFIX_OVER_VANILLA = 2.5  # speed, suffix / vanilla
GOAL_POOLED_OVER_COLD = 1.5  # tokens per forward, a fresh replica pooled / the same replica cold
COLUMNS = ("vanilla", "ngram", "head", "combined", "suffix", "suffix-pooled", "combined-suffix")


@dataclass
class Tally:
    tokens: int = 0
    forwards: int = 0  # decoding rounds (one target forward each)
    seconds: float = 0.0  # whole calls, prefill included
    decode_seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)
    turns: list[tuple[int, str]] = field(default_factory=list)  # (conversation, family) of each turn

    def add(self, tokens: list[int], forwards: int, seconds: float, decode_seconds: float) -> None:
        self.tokens += len(tokens)
        self.forwards += forwards
        self.seconds += seconds
        self.decode_seconds += decode_seconds
        self.outputs.append(tokens)

    def as_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "target_forwards": self.forwards,
            "seconds": round(self.seconds, 3),
            "decode_seconds": round(self.decode_seconds, 3),
            "tokens_per_forward": round(self.tokens / max(self.forwards, 1), 3),
            "tokens_per_second": round(self.tokens / max(self.seconds, 1e-9), 2),
            "decode_tokens_per_second": round(self.tokens / max(self.decode_seconds, 1e-9), 2),
        }


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.agentic", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the figures in docs)")
    p.add_argument("--tools", type=int, default=4, help="tool-using loops (5 turns each)")
    p.add_argument("--code", type=int, default=2, help="code-editing conversations (3 turns each)")
    p.add_argument("--extract", type=int, default=6, help="invoices to extract (1 turn each)")
    p.add_argument("--num-speculative-tokens", type=int, default=16, help="every speculative column's k")
    p.add_argument(
        "--workload",
        default="agentic",
        help="agentic (bench/agentic_workload.py), or a chat workload of bench/workloads.py: grounded, chat, ...",
    )
    p.add_argument("--limit", type=int, default=8, help="prompts of a --workload other than agentic")
    p.add_argument(
        "--max-tokens", type=int, default=128, help="tokens per answer of a --workload other than agentic"
    )
    p.add_argument(
        "--columns", default=",".join(COLUMNS[:-1]), help=f"any of {','.join(COLUMNS)} (vanilla is kept)"
    )
    p.add_argument("--seed", type=int, default=1, help="the measured workload's seed (the pooled replica's "
                   "earlier traffic uses seed + 1000)")  # fmt: skip
    p.add_argument(
        "--out", type=Path, default=None, help="report folder (default bench/results/agentic-<time>)"
    )
    args = p.parse_args(argv)
    columns = [c.strip() for c in args.columns.split(",") if c.strip()]
    if any(c not in COLUMNS for c in columns):
        p.error(f"--columns: expected names from {','.join(COLUMNS)}, got {args.columns!r}")
    args.columns = ["vanilla", *[c for c in columns if c != "vanilla"]]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from bench.machine import start_run, write_run
    from bench.metrics import explain_mismatch

    started = datetime.datetime.now()
    wall = time.monotonic()
    command, machine = start_run("bench.agentic", argv, args.threads)

    from bench.agentic_workload import workload
    from service.decoding import Engine, HeadDrafter, Method, NgramDrafter, load_model
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR
    from service.decoding.draft_policy import DraftPolicy, measure_forward_costs
    from service.decoding.drafters.combined import CombinedDrafter
    from service.decoding.drafters.suffix import SuffixDrafter
    from service.decoding.prefix_cache import PrefixCache

    target = load_model("embedded")
    head = HeadDrafter(target, EMBEDDED_HEAD_DIR)
    k = args.num_speculative_tokens
    costs = measure_forward_costs(target.model, k + 1)
    sizes = {"tools": args.tools, "code": args.code, "extract": args.extract}
    if args.workload == "agentic":
        measured = workload(args.seed, sizes)
        earlier = workload(args.seed + 1000, sizes)
    else:
        measured, earlier = _single_turns(args.workload, args.limit, args.max_tokens)

    def engine(name: str, drafter) -> Engine:
        drafters = {name: drafter} if drafter is not None else {}
        return Engine(target, drafters, policy=DraftPolicy(costs), prefix_cache=PrefixCache(256 << 20))

    def column_engine(column: str) -> tuple[Engine, str]:
        ngram = NgramDrafter()
        if column == "vanilla":
            return engine("ngram", None), "ngram"
        if column == "ngram":
            return engine("ngram", ngram), "ngram"
        if column == "head":
            return engine("head", head), "head"
        if column == "combined":
            return engine("combined", CombinedDrafter(ngram, head)), "combined"
        if column == "combined-suffix":
            lookup = CombinedDrafter(SuffixDrafter(), head, name=column)
            return engine(column, lookup), column
        return engine("suffix", SuffixDrafter()), "suffix"

    results: dict[str, dict] = {}
    per_family: dict[str, dict[str, Tally]] = {}
    tallies: dict[str, Tally] = {}
    notes: list[str] = []

    def serve(eng: Engine, drafter: str, method: Method, conversations, label: str) -> Tally:
        tally, families = Tally(), per_family.setdefault(label, {})
        for index, conv in enumerate(conversations):
            messages = [{"role": "system", "content": conv.system}] if conv.system else []
            for turn, max_tokens in zip(conv.turns, conv.max_tokens, strict=True):
                messages.append({"role": "user", "content": turn})
                ids, tokens, forwards, seconds, decode, text = _generate(
                    eng, drafter, method, messages, max_tokens, k
                )
                messages.append({"role": "assistant", "content": text})
                tally.add(tokens, forwards, seconds, decode)
                tally.prompts.append(ids)
                tally.turns.append((index, conv.family))
                families.setdefault(conv.family, Tally()).add(tokens, forwards, seconds, decode)
        print(f"{label}: {tally.as_dict()}", file=sys.stderr, flush=True)
        return tally

    for column in args.columns:
        if column == "suffix-pooled":
            pooled = _pooled(target, engine, serve, measured, earlier, notes)
            if pooled is None:
                continue
            tally, tallies["replica-a-earlier"] = pooled
        else:
            eng, drafter = column_engine(column)
            method = Method.VANILLA if column == "vanilla" else Method.SD
            tally = serve(eng, drafter, method, measured, column)
        tallies[column] = tally
        results[column] = tally.as_dict()

    vanilla = tallies["vanilla"]
    mismatches = {}
    for column, tally in tallies.items():
        if column == "replica-a-earlier":  # other conversations: nothing to compare with
            continue
        bad = [i for i, (a, b) in enumerate(zip(tally.outputs, vanilla.outputs, strict=True)) if a != b]
        mismatches[column] = bad
        results[column]["turns_differing_from_vanilla"] = len(bad)
        # a turn that differs changes the prompts of its conversation's later turns: the first difference of
        # a turn whose prompt is vanilla's is where strict SD met a near-tie; shown with the logit gap
        # (/work/shared/CSD.md: a k-token forward can differ in the last bits from k one-token forwards)
        for i in bad:
            if tally.prompts[i] == vanilla.prompts[i]:
                m = explain_mismatch(
                    target, f"turn {i}", column, vanilla.prompts[i], vanilla.outputs[i], tally.outputs[i]
                )
                if m is not None:
                    gap = "none (one output ended)" if m.logit_gap is None else f"{m.logit_gap:.4g}"
                    notes.append(
                        f"{column}, turn {i}: first difference at output token {m.position}, vanilla "
                        f"{m.vanilla_text!r} vs {m.method_text!r}, target logit gap {gap}"
                    )
    report = _report(results, per_family, tallies, args, notes)
    result = {
        "command": command,
        "machine_line": machine,
        "wall_seconds": time.monotonic() - wall,
        "num_speculative_tokens": k,
        "turns": len(vanilla.outputs),
        "columns": results,
        "families": {c: {f: t.as_dict() for f, t in fams.items()} for c, fams in per_family.items()},
        "mismatched_turns": mismatches,
        "replica_a_earlier": tallies["replica-a-earlier"].as_dict()
        if "replica-a-earlier" in tallies
        else None,
        "notes": notes,
    }
    out = write_run("agentic", args.out, result, report, started)
    # every turn's prompt and answer (vanilla's; replica A's for the earlier traffic): what
    # `python -m bench.agentic_replay` replays drafters on without the model
    turns = {
        name: [
            {"conversation": c, "family": f, "prompt": p, "output": o}
            for (c, f), p, o in zip(t.turns, t.prompts, t.outputs, strict=True)
        ]
        for name, t in (("measured", vanilla), ("earlier", tallies.get("replica-a-earlier")))
        if t is not None
    }
    (out / "agentic-turns.json").write_text(json.dumps(turns) + "\n", encoding="utf-8")
    return 0


def _single_turns(name: str, limit: int, max_tokens: int):
    """A chat workload of bench/workloads.py as one-turn conversations: the first `limit` prompts measured, the
    next `limit` as the pooled replica's earlier traffic."""
    from bench.agentic_workload import Conversation
    from bench.workloads import load_workload

    prompts = [p for p in load_workload(name, 2 * limit) if p.chat]
    turns = [Conversation(name, None, [p.text], [max_tokens]) for p in prompts]
    return turns[:limit], turns[limit:]


def _generate(engine, drafter: str, method, messages: list[dict], max_tokens: int, k: int):
    from service.decoding import SamplingParams, SpeculativeConfig, run_alone
    from service.decoding.text import encode_chat

    ids = encode_chat(engine.target.tokenizer, messages)
    spec = SpeculativeConfig(method=method, num_speculative_tokens=k, draft_pool="bench")
    started = time.perf_counter()
    generation = engine.generate(ids, SamplingParams(max_tokens=max_tokens), spec, drafter=drafter)
    for _ in run_alone(generation):
        pass
    seconds = time.perf_counter() - started
    tokens = [t.token_id for t in generation.tokens]
    stats = generation.stats
    return ids, tokens, stats.target_forwards, seconds, stats.decode_seconds, generation.text


def _pooled(target, engine, serve, measured, earlier, notes: list[str]):
    """Replica A serves `earlier` into a real Redis stream; a fresh replica B reads it back and serves
    `measured`. None (and a note) without redis-server."""
    import redis

    from bench.redis_process import RedisProcess
    from ocm_store.draft_pool import RedisDraftPool
    from service.decoding import Method
    from service.decoding.drafters.suffix import SuffixDrafter

    if shutil.which("redis-server") is None:
        notes.append("suffix-pooled skipped: no redis-server on the PATH")
        return None
    namespace = f"{target.identity}|bench"
    with tempfile.TemporaryDirectory() as tmp, RedisProcess(Path(tmp) / "redis") as server:

        def replica() -> tuple[SuffixDrafter, RedisDraftPool]:
            drafter = SuffixDrafter()
            client = redis.Redis.from_url(server.url, socket_timeout=5)
            pool = RedisDraftPool(client, namespace, drafter.fold, block_ms=100)
            drafter.pool_sink = pool.start()
            pool.caught_up.wait(30)
            return drafter, pool

        drafter_a, pool_a = replica()
        earlier_tally = serve(engine("suffix", drafter_a), "suffix", Method.SD, earlier, "replica-a-earlier")
        deadline = time.monotonic() + 30
        while (
            pool_a.published + pool_a.dropped < drafter_a.global_trees.outputs("bench")
            and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        pool_a.close()
        drafter_b, pool_b = replica()
        folded = drafter_b.global_trees.outputs("bench")
        notes.append(
            f"suffix-pooled: replica B started with {folded} outputs read back from replica A's stream"
        )
        tally = serve(engine("suffix", drafter_b), "suffix", Method.SD, measured, "suffix-pooled")
        pool_b.close()
    return tally, earlier_tally


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _report(results, per_family, tallies, args, notes) -> list[str]:
    served = (
        f"({args.tools} tool loops x 5 turns, {args.code} code conversations x 3, {args.extract} invoices)"
        if args.workload == "agentic"
        else f"(the {args.workload} workload's first {args.limit} prompts, up to {args.max_tokens} tokens each)"
    )
    lines = [
        f"{len(tallies['vanilla'].outputs)} turns {served}, greedy, strict `sd` with num_speculative_tokens "
        f"{args.num_speculative_tokens} for every speculative column, adaptive draft policy on measured costs.",
        "",
        "| column | tokens / forward | tok/s (whole call) | speedup | decode tok/s | decode speedup | turns != vanilla |",
        "|---|---|---|---|---|---|---|",
    ]
    v = results["vanilla"]
    for column, r in results.items():
        lines.append(
            f"| {column} | {r['tokens_per_forward']:.2f} | {r['tokens_per_second']:.1f} | "
            f"{_ratio(r['tokens_per_second'], v['tokens_per_second']):.2f}x | {r['decode_tokens_per_second']:.1f} | "
            f"{_ratio(r['decode_tokens_per_second'], v['decode_tokens_per_second']):.2f}x | "
            f"{r['turns_differing_from_vanilla']} |"
        )
    families = sorted({f for fams in per_family.values() for f in fams})
    lines += ["", "Tokens per forward by family:", "", "| column | " + " | ".join(families) + " |",
              "|---" * (len(families) + 1) + "|"]  # fmt: skip
    for column, fams in per_family.items():
        cells = [f"{fams[f].tokens / max(fams[f].forwards, 1):.2f}" if f in fams else "" for f in families]
        lines.append(f"| {column} | " + " | ".join(cells) + " |")
    lines += ["", "Goals (issue 34):", ""]
    if args.workload != "agentic":
        for column in ("suffix", "combined-suffix"):
            if column in results and "combined" in results:
                got = _ratio(results[column]["tokens_per_forward"], results["combined"]["tokens_per_forward"])
                speed = _ratio(results[column]["tokens_per_second"], results["combined"]["tokens_per_second"])
                lines.append(
                    f"- {column} on {args.workload}: {got:.2f}x the served default's (combined) tokens per "
                    f"forward, {speed:.2f}x its speed (goal: no worse): {'met' if min(got, speed) >= 1 else 'missed'}"
                )
        lines += [f"- {note}" for note in notes]
        return lines
    if "suffix" in results and "ngram" in results:
        got = _ratio(results["suffix"]["tokens_per_forward"], results["ngram"]["tokens_per_forward"])
        lines.append(
            f"- suffix tokens per forward {got:.2f}x prompt lookup's (goal >= {GOAL_SUFFIX_OVER_NGRAM}x): "
            f"{'met' if got >= GOAL_SUFFIX_OVER_NGRAM else 'missed'}"
        )
    if "suffix" in results:
        whole = _ratio(results["suffix"]["tokens_per_second"], v["tokens_per_second"])
        decode = _ratio(results["suffix"]["decode_tokens_per_second"], v["decode_tokens_per_second"])
        lines.append(
            f"- suffix speed {whole:.2f}x vanilla's whole calls, {decode:.2f}x its decoding (goal >= "
            f"{GOAL_SUFFIX_OVER_VANILLA}x): {'met' if min(whole, decode) >= GOAL_SUFFIX_OVER_VANILLA else 'missed'}"
        )
    if "suffix" in results and "suffix-pooled" in results:
        got = _ratio(results["suffix-pooled"]["tokens_per_forward"], results["suffix"]["tokens_per_forward"])
        lines.append(
            f"- a fresh replica pooled: {got:.2f}x its cold tokens per forward (goal >= {GOAL_POOLED_OVER_COLD}x): "
            f"{'met' if got >= GOAL_POOLED_OVER_COLD else 'missed'}"
        )
    lines += [f"- {note}" for note in notes]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
