"""bench.llama_cpp: the llama.cpp peer columns say why they are absent instead of vanishing, the report's ratios
come from the measured samples, bad options exit 2 in one line, and (where `make peer-llama-cpp` installed the
peer) the real library decodes the same token ids and its prompt lookup really drafts."""

from __future__ import annotations

import json

import pytest

from bench import llama_cpp
from bench.llama_cpp import markdown, peer_missing, summary


def _sample(column: str, workload: str, tokens: int, seconds: float, **extra) -> dict:
    return {
        "column": column,
        "prompt": f"{workload}-1",
        "workload": workload,
        "tokens": list(range(tokens)),
        "seconds": seconds,
        "first_token_seconds": seconds / 4,
        "extra": extra,
        "tok_s": tokens / seconds,
    }


def _result(samples: list[dict], missing: str | None = None) -> dict:
    return {
        "model": "m@r",
        "gguf": "m.gguf",
        "weights": "int4",
        "dtype": "bfloat16",
        "threads": 1,
        "max_tokens": 64,
        "peer": {"missing": missing},
        "samples": samples,
    }


def test_the_report_divides_measured_tokens_by_measured_time():
    samples = [
        _sample("vanilla", "chat", 40, 2.0),
        _sample("vanilla", "chat", 20, 2.0),  # 60 tokens in 4 s: 15 tok/s, not the mean of 20 and 10
        _sample("served", "chat", 60, 3.0, tokens_per_forward=1.5),
        _sample("llama.cpp", "chat", 60, 2.0),
        _sample("llama.cpp-lookup", "chat", 60, 1.5, predictions={"used": 7, "refuted": 3}),
    ]
    table = summary(_result(samples))["chat"]
    assert table["vanilla"]["tok_s"] == pytest.approx(15.0)
    assert table["llama.cpp-lookup"]["predictions_used"] == 7
    text = "\n".join(markdown(_result(samples)))
    assert "| chat | 15.0 (500 ms) | 20.0 (750 ms), 1.50 tok/fwd | 30.0 (500 ms) |" in text
    assert "7 lookup tokens used, 3 refuted | 0.50x | 0.67x |" in text


def test_without_the_peer_its_columns_say_why(monkeypatch, tmp_path):
    monkeypatch.setenv("NODE_LLAMA_CPP", str(tmp_path / "absent.js"))
    monkeypatch.setattr(llama_cpp, "PEER_DIR", tmp_path / "no-peer")
    reason = peer_missing()
    assert reason is not None and ("make peer-llama-cpp" in reason or "node" in reason)
    text = "\n".join(markdown(_result([_sample("vanilla", "chat", 10, 1.0)], missing=reason)))
    assert f"not run: {reason}" in text and "| n/a | n/a |" in text


@pytest.mark.parametrize(
    "argv", [["--limit", "0"], ["--workloads", "poetry"], ["--threads", "0"], ["--workloads", ""]]
)
def test_bad_options_exit_2_with_one_line(argv, capsys):
    assert llama_cpp.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bench.llama_cpp: error:")


@pytest.mark.skipif(peer_missing() is not None, reason=f"the llama.cpp peer is absent: {peer_missing()}")
def test_the_real_peer_decodes_our_token_ids_and_its_lookup_drafts(embedded):
    from service.decoding.text import encode_chat
    from service.executor.paths import embedded_gguf_path

    text = "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog"
    ids = encode_chat(embedded.tokenizer, [{"role": "user", "content": text}])
    peer = llama_cpp.LlamaCpp(embedded_gguf_path(), threads=1)
    try:
        plain = peer.generate(ids, 24, lookup=False)
        lookup = peer.generate(ids, 24, lookup=True)
    finally:
        peer.close()
    assert len(plain["tokens"]) > 0 and json.dumps(plain["tokens"])
    assert "quick brown fox" in embedded.tokenizer.decode(plain["tokens"])
    assert len(lookup["tokens"]) > 0  # (llama.cpp's batched verification need not give plain's bits)
    assert lookup["predictions"]["used"] > 0  # it drafted from the prompt and kept some
