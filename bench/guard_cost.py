"""What CSD's rescue guards cost on the hot path: building the per-token flags once, and one decision.

`python -m bench.guard_cost` (1 torch thread; the figures are per call, so a loaded machine inflates them).
"""

from __future__ import annotations

import os
import time


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from service.decoding import load_model
    from service.decoding.fact_guard import fact_refusal, model_special_ids, token_classes
    from service.decoding.verification import turn_guard

    torch.set_num_threads(1)
    target = load_model("embedded")
    tok = target.tokenizer
    started = time.perf_counter()
    classes = token_classes(tok, target.vocab_size, sorted(target.eos_token_ids()))
    build = time.perf_counter() - started
    before = tok.encode("The talk is in room 2 on a Saturday with Eve Cur", add_special_tokens=False)
    pairs = [
        (tok.convert_tokens_to_ids(","), tok.convert_tokens_to_ids(".")),
        (tok.encode(" colour")[-1], tok.encode(" color")[-1]),
        (tok.convert_tokens_to_ids("ry"), tok.convert_tokens_to_ids("ie")),
    ]
    turn = turn_guard(model_special_ids(target))
    n = 200_000
    started = time.perf_counter()
    for i in range(n):
        draft, top = pairs[i % 3]
        context = before[: 5 + i % 8]
        turn(context, draft, top)
        fact_refusal(classes, context, draft, top)
    per_call = (time.perf_counter() - started) / n
    print(
        f"token_classes: {build:.2f} s for {len(classes.flags)} tokens ({len(classes.fact_ids)} fact tokens, "
        f"{len(classes.special_ids)} special); both guards: {per_call * 1e6:.2f} us per rescue decision"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
