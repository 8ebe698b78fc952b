"""Structured output: a grammar engine constrains every position a round verifies, drafts included.

The engine is llguidance (Microsoft's Rust grammar engine: JSON Schema, regular expressions and Lark
grammars). Chosen over xgrammar by `python -m bench.grammar_engines` on the served tokenizer (docs/openai-api.md,
"Structured output"): both compute a next-token mask in microseconds (<0.1 % of a target forward), but
llguidance compiles a schema ~5x faster (0.5 vs 2.7 ms, paid per request), takes regex and Lark grammars
natively, and brings no dependencies, where xgrammar pulls triton and a TVM runtime.

How it meets speculation (per sequence, per round):
1. before the forward, `check_draft` walks the matcher through the draft: the mask of every position is
   computed on the way, the draft is cut at the first token the grammar forbids (verifying it would be
   wasted width: it is rejected anyway), and the matcher rolls back to the committed tokens;
2. tokens the grammar forces (`forced_tokens`: after `{"name": ` a schema may allow only one
   continuation) are drafted for free (jump-forward) and verified like any draft, so strict decoding stays
   lossless: the target still chooses, the grammar only proposes;
3. verification sees the masked logits: a forbidden token can be neither accepted nor rescued (its logit is
   -inf, so CSD's semantic gate fails), and the recovered / bonus token always satisfies the grammar;
4. after the round, `commit` feeds the emitted tokens to the matcher.
Between rounds the matcher holds exactly the committed output, as the KV cache does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance
import llguidance.hf
import llguidance.torch as lltorch
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark
from transformers import PreTrainedTokenizerBase

from service.decoding.types import Constraint, ConstraintKind, DecodingError

if TYPE_CHECKING:
    from service.executor.models import LoadedModel

# Compact JSON with json.dumps' separators: what small models write most readily, and no room for runaway
# whitespace (the default "flexible" whitespace lets a weak model emit newlines until max_tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_source(constraint: Constraint) -> str:
    """The llguidance grammar for a constraint; raises DecodingError for malformed values."""
    kind, value = constraint.kind, constraint.value
    try:
        if kind is ConstraintKind.JSON_OBJECT:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind is ConstraintKind.JSON_SCHEMA:
            if not isinstance(value, dict):
                raise DecodingError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(value), defaults=JSON_OPTIONS)
        if kind is ConstraintKind.REGEX:
            if not isinstance(value, str) or not value:
                raise DecodingError("a regex constraint must be a non-empty string")
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind is ConstraintKind.CHOICE:
            if not value or not all(isinstance(c, str) and c for c in value):  # type: ignore[union-attr]
                raise DecodingError("a choice constraint must be a list of non-empty strings")
            # Lark string literals take JSON's escapes, so any text is one literal.
            alternatives = " | ".join(json.dumps(c) for c in value)  # type: ignore[union-attr]
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if kind is ConstraintKind.GRAMMAR:
            if not isinstance(value, str) or not value.strip():
                raise DecodingError("a grammar constraint must be a non-empty Lark grammar")
            if "::=" in value:  # GBNF (llama.cpp's, and vLLM's xgrammar backend's): convert to Lark
                value = gbnf_to_lark(value)
            return llguidance.LLMatcher.grammar_from_lark(value)
    except (ValueError, GbnfToLarkError) as exc:
        raise DecodingError(f"invalid {kind.value} constraint: {exc}") from None
    raise DecodingError(f"unknown constraint kind {kind!r}")


def closed_objects(schema: object) -> object:
    """The schema with `additionalProperties: false` on every object that lists its properties and says
    nothing about others. JSON Schema's default admits any extra key, and a small model given that freedom
    invents keys until max_tokens (seen: pydantic models, which never say it, through instructor). vLLM's
    default backend (xgrammar's strict mode) closes objects the same way; OpenAI's strict mode requires it."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed_objects(value) for key, value in schema.items()}
    if (
        isinstance(out.get("properties"), dict)
        and "additionalProperties" not in out
        and "patternProperties" not in out
        and "unevaluatedProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


def model_grammar(target: LoadedModel) -> GrammarCompiler:
    """The grammar engine's view of a loaded model's tokenizer, built once and kept with the model."""
    return target.memo(
        "grammar",
        lambda: GrammarCompiler(target.tokenizer, target.vocab_size, sorted(target.eos_token_ids())),
    )


class GrammarCompiler:
    """The grammar engine's view of one tokenizer (built once per model: ~0.2 s for a 49k vocabulary)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, eos_ids: Sequence[int]) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise DecodingError("structured output needs a fast (Rust) tokenizer; this model has a slow one")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None
        )

    def check(self, constraint: Constraint) -> None:
        """Raise DecodingError (worded for the user) if the constraint does not compile."""
        source = grammar_source(constraint)
        error = llguidance.LLMatcher.validate_grammar(source, self.tokenizer)
        if error and not error.startswith("WARNING"):
            raise DecodingError(f"invalid {constraint.kind.value} constraint: {error}")

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        return GrammarMatcher(self, grammar_source(constraint))


class GrammarMatcher:
    """One sequence's grammar state: the committed output so far, as the KV cache holds it."""

    def __init__(self, compiler: GrammarCompiler, source: str) -> None:
        self.vocab_size = compiler.vocab_size
        self._matcher = llguidance.LLMatcher(compiler.tokenizer, source, log_level=0)
        if self._matcher.is_error():
            raise DecodingError(f"invalid constraint: {self._matcher.get_error()}")
        self.seconds = 0.0  # time spent in the grammar engine (masks, draft checks, commits)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (the sequence can end without an EOS token)."""
        return self._matcher.is_stopped()

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (jump-forward): free draft tokens."""
        if limit <= 0:
            return []
        started = time.perf_counter()
        try:
            return list(self._matcher.compute_ff_tokens())[:limit]
        finally:
            self.seconds += time.perf_counter() - started

    def check_draft(self, draft: Sequence[int]) -> tuple[int, torch.Tensor]:
        """(how many draft tokens the grammar allows in a row, allowed-token masks [that + 1, V] bool).

        Mask row i is for the position after `draft[:i]`; the matcher ends where it started."""
        started = time.perf_counter()
        bitmask = lltorch.allocate_token_bitmask(len(draft) + 1, self.vocab_size)
        valid = 0
        for i, token in enumerate(draft):
            lltorch.fill_next_token_bitmask(self._matcher, bitmask, i)
            if not _allowed(bitmask[i], token) or not self._matcher.consume_token(token):
                break
            valid += 1
        else:
            lltorch.fill_next_token_bitmask(self._matcher, bitmask, len(draft))
        if valid:
            self._matcher.rollback(valid)
        masks = unpack_bitmask(bitmask[: valid + 1], self.vocab_size)
        self.seconds += time.perf_counter() - started
        return valid, masks

    def commit(self, token: int) -> None:
        """The sequence kept `token` (verification only keeps allowed tokens)."""
        started = time.perf_counter()
        ok = self._matcher.consume_token(token)
        self.seconds += time.perf_counter() - started
        if not ok:  # a broken invariant, not a user error: say so loudly
            raise RuntimeError(f"the grammar refused committed token {token}: {self._matcher.get_error()}")


def _allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[n, ceil(V / 32)] int32 bitmask -> [n, V] bool (llguidance's own helper needs torch.compile)."""
    bits = (bitmask.unsqueeze(-1) >> _BITS) & 1  # [n, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
