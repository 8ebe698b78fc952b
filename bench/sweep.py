"""The tau / lambda sweep: guarded CSD at every grid point, per drafter, on held-out calibration prompts.

Only calibration prompts (bench/data/calibration.jsonl), never an evaluation set: the sweep chooses the
defaults that the benchmark then judges, so it must not see the benchmark's prompts. The last
`sweep_prompts` calibration prompts are held out of the OCM calibration (`calibration_items`), so the
frequency gate meets patterns counted on other prompts, as it would in service.

Per prompt, vanilla, strict sd per drafter and every (drafter, tau, lambda) point run back to back (order
rotated per prompt); each point has its own copy of the calibrated OCM, so points never learn from each
other. Tokens per forward, output length and similarity to vanilla do not depend on timing, so the sweep
is sound on a shared machine. The chosen setting per drafter: the most tokens per forward at mean
similarity >= `SIMILARITY_FLOOR`.

`python -m bench.sweep` runs it alone (calibration, then the sweep) and writes sweep.json and sweep.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from bench.calibration import copy_store, engine_with_store
from bench.config import BenchConfig
from bench.context import Bench
from bench.metrics import Aggregate
from bench.runners import CSD, VANILLA, MethodSpec, RunOutput
from bench.workloads import load_calibration
from service.decoding import Method

SIMILARITY_FLOOR = 0.95


def sweep_items(config: BenchConfig) -> list[dict]:
    """The held-out calibration prompts the sweep runs on: the file's last `sweep_prompts`."""
    n = config.sweep_prompts
    return load_calibration()[-n:] if n else []


def calibration_items(config: BenchConfig) -> list[dict]:
    """The calibration prompts the OCM learns from: the first `calibration_prompts`, less the sweep's."""
    held_out = {item["id"] for item in sweep_items(config)}
    return [item for item in load_calibration(config.calibration_prompts) if item.get("id") not in held_out]


def sweep_drafters(bench: Bench) -> list[str]:
    wanted = bench.config.sweep_drafters or tuple(bench.drafters)
    return [d for d in wanted if d in bench.drafters]


def run_sweep(bench: Bench) -> dict:
    from service.calibration import encode_item

    config = bench.config
    items = sweep_items(config)
    drafters = sweep_drafters(bench)
    grid = [
        (d, tau, lam, True) for d in drafters for tau in config.sweep_taus for lam in config.sweep_lambdas
    ]
    if config.sweep_unguarded:  # what the guards cost: the run's own tau and lambda without them
        grid += [(d, bench.speculative.tau, bench.speculative.lambda_, False) for d in drafters]
    engines = {
        point: {"calibrated": engine_with_store(bench.target, bench.drafters, copy_store(bench.calibrated))}
        for point in grid
    }
    plain = bench.engines()
    strict = {d: MethodSpec(f"sd-{d}", "engine", Method.SD, d) for d in drafters}
    keys: list[object] = ["vanilla", *drafters, *grid]
    outputs: dict[object, list[RunOutput]] = {key: [] for key in keys}
    for i, item in enumerate(items):
        ids = encode_item(bench.target.tokenizer, item)
        shift = i % len(keys)
        for key in keys[shift:] + keys[:shift]:
            bench.progress.set_postfix_str(f"sweep {item.get('id')} {key}", refresh=False)
            if key == "vanilla":
                out = bench.run(VANILLA, plain, ids)
            elif isinstance(key, str):
                out = bench.run(strict[key], plain, ids)
            else:
                drafter, tau, lam, guarded = key  # type: ignore[misc]
                spec = replace(
                    bench.speculative, tau=tau, lambda_=lam, guard_facts=guarded, guard_turns=guarded
                )
                out = bench.run(replace(CSD, drafter=drafter), engines[key], ids, speculative=spec)
            outputs[key].append(out)
            bench.progress.update()

    vanilla = outputs["vanilla"]
    similarity_pairs = [
        (v.text, o.text) for key in keys[1:] for v, o in zip(vanilla, outputs[key], strict=True)
    ]
    similarities = iter(bench.embedder.similarity(similarity_pairs))
    figures = {
        key: _figures(outputs[key], vanilla, [next(similarities) for _ in vanilla]) for key in keys[1:]
    }
    points = [
        {
            "drafter": d,
            "tau": tau,
            "lambda": lam,
            "guarded": guarded,
            **figures[(d, tau, lam, guarded)],
            "sd_tokens_per_forward": figures[d]["tokens_per_forward"],
        }
        for d, tau, lam, guarded in grid
    ]
    return {
        "prompts": [item.get("id") for item in items],
        "max_tokens": config.max_tokens,
        "drafters": drafters,
        "taus": list(config.sweep_taus),
        "lambdas": list(config.sweep_lambdas),
        "guards": {"facts": bench.speculative.guard_facts, "turns": bench.speculative.guard_turns},
        "vanilla_tokens": sum(o.tokens for o in vanilla),
        "strict": {d: figures[d] for d in drafters},
        "points": points,
        "chosen": {d: choose([p for p in points if p["drafter"] == d and p["guarded"]]) for d in drafters},
        "similarity_floor": SIMILARITY_FLOOR,
    }


