"""The draft policy verifies a draft only as far as it pays for itself."""

from __future__ import annotations

import pytest

from service.decoding.draft_policy import DraftPolicy, RowAcceptance, RowOffer, measure_forward_costs
from service.executor.forward_costs import ForwardCosts

# a CPU-like cost table: any draft token costs a lot, more of them little more
CPU_COSTS = [1.0, 1.8, 1.9, 2.0, 2.0, 2.1, 2.1]


def test_without_costs_every_draft_is_verified_in_full():
    policy = DraftPolicy()
    assert policy.choose("ngram", 2, 6) == 6
    assert policy.choose("ngram", 2, 0) == 0


def test_reliable_drafts_are_verified_in_full():
    policy = DraftPolicy(CPU_COSTS)
    for _ in range(50):
        policy.observe("ngram", 3, drafted=6, kept=6)
    assert policy.choose("ngram", 3, 6) == 6


def test_drafts_that_never_survive_become_plain_rounds_with_exploration():
    policy = DraftPolicy(CPU_COSTS, explore_every=4)
    for _ in range(50):
        policy.observe("ngram", 2, drafted=6, kept=0)
    choices = [policy.choose("ngram", 2, 6) for _ in range(8)]
    # three plain rounds, then one exploratory full draft, twice over
    assert choices == [0, 0, 0, 6, 0, 0, 0, 6]


def test_acceptance_is_learned_per_key_and_per_drafter():
    policy = DraftPolicy(CPU_COSTS, explore_every=1000)
    for _ in range(50):
        policy.observe("ngram", 2, drafted=6, kept=0)
        policy.observe("ngram", 4, drafted=6, kept=6)
    assert policy.choose("ngram", 2, 6) == 0
    assert policy.choose("ngram", 4, 6) == 6
    assert policy.choose("model", 2, 6) > 0  # unseen: the prior says try


def test_a_short_reliable_prefix_is_kept_when_the_tail_fails():
    costs = [1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2]  # each token costs 0.2 more
    policy = DraftPolicy(costs, explore_every=1000)
    for _ in range(100):
        policy.observe("ngram", 2, drafted=6, kept=2)
    assert policy.choose("ngram", 2, 6) in (2, 3)


def test_the_policy_adapts_when_the_workload_changes():
    policy = DraftPolicy(CPU_COSTS, explore_every=1000)
    for _ in range(50):
        policy.observe("ngram", 2, drafted=6, kept=0)
    assert policy.choose("ngram", 2, 6) == 0
    for _ in range(100):  # decayed counts let recent rounds outweigh old ones
        policy.observe("ngram", 2, drafted=6, kept=6)
    assert policy.choose("ngram", 2, 6) == 6


def test_measured_costs_are_positive_and_non_decreasing(tiny):
    costs = measure_forward_costs(tiny.model, 4, context=16, repeats=1, max_rows=5)
    assert sorted(costs.by_rows) == [1, 2, 4, 5]  # doubling row counts, then the maximum
    for table in costs.by_rows.values():
        assert len(table) == 4
        assert all(c > 0 for c in table)
        assert table == sorted(table)
    # rows between measured ones interpolate; rows beyond scale linearly
    assert costs(4, 2) <= costs(3, 2) * 2 and costs(3, 2) >= min(costs(2, 2), costs(4, 2))
    assert costs(10, 1) == pytest.approx(costs(5, 1) * 2)


def test_a_single_row_table_costs_a_batch_as_one_long_row():
    policy = DraftPolicy([1.0, 1.8, 1.9, 2.0])
    assert policy.cost(1, 3) == 1.9
    assert policy.cost(2, 2) == 2.0
    assert policy.cost(4, 2) == pytest.approx(2.0 * 8 / 4)


# ---------------------------------------------------------------- per-row caps (choose_rows)


def _row(kept_of_6: int, rounds: int = 20) -> RowAcceptance:
    own = RowAcceptance()
    for _ in range(rounds):
        own.observe(6, kept_of_6)
    return own


