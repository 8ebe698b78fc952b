"""Structured output under speculation: the grammar checks every draft position, forced tokens are drafted
for free, strict decoding stays lossless under a constraint, and CSD never rescues a forbidden token."""

from __future__ import annotations

import json
import math

import pytest
import torch

from service.decoding import (
    Constraint,
    ConstraintKind,
    SamplingParams,
    SpeculativeConfig,
)
from service.decoding.engine import run_to_end
from service.decoding.grammar import model_grammar
from service.decoding.processing import LogitsProcessing
from service.decoding.text import encode_chat
from service.decoding.types import DecodingError, Provenance
from service.decoding.verification import calibrated_rule, verify_greedy
from tests.conftest import engine_with_drafters

pytestmark = pytest.mark.usefixtures("single_thread")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "employed": {"type": "boolean"},
    },
    "required": ["name", "age", "languages", "employed"],
    "additionalProperties": False,
}


def validate(schema: dict, text: str) -> None:
    import jsonschema

    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def engine(embedded):
    return engine_with_drafters(embedded)


def chat(embedded, content: str) -> list[int]:
    return encode_chat(embedded.tokenizer, [{"role": "user", "content": content}])


def generate(engine, ids, method, constraint, max_tokens=96, **kw):
    sampling = SamplingParams(max_tokens=max_tokens, constraint=constraint, **kw)
    return run_to_end(engine.generate(ids, sampling, SpeculativeConfig(method=method), "combined"))


def test_check_draft_cuts_at_the_first_forbidden_token_and_leaves_the_matcher_as_it_was(embedded):
    tok = embedded.tokenizer
    matcher = model_grammar(embedded).matcher(Constraint(ConstraintKind.JSON_SCHEMA, PERSON))
    good = tok.encode('{"name": "Ada", "age": 36', add_special_tokens=False)
    bad = tok.encode("hello", add_special_tokens=False)
    valid, masks = matcher.check_draft(good + bad + good)
    assert valid == len(good)
    assert masks.shape == (len(good) + 1, embedded.vocab_size)
    for i, token in enumerate(good):  # each draft token was allowed at its own position
        assert masks[i, token]
    assert not masks[len(good), bad[0]]
    _, again = matcher.check_draft([])  # rolled back: the first position's mask is the same as before
    assert torch.equal(again[0], masks[0])
    assert not masks[0, tok.encode(" ", add_special_tokens=False)[0]], "compact JSON: no leading space"


@pytest.mark.parametrize("method", ["vanilla", "sd", "csd"])
def test_constrained_outputs_parse_and_validate_for_every_method(engine, embedded, method):
    prompts = [
        "Describe a fictional software engineer as JSON.",
        "Give me a JSON record for a retired teacher.",
    ]
    for content in prompts:
        g = generate(engine, chat(embedded, content), method, Constraint(ConstraintKind.JSON_SCHEMA, PERSON))
        assert g.finish_reason == "stop", g.text
        validate(PERSON, g.text)


def test_sd_under_a_constraint_equals_vanilla_under_it_and_jumps_forward(engine, embedded):
    ids = chat(embedded, "Describe a fictional software engineer as JSON.")
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, PERSON)
    plain = generate(engine, ids, "vanilla", constraint)
    sd = generate(engine, ids, "sd", constraint)
    assert [t.token_id for t in sd.tokens] == [t.token_id for t in plain.tokens]
    assert plain.stats.forced_tokens == 0  # plain decoding drafts nothing, forced or not
    assert sd.stats.forced_tokens > 0  # the keys after each value are forced by the schema
    assert sd.stats.tokens_per_forward > 1.5, sd.stats.as_dict()
    assert sd.stats.grammar_seconds > 0
    # the grammar ends the sequence itself: no forward spent on EOS
    assert sd.stats.target_forwards <= len(sd.tokens)


