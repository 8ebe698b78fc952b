"""The statistics add up (issue 13, finding 12): for every method and drafter, greedy and sampled, however a
generation ends (EOS, the token budget mid-round, a stop string), the counters equal the provenance list of
the tokens emitted, each counter as `GenerationStats` defines it, and vanilla decodes one token per forward.

A response had said 4 accepted + 2 bonus while its provenance listed 2 accepted + 1 bonus: the counters
counted what a round verified, also past the EOS or the budget that cut it short.
"""

from __future__ import annotations

from collections import Counter

import pytest

from ocm_store import InMemoryStore, Namespace
from service.decoding import (
    CombinedDrafter,
    Engine,
    HeadDrafter,
    ModelDrafter,
    NgramDrafter,
    SamplingParams,
    SpeculativeConfig,
    run_alone,
)
from service.decoding.draft_head import EMBEDDED_HEAD_DIR
from service.decoding.text import encode_chat
from service.decoding.types import Provenance
from tests.conftest import make_tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

REPEATS = "Write the days of the week, one per line, twice."
ENDINGS = {
    # (prompt, max_tokens, stop): an answer that ends with EOS, one cut by the budget in the middle of a
    # multi-token round (the n-gram drafter predicts the second week), one cut by a stop string
    "eos": ("Say hello in French. One word.", 48, ()),
    "budget": (REPEATS, 19, ()),
    "stop": (REPEATS, 48, ("Friday",)),
}
DRAFTERS = ("ngram", "model", "head", "combined")
CASES = [("vanilla", None), ("lossy", "ngram")] + [(m, d) for m in ("sd", "csd") for d in DRAFTERS]


@pytest.fixture(scope="module")
def engine(embedded):
    store = InMemoryStore()
    drafters = {
        "ngram": NgramDrafter(),
        "model": ModelDrafter(make_tiny_model(embedded)),
        "head": HeadDrafter(embedded, EMBEDDED_HEAD_DIR),
    }
    drafters["combined"] = CombinedDrafter(drafters["ngram"], drafters["head"])
    memories = {name: store.memory(Namespace("t", name, "v")) for name in drafters}
    return Engine(embedded, drafters, memories)


def assert_counters_match_provenance(generation, rounds) -> None:
    stats, tokens = generation.stats, generation.tokens
    by = Counter(t.provenance for t in tokens)
    assert stats.completion_tokens == len(tokens) == sum(len(s.tokens) for s in rounds)
    assert stats.num_accepted == by[Provenance.ACCEPTED]
    assert stats.num_rescued == by[Provenance.RESCUED]
    assert stats.num_recovered == by[Provenance.RECOVERED]
    assert stats.num_bonus == by[Provenance.BONUS]
    assert sum(by.values()) == stats.completion_tokens
    assert stats.target_forwards == len(rounds)  # one GenerationRound per round, one round per forward
    assert stats.num_drafts == sum(1 for s in rounds if s.round.num_draft_tokens)
    assert stats.num_draft_tokens == sum(s.round.num_draft_tokens for s in rounds)
    assert sum(stats.accepted_per_position) == stats.num_accepted
    assert sum(stats.kept_per_position) == stats.num_accepted + stats.num_rescued
    # every round's own statistics match the tokens that round emitted
    for decoded in rounds:
        round_by = Counter(t.provenance for t in decoded.tokens)
        assert (decoded.round.num_accepted, decoded.round.num_rescued) == (
            round_by[Provenance.ACCEPTED],
            round_by[Provenance.RESCUED],
        )
        assert decoded.round.num_recovered + decoded.round.num_bonus == (
            round_by[Provenance.RECOVERED] + round_by[Provenance.BONUS]
        )
    if generation.finish_reason == "length":
        assert stats.num_eos == 0
    elif not generation.sampling.stop:  # no stop string: a stop is the EOS
        assert stats.num_eos == 1
    decided = stats.completion_tokens + stats.num_eos
    assert stats.tokens_per_forward == pytest.approx(decided / stats.target_forwards)


@pytest.mark.parametrize(("method", "drafter"), CASES, ids=[f"{m}-{d}" for m, d in CASES])
@pytest.mark.parametrize("ending", list(ENDINGS))
def test_counters_equal_the_provenance_list(engine, embedded, method, drafter, ending):
    prompt, max_tokens, stop = ENDINGS[ending]
    ids = encode_chat(embedded.tokenizer, [{"role": "user", "content": prompt}])
    # lambda 0: CSD rescues a pattern from its second sighting on, so rescues happen in short answers
    spec = SpeculativeConfig(method=method, lambda_=0)
    samplings = [SamplingParams(max_tokens=max_tokens, stop=stop)]
    if ending == "budget":  # sampled too (rejection sampling's recovered and bonus tokens)
        samplings.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=7))
    for sampling in samplings:
        generation = engine.generate(ids, sampling, spec, drafter or "ngram")
        rounds = list(run_alone(generation))
        assert_counters_match_provenance(generation, rounds)
        if ending == "budget" and sampling.greedy and method in ("vanilla", "sd"):  # lossless: vanilla's text
            assert generation.finish_reason == "length" and len(generation.tokens) == max_tokens
        if method == "vanilla":
            assert generation.stats.tokens_per_forward == 1.0
            assert generation.stats.num_draft_tokens == 0
            assert {t.provenance for t in generation.tokens} == {Provenance.PLAIN}
