"""KV rollback: after a crop, the caches give the logits a fresh prefill of the kept tokens gives.

Tolerance: everything runs in float32. A fresh prefill computes all positions in one batched matmul, the
incremental path one or a few rows at a time; the kernels then sum in a different order, which moves the
logits in their last bits (measured when this was written: up to 1.4e-5 on the tiny model, 3.2e-5 on the
embedded one, whose logits reach ~30). A wrong rollback (a stale or missing position in the cache) moves
them by O(1). atol = 1e-3 leaves 30x room for other CPUs' kernels and still separates the two by orders of
magnitude.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from service.decoding import Engine, ModelDrafter, NgramDrafter, SamplingParams, SpeculativeConfig, run_alone
from service.decoding.drafters import DraftRow, ModelDraftRows
from service.decoding.verification import sampling_probs
from service.executor.fused_layers import executor_name
from service.executor.kv_cache import GrowingLayer, crop_cache, new_cache
from tests.conftest import make_word_model

ATOL = 1e-3

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def words():
    return make_word_model(seed=3)


def fresh_logits(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] logits of one forward over ids with no cache."""
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([ids])).logits[0].float()


def cached_logits(model, cache: DynamicCache, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model.model(input_ids=torch.tensor([ids]), cache=cache).logits[0].float()


def check_target_rollback(model, prompt: list[int], draft: list[int], kept: int, after: list[int]):
    """The target's side of the engine's rounds: prefill, a forward over a draft, crop to prompt + kept draft
    tokens, then extend with `after`. Its logits must equal a fresh prefill of the same tokens."""
    cache = DynamicCache(config=model.model.config)
    cached_logits(model, cache, prompt)
    cached_logits(model, cache, draft)
    crop_cache(cache, len(prompt) + kept)
    assert cache.get_seq_length() == len(prompt) + kept
    got = cached_logits(model, cache, after)
    expected = fresh_logits(model, prompt + draft[:kept] + after)[-len(after) :]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("kept", [0, 1, 3, 5])
def test_target_cache_crop_equals_fresh_prefill(words, kept):
    prompt = [2, 3, 4, 5, 6, 7, 2, 3]
    draft = [8, 9, 10, 11, 2]
    # after a rejection the recovered token (and next round's draft) follow the kept prefix
    check_target_rollback(words, prompt, draft, kept, after=[4, 6, 7])


def test_target_cache_crop_on_the_embedded_model(embedded):
    ids = embedded.tokenizer("The colour of the theatre was grey, and the centre")["input_ids"]
    prompt, draft = ids[:-4], ids[-4:]
    check_target_rollback(embedded, prompt, draft, kept=2, after=draft[2:3])


def test_growing_layers_give_the_plain_caches_logits_without_copying_the_cache(embedded, words):
    """`new_cache`'s layers write each forward's keys and values into a buffer with room to spare and hand
    out views: the same logits as transformers' concatenating cache (bit for bit where the project's
    attention kernel reads the views in place), through rounds, crops and a deep copy, and the cached
    positions are not copied by a forward or a crop."""
    ids = embedded.tokenizer("The colour of the theatre was grey, and the centre of the town was quiet")[
        "input_ids"
    ]
    # bit for bit where the fused layers' attention reads the views; torch's attention may take another path
    # for a strided input than for a contiguous one (rounding only)
    for model, exact in ((embedded, executor_name(embedded.model) == "fused"), (words, False)):
        tokens = ids if exact else [2, 3, 4, 5, 6, 7, 2, 3, 8, 9, 10, 11, 2, 4, 6]
        config = model.model.config
        plain, growing = DynamicCache(config=config), new_cache(config)
        assert all(isinstance(layer, GrowingLayer) for layer in growing.layers)

        def same(a: torch.Tensor, b: torch.Tensor, exact: bool = exact) -> None:
            if exact:
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, atol=ATOL, rtol=0)

        prompt, draft = tokens[:8], tokens[8:12]
        same(cached_logits(model, growing, prompt), cached_logits(model, plain, prompt))
        buffer = growing.layers[0].keys.data_ptr()
        same(cached_logits(model, growing, draft), cached_logits(model, plain, draft))
        for cache in (plain, growing):
            crop_cache(cache, len(prompt) + 1)
        assert growing.get_seq_length() == len(prompt) + 1
        same(cached_logits(model, growing, tokens[12:13]), cached_logits(model, plain, tokens[12:13]))
        # every forward and the crop wrote into the same buffer: no copy of the cached positions
        assert growing.layers[0].keys.data_ptr() == buffer
        assert not growing.layers[0].keys.is_contiguous()  # a view with room beyond it
        # a deep copy (what BatchKV.copy does for n > 1 choices) has buffers of its own
        twin, plain_twin = copy.deepcopy(growing), copy.deepcopy(plain)
        same(cached_logits(model, twin, tokens[14:16]), cached_logits(model, plain_twin, tokens[14:16]))
        same(cached_logits(model, growing, tokens[13:15]), cached_logits(model, plain, tokens[13:15]))


