"""Opt-in recording of served generations' token ids, for fine-tuning the draft head on an operator's own
traffic (`python -m training --from-traffic DIR`, training/traffic.py). Off unless `record_traffic` names a
folder (CSD_RECORD_TRAFFIC, `--record-traffic DIR`): the privacy switch. docs/traffic-learning.md.

What one record holds, per finished generation (one per choice): the exact prompt token ids the target
answered from, the token ids it emitted (its end-of-turn token appended when it ended on one), the model
(`name@revision`), method, drafter and the drafter's identity, the sampling temperature, finish reason and
the round counts. No text, no request id, no client address; nothing of a record is ever logged.

Off the hot path: the engine thread only puts the record on a bounded queue (`put_nowait`; a full queue
drops the record and counts it); one writer thread compresses and writes. Shards are append-only gzip files
(`traffic-<start>-<pid>-NNNN.jsonl.gz`), one gzip member per write, so a crash loses at most the member
being written and a reader keeps everything before it.

The size bound (`record_traffic_max_bytes`) counts compressed bytes written: a write that would cross it
is not made, recording stops, and the server says so once in its log and in `csd_traffic_recording_active`.
A folder that cannot be written (read-only, full disk) stops recording the same way; requests never fail
because of recording.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from service.decoding.generation import Generation
    from service.decoding.requests import EngineRequest

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
QUEUE_RECORDS = 4096  # records waiting for the writer; more are dropped (and counted), never waited for
SHARD_RECORDS = 10_000  # records per shard file before the next one starts
SHARD_GLOB = "traffic-*.jsonl.gz"


def traffic_record(request: EngineRequest, index: int, generation: Generation, model_identity: str) -> dict:
    """What fine-tuning needs of one finished generation (choice `index` of `request`): token ids, no text."""
    answer = [t.token_id for t in generation.tokens]
    stats = generation.stats
    # It ended on its end-of-turn token, which the emitted tokens leave out: appended when there is only
    # one it could be (a request's stop_token_ids add others, and which one ended it is not kept).
    end_known = not stats.num_eos or len(generation.eos_ids) == 1
    if stats.num_eos and end_known:
        answer.extend(generation.eos_ids)
    drafter = generation.drafter
    return {
        "v": FORMAT_VERSION,
        "time": round(time.time(), 3),
        "model": model_identity,
        "method": request.method,
        "drafter": request.drafter_label,
        "drafter_identity": drafter.identity if drafter is not None else None,
        "temperature": request.sampling_for(index).temperature,
        "finish_reason": generation.finish_reason or "stop",
        "ended_on_end_token": bool(stats.num_eos),
        "end_token_known": end_known,
        "prompt_ids": list(request.prompt_ids),
        "answer_ids": answer,
        "target_forwards": stats.target_forwards,
        "draft_tokens": stats.num_draft_tokens,
        "accepted_tokens": stats.num_accepted,
    }


class TrafficRecorder:
    """Writes records to `folder` on its own thread, up to `max_bytes` compressed bytes in all."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.written_records = 0
        self.written_bytes = 0
        self.dropped = {"queue_full": 0, "size_bound": 0, "write_failed": 0, "stopped": 0}
        self.active = True
        self.stop_reason: str | None = None
        self._queue: queue.Queue[dict | None] = queue.Queue(QUEUE_RECORDS)
        self._prefix = f"traffic-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}"
        self._shard = 0
        self._shard_records = 0
        self._thread = threading.Thread(target=self._run, name="csd-traffic", daemon=True)
        self._thread.start()
        log.info("recording served token ids (no text) to %s, up to %d bytes", self.folder, self.max_bytes)

    # ------------------------------------------------------------ any thread (the engine's)

    def record(self, record: dict) -> None:
        """Queue one record; never blocks, never raises."""
        if not self.active:
            self.dropped["stopped"] += 1
            return
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped["queue_full"] += 1

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, then stop the thread."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)

    # ------------------------------------------------------------ writer thread

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            batch = [first]
            while True:  # everything already waiting goes into one member
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            done = None in batch
            records = [r for r in batch if r is not None]
            if records:
                self._write(records)
            if done:
                return

    def _stop(self, reason: str, detail: str) -> None:
        self.active = False
        self.stop_reason = reason
        log.warning("traffic recording stopped (%s): %s; requests are served as before", reason, detail)

    def _write(self, records: list[dict]) -> None:
        if not self.active:
            self.dropped["stopped"] += len(records)
            return
        lines = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in records)
        member = gzip.compress(lines.encode(), compresslevel=6)
        if self.written_bytes + len(member) > self.max_bytes:
            self.dropped["size_bound"] += len(records)
            self._stop(
                "size bound",
                f"{self.written_records} records, {self.written_bytes} bytes written; the next write would "
                f"pass record_traffic_max_bytes={self.max_bytes}",
            )
            return
        if self._shard_records >= SHARD_RECORDS:
            self._shard += 1
            self._shard_records = 0
        path = self.folder / f"{self._prefix}-{self._shard:04d}.jsonl.gz"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as f:
                f.write(member)
        except OSError as exc:
            self.dropped["write_failed"] += len(records)
            self._stop("write failed", f"{type(exc).__name__}: {exc.strerror or exc}")
            return
        self.written_bytes += len(member)
        self.written_records += len(records)
        self._shard_records += len(records)


def read_traffic(folder: Path) -> Iterator[dict]:
    """Every record under `folder` (shards in name order). A shard cut short by a crash gives what came
    before the cut."""
    for path in sorted(Path(folder).rglob(SHARD_GLOB)):
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                for line in f:
                    if line.endswith("\n"):
                        yield json.loads(line)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            log.warning("%s ends early (%s); kept the records before", path.name, exc)


class TrafficCollector(Collector):
    """The recorder's counters at scrape time (nothing exported while recording is off)."""

    def __init__(self, recorder_fn, model_name: str = "unknown") -> None:
        self.recorder_fn = recorder_fn
        self.model_name = model_name

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable:
        recorder: TrafficRecorder | None = self.recorder_fn()
        if recorder is None:
            return
        m = [self.model_name]
        active = GaugeMetricFamily(
            "csd_traffic_recording_active",
            "1 while served token ids are being recorded; 0 once recording stopped (size bound, write failure)",
            labels=["model_name"],
        )
        active.add_metric(m, 1.0 if recorder.active else 0.0)
        yield active
        records = CounterMetricFamily(
            "csd_traffic_records", "Generations recorded for fine-tuning", labels=["model_name"]
        )
        records.add_metric(m, recorder.written_records)
        yield records
        size = CounterMetricFamily(
            "csd_traffic_bytes", "Compressed bytes of recorded traffic written", labels=["model_name"]
        )
        size.add_metric(m, recorder.written_bytes)
        yield size
        dropped = CounterMetricFamily(
            "csd_traffic_dropped_records",
            "Generations not recorded, by reason (queue_full, size_bound, write_failed, stopped)",
            labels=["model_name", "reason"],
        )
        for reason, count in recorder.dropped.items():
            dropped.add_metric([*m, reason], count)
        yield dropped
