"""Logit processing per verified position: table tests on hand-built logits, then the lossless property
through the engine: strict speculative decoding with penalties equals plain decoding with them."""

from __future__ import annotations

import pytest
import torch

from service.decoding import (
    SamplingParams,
    SpeculativeConfig,
)
from service.decoding.engine import run_to_end
from service.decoding.processing import LogitsProcessing
from service.decoding.text import encode_chat
from service.decoding.types import DecodingError
from tests.conftest import engine_with_drafters

pytestmark = pytest.mark.usefixtures("single_thread")

V = 6
EOS = 5


def processing(prompt=(0,), **kw) -> LogitsProcessing:
    return LogitsProcessing(SamplingParams(max_tokens=8, **kw), list(prompt), [EOS], V, torch.device("cpu"))


def test_frequency_and_presence_count_the_draft_prefix_of_each_row():
    p = processing(frequency_penalty=1.0, presence_penalty=0.5)
    p.commit([1, 1])  # token 1 generated twice already
    logits = torch.zeros(3, V)
    out = p.apply(logits, draft=[2, 2], generated=2)
    # row 0: only the committed output; row 1: + draft[0] = 2; row 2: + 2 again
    assert out[0].tolist() == [0, -2.5, 0, 0, 0, 0]
    assert out[1].tolist() == [0, -2.5, -1.5, 0, 0, 0]
    assert out[2].tolist() == [0, -2.5, -2.5, 0, 0, 0]
    assert logits.eq(0).all(), "the raw logits are left alone"


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    p = processing(prompt=(0,), repetition_penalty=2.0)
    logits = torch.tensor([[4.0, 4.0, -4.0, -4.0, 1.0, 1.0]] * 2)
    out = p.apply(logits, draft=[2], generated=0)
    assert out[0].tolist() == [2.0, 4.0, -4.0, -4.0, 1.0, 1.0]  # the prompt's token 0 only
    assert out[1].tolist() == [2.0, 4.0, -8.0, -4.0, 1.0, 1.0]  # + draft token 2 in row 1


def test_min_tokens_masks_eos_until_enough_tokens_but_never_every_token():
    p = processing(min_tokens=2)
    out = p.apply(torch.zeros(3, V), draft=[1, 1], generated=1)
    assert out[0, EOS] == float("-inf") and out[1, EOS] == 0 and out[2, EOS] == 0
    only_eos = torch.full((1, V), float("-inf"))
    only_eos[0, EOS] = 0.0
    allowed = torch.zeros(1, V, dtype=torch.bool)
    allowed[0, EOS] = True  # a finished grammar allows EOS alone: min_tokens must not forbid everything
    assert p.apply(only_eos, draft=[], generated=0, allowed=allowed)[0, EOS] == 0


def test_logit_bias_and_grammar_mask():
    p = processing(logit_bias=((3, 100.0), (4, -100.0)))
    allowed = torch.tensor([[True, True, False, True, True, True]])
    out = p.apply(torch.zeros(1, V), draft=[], generated=0, allowed=allowed)
    assert out[0].tolist() == [0, 0, float("-inf"), 100, -100, 0]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_tokens=9), "min_tokens"),
        (dict(logprobs=21), "logprobs"),
        (dict(logit_bias=((1, 101.0),)), "logit_bias"),
    ],
)
def test_out_of_range_parameters_are_refused(kw, match):
    with pytest.raises(DecodingError, match=match):
        SamplingParams(max_tokens=8, **kw)


# ---------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def engine(embedded):
    return engine_with_drafters(embedded)


@pytest.fixture(scope="module")
def ids(embedded):
    content = "List five fruits, then list them again in reverse order."
    return encode_chat(embedded.tokenizer, [{"role": "user", "content": content}])


def generate(engine, ids, method, drafter="combined", **kw):
    g = engine.generate(ids, SamplingParams(max_tokens=40, **kw), SpeculativeConfig(method=method), drafter)
    return run_to_end(g)


@pytest.mark.parametrize(
    "kw",
    [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.8, presence_penalty=0.6),
        dict(presence_penalty=-1.0),
        dict(logit_bias=((11, 4.0),), min_tokens=30),
    ],
    ids=["repetition", "frequency+presence", "negative-presence", "bias+min_tokens"],
)
@pytest.mark.parametrize("drafter", ["ngram", "combined"])
def test_sd_with_processing_equals_vanilla_with_it(engine, embedded, ids, kw, drafter):
    plain = generate(engine, ids, "vanilla", **kw)
    sd = generate(engine, ids, "sd", drafter, **kw)
    unprocessed = generate(engine, ids, "vanilla")
    assert [t.token_id for t in sd.tokens] == [t.token_id for t in plain.tokens]
    if drafter == "combined":  # the head always drafts (prompt lookup may find nothing to copy)
        assert sd.stats.num_accepted > 0
    # the processing changed the output (else this test could not fail)
    assert [t.token_id for t in plain.tokens] != [t.token_id for t in unprocessed.tokens]


