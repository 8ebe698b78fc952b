"""The draft head and its drafter: files, the target hidden state it starts from (after every rollback, alone
and in a batch), batched drafting, sampling distributions, the combined drafter, and refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from service.decoding import (
    CombinedDrafter,
    DecodingError,
    Engine,
    HeadDrafter,
    NgramDrafter,
    SamplingParams,
    SpeculativeConfig,
    run_alone,
    vocabulary_hash,
)
from service.decoding.batch import Batch
from service.decoding.draft_head import DraftHeadConfig, RecurrentDraftHead
from service.decoding.drafters import DraftRow
from service.decoding.drafters.combined import NGRAM_KEY_OFFSET
from tests.conftest import make_word_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def words():
    return make_word_model(seed=11)


def save_word_head(
    words, folder: Path, seed: int = 0, vocab: list[int] | None = None, feature_layers: tuple[int, ...] = ()
) -> Path:
    """A random head for the word model (random everywhere, so its drafts vary), saved as the real files."""
    vocab = vocab or list(range(2, 12))
    config = DraftHeadConfig(
        hidden_size=words.model.config.hidden_size,
        inner_size=48,
        num_blocks=2,
        draft_vocab_size=len(vocab),
        target_vocab_hash=vocabulary_hash(words.tokenizer),
        target_name=words.name,
        feature_layers=feature_layers,
    )
    torch.manual_seed(seed)
    head = RecurrentDraftHead(config, torch.tensor(vocab))
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0.0, 0.3)
    head.save(folder)
    return folder


@pytest.fixture(scope="module")
def head_drafter(words, tmp_path_factory):
    return HeadDrafter(words, save_word_head(words, tmp_path_factory.mktemp("head")))


def fresh_final_hidden(model, tokens: list[int]) -> torch.Tensor:
    """The target's final hidden state at the last of `tokens`, from a fresh full forward."""
    with torch.inference_mode():
        out = model.model(input_ids=torch.tensor([tokens]))
    return out.last_hidden_state[0, -1]


def test_files_round_trip(words, tmp_path):
    """The loaded head computes what the saved one did; another head's file computes something else."""
    folder = save_word_head(words, tmp_path, seed=3)
    loaded = RecurrentDraftHead.load(folder)
    torch.manual_seed(3)  # rebuild the saved head exactly as save_word_head made it
    original = RecurrentDraftHead(loaded.config, torch.tensor(list(range(2, 12))))
    with torch.no_grad():
        for parameter in original.parameters():
            parameter.normal_(0.0, 0.3)
    other = RecurrentDraftHead.load(save_word_head(words, tmp_path / "other", seed=4))
    embed, lm_head = words.model.get_input_embeddings().weight, words.model.lm_head.weight
    state, tokens = torch.randn(2, words.model.config.hidden_size), torch.tensor([3, 4])
    with torch.no_grad():
        outputs = [h.bind(embed, lm_head).advance(state, tokens) for h in (loaded, original, other)]
    torch.testing.assert_close(outputs[0], outputs[1])
    assert not torch.allclose(outputs[0][1], outputs[2][1])
    assert not any("embed" in k or "lm_rows" in k for k in RecurrentDraftHead.load(folder).state_dict())


def test_a_head_for_another_vocabulary_is_refused(words, tmp_path, embedded):
    folder = save_word_head(words, tmp_path)
    with pytest.raises(DecodingError, match="vocabulary"):
        HeadDrafter(embedded, folder)


def test_the_drafter_starts_from_the_targets_hidden_state_after_every_round(words, head_drafter):
    """Rounds reject and keep draft tokens; at every round's end the hidden state handed to the head is
    what a fresh forward of the committed sequence gives at the position that chose its last token."""
    engine = Engine(words, {"head": head_drafter})
    prompt = [2, 3, 4, 5, 6, 7, 2, 3]
    g = engine.generate(
        prompt, SamplingParams(max_tokens=30, ignore_eos=True), SpeculativeConfig(method="sd"), "head"
    )
    rounds = 0
    for _ in run_alone(g):
        rounds += 1
        expected = fresh_final_hidden(words.model, g.committed[:-1])
        torch.testing.assert_close(g.target_hidden, expected, atol=1e-4, rtol=1e-4)
    assert g.stats.num_draft_tokens > 0 and rounds == g.stats.target_forwards
    # the rounds did reject (rollback was exercised), and did keep something
    assert 0 < g.stats.num_accepted < g.stats.num_draft_tokens


