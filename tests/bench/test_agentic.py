"""bench.agentic's workload and bench.agentic_replay (no model: the drafters replayed on recorded answers)."""

from __future__ import annotations

import json

import pytest

from bench.agentic import parse_args
from bench.agentic_replay import main as replay_main
from bench.agentic_replay import replay
from bench.agentic_workload import workload
from service.decoding.drafters.ngram import NgramDrafter
from service.decoding.drafters.suffix import SuffixDrafter


def test_the_workload_is_seeded_interleaved_and_multi_turn():
    sizes = {"tools": 2, "code": 1, "extract": 3}
    first, again, other = workload(1, sizes), workload(1, sizes), workload(1001, sizes)
    assert [c.turns for c in first] == [c.turns for c in again]
    assert [c.turns for c in first] != [c.turns for c in other]
    assert [c.family for c in first] == ["tools", "code", "extract", "tools", "extract", "extract"]
    assert {c.family: len(c.turns) for c in first} == {"tools": 5, "code": 3, "extract": 1}
    assert all(len(c.max_tokens) == len(c.turns) for c in first)
    tools = first[0]
    assert tools.system and '"tool": "finish"' in tools.system and tools.turns[1].startswith("Tool result: {")
    json.loads(tools.turns[1].removeprefix("Tool result: ").split("\n")[0])  # the fed-back result is JSON


def test_columns_are_checked():
    assert parse_args(["--columns", "suffix,ngram"]).columns == ["vanilla", "suffix", "ngram"]
    with pytest.raises(SystemExit):
        parse_args(["--columns", "suffix,nope"])


def _turn(conversation: int, family: str, prompt: list[int], output: list[int]) -> dict:
    return {"conversation": conversation, "family": family, "prompt": prompt, "output": output}


def test_replay_keeps_what_agrees_with_the_answer():
    answer = list(range(100, 140))
    # the answer copies its prompt: prompt lookup drafts it from the first match on
    copy = [_turn(0, "code", [1, 2, *answer, 3], answer)]
    families, forwards = replay(NgramDrafter(), copy, k=16)
    assert families["code"][0] == len(answer) and forwards[0] < len(answer) / 4
    # an answer nothing predicts: one token per forward, whatever is drafted
    fresh = [_turn(0, "code", [1, 2, 3], answer)]
    assert replay(NgramDrafter(), fresh, k=16)[1] == [len(answer)]


def test_replay_shows_the_pool(tmp_path, capsys):
    """An answer another replica already gave drafts far better pooled than cold."""
    answer = [500 + (i * 7) % 31 for i in range(60)]
    measured = [_turn(0, "tools", [9, 9, 1], answer)]
    earlier = [_turn(0, "tools", [8, 8, 1], answer)]
    cold = replay(SuffixDrafter(), measured, k=16)[1][0]
    pooled_drafter = SuffixDrafter()
    replay(pooled_drafter, earlier, k=16)
    pooled = replay(pooled_drafter, measured, k=16)[1][0]
    assert pooled < cold / 2, (pooled, cold)
    path = tmp_path / "turns.json"
    path.write_text(json.dumps({"measured": measured, "earlier": earlier}))
    assert replay_main([str(path), "--factors", "4", "--tails", "8"]) == 0
    table = capsys.readouterr().out
    assert "suffix factor 4, prompt tail 8 (pooled)" in table and "| ngram |" in table
