"""The lossless runners the benchmark times, on a short prompt: ours with every drafter (n-gram, draft model,
draft head, combined), and transformers' generate (plain, prompt lookup, assisted by a draft model).

At temperature 0 every lossless runner must reproduce vanilla token for token; that is what makes the speed
ratios comparable (same tokens, same work) and the peer a fair one.
"""

from __future__ import annotations

import pytest

from bench.calibration import engine_with_store
from bench.runners import ForwardCounter, method_specs, run_engine, run_hf, select_specs
from ocm_store.memory import InMemoryStore
from service.decoding import (
    CombinedDrafter,
    HeadDrafter,
    Method,
    ModelDrafter,
    NgramDrafter,
    SpeculativeConfig,
)
from service.decoding.text import encode_chat

PROMPT = "Copy this sentence exactly: The quick brown fox jumps over the lazy dog near the old river bank."
MAX_TOKENS = 12
LOSSLESS = ("vanilla", "sd", "sd-model", "sd-head", "sd-combined", "hf-greedy", "hf-pld", "hf-assisted")


@pytest.fixture(scope="module")
def outputs(embedded, tiny, embedded_head):
    ngram, head = NgramDrafter(), HeadDrafter(embedded, embedded_head)
    drafters = {
        "ngram": ngram,
        "model": ModelDrafter(tiny),
        "head": head,
        "combined": CombinedDrafter(ngram, head),
    }
    engine = engine_with_store(embedded, drafters, InMemoryStore())
    engines = {None: engine, "cold": engine, "calibrated": engine}
    ids = encode_chat(embedded.tokenizer, [{"role": "user", "content": PROMPT}])
    results = {}
    for spec in method_specs(with_draft_model=True, with_head=True):
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
    for label in ("sd-head", "sd-combined"):
        out = outputs[label]
        assert out.draft_tokens > 0 and out.rescued == 0, label
        assert sum(out.kept_per_round.values()) + out.undrafted_rounds == out.target_forwards, label


def test_head_columns():
    specs = {s.label: s for s in method_specs(with_draft_model=False, with_peer=False, with_head=True)}
    assert {"sd-head", "csd-head", "csd-head-unguarded", "sd-combined", "csd-combined"} <= set(specs)
    assert specs["csd-head"].ocm == specs["csd-head-unguarded"].ocm == "calibrated"
    assert specs["csd-head"].guard_facts and not specs["csd-head-unguarded"].guard_facts
    assert specs["sd-head"].lossless and specs["sd-combined"].lossless and not specs["csd-head"].lossless
    assert specs["csd-combined"].method is Method.CSD and specs["csd-combined"].drafter == "combined"
    assert not any("head" in label for label in (s.label for s in method_specs(with_draft_model=False)))


def test_methods_keep_the_peer_unless_no_peer():
    specs = method_specs(with_draft_model=False, with_head=True)
    chosen = [s.label for s in select_specs(specs, ("vanilla", "csd-head"), peer=True)]
    assert chosen == ["vanilla", "hf-greedy", "hf-pld", "csd-head"]
    assert [s.label for s in select_specs(specs, ("vanilla", "csd-head"), peer=False)] == [
        "vanilla",
        "csd-head",
    ]


def test_fp32_reference_column_is_kept_and_never_held_lossless():
    specs = method_specs(with_draft_model=False, with_head=True, with_fp32=True)
    fp32 = next(s for s in specs if s.label == "vanilla-fp32")
    assert fp32.fp32_target and fp32.method is Method.VANILLA and not fp32.lossless
    # --methods keeps the reference column, as it keeps the peer's
    chosen = [s.label for s in select_specs(specs, ("vanilla", "sd-head"), peer=False)]
    assert chosen == ["vanilla", "vanilla-fp32", "sd-head"]
    assert "vanilla-fp32" not in {s.label for s in method_specs(with_draft_model=False)}


def test_forward_counter_counts_and_detaches(embedded):
    import torch

    with ForwardCounter(embedded.model) as counter, torch.inference_mode():
        embedded.model(input_ids=torch.tensor([[1, 2, 3]]))
        embedded.model(input_ids=torch.tensor([[4]]))
    assert counter.calls == 2
    with torch.inference_mode():
        embedded.model(input_ids=torch.tensor([[5]]))
    assert counter.calls == 2


def test_the_unguarded_column_turns_the_fact_guard_off():
    class Asked(Exception):
        pass

    class Recorder:  # stands in for the engine: records what run_engine asks it for
        def generate(self, prompt_ids, sampling, spec, drafter):
            raise Asked(spec, drafter)

    specs = {s.label: s for s in method_specs(with_draft_model=False, with_peer=False, with_head=True)}
    for label, guarded in (("csd-head", True), ("csd-head-unguarded", False), ("csd", True)):
        with pytest.raises(Asked) as asked:
            run_engine(Recorder(), specs[label], [1, 2], 4, SpeculativeConfig(tau=0.05))  # type: ignore[arg-type]
        spec, drafter = asked.value.args
        assert spec.guard_facts is guarded and spec.tau == 0.05 and spec.method is Method.CSD, label
        assert spec.guard_turns is guarded, label  # the unguarded column is the paper's CSD: no guard at all
        assert drafter == specs[label].drafter


def test_every_csd_column_has_an_ocm_of_its_own(embedded):
    """Columns sharing one OCM learn from each other's rescues: their figures then depend on the order of the
    columns (issue 19). Each column with an OCM gets its own engine and its own copy of the calibrated one."""
    from bench.config import BenchConfig
    from bench.context import Bench

    calibrated = InMemoryStore()
    bench = Bench(
        BenchConfig(), embedded, None, {"ngram": NgramDrafter()}, progress=None, calibrated=calibrated
    )  # type: ignore[arg-type]
    namespace = next(iter(engine_with_store(embedded, bench.drafters, calibrated).memories.values()))
    namespace.record([(5, 6)] * 7)  # the calibration's count
    specs = [s for s in method_specs(with_draft_model=False, with_peer=False) if s.method is Method.CSD]
    engines = bench.engines(specs)
    memories = [engines[s.label].memories["ngram"] for s in specs]
    assert len({id(m) for m in memories}) == len(specs)
    memories[0].record([(5, 6)])  # one column learns online
    by_label = {s.label: engines[s.label].memories["ngram"].counts([(5, 6)])[0] for s in specs}
    # every calibrated column starts from the calibration's 7 (the learning one has 8); csd-cold from nothing
    assert by_label == {s.label: (0 if s.ocm == "cold" else 7) + (s is specs[0]) for s in specs}


def test_drafter_cost_times_every_drafter(embedded, tiny, embedded_head):
    from types import SimpleNamespace

    from bench.profiling import drafter_cost

    ngram, head = NgramDrafter(), HeadDrafter(embedded, embedded_head)
    drafters = {
        "ngram": ngram,
        "head": head,
        "combined": CombinedDrafter(ngram, head),
        "model": ModelDrafter(tiny),
    }
    ids = encode_chat(embedded.tokenizer, [{"role": "user", "content": PROMPT}])
    costs = drafter_cost(SimpleNamespace(target=embedded, drafters=drafters), ids, k=3, repeats=1)  # type: ignore[arg-type]
    assert set(costs) == set(drafters)
    for name, cost in costs.items():
        assert set(cost["seconds_by_tokens"]) == {"1", "2", "3"}, name
        assert cost["seconds_per_draft_token"] == pytest.approx(cost["seconds_by_tokens"]["3"] / 3), name
        assert cost["identity"] == drafters[name].identity
