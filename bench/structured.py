"""Structured output: every method under a JSON constraint, validated, timed, with the grammar's share.

Every item of bench/data/structured.jsonl (a chat user message asking for JSON, and the JSON Schema its answer
must match, or null for "any JSON object") runs through the engine once per method with
`SamplingParams(constraint=Constraint(JSON_SCHEMA, schema))` (or `JSON_OBJECT`), greedy, interleaved per item
(the method order rotates from item to item, so machine drift falls on every method alike). Each output is
parsed and validated with `jsonschema` (Draft 2020-12, formats it can check); an output cut by the token
budget (finish_reason "length") is counted apart: it cannot parse. Per method we report

- valid: outputs that parse and validate / items;
- tokens/s: completion tokens over the wall time of the calls (prefill, drafting, verification, grammar);
- tok/fwd: completion tokens per target forward;
- speedup: tokens/s over vanilla's with the same constraint on the same items;
- grammar share: `GenerationStats.grammar_seconds` (mask computation + draft checking) over the wall time,
  and `GenerationStats.forced_tokens` (tokens the grammar forced, drafted for free: jump-forward) when the
  engine exposes them ("n/a" otherwise);
- same as vanilla: outputs equal to vanilla's token for token (strict SD must be lossless under a constraint).

Goals (issue 12): 100 % of responses parse and validate, for every method, over at least 30 items; with
`json_schema`, speculation is at least as fast as vanilla with the same constraint; the grammar's share is
reported.

    python -m bench.structured                               # every item, vanilla, sd, csd; combined drafter
    python -m bench.structured --limit 6 --max-tokens 96     # a few minutes
    python -m bench.structured --methods vanilla,sd --drafter ngram --figures

CSD's correction memory is calibrated first on bench/data/calibration.jsonl (`--calibration-prompts`, strict
SD with recording, `csd calibrate`'s code path) and keeps learning online while it serves, as in the service.
Speculation verifies only as much of a draft as pays for itself (measured forward costs), as `csd serve` does
by default; `--fixed-speculation` verifies every draft in full. Writes bench/results/structured-report.md and
structured.json (with --figures also bench/figures/structured-report.md) and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from decimal import Decimal
from pathlib import Path

from service.decoding.drafter_registry import DRAFTERS as REGISTRY  # no torch: the CLI checks stay fast

REPO = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "structured.jsonl"
RESULTS = REPO / "bench" / "results"
FIGURES = REPO / "bench" / "figures"
# sd-no-jump: sd without jump-forward (the grammar's forced tokens are not drafted): what jump-forward buys
METHODS = ("vanilla", "sd", "csd", "sd-no-jump")
GOAL_METHODS = ("vanilla", "sd", "csd")  # the "every method"
# The registry's drafters this bench can build: it loads a head for the model, never a draft model.
DRAFTERS = tuple(entry.name for entry in REGISTRY if entry.needs != "draft_model")
GOAL_ITEMS = 30  # the set: at least 30 schemas / prompts


@dataclass(frozen=True)
class Item:
    id: str
    prompt: str
    schema: dict | None  # None: any JSON object (response_format json_object)


def load_items(path: Path = DATA, limit: int | None = None) -> list[Item]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        items.append(Item(raw["id"], raw["prompt"], raw["schema"]))
    return items[:limit] if limit is not None else items


def check_output(text: str, schema: dict | None, finish_reason: str | None) -> tuple[str, str]:
    """-> (status, detail): "valid", "length" (cut by the token budget), "parse" or "schema" (invalid).

    Numbers, in the output and the schema, are read as decimals, as JSON writes them: in binary floating
    point 2.4 / 0.1 is 23.999999999999996, and jsonschema would call 2.4 "not a multiple of 0.1"."""
    import jsonschema

    if finish_reason == "length":
        return "length", f"cut at the token budget after {len(text)} characters"
    try:
        value = json.loads(text, parse_float=Decimal)
    except json.JSONDecodeError as exc:
        return "parse", f"{exc.msg} at character {exc.pos}"
    if schema is None:
        return (
            ("valid", "") if isinstance(value, dict) else ("schema", f"not an object: {type(value).__name__}")
        )
    schema = json.loads(json.dumps(schema), parse_float=Decimal)
    validator = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return "schema", f"{where}: {error.message[:160]}"
    return "valid", ""


@dataclass
class Outcome:
    """One item decoded by one method."""

    item: str
    method: str
    constrained_by: str  # "json_schema" or "json_object"
    tokens: int
    seconds: float  # wall time of the whole call
    target_forwards: int
    finish_reason: str | None
    status: str  # see check_output
    detail: str
    text: str
    token_ids: list[int]
    draft_tokens: int = 0
    accepted: int = 0
    rescued: int = 0
    grammar_seconds: float | None = None  # None: the engine does not expose it
    forced_tokens: int | None = None


# ---------------------------------------------------------------- summary and goals


def _sum_or_none(values: list) -> float | None:
    """The sum, or None when any generation lacked the figure (never a partial sum shown as a whole)."""
    return None if not values or any(v is None for v in values) else sum(values)


def summarise(outcomes: list[Outcome], constrained_by: str | None = None) -> dict[str, dict]:
    """method -> totals over its outcomes (`constrained_by`: only items of that kind), vanilla first."""
    chosen = [o for o in outcomes if constrained_by is None or o.constrained_by == constrained_by]
    methods = sorted(
        {o.method for o in chosen}, key=lambda m: (m != "vanilla", METHODS.index(m) if m in METHODS else 9, m)
    )
    vanilla = {o.item: o for o in chosen if o.method == "vanilla"}
    out: dict[str, dict] = {}
    for method in methods:
        rows = [o for o in chosen if o.method == method]
        tokens = sum(o.tokens for o in rows)
        seconds = sum(o.seconds for o in rows)
        forwards = sum(o.target_forwards for o in rows)
        grammar = _sum_or_none([o.grammar_seconds for o in rows])
        same = [o.token_ids == vanilla[o.item].token_ids for o in rows if o.item in vanilla]
        out[method] = {
            "items": len(rows),
            "valid": sum(o.status == "valid" for o in rows),
            "length": sum(o.status == "length" for o in rows),
            "invalid": sum(o.status in ("parse", "schema") for o in rows),
            "tokens": tokens,
            "seconds": seconds,
            "target_forwards": forwards,
            "tokens_per_second": tokens / seconds if seconds else None,
            "tokens_per_forward": tokens / forwards if forwards else None,
            "draft_tokens": sum(o.draft_tokens for o in rows),
            "accepted": sum(o.accepted for o in rows),
            "rescued": sum(o.rescued for o in rows),
            "grammar_seconds": grammar,
            "grammar_share": grammar / seconds if grammar is not None and seconds else None,
            "forced_tokens": _sum_or_none([o.forced_tokens for o in rows]),
            "same_as_vanilla": sum(same) if same else None,
            "compared_with_vanilla": len(same),
        }
    base = out.get("vanilla", {}).get("tokens_per_second")
    for row in out.values():
        row["speedup"] = row["tokens_per_second"] / base if base and row["tokens_per_second"] else None
    return out


def _goal(goal: str, met: bool | None, measured: str, note: str = "") -> dict:
    return {"goal": goal, "status": {True: "met", False: "missed", None: "not measured"}[met], "measured": measured,
            "note": note}  # fmt: skip


def judge(everything: dict[str, dict], schema_only: dict[str, dict]) -> list[dict]:
    """The issue's goals from the summaries of every item and of the json_schema items; nothing is guessed:
    a goal whose figures were not measured is "not measured", never met."""
    goals = []
    if everything:
        counts = ", ".join(
            f"{m} {r['valid']}/{r['items']}" + (f" ({r['length']} cut by length)" if r["length"] else "")
            for m, r in everything.items()
        )
        items = min(r["items"] for r in everything.values())
        all_valid = all(r["valid"] == r["items"] for r in everything.values())
        missing = [m for m in GOAL_METHODS if m not in everything]
        note = ""
        met: bool | None = all_valid
        if items < GOAL_ITEMS or missing:
            met = None if all_valid else False
            note = f"the goal's set is >= {GOAL_ITEMS} items and every method; this run: {items} item(s)"
            note += f", without {', '.join(missing)}" if missing else ""
        goals.append(
            _goal("every response parses and validates against its schema, every method", met, counts, note)
        )
    vanilla = schema_only.get("vanilla")
    for method, row in schema_only.items():
        if method not in GOAL_METHODS or method == "vanilla":
            continue
        goal = f"json_schema: {method} is at least as fast as vanilla with the same constraint"
        if not vanilla or not row["speedup"]:
            goals.append(_goal(goal, None, "-"))
            continue
        measured = (
            f"{row['speedup']:.2f}x ({row['tokens_per_second']:.1f} vs {vanilla['tokens_per_second']:.1f} tok/s, "
            f"{row['items']} items)"
        )
        goals.append(_goal(goal, row["speedup"] >= 1.0, measured))
    with_jump, without = schema_only.get("sd"), schema_only.get("sd-no-jump")
    if with_jump and without and without["tokens_per_second"]:
        ratio = with_jump["tokens_per_second"] / without["tokens_per_second"]
        measured = (
            f"{ratio:.2f}x tok/s ({with_jump['tokens_per_second']:.1f} vs {without['tokens_per_second']:.1f}), "
            f"tok/fwd {_num(with_jump['tokens_per_forward'])} vs {_num(without['tokens_per_forward'])}"
        )
        goals.append(_goal("json_schema: what jump-forward buys (sd vs sd-no-jump)", ratio >= 1.0, measured))
    if everything:
        shares = {m: r["grammar_share"] for m, r in everything.items()}
        reported = all(s is not None for s in shares.values())
        measured = ", ".join(f"{m} {_pct(s)}" for m, s in shares.items())
        goals.append(
            _goal(
                "the grammar's share of decoding time is reported",
                True if reported else None,
                measured,
                "" if reported else "the engine exposes no GenerationStats.grammar_seconds",
            )
        )
    return goals


# ---------------------------------------------------------------- markdown


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _num(x: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def table(summary: dict[str, dict]) -> list[str]:
    lines = [
        "| method | valid | cut by length | invalid | tokens | tok/s | speedup vs vanilla | tok/fwd | accepted / drafted "
        "| rescued | grammar share | forced tokens | same as vanilla |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, r in summary.items():
        drafted = f"{r['accepted']} / {r['draft_tokens']}" if r["draft_tokens"] else "-"
        same = (
            f"{r['same_as_vanilla']}/{r['compared_with_vanilla']}"
            if r["same_as_vanilla"] is not None
            else "-"
        )
        forced = "n/a" if r["forced_tokens"] is None else f"{r['forced_tokens']:.0f}"
        if r["forced_tokens"] and r["tokens"]:
            forced += f" ({100 * r['forced_tokens'] / r['tokens']:.0f} % of tokens)"
        lines.append(
            f"| {method} | {r['valid']}/{r['items']} ({100 * r['valid'] / r['items']:.0f} %) | {r['length']} "
            f"| {r['invalid']} | {r['tokens']} | {_num(r['tokens_per_second'], '{:.1f}')} "
            f"| {_num(r['speedup'], '{:.2f}x')} | {_num(r['tokens_per_forward'])} | {drafted} | {r['rescued']} "
            f"| {_pct(r['grammar_share'])} | {forced} | {same} |"
        )
    return lines


def markdown(outcomes: list[Outcome], meta: dict) -> str:
    everything = summarise(outcomes)
    schema_only = summarise(outcomes, "json_schema")
    goals = judge(everything, schema_only)
    lines = [
        "# Structured output: vanilla, sd and csd under a JSON constraint",
        "",
        f"Machine: {meta['machine']}",
        "",
        f"Reproduce: `{meta['command']}`",
        "",
        f"{meta['items']} items of bench/data/structured.jsonl ({meta['schema_items']} json_schema, "
        f"{meta['items'] - meta['schema_items']} json_object), greedy, up to {meta['max_tokens']} tokens, drafter "
        f"{meta['drafter']!r}, {meta['speculation']} speculation, torch threads {meta['threads']}; csd's memory "
        f"calibrated on {meta['calibration_prompts']} calibration prompt(s). Wall time {meta['wall_seconds']:.0f} s.",
        "",
        "valid: parses and validates (jsonschema, Draft 2020-12); tok/s: completion tokens over the calls' wall "
        "time; tok/fwd: completion tokens per target forward; grammar share: `grammar_seconds` (mask computation "
        "+ draft checking) over the wall time; forced tokens: draft tokens the grammar forced (jump-forward: "
        "drafted for free, the only token the mask allows), with their share of the output; same as vanilla: "
        "outputs equal to vanilla's token for token.",
        "",
        "## Every item",
        "",
        *table(everything),
        "",
        "## json_schema items only",
        "",
        *table(schema_only),
        "",
        "## Goals (issue 12)",
        "",
        "| goal | status | measured | note |",
        "|---|---|---|---|",
        *(f"| {g['goal']} | {g['status']} | {g['measured']} | {g['note']} |" for g in goals),
    ]
    failures = [o for o in outcomes if o.status != "valid"]
    if failures:
        lines += ["", "## Outputs that did not validate", "", "| item | method | status | detail | output |",
                  "|---|---|---|---|---|"]  # fmt: skip
        for o in failures:
            shown = o.text[:120].replace("|", "\\|").replace("\n", "\\n")
            lines.append(f"| {o.item} | {o.method} | {o.status} | {o.detail.replace('|', '/')} | `{shown}` |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- running


def run_one(
    engine, item: Item, method: str, prompt_ids: list[int], max_tokens: int, spec, drafter: str
) -> Outcome:
    from service.decoding import Constraint, ConstraintKind, SamplingParams, run_alone

    if item.schema is None:
        constraint, kind = Constraint(ConstraintKind.JSON_OBJECT), "json_object"
    else:
        constraint, kind = Constraint(ConstraintKind.JSON_SCHEMA, item.schema), "json_schema"
    sampling = SamplingParams(max_tokens=max_tokens, constraint=constraint)
    started = time.perf_counter()
    generation = engine.generate(prompt_ids, sampling, spec, drafter=drafter)
    for _ in run_alone(generation):
        pass
    seconds = time.perf_counter() - started
    stats = generation.stats
    status, detail = check_output(generation.text, item.schema, generation.finish_reason)
    return Outcome(
        item=item.id,
        method=method,
        constrained_by=kind,
        tokens=stats.completion_tokens,
        seconds=seconds,
        target_forwards=stats.target_forwards,
        finish_reason=generation.finish_reason,
        status=status,
        detail=detail,
        text=generation.text,
        token_ids=[t.token_id for t in generation.tokens],
        draft_tokens=stats.num_draft_tokens,
        accepted=stats.num_accepted,
        rescued=stats.num_rescued,
        grammar_seconds=getattr(stats, "grammar_seconds", None),
        forced_tokens=getattr(stats, "forced_tokens", None),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, help="the first N items (default: all)")
    p.add_argument("--items", help="comma-separated item ids to run instead (in this order)")
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}"
    )
    p.add_argument("--drafter", default="combined", choices=DRAFTERS, help="the speculative methods' drafter")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--num-speculative-tokens", type=int, default=6)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument(
        "--calibration-prompts", type=int, default=16, help="csd's memory calibration (default 16)"
    )
    p.add_argument("--calibration-max-tokens", type=int, default=64)
    p.add_argument(
        "--fixed-speculation", action="store_true", help="verify every draft in full (no cost policy)"
    )
    p.add_argument("--model", default="embedded")
    p.add_argument("--data", type=Path, default=DATA)
    p.add_argument("--out", type=Path, default=RESULTS, help="report folder (default bench/results)")
    p.add_argument("--figures", action="store_true", help="also write bench/figures/structured-report.md")
    args = p.parse_args(argv)
    args.methods = list(dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
    args.items = [i.strip() for i in args.items.split(",") if i.strip()] if args.items else None
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown or not args.methods:
        p.error(f"--methods: choose from {','.join(METHODS)}")
    for name in ("limit", "max_tokens", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.calibration_prompts < 0:
        p.error("--calibration-prompts must be >= 0")
    return args


def build_engines(target, args) -> dict:
    """method -> engine: vanilla plain; sd with the drafter; csd with the drafter and a calibrated memory."""
    from bench.calibration import calibrated_store, engine_with_store
    from bench.config import BenchConfig
    from bench.context import head_folder
    from bench.workloads import load_calibration
    from ocm_store.memory import InMemoryStore
    from service.decoding import DecodingError, DraftPolicy, Engine, HeadDrafter
    from service.decoding.draft_policy import measure_forward_costs
    from service.decoding.drafter_registry import DrafterInputs, build_drafters, drafter_entry

    config = BenchConfig(model=args.model)
    head = None
    if drafter_entry(args.drafter).needs == "draft_head":  # loaded only for a drafter that drafts with it
        folder, why = head_folder(config)
        if folder is None:
            raise DecodingError(f"drafter {args.drafter!r} needs a draft head: {why}")
        head = HeadDrafter(target, folder)
    # built as the server builds them
    drafters = build_drafters(DrafterInputs(target, config.ngram_min, config.ngram_max, head=head))
    chosen = {args.drafter: drafters[args.drafter]}

    costs = (
        None
        if args.fixed_speculation
        else measure_forward_costs(target.model, args.num_speculative_tokens + 1)
    )

    def policy():  # one per engine, so one method's acceptance never steers another's drafts
        return None if costs is None else DraftPolicy(costs)

    engines = {"vanilla": Engine(target, chosen)}
    for method in ("sd", "sd-no-jump"):
        if method in args.methods:
            engines[method] = Engine(target, chosen, policy=policy())
    if "csd" in args.methods:
        store = InMemoryStore()
        if args.calibration_prompts:
            store, _ = calibrated_store(
                target,
                chosen,
                load_calibration(args.calibration_prompts),
                num_speculative_tokens=args.num_speculative_tokens,
                max_tokens=args.calibration_max_tokens,
            )
        engines["csd"] = engine_with_store(target, chosen, store, policy())
    return engines


def run_structured(args: argparse.Namespace, argv: list[str], target=None) -> tuple[dict, str]:
    """Every item with every method; writes the report files. `target` may come loaded (tests).
    -> (the report dict, its markdown)."""
    import torch
    import transformers

    from bench.config import BenchError
    from bench.machine import describe, one_line
    from service.calibration import encode_item
    from service.decoding import Method, SpeculativeConfig, load_model

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    wall_start = time.perf_counter()
    items = load_items(args.data, args.limit)
    if args.items:
        by_id = {item.id: item for item in load_items(args.data)}
        missing = [i for i in args.items if i not in by_id]
        if missing:
            raise BenchError(f"--items: no item {missing[0]!r} in {args.data}")
        items = [by_id[i] for i in args.items]
    methods = ["vanilla", *(m for m in args.methods if m != "vanilla")]  # vanilla is the baseline
    command = (
        f"cd {shlex.quote(str(REPO))} && HF_HUB_OFFLINE=1 {shlex.quote(sys.executable)} -m bench.structured "
        f"{shlex.join(argv)}"
    ).rstrip()
    machine = one_line(describe())
    print(f"reproduce: {command}", file=sys.stderr)
    print(f"machine:   {machine}", file=sys.stderr)
    print(f"torch threads: {torch.get_num_threads()}", file=sys.stderr, flush=True)
    target = target or load_model(args.model)
    engines = build_engines(target, args)
    specs = {
        m: SpeculativeConfig(
            method=Method(m.removesuffix("-no-jump")),
            num_speculative_tokens=args.num_speculative_tokens,
            jump_forward=not m.endswith("-no-jump"),
        )
        for m in methods
    }
    prompt_ids = {item.id: encode_item(target.tokenizer, {"prompt": item.prompt}) for item in items}
    # one short untimed generation per method: first-call costs (allocator, grammar setup) stay out of timings
    for method in methods:
        run_one(engines[method], items[0], method, prompt_ids[items[0].id], 8, specs[method], args.drafter)
    outcomes: list[Outcome] = []
    for i, item in enumerate(items):
        for method in methods[i % len(methods) :] + methods[: i % len(methods)]:
            o = run_one(
                engines[method],
                item,
                method,
                prompt_ids[item.id],
                args.max_tokens,
                specs[method],
                args.drafter,
            )
            outcomes.append(o)
            grammar = "" if o.grammar_seconds is None else f", grammar {o.grammar_seconds:.2f} s"
            forced = "" if o.forced_tokens is None else f", {o.forced_tokens} forced"
            print(
                f"[{i + 1}/{len(items)}] {item.id} {method}: {o.status}, {o.tokens} tokens in {o.seconds:.1f} s "
                f"({o.tokens / o.seconds if o.seconds else 0:.1f} tok/s, {o.target_forwards} forwards"
                f"{forced}{grammar})",
                file=sys.stderr,
                flush=True,
            )
    meta = {
        "machine": machine,
        "command": command,
        "items": len(items),
        "schema_items": sum(item.schema is not None for item in items),
        "max_tokens": args.max_tokens,
        "drafter": args.drafter,
        "speculation": "fixed" if args.fixed_speculation else "cost-aware (adaptive)",
        "threads": torch.get_num_threads(),
        "calibration_prompts": args.calibration_prompts if "csd" in methods else 0,
        "wall_seconds": time.perf_counter() - wall_start,
    }
    text = markdown(outcomes, meta)
    everything, schema_only = summarise(outcomes), summarise(outcomes, "json_schema")
    report = {
        "meta": meta,
        "summary": everything,
        "summary_json_schema": schema_only,
        "goals": judge(everything, schema_only),
        "outcomes": [asdict(o) for o in outcomes],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured-report.md").write_text(text, encoding="utf-8")
    (args.out / "structured.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    if args.figures:
        FIGURES.mkdir(parents=True, exist_ok=True)
        (FIGURES / "structured-report.md").write_text(text, encoding="utf-8")
    print(f"report in {args.out / 'structured-report.md'}", file=sys.stderr)
    return report, text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from bench.config import BenchError
    from service.decoding import DecodingError

    try:
        _, text = run_structured(args, argv)
    except (BenchError, DecodingError) as exc:  # an unknown item, a missing draft head, a bad model spec
        print(f"bench.structured: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