def test_a_row_whose_drafter_does_well_keeps_drafting_where_the_drafter_usually_misses():
    """The drafter's rates say its drafts die (kept 0 of 6): alone they would be plain rounds. A row whose
    own drafts survive keeps drafting, and a row beside it whose own drafts die rides along in the padded
    forward (its positions cost nothing more) instead of dragging the batch to plain rounds."""
    policy = DraftPolicy(CPU_COSTS, explore_every=1000)
    for _ in range(50):
        policy.observe("ngram", 2, drafted=6, kept=0)
    assert policy.choose_rows([RowOffer("ngram", 2, 6)], rows=1) == [0]
    assert policy.choose_rows([RowOffer("ngram", 2, 6, _row(6))], rows=1) == [6]
    caps = policy.choose_rows([RowOffer("ngram", 2, 6, _row(6)), RowOffer("ngram", 2, 6, _row(0))], rows=2)
    assert caps[0] >= 3 and caps[1] == caps[0]  # 3: where a third token stops paying for two rows' width


def test_a_row_whose_drafter_misses_decodes_plainly_where_the_drafter_usually_hits():
    policy = DraftPolicy(CPU_COSTS, explore_every=1000)
    for _ in range(50):
        policy.observe("ngram", 4, drafted=6, kept=6)
    bad = RowOffer("ngram", 4, 6, _row(0, rounds=40))
    assert policy.choose_rows([RowOffer("ngram", 4, 6)], rows=1) == [6]
    assert policy.choose_rows([bad], rows=1) == [0]
    # a row that keeps two of six verifies about that much where each draft token costs a fifth of a forward
    steep = DraftPolicy([1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.2], explore_every=1000)
    for _ in range(50):
        steep.observe("ngram", 4, drafted=6, kept=6)
    assert steep.choose_rows([RowOffer("ngram", 4, 6, _row(2))], rows=1) == [2]


def test_a_cheap_wider_forward_verifies_an_unlikely_tail():
    """Where a wider forward costs almost nothing more (bf16 on a CPU with native bf16: 7 tokens ~1.2x
    one), even a tail that survives one time in ten pays for its width: the cap follows the cost table, no
    fixed survival threshold cuts it (one did, and cost ~5 % of tokens per forward in bf16)."""
    costs = [1.0 + 0.03 * n for n in range(7)]
    policy = DraftPolicy(costs, explore_every=1000)
    for _ in range(50):
        policy.observe("ngram", 4, drafted=6, kept=6)
    own = _row(2, rounds=40)
    probs = policy._prefix(RowOffer("ngram", 4, 6, own), 6)
    assert probs[2] < 0.1 < probs[1]  # the third token survives under one time in ten
    assert policy.choose_rows([RowOffer("ngram", 4, 6, own)], rows=1)[0] >= 3


def test_per_row_caps_respect_the_batch_cost_and_lengths():
    """At 16 rows a wider forward costs 16 rows of tokens: mediocre rows do not pay for it, whatever their
    own acceptance; a cap never exceeds a row's draft or max_len."""
    costs = ForwardCosts({1: CPU_COSTS, 16: [16.0 * n for n in range(1, 8)]})
    policy = DraftPolicy(costs, explore_every=1000)
    mediocre = [RowOffer("ngram", 2, 6, _row(1)) for _ in range(16)]
    assert policy.choose_rows(mediocre, rows=16) == [0] * 16
    strong = [RowOffer("ngram", 2, length, _row(6)) for length in (6, 2, 4, 6)]
    for max_len in (1, 3, None):
        caps = policy.choose_rows(strong, rows=4, max_len=max_len)
        assert max(caps) > 0
        assert all(c <= min(o.length, max_len or 99) for c, o in zip(caps, strong, strict=True))


def test_row_acceptance_forgets():
    own = _row(6)
    for _ in range(40):
        own.observe(6, 0)
    trials, kept = own.tallies(0)
    assert kept / trials < 0.05


