"""The draft policy verifies a draft only as far as it pays for itself."""

from __future__ import annotations

import pytest

from service.decoding.draft_policy import DraftPolicy, measure_forward_costs

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


def test_drafts_that_never_survive_become_plain_steps_with_exploration():
    policy = DraftPolicy(CPU_COSTS, explore_every=4)
    for _ in range(50):
        policy.observe("ngram", 2, drafted=6, kept=0)
    choices = [policy.choose("ngram", 2, 6) for _ in range(8)]
    # three plain steps, then one exploratory full draft, twice over
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
