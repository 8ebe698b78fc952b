"""`python -m bench.traffic_finetune`: does fine-tuning on recorded traffic raise the head's acceptance there?

One operator's traffic, unlike the training corpus: the support desk of a fictional outdoor-gear shop (one
system prompt, user questions drawn from products x issues x phrasings, seeded), answered greedily.

1. serve with recording on (`--record-traffic`), several concurrent clients (the batch fills), and
   record the answers to `--requests` prompts;
2. `training.traffic.fine_tune`: hold out a seeded share by request, fine-tune the shipped head on the rest,
   report teacher-forced held-out acceptance before and after (training.train_head.evaluate);
3. unless `--no-serve-check`: serve `--check-requests` fresh prompts of the same distribution (in no
   recorded request) with strict `sd` and the `head` drafter, reload the fine-tuned head
   (POST /v1/admin/reload_drafter), serve them again: tokens per target forward before and after.

Writes WORK/report.json (default bench/results/traffic-finetune/) and prints a summary with the machine line (the machine may be shared: timings
are noisy, tokens per forward and acceptance are not).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
_LISTENING = re.compile(r"on http://([\w.\-\[\]:]+):(\d+) ")

SYSTEM = (
    "You are the customer support assistant of Northwind Outfitters, an online shop for hiking and camping "
    "gear. Answer politely and briefly, give concrete next steps, and never invent order details you were "
    "not given. Returns are free within 30 days; the warranty on tents and backpacks is two years."
)
PRODUCTS = [
    "Trailblazer 45 backpack", "Summit Lite tent", "Alpine down sleeping bag", "Ridge trekking poles",
    "Cascade rain jacket", "Granite hiking boots", "Ember camping stove", "Glacier water filter",
    "Nomad headlamp", "Canyon hammock", "Timberline fleece", "Aurora insulated bottle",
    "Basecamp folding chair", "Pathfinder GPS watch", "Meadow picnic blanket", "Tundra gloves",
    "Horizon camping lantern", "Drift dry bag", "Kestrel trail shoes", "Sierra merino socks",
]  # fmt: skip
ISSUES = [
    "my order {order} has not arrived yet and the tracking page has not changed for five days",
    "I want to return the {product} because it is too small",
    "the {product} arrived damaged, with a tear on one side",
    "can I exchange the {product} for a bigger size",
    "the discount code SPRING15 does not work at checkout for the {product}",
    "my payment for the {product} failed but the money left my account",
    "I need to change the delivery address of order {order}",
    "how do I claim the warranty on my {product}, it broke after a year",
    "please cancel order {order}, I ordered the {product} twice by mistake",
    "is the {product} suitable for winter camping",
    "when will the {product} be back in stock",
    "how do I clean and store the {product}",
]
PHRASINGS = [
    "Hi, {issue}.",
    "Hello! {issue}. What should I do?",
    "{issue}. Can you help me?",
    "Good morning, quick question: {issue}?",
    "Hey there. {issue}, thanks in advance.",
]


def support_requests(count: int, seed: int, exclude: set[str] = frozenset()) -> list[str]:
    """`count` distinct user turns of the shop's traffic (seeded), none of them in `exclude`."""
    rng = random.Random(seed)
    out: list[str] = []
    seen = set(exclude)
    while len(out) < count:
        issue = rng.choice(ISSUES).format(
            product=rng.choice(PRODUCTS), order=f"NW-{rng.randint(10000, 99999)}"
        )
        text = rng.choice(PHRASINGS).format(
            issue=issue[0].upper() + issue[1:] if rng.random() < 0.5 else issue
        )
        if text not in seen:
            seen.add(text)
            out.append(text)
    return out


def start_server(work: Path, threads: int, *flags: str) -> tuple[subprocess.Popen, str]:
    log_path = work / f"server-{int(time.time() * 1000)}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CSD_") or k == "CSD_CACHE_DIR"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", CSD_OCM_PATH=str(work / "ocm.sqlite"))
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--port",
        "0",
        "--torch-threads",
        str(threads),
        *flags,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    url = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited:\n{log_path.read_text()}")
        match = _LISTENING.search(log_path.read_text(errors="replace")) if not url else None
        if match:
            url = f"http://{match.group(1)}:{match.group(2)}"
        if url:
            try:
                if httpx.get(f"{url}/ready", timeout=10).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not get ready in 600 s")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def ask_all(url: str, prompts: list[str], max_tokens: int, clients: int, speculative: dict) -> list[dict]:
    def ask(text: str) -> dict:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "speculative": speculative,
        }
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        response.raise_for_status()
        return response.json()

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(ask, prompts))