def _figures(outs: list[RunOutput], vanilla: list[RunOutput], similarities: list[float]) -> dict:
    agg = Aggregate()
    refused: Counter = Counter()
    for out in outs:
        agg.add(out)
        refused.update(out.refused_rescues)
    base = sum(v.tokens for v in vanilla)
    return {
        "tokens_per_forward": agg.tokens_per_forward,
        "tokens": agg.tokens,
        "length_ratio": agg.tokens / base if base else None,
        "acceptance_rate": agg.acceptance_rate,  # strict: accepted / drafted
        "kept_rate": agg.kept_rate,  # (accepted + rescued) / drafted
        "rescue_rate": agg.rescue_rate,
        "rescued": agg.rescued or 0,
        "refused_rescues": dict(refused),
        "exact_match": sum(o.token_ids == v.token_ids for o, v in zip(outs, vanilla, strict=True)) / len(outs)
        if outs
        else None,
        "similarity": sum(similarities) / len(similarities) if similarities else None,
        "min_similarity": min(similarities) if similarities else None,
    }


def choose(points: list[dict], floor: float = SIMILARITY_FLOOR) -> dict | None:
    """The point with the most tokens per forward at mean similarity >= floor (ties: the higher similarity,
    then the stricter gates: the larger lambda, the larger tau). None if no point reaches the floor."""
    fit = [p for p in points if p["similarity"] is not None and p["similarity"] >= floor]
    if not fit:
        return None
    best = max(fit, key=lambda p: (round(p["tokens_per_forward"], 3), p["similarity"], p["lambda"], p["tau"]))
    return {
        k: best[k] for k in ("tau", "lambda", "tokens_per_forward", "similarity", "length_ratio", "rescued")
    }


