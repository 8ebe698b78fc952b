"""Continuous batching: a sequence decoded in a batch emits what it emits alone.

Real embedded model throughout. Rows of a batch differ in prompt length (so in padding), method (vanilla,
sd, lossy, csd with a memory that rescues) and draft length; sequences join while others run, leave when
done or cancelled, and long prompts are prefilled in chunks between the others' rounds. Token comparisons
go through `assert_same_tokens`: a batched forward may differ from a one-row forward in the last bits, so
only a genuine near-tie may flip, and it is shown, never hidden.
"""

from __future__ import annotations

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
from service.decoding.batch import MIN_PREFILL_CHUNK, Batch
from service.decoding.draft_head import EMBEDDED_HEAD_DIR
from service.decoding.draft_policy import DraftPolicy
from service.decoding.text import encode_chat
from service.decoding.types import DecodingError
from service.executor import batch_kv
from tests.decoding.test_lossless import assert_same_tokens

pytestmark = pytest.mark.usefixtures("single_thread")

CHUNK = 48  # max_batched_tokens: small, so the long prompt is prefilled in several chunks
MAX_TOKENS = 24
PROMPTS = [
    ("Write the days of the week, one per line, twice.", "sd"),
    # csd emits rescued tokens here (with the seeded memory below); a rescue past the EOS would not count
    ("Copy exactly: the colour of the sky is grey, the colour of the sea is grey.", "csd"),
    ("Hi!", "vanilla"),
    (
        "Rewrite in American spelling: "
        + " ".join(
            "The colour of the theatre's centre stage was grey, and the organisers apologised for the "
            "delay of the programme."
            for _ in range(4)
        ),
        "lossy",
    ),
]
NS = Namespace("embedded", "ngram", "test")


def seeded_memory(engine_target, prompt_ids):
    """A memory that has seen the sd rejections of the csd prompt once: with lambda 0 each is a rescue
    candidate. Built the same way for every run, so the alone and batched csd rows start equal."""
    store = InMemoryStore()
    memory = store.memory(NS)
    engine = Engine(engine_target, {"ngram": NgramDrafter()}, {"ngram": memory})
    g = engine.generate(
        prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), SpeculativeConfig(method="sd"), record_strict=True
    )
    for _ in run_alone(g):
        pass
    return memory


def make_generation(embedded, ids, method, memory=None):
    engine = Engine(embedded, {"ngram": NgramDrafter()}, {"ngram": memory} if memory is not None else {})
    spec = SpeculativeConfig(method=method, lambda_=0, tau=0.001) if method == "csd" else None
    return engine.generate(
        ids, SamplingParams(max_tokens=MAX_TOKENS), spec or SpeculativeConfig(method=method)
    )


def run_batch(batch: Batch, join: dict[int, list], cancel: dict[int, object] | None = None) -> int:
    """Step until every sequence finished; `join[i]` sequences are added before step i."""
    steps = 0
    while len(batch) or any(i >= steps for i in join):
        for g in join.get(steps, []):
            batch.add(g)
        if cancel and steps in cancel:
            batch.remove(cancel[steps])
        batch.step()
        steps += 1
        assert steps < 500
    return steps


@pytest.fixture(scope="module")
def prompt_ids(embedded):
    return [encode_chat(embedded.tokenizer, [{"role": "user", "content": p}]) for p, _ in PROMPTS]


@pytest.fixture(scope="module")
def alone(embedded, prompt_ids):
    """Each prompt decoded alone (a batch of one), with the same chunk size."""
    out = []
    for ids, (_, method) in zip(prompt_ids, PROMPTS, strict=True):
        memory = seeded_memory(embedded, ids) if method == "csd" else None
        g = make_generation(embedded, ids, method, memory)
        run_batch(Batch(embedded, max_batch_size=1, max_batched_tokens=CHUNK), {0: [g]})
        out.append(g)
    return out


def fresh(embedded, prompt_ids):
    gens = []
    for ids, (_, method) in zip(prompt_ids, PROMPTS, strict=True):
        memory = seeded_memory(embedded, ids) if method == "csd" else None
        gens.append(make_generation(embedded, ids, method, memory))
    return gens


def check_same(embedded, prompt_ids, gens, alone, skip=()):
    for i, (g, ref) in enumerate(zip(gens, alone, strict=True)):
        if i in skip:
            continue
        assert_same_tokens(
            embedded, prompt_ids[i], [t.token_id for t in g.tokens], [t.token_id for t in ref.tokens]
        )
        assert g.finish_reason == ref.finish_reason
        assert g.text == ref.text


