"""At temperature 0, strict speculative decoding emits exactly the target's greedy tokens."""

from __future__ import annotations

import math

import pytest

from ocm_store import InMemoryStore, Namespace
from service.decoding import Engine, ModelDrafter, NgramDrafter, SamplingParams, SpeculativeConfig
from service.decoding.text import encode_chat
from tests.conftest import make_tiny_model

PROMPTS = [
    "Rewrite in American spelling: The colour of the theatre's centre stage was grey, and the organisers "
    "apologised for the delay of the programme.",
    "Summarise in one sentence: The bridge opened in 1937. It is 2,737 metres long and links the city to "
    "the northern county. About 112,000 vehicles cross it every day.",
    "What is the capital of France?",
]


def run(engine, ids, method, drafter="ngram", max_tokens=48, **spec):
    g = engine.generate(
        ids, SamplingParams(max_tokens=max_tokens), SpeculativeConfig(method=method, **spec), drafter
    )
    for _ in g:
        pass
    return g


@pytest.fixture(scope="module")
def engine(embedded):
    store = InMemoryStore()
    ns = Namespace("t", "ngram", "v")
    drafters = {
        "ngram": NgramDrafter(),
        "tiny": ModelDrafter(make_tiny_model(embedded)),
        "self": ModelDrafter(embedded),
    }
    memories = {name: store.memory(Namespace("t", name, "v")) for name in drafters}
    del ns
    return Engine(embedded, drafters, memories)


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("drafter", ["ngram", "tiny", "self"])
def test_sd_equals_vanilla_greedy(engine, embedded, prompt, drafter):
    ids = encode_chat(embedded.tokenizer, [{"role": "user", "content": prompt}])
    vanilla = run(engine, ids, "vanilla")
    sd = run(engine, ids, "sd", drafter)
    assert [t.token_id for t in sd.tokens] == [t.token_id for t in vanilla.tokens]
    assert sd.text == vanilla.text
    assert sd.stats.num_draft_tokens > 0
    if drafter == "self":  # the target drafting for itself is right nearly every time
        assert sd.stats.acceptance_rate > 0.9


def test_csd_with_infinite_lambda_equals_sd(engine, embedded):
    ids = encode_chat(embedded.tokenizer, [{"role": "user", "content": PROMPTS[0]}])
    sd = run(engine, ids, "sd")
    csd = run(engine, ids, "csd", lambda_=math.inf)
    assert [t.token_id for t in csd.tokens] == [t.token_id for t in sd.tokens]
    assert csd.stats.num_rescued == 0


def test_sd_with_adaptive_draft_policy_equals_vanilla(embedded):
    """The policy only shortens drafts; strict verification stays lossless whatever it chooses."""
    from service.decoding import DraftPolicy

    policy = DraftPolicy([1.0, 1.8, 1.9, 2.0, 2.0, 2.1, 2.1], explore_every=3)
    engine = Engine(embedded, {"ngram": NgramDrafter()}, policy=policy)
    ids = encode_chat(embedded.tokenizer, [{"role": "user", "content": PROMPTS[1]}])
    vanilla = run(engine, ids, "vanilla")
    sd = run(engine, ids, "sd")
    assert [t.token_id for t in sd.tokens] == [t.token_id for t in vanilla.tokens]