def sweep_markdown(sweep: dict) -> list[str]:
    parts = [
        f"## tau / lambda sweep ({len(sweep['prompts'])} held-out calibration prompts, {sweep['max_tokens']} "
        f"tokens, guards {'on' if all(sweep['guards'].values()) else sweep['guards']}; vanilla wrote "
        f"{sweep['vanilla_tokens']} tokens)",
        "",
        "| drafter | guards | tau | lambda | tok/fwd | vs sd | tokens (vs vanilla) | accept | kept | rescue | refused by guards | exact | sim | min sim |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in sweep["points"]:
        refused = ", ".join(f"{k} {v}" for k, v in sorted(p["refused_rescues"].items())) or "–"
        parts.append(
            f"| {p['drafter']} | {'on' if p.get('guarded', True) else 'off'} | {p['tau']:g} | {p['lambda']:g} | {p['tokens_per_forward']:.3f} | "
            f"{p['tokens_per_forward'] / p['sd_tokens_per_forward']:.3f}x | {p['tokens']} ({_pct(p['length_ratio'], 0)}) | "
            f"{_pct(p['acceptance_rate'])} | {_pct(p['kept_rate'])} | {_pct(p['rescue_rate'])} | {refused} | "
            f"{_pct(p['exact_match'], 0)} | {p['similarity']:.3f} | {p['min_similarity']:.3f} |"
        )
    parts.append("")
    for d, s in sweep["strict"].items():
        chosen = sweep["chosen"][d]
        choice = (
            f"tau {chosen['tau']:g}, lambda {chosen['lambda']:g}: {chosen['tokens_per_forward']:.3f} tokens per "
            f"forward, similarity {chosen['similarity']:.3f}, {chosen['rescued']} rescued"
            if chosen
            else f"no point reaches similarity {sweep['similarity_floor']}"
        )
        parts.append(f"- {d}: strict sd {s['tokens_per_forward']:.3f} tokens per forward; chosen {choice}.")
    return parts


def _pct(v: float | None, digits: int = 1) -> str:
    return "–" if v is None else f"{v * 100:.{digits}f}%"


# ---------------------------------------------------------------- `python -m bench.sweep`


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="embedded")
    p.add_argument("--draft-head", default="embedded", help="folder of a draft head, or 'embedded'")
    p.add_argument("--drafters", default="", help="comma-separated (default: every drafter available)")
    p.add_argument("--prompts", type=int, default=8, help="held-out calibration prompts swept")
    p.add_argument(
        "--calibration-prompts", type=int, help="calibration prompts for the OCM (default: all others)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--taus", default="0.01,0.05,0.1,0.3")
    p.add_argument("--lambdas", default="2,6,12")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--unguarded", action="store_true", help="also run tau 0.01, lambda 6 without the guards")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers
    from tqdm import tqdm

    from bench.calibration import calibrated_store
    from bench.context import head_folder
    from bench.machine import describe, one_line
    from service.decoding import load_model

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    config = BenchConfig(
        model=args.model,
        draft_head=args.draft_head,
        max_tokens=args.max_tokens,
        calibration_prompts=args.calibration_prompts,
        calibration_max_tokens=args.max_tokens,
        sweep_prompts=args.prompts,
        sweep_taus=tuple(float(x) for x in args.taus.split(",")),
        sweep_lambdas=tuple(float(x) for x in args.lambdas.split(",")),
        sweep_drafters=tuple(x for x in args.drafters.split(",") if x),
        sweep_unguarded=args.unguarded,
        threads=args.threads,
    )
    started = time.perf_counter()
    target = load_model(config.model)
    head, note = head_folder(config)
    items = calibration_items(config)
    progress = tqdm(desc="sweep", unit="gen", file=sys.stderr, dynamic_ncols=True)
    bench = Bench.create(config, target, None, progress, head)
    bench.calibrated, _ = calibrated_store(
        target,
        {d: bench.drafters[d] for d in sweep_drafters(bench)},
        items,
        num_speculative_tokens=config.num_speculative_tokens,
        max_tokens=config.calibration_max_tokens,
        on_prompt=lambda _: progress.update(),
    )
    sweep = run_sweep(bench)
    progress.close()
    sweep["calibration_prompts"] = len(items)
    sweep["draft_head"] = str(head) if head else note
    sweep["machine"] = one_line(describe("cpu"))
    sweep["wall_seconds"] = time.perf_counter() - started
    sweep["command"] = "python -m bench.sweep " + " ".join(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps(sweep, indent=1), encoding="utf-8")
    text = "\n".join(
        [f"Command: `{sweep['command']}`", "", f"Machine: {sweep['machine']}", "", *sweep_markdown(sweep), ""]
    )
    (args.out / "sweep.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wall time {sweep['wall_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
