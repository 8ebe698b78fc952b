"""`python -m bench.llama_cpp`: csd-serve beside llama.cpp on the same GGUF file, prompts, token ids and threads.

The peer is the llama.cpp library that the npm package node-llama-cpp ships prebuilt (`make peer-llama-cpp`
installs it under `.peers/`; `NODE_LLAMA_CPP` may name another install's `dist/index.js`), driven by
`bench/llama_cpp_node.mjs`: one model load, then each prompt as a fresh sequence. Four columns, interleaved
prompt by prompt (so a burst of load on a shared host falls on all of them), after one untimed warm-up each:

- `vanilla`: csd-serve's plain greedy decoding (method vanilla) with the weights `--weights` loads;
- `served`: csd-serve as `csd serve` runs by default (csd, its default drafter, the adaptive draft policy);
- `llama.cpp`: llama.cpp plain greedy decoding;
- `llama.cpp-lookup`: the same with node-llama-cpp's input-lookup token predictor (prompt lookup decoding).

Each figure: completion tokens over the wall time of the whole request, prefill included (tok/s), and the time
to the first token. Where the peer is not installed its columns say so and the run still measures ours.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from bench.machine import REPO

NODE_SCRIPT = REPO / "bench" / "llama_cpp_node.mjs"
PEER_DIR = REPO / ".peers" / "llama-cpp"
PEER_VERSION = "3.22.1"  # node-llama-cpp, the version the issue measured
COLUMNS = ("vanilla", "served", "llama.cpp", "llama.cpp-lookup")
PEER_COLUMNS = ("llama.cpp", "llama.cpp-lookup")


def peer_entry() -> Path | None:
    """node-llama-cpp's entry file, or None where it is not installed."""
    named = os.environ.get("NODE_LLAMA_CPP")
    candidates = [Path(named)] if named else []
    candidates.append(PEER_DIR / "node_modules" / "node-llama-cpp" / "dist" / "index.js")
    return next((c for c in candidates if c.is_file()), None)


def peer_missing() -> str | None:
    """Why the peer cannot run here, or None when it can."""
    if shutil.which("node") is None:
        return "node is not installed"
    if peer_entry() is None:
        return "node-llama-cpp is not installed (make peer-llama-cpp)"
    return None


