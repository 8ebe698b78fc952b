"""Replay the agentic bench's answers through the drafters, without the model: how the draft rule alone does.

    python -m bench.agentic_replay bench/figures/agentic-2026-12-06/agentic-turns.json

Strict speculative decoding emits the target's own answer whatever is drafted, so a drafter's drafts against a
recorded answer tell exactly which tokens a round keeps: per round the drafter proposes up to
`--num-speculative-tokens` tokens for the answer so far, the longest prefix that agrees with the answer is
kept, plus the target's own next token (recovered or bonus). Every draft is verified in full (no draft policy:
this measures the drafter, not the policy's cost cuts), so the tokens per forward here are an upper bound of
what serving keeps. It runs in seconds, so it compares drafter settings (the match-length factor, the prompt
tail a pooled answer carries) that the bench itself, at minutes per column, cannot.

Columns: prompt lookup; the suffix drafter cold (a fresh replica serving the measured turns in order) and
pooled (the same after the earlier traffic's answers, as a second replica's stream would give it); on every
turn and on the first conversation of each family (where a replica starts). Last, the copy bound, cold and
pooled: per round, the longest stretch of the answer ahead (at most k tokens) found anywhere in what the
replica has seen (the turn's prompt, the answer so far, and, with the answer's prompt tail in front, every
earlier answer it served or folded in). No drafter that copies from that text, knowing only the context,
keeps more: it is the ceiling of suffix decoding on these answers, and what pooling could add at most.

`--forward-ms 1:10.2,2:11.1,4:12.5,8:16.5,16:29.3` (a forward's milliseconds by width, e.g. bench.forward's)
adds the rounds as served: the draft policy (service/decoding/draft_policy.py, as Batch._propose and _cap call
it: how far a model drafts, each draft's cap, then what was kept) on that cost table, with each drafter's measured drafting
time, giving tokens per forward under the policy and a modelled speed (the forwards' costs and the drafting,
no prefill). A fixed cost table takes out what moves the bench's own figures from run to run (the table it
measures at start), so drafter settings compare on the same policy decisions.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def replay(drafter, turns: list[dict], k: int) -> tuple[dict[str, list[int]], list[int]]:
    """Serve `turns` in order through `drafter` (one replica): per family [tokens, forwards], and per turn its
    forwards."""
    from service.decoding import SamplingParams
    from service.decoding.drafters import DraftRow

    rows = drafter.rows()
    families: dict[str, list[int]] = {}
    forwards_of: list[int] = []
    for turn in turns:
        sequence, prompt, answer = object(), turn["prompt"], turn["output"]
        position = forwards = 0
        while position < len(answer):
            room = min(k, len(answer) - position - 1)  # a round emits at most k + 1 tokens
            row = DraftRow(
                sequence, prompt + answer[:position], max(room, 1), SamplingParams(), None, None, "p"
            )
            draft = rows.propose([row])[0].tokens[:room] if room > 0 else []
            position += lcp(draft, answer[position:]) + 1
            forwards += 1
        # the sequence leaves with its whole answer (the engine's row list has grown to it by then)
        rows.propose([DraftRow(sequence, prompt + answer, 1, SamplingParams(), None, None, "p")])
        rows.leave(sequence)
        tally = families.setdefault(turn["family"], [0, 0])
        tally[0] += len(answer)
        tally[1] += forwards
        forwards_of.append(forwards)
    return families, forwards_of


def policy_replay(drafter, name: str, turns: list[dict], k: int, policy) -> tuple[int, int, float]:
    """Serve `turns` through `drafter` with `policy` (a DraftPolicy with a cost table) choosing how far to draft
    and what to verify, as the engine's round does: (answer tokens, forwards, modelled seconds: each forward's
    table cost plus the measured drafting time)."""
    from service.decoding import SamplingParams
    from service.decoding.draft_policy import RowAcceptance, RowOffer
    from service.decoding.drafters import DraftRow

    rows = drafter.rows()
    tokens = forwards = 0
    seconds = 0.0
    for turn in turns:
        sequence, prompt, answer = object(), turn["prompt"], turn["output"]
        rows.prefill(sequence, prompt[:-1])  # what the engine's prefill hands every drafter
        own = RowAcceptance()
        position = 0
        while position < len(answer):
            room = min(k, len(answer) - position - 1)
            draft, cap = None, 0
            if room > 0:
                # as Batch._propose: the policy's length bounds a model's drafting (model_tokens); a lookup
                # drafts its budget, and drafting time is learnt from the rounds that paid for some positions
                length, explore = policy.draft_length(name, 1, 1, room)
                context = prompt + answer[:position]
                row = DraftRow(
                    sequence, context, room, SamplingParams(), None, None, "p", model_tokens=length
                )
                started = time.perf_counter()
                draft = rows.propose([row])[0]
                drafting = time.perf_counter() - started
                seconds += drafting
                if length > 0:
                    keys = [draft.key if draft.tokens else None]
                    policy.observe_drafting(name, drafting, keys, min(length, len(draft.tokens)))
                if draft.tokens:
                    offer = RowOffer(name, draft.key, len(draft.tokens), own)
                    cap = len(draft.tokens) if explore else policy.choose_rows([offer], rows=1)[0]
            kept = lcp(draft.tokens[:cap], answer[position:]) if cap else 0
            if cap:
                policy.observe(name, draft.key, cap, kept)
                own.observe(cap, kept)
            seconds += policy.cost(1, 1 + cap)
            forwards += 1
            position += kept + 1
        rows.propose([DraftRow(sequence, prompt + answer, 1, SamplingParams(), None, None, "p")])
        rows.leave(sequence)
        tokens += len(answer)
    return tokens, forwards, seconds


def forward_costs(spec: str):
    """'1:10.2,2:11.1,...' (width: milliseconds) -> ForwardCosts for one row, linear between the widths."""
    from service.decoding.draft_policy import ForwardCosts

    points = sorted((int(w), float(ms) / 1000) for w, ms in (item.split(":") for item in spec.split(",")))
    table = []
    for width in range(1, points[-1][0] + 1):
        below = max((p for p in points if p[0] <= width), default=points[0])
        above = min((p for p in points if p[0] >= width), default=points[-1])
        share = 0.0 if above[0] == below[0] else (width - below[0]) / (above[0] - below[0])
        table.append(below[1] + share * (above[1] - below[1]))
    return ForwardCosts.single_row(table)


def copy_bound(
    turns: list[dict], k: int, earlier: list[dict] | None = None, tail: int = 8
) -> tuple[dict[str, list[int]], list[int]]:
    """`replay`'s figures for an oracle drafter that knows the answer and drafts the longest stretch of it
    ahead that occurs anywhere in the text the replica has seen (module docstring): per family [tokens,
    forwards], and per turn its forwards. `earlier`: answers served before (a pooled replica)."""
    seen: set[tuple[int, ...]] = set()  # every stretch of up to k tokens of the earlier answers

    def index(text: list[int], into: set[tuple[int, ...]]) -> None:
        for start in range(len(text)):
            for end in range(start + 1, min(start + k, len(text)) + 1):
                into.add(tuple(text[start:end]))

    for turn in earlier or []:
        index(turn["prompt"][-tail:] + turn["output"], seen)
    families: dict[str, list[int]] = {}
    forwards_of: list[int] = []
    for turn in turns:
        prompt, answer = turn["prompt"], turn["output"]
        own: set[tuple[int, ...]] = set()
        index(prompt, own)
        position = forwards = 0
        while position < len(answer):
            room = min(k, len(answer) - position - 1)
            found = 0
            while found < room:
                stretch = tuple(answer[position : position + found + 1])
                if stretch not in seen and stretch not in own:
                    break
                found += 1
            kept = found + 1
            # the answer so far joins what the replica has seen (its stretches ending in the kept tokens)
            index_from = max(0, position - k)
            for start in range(index_from, position + kept):
                for end in range(max(start + 1, position + 1), min(start + k, position + kept) + 1):
                    own.add(tuple(answer[start:end]))
            position += kept
            forwards += 1
        tally = families.setdefault(turn["family"], [0, 0])
        tally[0] += len(answer)
        tally[1] += forwards
        forwards_of.append(forwards)
        index(prompt[-tail:] + answer, seen)
    return families, forwards_of


def tpf(tokens: int, forwards: int) -> float:
    return tokens / forwards if forwards else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.agentic_replay", description=__doc__.split("\n\n")[0])
    p.add_argument("turns", type=Path, help="agentic-turns.json of a `python -m bench.agentic` run")
    p.add_argument("--num-speculative-tokens", type=int, default=16)
    p.add_argument("--factors", default="1,4", help="suffix drafter max_spec_factor values to compare")
    p.add_argument("--tails", default="0,8", help="suffix drafter prompt_tail values to compare")
    p.add_argument(
        "--forward-ms",
        default=None,
        help="width:ms,... a forward's cost table: also replay under the draft policy",
    )
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    from bench.machine import start_run
    from service.decoding.drafters.ngram import NgramDrafter
    from service.decoding.drafters.suffix import SuffixDrafter

    data = json.loads(args.turns.read_text(encoding="utf-8"))
    measured, earlier = data["measured"], data.get("earlier") or []
    firsts: dict[str, int] = {}
    for turn in measured:
        firsts.setdefault(turn["family"], turn["conversation"])
    start = [firsts[t["family"]] == t["conversation"] for t in measured]
    answers = [len(t["output"]) for t in measured]
    k = args.num_speculative_tokens

    def row(label: str, make) -> dict:
        families, forwards = replay(make(), measured, k)
        result = {"label": label, "families": families, "forwards": forwards}
        if label.startswith("suffix") and earlier:
            pooled = make()
            replay(pooled, earlier, k)  # replica A's answers, folded in as the stream would
            result["pooled_families"], result["pooled_forwards"] = replay(pooled, measured, k)
        return result

    rows = [row("ngram", NgramDrafter)]
    for factor in (float(f) for f in args.factors.split(",")):
        for tail in (int(t) for t in args.tails.split(",")):
            rows.append(
                row(
                    f"suffix factor {factor:g}, prompt tail {tail}",
                    lambda f=factor, t=tail: SuffixDrafter(max_spec_factor=f, prompt_tail=t),
                )
            )
    families = sorted({t["family"] for t in measured})
    command, machine = start_run("bench.agentic_replay", argv, 1)
    print(f"Command: `{command}`\n\nMachine: {machine}\n")
    print(f"{len(measured)} turns, {len(earlier)} earlier turns, k = {k}, every draft verified in full\n")
    print(
        "| drafter | tokens / forward | "
        + " | ".join(families)
        + " | start (first conversation per family) |"
    )
    print("|---" * (len(families) + 3) + "|")

    def line(label: str, fams: dict, forwards: list[int]) -> None:
        tokens = sum(v[0] for v in fams.values())
        total = sum(v[1] for v in fams.values())
        s_tokens = sum(a for a, s in zip(answers, start, strict=True) if s)
        s_forwards = sum(f for f, s in zip(forwards, start, strict=True) if s)
        cells = [f"{tpf(*fams[f]):.2f}" for f in families]
        print(
            f"| {label} | {tpf(tokens, total):.2f} | "
            + " | ".join(cells)
            + f" | {tpf(s_tokens, s_forwards):.2f} |"
        )

    for r in rows:
        line(r["label"] + (" (cold)" if "pooled_families" in r else ""), r["families"], r["forwards"])
        if "pooled_families" in r:
            line(r["label"] + " (pooled)", r["pooled_families"], r["pooled_forwards"])
    line("copy bound (cold)", *copy_bound(measured, k))
    if earlier:
        line("copy bound (pooled)", *copy_bound(measured, k, earlier))
    if args.forward_ms:
        _policy_table(args.forward_ms, measured, earlier, k)
    return 0


def _policy_table(spec: str, measured: list[dict], earlier: list[dict], k: int) -> None:
    from service.decoding.draft_policy import DraftPolicy
    from service.decoding.drafters.ngram import NgramDrafter
    from service.decoding.drafters.suffix import SuffixDrafter

    costs = forward_costs(spec)
    print(
        f"\nUnder the draft policy, forward costs {spec} ms (modelled speed: forwards and drafting, no prefill):\n"
    )
    print("| drafter | tokens / forward | modelled tok/s | x vanilla |\n|---|---|---|---|")
    vanilla = 1 / costs(1, 1)
    print(f"| vanilla | 1.00 | {vanilla:.1f} | 1.00x |")

    def show(label: str, tokens: int, forwards: int, seconds: float) -> None:
        print(
            f"| {label} | {tpf(tokens, forwards):.2f} | {tokens / seconds:.1f} | {tokens / seconds / vanilla:.2f}x |"
        )

    show("ngram", *policy_replay(NgramDrafter(), "ngram", measured, k, DraftPolicy(costs)))
    show("suffix (cold)", *policy_replay(SuffixDrafter(), "suffix", measured, k, DraftPolicy(costs)))
    if earlier:
        pooled = SuffixDrafter()
        policy_replay(pooled, "suffix", earlier, k, DraftPolicy(costs))  # replica A, on its own policy
        show("suffix (pooled)", *policy_replay(pooled, "suffix", measured, k, DraftPolicy(costs)))


if __name__ == "__main__":
    raise SystemExit(main())
