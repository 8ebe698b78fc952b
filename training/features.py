"""Teacher-forced target features for a corpus shard: what the draft head starts from and is trained against.

The corpus stores token ids only (`training.magpie`); one batched forward per group of records recomputes,
at every answer position, the target's hidden states in the dtype the service runs it in (fp32 on a CPU),
so the head is trained on exactly the states serving hands it. A forward over a whole sequence is 3-4x
cheaper per token than generating it on this CPU (measured: ~500 vs ~130-190 tokens/s at 2 threads, fp32).

Per record (prompt ids P, answer ids A, `<|im_end|>` included when the answer ended), with H[q] the state
after consuming token q of P + A:
- `tokens[i]`: the prompt's last token, then each answer token (A + 1 tokens);
- `hidden[i]` = H[len(P) - 2 + i]: the final hidden state (the LM head's input) whose logits chose
  `tokens[i]`, i.e. what the engine hands the drafter at the start of a round; the label of pair i is
  `tokens[i + 1]`;
- `hidden_low[i]`, `hidden_mid[i]`: the outputs of two earlier decoder layers at the same position (EAGLE-3's
  low- and mid-level features, arXiv 2503.01840), for heads that fuse them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from service.executor.models import LoadedModel

log = logging.getLogger(__name__)


def feature_layers(num_layers: int) -> tuple[int, int]:
    """The low and mid decoder layers whose outputs a fused head reads (0-based), as EAGLE-3 picks them."""
    return 2, num_layers // 2 - 1


@torch.inference_mode()
def shard_features(target: LoadedModel, records: list[dict], out_file: Path, *, batch_size: int = 16) -> int:
    """Write `out_file` (safetensors: tokens, hidden, hidden_low, hidden_mid, offsets); -> positions."""
    base = target.model.get_decoder()
    low, mid = feature_layers(len(base.layers))
    captured: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(module, args, output):
            captured[name] = output[0] if isinstance(output, tuple) else output

        return hook

    hooks = [
        base.layers[low].register_forward_hook(keep("low")),
        base.layers[mid].register_forward_hook(keep("mid")),
        base.norm.register_forward_hook(keep("final")),
    ]
    order = sorted(
        range(len(records)), key=lambda i: len(records[i]["prompt_ids"]) + len(records[i]["answer_ids"])
    )
    rows: dict[int, tuple[torch.Tensor, ...]] = {}
    started = time.perf_counter()
    try:
        for first in range(0, len(order), batch_size):
            batch = [records[i] for i in order[first : first + batch_size]]
            seqs = [r["prompt_ids"] + r["answer_ids"] for r in batch]
            width = max(len(s) for s in seqs)
            ids = torch.zeros((len(seqs), width), dtype=torch.long)
            mask = torch.zeros((len(seqs), width), dtype=torch.long)
            for b, s in enumerate(seqs):  # right padding: positions start at 0 in every row
                ids[b, : len(s)] = torch.tensor(s)
                mask[b, : len(s)] = 1
            base(input_ids=ids.to(target.device), attention_mask=mask.to(target.device), use_cache=False)
            for b, record in enumerate(batch):
                first_pos = len(record["prompt_ids"]) - 2
                span = slice(first_pos, first_pos + len(record["answer_ids"]) + 1)
                tokens = torch.tensor([record["prompt_ids"][-1], *record["answer_ids"]], dtype=torch.int32)
                feats = [captured[k][b, span].to(torch.bfloat16).cpu() for k in ("final", "low", "mid")]
                rows[order[first + b]] = (tokens, *feats)
    finally:
        for hook in hooks:
            hook.remove()
    ordered = [rows[i] for i in range(len(records))]
    offsets = [0]
    for row in ordered:
        offsets.append(offsets[-1] + len(row[0]))
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_suffix(".tmp")
    save_file(
        {
            "tokens": torch.cat([r[0] for r in ordered]),
            "hidden": torch.cat([r[1] for r in ordered]),
            "hidden_low": torch.cat([r[2] for r in ordered]),
            "hidden_mid": torch.cat([r[3] for r in ordered]),
            "offsets": torch.tensor(offsets, dtype=torch.int64),
        },
        str(tmp),
    )
    tmp.replace(out_file)
    log.info(
        "features of %d records, %d positions in %.0f s",
        len(records),
        offsets[-1],
        time.perf_counter() - started,
    )
    return offsets[-1]
