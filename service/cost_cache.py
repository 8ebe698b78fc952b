"""Measured forward-cost tables on disk, one file per model + machine + settings, so a warm start measures
nothing (issue 13, finding 9).

The key holds everything a forward's cost depends on: the model's content identity and dtype, the device,
torch's version and threads, the executor (fused layers or eager), whether CPU weights are packed, the CPU, and the shapes measured. A table that
was measured under another key is never used; a file that cannot be read or fails the sanity checks is
measured again, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from functools import cache
from pathlib import Path

import torch

from service.executor import native
from service.executor.forward_costs import CONTEXT, MEASUREMENT_VERSION, ForwardCosts, row_counts
from service.executor.models import LoadedModel

log = logging.getLogger(__name__)


@cache
def cpu_name() -> str:
    """The CPU's model name (the machine line of the benchmarks, and part of the cost cache's key)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cost_key(target: LoadedModel, max_tokens: int, max_rows: int, pack_cpu_weights: bool) -> dict:
    device = target.device
    return {
        "version": MEASUREMENT_VERSION,
        "model": target.identity,
        "dtype": str(target.model.dtype),
        "weights": target.weights,
        "executor": target.executor,
        "kernels": native.sources_digest() if target.executor != "eager" else None,
        "device": device.type,
        "accelerator": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "packed": pack_cpu_weights,
        "context": CONTEXT,
        "max_tokens": max_tokens,
        "rows": row_counts(max_rows),
    }


def cost_file(cache_dir: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir / "forward-costs" / f"{digest}.json"


def load_costs(cache_dir: Path, key: dict) -> ForwardCosts | None:
    """The cached table for `key`, or None (absent, unreadable, another key, or not a sane table)."""
    path = cost_file(cache_dir, key)
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            return None
        by_rows = {int(rows): [float(c) for c in costs] for rows, costs in data["by_rows"].items()}
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring the unreadable forward-cost cache %s: %s", path, exc)
        return None
    if not _sane(by_rows, key):
        log.warning("ignoring the forward-cost cache %s: not a table of positive, non-decreasing costs", path)
        return None
    return ForwardCosts(by_rows)


def _sane(by_rows: dict[int, list[float]], key: dict) -> bool:
    if sorted(by_rows) != key["rows"]:
        return False
    for costs in by_rows.values():
        if len(costs) != key["max_tokens"] or not all(c > 0 for c in costs) or costs != sorted(costs):
            return False
    return True


def save_costs(cache_dir: Path, key: dict, costs: ForwardCosts) -> Path | None:
    """Write the table (atomically: a concurrent start reads the old file or the new one); None if the
    cache folder is not writable (the next start measures again, nothing worse)."""
    path = cost_file(cache_dir, key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "by_rows": costs.by_rows}, indent=1))
        tmp.replace(path)
    except OSError as exc:
        log.warning("cannot cache the forward costs in %s: %s", path, exc)
        return None
    return path
