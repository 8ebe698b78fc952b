"""`python -m training.exit`: train the early-exit draft model's exit (`service.executor.early_exit`).

The draft model is the target's first `--layers` decoder layers; the exit maps layer N's residual stream h to
norm(h + A h), read by the target's own LM head. Only A (d x d, zero at the start: plain early exit) and the
final norm's scale are trained, on the corpus the target wrote (training.magpie), teacher-forced: the
states are layer N's outputs over prompt + answer, the labels the target's own answer tokens, the loss cross-
entropy through the target's frozen LM head. The states are computed once by the truncated model itself (so
they are what serving's draft forward computes) and kept in memory.

Judged on prompts people wrote (training.unseen's calibration sets, answered greedily by the full target):
top-1 agreement of the exit with the target, untrained and trained, written to the model card with the
command that reproduces it.

    python -m training.exit --layers 15 --shards 17 --threads 1 --install
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_WORK = Path("training/runs/smollm2-135m-exit")


def main(argv: list[str] | None = None) -> None:
    from training.__main__ import DEFAULT_CORPUS

    parser = argparse.ArgumentParser(prog="python -m training.exit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded", help="the target model spec (default: embedded)")
    parser.add_argument("--layers", type=int, default=15, help="decoder layers the draft model keeps")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("--shards", type=int, default=17, help="corpus shards to train on (the first N)")
    parser.add_argument("--max-positions", type=int, default=None, help="stop reading shards after this many")
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=1024, help="positions a step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--install", action="store_true", help="copy the exit into the package")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import torch

    from service.executor.early_exit import final_rms_norm, save_exit
    from service.executor.models import load_model
    from service.executor.paths import EMBEDDED_EXIT_DIR
    from training.magpie import read_shard, shard_path
    from training.unseen import CALIBRATION_SETS, KINDS, answers

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    records: list[dict] = []
    for shard in range(args.shards):
        records += read_shard(shard_path(args.corpus, shard))
        if args.max_positions and sum(len(r["answer_ids"]) for r in records) >= args.max_positions:
            break
    cut = load_model(args.model, layers=args.layers)
    train_h, train_y = exit_states(cut.model, records)
    log.info("%d training positions from %d answers in %.0f s", len(train_y), len(records), _since(started))
    # held out: prompts people wrote, answered by the whole target (what the draft model must agree with)
    target = load_model(args.model)
    held_out = {name: exit_states(cut.model, answers(target, name, 128)) for name in CALIBRATION_SETS}
    depth = int(target.model.config.num_hidden_layers)
    del target
    norm = final_rms_norm(cut.model)
    exit_ = Exit(norm.weight.detach().float(), norm.variance_epsilon, cut.model.get_output_embeddings())
    before = {name: exit_.agreement(*data) for name, data in held_out.items()}
    t0 = time.perf_counter()
    losses = exit_.fit(train_h, train_y, args.epochs, args.lr, args.batch, args.seed)
    train_s = time.perf_counter() - t0
    after = {name: exit_.agreement(*data) for name, data in held_out.items()}
    for name in held_out:
        log.info("%s: top-1 agreement %.3f untrained, %.3f trained", name, before[name], after[name])
    folder = args.work / f"exit{args.layers}"
    save_exit(folder, args.model, args.layers, exit_.adapter, exit_.scale)
    report = {
        "model": args.model,
        "layers": args.layers,
        "of_layers": depth,
        "hidden": int(exit_.scale.shape[0]),
        "answers": len(records),
        "positions": len(train_y),
        "epochs": args.epochs,
        "lr": args.lr,
        "batch": args.batch,
        "seed": args.seed,
        "threads": args.threads,
        "train_seconds": round(train_s, 1),
        "final_loss": round(losses[-1], 4),
        "held_out": {
            name: {
                "kind": KINDS[name],
                "positions": len(held_out[name][1]),
                "untrained": b,
                "trained": after[name],
            }
            for name, b in before.items()
        },
        "command": "python -m training.exit " + " ".join(argv if argv is not None else _argv()),
    }
    (folder / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    (folder / "README.md").write_text(model_card(report))
    print(json.dumps(report["held_out"], indent=2))
    if args.install:
        import shutil

        EMBEDDED_EXIT_DIR.mkdir(parents=True, exist_ok=True)
        for name in ("exit.json", "exit.safetensors", "README.md", "training.json"):
            shutil.copy2(folder / name, EMBEDDED_EXIT_DIR / name)
        print(f"installed the exit in {EMBEDDED_EXIT_DIR}")


class Exit:
    """The trainable exit: logits = head(rmsnorm(h + h A) * scale), the head frozen."""

    def __init__(self, scale, eps: float, head) -> None:
        import torch

        self.adapter = torch.zeros(scale.shape[0], scale.shape[0], requires_grad=True)
        self.scale = scale.clone().requires_grad_(True)
        self.eps = eps
        # the LM head's rows in fp32 (an 8-bit head keeps the model's own weight beside its blocks)
        self.vocab = head.weight.detach().float()

    def logits(self, hidden):
        import torch

        x = hidden + hidden @ self.adapter
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale
        return x @ self.vocab.T

    def fit(self, hidden, labels, epochs: float, lr: float, batch: int, seed: int) -> list[float]:
        import torch

        generator = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam([self.adapter, self.scale], lr=lr)
        steps = max(1, int(epochs * len(labels) / batch))
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
        losses: list[float] = []
        order = torch.randperm(len(labels), generator=generator)
        at = 0
        for step in range(steps):
            if at + batch > len(order):
                order, at = torch.randperm(len(labels), generator=generator), 0
            pick = order[at : at + batch]
            at += batch
            loss = torch.nn.functional.cross_entropy(self.logits(hidden[pick]), labels[pick])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss))
            if step % 50 == 0 or step == steps - 1:
                log.info("step %d/%d loss %.4f", step + 1, steps, sum(losses[-50:]) / len(losses[-50:]))
        return losses

    def agreement(self, hidden, labels) -> float:
        import torch

        with torch.no_grad():
            hits = sum(
                int((self.logits(hidden[i : i + 4096]).argmax(-1) == labels[i : i + 4096]).sum())
                for i in range(0, len(labels), 4096)
            )
        return round(hits / max(1, len(labels)), 4)


def exit_states(model, records: list[dict]):
    """Layer N's outputs (the cut model's last layer) at every answer position, teacher-forced, and the
    target's token there: ([P, d] float32, [P] long)."""
    import torch

    decoder = model.get_decoder()
    captured = {}
    hook = decoder.layers[-1].register_forward_hook(
        lambda module, args, output: captured.__setitem__(
            "h", output[0] if isinstance(output, tuple) else output
        )
    )
    states, labels = [], []
    try:
        with torch.inference_mode():
            for record in records:
                ids = record["prompt_ids"] + record["answer_ids"]
                decoder(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
                span = slice(len(record["prompt_ids"]) - 1, len(ids) - 1)
                states.append(captured["h"][0, span].float().cpu())
                labels.append(torch.tensor(record["answer_ids"], dtype=torch.long))
    finally:
        hook.remove()
    return torch.cat(states).clone(), torch.cat(labels)


def model_card(report: dict) -> str:
    held = "\n".join(
        f"  - {v['kind']} (`bench/data/{name}.jsonl`, {v['positions']} positions): **{v['trained']:.1%}** "
        f"(untrained early exit: {v['untrained']:.1%})"
        for name, v in report["held_out"].items()
    )
    hidden = report["hidden"]
    return f"""# Early-exit draft model for `{report["model"]}`

A draft model for speculative decoding with the target `{report["model"]}` (`embedded`: SmolLM2-135M-Instruct,
served by `--drafter model --draft-model embedded-exit`): the target's own first {report["layers"]} of
{report["of_layers"]} decoder layers, a trained exit (`service/executor/early_exit.py`: norm(h + A h), A {hidden} x
{hidden}, and the final norm's scale), the target's LM head. Nothing to download: the layers come from the
target's own weights; this folder holds the exit only ({4 * hidden * (hidden + 1) / 1e6:.1f} MB).

- Data: the target's greedy answers in the project's corpus (`training/corpus`, `training/magpie.py`),
  teacher-forced: {report["answers"]} answers, {report["positions"]} positions. Labels: the target's own tokens.
- Training: Adam, one-cycle lr {report["lr"]}, {report["epochs"]} epochs of {report["batch"]} positions a step,
  seed {report["seed"]}, {report["train_seconds"]} s on {report["threads"]} CPU thread(s); final loss {report["final_loss"]}.
- Top-1 agreement with the target (greedy) on prompts people wrote, which the corpus never saw:
{held}
- Reproduce: `{report["command"]}`

Its divergences from the target are systematic (what {report["layers"]} layers and a linear exit cannot recover
of the rest): the recurring (draft, target) pairs CSD's correction memory counts. Licence: Apache-2.0 (the
target, SmolLM2, is Apache-2.0; the corpus is its output).
"""


def _since(t0: float) -> float:
    return time.perf_counter() - t0


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


if __name__ == "__main__":
    main()