def test_the_alone_runs_exercise_what_batching_must_preserve(alone, prompt_ids):
    """Guards the test's own power: drafts were verified, csd rescued, the long prompt needed chunks."""
    by_method = {method: g for g, (_, method) in zip(alone, PROMPTS, strict=True)}
    assert by_method["sd"].stats.num_draft_tokens > 0
    assert by_method["csd"].stats.num_rescued > 0
    assert by_method["vanilla"].stats.num_draft_tokens == 0
    assert len(prompt_ids[3]) > 2 * CHUNK


@pytest.mark.parametrize("compact", [False, True], ids=["holes", "compacted"])
def test_batched_outputs_equal_alone_with_staggered_joins(embedded, prompt_ids, alone, compact, monkeypatch):
    if compact:  # compact after every round: the gather path must keep every row intact
        monkeypatch.setattr(batch_kv, "_COMPACT_MIN_SLOTS", 1)
        monkeypatch.setattr(batch_kv, "_COMPACT_DEAD_SHARE", 0.0)
    gens = fresh(embedded, prompt_ids)
    batch = Batch(embedded, max_batch_size=4, max_batched_tokens=CHUNK)
    # two start together, the long prompt joins mid-flight, the short one later still
    run_batch(batch, {0: [gens[0], gens[1]], 2: [gens[3]], 5: [gens[2]]})
    check_same(embedded, prompt_ids, gens, alone)


def test_a_cancelled_sequence_leaves_the_others_untouched(embedded, prompt_ids, alone):
    gens = fresh(embedded, prompt_ids)
    batch = Batch(embedded, max_batch_size=4, max_batched_tokens=CHUNK)
    run_batch(batch, {0: gens}, cancel={4: gens[1]})
    assert gens[1].finish_reason is None and len(gens[1].tokens) < len(alone[1].tokens)
    check_same(embedded, prompt_ids, gens, alone, skip={1})


