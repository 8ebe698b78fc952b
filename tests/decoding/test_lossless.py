"""At temperature 0, strict speculative decoding emits exactly the target's greedy tokens.

Each comparison is token for token. Per CSD.md, a forward over k tokens may differ from k one-token
forwards in the last bits, so a genuine near-tie between two tokens could flip; where a comparison meets
one, `assert_same_tokens` shows the logit gap at the divergence (and fails unless it is below 1e-3)
instead of the check being loosened.
"""

from __future__ import annotations

import math

import pytest
import torch

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
from tests.conftest import make_tiny_model

PROMPTS = [
    "Rewrite in American spelling: The colour of the theatre's centre stage was grey, and the organisers "
    "apologised for the delay of the programme.",
    "Summarise in one sentence: The bridge opened in 1937. It is 2,737 metres long and links the city to "
    "the northern county. About 112,000 vehicles cross it every day.",
    # a long answer that repeats itself: multi-token rounds for the n-gram drafter, room to cut mid-round
    "Write the days of the week, one per line, twice.",
]
LONG = 2  # the prompt whose output runs to MAX_TOKENS
MAX_TOKENS = 32
NEAR_TIE = 1e-3  # logit gap below which a flip between batched and one-token forwards is floating point

# One torch thread: see the fixture (on shared cores a second thread makes each forward several times slower).
pytestmark = pytest.mark.usefixtures("single_thread")


def run(engine, ids, method, drafter="ngram", max_tokens=MAX_TOKENS, stop=(), **spec):
    sampling = SamplingParams(max_tokens=max_tokens, stop=tuple(stop))
    g = engine.generate(ids, sampling, SpeculativeConfig(method=method, **spec), drafter)
    for _ in run_alone(g):
        pass
    return g


def token_ids(generation) -> list[int]:
    return [t.token_id for t in generation.tokens]


def assert_same_tokens(target, prompt_ids, got: list[int], expected: list[int]) -> None:
    """got == expected, or a mismatch at a genuine near-tie, which is shown rather than hidden."""
    if got == expected:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if i is None:  # one is a prefix of the other
        pytest.fail(f"lengths differ: {len(got)} tokens vs {len(expected)}")
    with torch.inference_mode():
        row = target.model(input_ids=torch.tensor([prompt_ids + expected[:i]])).logits[0, -1].float()
    gap = abs(float(row[got[i]] - row[expected[i]]))
    tok = target.tokenizer
    detail = (
        f"first difference at generated position {i}: {tok.decode([got[i]])!r} vs "
        f"{tok.decode([expected[i]])!r}, logit gap {gap:.2e}"
    )
    assert gap < NEAR_TIE, f"not lossless: {detail}"
    pytest.xfail(f"genuine near-tie (fp32 batched vs one-token forward): {detail}")


@pytest.fixture(scope="module")
def engine(embedded):
    store = InMemoryStore()
    drafters = {
        "ngram": NgramDrafter(),
        "tiny": ModelDrafter(make_tiny_model(embedded)),
        "self": ModelDrafter(embedded),
        "head": HeadDrafter(embedded, EMBEDDED_HEAD_DIR),  # the shipped, trained head
    }
    drafters["combined"] = CombinedDrafter(drafters["ngram"], drafters["head"])
    memories = {name: store.memory(Namespace("t", name, "v")) for name in drafters}
    return Engine(embedded, drafters, memories)


@pytest.fixture(scope="module")
def prompt_ids(embedded):
    return [encode_chat(embedded.tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def vanilla(engine, prompt_ids):
    """Plain greedy decoding of each prompt, computed once: the reference every test compares with."""
    cache: dict[int, object] = {}

    def get(index: int):
        if index not in cache:
            cache[index] = run(engine, prompt_ids[index], "vanilla")
        return cache[index]

    return get


# A draft model costs a forward per draft token: the short answers are enough to show it is lossless (and,
# for the target drafting for itself, that it agrees with itself). The long answer is covered with several
# num_speculative_tokens below.
@pytest.mark.parametrize(
    "drafter, prompt",
    [
        ("ngram", 0),
        ("ngram", 1),
        ("tiny", 0),
        ("tiny", 1),
        ("self", 0),
        ("head", 0),
        ("head", 1),
        ("combined", 0),
    ],
)
def test_sd_equals_vanilla_greedy(engine, embedded, prompt_ids, vanilla, drafter, prompt):
    ids = prompt_ids[prompt]
    reference = vanilla(prompt)
    sd = run(engine, ids, "sd", drafter)
    assert_same_tokens(embedded, ids, token_ids(sd), token_ids(reference))
    assert sd.text == reference.text
    assert sd.stats.num_draft_tokens > 0
    if drafter == "self":  # the target drafting for itself is right nearly every time
        assert sd.stats.acceptance_rate > 0.9
    if drafter == "head":  # the trained head drafts what the target says far more often than chance
        # (1 in 8,192; its calibrated stop rule drafts little where it is unsure, so acceptance is the sharper
        # check). Measured with the shipped head (Magpie corpus, fused) in bf16: 2/12 on prompt 0 (an 11-token
        # spelling rewrite, 1.2 tokens per forward) and 8/16 on prompt 1 (1.89); the template-corpus head
        # before it kept 4/11 and 6/20.
        assert sd.stats.acceptance_rate >= 0.15 and sd.stats.tokens_per_forward >= 1.15, sd.stats.as_dict()


@pytest.mark.parametrize(
    "drafter, k, prompt",
    [
        ("ngram", 1, LONG),
        ("ngram", 3, LONG),
        ("ngram", 8, LONG),
        ("tiny", 8, 0),
        ("head", 8, LONG),
        ("combined", 3, LONG),
    ],
)
def test_sd_equals_vanilla_for_any_num_speculative_tokens(
    engine, embedded, prompt_ids, vanilla, drafter, k, prompt
):
    sd = run(engine, prompt_ids[prompt], "sd", drafter, num_speculative_tokens=k)
    assert_same_tokens(embedded, prompt_ids[prompt], token_ids(sd), token_ids(vanilla(prompt)))
    assert len(sd.stats.accepted_per_position) <= k
    assert sd.stats.num_draft_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 6, 13])