@pytest.mark.parametrize(
    "constraint, check",
    [
        (Constraint(ConstraintKind.REGEX, r"[0-9]{3}-[0-9]{4}"), lambda s: len(s) == 8 and s[3] == "-"),
        (Constraint(ConstraintKind.CHOICE, ("positive", "negative", 'it\'s "neutral"')), None),
        (Constraint(ConstraintKind.JSON_OBJECT), lambda s: isinstance(json.loads(s), dict)),
        (
            Constraint(ConstraintKind.GRAMMAR, 'start: "yes" | "no" | "maybe"'),
            lambda s: s in {"yes", "no", "maybe"},
        ),
    ],
    ids=["regex", "choice", "json_object", "lark"],
)
def test_regex_choice_json_object_and_lark_grammars(engine, embedded, constraint, check):
    g = generate(
        engine, chat(embedded, "Is this review positive? 'Great phone, terrible battery.'"), "sd", constraint
    )
    if check is None:
        assert g.text in constraint.value
    else:
        assert check(g.text), g.text


def test_sampling_under_a_constraint_stays_valid(engine, embedded):
    ids = chat(embedded, "Invent a person and describe them as JSON.")
    for seed in range(3):
        g = generate(
            engine, ids, "csd", Constraint(ConstraintKind.JSON_SCHEMA, PERSON), temperature=1.0, seed=seed
        )
        assert g.finish_reason == "stop", g.text
        validate(PERSON, g.text)


class _Recurring:
    """A memory in which every divergence pattern has recurred many times."""

    def record(self, patterns):
        pass

    def counts(self, patterns):
        return [1000 for _ in patterns]


def test_csd_never_rescues_a_token_the_grammar_forbids():
    vocab = 8
    raw = torch.zeros(2, vocab)
    raw[0, 3], raw[0, 4] = 2.0, 1.9  # the draft token 4 is nearly the target's choice 3: rescuable
    rule = calibrated_rule(_Recurring(), lambda_=6, tau=0.01)
    assert verify_greedy([4], raw, rule).tokens[0].provenance is Provenance.RESCUED
    allowed = torch.ones(2, vocab, dtype=torch.bool)
    allowed[0, 4] = False  # ... but the grammar forbids it there
    processing = LogitsProcessing(SamplingParams(max_tokens=4), [0], [7], vocab, torch.device("cpu"))
    masked = processing.apply(raw, draft=[4], generated=0, allowed=allowed)
    verdict = verify_greedy([4], masked, rule)
    assert [(t.token_id, t.provenance) for t in verdict.tokens] == [(3, Provenance.RECOVERED)]
    assert math.isinf(float(masked[0, 4]))


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint(ConstraintKind.JSON_SCHEMA, {"type": "object", "properties": {"a": {"type": "nonsense"}}}),
        Constraint(ConstraintKind.REGEX, "(unclosed"),
        Constraint(ConstraintKind.GRAMMAR, "start: undefined_rule"),
        Constraint(ConstraintKind.CHOICE, ()),
    ],
    ids=["schema", "regex", "lark", "empty-choice"],
)
def test_invalid_constraints_are_user_errors(embedded, constraint):
    with pytest.raises(DecodingError):
        model_grammar(embedded).check(constraint)


def test_objects_that_list_their_properties_are_closed_unless_they_say_otherwise():
    from service.decoding.grammar import closed_objects

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "free": {"type": "object"},
        },
        "$defs": {"d": {"properties": {"x": {}}, "additionalProperties": True}},
        "anyOf": [{"properties": {"y": {}}}, {"patternProperties": {"^z": {}}, "properties": {"z1": {}}}],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["free"]  # a free-form object stays free
    assert closed["$defs"]["d"]["additionalProperties"] is True  # what a schema says, it keeps
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["anyOf"][1]
    assert "additionalProperties" not in schema  # the caller's schema is left alone


def test_a_pydantic_style_schema_cannot_grow_invented_keys(embedded):
    tok = embedded.tokenizer
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
    }  # says nothing more
    matcher = model_grammar(embedded).matcher(Constraint(ConstraintKind.JSON_SCHEMA, schema))
    draft = tok.encode('{"n": 1, "', add_special_tokens=False)
    valid, _ = matcher.check_draft(draft)
    assert valid < len(draft)  # after the one property, only the closing brace
