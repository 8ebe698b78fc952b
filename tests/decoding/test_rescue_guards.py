"""CSD's rescue guards: the turn guard and the context fact guard (hand-built logits and vocabularies, the
embedded SmolLM2 vocabulary, and one generation through the engine)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from ocm_store import InMemoryStore, Namespace
from service.decoding import Engine, ModelDrafter, SamplingParams, SpeculativeConfig, run_alone
from service.decoding.fact_guard import TokenClasses, fact_refusal, model_special_ids, model_token_classes
from service.decoding.types import Provenance
from service.decoding.verification import calibrated_rule, turn_guard, verify_greedy
from tests.conftest import make_word_model

pytestmark = pytest.mark.usefixtures("single_thread")
NS = Namespace("target", "drafter", "vocab")

# ---------------------------------------------------------------- the turn guard on hand-built logits

EOS, NEWLINE, WORD, OTHER, LAST = 0, 1, 2, 3, 4
V = 5


def rows(*tops: dict[int, float]) -> torch.Tensor:
    out = torch.full((len(tops), V), -10.0)
    for i, row in enumerate(tops):
        for token, value in row.items():
            out[i, token] = value
    return out


def learnt(pattern: tuple[int, int], count: int = 20):
    mem = InMemoryStore().memory(NS)
    for _ in range(count):
        mem.record([pattern])
    return mem


@pytest.mark.parametrize(
    "draft, top, rescued",
    [
        (NEWLINE, EOS, False),  # the target ended its turn: keeping the newline would run the answer on
        (EOS, WORD, False),  # a special token kept over the text the target chose
        (WORD, OTHER, True),  # text over text: the gates decide (here: rescued)
    ],
)
def test_turn_guard_table(draft, top, rescued):
    logits = rows({top: 5.0, draft: 4.5}, {LAST: 5.0})  # p(draft)/p(top) = 0.61: the SCG passes
    refused: Counter = Counter()
    rule = calibrated_rule(learnt((draft, top)), 6, 0.01, [turn_guard(frozenset({EOS}))], refused)
    v = verify_greedy([draft], logits, rule)
    kept = v.tokens[0]
    assert (kept.provenance is Provenance.RESCUED) is rescued
    assert kept.token_id == (draft if rescued else top)
    assert refused == (Counter() if rescued else Counter(turn=1))
    # without the guard the same round rescues: the table has power
    assert (
        verify_greedy([draft], logits, calibrated_rule(learnt((draft, top)), 6, 0.01)).round.num_rescued == 1
    )


def test_a_guard_is_asked_only_when_both_gates_pass():
    refused: Counter = Counter()
    rule = calibrated_rule(learnt((NEWLINE, EOS), count=3), 6, 0.01, [turn_guard(frozenset({EOS}))], refused)
    verify_greedy([NEWLINE], rows({EOS: 5.0, NEWLINE: 4.5}, {LAST: 5.0}), rule)  # 4 <= lambda: not recurring
    assert refused == Counter()


# ---------------------------------------------------------------- the fact guard, hand-built vocabulary

TEXTS = ["room", " ", "2", ".", ",", "1", "7", " on", " a", " the", " Cur", "ie", "ry", " colour", " color",
         " is", "\n", " Saturday", " May", " may", " not", "st", " and", " Paris", " London", "ing", " walk",
         "!"]  # fmt: skip
ID = {t: i for i, t in enumerate(TEXTS)}
HAND = TokenClasses.from_texts(TEXTS)


def ids(*texts: str) -> list[int]:
    return [ID[t] for t in texts]


@pytest.mark.parametrize(
    "before, draft, top, reason",
    [
        # "room 2.17" must not become "room 2,": a ',' where the target wanted '.', after a digit
        (("room", " ", "2"), ",", ".", "number"),
        (("room", " ", "2"), ".", " on", "number"),  # a '.' after a digit may be a decimal point
        (("room", " ", "2"), " on", "1", "fact"),  # ends the number the target continued
        (("1",), "st", " on", "number"),  # "1st": a suffix continues the number
        ((" on",), " a", " the", "determiner"),  # "on a Saturday" -> "on the ..."
        ((" on", " a"), " Saturday", " May", "fact"),  # a date
        ((" Cur",), "ry", "ie", "word"),  # breaks a name inside the word
        ((" Cur",), " is", "ie", "word"),  # ends a name the target continued
        ((" is",), " not", " a", "fact"),  # negation
        ((" walk",), " Paris", " London", "fact"),  # names
        # a sentence's end: where an answer may end ("... River Tessel." ran on as "... River Tessel, which")
        ((" Paris",), ",", ".", "sentence"),
        ((), ",", ".", "sentence"),
        ((" walk",), ".", " and", "sentence"),  # ends a sentence the target went on with
        ((" walk",), "!", ",", "sentence"),
        # what CSD is for: spelling, punctuation, formatting, a verb's form
        ((" the",), " colour", " color", None),
        ((" walk",), "\n", " on", None),
        ((" walk",), "ing", " on", None),  # a common word's ending
        ((" walk",), ",", " and", None),  # a connective for a comma
        ((" walk",), "!", ".", None),  # both end the sentence
        ((" may",), " walk", " is", None),  # "may" the verb is no date
    ],
)
def test_fact_refusal_table(before, draft, top, reason):
    assert fact_refusal(HAND, ids(*before), ID[draft], ID[top]) == reason


def test_the_context_reaches_back_over_a_split_name():
    # " Cur" "ie" + "ry"/"ie": the word in progress started with a name, two tokens back
    assert fact_refusal(HAND, ids(" Cur", "ie"), ID["ry"], ID["ing"]) == "word"
    # a common word split the same way is not guarded
    assert fact_refusal(HAND, ids(" walk", "ie"), ID["ry"], ID["ing"]) is None


# ---------------------------------------------------------------- the embedded model's vocabulary


def last_id(tok, text: str) -> int:
    return tok.encode(text, add_special_tokens=False)[-1]


def test_fact_refusal_on_smollm2_token_ids(embedded):
    tok, classes = embedded.tokenizer, model_token_classes(embedded)
    room_2 = tok.encode("The talk is in room 2", add_special_tokens=False)
    comma, dot = last_id(tok, "2,"), last_id(tok, "2.")
    assert tok.decode([comma]) == "," and tok.decode([dot]) == "."
    assert fact_refusal(classes, room_2, comma, dot) == "number"
    # after a name the two end it either way, but only the '.' ends the sentence (and may end the answer)
    assert fact_refusal(classes, tok.encode("in Paris", add_special_tokens=False), comma, dot) == "sentence"
    semicolon = last_id(tok, "Paris;")
    assert tok.decode([semicolon]) == ";"
    assert fact_refusal(classes, tok.encode("in Paris", add_special_tokens=False), comma, semicolon) is None
    the, a = last_id(tok, "on the"), last_id(tok, "on a")
    assert fact_refusal(classes, tok.encode("on", add_special_tokens=False), the, a) == "determiner"
    curie = tok.encode("Eve Curie", add_special_tokens=False)  # 'E' 've' ' Cur' 'ie'
    assert tok.decode(curie[-2:]) == " Curie"
    assert fact_refusal(classes, curie[:-1], tok.convert_tokens_to_ids("ry"), curie[-1]) == "word"
    colour, color = last_id(tok, " colour"), last_id(tok, " color")
    assert fact_refusal(classes, tok.encode("the", add_special_tokens=False), colour, color) is None
    # the chat end-of-turn and end-of-text are special: the turn guard's, never text
    newline, im_end = last_id(tok, "\n"), tok.convert_tokens_to_ids("<|im_end|>")
    assert {im_end, tok.eos_token_id} <= model_special_ids(embedded)
    assert newline not in model_special_ids(embedded)
    assert turn_guard(model_special_ids(embedded))([], newline, im_end) == "turn"


# ---------------------------------------------------------------- end to end through the engine

WORD_PROMPTS = [[2, 3, 4], [9, 10, 11], [2, 9, 5, 6], [3, 7, 8], [6, 7, 2, 3], [10, 4, 5], [8, 9, 3, 11]]


def _generate(engine, prompt, guard_turns: bool):
    # lambda 0 and a vanishing tau: every divergence is rescued unless a guard refuses it
    spec = SpeculativeConfig(method="csd", lambda_=0, tau=1e-30, guard_facts=False, guard_turns=guard_turns)
    generation = engine.generate(prompt, SamplingParams(max_tokens=24), spec, drafter="other")
    for _ in run_alone(generation):
        pass
    return generation


def test_no_rescue_over_the_end_of_turn_through_the_engine():
    """A random word-level target and another random model as drafter: with every rescue allowed, CSD
    keeps the draft wherever it differs, so where the target chose EOS the draft's word would run on."""
    target, other = make_word_model(seed=0), make_word_model(seed=1)
    eos = target.tokenizer.eos_token_id
    runs: dict[bool, list] = {True: [], False: []}
    for guard_turns in (True, False):
        memory = InMemoryStore().memory(NS)
        engine = Engine(target, {"other": ModelDrafter(other)}, {"other": memory})
        runs[guard_turns] = [_generate(engine, prompt, guard_turns) for prompt in WORD_PROMPTS]
    guarded_refusals = sum(g.refused_rescues["turn"] for g in runs[True])
    for generation in runs[True]:
        rescued = [t.replaced_token_id for t in generation.tokens if t.provenance is Provenance.RESCUED]
        assert eos not in rescued
    # the runs decide alike until the guard refuses a rescue the unguarded run makes: over EOS (the guarded
    # answer ends there, the unguarded one runs on), over another special token the target chose (the
    # guarded answer has the target's token), or of the draft's own EOS (the unguarded answer ends early)
    parted = 0
    for guarded, unguarded in zip(runs[True], runs[False], strict=True):
        mine, theirs = [t.token_id for t in guarded.tokens], unguarded.tokens
        i = next(
            (i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b.token_id),
            min(len(mine), len(theirs)),
        )
        if i == len(mine) == len(theirs):
            continue
        parted += 1
        if i == len(theirs):
            # the unguarded run rescued the draft's own EOS there: it ended, the target had not
            assert unguarded.finish_reason == "stop" and len(mine) > i
            continue
        assert theirs[i].provenance is Provenance.RESCUED
        if i == len(mine):
            assert theirs[i].replaced_token_id == eos and guarded.finish_reason == "stop"
        else:
            assert mine[i] == theirs[i].replaced_token_id and mine[i] in model_special_ids(target)
    # the test has power: unguarded, CSD did rescue over EOS; guarded, the guard refused rescues
    unguarded_over_eos = sum(t.replaced_token_id == eos for g in runs[False] for t in g.tokens)
    assert unguarded_over_eos > 0 and guarded_refusals > 0 and parted > 0
