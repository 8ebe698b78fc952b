"""OCM increments that could not reach Redis before shutdown, kept on the local disk for the next start.

A file per store instance that spilled, `ocm-spill-<writer>.json`, written atomically (temporary file, then
rename): a crash mid-write leaves the previous state, never half a file. Each batch keeps the (writer id,
batch number) it had or would have had, so replaying it runs through the flush script's idempotency check:
a batch that did reach Redis before the link died (its reply lost) is skipped, and a replay that is
interrupted and repeated never counts twice.

A file that cannot be read is renamed `*.bad` and logged: kept for a person to look at, never replayed
blindly and never retried at every start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ocm_store.base import Namespace

log = logging.getLogger(__name__)

FORMAT = 1
PREFIX = "ocm-spill-"

Pair = tuple[int, int]


@dataclass
class SpilledBatch:
    writer: str
    batch: int
    patterns: dict[Pair, int]


def write_spill(folder: Path, writer: str, batches: Sequence[tuple[Namespace, SpilledBatch]]) -> Path | None:
    """Write the batches of every namespace; returns the file, or None if the disk refused (logged)."""
    path = folder / f"{PREFIX}{writer}.json"
    data = {
        "format": FORMAT,
        "batches": [
            {
                "namespace": ns.key,
                "writer": b.writer,
                "batch": b.batch,
                "patterns": [[d, t, n] for (d, t), n in b.patterns.items()],
            }
            for ns, b in batches
        ],
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as exc:
        log.error("OCM store: cannot spill to %s: %s", path, exc)
        return None
    return path


def read_spills(folder: Path) -> tuple[list[Path], list[tuple[Namespace, SpilledBatch]]]:
    """Every readable spill file in `folder` and its batches, oldest file first."""
    try:
        files = sorted(folder.glob(f"{PREFIX}*.json"), key=lambda p: p.stat().st_mtime_ns)
    except OSError:
        return [], []
    read: list[Path] = []
    batches: list[tuple[Namespace, SpilledBatch]] = []
    for path in files:
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            found = [
                (
                    Namespace.from_key(item["namespace"]),
                    SpilledBatch(
                        str(item["writer"]),
                        int(item["batch"]),
                        {(int(d), int(t)): int(n) for d, t, n in item["patterns"] if int(n) > 0},
                    ),
                )
                for item in data["batches"]
            ]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            bad = path.with_suffix(".bad")
            log.error("OCM store: cannot read the spill file %s (%s); moved to %s", path, exc, bad)
            with contextlib.suppress(OSError):
                path.replace(bad)
            continue
        read.append(path)
        batches += [(ns, b) for ns, b in found if b.patterns]
    return read, batches


def remove_spills(files: Sequence[Path]) -> None:
    for path in files:
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.error("OCM store: cannot remove the replayed spill file %s: %s", path, exc)
