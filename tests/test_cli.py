"""The `csd` command, run as a user runs it: a real process, real models, its real output streams.

CSD_CACHE_DIR is left as it is (the converted embedded model is reused); the OCM file always lives in the
test's tmp_path, never in the user's cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service.executor.paths import EMBEDDED_EXIT_DIR
from tests.conftest import make_word_model

ROOT = Path(__file__).resolve().parent.parent
PROVENANCES = {"accepted", "rescued", "recovered", "bonus", "plain"}
SPELLING = "Rewrite in American spelling: The colour of the theatre's centre stage was grey."


def csd(*args: str, ocm_path: Path, timeout: float = 600, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CSD_") or k == "CSD_CACHE_DIR"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CSD_OCM_PATH=str(ocm_path))
    # one torch thread, as in the in-process tests (see the single_thread fixture in conftest.py)
    env.update(CSD_TORCH_THREADS="1", **env_vars)
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def ocm_path(tmp_path):
    return tmp_path / "ocm.sqlite"


@pytest.fixture(scope="module", autouse=True)
def converted_embedded(embedded):
    """Make sure the embedded GGUF is converted once (by the session fixture) before any process needs it."""
    return embedded


# ---------------------------------------------------------------- what works


def test_generate_csd_chat_prints_text_and_statistics(ocm_path):
    out = csd("generate", "--chat", "--method", "csd", "--max-tokens", "24", SPELLING, ocm_path=ocm_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    assert "Traceback" not in out.stderr
    stats_line = out.stderr.strip().splitlines()[-1]
    assert re.match(
        r"\[csd\] \d+ tokens, [\d.]+ tokens/s, [\d.]+ tokens per target forward, "
        r"acceptance [\d.]+%, rescue [\d.]+% \(accepted \d+, rescued \d+, drafted \d+\), finish: (stop|length)$",
        stats_line,
    ), stats_line


def test_generate_json_has_text_tokens_with_provenance_and_stats(ocm_path):
    # Fixed speculation, so the drafter is certainly used (on a busy CPU the adaptive policy may find that
    # no draft pays for itself).
    out = csd(
        "generate", "--chat", "--json", "--method", "sd", "--max-tokens", "24", SPELLING,
        ocm_path=ocm_path, CSD_ADAPTIVE_SPECULATION="false",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # one JSON object and nothing else on stdout
    assert result["method"] == "sd" and result["drafter"] == "combined"  # the default on the embedded model
    assert result["text"].strip() and result["finish_reason"] in ("stop", "length")
    tokens = result["tokens"]
    assert tokens and all(t["provenance"] in PROVENANCES and isinstance(t["id"], int) for t in tokens)
    assert "".join(t["text"] for t in tokens) == result["text"]  # plain ASCII: pieces add up
    stats = result["stats"]
    assert stats["completion_tokens"] == len(tokens)
    assert stats["target_forwards"] >= 1
    for key in ("tokens_per_second", "tokens_per_forward", "acceptance_rate", "kept_rate", "rescue_rate"):
        assert isinstance(stats[key], (int, float)), key
    # The n-gram drafter copies the sentence from the prompt: some tokens came from accepted drafts. The
    # statistics count what was emitted (issue 13, finding 12), so they equal the provenance list.
    accepted = sum(t["provenance"] == "accepted" for t in tokens)
    assert 0 < accepted == stats["accepted_tokens"]


@pytest.mark.skipif(not (EMBEDDED_EXIT_DIR / "exit.json").exists(), reason="no exit shipped")
def test_the_shipped_early_exit_draft_model_serves_drafter_model_losslessly(ocm_path):
    """`--draft-model embedded-exit` needs nothing but the package: the embedded target's own first layers
    behind the shipped exit draft for it, and strict SD writes vanilla's text."""
    common = ("generate", "--chat", "--json", "--max-tokens", "32", SPELLING)
    plain = csd(*common, "--method", "vanilla", ocm_path=ocm_path)
    assert plain.returncode == 0, plain.stderr
    out = csd(
        *common, "--method", "sd", "--drafter", "model", "--draft-model", "embedded-exit",
        ocm_path=ocm_path, CSD_ADAPTIVE_SPECULATION="false",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "UNEXPECTED" not in out.stderr  # the layers it does not keep are left unread, quietly
    result = json.loads(out.stdout)
    assert result["drafter"] == "model" and result["text"] == json.loads(plain.stdout)["text"]
    assert result["stats"]["accepted_tokens"] > 0


def test_calibrate_then_ocm_top_shows_decoded_patterns(tmp_path, ocm_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": SPELLING})
        + "\n\n"
        + "Write the days of the week, one per line, twice.\n",  # a plain line is a prompt too
        encoding="utf-8",
    )
    out = csd("calibrate", "--prompts", str(prompts), "--max-tokens", "16", ocm_path=ocm_path)
    assert out.returncode == 0, out.stderr
    match = re.search(r"calibrated 2 prompts in [\d.]+s: (\d+) divergences", out.stdout)
    assert match, out.stdout
    divergences = int(match.group(1))
    assert divergences > 0
    assert ocm_path.exists()

    top = csd("ocm", "top", "-n", "100000", ocm_path=ocm_path)
    assert top.returncode == 0, top.stderr
    lines = top.stdout.splitlines()
    # calibration records in the default drafter's namespace (combined: prompt lookup, else the trained head)
    assert lines[0].startswith("# SmolLM2-135M-Instruct@") and "|combined:ngram+head:" in lines[0]
    patterns = [re.match(r"^\s*(\d+)  ('.*'|\".*\") -> ('.*'|\".*\")$", line) for line in lines[1:]]
    assert patterns and all(patterns), lines
    # every divergence recorded by calibration is in the store, each counted once
    assert sum(int(p.group(1)) for p in patterns) == divergences


# ---------------------------------------------------------------- what is refused


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad-inputs")
    (folder / "fake.gguf").write_text("not a model\n")
    (folder / "malformed.jsonl").write_text('{"prompt": "fine"}\n{"prompt": oops}\n')
    (folder / "fieldless.jsonl").write_text('{"question": "where is the prompt?"}\n')
    (folder / "empty.jsonl").write_text("\n\n")
    (folder / "good.jsonl").write_text('{"prompt": "Say hello."}\n')
    (folder / "bad-exit").mkdir()
    (folder / "bad-exit" / "exit.json").write_text('{"base": "embedded"}\n')  # no layers
    other_vocab = make_word_model(seed=0)
    other_vocab.model.save_pretrained(folder / "word-model")
    other_vocab.tokenizer.save_pretrained(folder / "word-model")
    return folder


BAD_INPUTS = [
    # (arguments, with {dir} for the bad files' folder; what the error line must say)
    (["generate", ""], "prompt must not be empty"),
    (["generate", "   "], "prompt must not be empty"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens must be >= 1"),
    (["generate", "hi", "--max-tokens", "-5"], "max_tokens must be >= 1"),
    (["generate", "hi", "--max-tokens", str(10**9)], "exceeds the cap"),
    (["generate", "hi", "--tau", "0"], "invalid tau"),
    (["generate", "hi", "--tau", "1.5"], "invalid tau"),
    (["generate", "hi", "--lambda", "-1"], "invalid lambda"),
    (["generate", "hi", "--temperature", "5"], "temperature must be in [0, 2]"),
    (["generate", "hi", "--drafter", "model"], "needs draft_model"),
    (
        ["generate", "hi", "--weights", "int4", "--dtype", "float16"],
        "--weights int4 runs a bfloat16 or float32 body",
    ),
    (["generate", "hi", "--weights", "int4", "--device", "cuda"], "--weights int4 runs on the CPU only"),
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "does not exist"),
    (["generate", "hi", "--model", "{dir}/fake.gguf"], "is not a GGUF file"),
    (
        ["generate", "hi", "--drafter", "model", "--draft-model", "{dir}/word-model"],
        "does not share the vocabulary of target model 'SmolLM2-135M-Instruct'",
    ),
    (["generate", "hi", "--drafter", "model", "--draft-model", "{dir}/bad-exit"], "is not an exit's config"),
    (["calibrate", "--prompts", "{dir}/missing.jsonl"], "cannot read prompts file"),
    (["calibrate", "--prompts", "{dir}/malformed.jsonl"], "malformed.jsonl:2: not valid JSON"),
    (["calibrate", "--prompts", "{dir}/fieldless.jsonl"], "needs a 'prompt', 'messages' or 'text' field"),
    (["calibrate", "--prompts", "{dir}/empty.jsonl"], "holds no prompts"),
    (["calibrate", "--prompts", "{dir}/good.jsonl", "--max-tokens", "0"], "max_tokens must be >= 1"),
]


@pytest.mark.parametrize("args, message", BAD_INPUTS, ids=[" ".join(a)[:50] for a, _ in BAD_INPUTS])
def test_bad_input_gives_one_error_line_and_exit_2(bad_files, ocm_path, args, message):
    out = csd(*[a.replace("{dir}", str(bad_files)) for a in args], ocm_path=ocm_path)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("csd: error: ")]
    assert len(errors) == 1 and errors[0] == lines[-1], out.stderr
    # nothing else on stderr but the progress line of a model load
    assert all(line.startswith("csd: loading ") for line in lines[:-1]), out.stderr
    assert message in errors[0], errors[0]
    if "word-model" in " ".join(args):  # the mismatch names both models
        assert str(bad_files / "word-model") in errors[0]


def test_settings_default_drafter_follows_the_head():
    """combined where a head is loaded (the shipped one on the embedded model, or --draft-head FOLDER),
    prompt lookup for any other target."""
    from service.config import Settings

    assert Settings().drafter == "combined"
    assert Settings(model="some/other-model").drafter == "ngram"
    assert Settings(model="some/other-model", draft_head="/heads/mine").drafter == "combined"
    assert Settings(draft_head="").drafter == "ngram"
