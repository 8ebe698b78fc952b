"""bench.threads' configurations and its verdict against issue 31's goal (the default within 1.3x of the
best configuration in every scenario); the timed runs themselves are the benchmark, not a test."""

from __future__ import annotations

from bench.threads import GOAL, configs, report


def _row(config: str, seconds: float, best: float) -> dict:
    return {
        "config": config,
        "threads": 1,
        "threads_at_end": 1,
        "wait_policy": "unset",
        "median_s": seconds,
        "tokens": 64,
        "vs_best": seconds / best,
    }


def test_every_thread_count_runs_under_both_wait_policies_beside_the_default():
    names = [c.name for c in configs(2)]
    assert names == [
        "default",
        "1 thread, passive",
        "1 thread, active",
        "2 threads, passive",
        "2 threads, active",
    ]
    assert all(c.env().get("OMP_WAIT_POLICY") == c.policy for c in configs(2) if c.policy)
    assert "OMP_WAIT_POLICY" not in configs(2)[0].env()


def test_the_verdict_fails_when_the_default_misses_the_goal_in_any_scenario():
    good = [_row("default", 2.0, 2.0), _row("2 threads, active", 5.0, 2.0)]
    slow = [_row("default", 2.0 * GOAL + 0.1, 2.0), _row("1 thread, passive", 2.0, 2.0)]
    text, ok = report({"Idle host": good}, "machine", "python -m bench.threads", 64)
    assert ok and "Verdict: the default is within 1.3x" in text
    text, ok = report({"Idle host": good, "busy": slow}, "machine", "python -m bench.threads", 64)
    assert not ok and "NOT within 1.3x" in text and "| default | 1 -> 1 | unset | 2.70 |" in text