def test_batched_rows_start_from_their_own_hidden_states(words, head_drafter):
    """Three sequences of different lengths joining at different steps share forwards; each row's hidden
    state stays its own sequence's."""
    engine = Engine(words, {"head": head_drafter})
    prompts = [[2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 2, 3], [4, 4]]
    gens = [
        engine.generate(
            p, SamplingParams(max_tokens=12 + 3 * i, ignore_eos=True), SpeculativeConfig(method="sd"), "head"
        )
        for i, p in enumerate(prompts)
    ]
    batch = Batch(words, max_batch_size=3, max_batched_tokens=64)
    batch.add(gens[0])
    steps = 0
    while len(batch):
        if steps == 2:
            batch.add(gens[1])
        if steps == 4:
            batch.add(gens[2])
        for g, _ in batch.step():
            if g.finish_reason is None:
                expected = fresh_final_hidden(words.model, g.committed[:-1])
                torch.testing.assert_close(g.target_hidden, expected, atol=1e-4, rtol=1e-4)
        steps += 1
    alone = [
        engine.generate(
            p, SamplingParams(max_tokens=12 + 3 * i, ignore_eos=True), SpeculativeConfig(method="sd"), "head"
        )
        for i, p in enumerate(prompts)
    ]
    for a in alone:
        list(run_alone(a))
    # strict SD is lossless: batched and alone emit the same tokens
    assert [[t.token_id for t in g.tokens] for g in gens] == [[t.token_id for t in a.tokens] for a in alone]


def request(key, committed, k, hidden, sampling=None, seed=0):
    sampling = sampling or SamplingParams()
    generator = torch.Generator().manual_seed(seed) if not sampling.greedy else None
    return DraftRow(key, committed, k, sampling, generator, hidden)


