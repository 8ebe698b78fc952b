"""`python -m bench.forward`: the machinery (shapes, the profiler split, the rollback, the report), not the figures.

The end-to-end test runs the real `--quick` command on the embedded model in a subprocess with one thread; the
others check the pieces on a tiny random model and on a hand-built result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from bench import forward
from bench.forward_report import forward_markdown, forward_table
from service.decoding import LoadedModel
from service.executor.q8_head import q8_kernel

REPO = Path(__file__).resolve().parents[2]


def test_quick_command_end_to_end(tmp_path):
    out = tmp_path / "forward"
    done = subprocess.run(
        [sys.executable, "-m", "bench.forward", "--quick", "--threads", "1", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reproduce: " in done.stderr and "-m bench.forward --quick" in done.stderr
    assert "machine: " in done.stderr and "(1 threads)" in done.stderr and "cpu flags:" in done.stderr
    assert "| format | rows | width |" in done.stdout
    result = json.loads((out / "forward.json").read_text())
    assert (out / "forward.md").read_text().count("| fp32 |") == 4
    assert (out / "forward.md").read_text().count("| int4 |") == 4
    assert result["threads"] == 1 and result["bandwidth"]["read_bytes_per_s"] > 1e8
    formats = {f["format"]: f for f in result["formats"]}
    assert set(formats) == {"fp32", "bf16", "int4"}
    # int4 reads half a byte a body weight (and its bf16 scales and zeros), and its head the GGUF's 8-bit
    # blocks (a byte a weight and a scale a block: over a quarter of the fp32 head) where the kernel builds
    assert formats["int4"]["weight_bytes"] < formats["bf16"]["weight_bytes"] / 1.5
    if q8_kernel() is not None:
        assert (
            formats["fp32"]["head_bytes"] / 4
            < formats["int4"]["head_bytes"]
            < formats["fp32"]["head_bytes"] / 3
        )
    else:
        assert formats["int4"]["head_bytes"] == formats["fp32"]["head_bytes"]
    # fp32 reads 4 bytes a body weight, bf16 2; both read the same fp32 LM head (bf16's packed copy)
    assert formats["bf16"]["weight_bytes"] < formats["fp32"]["weight_bytes"]
    assert formats["bf16"]["head_bytes"] == formats["fp32"]["head_bytes"] > 0
    assert formats["bf16"]["attention"] == "csd_row_aligned" and formats["fp32"]["attention"] == "sdpa"
    for fmt in formats.values():
        assert [(r["rows"], r["width"]) for r in fmt["rows"]] == [(1, 1), (1, 8), (4, 1), (4, 8)]
        for row in fmt["rows"]:
            parts = sum(row[f"{p}_seconds"] for p in ("matmul", "attention", "other", "host"))
            assert parts == pytest.approx(row["seconds"])
            assert row["matmul_seconds"] > 0 and row["attention_seconds"] > 0
            assert 0 < row["lm_head_seconds"] < row["seconds"]
            assert row["tokens"] == row["rows"] * row["width"]
        assert fmt["rows"][0]["vs_width_1"] == pytest.approx(1.0)


def test_row_batch_rolls_back_and_profile_split_sees_attention(tiny: LoadedModel):
    stream = list(range(100, 400))
    name = tiny.model.config._attn_implementation
    head = tiny.model.get_output_embeddings()
    with torch.inference_mode():
        batch = forward.RowBatch(tiny, stream, rows=3, context=20, max_width=4)
        assert batch.contexts == [20, 25, 15]  # ragged: the padding mask runs, as in a real batch
        width = batch.kv.width
        assert batch.forward(4) > 0 and batch.kv.width == width
        split = forward.profile_split(lambda: batch.forward(4, scoped=True), tiny.model, repeats=2)
    assert split["seconds"]["matmul"] > 0 and split["seconds"]["attention"] > 0
    assert 0 < split["head_seconds"] <= split["seconds"]["matmul"] + split["seconds"]["other"]
    # the scopes are gone afterwards: the registry and the head are the model's own again
    assert name not in ALL_ATTENTION_FUNCTIONS._local_mapping
    assert "forward" not in head.__dict__


def test_weight_bytes_counts_the_head_and_skips_the_embedding(tiny: LoadedModel):
    model = tiny.model
    sizes = forward.weight_bytes(model)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    every = {id(p): p.numel() * p.element_size() for p in model.parameters()}  # each tensor once
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    # a forward reads the head's weight in full, the embedding's only by the rows it looks up (left out); a
    # tied embedding is the head's weight, so it counts then
    skipped = 0 if embedding is head else embedding.numel() * embedding.element_size()
    assert sizes["head"] == head.numel() * head.element_size() > 0
    assert sizes["total"] == sum(every.values()) + buffers - skipped


def test_categories():
    assert forward.category("aten::mkldnn_linear", False) == "matmul"
    assert forward.category("aten::_weight_int4pack_mm_for_cpu", False) == "matmul"
    assert forward.category("aten::bmm", True) == "attention"
    assert forward.category("aten::cat", False) == "other"


def _row(rows: int, width: int, seconds: float) -> dict:
    return {
        "rows": rows, "width": width, "tokens": rows * width, "seconds": seconds, "matmul_seconds": 0.6 * seconds,
        "lm_head_seconds": 0.1 * seconds, "attention_seconds": 0.1 * seconds, "other_seconds": 0.1 * seconds,
        "host_seconds": 0.2 * seconds, "weight_passes": 1, "vs_width_1": None,
    }  # fmt: skip


def test_markdown_from_a_hand_built_result():
    rows = [_row(1, 1, 0.1), _row(1, 8, 0.15)]
    rows[0]["vs_width_1"], rows[1]["vs_width_1"] = 1.0, 1.5
    result = {
        "model": "embedded", "threads": 1, "context": 100, "repeats": 15, "profile_repeats": 3,
        "served_dtype": "bfloat16", "native_bf16": True, "wall_seconds": 60.0,
        "bandwidth": {"read_bytes_per_s": 10e9, "copy_bytes_per_s": 9e9, "array_mib": 512, "repeats": 5},
        "formats": [{
            "format": "fp32", "what": "packed", "dtype": "float32", "attention": "sdpa", "weight_bytes": 500e6,
            "head_bytes": 100e6, "bound_seconds": 0.05, "rows": rows,
        }],
    }  # fmt: skip
    table = forward_table(result)
    assert "| fp32 | 1 | 8 | 8 | 150.0 | 1.50x | 18.8 | 90.0 (60%) | 15.0 (10%) |" in table
    assert "| 50.0 | 3.0x | 1 |" in table
    text = "\n".join(forward_markdown(result))
    assert "memory read 10.0 GB/s" in text and "1 torch thread" in text
    assert "bound 50.0 ms; 1 row: width 1 100.0 ms (2.0x the bound; matmul 60%" in text
    assert "width 8 1.50x it." in text
    assert forward_markdown(None) == [] and forward_markdown({"formats": []}) == []
