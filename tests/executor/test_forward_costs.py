"""The forward-cost table is robust to load (issue 13, finding 9): medians of interleaved repeats, a monotone
sanity pass, a time budget with the rest measured in slices later.

The load is injected into the samples, not into the machine: the aggregation is a pure function, and real
load on a shared machine cannot be produced on demand (nor kept away: no test here times anything).
"""

from __future__ import annotations

import itertools

import pytest

from service.decoding.draft_policy import DraftPolicy
from service.executor.forward_costs import CostMeasurement, row_counts, summarise, token_counts

MAX_TOKENS = 7
MAX_ROWS = 16


def quiet_cost(rows: int, tokens: int) -> float:
    """A CPU-like table: a fixed cost per forward, a little per token, attention growing with rows."""
    return 0.040 + 0.002 * rows * tokens + 0.004 * rows


def samples_from(cost, repeats: int = 5) -> dict[tuple[int, int], list[float]]:
    return {(r, t): [cost(r, t)] * repeats for r in row_counts(MAX_ROWS) for t in token_counts(r, MAX_TOKENS)}


def decisions(costs) -> list[int]:
    """The policy's draft cap over a grid of batch sizes, acceptance rates and draft lengths."""
    out = []
    for rows, kept, length in itertools.product((1, 2, 3, 5, 8, 16), range(7), (1, 3, 6)):
        policy = DraftPolicy(costs, explore_every=10**9)
        for _ in range(60):
            policy.observe("ngram", 2, drafted=6, kept=kept)
        out.append(policy.choose_batch([("ngram", 2, length)] * rows, rows=rows))
    return out


def test_a_quiet_measurement_is_taken_as_it_is():
    table = summarise(samples_from(quiet_cost), MAX_TOKENS)
    for rows in row_counts(MAX_ROWS):
        for t in token_counts(rows, MAX_TOKENS):
            assert table(rows, t) == pytest.approx(quiet_cost(rows, t))


@pytest.fixture(scope="module")
def sample_order(tiny) -> list[tuple[int, int]]:
    """The order in which a real measurement takes its timed samples (tiny model: shapes, not speed)."""
    measurement = CostMeasurement(tiny.model, MAX_TOKENS, max_rows=MAX_ROWS, context=4).run()
    assert measurement.complete
    return measurement.order


def with_burst(order: list[tuple[int, int]], start: float, length: float) -> dict:
    """Quiet samples, except a burst of load (40x) over a contiguous stretch of the measurement's time."""
    samples: dict[tuple[int, int], list[float]] = {shape: [] for shape in order}
    first, last = int(start * len(order)), int((start + length) * len(order))
    for i, (rows, t) in enumerate(order):
        samples[(rows, t)].append(quiet_cost(rows, t) * (40 if first <= i < last else 1))
    return samples


BURST_STARTS = [0.0, 0.1, 0.3, 0.6]


@pytest.mark.parametrize("start", BURST_STARTS)
def test_a_load_burst_does_not_change_the_policy_decisions(sample_order, start):
    """The machine of the issue: a burst of load during the measurement (here 12 % of its samples, 40x
    slower). The samples go round-robin over the shapes and each cost is a median, so the decisions on the
    measured table equal those on a quiet machine's."""
    quiet = decisions(summarise(samples_from(quiet_cost), MAX_TOKENS))
    assert decisions(summarise(with_burst(sample_order, start, 0.12), MAX_TOKENS)) == quiet


def test_the_burst_test_has_power(sample_order):
    """Taken one shape after the other (the first version's order), the same bursts spoil every sample of
    some shapes and change decisions for at least one of them (the per-row policy reads only the shapes a
    burst leaves alone for some starts, so not for every start)."""
    quiet = decisions(summarise(samples_from(quiet_cost), MAX_TOKENS))
    one_shape_after_the_other = sorted(sample_order)
    spoiled = [
        decisions(summarise(with_burst(one_shape_after_the_other, start, 0.12), MAX_TOKENS))
        for start in BURST_STARTS
    ]
    assert any(d != quiet for d in spoiled)


def test_the_sanity_pass_makes_the_table_monotone_in_rows_and_tokens():
    """A shape measured entirely under load (one row 40x slower than sixteen rows) is capped by the
    cheapest larger shape: the table never says a smaller forward costs more."""
    noisy = samples_from(quiet_cost)
    for t in token_counts(1, MAX_TOKENS):
        noisy[(1, t)] = [v * 40 for v in noisy[(1, t)]]
    table = summarise(noisy, MAX_TOKENS)
    for rows, t in itertools.product(row_counts(MAX_ROWS), range(1, MAX_TOKENS)):
        assert table(rows, t) <= table(rows, t + 1)
        assert table(rows, t) <= table(MAX_ROWS, t)
    assert table(1, 1) <= quiet_cost(2, 1)


def test_a_row_count_not_fully_measured_is_left_out():
    samples = samples_from(quiet_cost)
    samples[(16, 7)] = []
    assert sorted(summarise(samples, MAX_TOKENS).by_rows) == [1, 2, 4, 8]


@pytest.mark.usefixtures("single_thread")
def test_a_budget_stops_the_measurement_and_slices_finish_it(tiny):
    measurement = CostMeasurement(tiny.model, 4, max_rows=4, context=16, repeats=3).run(budget_s=0)
    assert measurement.forwards == 1 and not measurement.single_row_measured and not measurement.done
    while not measurement.single_row_measured:
        assert measurement.measure_next()
    assert not measurement.complete
    assert sorted(measurement.table().by_rows) == [1]  # usable already: what one request needs
    forwards = measurement.forwards
    while measurement.measure_next():  # what the engine worker does while idle
        pass
    assert measurement.done and measurement.complete and measurement.forwards > forwards
    table = measurement.table()
    assert sorted(table.by_rows) == [1, 2, 4]
    for costs in table.by_rows.values():
        assert all(c > 0 for c in costs) and costs == sorted(costs)