def test_a_long_prefill_is_chunked_between_the_others_rounds(embedded, prompt_ids):
    short, long = fresh(embedded, prompt_ids)[0], fresh(embedded, prompt_ids)[3]
    batch = Batch(embedded, max_batch_size=2, max_batched_tokens=CHUNK)
    batch.add(short)
    batch.step()  # short's prefill (one chunk) and its first round
    assert len(short.tokens) > 0
    batch.add(long)
    steps = 0
    while long not in batch.running:
        before, prefilled = len(short.tokens), long.prefilled
        batch.step()
        steps += 1
        # every step gave the running sequence a round while the long prompt went in chunk by chunk, each
        # chunk within the step's token budget left by the round (and at least the minimum chunk)
        assert len(short.tokens) > before or short.finish_reason is not None
        if long not in batch.running:
            assert MIN_PREFILL_CHUNK <= long.prefilled - prefilled <= CHUNK - 1
    assert steps >= -(-(len(prompt_ids[3]) - 1) // (CHUNK - 1))


def test_batch_limits(embedded, prompt_ids):
    batch = Batch(embedded, max_batch_size=2, max_batched_tokens=CHUNK)
    gens = fresh(embedded, prompt_ids)
    batch.add(gens[0])
    batch.add(gens[1])
    assert not batch.has_room
    with pytest.raises(Exception, match="full"):
        batch.add(gens[2])
    with pytest.raises(Exception, match="max_batched_tokens"):
        Batch(embedded, max_batch_size=8, max_batched_tokens=4)


def test_round_width_never_exceeds_max_batched_tokens(embedded, prompt_ids):
    """Four rows at 12 tokens a forward: the draft cap shrinks to 2 (3 tokens a row)."""
    widths = []
    gens = fresh(embedded, prompt_ids)
    batch = Batch(embedded, max_batch_size=4, max_batched_tokens=12)
    model = embedded.model
    hook = model.register_forward_pre_hook(
        lambda _m, args, kwargs: widths.append(kwargs["input_ids"].numel()), with_kwargs=True
    )
    try:
        for g in gens:
            batch.add(g)
        for _ in range(8):
            batch.step()
    finally:
        hook.remove()
    assert max(widths) <= 12
    assert any(g.stats.num_draft_tokens for g in gens)


def test_speculation_is_switched_off_when_a_wide_batch_does_not_pay():
    """On a CPU a forward costs about linear in its tokens past a few: alone, drafts that usually survive
    are worth verifying; at 16 rows they are not, and the cap drops to 0 (plain batched decoding)."""
    cpu = [1.0, 1.3, 1.5, 1.7, 1.9, 2.1, 2.3, 2.5] + [2.5 * n / 8 for n in range(9, 129)]
    policy = DraftPolicy(cpu, explore_every=1000)
    for _ in range(50):
        policy.observe("ngram", 2, drafted=4, kept=3)
    assert policy.choose_batch([("ngram", 2, 4)], rows=1) == 3  # the 4th draft token never survived
    assert policy.choose_batch([("ngram", 2, 4)] * 16, rows=16) == 0
    # mixed batch: one speculating row among 8 cannot pay for widening all eight
    assert policy.choose_batch([("ngram", 2, 4)], rows=8) == 0


def test_speculation_stays_on_at_16_rows_where_forwards_are_overhead_bound():
    """A GPU-like cost table (a wider forward costs little more): the same drafts pay at 16 rows."""
    gpu = [1.0 + 0.002 * n for n in range(1, 129)]
    policy = DraftPolicy(gpu, explore_every=1000)
    for _ in range(50):
        policy.observe("ngram", 2, drafted=4, kept=3)
    assert policy.choose_batch([("ngram", 2, 4)] * 16, rows=16) >= 3
    assert policy.choose_batch([("ngram", 2, 4)] * 16, rows=16, max_len=2) == 2


def padded_and_solo_logits(target, a: list[int], b: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """b's logits (from its 6th token on) as the second row of a batch with a, left-padded to a's width, and
    alone in one forward."""
    from service.executor.batch_kv import BatchKV

    with torch.inference_mode():
        solo = target.model(input_ids=torch.tensor([b])).logits[0].float()
        kv = BatchKV(target.model, target.device, rows=1)
        kv.forward([a[:-1]])
        other = BatchKV(target.model, target.device, rows=1)
        other.forward([b[:5]])
        kv.add(other)  # b is left-padded to a's width
        logits = kv.forward([[a[-1]], b[5:]])[1, : len(b) - 5].float()
    return logits, solo


def test_greedy_argmax_is_unaffected_by_padding_rows(embedded, prompt_ids):
    """The raw layout check: one row's logits in a padded two-row forward equal its one-row logits."""
    logits, solo = padded_and_solo_logits(embedded, prompt_ids[0], prompt_ids[2])
    assert torch.allclose(logits, solo[5:], atol=1e-3)
    assert torch.equal(logits.argmax(-1), solo[5:].argmax(-1))


def test_draft_model_rows_draft_together_and_stay_right(embedded, prompt_ids, alone):
    """The target drafting for itself through the batch's draft cache: rows of different lengths drafting
    in shared draft forwards. A wrong draft cache (a stale or shifted row) would show as rejections; the
    target agrees with itself nearly always. The outputs are sd's, so they equal the alone runs of the
    sd and vanilla prompts."""
    engine = Engine(embedded, {"ngram": NgramDrafter(), "self": ModelDrafter(embedded)})
    picks = [0, 2, 3]  # sd, vanilla, lossy prompts: run all three as sd with the self-drafter
    gens = [
        engine.generate(
            prompt_ids[i], SamplingParams(max_tokens=MAX_TOKENS), SpeculativeConfig(method="sd"), "self"
        )
        for i in picks
    ]
    draft_forwards = []
    hook = embedded.model.register_forward_pre_hook(
        lambda _m, args, kwargs: draft_forwards.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        run_batch(Batch(embedded, max_batch_size=3, max_batched_tokens=CHUNK), {0: gens[:2], 3: gens[2:]})
    finally:
        hook.remove()
    for g in gens:
        assert g.stats.num_draft_tokens > 0
        assert g.stats.acceptance_rate > 0.9, g.stats.acceptance_rate
    # sd is lossless: the rows whose alone run was sd or vanilla must match it token for token
    for g, i in zip(gens[:2], picks[:2], strict=True):
        assert_same_tokens(
            embedded, prompt_ids[i], [t.token_id for t in g.tokens], [t.token_id for t in alone[i].tokens]
        )
    # draft forwards really carried several rows at once (the same model serves as target and drafter,
    # so the hook sees both; rows > 1 appear only in batched forwards)
    assert max(draft_forwards) >= 2


def test_head_and_combined_rows_batch_with_the_others_and_stay_lossless(embedded, prompt_ids, alone):
    """The trained head drafts for several rows in one `advance` per drafted position, each row from its own
    hidden state, beside n-gram rows; strict SD stays equal to the alone runs."""
    head = HeadDrafter(embedded, EMBEDDED_HEAD_DIR)
    drafters = {"ngram": NgramDrafter(), "head": head, "combined": CombinedDrafter(NgramDrafter(), head)}
    engine = Engine(embedded, drafters)
    picks = [(0, "head"), (2, "combined"), (3, "head"), (0, "ngram")]
    gens = [
        engine.generate(
            prompt_ids[i], SamplingParams(max_tokens=MAX_TOKENS), SpeculativeConfig(method="sd"), drafter
        )
        for i, drafter in picks
    ]
    run_batch(Batch(embedded, max_batch_size=4, max_batched_tokens=96), {0: gens[:2], 2: gens[2:]})
    for g, (i, _) in zip(gens, picks, strict=True):
        assert g.stats.num_draft_tokens > 0
        if PROMPTS[i][1] in ("sd", "vanilla"):  # the alone run of this prompt was lossless
            assert_same_tokens(
                embedded, prompt_ids[i], [t.token_id for t in g.tokens], [t.token_id for t in alone[i].tokens]
            )
    assert gens[0].stats.tokens_per_forward > 1.2  # the head's drafts were accepted in the batch


def test_a_sequence_that_fails_leaves_the_batch_alone(embedded, prompt_ids, alone):
    """A fault no real input triggers (named fake): one row's verification raises mid-generation. That row
    is dropped and reported in `Batch.failed`; the other rows finish with their alone outputs."""
    gens = fresh(embedded, prompt_ids)
    broken = gens[1]
    calls = {"n": 0}
    real_verify = broken._verify

    def fake_failing_verify(*args, **kwargs):  # a fake: fails on its third round
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected verification fault")
        return real_verify(*args, **kwargs)

    broken._verify = fake_failing_verify
    batch = Batch(embedded, max_batch_size=4, max_batched_tokens=CHUNK)
    for g in gens:
        batch.add(g)
    failed = []
    while len(batch):
        batch.step()
        failed += batch.failed
    assert [(g, str(e)) for g, e in failed] == [(broken, "injected verification fault")]
    assert broken not in batch.running
    check_same(embedded, prompt_ids, gens, alone, skip={1})
    # alone, the same fault surfaces to whoever iterates the generation
    lone = fresh(embedded, prompt_ids)[1]
    lone._verify = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        list(run_alone(lone))


def test_one_token_prompts_join_a_running_batch(embedded, prompt_ids):
    """A one-token prompt has nothing to prefill (no cache yet): it joins rows that have caches, and a
    batch made of such rows grows its first cache in a shared forward."""
    bos = [prompt_ids[0][0]]
    runs = []
    for join in ({0: ["long", "one"]}, {0: ["one", "one2"]}, {0: ["long"], 2: ["one"]}):
        made = {
            "long": make_generation(embedded, prompt_ids[0], "sd"),
            "one": make_generation(embedded, bos, "vanilla"),
            "one2": make_generation(embedded, bos, "sd"),
        }
        batch = Batch(embedded, max_batch_size=4, max_batched_tokens=CHUNK)
        run_batch(batch, {step: [made[name] for name in names] for step, names in join.items()})
        runs.append({name: made[name] for names in join.values() for name in names})
    lone = make_generation(embedded, bos, "vanilla")
    list(run_alone(lone))
    assert lone.tokens
    for made in runs:
        for name in ("one", "one2"):
            if name in made:
                assert [t.token_id for t in made[name].tokens] == [t.token_id for t in lone.tokens], name


def test_models_with_sliding_window_layers_are_not_batched(embedded):
    """Their caches keep a rolling window that slot masks cannot address: the runtime serves them one at
    a time (and says so in the log); full-attention models batch."""
    from transformers import MistralConfig, MistralForCausalLM

    from service.executor.batch_kv import supports_batching

    tiny_mistral = MistralForCausalLM(
        MistralConfig(
            num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=100, sliding_window=8,
        )
    )  # fmt: skip
    assert not supports_batching(tiny_mistral)
    assert supports_batching(embedded.model)


def test_choices_of_one_prompt_share_its_prefill_and_decode_as_if_alone(embedded, prompt_ids, alone):
    """A request's n choices: one prefill forward per chunk for the group, then one row each; at
    temperature 0 every choice equals the prompt decoded alone, and a choice cancelled while the group is
    still joining leaves the others alone."""
    index = next(i for i, (_, method) in enumerate(PROMPTS) if method == "sd")
    group = [make_generation(embedded, prompt_ids[index], "sd") for _ in range(3)]
    batch = Batch(embedded, max_batch_size=4, max_batched_tokens=CHUNK)
    batch.add_group(group)
    assert len(batch) == 3 and batch.room() == 1
    with pytest.raises(DecodingError, match="full"):
        batch.add_group([make_generation(embedded, prompt_ids[index], "sd") for _ in range(2)])
    batch.remove(group[2])  # cancelled before its prompt is in
    calls = []
    hook = embedded.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        run_batch(batch, {})
        grouped = len(calls)
        calls.clear()
        single = make_generation(embedded, prompt_ids[index], "sd")
        run_batch(Batch(embedded, max_batch_size=1, max_batched_tokens=CHUNK), {0: [single]})
    finally:
        hook.remove()
    # the same forwards as one sequence alone: prefill chunks once for the group, every round shared
    assert grouped == len(calls)
    for g in group[:2]:
        assert [t.token_id for t in g.tokens] == [t.token_id for t in alone[index].tokens]
    assert not group[2].tokens


def test_a_group_shares_one_prompt(embedded, prompt_ids):
    batch = Batch(embedded, max_batch_size=4)
    with pytest.raises(DecodingError, match="shares one prompt"):
        batch.add_group([make_generation(embedded, ids, "vanilla") for ids in prompt_ids[:2]])
