"""`python -m training`: the whole drafter pipeline, one command, seeded; each stage is skipped when its output
exists in the work folder (so an interrupted run resumes).

1. open prompts (training.prompts) -> the target's answers + hidden states      work/open-NNN.safetensors
   (shards of --shard-size prompts: the first N prompts of a larger corpus are the same prompts)
2. grounded prompts over shard 0's answers -> answers + hidden states            work/grounded.safetensors
3. train the recurrent draft head (training.train_head)                          work/head/
4. copy the head into the package, with its model card                           --install-to

The defaults reproduce the shipped head (service/decoding/draft_heads/); README says how long each stage
took and what it measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import time
from pathlib import Path

DEFAULT_WORK = Path("training/runs/smollm2-135m")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="the target model spec (default: embedded)")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="work folder (resumable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--open-prompts", type=int, default=2600)
    parser.add_argument("--shard-size", type=int, default=1300, help="open prompts per data file")
    parser.add_argument("--grounded-prompts", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--batch-size", type=int, default=48)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch threads (default 2: this machine's cores)"
    )
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument(
        "--draft-vocab", type=int, default=8192, help="frequency-ranked draft vocabulary size"
    )
    parser.add_argument(
        "--install-to", type=Path, default=None, help="copy the trained head here (default: the package's)"
    )
    parser.add_argument("--stop-after", choices=["data", "train"], default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import torch

    from service.decoding.models import load_model
    from training.distill import distill
    from training.prompts import bench_ngrams, grounded_prompts, open_prompts, overlaps

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    target = load_model(args.model)
    timings: dict[str, float] = {}

    corpus = open_prompts(args.open_prompts, seed=args.seed, banned=bench_ngrams())
    open_files = []
    for shard, first in enumerate(range(0, len(corpus), args.shard_size)):
        open_file = work / f"open-{shard:03d}.safetensors"
        open_files.append(open_file)
        if not open_file.exists():
            started = time.perf_counter()
            items = corpus[first : first + args.shard_size]
            distill(target, items, open_file, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens)
            timings[f"distill_open_{shard}_s"] = time.perf_counter() - started
    open_file = open_files[0]

    grounded_file = work / "grounded.safetensors"
    if not grounded_file.exists():
        started = time.perf_counter()
        answered = [json.loads(line) for line in open_file.with_suffix(".jsonl").read_text().splitlines()]
        # passages: the target's longer answers to explanatory prompts (whole answers, about 60-160 tokens)
        pool = [a for a in answered if a["kind"] in ("explain", "howto", "compare", "opinion")]
        pool = [a for a in pool if len(a["answer"].split()) >= 40]
        rng = random.Random(args.seed)
        rng.shuffle(pool)
        passages = [(a["prompt"], a["answer"].strip()) for a in pool[: args.grounded_prompts]]
        items = grounded_prompts(passages, seed=args.seed)
        banned = bench_ngrams()
        items = [i for i in items if not overlaps(i["prompt"], banned)]
        distill(target, items, grounded_file, batch_size=args.batch_size // 2, max_new_tokens=128)
        timings["distill_grounded_s"] = time.perf_counter() - started
    if timings:
        (work / f"timings-data-{int(time.time())}.json").write_text(json.dumps(timings, indent=1))
    if args.stop_after == "data":
        return

    from training.train_head import TrainConfig, train

    head_dir = work / "head"
    if not (head_dir / "model.safetensors").exists():
        config = TrainConfig(seed=args.seed, epochs=args.epochs, draft_vocab=args.draft_vocab)
        train(target, [*open_files, grounded_file], head_dir, config)
    if args.stop_after == "train":
        return
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR

    destination = args.install_to or EMBEDDED_HEAD_DIR
    destination.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json", "README.md", "training.json"):
        shutil.copy2(head_dir / name, destination / name)
    print(f"installed the draft head in {destination}")


if __name__ == "__main__":
    main()
