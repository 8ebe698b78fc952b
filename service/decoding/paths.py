"""Where csd-serve keeps files on disk (no heavy imports: the settings and the CLI read this early)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """CSD_CACHE_DIR, else $XDG_CACHE_HOME/csd-serve, else ~/.cache/csd-serve."""
    root = os.environ.get("CSD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "csd-serve"
    )
    return Path(root)
