"""bench.weight_quality: the scores come from the models' own outputs (a real run on a tiny budget), the report
states them against fp32, and bad options exit 2 in one line."""

from __future__ import annotations

import pytest

from bench import weight_quality
from service.executor.models import auto_cpu_dtype


def test_a_real_run_scores_int4_against_fp32(embedded):
    result = weight_quality.run("embedded", ["int4"], limit=1, tokens=6, text_tokens=600)
    int4 = result["formats"]["int4"]
    assert result["prompts"] and len(result["prompts"]) == 2  # one chat, one grounded
    # the body --dtype auto gives int4 weights here: fp32 where the fused kernel builds, not the CPU's bf16
    body = str(auto_cpu_dtype("int4")).removeprefix("torch.")
    assert int4["weights"] == "int4" and int4["dtype"] == body
    assert 0 <= int4["greedy_prefix_share"] <= 1 and 0 <= int4["top1_agreement"] <= 1
    assert int4["positions"] <= 12 and int4["identical_answers"] <= 2
    # the same weights: perplexity within a few percent of fp32's
    ref = result["formats"]["fp32"]["perplexity"]
    assert result["text_tokens"] == 600 and abs(int4["perplexity"] / ref - 1) < 0.05
    text = "\n".join(weight_quality.markdown(result))
    assert f"(fp32: {ref:.3f})" in text and f"| int4 | {body} | int4 |" in text


@pytest.mark.parametrize("argv", [["--formats", "int3"], ["--limit", "0"], ["--formats", ""]])
def test_bad_options_exit_2_with_one_line(argv, capsys):
    assert weight_quality.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench.weight_quality: error:")