class LlamaCpp:
    """One node process holding llama.cpp with the model loaded; `generate` runs one prompt's token ids."""

    def __init__(self, gguf: Path, threads: int) -> None:
        entry = peer_entry()
        assert entry is not None
        env = dict(os.environ, NODE_LLAMA_CPP=str(entry))
        self.process = subprocess.Popen(
            ["node", str(NODE_SCRIPT), str(gguf), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = self._read()

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            error = self.process.stderr.read().strip().splitlines()
            raise RuntimeError(f"llama.cpp peer ended: {error[-1] if error else 'no output'}")
        return json.loads(line)

    def generate(self, ids: list[int], max_tokens: int, lookup: bool) -> dict:
        self.process.stdin.write(json.dumps({"ids": ids, "max_tokens": max_tokens, "lookup": lookup}) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()


@dataclass
class Sample:
    column: str
    prompt: str
    workload: str
    tokens: list[int]
    seconds: float
    first_token_seconds: float
    extra: dict

    @property
    def tok_s(self) -> float:
        return len(self.tokens) / self.seconds


class Ours:
    """csd-serve's engine as `csd serve` builds it (Runtime.build), one request at a time."""

    def __init__(self, threads: int, weights: str) -> None:
        from service.config import Settings
        from service.runtime import Runtime

        # no prefix cache: each request computes its whole prompt, as the peer's fresh sequence does
        self.settings = Settings(
            torch_threads=threads, weights=weights, max_batch_size=1, enable_prefix_caching=False
        )
        self.runtime = Runtime.build(self.settings)

    def generate(self, ids: list[int], max_tokens: int, served: bool) -> dict:
        from service.decoding import Method, SamplingParams, SpeculativeConfig, run_alone

        spec = self.settings.speculative_config()
        if not served:
            spec = SpeculativeConfig(method=Method.VANILLA)
        started = time.perf_counter()
        first = None
        generation = self.runtime.engine.generate(
            ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), spec, drafter=self.settings.drafter
        )
        for _ in run_alone(generation):
            if first is None:
                first = time.perf_counter() - started
        seconds = time.perf_counter() - started
        stats = generation.stats
        return {
            "tokens": [t.token_id for t in generation.tokens],
            "seconds": seconds,
            "first_token_seconds": first or seconds,
            "tokens_per_forward": stats.completion_tokens / max(1, stats.target_forwards),
        }


def run(workloads: list[str], limit: int, max_tokens: int, threads: int, weights: str, log) -> dict:
    import torch

    from bench.workloads import load_workload
    from service.executor.paths import resolve_model_spec

    started = time.perf_counter()
    _, gguf, _ = resolve_model_spec("embedded")
    ours = Ours(threads, weights)
    torch.set_num_threads(threads)  # the same count as the peer's, whatever the governor would choose
    tokenizer = ours.runtime.target.tokenizer
    missing = peer_missing()
    peer = None
    if missing is None:
        try:
            peer = LlamaCpp(gguf, threads)
        except (OSError, RuntimeError, ValueError) as exc:
            missing = f"the peer did not start: {exc}"
    prompts = [p for name in workloads for p in load_workload(name, limit)]
    runners = {
        "vanilla": lambda ids: ours.generate(ids, max_tokens, served=False),
        "served": lambda ids: ours.generate(ids, max_tokens, served=True),
    }
    if peer is not None:
        runners["llama.cpp"] = lambda ids: peer.generate(ids, max_tokens, lookup=False)
        runners["llama.cpp-lookup"] = lambda ids: peer.generate(ids, max_tokens, lookup=True)
    warm = prompts[0].token_ids(tokenizer)
    for column, generate in runners.items():
        log(f"warm-up: {column}")
        generate(warm)
    samples: list[Sample] = []
    try:
        for i, prompt in enumerate(prompts):
            ids = prompt.token_ids(tokenizer)
            log(f"prompt {i + 1}/{len(prompts)} ({prompt.id}, {len(ids)} tokens)")
            for column, generate in runners.items():
                out = generate(ids)
                extra = {
                    k: v for k, v in out.items() if k not in ("tokens", "seconds", "first_token_seconds")
                }
                samples.append(
                    Sample(column, prompt.id, prompt.workload, out["tokens"], out["seconds"],
                           out["first_token_seconds"], extra)
                )  # fmt: skip
    finally:
        if peer is not None:
            peer.close()
    return {
        "model": ours.runtime.target.identity,
        "gguf": gguf.name,
        "weights": ours.runtime.target.weights,
        "dtype": str(ours.runtime.target.model.dtype).removeprefix("torch."),
        "threads": threads,
        "max_tokens": max_tokens,
        "peer": {"missing": missing, "node_llama_cpp": PEER_VERSION, **(peer.info if peer else {})},
        "samples": [s.__dict__ | {"tok_s": s.tok_s} for s in samples],
        "wall_seconds": time.perf_counter() - started,
    }


def summary(result: dict) -> dict:
    """Per workload and column: the mean tok/s over prompts, the median time to first token, and llama.cpp's
    predictions used (lookup)."""
    table: dict[str, dict[str, dict]] = {}
    for s in result["samples"]:
        table.setdefault(s["workload"], {}).setdefault(s["column"], []).append(s)
    out: dict[str, dict[str, dict]] = {}
    for workload, columns in table.items():
        out[workload] = {}
        for column, samples in columns.items():
            tokens = sum(len(s["tokens"]) for s in samples)
            seconds = sum(s["seconds"] for s in samples)
            row = {
                "tok_s": tokens / seconds,
                "ttft_median_s": statistics.median(s["first_token_seconds"] for s in samples),
                "tokens": tokens,
            }
            if column == "served":
                row["tokens_per_forward"] = statistics.mean(s["extra"]["tokens_per_forward"] for s in samples)
            if column == "llama.cpp-lookup":
                row["predictions_used"] = sum(s["extra"]["predictions"]["used"] for s in samples)
                row["predictions_refuted"] = sum(s["extra"]["predictions"]["refuted"] for s in samples)
            out[workload][column] = row
    return out


def markdown(result: dict) -> list[str]:
    table = summary(result)
    missing = result["peer"]["missing"]
    lines = [
        f"`{result['gguf']}` ({result['model']}); ours: {result['weights']} weights, {result['dtype']} body; "
        f"{result['threads']} thread(s) each; greedy, at most {result['max_tokens']} tokens; tok/s = completion "
        "tokens over wall time with prefill, summed over the prompts; in brackets the median time to the first "
        "token.",
        "",
        "| workload | " + " | ".join(COLUMNS) + " | vanilla / llama.cpp | served / llama.cpp |",
        "|---|" + "---|" * (len(COLUMNS) + 2),
    ]
    for workload, columns in table.items():
        cells = []
        for column in COLUMNS:
            row = columns.get(column)
            if row is None:
                cells.append(f"not run: {missing}")
                continue
            cell = f"{row['tok_s']:.1f} ({row['ttft_median_s'] * 1e3:.0f} ms)"
            if "tokens_per_forward" in row:
                cell += f", {row['tokens_per_forward']:.2f} tok/fwd"
            if "predictions_used" in row:
                cell += (
                    f", {row['predictions_used']} lookup tokens used, {row['predictions_refuted']} refuted"
                )
            cells.append(cell)
        peer = columns.get("llama.cpp")
        ratios = [
            f"{columns[c]['tok_s'] / peer['tok_s']:.2f}x" if peer else "n/a" for c in ("vanilla", "served")
        ]
        lines.append(f"| {workload} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.llama_cpp", description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="chat,grounded", help="comma-separated bench workloads")
    p.add_argument("--limit", type=int, default=8, help="prompts per workload")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="threads for both engines")
    p.add_argument("--weights", choices=("auto", "dense", "int4"), default="auto", help="csd-serve's weights")
    p.add_argument("--out", type=Path, help="output folder (default bench/results/llama-cpp-<timestamp>)")
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    if not workloads or min(args.limit, args.max_tokens, args.threads) < 1:
        print("bench.llama_cpp: error: --workloads must name one; --limit, --max-tokens, --threads >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    from bench.workloads import WORKLOADS

    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        print(f"bench.llama_cpp: error: unknown workload {unknown[0]!r}; choose from {', '.join(WORKLOADS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    from bench.machine import start_run, write_run

    command, machine = start_run("bench.llama_cpp", argv, args.threads)
    started = datetime.now()
    result = run(
        workloads, args.limit, args.max_tokens, args.threads, args.weights,
        log=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )  # fmt: skip
    result.update(command=command, machine_line=machine, started=started.isoformat(timespec="seconds"))
    write_run("llama-cpp", args.out, result, markdown(result), started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
