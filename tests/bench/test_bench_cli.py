"""`python -m bench` options, parsed without running anything."""

from __future__ import annotations

import pytest

from bench.cli import build_parser, config_from_args
from bench.config import BenchError


def parse(*args: str):
    return config_from_args(build_parser().parse_args(list(args)))


def test_draft_head_options(tmp_path):
    assert parse().draft_head == "embedded"  # the shipped head, where it applies (bench.context.head_folder)
    assert parse("--no-draft-head").draft_head is None
    assert parse("--draft-head", str(tmp_path)).draft_head == str(tmp_path)
    assert parse("--quick", "--calibration-prompts", "3").calibration_prompts == 3
    with pytest.raises(BenchError, match="no such folder"):
        parse("--draft-head", str(tmp_path / "missing"))


def test_methods_option_keeps_vanilla_as_the_baseline():
    assert parse().methods is None  # every column
    assert parse("--methods", "sd-head, csd-head").methods == ("vanilla", "sd-head", "csd-head")
    assert parse("--methods", "vanilla,sd").methods == ("vanilla", "sd")
