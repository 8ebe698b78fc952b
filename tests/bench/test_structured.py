"""`python -m bench.structured`: its data set, its validation and goal judgement, and one small real run."""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import llguidance
import pytest

from bench.structured import (
    DATA,
    Outcome,
    check_output,
    judge,
    load_items,
    markdown,
    parse_args,
    run_structured,
    summarise,
)

ITEMS = load_items()
SCHEMAS = [item for item in ITEMS if item.schema is not None]


def walk(schema):
    """Every sub-schema of `schema` (itself included)."""
    if isinstance(schema, dict):
        yield schema
        for key, value in schema.items():
            if key in ("properties", "patternProperties", "$defs"):
                for sub in value.values():
                    yield from walk(sub)
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                yield from walk(value)
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems"):
                for sub in value:
                    yield from walk(sub)


# ---------------------------------------------------------------- the data set


def test_the_data_set_loads_with_unique_ids():
    assert len(ITEMS) >= 36
    ids = [item.id for item in ITEMS]
    assert len(ids) == len(set(ids))
    assert all(item.prompt.strip() and "JSON" in item.prompt for item in ITEMS)
    assert 2 <= len(ITEMS) - len(SCHEMAS) <= 6  # a few json_object items
    # every line is a plain {"id", "prompt", "schema"} object
    for line in DATA.read_text(encoding="utf-8").splitlines():
        assert set(json.loads(line)) == {"id", "prompt", "schema"}


@pytest.mark.parametrize("item", SCHEMAS, ids=[item.id for item in SCHEMAS])
def test_every_schema_is_valid_and_compiles_in_llguidance(item):
    jsonschema.Draft202012Validator.check_schema(item.schema)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(item.schema)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""


def test_the_schemas_cover_the_features_and_bound_their_outputs():
    """Varied (every feature the issue names is in some schema) and bounded: a 135M model cannot run away
    inside a schema (a response cut by the token budget never parses)."""
    seen: set[str] = set()
    for item in SCHEMAS:
        for sub in walk(item.schema):
            seen |= set(sub)
            types = sub.get("type")
            types = types if isinstance(types, list) else [types]
            if "string" in types and "enum" not in sub and "const" not in sub:
                pattern = sub.get("pattern", "")
                bounded_pattern = pattern and "*" not in pattern and "+" not in pattern
                assert "maxLength" in sub or bounded_pattern, (item.id, sub)
            if "array" in types:
                assert "maxItems" in sub or sub.get("items") is False, (item.id, sub)
            if "object" in types:
                assert sub.get("additionalProperties") is False, (item.id, sub)
                assert "properties" in sub or "maxProperties" in sub, (item.id, sub)
            if "integer" in types or "number" in types:
                assert "minimum" in sub or "exclusiveMinimum" in sub, (item.id, sub)
                assert "maximum" in sub, (item.id, sub)
            if "number" in types:
                assert "multipleOf" in sub, (item.id, sub)  # bounded decimals
    wanted = {
        "enum", "const", "anyOf", "$ref", "$defs", "required", "additionalProperties", "maxLength", "pattern",
        "format", "minimum", "maximum", "minItems", "maxItems", "prefixItems", "patternProperties",
    }  # fmt: skip
    assert wanted <= seen, wanted - seen
    nullable = [s for item in SCHEMAS for s in walk(item.schema) if isinstance(s.get("type"), list)]
    assert nullable and all("null" in s["type"] for s in nullable)
    optional = [
        s
        for item in SCHEMAS
        for s in walk(item.schema)
        if "properties" in s and set(s["required"]) < set(s["properties"])
    ]
    assert optional  # some fields are optional


# ---------------------------------------------------------------- validation and goals

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "email": {"type": "string", "format": "email"},
    },
    "required": ["name"],
    "additionalProperties": False,
}


