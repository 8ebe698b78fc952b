"""Offline calibration of the Online Correction Memory: the CSD paper's first phase (arXiv 2604.13634).

Strict speculative decoding runs over unlabeled in-domain prompts with `record_strict=True`, so every rejection's
divergence pattern (draft token, target top token) is counted in the engine's memory while the output stays the
target's own. `csd calibrate` and the benchmarks both warm the memory through `calibrate()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from service.decoding.engine import Engine, run_alone
from service.decoding.text import encode_chat, encode_prompt
from service.decoding.types import Method, SamplingParams, SpeculativeConfig


@dataclass
class CalibrationResult:
    prompts: int = 0
    divergences: int = 0  # rejections recorded (one per round that ended in a recovered token)
    completion_tokens: int = 0


def encode_item(tokenizer: PreTrainedTokenizerBase, item: Mapping) -> list[int]:
    """A prompt-file item -> token ids: "messages" (chat), "prompt" (one chat user message) or "text" (raw)."""
    if "messages" in item:
        return encode_chat(tokenizer, item["messages"])
    if "prompt" in item:
        return encode_chat(tokenizer, [{"role": "user", "content": item["prompt"]}])
    return encode_prompt(tokenizer, item["text"])


def calibrate(
    engine: Engine,
    items: Iterable[Mapping],
    *,
    drafter: str = "ngram",
    num_speculative_tokens: int = 6,
    max_tokens: int = 128,
    on_prompt: Callable[[CalibrationResult], None] | None = None,
) -> CalibrationResult:
    """Run strict SD over `items`, recording every divergence pattern in the engine's memory for `drafter`.

    `on_prompt` is called after each prompt with the running totals (progress display).
    """
    spec = SpeculativeConfig(method=Method.SD, num_speculative_tokens=num_speculative_tokens)
    sampling = SamplingParams(max_tokens=max_tokens)
    result = CalibrationResult()
    for item in items:
        generation = engine.generate(
            encode_item(engine.target.tokenizer, item), sampling, spec, drafter=drafter, record_strict=True
        )
        for _ in run_alone(generation):
            pass
        result.prompts += 1
        result.divergences += generation.stats.num_rejections_seen  # each one recorded, emitted or not
        result.completion_tokens += generation.stats.completion_tokens
        if on_prompt is not None:
            on_prompt(result)
    return result
