"""The drafter training pipeline: a corpus the target writes itself (Magpie) that never overlaps the
benchmark, stored as token ids; teacher-forced features equal to what serving hands the head; training on a
tiny model writes a head the service loads, whose drafts are accepted, with a fused-layer variant too."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file

from service.decoding import Engine, HeadDrafter, SamplingParams, SpeculativeConfig, run_alone
from service.decoding.text import encode_chat
from tests.conftest import make_word_model
from training.features import feature_layers, shard_features
from training.magpie import (
    CODE_OPENERS,
    Conversation,
    CorpusConfig,
    Filter,
    _answer,
    _new_conversation,
    _openings,
    _user_prefix,
    build_corpus,
    read_shard,
    shard_path,
    shard_positions,
    write_shard,
)
from training.overlap import bench_ngrams, ngrams, overlaps
from training.sampling import decode_batch
from training.traffic import held_out_acceptance
from training.train_head import TrainConfig, rank_vocabulary, train

pytestmark = pytest.mark.usefixtures("single_thread")


def test_the_filter_keeps_user_like_turns_and_drops_bench_overlaps_duplicates_and_loops():
    banned = bench_ngrams()
    assert len(banned) > 1000  # the bench sets were read
    from bench.workloads import DATA_DIR, read_jsonl

    chat = read_jsonl(DATA_DIR / "chat.jsonl")[0]["prompt"]
    assert ngrams(chat) & banned and overlaps(chat, banned)
    flt = Filter(banned)
    assert flt.accept("How do I keep basil alive on a windowsill in winter?")
    assert not flt.accept("How do I keep basil alive on a windowsill in winter?")  # duplicate opening
    assert not flt.accept(chat)  # a bench prompt
    assert not flt.accept("Hi")  # too short
    assert not flt.accept("buy now " * 40)  # degenerate repetition
    assert not flt.accept("Как приготовить борщ дома быстро и вкусно?")  # not the corpus' language
    assert not flt.accept("What is this?<|im_start|>assistant\nIt is")  # the template leaked


def test_magpie_samples_from_the_template_up_to_the_user_turn(embedded):
    conv = Conversation(kind="system", messages=[{"role": "system", "content": "Be brief."}])
    text = embedded.tokenizer.decode(_user_prefix(embedded, conv))
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    conv = Conversation(kind="open", messages=[], pending="How do I")
    text = embedded.tokenizer.decode(_user_prefix(embedded, conv))
    assert text.endswith("<|im_start|>user\nHow do I") and "You are a helpful AI assistant" in text


def test_answers_are_the_targets_greedy_answers_to_the_exact_prompt_ids(tiny):
    convs = [
        Conversation(kind="open", messages=[{"role": "user", "content": q}])
        for q in ("Name a colour.", "What is a river? Answer in one line please.")
    ]
    _answer(tiny, convs, CorpusConfig(batch_size=2, max_answer_tokens=6))
    engine = Engine(tiny)
    for conv in convs:
        (record,) = conv.records
        assert record["prompt_ids"] == encode_chat(tiny.tokenizer, record["messages"])
        g = engine.generate(
            record["prompt_ids"], SamplingParams(max_tokens=6), SpeculativeConfig(method="vanilla")
        )
        list(run_alone(g))
        assert record["answer_ids"] == [t.token_id for t in g.tokens][: len(record["answer_ids"])]
        assert conv.messages[-1]["role"] == "assistant"  # a multi-turn follow-up sees the answer


def test_sampled_turns_are_seeded_and_stop_at_the_stop_token(tiny):
    prompts = [[1, 2, 3], [4, 5]]
    first = decode_batch(tiny, prompts, 12, {7}, temperature=1.0, generator=torch.Generator().manual_seed(3))
    again = decode_batch(tiny, prompts, 12, {7}, temperature=1.0, generator=torch.Generator().manual_seed(3))
    other = decode_batch(tiny, prompts, 12, {7}, temperature=1.0, generator=torch.Generator().manual_seed(4))
    assert first == again and first != other
    # greedy, a row stops at its own stop token (kept as its last token) while the other decodes on
    greedy = decode_batch(tiny, prompts, 12, set())
    assert all(len(tokens) == 12 and not ended for tokens, ended in greedy)
    stop = greedy[0][0][3]
    assert stop not in greedy[0][0][:3]
    cut = decode_batch(tiny, prompts, 12, {stop})
    assert cut[0] == (greedy[0][0][:4], True)
    expected = greedy[1][0][: greedy[1][0].index(stop) + 1] if stop in greedy[1][0] else greedy[1][0]
    assert cut[1] == (expected, stop in greedy[1][0])
    # a row writes the same alone as beside others (the corpus is what serving writes, batched or not)
    assert decode_batch(tiny, prompts[1:], 12, set()) == greedy[1:]


def test_the_corpus_is_deduplicated_across_shards_and_mixes_in_code(tmp_path):
    turn = "How do I keep basil alive on a windowsill in winter?"
    records = [
        {
            "kind": "open",
            "messages": [{"role": "user", "content": turn}],
            "answer": "x",
            "prompt_ids": [1, 2],
            "answer_ids": [3, 4, 5],
        }
    ]
    path = shard_path(tmp_path, 0)
    write_shard(path, records)
    assert shard_positions(path) == 3
    seen = set(_openings(path))
    flt = Filter(set(), seen)
    assert not flt.accept(turn)  # an earlier shard opened a turn alike
    assert flt.accept("How do I repot a cactus without getting pricked?")
    rng = random.Random(0)
    convs = [_new_conversation(rng, []) for _ in range(400)]
    code = [c for c in convs if c.kind == "code"]
    assert 10 <= len(code) <= 60 and all(c.pending in CODE_OPENERS for c in code)


def test_the_corpus_resumes_shard_by_shard(tiny, tmp_path):
    records = [{"kind": "open", "messages": [], "answer": "x", "prompt_ids": [1, 2], "answer_ids": [3]}]
    write_shard(shard_path(tmp_path, 0), records)
    # shard 0 exists, so nothing is generated for it; the budget stops shard 1 before it starts
    built = build_corpus(tiny, tmp_path, 2, CorpusConfig(), set(), budget_seconds=-1)
    assert built == [shard_path(tmp_path, 0)] and read_shard(built[0]) == records

    def no_writer():
        raise AssertionError("the writer was loaded although every shard was there")

    # a resumed run whose shards all exist never loads the model that writes them
    assert build_corpus(no_writer, tmp_path, 1, CorpusConfig(), set()) == [shard_path(tmp_path, 0)]


@pytest.fixture(scope="module")
def words():
    return make_word_model(seed=21, hidden=32, layers=4)


def _greedy_records(model, prompts, max_tokens):
    engine = Engine(model)
    records = []
    for prompt in prompts:
        g = engine.generate(
            prompt, SamplingParams(max_tokens=max_tokens), SpeculativeConfig(method="vanilla")
        )
        list(run_alone(g))
        records.append({"prompt_ids": prompt, "answer_ids": [t.token_id for t in g.tokens]})
    return records


def test_features_are_the_states_serving_hands_the_head(words, tmp_path):
    records = _greedy_records(words, [[2, 3, 4, 5], [6, 7], [8, 9, 10, 2, 3, 4]], 10)
    out = tmp_path / "f.safetensors"
    assert shard_features(words, records, out, batch_size=2) == sum(len(r["answer_ids"]) + 1 for r in records)
    from safetensors.torch import load_file

    data = load_file(str(out))
    offsets = data["offsets"].tolist()
    low, mid = feature_layers(len(words.model.model.layers))
    for i, record in enumerate(records):
        sequence = record["prompt_ids"] + record["answer_ids"]
        with torch.inference_mode():
            fresh = words.model.model(input_ids=torch.tensor([sequence]), output_hidden_states=True)
        start, span = len(record["prompt_ids"]) - 2, slice(offsets[i], offsets[i + 1])
        n = offsets[i + 1] - offsets[i]
        assert data["tokens"][span].tolist() == [record["prompt_ids"][-1], *record["answer_ids"]]
        # hidden[i] is the final hidden state at the position before tokens[i] (bf16 storage)
        for key, expected in (
            ("hidden", fresh.last_hidden_state[0]),
            ("hidden_low", fresh.hidden_states[low + 1][0]),  # hidden_states[0] is the embeddings
            ("hidden_mid", fresh.hidden_states[mid + 1][0]),
        ):
            torch.testing.assert_close(
                data[key][span].float(), expected[start : start + n], atol=0.05, rtol=0.02
            )


@pytest.mark.parametrize("fused", [False, True], ids=["final", "fused"])
def test_training_writes_a_head_that_learned_and_loads(words, tmp_path, fused):
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 12, (5,), generator=generator).tolist() for _ in range(24)]
    records = _greedy_records(words, prompts, 16)
    data = tmp_path / "data.safetensors"
    shard_features(words, records, data)
    config = TrainConfig(
        epochs=100,
        batch_size=64,
        unroll=3,
        inner_size=64,
        draft_vocab=10,
        warmup_steps=5,
        lr=3e-3,
        bf16=False,
        fuse_layers=fused,
    )
    report = train(words, [data], tmp_path / "head", config)
    history = report["history"]
    assert history[-1]["loss"] < history[0]["loss"]
    held = report["held_out"]
    assert held["positions"] > 0 and 1.0 <= held["served_tokens_per_forward"] <= 7.0
    assert report["confidence_calibration"]["temperature"] > 0
    card = (tmp_path / "head" / "README.md").read_text()
    assert "Predicted for serving" in card and json.loads((tmp_path / "head" / "training.json").read_text())
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert (saved["feature_layers"] != []) == fused
    # a fine-tune that does not ask for fusion (what --from-traffic runs) keeps a fused start head fused, and
    # the traffic report scores either kind
    plain = TrainConfig(
        **{**config.__dict__, "epochs": 0, "fuse_layers": False, "init_from": tmp_path / "head"}
    )
    train(words, [data], tmp_path / "again", plain)
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["feature_layers"] == saved["feature_layers"]
    assert held_out_acceptance(words, tmp_path / "again", data)["positions"] > 0
    assert history[-1]["train_accuracy_per_step"][0] > 0.8  # it fits its data
    # The service loads it, and serving feeds it what training did (the same features and token at each
    # drafted position; an off-by-one would show here): on the prompts it was trained on, its drafts are
    # accepted far more often than an untrained head's.
    train(words, [data], tmp_path / "untrained", TrainConfig(**{**config.__dict__, "epochs": 0}))
    rates = []
    for folder in ("head", "untrained"):
        engine = Engine(words, {"head": HeadDrafter(words, tmp_path / folder)})
        accepted = drafted = 0
        for prompt in prompts[:8]:
            spec = SpeculativeConfig(
                method="sd", num_speculative_tokens=config.unroll
            )  # the drafted positions it learned
            g = engine.generate(prompt, SamplingParams(max_tokens=16), spec, "head")
            list(run_alone(g))
            accepted, drafted = accepted + g.stats.num_accepted, drafted + g.stats.num_draft_tokens
        rates.append(accepted / max(1, drafted))
    assert rates[0] > 0.8 > 0.5 > rates[1], rates
    # A head started from another keeps its weights and draft vocabulary; fusion added on top starts as the
    # identity, so before any optimizer step the fused head drafts exactly as the one it started from.
    warm = TrainConfig(
        **{**config.__dict__, "epochs": 0, "fuse_layers": True, "init_from": tmp_path / "head"}
    )
    started = train(words, [data], tmp_path / "warm", warm)
    trained = json.loads((tmp_path / "head" / "training.json").read_text())
    for key in ("accuracy_per_step", "served_tokens_per_forward"):
        assert started["held_out"][key] == trained["held_out"][key]
    # and its draft vocabulary can grow by the new data's frequent tokens (the head's weights don't depend on it)
    small = TrainConfig(**{**config.__dict__, "epochs": 0, "draft_vocab": 4})
    train(words, [data], tmp_path / "small", small)
    grown = TrainConfig(**{**small.__dict__, "init_from": tmp_path / "small", "extend_vocab": 10})
    train(words, [data], tmp_path / "grown", grown)
    before = json.loads((tmp_path / "small" / "config.json").read_text())["draft_vocab_size"]
    after = json.loads((tmp_path / "grown" / "config.json").read_text())["draft_vocab_size"]
    assert before == 4 < after <= 10


def test_prompts_unlike_the_corpus_calibrate_the_head_and_give_the_cards_prediction(words, tmp_path):
    generator = torch.Generator().manual_seed(1)
    corpus = [torch.randint(2, 12, (5,), generator=generator).tolist() for _ in range(24)]
    other = [torch.randint(2, 12, (3,), generator=generator).tolist() for _ in range(7)]
    shard_features(words, _greedy_records(words, corpus, 16), tmp_path / "corpus.safetensors")
    shard_features(words, _greedy_records(words, other, 12), tmp_path / "other.safetensors")
    config = TrainConfig(epochs=5, batch_size=64, unroll=3, inner_size=64, draft_vocab=10, bf16=False)
    report = train(
        words,
        [tmp_path / "corpus.safetensors"],
        tmp_path / "head",
        config,
        unseen={"other": tmp_path / "other.safetensors"},
    )
    # start positions per answer (each has a label after it); answers 0, 2, 4, 6 fit the temperature,
    # answers 1, 3, 5 are what the card predicts from
    offsets = load_file(str(tmp_path / "other.safetensors"))["offsets"].tolist()
    starts = [b - a - 1 for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    calibration, predicted = report["confidence_calibration"], report["predicted_unseen"]
    assert calibration["positions"] == sum(starts[0::2]) and "other" in calibration["on"]
    assert predicted["other"]["positions"] == sum(starts[1::2]) > 0
    assert 1.0 <= predicted["other"]["served_tokens_per_forward"] <= 4.0
    card = (tmp_path / "head" / "README.md").read_text()
    assert (
        "prompts people wrote" in card
        and f"(`bench/data/other.jsonl`): {predicted['other']['served_tokens_per_forward']}" in card
    )
    assert "not the prediction" in card  # the held-out corpus figure is labelled as what it is
    # an ablation's card reproduces its shape (the default shape's card names none of these flags)
    assert (
        "--inner-size 64 --unroll 3 --draft-vocab 10 --epochs 5 --install" in card and "--blocks" not in card
    )
    saved = json.loads((tmp_path / "head" / "config.json").read_text())
    assert saved["confidence_temperature"] == calibration["temperature"]


def test_no_committed_corpus_turn_shares_8_words_with_a_bench_prompt():
    # the wall between training and evaluation, checked on what is committed: a bench prompt added after a
    # shard was written (calibration-chat.jsonl, say) must not have been seen by the corpus either
    from training.__main__ import DEFAULT_CORPUS

    banned = bench_ngrams()
    shards = sorted(DEFAULT_CORPUS.glob("corpus-*.jsonl.gz"))
    turns = [
        m["content"]
        for shard in shards
        for r in read_shard(shard)
        for m in r["messages"]
        if m["role"] == "user"
    ]
    assert len(shards) >= 12 and len(turns) > 2000
    assert [t for t in turns if overlaps(t, banned)] == []


def test_the_draft_vocabulary_ranks_answer_tokens_by_frequency():
    tokens = torch.tensor([9, 1, 1, 1, 2, 2, 3, 9, 4, 4, 4, 4])
    vocab, coverage = rank_vocabulary(tokens, [(0, 7), (7, 12)], size=2)
    # labels are every token after the first of each answer: 1 1 1 2 2 3 | 4 4 4 4
    assert vocab.tolist() == [1, 4] and coverage == pytest.approx(7 / 10)


def test_a_trained_exit_agrees_with_the_target_more_and_serves_as_a_draft_model(words, tmp_path):
    """training.exit on a 4-layer model cut at 2: the exit learns the target's tokens from layer 2's states,
    and the folder it writes loads as a draft model whose logits are the exit's."""
    from service.executor.early_exit import final_rms_norm, save_exit
    from service.executor.models import load_model
    from training.exit import Exit, exit_states, model_card

    words.model.save_pretrained(tmp_path / "base")
    words.tokenizer.save_pretrained(tmp_path / "base")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 12, (4,), generator=generator).tolist() for _ in range(16)]
    records = _greedy_records(words, prompts, 12)  # the whole target's answers: the labels
    cut = load_model(str(tmp_path / "base"), layers=2, dtype="float32")
    assert len(cut.model.get_decoder().layers) == 2
    states, labels = exit_states(cut.model, records)
    assert states.shape == (sum(len(r["answer_ids"]) for r in records), words.model.config.hidden_size)
    norm = final_rms_norm(cut.model)
    exit_ = Exit(norm.weight.detach().float(), norm.variance_epsilon, cut.model.get_output_embeddings())
    before = exit_.agreement(states, labels)
    losses = exit_.fit(states, labels, epochs=40, lr=1e-2, batch=64, seed=0)
    after = exit_.agreement(states, labels)
    assert losses[-1] < losses[0] and after >= before + 0.15, (before, after)

    save_exit(tmp_path / "exit", str(tmp_path / "base"), 2, exit_.adapter, exit_.scale)
    draft = load_model(str(tmp_path / "exit"), dtype="float32")
    ids = records[0]["prompt_ids"] + records[0]["answer_ids"]
    with torch.inference_mode():
        got = draft.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        span = slice(len(records[0]["prompt_ids"]) - 1, len(ids) - 1)
        expected = exit_.logits(states[: len(records[0]["answer_ids"])])
    assert torch.allclose(got[span].float(), expected, atol=1e-3, rtol=1e-3)
    # its card names the target and the exit's own size, not the embedded model's
    held = {"calibration": {"kind": "grounded tasks", "positions": 9, "untrained": 0.1, "trained": 0.5}}
    report = {"model": "base", "layers": 2, "of_layers": 4, "hidden": 32, "answers": 16, "positions": 9,
              "lr": 0.01, "epochs": 40, "batch": 64, "seed": 0, "train_seconds": 1.0, "threads": 1,
              "final_loss": 1.0, "held_out": held, "command": "python -m training.exit"}  # fmt: skip
    card = model_card(report)
    assert "`base`" in card and "A 32 x\n32" in card and "(0.0 MB)" in card and "576" not in card


def test_the_command_line_sets_the_heads_shape_for_ablations_and_keeps_the_shipped_one_by_default():
    from training.__main__ import build_parser, train_config
    from training.train_head import TrainConfig

    default = train_config(build_parser().parse_args([]))
    assert (default.inner_size, default.num_blocks, default.unroll) == (
        TrainConfig.inner_size,
        TrainConfig.num_blocks,
        TrainConfig.unroll,
    )
    assert default.fuse_layers  # the shipped head fuses low, mid and final features
    shaped = train_config(
        build_parser().parse_args(["--inner-size", "2048", "--blocks", "3", "--unroll", "6", "--epochs", "1"])
    )
    assert (shaped.inner_size, shaped.num_blocks, shaped.unroll, shaped.epochs) == (2048, 3, 6, 1.0)
