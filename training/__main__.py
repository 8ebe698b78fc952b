"""`python -m training`: the whole drafter pipeline, one command, seeded; every stage resumes where it stopped.

1. corpus: the target writes user turns and answers them (training.magpie)     --corpus/corpus-NNNN.jsonl.gz
   token ids and texts only, one shard at a time: `--budget-minutes` spreads generation over several runs
2. features: teacher-forced target hidden states per shard (training.features)   work/features/NNNN.safetensors
3. train the draft head (training.train_head); its confidence is calibrated on,
   and its card predicts from, prompts people wrote (training.unseen)             work/head/
4. with --install: copy the head into the package, with its model card          --install-to

Installing is opt-in: a head trained on a small corpus can be worse than the shipped one, so compare first
(`python -m training.evaluate --head work/head --head service/decoding/draft_heads/...`), then install.

`--from-traffic DIR` fine-tunes the shipped head on recorded traffic instead (training.traffic).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path

from training import traffic, unseen

DEFAULT_WORK = Path("training/runs/smollm2-135m")
# The corpus is the expensive part (generation) and small as token ids: it is committed, so a later run
# resumes it where the last one stopped instead of writing it again.
DEFAULT_CORPUS = Path("training/corpus/smollm2-135m")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded", help="the target model spec (default: embedded)")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="work folder (resumable)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="corpus shards (committed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--shards",
        type=int,
        default=36,
        help="corpus shards to train on, written first where missing (192 conversations each; the first 36 "
        "rebuild the shipped head, more grow the corpus)",
    )
    parser.add_argument(
        "--budget-minutes", type=float, default=None, help="stop starting corpus shards after this long"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared 2-core machine a second thread waits for the other jobs)",
    )
    # one pass over the 1M-position corpus (the shipped head): 1.5x the steps of two over the 12-shard one
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (lower for a fine-tune)")
    parser.add_argument("--head-name", default=None, help="the head's folder in the work folder")
    parser.add_argument(
        "--fuse-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="EAGLE-3 style low+mid+final features, as the shipped head (--no-fuse-layers: the final state only)",
    )
    parser.add_argument(
        "--init-from", type=Path, default=None, help="start from this head (its weights and draft vocabulary)"
    )
    parser.add_argument(
        "--extend-vocab",
        type=int,
        default=0,
        help="with --init-from: add this many of the data's most frequent tokens to the head's draft vocabulary",
    )
    parser.add_argument(
        "--draft-vocab", type=int, default=8192, help="frequency-ranked draft vocabulary size"
    )
    # the head's shape and what it learns per example (ablations: each choice judged on unseen prompts by
    # training.evaluate, and priced by its draft time in bench)
    # (unset: TrainConfig's defaults, the shipped head's shape)
    parser.add_argument("--inner-size", type=int, default=None, help="width of the head's blocks")
    parser.add_argument("--blocks", type=int, default=None, help="residual blocks a drafted position")
    parser.add_argument("--unroll", type=int, default=None, help="drafted positions trained per example")
    parser.add_argument(
        "--install", action="store_true", help="copy the trained head over the shipped one (or --install-to)"
    )
    parser.add_argument(
        "--install-to",
        type=Path,
        default=None,
        help="with --install: copy the head here (default: the package's)",
    )
    parser.add_argument("--stop-after", choices=["corpus", "features", "train"], default=None)
    traffic.add_arguments(parser)  # --from-traffic DIR, --head, --holdout, --out
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.from_traffic is not None:
        traffic.main(args)
        return

    import torch

    from service.executor.models import load_model
    from training.features import shard_features
    from training.magpie import CorpusConfig, build_corpus, read_shard
    from training.overlap import bench_ngrams

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    work: Path = args.work
    timings: dict[str, float] = {}
    budget = None if args.budget_minutes is None else 60 * args.budget_minutes

    # Shard by shard: write the corpus shard, then its features, so a run stopped by its budget or by hand
    # leaves every finished shard usable. The served target writes the corpus through the serving engine
    # (training.sampling): its answers are the labels the head learns, exactly as serving writes them.
    target = load_model(args.model)
    banned = bench_ngrams()
    started = time.perf_counter()
    feature_files: list[Path] = []
    written: list[float] = []  # seconds each shard written by this run took
    for shard in range(args.shards):
        left = None if budget is None else budget - (time.perf_counter() - started)
        t0 = time.perf_counter()
        built = build_corpus(target, args.corpus, shard + 1, CorpusConfig(seed=args.seed), banned, left)
        spent = time.perf_counter() - t0
        timings["corpus_s"] = timings.get("corpus_s", 0.0) + spent
        if len(built) <= shard:
            break
        if spent > 1.0:  # written now, not found on disk: where the whole job stands
            written.append(spent)
            _progress(built, args.shards, written)
        if args.stop_after == "corpus":
            continue
        out = work / "features" / built[shard].name.replace(".jsonl.gz", ".safetensors")
        if not out.exists():
            t0 = time.perf_counter()
            shard_features(target, read_shard(built[shard]), out)
            timings["features_s"] = timings.get("features_s", 0.0) + time.perf_counter() - t0
        feature_files.append(out)
    if args.stop_after in ("corpus", "features"):
        return _save_timings(work, timings)

    from training.train_head import train

    head_dir = work / (args.head_name or ("head" if args.fuse_layers else "head-final-only"))
    if not (head_dir / "model.safetensors").exists():
        config = train_config(args)
        # the head's confidence is calibrated, and its card predicts, on prompts people wrote (training.unseen)
        calibration = {
            name: unseen.features(target, name, work / "unseen") for name in unseen.CALIBRATION_SETS
        }
        train(target, feature_files, head_dir, config, unseen=calibration)
    _save_timings(work, timings)
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR

    if args.stop_after == "train" or not args.install:
        print(
            f"trained {head_dir} (model card: {head_dir / 'README.md'}); compare it with the shipped head:\n"
            f"  python -m training.evaluate --head {head_dir} --head {EMBEDDED_HEAD_DIR}\n"
            "then install it with the same command and --install"
        )
        return
    destination = args.install_to or EMBEDDED_HEAD_DIR
    destination.mkdir(parents=True, exist_ok=True)
    for name in ("model.safetensors", "config.json", "README.md", "training.json"):
        shutil.copy2(head_dir / name, destination / name)
    print(f"installed the draft head in {destination}")


def train_config(args: argparse.Namespace):
    """The `TrainConfig` the command line asks for (the head's shape flags unset: the shipped head's)."""
    from training.train_head import TrainConfig

    shape = {
        field: value
        for field, value in (
            ("inner_size", args.inner_size),
            ("num_blocks", args.blocks),
            ("unroll", args.unroll),
        )
        if value is not None
    }
    return TrainConfig(
        seed=args.seed,
        epochs=args.epochs,
        lr=args.lr,
        draft_vocab=args.draft_vocab,
        fuse_layers=args.fuse_layers,
        init_from=args.init_from,
        extend_vocab=args.extend_vocab,
        **shape,
    )


def _progress(built: list[Path], shards: int, written: list[float]) -> None:
    """One line a written shard: shards and answer positions so far, and when the corpus will be complete at
    this run's pace (generation is hours for a large corpus; it resumes shard by shard)."""
    from training.magpie import shard_positions

    positions = sum(shard_positions(path) for path in built)
    pace = sum(written) / len(written)
    left = (shards - len(built)) * pace
    bar = "#" * (20 * len(built) // shards)
    print(
        f"corpus [{bar:<20}] {len(built)}/{shards} shards, {positions:,} positions, "
        f"{pace / 60:.1f} min a shard, ETA {left / 3600:.1f} h",
        flush=True,
    )


def _save_timings(work: Path, timings: dict[str, float]) -> None:
    work.mkdir(parents=True, exist_ok=True)
    (work / f"timings-{int(time.time())}.json").write_text(json.dumps(timings, indent=1))


if __name__ == "__main__":
    main()
