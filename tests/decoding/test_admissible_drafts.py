"""Drafts cut where nothing can follow (issue 33, item 4): after a token that ends the generation (EOS, a stop
token id) and before a special token that does not (a chat template's turn start), whatever the drafter; the
output stays the target's."""

from __future__ import annotations

import pytest

from service.decoding import Engine, NgramDrafter, SamplingParams, SpeculativeConfig, run_alone
from service.decoding.drafters.base import Draft, DraftRow
from service.decoding.generation import Generation
from service.decoding.text import encode_chat

pytestmark = pytest.mark.usefixtures("single_thread")

# the answer repeats the end of the question, so prompt lookup continues it past the user's turn
QUESTION = "Repeat this line exactly: the red fox ran over the old stone bridge"


@pytest.fixture(scope="module")
def engine(embedded):
    return Engine(embedded, {"ngram": NgramDrafter()})


@pytest.fixture(scope="module")
def ids(embedded):
    return encode_chat(embedded.tokenizer, [{"role": "user", "content": QUESTION}])


def special(embedded, text: str) -> int:
    return embedded.tokenizer.convert_tokens_to_ids(text)


def test_a_draft_ends_with_its_first_eos_and_stops_before_a_turn_start(engine, embedded, ids):
    generation = engine.generate(ids, SamplingParams(max_tokens=8), SpeculativeConfig("sd"), "ngram")
    end, start = special(embedded, "<|im_end|>"), special(embedded, "<|im_start|>")
    assert end in generation.eos_ids and start not in generation.eos_ids
    words = embedded.tokenizer(" the red fox")["input_ids"]
    assert generation.admissible(Draft([*words, end, 198, start])).tokens == [*words, end]
    assert generation.admissible(Draft([*words, start, *words])).tokens == words
    assert generation.admissible(Draft(words)).tokens == words
    with_stop = engine.generate(
        ids, SamplingParams(max_tokens=8, stop_token_ids=[words[1]]), SpeculativeConfig("sd"), "ngram"
    )
    assert with_stop.admissible(Draft(words)).tokens == words[:2]


def test_prompt_lookup_proposes_the_turn_start_and_the_batch_never_drafts_it(
    engine, embedded, ids, monkeypatch
):
    # the real n-gram drafter, after the answer has repeated the question's last words: it continues into
    # the template's "<|im_end|>\n<|im_start|>assistant"
    end, start = special(embedded, "<|im_end|>"), special(embedded, "<|im_start|>")
    tail = embedded.tokenizer(" the old stone bridge")["input_ids"]
    committed = [*ids, *tail]
    row = DraftRow(object(), committed, 6, SamplingParams(), None, None)
    proposed = NgramDrafter().rows().propose([row])[0]
    assert start in proposed.tokens and end in proposed.tokens
    generation = engine.generate(ids, SamplingParams(max_tokens=8), SpeculativeConfig("sd"), "ngram")
    cut = generation.admissible(proposed)
    assert start not in cut.tokens and cut.tokens[-1] == end
    # served end to end: every round's draft passes through the cut before the forward (a spy on the real
    # method records what it let through), and strict SD is still vanilla
    let_through: list[list[int]] = []
    original = Generation.admissible

    def spy(self, draft):
        kept = original(self, draft)
        let_through.append(kept.tokens)
        return kept

    monkeypatch.setattr(Generation, "admissible", spy)
    sd = engine.generate(ids, SamplingParams(max_tokens=40), SpeculativeConfig("sd"), "ngram")
    rounds = list(run_alone(sd))
    assert len(let_through) == len(rounds) and not any(start in tokens for tokens in let_through)
    vanilla = engine.generate(ids, SamplingParams(max_tokens=40), SpeculativeConfig("vanilla"), "ngram")
    list(run_alone(vanilla))
    assert [t.token_id for t in sd.tokens] == [t.token_id for t in vanilla.tokens]
    assert sd.stats.num_draft_tokens > 0 and rounds
