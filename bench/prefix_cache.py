"""Prefix caching: time to first token of later chat turns, and an agent loop's throughput, with / without.

The engine runs in-process (the embedded model unless --model says otherwise), one torch thread, the
server's batch settings (max_batched_tokens 128). Two engines share the model and the drafters; one has a
prefix cache, the other none. Both arms run in one process, interleaved request by request (chat) or
repeat by repeat (agent loop), so a machine shared with other work slows both alike: report the ratios.

- Multi-turn chat: `--conversations` conversations of `--turns` turns; turn t sends the whole history
  (system prompt, every earlier question and the model's own answers) plus a new question, as a chat
  client does. TTFT = the request joining the engine -> its first emitted tokens (prefill and the first
  round). Per turn: median TTFT with the cache, without, and their ratio (goal: turn 5 <= 0.3x).
- Agent loop: `--agents` agents at once in one continuous batch, each `--steps` calls long; every call
  sends one long system prompt with tool definitions, the task, and the earlier calls' answers and tool
  results. Throughput: completion tokens / wall time of the whole loop; also mean TTFT.
- Outputs: at temperature 0 the two arms must emit the same tokens (a mismatch is reported with the
  request it happened in; each arm then keeps its own history).

    python -m bench.prefix_cache                    # ~5 min on a shared 2-core machine
    python -m bench.prefix_cache --quick            # 1 conversation, 2 agents x 3 calls

Writes bench/results/prefix-cache-<timestamp>/ (prefix_cache.json, prefix_cache.md) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from bench.machine import describe, one_line
from ocm_store import InMemoryStore, Namespace
from service.decoding import Engine, NgramDrafter, SamplingParams, SpeculativeConfig, load_model
from service.decoding.batch import DEFAULT_MAX_BATCHED_TOKENS, Batch
from service.decoding.prefix_cache import PrefixCache, default_max_bytes
from service.decoding.text import encode_chat

RESULTS = Path(__file__).resolve().parent / "results"
DATA = Path(__file__).resolve().parent / "data" / "chat.jsonl"

CHAT_SYSTEM = (
    "You are a knowledgeable, patient assistant. Answer clearly and concretely, in a few sentences; use "
    "examples where they help, say so when you are unsure, and keep the conversation's earlier answers in "
    "mind so you do not repeat yourself."
)
FOLLOW_UPS = [
    "Can you give me a concrete example of that?",
    "What is the most common mistake people make here?",
    "How would you explain that to a ten-year-old?",
    "Summarise everything we discussed in two sentences.",
    "What should I read or try next?",
]
TOOLS = [
    {
        "name": "search_orders",
        "description": "Find a customer's orders by email address, optionally filtered by status "
        "(pending, shipped, delivered, returned) and by a date range in ISO format.",
        "parameters": {
            "email": "string, required",
            "status": "string, optional",
            "from": "date, optional",
            "to": "date, optional",
        },
    },
    {
        "name": "get_order",
        "description": "The full record of one order: items, quantities, prices, shipping address, "
        "carrier, tracking number and the history of status changes.",
        "parameters": {"order_id": "string, required"},
    },
    {
        "name": "refund",
        "description": "Refund an order in full or in part. Refunds over 200 euros need a supervisor; "
        "never refund an order that has not been delivered or returned.",
        "parameters": {"order_id": "string, required", "amount": "number, required", "reason": "string"},
    },
    {
        "name": "send_email",
        "description": "Send the customer an email. Use a polite, short message that names the order "
        "and what was done; never include internal notes.",
        "parameters": {"to": "string, required", "subject": "string, required", "body": "string, required"},
    },
    {
        "name": "escalate",
        "description": "Hand the case to a human supervisor with a one-paragraph summary.",
        "parameters": {"summary": "string, required"},
    },
]
AGENT_SYSTEM = (
    "You are the customer-service agent of an online shop. Work step by step. To use a tool, answer with "
    'exactly one line {"tool": NAME, "arguments": {...}} and nothing else; you will get its result in the '
    "next message. When the task is done, answer the customer in plain text.\n\nRules:\n"
    "1. Always look the order up before acting on it.\n2. Never guess an order id or an email address.\n"
    "3. Refunds over 200 euros go to a supervisor.\n4. Keep answers short and polite.\n\nTools:\n"
    + "\n".join(json.dumps(tool) for tool in TOOLS)
)
AGENT_TASKS = [
    "Customer ana@example.com says her blender arrived broken and wants her money back.",
    "Customer li@example.com asks where his order of running shoes is; it is a week late.",
    "Customer sam@example.com wants to return two of the three shirts he ordered last month.",
    "Customer eva@example.com was charged twice for one order and asks for one charge back.",
]
TOOL_RESULT = (
    'Tool result: {"orders": [{"order_id": "A-%d", "status": "delivered", "total": 89.5, '
    '"items": [{"name": "item", "quantity": 1}]}]}'
)


@dataclass
class Arm:
    name: str
    engine: Engine
    ttft: dict[int, list[float]] = field(default_factory=dict)  # chat turn -> TTFTs
    cached: dict[int, list[int]] = field(default_factory=dict)  # chat turn -> cached prompt tokens
    prompt: dict[int, list[int]] = field(default_factory=dict)  # chat turn -> prompt tokens
    agent_runs: list[dict] = field(default_factory=list)


def make_engine(target, cache: PrefixCache | None) -> Engine:
    memory = InMemoryStore().memory(Namespace(target.name, "ngram", "bench"))
    return Engine(target, {"ngram": NgramDrafter()}, {"ngram": memory}, prefix_cache=cache)


def spec(method: str) -> SpeculativeConfig:
    return SpeculativeConfig(method=method)


def run_one(arm: Arm, ids: list[int], args) -> tuple[list[int], str, float, int]:
    """One request alone (a chat client waits for its answer): tokens, text, TTFT, cached tokens."""
    batch = Batch(arm.engine.target, arm.engine.policy, 1, DEFAULT_MAX_BATCHED_TOKENS)
    g = arm.engine.generate(ids, SamplingParams(max_tokens=args.max_tokens), spec(args.method), "ngram")
    started = time.perf_counter()
    batch.add(g)
    ttft = None
    while len(batch):
        for decoding, decoded in batch.step():
            if decoding is g and decoded.tokens and ttft is None:
                ttft = time.perf_counter() - started
        if batch.failed:
            raise batch.failed[0][1]
    return [t.token_id for t in g.tokens], g.text, ttft or 0.0, g.stats.cached_tokens


def chat_bench(arms: list[Arm], tokenizer, args) -> list[str]:
    openers = [json.loads(line)["prompt"] for line in DATA.read_text().splitlines()[: args.conversations]]
    mismatches = []
    for c, opener in enumerate(openers):
        histories = {arm.name: [{"role": "system", "content": CHAT_SYSTEM}] for arm in arms}
        for turn in range(1, args.turns + 1):
            question = opener if turn == 1 else FOLLOW_UPS[(turn - 2) % len(FOLLOW_UPS)]
            outputs = {}
            # alternate which arm goes first: neither always runs on a warmer machine
            for arm in arms if (c + turn) % 2 else arms[::-1]:
                history = histories[arm.name]
                history.append({"role": "user", "content": question})
                ids = encode_chat(tokenizer, history)
                tokens, text, ttft, cached = run_one(arm, ids, args)
                history.append({"role": "assistant", "content": text})
                arm.ttft.setdefault(turn, []).append(ttft)
                arm.cached.setdefault(turn, []).append(cached)
                arm.prompt.setdefault(turn, []).append(len(ids))
                outputs[arm.name] = tokens
            if len({tuple(t) for t in outputs.values()}) > 1:
                mismatches.append(f"conversation {c + 1} turn {turn}")
            print(
                f"  chat {c + 1} turn {turn}: "
                + ", ".join(f"{a.name} {a.ttft[turn][-1] * 1000:.0f} ms" for a in arms),
                file=sys.stderr,
            )
    return mismatches


def agent_loop(arm: Arm, tokenizer, args) -> dict:
    """`args.agents` agents in one continuous batch; each call's answer and a tool result extend its
    history, and its next call joins the batch as soon as the last one finished."""
    batch = Batch(arm.engine.target, arm.engine.policy, args.agents, DEFAULT_MAX_BATCHED_TOKENS)
    sampling = SamplingParams(max_tokens=args.agent_max_tokens)
    histories = [
        [
            {"role": "system", "content": AGENT_SYSTEM},
            {"role": "user", "content": AGENT_TASKS[i % len(AGENT_TASKS)]},
        ]
        for i in range(args.agents)
    ]
    calls_done = [0] * args.agents
    running: dict[int, tuple[object, float]] = {}
    ttfts, tokens, prompt_tokens, cached_tokens, outputs = [], 0, 0, 0, []

    def start(agent: int) -> None:
        g = arm.engine.generate(
            encode_chat(tokenizer, histories[agent]), sampling, spec(args.method), "ngram"
        )
        batch.add(g)
        running[agent] = (g, time.perf_counter())

    started = time.perf_counter()
    for agent in range(args.agents):
        start(agent)
    first_seen: set[int] = set()
    while running:
        for decoding, decoded in batch.step():
            for g, t0 in running.values():
                if decoding is g and decoded.tokens and id(g) not in first_seen:
                    first_seen.add(id(g))
                    ttfts.append(time.perf_counter() - t0)
        if batch.failed:
            raise batch.failed[0][1]
        for agent, (g, _) in list(running.items()):
            if g.finish_reason is None:
                continue
            del running[agent]
            tokens += len(g.tokens)
            prompt_tokens += g.stats.prompt_tokens
            cached_tokens += g.stats.cached_tokens
            outputs.append((agent, calls_done[agent], [t.token_id for t in g.tokens]))
            calls_done[agent] += 1
            histories[agent].append({"role": "assistant", "content": g.text})
            histories[agent].append(
                {"role": "user", "content": TOOL_RESULT % (agent * 100 + calls_done[agent])}
            )
            if calls_done[agent] < args.steps:
                start(agent)
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_mean_s": statistics.mean(ttfts),
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached_tokens,
        "outputs": sorted(outputs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--method", default="sd", help="vanilla | sd | csd | lossy (default sd: lossless)")
    p.add_argument("--conversations", type=int, default=2)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=48, help="per chat answer")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="calls per agent")
    p.add_argument("--agent-max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="agent-loop runs per arm, interleaved")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.quick:
        args.conversations, args.agents, args.steps, args.repeats = 1, 2, 3, 1
    torch.set_num_threads(args.threads)
    info = describe()
    target = load_model(args.model)
    tokenizer = target.tokenizer
    cache = PrefixCache(default_max_bytes(target.device))
    arms = [Arm("no cache", make_engine(target, None)), Arm("cache", make_engine(target, cache))]
    print(f"machine (shared with other work; timings are noisy): {one_line(info)}", file=sys.stderr)

    mismatches = chat_bench(arms, tokenizer, args)
    off, on = arms
    chat_rows = []
    for turn in sorted(on.ttft):
        t_off, t_on = statistics.median(off.ttft[turn]), statistics.median(on.ttft[turn])
        chat_rows.append(
            {
                "turn": turn,
                "prompt_tokens": statistics.median(on.prompt[turn]),
                "cached_tokens": statistics.median(on.cached[turn]),
                "ttft_no_cache_s": t_off,
                "ttft_cache_s": t_on,
                "ratio": t_on / t_off,
            }
        )

    cache.clear()  # the agent loop starts cold: its first calls pay the system prompt once
    for r in range(args.repeats):
        for arm in arms if r % 2 == 0 else arms[::-1]:
            if arm is on:
                cache.clear()
            arm.agent_runs.append(agent_loop(arm, tokenizer, args))
            run = arm.agent_runs[-1]
            print(f"  agent loop {r + 1} {arm.name}: {run['tokens_per_s']:.2f} tok/s", file=sys.stderr)
    for r in range(args.repeats):
        if off.agent_runs[r]["outputs"] != on.agent_runs[r]["outputs"]:
            mismatches.append(f"agent loop run {r + 1}")
    agent = {
        arm.name: {
            key: statistics.median(run[key] for run in arm.agent_runs)
            for key in (
                "wall_s",
                "completion_tokens",
                "tokens_per_s",
                "ttft_mean_s",
                "prompt_tokens",
                "cached_tokens",
            )
        }
        for arm in arms
    }
    speedup = agent["cache"]["tokens_per_s"] / agent["no cache"]["tokens_per_s"]
    ttft_ratio = agent["cache"]["ttft_mean_s"] / agent["no cache"]["ttft_mean_s"]
    last = chat_rows[-1]
    goal = "met" if last["ratio"] <= 0.3 else "missed"

    lines = [
        "# Prefix caching: multi-turn chat and agent loop",
        "",
        f"Machine: {one_line(info)}. Shared with a training job and other work: timings are noisy, both arms "
        "ran interleaved in one process, so compare the ratios.",
        f"Model {args.model}, method {args.method} (ngram drafter), {args.threads} torch thread(s), "
        f"max_batched_tokens {DEFAULT_MAX_BATCHED_TOKENS}, block size {cache.block_size}.",
        "",
        f"## Multi-turn chat ({args.conversations} conversations x {args.turns} turns, answers of up to "
        f"{args.max_tokens} tokens, medians)",
        "",
        "| turn | prompt tokens | cached tokens | TTFT no cache | TTFT cache | ratio |",
        "|---|---|---|---|---|---|",
        *(
            f"| {r['turn']} | {r['prompt_tokens']:.0f} | {r['cached_tokens']:.0f} | "
            f"{r['ttft_no_cache_s'] * 1000:.0f} ms | {r['ttft_cache_s'] * 1000:.0f} ms | {r['ratio']:.2f}x |"
            for r in chat_rows
        ),
        "",
        f"Goal: turn {last['turn']} TTFT <= 0.3x without the cache: **{goal}** ({last['ratio']:.2f}x).",
        "",
        f"## Agent loop ({args.agents} agents at once, {args.steps} calls each, up to {args.agent_max_tokens} "
        f"tokens per call, system prompt + tools {len(encode_chat(tokenizer, [{'role': 'system', 'content': AGENT_SYSTEM}]))} tokens; "
        f"median of {args.repeats} runs per arm)",
        "",
        "| arm | wall | completion tokens | tokens/s | mean TTFT | prompt tokens | cached |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {name} | {a['wall_s']:.1f} s | {a['completion_tokens']:.0f} | {a['tokens_per_s']:.2f} | "
            f"{a['ttft_mean_s'] * 1000:.0f} ms | {a['prompt_tokens']:.0f} | {a['cached_tokens']:.0f} |"
            for name, a in agent.items()
        ),
        "",
        f"Agent-loop throughput with the cache: {speedup:.2f}x; mean TTFT {ttft_ratio:.2f}x.",
        "",
        "Outputs (temperature 0): "
        + (
            "identical in every request of both arms."
            if not mismatches
            else f"DIFFER in {', '.join(mismatches)}."
        ),
        f"Prefix cache at the end: {len(cache)} blocks, {cache.bytes_used / 2**20:.1f} MiB; counters {asdict(cache.stats)}.",
    ]
    report = "\n".join(lines)
    out = args.out or RESULTS / f"prefix-cache-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix_cache.md").write_text(report + "\n")
    for arm in arms:
        for run in arm.agent_runs:
            run.pop("outputs", None)
    result = {
        "machine": info,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "chat": chat_rows,
        "agent": agent,
        "agent_runs": {arm.name: arm.agent_runs for arm in arms},
        "mismatches": mismatches,
    }
    (out / "prefix_cache.json").write_text(json.dumps(result, indent=2))
    print(report)
    print(f"\nwritten to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
