"""Table tests of each verification rule on hand-built logits (no model involved)."""

from __future__ import annotations

import math

import pytest
import torch

from ocm_store import InMemoryStore, Namespace
from service.decoding.fact_guard import fact_class, model_token_classes
from service.decoding.types import Provenance
from service.decoding.verification import (
    calibrated_rule,
    lossy_rule,
    recording_rule,
    sampling_probs,
    token_set_guard,
    verify_greedy,
    verify_sampling,
)

V = 8

# many tiny ops: a second torch thread only adds synchronisation (see the fixture)
pytestmark = pytest.mark.usefixtures("single_thread")
NS = Namespace("target", "ngram", "vocab")


def logits_rows(*rows: dict[int, float]) -> torch.Tensor:
    """Each row: {token: logit}; unspecified tokens get -10."""
    out = torch.full((len(rows), V), -10.0)
    for i, row in enumerate(rows):
        for token, value in row.items():
            out[i, token] = value
    return out


def memory_with(count: int, pattern=(3, 5)):
    store = InMemoryStore()
    mem = store.memory(NS)
    for _ in range(count):
        mem.record([pattern])
    return store, mem


def provenances(verdict):
    return [(t.token_id, t.provenance) for t in verdict.tokens]


# rows: position 0 predicts after `last`, position i after d_i
ALL_MATCH = logits_rows({1: 5.0}, {2: 5.0}, {4: 5.0})
MISMATCH_AT_1 = logits_rows({1: 5.0}, {5: 5.0, 3: 4.0}, {4: 5.0})  # target prefers 5, draft says 3


def test_strict_all_accepted_adds_bonus():
    v = verify_greedy([1, 2], ALL_MATCH)
    assert provenances(v) == [(1, Provenance.ACCEPTED), (2, Provenance.ACCEPTED), (4, Provenance.BONUS)]
    assert (v.round.num_accepted, v.round.num_bonus, v.round.num_recovered) == (2, 1, 0)
    assert v.round.kept_per_position == [True, True]


def test_strict_mismatch_recovers_target_token_and_ends_round():
    v = verify_greedy([1, 3], MISMATCH_AT_1)
    assert provenances(v) == [(1, Provenance.ACCEPTED), (5, Provenance.RECOVERED)]
    assert v.round.kept_per_position == [True, False]


def test_no_draft_is_a_plain_token():
    v = verify_greedy([], logits_rows({6: 1.0}))
    assert provenances(v) == [(6, Provenance.PLAIN)]
    assert v.round.num_draft_tokens == 0 and v.round.num_bonus == 0


@pytest.mark.parametrize(
    "count, lam, expect_rescue",
    [
        (6, 6, True),  # recorded once more in the round -> 7 > 6
        (5, 6, False),  # 6 > 6 is false: not yet a recurring divergence
        (0, 0, True),  # lambda 0: the first sighting is enough
        (100, math.inf, False),  # lambda infinity: never rescues (equals sd)
    ],
)
def test_calibrated_frequency_gate(count, lam, expect_rescue):
    store, mem = memory_with(count)
    v = verify_greedy([1, 3], MISMATCH_AT_1, calibrated_rule(mem, lam, tau=0.01))
    if expect_rescue:
        assert provenances(v) == [(1, Provenance.ACCEPTED), (3, Provenance.RESCUED), (4, Provenance.BONUS)]
        assert v.tokens[1].replaced_token_id == 5
        assert v.round.num_rescued == 1 and v.round.kept_per_position == [True, True]
    else:
        assert provenances(v) == [(1, Provenance.ACCEPTED), (5, Provenance.RECOVERED)]
    # the pattern is counted before the gates, whatever they decide
    assert store.counts(NS, [(3, 5)]) == [count + 1]