def test_crop_beyond_the_cache_is_a_no_op(words):
    cache = DynamicCache(config=words.model.config)
    cached_logits(words, cache, [2, 3, 4])
    crop_cache(cache, 10)
    assert cache.get_seq_length() == 3
    crop_cache(cache, 3)
    assert cache.get_seq_length() == 3


# ---------------------------------------------------------------- the draft model's rollback


def assert_draft_matches_fresh_prefill(draft_model, committed: list[int], proposal) -> None:
    """Every row of the proposal's distributions equals what a fresh prefill of committed + the tokens
    drafted before it gives."""
    assert proposal.probs is not None and len(proposal.probs) == len(proposal.tokens)
    for i in range(len(proposal.tokens)):
        logits = fresh_logits(draft_model, committed + proposal.tokens[:i])[-1]
        expected = sampling_probs(logits, 1.0, 1.0)
        torch.testing.assert_close(proposal.probs[i], expected, atol=ATOL, rtol=0)


class Session:
    """A sequence's sampling settings, as the batch hands them to a drafter in each `DraftRow`."""

    def __init__(self, seed: int) -> None:
        self.sampling = SamplingParams(temperature=1.0)  # sampling, so the proposal carries its distributions
        self.generator = torch.Generator().manual_seed(seed)


def start_session(draft_model, seed: int = 0) -> Session:
    return Session(seed)


def draft_rows(draft_model, prompts: list[list[int]]) -> tuple[ModelDraftRows, list[object]]:
    """A batch's draft cache with one row per prompt, each prefilled (all but its last token) as the batch
    does it: chunk by chunk into a cache of its own, joining at its first proposal."""
    rows = ModelDraftRows(draft_model)
    keys = []
    for i, prompt in enumerate(prompts):
        key = f"sequence-{i}"
        with torch.inference_mode():
            body = prompt[:-1]
            rows.prefill(key, body[:2])
            rows.prefill(key, body[2:])
        keys.append(key)
    return rows, keys


def propose(rows, wanted):
    """wanted: key -> (committed, k, session); returns key -> Draft."""
    requests = [
        DraftRow(key, committed, k, session.sampling, session.generator, None)
        for key, (committed, k, session) in wanted.items()
    ]
    with torch.inference_mode():
        return dict(zip(wanted, rows.propose(requests), strict=True))


@pytest.mark.parametrize("kept", [0, 2, 4], ids=["first-rejected", "some-kept", "all-kept-bonus"])
def test_draft_rollback_equals_fresh_prefill(words, kept):
    """Round 1 drafts k = 4 tokens; the target keeps `kept` of them and adds one token; round 2 must see
    exactly the committed sequence. kept = k is gpt-fast's edge case: the draft never fed its own last
    token, so round 2 has to feed it along with the bonus token."""
    committed = [2, 3, 4, 5, 6, 7, 2, 3]
    rows, (key,) = draft_rows(words, [committed])
    session = start_session(words)
    first = propose(rows, {key: (committed, 4, session)})[key]
    assert_draft_matches_fresh_prefill(words, committed, first)
    # the draft fed the committed tokens and its first 3 drafts (the 4th is only sampled)
    assert rows.kv.length(0) == len(committed) + 3

    recovered = next(t for t in range(2, 12) if kept == 4 or t != first.tokens[kept])
    committed = committed + first.tokens[:kept] + [recovered]
    second = propose(rows, {key: (committed, 4, session)})[key]
    assert_draft_matches_fresh_prefill(words, committed, second)
    assert rows.cached[0] == committed + second.tokens[:3]
    assert rows.kv.length(0) == len(rows.cached[0])


def test_batched_draft_rows_survive_many_rounds(words):
    """Three rows of different lengths, random k per row (some rows sit a round out), random keep/reject:
    every row's drafts stay what a fresh prefill of its own sequence gives."""
    rng = torch.Generator().manual_seed(5)
    committed = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3], [4, 4]]
    rows, keys = draft_rows(words, committed)
    sessions = [start_session(words, seed=i) for i in range(3)]
    for _ in range(10):
        ks = [int(torch.randint(0, 5, (), generator=rng)) for _ in keys]
        wanted = {key: (committed[i], ks[i], sessions[i]) for i, key in enumerate(keys) if ks[i]}
        drafts = propose(rows, wanted)
        for i, key in enumerate(keys):
            if not ks[i]:
                assert key not in drafts
                continue
            assert len(drafts[key].tokens) == ks[i]
            assert_draft_matches_fresh_prefill(words, committed[i], drafts[key])
            kept = int(torch.randint(0, ks[i] + 1, (), generator=rng))
            committed[i] = (
                committed[i] + drafts[key].tokens[:kept] + [int(torch.randint(2, 12, (), generator=rng))]
            )
    # a row leaving does not disturb the others
    rows.leave(keys[1])
    wanted = {key: (committed[i], 3, sessions[i]) for i, key in enumerate(keys) if i != 1}
    drafts = propose(rows, wanted)
    for i in (0, 2):
        assert_draft_matches_fresh_prefill(words, committed[i], drafts[keys[i]])