# a forward whose width is dear, as the 4-bit forward on an AVX2 CPU (width 2 costs 1.45x width 1)
DEAR_WIDTH = [1.0, 1.45, 1.9, 2.3, 2.7, 3.1, 3.5]


def test_a_dear_drafter_whose_drafts_are_seldom_verified_is_not_run_but_explored():
    """The served default once drafted six head positions every round and then verified none in half the
    rounds: slower than plain decoding. Drafting now pays its own way, with an exploration now and then
    (whose draft `Batch` verifies in full)."""
    policy = DraftPolicy(DEAR_WIDTH, explore_every=4)
    assert policy.draft_length("head", 1, 1, 6) == (6, False)  # nothing known yet: draft
    for _ in range(50):
        policy.observe("head", 0, drafted=6, kept=0)  # its drafts are rejected
        policy.observe_drafting(
            "head", seconds=0.06 * 6, keys=[0], positions=6
        )  # 6 % of a forward a position
    lengths = [policy.draft_length("head", 1, 1, 6) for _ in range(8)]
    assert lengths == [(0, False)] * 3 + [(6, True)] + [(0, False)] * 3 + [(6, True)]


def test_a_dear_drafter_drafts_where_its_confident_drafts_pay():
    """Drafting reveals the draft's key, and the cap then chooses per key: a drafter worth running for its
    confident half is run although its other half is never verified."""
    policy = DraftPolicy(DEAR_WIDTH, explore_every=1000)
    for _ in range(50):
        policy.observe("head", 2, drafted=6, kept=6)
        policy.observe("head", 0, drafted=6, kept=0)
        policy.observe_drafting("head", seconds=0.01 * 6, keys=[2, 0], positions=6)
    assert policy.draft_length("head", 1, 1, 6) == (6, False)
    assert policy.choose("head", 2, 6) == 6 and policy.choose("head", 0, 6) == 0


def test_a_drafter_that_costs_next_to_nothing_drafts_its_budget_and_the_cap_decides():
    """Prompt lookup costs ~0.1 % of a forward: it drafts whatever its drafts were worth so far, so a key it
    never showed (a long match, judged by the optimistic prior) still reaches the cap; the same drafter at 5 %
    of a forward a position is not run."""
    policy = DraftPolicy(DEAR_WIDTH, explore_every=1000)
    for _ in range(50):
        policy.observe("ngram", 2, drafted=6, kept=0)
        policy.observe_drafting("ngram", seconds=0.001, keys=[2], positions=6)
        policy.observe("dear", 2, drafted=6, kept=0)
        policy.observe_drafting("dear", seconds=0.05 * 6, keys=[2], positions=6)
    assert policy.draft_length("ngram", 1, 1, 6) == (6, False)
    assert policy.choose("ngram", 2, 6) == 0 and policy.choose("ngram", 4, 6) > 0
    assert policy.draft_length("dear", 1, 1, 6) == (0, False)


def test_a_batch_runs_a_dear_drafter_only_when_it_pays_and_stays_lossless(embedded):
    """The real head on the embedded model, in an engine whose cost table makes every draft token dear and
    whose policy has learned that the head's drafts are rejected: the head drafts only in exploring rounds
    (every fourth round the policy would skip), those drafts are verified in full, and greedy SD still says
    what plain decoding says."""
    from ocm_store import InMemoryStore, Namespace
    from service.decoding import Engine, HeadDrafter
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR

    policy = DraftPolicy([c * 0.02 for c in DEAR_WIDTH], explore_every=4)
    for key in (0, 1, 2):
        for _ in range(50):
            policy.observe("head", key, drafted=6, kept=0)
    policy.observe_drafting("head", seconds=0.1, keys=[0, 1, 2], positions=1)
    engine = Engine(
        embedded,
        {"head": HeadDrafter(embedded, EMBEDDED_HEAD_DIR)},
        {"head": InMemoryStore().memory(Namespace("t", "head", "v"))},
        policy,
    )
    rounds = strict_rounds_equal_to_plain(engine, "Name three colours.", 24, "head")
    # every fourth round drafts, and its draft is verified: the cap, which has learned the same rejections,
    # would have cut it to nothing
    drafted = [s.round.num_draft_tokens for s in rounds]
    assert len(rounds) // 4 - 1 <= sum(1 for d in drafted if d) <= len(rounds) // 4 + 1, drafted


