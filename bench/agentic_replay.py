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
"""

from __future__ import annotations

import argparse
import json
import sys
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
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
