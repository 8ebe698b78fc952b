"""One "replica" of the service for the multi-process OCM tests: opens a store the way the service does
(`open_store`), then records or reads the patterns of `PATTERNS`.

    python tests/ocm_store/replica.py (--redis-url URL | --path FILE) record-hold | record-exit | read

record-hold: record, print "recorded", keep running (the background worker flushes) until stdin closes.
record-exit: record, close the store (a graceful shutdown), exit.
read: print {"counts": [...], "status": {...}} as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ocm_store import Namespace
from ocm_store.factory import open_store

NAMESPACE = Namespace("target@rev", "ngram", "vocab")
# pattern (i, 1000 + i) recorded i + 1 times
PATTERNS = [((i, 1000 + i), i + 1) for i in range(20)]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url")
    parser.add_argument("--path", type=Path)
    parser.add_argument("--refresh-interval", type=float, default=0.2)
    parser.add_argument("--save-interval", type=float, default=3600)
    parser.add_argument("action", choices=["record-hold", "record-exit", "read"])
    args = parser.parse_args()
    store = open_store(
        args.redis_url,
        args.path,
        refresh_interval_s=args.refresh_interval,
        save_interval_s=args.save_interval,
    )
    memory = store.memory(NAMESPACE)
    if args.action == "read":
        counts = memory.counts([p for p, _ in PATTERNS])
        print(json.dumps({"counts": counts, "status": dataclasses.asdict(store.status())}), flush=True)
    else:
        for pattern, times in PATTERNS:
            for _ in range(times):
                memory.record([pattern])
        print("recorded", flush=True)
        if args.action == "record-hold":
            sys.stdin.readline()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