def test_prompt_lookup_in_combined_drafts_where_the_policy_gives_the_head_nothing(embedded):
    """The served default (`combined`: prompt lookup where it matches, the head elsewhere) with a policy that
    has learned the head's drafts are rejected and dear: the head drafts nothing, yet prompt lookup, which
    costs nothing, still drafts its whole budget on a prompt the answer copies (before, the policy's length
    0 for `combined` skipped its free lookup too, and a length of 2 cut every lookup draft to 2 tokens);
    greedy SD still says what plain decoding says."""
    from ocm_store import InMemoryStore, Namespace
    from service.decoding import (
        CombinedDrafter,
        Engine,
        HeadDrafter,
        NgramDrafter,
    )
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR

    policy = DraftPolicy([0.02 * (1 + 0.02 * n) for n in range(8)], explore_every=1000)
    for key in (0, 1, 2):  # the head's confidence buckets: every draft rejected, a position 5 forwards' time
        for _ in range(50):
            policy.observe("combined", key, drafted=6, kept=0)
    policy.observe_drafting("combined", seconds=0.1, keys=[0, 1, 2], positions=1)
    assert policy.draft_length("combined", 1, 1, 6) == (0, False)
    drafter = CombinedDrafter(NgramDrafter(), HeadDrafter(embedded, EMBEDDED_HEAD_DIR))
    engine = Engine(
        embedded,
        {"combined": drafter},
        {"combined": InMemoryStore().memory(Namespace("t", "c", "v"))},
        policy,
    )
    text = (
        "Repeat exactly: one two three four five six seven eight nine ten, one two three four five six seven"
    )
    rounds = strict_rounds_equal_to_plain(engine, text, 32, "combined")
    drafted = [s.round.num_draft_tokens for s in rounds]
    assert max(drafted) > 2, drafted  # whole lookup drafts, not cut to the head's length
    assert policy.draft_length("combined", 1, 1, 6) == (0, False)  # the head still sits out


def strict_rounds_equal_to_plain(engine, text: str, max_tokens: int, drafter: str) -> list:
    """Greedy strict SD's rounds on the embedded model's chat prompt `text`, after checking that its tokens
    are plain decoding's."""
    from service.decoding import SamplingParams, SpeculativeConfig, run_alone
    from service.decoding.text import encode_chat

    tokenizer = engine.target.tokenizer
    ids = encode_chat(tokenizer, [{"role": "user", "content": text}])
    sampling = SamplingParams(max_tokens=max_tokens)
    plain = engine.generate(ids, sampling, SpeculativeConfig(method="vanilla"), drafter)
    list(run_alone(plain))
    generation = engine.generate(ids, sampling, SpeculativeConfig(method="sd"), drafter)
    rounds = list(run_alone(generation))
    assert [t.token_id for t in generation.tokens] == [t.token_id for t in plain.tokens]
    return rounds


def test_a_forgotten_drafter_is_measured_afresh():
    """A reloaded draft head is not judged by the old head's record: after `forget` the policy drafts it in
    full again (unmeasured), and what it learnt of other drafters stays."""
    policy = DraftPolicy(DEAR_WIDTH, explore_every=1000)
    for name in ("head", "dear"):
        for _ in range(50):
            policy.observe(name, 0, drafted=6, kept=0)
            policy.observe_drafting(name, seconds=0.06 * 6, keys=[0], positions=6)
    assert policy.draft_length("head", 1, 1, 6) == (0, False)
    policy.forget("head")
    assert policy.draft_length("head", 1, 1, 6) == (6, False)
    assert policy.choose("head", 0, 6) > 0  # the optimistic prior again
    assert policy.draft_length("dear", 1, 1, 6) == (0, False)
