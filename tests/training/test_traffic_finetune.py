"""training/traffic.py's record selection and held-out split (pure; the whole loop runs in
tests/api/test_traffic.py)."""

from __future__ import annotations

from types import SimpleNamespace

from training.traffic import MIN_ANSWER_TOKENS, select_records, split_by_request

TARGET = SimpleNamespace(name="SmolLM2-135M-Instruct", revision="abc", identity="SmolLM2-135M-Instruct@abc")


def _record(prompt: list[int], answer: list[int], model: str = "SmolLM2-135M-Instruct@abc") -> dict:
    return {"model": model, "prompt_ids": prompt, "answer_ids": answer, "method": "csd"}


def test_select_keeps_this_targets_long_enough_records_once() -> None:
    long = list(range(MIN_ANSWER_TOKENS))
    records = [
        _record([1, 2, 3], long),
        _record([1, 2, 3], long),  # a repeat
        _record([1, 2, 3], long[:-1]),  # too short
        _record([4, 5], long, model="Other@abc"),
        _record([4, 5], long, model="SmolLM2-135M-Instruct@other-revision"),
        _record([4, 5], long + [9]),
    ]
    kept, skipped = select_records(records, TARGET)
    assert kept == [
        {"prompt_ids": [1, 2, 3], "answer_ids": long},
        {"prompt_ids": [4, 5], "answer_ids": long + [9]},
    ]
    assert skipped == {"other_model": 2, "short": 1, "repeat": 1}


def test_the_split_is_by_request_seeded_and_leaves_both_sides_something() -> None:
    records = [_record([p, p + 1], [i, i + 1, i + 2, i + 3]) for p in range(20) for i in range(3)]
    train, held = split_by_request(records, 0.2, seed=7)
    assert len(held) == 4 * 3 and len(train) == 16 * 3  # 4 of 20 prompts, with all 3 answers of each
    assert not {tuple(r["prompt_ids"]) for r in train} & {tuple(r["prompt_ids"]) for r in held}
    assert split_by_request(records, 0.2, seed=7) == (train, held)
    assert split_by_request(records, 0.2, seed=8) != (train, held)
    two = records[:6]  # two prompts: one each side, whatever the share
    for share in (0.0, 0.99):
        a, b = split_by_request(two, share, seed=0)
        assert a and b