def test_calibrated_semantic_gate_blocks_implausible_token():
    store, mem = memory_with(50)
    # z[3] - z[5] = -6 < log(0.01) = -4.6: the target does not find the draft plausible
    far = logits_rows({1: 5.0}, {5: 5.0, 3: -1.0}, {4: 5.0})
    v = verify_greedy([1, 3], far, calibrated_rule(mem, 6, tau=0.01))
    assert provenances(v) == [(1, Provenance.ACCEPTED), (5, Provenance.RECOVERED)]
    # with a laxer tau (e^-6 < 0.003) the same token is rescued
    v = verify_greedy([1, 3], far, calibrated_rule(mem, 6, tau=0.002))
    assert v.tokens[1].provenance is Provenance.RESCUED


def test_rescue_then_further_acceptance_and_second_mismatch():
    store, mem = memory_with(10)
    # d = [3, 4, 7]: 3 rescued at position 0, 4 accepted at 1, 7 rejected at 2 (no memory for (7, 2))
    logits = logits_rows({5: 5.0, 3: 4.5}, {4: 5.0}, {2: 5.0, 7: 4.9}, {0: 1.0})
    v = verify_greedy([3, 4, 7], logits, calibrated_rule(mem, 6, tau=0.01))
    assert provenances(v) == [(3, Provenance.RESCUED), (4, Provenance.ACCEPTED), (2, Provenance.RECOVERED)]
    assert v.round.kept_per_position == [True, True, False]
    assert v.round.accepted_per_position == [False, True, False]  # a rescued token is kept, not accepted
    assert store.counts(NS, [(7, 2)]) == [1]


# Exact ties: the target's choice is argmax, which takes the lowest token id among equal logits (plain
# decoding does the same, so strict SD stays plain decoding). A draft token tied with the top is therefore
# accepted when its id is the lower one, and otherwise a divergence like any other, which CSD may rescue (its
# logit gap is 0 >= log tau for every tau <= 1) and strict SD replaces by the top.
TIE_AT_1 = logits_rows({1: 5.0}, {3: 5.0, 5: 5.0}, {4: 5.0})  # tokens 3 and 5 tie after d_1


def test_a_draft_token_tied_with_the_top_and_of_lower_id_is_accepted():
    v = verify_greedy([1, 3], TIE_AT_1)
    assert provenances(v) == [(1, Provenance.ACCEPTED), (3, Provenance.ACCEPTED), (4, Provenance.BONUS)]


def test_a_draft_token_tied_with_the_top_and_of_higher_id_is_a_divergence():
    strict = verify_greedy([1, 5], TIE_AT_1)
    assert provenances(strict) == [(1, Provenance.ACCEPTED), (3, Provenance.RECOVERED)]
    _, mem = memory_with(5, pattern=(5, 3))
    rescued = verify_greedy([1, 5], TIE_AT_1, calibrated_rule(mem, lambda_=4, tau=1.0))
    assert provenances(rescued) == [(1, Provenance.ACCEPTED), (5, Provenance.RESCUED), (4, Provenance.BONUS)]
    assert rescued.tokens[1].replaced_token_id == 3


def test_lossy_threshold_is_relative_to_top():
    close = logits_rows({5: 5.0, 3: 5.0 + math.log(0.7)}, {4: 1.0})  # p(3)/p(5) = 0.7
    far = logits_rows({5: 5.0, 3: 5.0 + math.log(0.5)}, {4: 1.0})  # 0.5 < 0.6
    assert verify_greedy([3], close, lossy_rule(0.6)).tokens[0].provenance is Provenance.RESCUED
    assert provenances(verify_greedy([3], far, lossy_rule(0.6))) == [(5, Provenance.RECOVERED)]


def test_recording_rule_counts_but_never_keeps():
    store, mem = memory_with(0)
    v = verify_greedy([1, 3], MISMATCH_AT_1, recording_rule(mem))
    assert provenances(v) == [(1, Provenance.ACCEPTED), (5, Provenance.RECOVERED)]
    assert store.counts(NS, [(3, 5)]) == [1]


