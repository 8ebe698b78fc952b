"""The drafter training pipeline on a tiny model: the prompt corpus is disjoint from the benchmark, the
distilled data is the target's own greedy answers and hidden states, and training produces a head that the
service loads and that learned something."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from service.decoding import Engine, HeadDrafter, SamplingParams, SpeculativeConfig, run_alone
from tests.conftest import make_word_model
from training.distill import answer_batch
from training.prompts import bench_ngrams, grounded_prompts, ngrams, open_prompts
from training.train_head import TrainConfig, rank_vocabulary, train

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_prompt_corpus_is_seeded_and_disjoint_from_every_bench_prompt():
    banned = bench_ngrams()
    assert len(banned) > 1000  # the bench sets were read
    first = open_prompts(1300, seed=0, banned=banned)
    assert first == open_prompts(1300, seed=0, banned=banned)
    assert len({p["prompt"] for p in first}) == 1300
    assert all(not (ngrams(p["prompt"]) & banned) for p in first)
    # the filter has power: a bench prompt itself is caught
    from bench.workloads import DATA_DIR, read_jsonl

    chat = read_jsonl(DATA_DIR / "chat.jsonl")[0]["prompt"]
    assert ngrams(chat) & banned
    grounded = grounded_prompts([("tides", "The tides rise and fall twice a day.")], seed=0)
    assert "The tides rise and fall twice a day." in grounded[0]["prompt"]


@pytest.fixture(scope="module")
def words():
    return make_word_model(seed=21, hidden=32)


def test_distilled_answers_are_the_targets_greedy_answers_with_its_hidden_states(words):
    prompts = [[2, 3, 4, 5], [6, 7], [8, 9, 10, 2, 3, 4]]
    answers = answer_batch(words, prompts, max_new_tokens=10)
    engine = Engine(words)
    for prompt, (tokens, hidden) in zip(prompts, answers, strict=True):
        g = engine.generate(prompt, SamplingParams(max_tokens=10), SpeculativeConfig(method="vanilla"))
        list(run_alone(g))
        assert tokens == [prompt[-1]] + [t.token_id for t in g.tokens]
        # hidden[i] is the target's final hidden state at the position before tokens[i]
        sequence = prompt[:-1] + tokens
        with torch.inference_mode():
            fresh = words.model.model(input_ids=torch.tensor([sequence])).last_hidden_state[0]
        start = len(prompt) - 2
        torch.testing.assert_close(hidden, fresh[start : start + len(tokens)], atol=1e-4, rtol=1e-4)


def test_training_writes_a_head_that_learned_and_loads(words, tmp_path):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 12, (5,), generator=generator).tolist() for _ in range(24)]
    answers = answer_batch(words, prompts, max_new_tokens=16)
    tokens = [torch.tensor(t, dtype=torch.int32) for t, _ in answers]
    offsets = [0]
    for t in tokens:
        offsets.append(offsets[-1] + len(t))
    data = tmp_path / "data.safetensors"
    save_file(
        {
            "tokens": torch.cat(tokens),
            "hidden": torch.cat([h for _, h in answers]).to(torch.bfloat16),
            "offsets": torch.tensor(offsets),
        },
        str(data),
    )
    config = TrainConfig(
        epochs=100,
        batch_size=64,
        unroll=3,
        inner_size=64,
        draft_vocab=10,
        warmup_steps=5,
        lr=3e-3,
        bf16=False,
    )
    report = train(words, [data], tmp_path / "head", config)
    history = report["history"]
    assert history[-1]["loss"] < history[0]["loss"]
    assert report["held_out"]["positions"] > 0
    card = (tmp_path / "head" / "README.md").read_text()
    assert "Held-out" in card and json.loads((tmp_path / "head" / "training.json").read_text())["steps"] > 0
    assert history[-1]["train_accuracy_per_step"][0] > 0.8  # it fits its data
    # The service loads it, and serving feeds it what training did (the same hidden state and token at
    # each step; an off-by-one would show here): on the prompts it was trained on, its drafts are accepted
    # far more often than an untrained head's.
    train(words, [data], tmp_path / "untrained", TrainConfig(**{**config.__dict__, "epochs": 0}))
    rates = []
    for folder in ("head", "untrained"):
        engine = Engine(words, {"head": HeadDrafter(words, tmp_path / folder)})
        accepted = drafted = 0
        for prompt in prompts[:8]:
            spec = SpeculativeConfig(
                method="sd", num_speculative_tokens=config.unroll
            )  # the steps it learned
            g = engine.generate(prompt, SamplingParams(max_tokens=16), spec, "head")
            list(run_alone(g))
            accepted, drafted = accepted + g.stats.num_accepted, drafted + g.stats.num_draft_tokens
        rates.append(accepted / drafted)
    assert rates[0] > 0.8 > 0.5 > rates[1], rates


def test_the_draft_vocabulary_ranks_answer_tokens_by_frequency():
    tokens = torch.tensor([9, 1, 1, 1, 2, 2, 3, 9, 4, 4, 4, 4])
    vocab, coverage = rank_vocabulary(tokens, [(0, 7), (7, 12)], size=2)
    # labels are every token after the first of each answer: 1 1 1 2 2 3 | 4 4 4 4
    assert vocab.tolist() == [1, 4] and coverage == pytest.approx(7 / 10)
