"""Starting costs no measurement that nothing uses (issue 13, finding 9): `csd generate --method vanilla`
measures nothing, the first speculating run measures and caches the table, the next one reads it.

Real `csd` processes on the embedded model, each with its own cache folder (the converted model linked in,
so nothing is converted again). Asserted on the log and the cache file, never on a wall clock.
"""

from __future__ import annotations

import json

import pytest

from service.executor import native
from service.executor.paths import default_cache_dir
from tests.test_cli import csd

PROMPT = "Name three colours."
MEASURED = "measured target forward costs"
FROM_CACHE = "target forward costs (ms) from the cache"


@pytest.fixture
def cache_dir(tmp_path, embedded):
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "models").symlink_to(default_cache_dir() / "models", target_is_directory=True)
    return folder


def run(cache_dir, *args: str):
    out = csd(
        "generate", "--max-tokens", "4", *args, PROMPT,
        ocm_path=cache_dir / "ocm.sqlite", CSD_CACHE_DIR=str(cache_dir), CSD_LOG_LEVEL="info",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_vanilla_measures_nothing_and_a_second_start_reads_the_cache(cache_dir):
    vanilla = run(cache_dir, "--method", "vanilla")
    assert MEASURED not in vanilla and FROM_CACHE not in vanilla
    assert not (cache_dir / "forward-costs").exists()

    first = run(cache_dir, "--method", "sd")
    assert MEASURED in first and FROM_CACHE not in first
    (cached,) = (cache_dir / "forward-costs").iterdir()
    saved = json.loads(cached.read_text())
    # generate: one row; the threads of CSD_TORCH_THREADS
    assert saved["key"]["rows"] == [1] and saved["key"]["threads"] == 1
    assert saved["key"]["model"].startswith("SmolLM2-135M-Instruct@")
    # the embedded model runs on the project's kernels: a table measured on other kernel sources is not reused
    assert saved["key"]["kernels"] == native.sources_digest()

    second = run(cache_dir, "--method", "csd")
    assert FROM_CACHE in second and MEASURED not in second
    assert str(cached) in second

    # other shapes (a shorter draft) are another key: measured, not taken from the wrong table
    other = run(cache_dir, "--method", "sd", "--num-speculative-tokens", "3")
    assert MEASURED in other and len(list((cache_dir / "forward-costs").iterdir())) == 2


def test_a_corrupt_cache_file_is_measured_again(cache_dir):
    run(cache_dir, "--method", "sd")
    (cached,) = (cache_dir / "forward-costs").iterdir()
    data = json.loads(cached.read_text())
    data["by_rows"]["1"] = list(reversed(data["by_rows"]["1"]))  # decreasing: not a sane table
    cached.write_text(json.dumps(data))
    again = run(cache_dir, "--method", "sd")
    assert "ignoring the forward-cost cache" in again and MEASURED in again
