"""Fleet learning, measured: R replicas sharing one Online Correction Memory in a real Redis against the same
R replicas each with a memory of its own, serving one request stream split round-robin across them.

Each replica is the decoding engine in-process (`service.decoding.Engine` on the embedded model with the
trained draft head, the drafter whose divergences recur) with its own OCM store object: a `RedisStore` on
one throwaway `redis-server` (shared), or an `InMemoryStore` (alone). Requests are served one after
another; before a request its replica pulls what the fleet wrote (`refresh`) and after it sends what it
learned (`flush`), which is what the background worker does within 0.6 s while a request runs for seconds.
Every figure here (rescue rate, tokens per forward, requests until the first divergence pattern passes
lambda) counts tokens and forwards, never time, so it does not depend on the machine's load.

    python -m bench.fleet [--replicas 1 2 4] [--requests 32] [--max-tokens 48] [--threads 1]
    python -m bench.fleet --tiny        # seconds: the shape of the report, for the tests
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

FIGURES = Path(__file__).resolve().parent / "figures"


@dataclass
class Served:
    request: int  # 1-based position in the stream
    replica: int
    completion_tokens: int
    target_forwards: int
    num_rescued: int
    num_eos: int
    pattern_above_lambda: bool  # after this request, the serving replica's memory holds a count > lambda


@dataclass
class SetupResult:
    label: str
    replicas: int
    shared: bool
    served: list[Served] = field(default_factory=list)

    def totals(self, upto: int | None = None, since: int = 0) -> dict:
        rows = [s for s in self.served if since < s.request <= (upto or len(self.served))]
        tokens = sum(s.completion_tokens for s in rows)
        forwards = sum(s.target_forwards for s in rows)
        rescued = sum(s.num_rescued for s in rows)
        decided = tokens + sum(s.num_eos for s in rows)
        return {
            "requests": len(rows),
            "completion_tokens": tokens,
            "target_forwards": forwards,
            "rescued": rescued,
            "rescue_rate": rescued / tokens if tokens else 0.0,
            "tokens_per_forward": decided / forwards if forwards else 0.0,
        }

    def first_above_lambda(self) -> int | None:
        return next((s.request for s in self.served if s.pattern_above_lambda), None)


def run(
    target,
    prompts: list[list[int]],
    replica_counts: list[int],
    max_tokens: int,
    lambda_: float = 6,
    progress=None,
) -> list[SetupResult]:
    from bench.redis_process import RedisProcess
    from ocm_store import InMemoryStore
    from ocm_store.redis_store import RedisStore
    from service.decoding import (
        Engine,
        HeadDrafter,
        Method,
        SamplingParams,
        SpeculativeConfig,
    )
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR
    from service.decoding.engine import run_to_end
    from service.runtime import ocm_namespaces

    drafter = HeadDrafter(target, EMBEDDED_HEAD_DIR)
    ns = ocm_namespaces(target, {"head": drafter})["head"]
    spec = SpeculativeConfig(method=Method.CSD, lambda_=lambda_)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    setups = [(1, False)] + [(r, shared) for r in replica_counts if r > 1 for shared in (True, False)]
    results = []
    with tempfile.TemporaryDirectory(prefix="csd-fleet-") as tmp:
        for n, shared in setups:
            label = f"{n} replica" if n == 1 else f"{n} replicas, {'shared' if shared else 'alone'}"
            server = (
                RedisProcess(Path(tmp) / label.replace(" ", "_").replace(",", "")).start() if shared else None
            )
            stores = [
                RedisStore(server.url, flush_interval_s=3600, refresh_interval_s=3600) if server else InMemoryStore()
                for _ in range(n)
            ]  # fmt: skip
            engines = [Engine(target, {"head": drafter}, {"head": s.memory(ns)}) for s in stores]
            result = SetupResult(label, n, shared)
            try:
                for i, prompt in enumerate(prompts):
                    r = i % n
                    if server:
                        stores[r].refresh()
                    g = run_to_end(engines[r].generate(prompt, sampling, spec, drafter="head"))
                    if server:
                        stores[r].flush()
                    top = stores[r].top(ns, 1)
                    st = g.stats
                    result.served.append(
                        Served(
                            i + 1,
                            r,
                            st.completion_tokens,
                            st.target_forwards,
                            st.num_rescued,
                            st.num_eos,
                            bool(top) and top[0].count > lambda_,
                        )  # fmt: skip
                    )
                    if progress:
                        progress(label, i + 1, len(prompts))
            finally:
                for s in stores:
                    s.close()
                if server:
                    server.stop()
            results.append(result)
    return results


def report(results: list[SetupResult], config: dict) -> dict:
    n = len(results[0].served)
    half = n // 2
    return {
        "config": config,
        "setups": [
            {
                "label": r.label,
                "replicas": r.replicas,
                "shared": r.shared,
                "first_pattern_above_lambda_at_request": r.first_above_lambda(),
                "all": r.totals(),
                "first_half": r.totals(upto=half),
                "second_half": r.totals(since=half),
                "cumulative": [r.totals(upto=k)["tokens_per_forward"] for k in range(1, n + 1)],
                "cumulative_rescue_rate": [r.totals(upto=k)["rescue_rate"] for k in range(1, n + 1)],
            }
            for r in results
        ],
    }


def markdown(rep: dict, command: str) -> str:
    c = rep["config"]
    lines = [
        "# Fleet learning: a shared OCM against a memory per replica",
        "",
        f"`{command}`: {c['requests']} chat requests x {c['max_tokens']} tokens, greedy, csd (lambda "
        f"{c['lambda']}, tau 0.01, k 6), trained draft head on the embedded model, split round-robin.",
        f"Machine: {c['machine']} (shared with other jobs; only token counts are reported, no timings).",
        "",
        "| setup | first pattern > lambda at request | rescue rate | tokens/forward | tokens/forward, 2nd half |",
        "|---|---|---|---|---|",
    ]
    for s in rep["setups"]:
        first = s["first_pattern_above_lambda_at_request"]
        lines.append(
            f"| {s['label']} | {first if first is not None else 'never'} | {s['all']['rescue_rate']:.3f} | "
            f"{s['all']['tokens_per_forward']:.3f} | {s['second_half']['tokens_per_forward']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rep: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for s in rep["setups"]:
        style = "-" if s["shared"] or s["replicas"] == 1 else "--"
        xs = range(1, len(s["cumulative"]) + 1)
        axes[0].plot(xs, s["cumulative_rescue_rate"], style, label=s["label"])
        axes[1].plot(xs, s["cumulative"], style, label=s["label"])
    axes[0].set_ylabel("rescued / completion tokens (cumulative)")
    axes[1].set_ylabel("tokens per target forward (cumulative)")
    for ax in axes:
        ax.set_xlabel("requests served by the fleet")
        ax.legend(fontsize=8)
    fig.suptitle("Fleet learning: shared OCM (solid) vs a memory per replica (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet", description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lambda", dest="lambda_", type=float, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--out", type=Path, default=FIGURES, help="folder for fleet.json, fleet.md, fleet.png"
    )
    parser.add_argument("--tiny", action="store_true", help="2 replicas, 4 requests of 8 tokens")
    args = parser.parse_args(argv)
    if args.tiny:
        args.replicas, args.requests, args.max_tokens = [1, 2], 4, 8

    import torch

    from bench.workloads import load_workload
    from service.executor.models import load_model

    torch.set_num_threads(args.threads)
    target = load_model("embedded")
    chat = load_workload("chat")
    prompts = [chat[i % len(chat)].token_ids(target.tokenizer) for i in range(args.requests)]
    started = time.monotonic()
    results = run(target, prompts, args.replicas, args.max_tokens, args.lambda_,
                  progress=lambda label, i, n: print(f"{label}: {i}/{n}", file=sys.stderr, flush=True))  # fmt: skip
    config = {
        "requests": args.requests,
        "distinct_prompts": min(args.requests, len(chat)),
        "max_tokens": args.max_tokens,
        "lambda": args.lambda_,
        "replicas": args.replicas,
        "threads": args.threads,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s), {platform.python_version()}",
        "wall_seconds": round(time.monotonic() - started, 1),
    }
    rep = report(results, config)
    command = "python -m bench.fleet " + " ".join(argv if argv is not None else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fleet.json").write_text(json.dumps(rep, indent=2))
    (args.out / "fleet.md").write_text(markdown(rep, command.strip()))
    plot(rep, args.out / "fleet.png")
    print(markdown(rep, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
