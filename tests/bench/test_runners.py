"""The lossless runners the benchmark times, on a short prompt: ours with both drafters, and transformers'
generate (plain, prompt lookup, assisted by a draft model).

At temperature 0 every lossless runner must reproduce vanilla token for token; that is what makes the speed
ratios comparable (same tokens, same work) and the peer a fair one.
"""

from __future__ import annotations

import pytest

from bench.calibration import engine_with_store
from bench.runners import ForwardCounter, method_specs, run_engine, run_hf
from ocm_store.memory import InMemoryStore
from service.decoding import ModelDrafter, NgramDrafter, SpeculativeConfig
from service.decoding.text import encode_chat

PROMPT = "Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the old river bank."
MAX_TOKENS = 12
LOSSLESS = ("vanilla", "sd", "sd-model", "hf-greedy", "hf-pld", "hf-assisted")


@pytest.fixture(scope="module")
def outputs(embedded, tiny):
    drafters = {"ngram": NgramDrafter(), "model": ModelDrafter(tiny)}
    engine = engine_with_store(embedded, drafters, InMemoryStore())
    engines = {None: engine, "cold": engine, "calibrated": engine}
    ids = encode_chat(embedded.tokenizer, [{"role": "user", "content": PROMPT}])
    results = {}
    for spec in method_specs(with_draft_model=True):
        if spec.label not in LOSSLESS:  # the lossy methods run end to end in test_bench_smoke.py
            continue
        if spec.runner == "hf":
            results[spec.label] = run_hf(embedded, spec, ids, MAX_TOKENS, 6, draft=tiny)
        else:
            results[spec.label] = run_engine(engines[spec.ocm], spec, ids, MAX_TOKENS, SpeculativeConfig())
    return results


def test_every_lossless_runner_reproduces_vanilla(outputs):
    vanilla = outputs["vanilla"]
    assert 0 < vanilla.tokens <= MAX_TOKENS
    for label in LOSSLESS:
        assert outputs[label].token_ids == vanilla.token_ids, label
        assert outputs[label].text == vanilla.text, label


def test_forward_counts(outputs):
    vanilla = outputs["vanilla"]
    # one forward per token (plus one that produced EOS, if the output stopped there)
    assert vanilla.target_forwards in (vanilla.tokens, vanilla.tokens + 1)
    assert outputs["hf-greedy"].target_forwards in (vanilla.tokens, vanilla.tokens + 1)
    # prompt lookup on a prompt that asks for a copy must save target forwards
    assert outputs["sd"].target_forwards < vanilla.target_forwards
    assert outputs["hf-pld"].target_forwards < outputs["hf-greedy"].target_forwards
    sd = outputs["sd"]
    assert sd.draft_tokens > 0 and sd.accepted > 0 and sd.rescued == 0
    assert sum(sd.kept_per_round.values()) + sd.undrafted_rounds == sd.target_forwards
    assert outputs["hf-pld"].draft_tokens is None  # the peer's counters are not visible


def test_forward_counter_counts_and_detaches(embedded):
    import torch

    with ForwardCounter(embedded.model) as counter, torch.inference_mode():
        embedded.model(input_ids=torch.tensor([[1, 2, 3]]))
        embedded.model(input_ids=torch.tensor([[4]]))
    assert counter.calls == 2
    with torch.inference_mode():
        embedded.model(input_ids=torch.tensor([[5]]))
    assert counter.calls == 2
