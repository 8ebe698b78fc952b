"""The benches that take a drafter offer the registry's (service/decoding/drafter_registry.py, the one list of
drafters), less those needing a draft model, which no bench loads; and they build them as the server does."""

from __future__ import annotations

import argparse

import pytest

from bench import draft_length, structured
from service.decoding.drafter_registry import DRAFTERS

BUILDABLE = [entry.name for entry in DRAFTERS if entry.needs != "draft_model"]


def test_the_benches_offer_the_registry_s_drafters():
    assert list(draft_length.DRAFTERS) == list(structured.DRAFTERS) == BUILDABLE
    for name in BUILDABLE:
        assert structured.parse_args(["--drafter", name]).drafter == name
    assert draft_length._drafters(",".join(BUILDABLE)) == BUILDABLE
    # a registered drafter a bench cannot build is refused, as an unknown name is
    for name in [entry.name for entry in DRAFTERS if entry.name not in BUILDABLE] + ["oracle"]:
        with pytest.raises(SystemExit):
            structured.parse_args(["--drafter", name])
        with pytest.raises(argparse.ArgumentTypeError):
            draft_length._drafters(name)


def test_the_structured_bench_builds_its_drafter_from_the_registry(embedded):
    """Its engine drafts with what the registry's builder made: prompt lookup without loading a head, the
    combined drafter with the model's head behind it."""
    from service.decoding import CombinedDrafter, HeadDrafter, NgramDrafter

    base = ["--methods", "sd", "--fixed-speculation", "--calibration-prompts", "0"]
    engines = structured.build_engines(embedded, structured.parse_args([*base, "--drafter", "ngram"]))
    assert {type(d) for d in engines["sd"].drafters.values()} == {NgramDrafter}
    engines = structured.build_engines(embedded, structured.parse_args([*base, "--drafter", "combined"]))
    (combined,) = engines["sd"].drafters.values()
    assert isinstance(combined, CombinedDrafter)
    assert isinstance(combined.head, HeadDrafter)