def test_outputs_are_parsed_validated_and_cuts_counted_apart():
    assert check_output('{"name": "Ada"}', PERSON, "stop") == ("valid", "")
    assert check_output('{"name": "Ada", "email": "ada@example.org"}', PERSON, "stop")[0] == "valid"
    assert check_output('{"name": "Ad', PERSON, "length")[0] == "length"
    status, detail = check_output('{"name": "Ada"', PERSON, "stop")
    assert status == "parse" and "character" in detail
    status, detail = check_output('{"name": "Ada Lovelace Byron"}', PERSON, "stop")
    assert status == "schema" and detail.startswith("name:")
    assert check_output('{"name": "Ada", "age": 3}', PERSON, "stop")[0] == "schema"  # additionalProperties
    assert check_output('{"name": "Ada", "email": "not an address"}', PERSON, "stop")[0] == "schema"  # format
    # multipleOf on decimals, as JSON writes them (binary floats would call 2.4 no multiple of 0.1)
    weight = {"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.1}
    assert [check_output(x, weight, "stop")[0] for x in ("2.4", "0.3", "7", "2.45", "-0.1", "1e1")] == [
        "valid", "valid", "valid", "schema", "schema", "valid",
    ]  # fmt: skip
    assert check_output("19.99", {"type": "number", "multipleOf": 0.01}, "stop")[0] == "valid"
    assert check_output('{"anything": [1, 2]}', None, "stop") == ("valid", "")  # json_object
    assert check_output("[1, 2]", None, "stop")[0] == "schema"


def outcome(item: str, method: str, tokens: int, seconds: float, status: str = "valid", **kw) -> Outcome:
    return Outcome(
        item=item, method=method, constrained_by=kw.pop("kind", "json_schema"), tokens=tokens, seconds=seconds,
        target_forwards=kw.pop("forwards", tokens), finish_reason="length" if status == "length" else "stop",
        status=status, detail="", text="{}", token_ids=kw.pop("ids", list(range(tokens))), **kw,
    )  # fmt: skip


def run_of(n: int, sd_seconds: float, cut: str | None = None, grammar: bool = True) -> list[Outcome]:
    """n items, vanilla 10 tokens in 1 s each, sd the same tokens in `sd_seconds` (4 forwards), csd like sd."""
    out = []
    for i in range(n):
        g = {"grammar_seconds": 0.1, "forced_tokens": 3} if grammar else {}
        out.append(outcome(f"i{i}", "vanilla", 10, 1.0, **g))
        out.append(outcome(f"i{i}", "sd", 10, sd_seconds, forwards=4, **g))
        status = "length" if f"i{i}" == cut else "valid"
        out.append(outcome(f"i{i}", "csd", 10, sd_seconds, status, forwards=4, ids=[7] * 10, **g))
    out.append(outcome("obj", "vanilla", 5, 0.5, kind="json_object", **g))
    out.append(outcome("obj", "sd", 5, 0.5, kind="json_object", **g))
    out.append(outcome("obj", "csd", 5, 0.5, kind="json_object", **g))
    return out


def test_goals_are_judged_from_the_measured_outcomes():
    outcomes = run_of(30, sd_seconds=0.8)
    everything, schema_only = summarise(outcomes), summarise(outcomes, "json_schema")
    assert list(everything) == ["vanilla", "sd", "csd"]
    sd = schema_only["sd"]
    assert sd["items"] == 30 and sd["tokens"] == 300 and sd["tokens_per_forward"] == 2.5
    assert sd["speedup"] == pytest.approx(1.25) and sd["same_as_vanilla"] == 30
    assert schema_only["csd"]["same_as_vanilla"] == 0
    assert everything["vanilla"]["grammar_share"] == pytest.approx(3.1 / 30.5)
    goals = judge(everything, schema_only)
    assert [g["status"] for g in goals] == ["met", "met", "met", "met"]
    assert goals[0]["measured"] == "vanilla 31/31, sd 31/31, csd 31/31"
    assert goals[1]["measured"].startswith("1.25x (12.5 vs 10.0 tok/s, 30 items)")

    # one csd output cut by the budget; speculation slower than vanilla: both missed, with the numbers
    outcomes = run_of(30, sd_seconds=1.25, cut="i3")
    goals = judge(summarise(outcomes), summarise(outcomes, "json_schema"))
    assert [g["status"] for g in goals] == ["missed", "missed", "missed", "met"]
    assert "csd 30/31 (1 cut by length)" in goals[0]["measured"]
    assert goals[1]["measured"].startswith("0.80x (8.0 vs 10.0 tok/s")

    # too few items for the goal's set: all valid is "not measured", an invalid one still "missed"
    small = judge(summarise(run_of(3, 0.8)), summarise(run_of(3, 0.8), "json_schema"))
    assert small[0]["status"] == "not measured" and ">= 30 items" in small[0]["note"]
    cut = run_of(3, 0.8, cut="i0")
    assert judge(summarise(cut), summarise(cut, "json_schema"))[0]["status"] == "missed"

    # an engine without grammar_seconds: the share is n/a and its goal not measured, never met
    bare = run_of(30, 0.8, grammar=False)
    everything = summarise(bare)
    assert everything["sd"]["grammar_share"] is None and everything["sd"]["forced_tokens"] is None
    assert judge(everything, summarise(bare, "json_schema"))[-1]["status"] == "not measured"


def test_the_markdown_shows_every_method_and_the_failures():
    outcomes = run_of(30, sd_seconds=0.8, cut="i3")
    meta = {
        "machine": "m", "command": "c", "items": 31, "schema_items": 30, "max_tokens": 192, "drafter": "combined",
        "speculation": "fixed", "threads": 1, "calibration_prompts": 16, "wall_seconds": 100.0,
    }  # fmt: skip
    text = markdown(outcomes, meta)
    assert "Machine: m" in text and "Reproduce: `c`" in text and "torch threads 1" in text
    assert "| sd | 31/31 (100 %) | 0 | 0 | 305 | 12.4 | 1.24x | 2.44 |" in text
    assert "| csd | 30/31 (97 %) | 1 |" in text
    assert "| 93 (30 % of tokens) |" in text  # forced tokens (jump-forward) with their share of the output
    assert "| i3 | csd | length |" in text
    bare = markdown(run_of(30, sd_seconds=0.8, grammar=False), meta)
    assert "| n/a | n/a | 31/31 |" in bare  # an engine without grammar_seconds / forced_tokens
    assert "| every response parses and validates against its schema, every method | missed |" in text


def test_arguments():
    args = parse_args([])
    assert (
        args.methods == ["vanilla", "sd", "csd", "sd-no-jump"]
        and args.drafter == "combined"
        and args.threads == 1
    )
    assert args.max_tokens == 192 and args.items is None
    assert parse_args(["--items", "a, b"]).items == ["a", "b"]
    for bad in (["--methods", "lossy"], ["--max-tokens", "0"], ["--threads", "0"], ["--drafter", "x"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


# ---------------------------------------------------------------- one small real run


@pytest.mark.timeout(120)
def test_a_small_run_through_the_real_model(embedded, single_thread, tmp_path):
    """Two short items, vanilla and sd (n-gram drafter), through the engine: under a minute on 2 cores."""
    argv = [
        "--items", "object-status,hex-color", "--methods", "vanilla,sd", "--drafter", "ngram", "--max-tokens", "24",
        "--fixed-speculation", "--out", str(tmp_path),
    ]  # fmt: skip
    report, text = run_structured(parse_args(argv), argv, target=embedded)
    assert (tmp_path / "structured-report.md").read_text() == text
    saved = json.loads((tmp_path / "structured.json").read_text())
    assert [(o["item"], o["method"]) for o in saved["outcomes"]] == [
        ("object-status", "vanilla"), ("object-status", "sd"), ("hex-color", "sd"), ("hex-color", "vanilla"),
    ]  # fmt: skip
    sd = report["summary"]["sd"]
    assert sd["same_as_vanilla"] == 2  # strict SD stays lossless under the constraint
    assert all(0 < o["tokens"] <= 24 and o["seconds"] > 0 for o in saved["outcomes"])
    assert "| vanilla |" in text and "| sd |" in text and "torch threads 1" in text
    if importlib.util.find_spec("service.decoding.grammar") is not None:  # enforcement is in the engine
        assert all(o["status"] == "valid" for o in saved["outcomes"]), saved["outcomes"]


def test_what_jump_forward_buys_is_judged_from_sd_and_sd_no_jump():
    row = {"tokens_per_second": 10.0, "tokens_per_forward": 2.0, "speedup": 1.0, "items": 38}
    slower = {**row, "tokens_per_second": 8.0, "tokens_per_forward": 1.5}
    goals = judge({}, {"vanilla": row, "sd": row, "sd-no-jump": slower})
    jump = next(g for g in goals if "jump-forward" in g["goal"])
    assert jump["status"] == "met" and jump["measured"].startswith("1.25x")
    goals = judge({}, {"vanilla": row, "sd": slower, "sd-no-jump": row})
    assert next(g for g in goals if "jump-forward" in g["goal"])["status"] == "missed"
    # sd-no-jump is a measurement, not one of the methods: no speed goal of its own
    assert not any("sd-no-jump is at least as fast" in g["goal"] for g in goals)