def test_sampling_rejection_sampler_matches_target_distribution():
    """Leviathan/Chen: the first emitted token follows the target distribution whatever the draft."""
    gen = torch.Generator().manual_seed(0)
    target_logits = torch.randn(3, V, generator=gen)
    draft_probs = torch.softmax(torch.randn(2, V, generator=gen), dim=-1)
    expected = torch.softmax(target_logits[0], dim=-1)
    n = 20000
    counts = torch.zeros(V)
    for _ in range(n):
        draft = [
            int(torch.multinomial(draft_probs[0], 1, generator=gen)),
            int(torch.multinomial(draft_probs[1], 1, generator=gen)),
        ]
        v = verify_sampling(draft, draft_probs, target_logits, 1.0, 1.0, gen)
        counts[v.tokens[0].token_id] += 1
    empirical = counts / n
    # 4 standard errors per cell
    tolerance = 4 * torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((empirical - expected).abs() <= tolerance), (empirical, expected)


def test_sampling_point_mass_draft_matches_target_distribution():
    gen = torch.Generator().manual_seed(1)
    target_logits = torch.randn(2, V, generator=gen)
    expected = torch.softmax(target_logits[0], dim=-1)
    n = 20000
    counts = torch.zeros(V)
    for _ in range(n):
        v = verify_sampling([2], None, target_logits, 1.0, 1.0, gen)  # an n-gram drafter always says 2
        counts[v.tokens[0].token_id] += 1
    tolerance = 4 * torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((counts / n - expected).abs() <= tolerance)


def test_the_fact_guard_never_rescues_a_guarded_token_but_still_records_it():
    store, mem = memory_with(10)
    # 3 would be rescued over 5 (a recurring pattern, plausible); guarding either token refuses it
    for guarded in ({3}, {5}):
        v = verify_greedy(
            [1, 3], MISMATCH_AT_1, calibrated_rule(mem, 6, 0.01, [token_set_guard(frozenset(guarded))])
        )
        assert provenances(v) == [(1, Provenance.ACCEPTED), (5, Provenance.RECOVERED)]
    v = verify_greedy([1, 3], MISMATCH_AT_1, calibrated_rule(mem, 6, 0.01, [token_set_guard(frozenset({7}))]))
    assert v.tokens[1].provenance is Provenance.RESCUED
    assert store.counts(NS, [(3, 5)]) == [13]  # each of the three rounds recorded the pattern


@pytest.mark.parametrize(
    "text, expected",
    [
        (" 1", "number"),
        ("7", "number"),
        (" twenty", "number"),
        (" not", "negation"),
        ("n't", "negation"),
        (" Paris", "name"),
        (" Lindqvist", "name"),
        (" The", None),
        (" colour", None),
        (",", None),
        ("\n", None),
    ],
)
def test_fact_classes(text, expected):
    assert fact_class(text) == expected


def test_the_guarded_vocabulary_of_the_embedded_model(embedded):
    ids = model_token_classes(embedded).fact_ids
    tok = embedded.tokenizer
    # the last token of each text carries the digit or the word (SmolLM2 splits " 2" into " " and "2")
    for text in (" 2", " 0", " not", " never", " London"):
        assert tok.encode(text, add_special_tokens=False)[-1] in ids, text
    for text in (" the", " colour", " color", ",", " The"):
        assert tok.encode(text, add_special_tokens=False)[-1] not in ids, text


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45, 1e-8])
def test_a_vanishing_top_p_keeps_the_top_token(top_p):
    """top_p below float32's range became 0.0 and dropped every token (nan probabilities, a 500)."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.0, 0.0, 5.0]])
    probs = sampling_probs(logits, 0.7, top_p)
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]))


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324, 1e-6])
def test_a_vanishing_temperature_decodes_greedily(embedded, temperature):
    """Any temperature the API accepts must decode: one so small that logits / T overflows is greedy."""
    from service.decoding import Engine, SamplingParams, SpeculativeConfig, run_alone

    sampling = SamplingParams(max_tokens=6, temperature=temperature, seed=1)
    assert sampling.greedy
    engine = Engine(embedded)
    ids = embedded.tokenizer.encode("The capital of France is")
    g = engine.generate(ids, sampling, SpeculativeConfig(method="vanilla"))
    list(run_alone(g))
    ref = engine.generate(ids, SamplingParams(max_tokens=6), SpeculativeConfig(method="vanilla"))
    list(run_alone(ref))
    assert [t.token_id for t in g.tokens] == [t.token_id for t in ref.tokens]
