"""Batched decoding for building training data: greedy answers and sampled user turns, by the serving engine.

The corpus is written by the same engine and executor that serve (`EngineCore`, vanilla decoding, up to
`ROWS` rows decoding together, each row leaving the batch at its own stop token and a queued prompt taking its
place), so its answers are exactly what the served target writes (the labels the draft head learns) and the
writer is as fast as serving is: the 4-bit GGUF executor's batched forward, not transformers' eager one.
Answers are the target's greedy choices (the regime acceptance is measured in); user turns are sampled at
temperature ~1 so the corpus is varied (Magpie, arXiv 2406.08464), each prompt from its own seed drawn from
the caller's generator, so a shard is reproducible. No hidden states are kept here: the corpus stores token
ids only, and `training.features` recomputes the states with teacher-forced forwards.
"""

from __future__ import annotations

import torch

from service.decoding.engine import Engine, EngineCore
from service.decoding.requests import EngineRequest, Failed, Finished
from service.decoding.types import SamplingParams, SpeculativeConfig
from service.executor.models import LoadedModel

# Rows decoding together. On one CPU thread a 4-bit forward of 32 rows costs ~5x one of 1 row (bench.forward),
# so throughput grows up to about here; more rows would only lengthen the attention over longer contexts.
ROWS = 32


@torch.inference_mode()
def decode_batch(
    target: LoadedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    rows: int = ROWS,
) -> list[tuple[list[int], bool]]:
    """Per prompt: (new tokens, ended with a stop token). The stop token ends the tokens when one did.

    Only `stop_ids` end a row (the model's own EOS is not implied: pass it), as the corpus's turns need."""
    sampled = temperature > 0
    seeds = (
        torch.randint(0, 2**62, (len(prompts),), generator=generator).tolist()
        if sampled
        else [None] * len(prompts)
    )
    core = EngineCore(Engine(target), max_batch_size=max(1, min(rows, len(prompts))), max_queue=len(prompts))
    vanilla = SpeculativeConfig(method="vanilla")
    for index, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        sampling = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature if sampled else 0.0,
            top_p=top_p if sampled else 1.0,
            seed=seed,
            ignore_eos=True,
            stop_token_ids=tuple(sorted(stop_ids)),
        )
        core.add(str(index), EngineRequest(list(prompt), sampling, vanilla, drafter="none"))
    out: list[tuple[list[int], bool] | None] = [None] * len(prompts)
    left = len(prompts)
    try:
        while left:
            for output in core.step().outputs:
                if isinstance(output, Failed):
                    raise RuntimeError(f"the engine failed prompt {output.request_id}: {output.message}")
                if isinstance(output, Finished):
                    generation = output.generation
                    assert generation is not None
                    tokens = [t.token_id for t in generation.tokens]
                    ended = generation.stop_token_id is not None
                    if ended:
                        tokens.append(generation.stop_token_id)
                    out[int(output.request_id)] = (tokens, ended)
                    left -= 1
    finally:
        core.close()
    return out  # type: ignore[return-value]
