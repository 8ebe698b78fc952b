"""`python -m training.evaluate`: a draft head's teacher-forced figures on prompts no training corpus saw.

The benchmark's own evaluation prompts (training.unseen.EVALUATION_SETS; the corpus filter keeps every
training prompt 8-word-disjoint from them) are answered greedily by the target in the serving dtype (exactly
vanilla's output), their features computed as for training, and each head is scored with
`train_head.evaluate`: accuracy per drafted position and the tokens per target forward that serving with the
head's own stop rule would give. Timing-free, so it is a fair comparison of heads on a busy machine, and it
is the check of the model card's prediction (the card predicts from the other prompts in training.unseen).

    python -m training.evaluate --head service/decoding/draft_heads/smollm2-135m-instruct --head OTHER
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from training.unseen import EVALUATION_SETS

WORK = Path("training/runs/unseen")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--head", type=Path, action="append", required=True, help="a head folder (repeatable)"
    )
    parser.add_argument("--workloads", default=",".join(EVALUATION_SETS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="prompts per workload")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=WORK, help="cache of the answers and features")
    parser.add_argument(
        "--calibrate-on",
        type=Path,
        nargs="*",
        default=None,
        help="feature files the heads never trained on (e.g. corpus shards newer than the head): fit each head's "
        "confidence temperature on them, write it into the head's config.json, and report the head on them",
    )
    parser.add_argument(
        "--min-survival",
        type=float,
        action="append",
        default=None,
        help="score the stop rule at this threshold instead of the drafter's own (repeatable)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)

    from service.decoding.draft_head import RecurrentDraftHead
    from service.executor.models import load_model
    from training import unseen
    from training.train_head import TrainConfig, _positions, evaluate, load_data

    target = load_model("embedded")
    embed = target.model.get_input_embeddings().weight.detach().float()
    lm_head = target.model.get_output_embeddings().weight.detach().float()
    results: dict = {}
    if args.calibrate_on:
        from training.train_head import fit_confidence_temperature

        for folder in args.head:
            head = RecurrentDraftHead.load(folder).bind(embed, lm_head)
            data, spans = load_data(args.calibrate_on, fused=bool(head.config.feature_layers))
            starts = _positions(spans)
            starts = starts[torch.randperm(len(starts), generator=torch.Generator().manual_seed(0))[:16384]]
            fitted = fit_confidence_temperature(head, data, starts)
            config_file = folder / "config.json"
            saved = json.loads(config_file.read_text())
            saved["confidence_temperature"] = fitted["temperature"]
            config_file.write_text(json.dumps(saved, indent=1))
            head = RecurrentDraftHead.load(folder).bind(embed, lm_head)
            remap = torch.full((int(data.tokens.max()) + 1,), -100, dtype=torch.long)
            figures = evaluate(head, data, starts, remap, TrainConfig())
            results.setdefault(str(folder), {})["calibration"] = {**fitted, **figures}
            print(
                f"calibrated {str(folder):60s} {json.dumps(results[str(folder)]['calibration'])}", flush=True
            )
    for workload in args.workloads.split(","):
        features = unseen.features(target, workload, args.work, args.max_tokens, args.limit)
        for folder in args.head:
            head = RecurrentDraftHead.load(folder).bind(embed, lm_head)
            data, spans = load_data([features], fused=bool(head.config.feature_layers))
            remap = torch.full((int(data.tokens.max()) + 1,), -100, dtype=torch.long)
            for threshold in args.min_survival or [None]:
                figures = evaluate(
                    head, data, _positions(spans), remap, TrainConfig(), min_survival=threshold
                )
                name = workload if threshold is None else f"{workload}@{threshold:g}"
                results.setdefault(str(folder), {})[name] = figures
                print(f"{name:9s} {str(folder):60s} {json.dumps(figures)}", flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