def served_figures(answers: list[dict]) -> dict:
    spec = [a["speculative"] for a in answers]
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    forwards = sum(s["target_forwards"] for s in spec)
    drafted, accepted = sum(s["draft_tokens"] for s in spec), sum(s["accepted_tokens"] for s in spec)
    return {
        "requests": len(answers),
        "completion_tokens": tokens,
        "target_forwards": forwards,
        "tokens_per_forward": round(tokens / max(1, forwards), 3),
        "acceptance_rate": round(accepted / max(1, drafted), 4),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m bench.traffic_finetune", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--work", type=Path, default=Path("bench/results/traffic-finetune"))
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--check-requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (server and fine-tuning)")
    parser.add_argument("--holdout", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--finetune-epochs", type=float, default=None)
    parser.add_argument("--no-serve-check", action="store_true")
    parser.add_argument(
        "--reuse-traffic",
        action="store_true",
        help="skip recording: fine-tune on what WORK/traffic holds already (a recording cut short)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    work: Path = args.work.resolve()
    traffic = work / "traffic"
    has_traffic = traffic.exists() and any(traffic.iterdir())
    if has_traffic and not args.reuse_traffic:
        raise SystemExit(f"{traffic} holds recorded traffic already: pick another --work, or --reuse-traffic")
    work.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}
    # the check prompts exclude all --requests prompts, recorded or not
    recorded_prompts = support_requests(args.requests, args.seed)
    check_prompts = support_requests(args.check_requests, args.seed + 1, exclude=set(recorded_prompts))

    if args.reuse_traffic:
        from service.traffic import read_traffic

        recorded = {"reused": str(traffic), "records": len(list(read_traffic(traffic)))}
    else:
        t0 = time.perf_counter()
        proc, url = start_server(
            work, args.threads, "--record-traffic", str(traffic), "--max-batch-size", "8"
        )
        try:
            # the server's default speculation (csd, combined): what an operator's traffic is served with
            answers = ask_all(url, recorded_prompts, args.max_tokens, args.clients, {})
        finally:
            stop_server(proc)  # writes what is queued
        timings["record_s"] = round(time.perf_counter() - t0, 1)
        recorded = served_figures(answers)

    import torch

    from service.decoding.draft_head import EMBEDDED_HEAD_DIR
    from service.executor.models import load_model
    from training.traffic import fine_tune, fine_tune_config

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    target = load_model("embedded")
    overrides = {"seed": args.seed}
    if args.finetune_epochs is not None:
        overrides["epochs"] = args.finetune_epochs
    head_dir = work / "traffic-head"
    tuned = fine_tune(
        target, traffic, EMBEDDED_HEAD_DIR, head_dir, fine_tune_config(**overrides), holdout=args.holdout
    )
    timings["fine_tune_s"] = round(time.perf_counter() - t0, 1)
    del target

    served = None
    if not args.no_serve_check:
        t0 = time.perf_counter()
        strict_head = {"method": "sd", "drafter": "head"}
        proc, url = start_server(work, args.threads, "--max-batch-size", "8")
        try:
            before = served_figures(ask_all(url, check_prompts, args.max_tokens, 4, strict_head))
            reload = httpx.post(f"{url}/v1/admin/reload_drafter", json={"folder": str(head_dir)}, timeout=120)
            reload.raise_for_status()
            after = served_figures(ask_all(url, check_prompts, args.max_tokens, 4, strict_head))
        finally:
            stop_server(proc)
        served = {"before": before, "after": after, "reload": reload.json()}
        timings["serve_check_s"] = round(time.perf_counter() - t0, 1)

    from bench.machine import describe, one_line, reproduce_command

    machine = describe()
    report = {
        "command": reproduce_command(["-m", "bench.traffic_finetune", *(argv or sys.argv[1:])]),
        "machine": one_line(machine),
        "note": "the machine may be shared with other work: timings are noisy, tokens per forward are not",
        "distribution": "customer support of a fictional outdoor-gear shop (bench/traffic_finetune.py)",
        "recording": {"served_with": "csd, combined (server default)", **recorded},
        "fine_tune": {k: tuned[k] for k in ("records", "positions", "steps", "before", "after", "seconds")},
        "served_held_out_prompts": served,
        "timings": timings,
    }
    (work / "report.json").write_text(json.dumps(report, indent=1))
    before, after = tuned["before"], tuned["after"]
    print(f"machine: {report['machine']} (possibly shared)")
    print(
        f"recorded {tuned['records']['usable']} generations; trained on {tuned['records']['train']}, "
        f"held out {tuned['records']['held_out']} ({before['positions']} positions)"
    )
    print(
        f"teacher-forced held out, before: accuracy {before['accuracy_per_step']}, "
        f"expected tokens/forward {before['expected_tokens_per_forward_k6']}"
    )
    print(
        f"teacher-forced held out, after:  accuracy {after['accuracy_per_step']}, "
        f"expected tokens/forward {after['expected_tokens_per_forward_k6']}"
    )
    if served:
        print(
            f"served sd/head on {len(check_prompts)} fresh prompts: tokens/forward "
            f"{served['before']['tokens_per_forward']} -> {served['after']['tokens_per_forward']}, acceptance "
            f"{served['before']['acceptance_rate']} -> {served['after']['acceptance_rate']}"
        )
    print(f"timings: {timings}; report: {work / 'report.json'}")  # fmt: skip
    return report


if __name__ == "__main__":
    main()