def test_stop_token_ids_and_ignore_eos(engine, embedded, ids):
    plain = generate(engine, ids, "vanilla")
    stop_at = plain.tokens[5].token_id
    stopped = generate(engine, ids, "sd", stop_token_ids=(stop_at,))
    first = next(i for i, t in enumerate(plain.tokens) if t.token_id == stop_at)
    assert [t.token_id for t in stopped.tokens] == [t.token_id for t in plain.tokens[:first]]
    assert stopped.finish_reason == "stop"
    short = encode_chat(
        embedded.tokenizer, [{"role": "user", "content": "Answer with one word: what colour is the sky?"}]
    )
    ended = generate(engine, short, "sd")
    assert ended.finish_reason == "stop" and len(ended.tokens) < 40
    ignored = generate(engine, short, "sd", ignore_eos=True)
    assert ignored.finish_reason == "length" and len(ignored.tokens) == 40


def test_logprobs_are_the_processed_distribution_of_each_emitted_token(engine, embedded, ids):
    g = generate(engine, ids, "sd", logprobs=3, frequency_penalty=0.5)
    assert g.stats.num_accepted > 0  # accepted draft tokens carry logprobs like the others
    committed = list(ids)
    counts = torch.zeros(embedded.vocab_size)
    with torch.inference_mode():
        for t in g.tokens[:12]:
            row = embedded.model(input_ids=torch.tensor([committed])).logits[0, -1].float() - 0.5 * counts
            expected = torch.log_softmax(row, -1)
            assert t.logprob == pytest.approx(float(expected[t.token_id]), abs=2e-3)
            # ties in id order (bf16 logprobs tie), as greedy's argmax breaks them
            assert [i for i, _ in t.top_logprobs] == expected.sort(descending=True, stable=True).indices[
                :3
            ].tolist()
            assert t.top_logprobs[0][1] >= t.logprob - 1e-6
            committed.append(t.token_id)
            counts[t.token_id] += 1


def test_a_rescued_token_reports_the_targets_logprob_of_the_kept_token(engine, embedded, ids):
    """CSD's lossiness shows in the numbers: a rescued token's logprob is below the target's top choice, or
    equal to it in an exact tie, where the top is the lower token id (argmax's choice, reported first)."""
    # strict decoding that records its rejections: the memory then knows this text's divergences
    strict = SpeculativeConfig(method="sd")
    run_to_end(engine.generate(ids, SamplingParams(max_tokens=40), strict, "combined", record_strict=True))
    spec = SpeculativeConfig(method="csd", lambda_=0, tau=0.001, guard_facts=False)
    g = run_to_end(engine.generate(ids, SamplingParams(max_tokens=40, logprobs=2), spec, "combined"))
    rescued = [t for t in g.tokens if t.replaced_token_id is not None]
    assert rescued, g.stats.as_dict()
    for t in rescued:
        best_id, best = t.top_logprobs[0]
        assert best_id == t.replaced_token_id
        assert best > t.logprob or (best == t.logprob and best_id < t.token_id), (t, t.top_logprobs)


def test_the_semantic_gate_reads_the_processed_logits(engine, embedded, ids):
    """SCG compares the logits plain decoding chooses from (after penalties, logit_bias and the grammar's
    mask): a token the user biased away, or a grammar forbids, is never kept by a rescue, however plausible
    the raw logits find it."""
    strict = SpeculativeConfig(method="sd")
    run_to_end(engine.generate(ids, SamplingParams(max_tokens=40), strict, "combined", record_strict=True))
    spec = SpeculativeConfig(method="csd", lambda_=0, tau=0.001, guard_facts=False)
    free = run_to_end(engine.generate(ids, SamplingParams(max_tokens=40), spec, "combined"))
    rescued = {t.token_id for t in free.tokens if t.replaced_token_id is not None}
    assert rescued, free.stats.as_dict()
    biased = SamplingParams(max_tokens=40, logit_bias=tuple((t, -100.0) for t in sorted(rescued)))
    g = run_to_end(engine.generate(ids, biased, spec, "combined"))
    assert g.stats.num_draft_tokens > 0
    assert not rescued & {t.token_id for t in g.tokens}, g.stats.as_dict()