def test_sd_cut_by_max_tokens_mid_round_equals_vanilla_prefix(
    engine, embedded, prompt_ids, vanilla, max_tokens
):
    """k = 8 drafts more than the budget leaves; the output is vanilla's first max_tokens tokens."""
    reference = token_ids(vanilla(LONG))
    assert len(reference) == MAX_TOKENS  # the reference itself was not cut short by EOS
    sd = run(engine, prompt_ids[LONG], "sd", max_tokens=max_tokens, num_speculative_tokens=8)
    assert_same_tokens(embedded, prompt_ids[LONG], token_ids(sd), reference[:max_tokens])
    assert sd.finish_reason == "length"


def test_sd_with_stop_string_equals_vanilla(engine, embedded, prompt_ids, vanilla):
    reference = vanilla(LONG)
    text = reference.text
    # a stop string from the middle of the output (the first occurrence is where both must stop)
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert stop.strip()
    sd = run(engine, prompt_ids[LONG], "sd", stop=[stop], num_speculative_tokens=8)
    assert sd.text == text[: text.index(stop)]
    assert sd.finish_reason == "stop"
    # the tokens are vanilla's, up to (and including) the one that completed the stop string
    assert_same_tokens(embedded, prompt_ids[LONG], token_ids(sd), token_ids(reference)[: len(sd.tokens)])


@pytest.mark.parametrize(
    "method, spec",
    [
        # threshold 1: p(d) >= p(t*) for d != t* only on an exact tie
        ("lossy", {"lossy_threshold": 1.0}),
        # frequency gate wide open (lambda 0), semantic gate shut (tau 1): nothing can pass
        ("csd", {"lambda_": 0, "tau": 1.0}),
        # frequency gate shut (lambda infinity), default semantic gate: the memory learns, never rescues
        ("csd", {"lambda_": math.inf}),
    ],
)
def test_rescue_rules_that_admit_nothing_equal_sd(engine, embedded, prompt_ids, vanilla, method, spec):
    """The tiny random drafter is rejected nearly every time, so the rule is consulted at nearly every
    round. Compared with vanilla, which test_sd_equals_vanilla_greedy shows `sd` equals on this prompt."""
    ids = prompt_ids[0]
    other = run(engine, ids, method, "tiny", **spec)
    assert_same_tokens(embedded, ids, token_ids(other), token_ids(vanilla(0)))
    assert other.stats.num_rescued == 0
    # the rule was really consulted: there were rejections for it to judge
    assert other.stats.num_recovered >= len(other.tokens) // 2


def test_sd_with_adaptive_draft_policy_equals_vanilla(embedded, prompt_ids, vanilla):
    """The policy only shortens drafts; strict verification stays lossless whatever it chooses."""
    from service.decoding import DraftPolicy

    policy = DraftPolicy([1.0, 1.8, 1.9, 2.0, 2.0, 2.1, 2.1], explore_every=3)
    engine = Engine(embedded, {"ngram": NgramDrafter()}, policy=policy)
    sd = run(engine, prompt_ids[1], "sd")
    assert_same_tokens(embedded, prompt_ids[1], token_ids(sd), token_ids(vanilla(1)))


def test_a_real_mismatch_is_not_taken_for_a_near_tie(embedded, prompt_ids, vanilla):
    """The near-tie escape of assert_same_tokens only opens for a gap below NEAR_TIE."""
    reference = token_ids(vanilla(0))
    with torch.inference_mode():
        row = embedded.model(input_ids=torch.tensor([prompt_ids[0] + reference[:2]])).logits[0, -1]
    wrong = reference[:2] + [int(row.argmin())] + reference[3:]
    with pytest.raises(AssertionError, match="not lossless: first difference at generated position 2"):
        assert_same_tokens(embedded, prompt_ids[0], wrong, reference)