# ---------------------------------------------------------------- the engine: no re-encoding


@pytest.mark.parametrize("drafter", ["ngram", "model"])
def test_engine_feeds_each_token_to_the_target_once_per_round(words, drafter):
    """One target forward per round over [last committed, draft...]: the target never re-encodes the
    sequence. Counted with a forward hook on the real model (it observes, it changes nothing)."""
    fed: list[int] = []
    handle = words.model.register_forward_pre_hook(
        lambda module, args, kwargs: fed.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    draft = make_word_model(seed=4, tokenizer=words.tokenizer)
    engine = Engine(words, {"ngram": NgramDrafter(), "model": ModelDrafter(draft)})
    prompt = [2, 3, 4, 5, 6, 7, 2, 3, 4, 5]
    try:
        generation = engine.generate(
            prompt, SamplingParams(max_tokens=24, ignore_eos=True), SpeculativeConfig(method="sd"), drafter
        )
        decoded = list(run_alone(generation))
    finally:
        handle.remove()
    assert fed[0] == len(prompt) - 1  # prefill: all but the last prompt token
    rounds = fed[1:]
    assert len(rounds) == len(decoded) == generation.stats.target_forwards
    assert [1 + s.round.num_draft_tokens for s in decoded] == rounds
    assert generation.stats.num_draft_tokens > 0


def in_place_against_generic(monkeypatch, name: str, scenario) -> list[bool]:
    """Run `scenario()` (-> a BatchKV and its next logits) with `BatchKV.<name>` (a layout change written in
    place into the layers' new buffers) as it is, then declining (the generic path); assert both give the same
    logits, slots, mask and cache. Returns what the in-place runs answered (True: the in-place path ran)."""
    from service.executor.batch_kv import BatchKV

    real, answers = getattr(BatchKV, name), []

    def spied(self, *args):
        answers.append(real(self, *args))
        return answers[-1]

    results = []
    with torch.inference_mode():
        for replacement in (spied, lambda self, *args: False):
            monkeypatch.setattr(BatchKV, name, replacement)
            try:
                results.append(scenario())
            finally:
                monkeypatch.undo()
    (mine, my_logits), (theirs, their_logits) = results
    assert torch.equal(my_logits, their_logits)
    assert mine.slots == theirs.slots and torch.equal(mine.mask, theirs.mask)
    for a, b in zip(mine.cache.layers, theirs.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    return answers


def test_a_join_writes_both_batches_once_into_new_buffers_as_concatenation_would(words, monkeypatch):
    """`BatchKV.add` on caches of `GrowingLayer`s writes the running batch's and the newcomer's keys and values,
    left-padded, straight into each layer's new buffers (owned, with room to grow): the same cache, mask, slots
    and next logits as padding and concatenating give."""
    from service.executor.batch_kv import BatchKV

    def joined():
        running = BatchKV(words.model, torch.device("cpu"), rows=1)
        running.forward([[3, 4, 5, 6, 7, 2, 1]])
        running.forward([[4, 5]])
        running.keep(0, running.length(0) - 1)  # a dead slot at the end
        newcomer = BatchKV(words.model, torch.device("cpu"), rows=1)
        newcomer.forward([[6, 7, 3]])
        running.add(newcomer)
        return running, running.forward([[2], [5]])

    assert in_place_against_generic(monkeypatch, "_join_in_place", joined) == [True]


def test_a_row_leaving_writes_the_rest_once_into_new_buffers_as_selection_would(words, monkeypatch):
    """`BatchKV.remove` on caches of `GrowingLayer`s writes the kept rows, without the columns none of them
    uses, straight into each layer's new buffers: the same cache, mask, slots and next logits as selecting the
    rows and dropping the columns give."""
    from service.executor.batch_kv import BatchKV

    def removed():
        kv = BatchKV(words.model, torch.device("cpu"))
        for prompt in ([3, 4, 5, 6, 7, 2, 1, 4, 5], [6, 7, 3], [2, 5, 4, 6]):
            own = BatchKV(words.model, torch.device("cpu"), rows=1)
            own.forward([prompt])
            kv.add(own)
        kv.forward([[4, 5], [6], [7, 2]])
        kv.keep(1, kv.length(1) - 1)  # a hole in row 1
        kv.remove([0])  # the longest row leaves: the columns only it used go too
        assert kv.width < 9 + 2  # the columns only row 0 used are gone
        return kv, kv.forward([[2], [5]])

    assert in_place_against_generic(monkeypatch, "_select_in_place", removed) == [True]