def test_batched_drafts_equal_drafts_alone(words, head_drafter):
    rows = head_drafter.rows()
    states = torch.randn(3, words.model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    asks = [request(i, [2, 3 + i], k, states[i]) for i, k in enumerate([4, 2, 6])]
    together = rows.propose(asks)
    for ask, draft in zip(asks, together, strict=True):
        (alone,) = rows.propose([ask])
        assert draft.tokens == alone.tokens and 1 <= len(draft.tokens) <= ask.max_tokens
        assert set(draft.tokens) <= set(head_drafter.head.draft_vocab.tolist())
    # no hidden state yet (a one-token prompt before its first forward): nothing to propose
    assert rows.propose([request("new", [2], 4, None)])[0].tokens == []


def test_sampled_drafts_carry_their_distributions(words, head_drafter):
    rows = head_drafter.rows()
    state = torch.randn(words.model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    sampling = SamplingParams(temperature=0.8, top_p=0.9)
    (draft,) = rows.propose([request(0, [2, 3], 5, state, sampling)])
    n = len(draft.tokens)
    assert 1 <= n <= 5 and draft.probs is not None and draft.probs.shape == (n, len(words.tokenizer))
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(n))
    outside = torch.ones(len(words.tokenizer), dtype=torch.bool)
    outside[head_drafter.head.draft_vocab] = False
    assert float(draft.probs[:, outside].abs().sum()) == 0.0  # never proposes outside its vocabulary
    assert all(float(draft.probs[i, t]) > 0 for i, t in enumerate(draft.tokens))


def test_combined_takes_prompt_lookup_where_it_matches_and_the_head_elsewhere(words, head_drafter):
    combined = CombinedDrafter(NgramDrafter(), head_drafter, min_match=3).rows()
    state = torch.randn(words.model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    repeating = [2, 3, 4, 5, 6, 2, 3, 4]  # the suffix (2, 3, 4) occurred before: n-gram draft [5, 6, 2, ...]
    fresh = [7, 8, 9, 10]  # no match: the head drafts
    lookup, head = combined.propose([request("a", repeating, 3, state), request("b", fresh, 3, state)])
    assert lookup.tokens == [5, 6, 2] and lookup.key == NGRAM_KEY_OFFSET + 3
    (expected,) = head_drafter.rows().propose([request("b", fresh, 3, state)])
    assert head.tokens == expected.tokens and head.key < NGRAM_KEY_OFFSET


def test_the_policys_model_length_bounds_the_head_but_never_the_lookup(words, head_drafter):
    """`model_tokens` (the draft policy's length) is what a position of the head costs: with 0 the head
    drafts nothing and with 1 one token, while prompt lookup, free, drafts its whole budget either way."""
    combined = CombinedDrafter(NgramDrafter(), head_drafter, min_match=3).rows()
    state = torch.randn(words.model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    repeating = [2, 3, 4, 5, 6, 2, 3, 4]
    fresh = [7, 8, 9, 10]
    for model_tokens, head_length in ((0, 0), (1, 1)):
        rows = [request("a", repeating, 3, state), request("b", fresh, 3, state)]
        rows = [dataclasses.replace(row, model_tokens=model_tokens) for row in rows]
        lookup, head = combined.propose(rows)
        assert lookup.tokens == [5, 6, 2]
        assert len(head.tokens) == head_length
    (alone,) = head_drafter.rows().propose(
        [dataclasses.replace(request("b", fresh, 3, state), model_tokens=0)]
    )
    assert alone.tokens == []


def test_a_row_stops_drafting_where_the_head_is_unsure(words, head_drafter, monkeypatch):
    """A row stops once the head's estimate that its draft survives (the product of its top probabilities)
    falls below MIN_SURVIVAL; other rows go on."""
    from service.decoding.drafters import head as head_module

    rows = head_drafter.rows()
    states = torch.randn(2, words.model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    asks = [request(i, [2, 3], 6, states[i]) for i in range(2)]
    monkeypatch.setattr(head_module, "MIN_SURVIVAL", 0.0)
    full = rows.propose(asks)
    assert [len(d.tokens) for d in full] == [6, 6]
    monkeypatch.setattr(head_module, "MIN_SURVIVAL", 1.0)  # nothing is certain: one token each
    assert [len(d.tokens) for d in rows.propose(asks)] == [1, 1]
    # in between: each row stops where its own running product first drops below the bar
    logits_rows = []
    state, last = states.clone(), torch.tensor([3, 3])
    with torch.inference_mode():
        for _ in range(6):
            state, logits = head_drafter.head.advance(state, last)
            top_probs, top = torch.softmax(logits, -1).max(-1)
            logits_rows.append(top_probs)
            last = head_drafter.head.draft_vocab[top]
    products = torch.stack(logits_rows).cumprod(0)  # [6, 2]
    bar = float(products[2, 0]) + 1e-6  # row 0 stops after its 3rd token
    monkeypatch.setattr(head_module, "MIN_SURVIVAL", bar)
    expected = [int((products[:, j] >= bar).sum()) + 1 for j in range(2)]
    assert [len(d.tokens) for d in rows.propose(asks)] == [min(e, 6) for e in expected]
    assert expected[0] == 3


def test_a_fused_head_is_handed_the_low_mid_and_final_states_of_the_verification_forward(tmp_path):
    """EAGLE-3 fusion: the capture concatenates the chosen decoder layers' outputs and the final state at the
    positions the LM head saw, and the batch hands a fused head exactly the features a fresh forward gives."""
    model = make_word_model(seed=5, layers=4)
    vocab = list(range(2, 12))
    config = DraftHeadConfig(
        hidden_size=model.model.config.hidden_size,
        inner_size=48,
        num_blocks=2,
        draft_vocab_size=len(vocab),
        target_vocab_hash=vocabulary_hash(model.tokenizer),
        target_name=model.name,
        feature_layers=(0, 2),
    )
    head = RecurrentDraftHead(config, torch.tensor(vocab))
    head.save(tmp_path)
    drafter = HeadDrafter(model, tmp_path)
    assert drafter.head.feature_size == 3 * config.hidden_size
    engine = Engine(model, {"head": drafter})
    g = engine.generate(
        [2, 3, 4, 5, 6], SamplingParams(max_tokens=12), SpeculativeConfig(method="sd"), "head"
    )
    list(run_alone(g))
    with torch.inference_mode():
        fresh = model.model.model(input_ids=torch.tensor([g.committed[:-1]]), output_hidden_states=True)
    states = fresh.hidden_states  # [0] = embeddings, [i + 1] = layer i's output
    expected = torch.cat([states[1][0, -1], states[3][0, -1], fresh.last_hidden_state[0, -1]])
    torch.testing.assert_close(g.target_hidden, expected, atol=1e-4, rtol=1e-4)
    # a second head on the same model asking for other layers is refused, not silently fed the wrong ones
    other = RecurrentDraftHead(
        DraftHeadConfig(**{**config.__dict__, "feature_layers": (1,)}), torch.tensor(vocab)
    )
    other.save(tmp_path / "other")
    with pytest.raises(DecodingError, match="already captured"):
        HeadDrafter(model, tmp_path / "other")
    # a head on the final state alone drafts beside it (or after a reload from it): it reads the last
    # hidden_size features of what the fused capture hands over
    final_only = RecurrentDraftHead(
        DraftHeadConfig(**{**config.__dict__, "feature_layers": ()}), torch.tensor(vocab)
    )
    final_only.save(tmp_path / "final-only")
    plain = HeadDrafter(model, tmp_path / "final-only")
    g = Engine(model, {"head": plain}).generate(
        [2, 3, 4, 5, 6], SamplingParams(max_tokens=12), SpeculativeConfig(method="sd"), "head"
    )
    list(run_alone(g))
    assert g.stats.num_draft_tokens > 0
    torch.testing.assert_close(
        plain.head.initial_state(g.target_hidden), g.target_hidden[-config.hidden_size :]
    )


def test_a_reload_to_a_head_fusing_layers_the_server_does_not_capture_is_refused(tmp_path):
    # started with a final-state head, the server captures no decoder layer: a fused head swapped in between
    # rounds would be handed the running head's features, so the reload is refused and the old head serves on
    model = make_word_model(seed=6, layers=4)
    HeadDrafter(model, save_word_head(model, tmp_path / "final"))
    fused = save_word_head(model, tmp_path / "fused", feature_layers=(0, 2))
    with pytest.raises(DecodingError, match="does not capture"):
        HeadDrafter(model, fused, reload=True)
    assert model.final_hidden.layers == ()
    HeadDrafter(model, tmp_path / "final", reload=True)  # the same kind reloads


def test_the_trained_head_keeps_more_per_forward_than_prompt_lookup_on_an_open_question(embedded):
    """What the shipped head is for: an open question, where the prompt holds little to look up. At a fixed
    draft length (no cost table: every draft verified in full, so the drafters alone decide), the head and
    the combined drafter keep more tokens per target forward than prompt lookup, and strict SD says exactly
    what plain decoding says. The API test asks the same question through a server, whose adaptive policy
    may draft less on a machine where a wide forward is dear."""
    from ocm_store import InMemoryStore, Namespace
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR
    from service.decoding.text import encode_chat

    ngram = NgramDrafter()
    drafters = {"ngram": ngram, "head": HeadDrafter(embedded, EMBEDDED_HEAD_DIR)}
    drafters["combined"] = CombinedDrafter(ngram, drafters["head"])
    store = InMemoryStore()
    engine = Engine(embedded, drafters, {n: store.memory(Namespace("t", n, "v")) for n in drafters})
    ids = encode_chat(
        embedded.tokenizer, [{"role": "user", "content": "Why do leaves change colour in autumn?"}]
    )
    sampling = SamplingParams(max_tokens=48)

    def decode(method: str, drafter: str):
        generation = engine.generate(ids, sampling, SpeculativeConfig(method=method), drafter)
        list(run_alone(generation))
        return [t.token_id for t in generation.tokens], generation.stats.tokens_per_forward

    plain, _ = decode("vanilla", "ngram")
    per_forward = {}
    for drafter in drafters:
        tokens, per_forward[drafter] = decode("sd", drafter)
        assert tokens == plain, drafter
    assert per_forward["head"] > per_forward["ngram"] and per_forward["combined"] > per_forward["ngram"], (
        per_forward
    )
