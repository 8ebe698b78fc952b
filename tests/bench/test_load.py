"""`python -m bench.load`: the machinery end to end on real servers (not the figures), and its judgement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.load import Point, judge, markdown, parse_args, percentile

REPO = Path(__file__).resolve().parents[2]


def test_load_bench_end_to_end(tmp_path):
    out = tmp_path / "load"
    done = subprocess.run(
        [
            sys.executable, "-m", "bench.load", "--clients", "1,2", "--configs", "batched,one-at-a-time",
            "--requests", "1", "--max-tokens", "6", "--torch-threads", "1", "--out", str(out),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| config | clients |" in done.stdout and "Reproduce: `" in done.stdout
    for name in ("load.json", "load.md", "load.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((out / "load.json").read_text())
    points = {(p["config"], p["clients"]): p for p in report["points"]}
    assert set(points) == {("batched", 1), ("batched", 2), ("one-at-a-time", 1), ("one-at-a-time", 2)}
    for point in points.values():
        assert point["errors"] == 0 and point["requests"] == point["clients"]
        assert 0 < point["tokens"] <= 6 * point["clients"]
        assert point["tokens_per_s"] > 0 and point["ttft_p50_s"] > 0
        # the servers' own counters saw this point's requests
        assert point["server"]["generation_tokens"] == point["tokens"]


def point(config: str, clients: int, tok_s: float, itl_p99: float) -> Point:
    return Point(config, clients, 2, 0, 100, 1.0, tok_s, 0.2, 0.3, 0.05, itl_p99, 0.04)


def test_goals_are_judged_from_the_measured_points():
    points = [
        point("one-at-a-time", 8, 40.0, 0.06),
        point("batched", 1, 36.0, 0.06),
        point("batched", 8, 110.0, 0.16),
        point("batched", 16, 90.0, 0.2),
        point("batched-nospec", 16, 100.0, 0.2),
    ]
    goals = judge(points)
    assert [g["met"] for g in goals] == [True, False, False]  # 2.75x; ITL 2.67x (goal 2.5x); 0.90x of off
    assert (
        "2.75x" in goals[0]["measured"]
        and "2.67x" in goals[1]["measured"]
        and "0.90x" in goals[2]["measured"]
    )
    text = markdown(points, goals, {"machine": "m", "command": "c", "requests": 2, "max_tokens": 8})
    assert "| batched | 8 | 110.0 | 2.75x |" in text
    # a goal whose points were not measured is left out, not guessed
    assert judge([point("batched", 8, 1.0, 0.1)]) == []
    # within 5 % counts as "not slower"; a config that served nothing is shown, as not met
    level = judge([point("batched", 16, 98.0, 0.2), point("batched-nospec", 16, 100.0, 0.2)])
    assert [g["met"] for g in level] == [True]
    dead = judge([point("batched", 8, 0.0, 0.1), point("one-at-a-time", 8, 40.0, 0.06)])
    assert [(g["met"], g["measured"][:5]) for g in dead] == [(False, "0.00x")]


def test_percentile_and_arguments():
    assert percentile([], 99) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) in (2.0, 3.0)
    assert percentile(list(range(101)), 99) == 99
    args = parse_args(["--quick"])
    assert args.clients == [1, 4, 8] and args.max_tokens == 32 and args.requests == 1
    for bad in (
        ["--clients", "1,x"], ["--clients", "0"], ["--configs", "nope"], ["--max-tokens", "0"], ["--requests", "0"],
    ):  # fmt: skip
        try:
            parse_args(bad)
        except SystemExit as exc:
            assert exc.code == 2
        else:
            raise AssertionError(f"accepted {bad}")
