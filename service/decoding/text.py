"""Prompts in, text out: chat templates, incremental detokenisation and stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from service.decoding.types import DecodingError


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    if not prompt:
        raise DecodingError("prompt must not be empty")
    return list(tokenizer(prompt)["input_ids"])


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    *,
    tools: Sequence[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """messages: [{"role": ..., "content": ...}] through the tokenizer's chat template. `tools`: function
    definitions for templates that render them (OpenAI's {"type": "function", "function": {...}} shape)."""
    if not messages:
        raise DecodingError("messages must not be empty")
    if tokenizer.chat_template is None:
        raise DecodingError("this model has no chat template; use a plain completion prompt")
    ids = tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=True,
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)


class IncrementalDetokenizer:
    """Turns token ids into text deltas as they come.

    Decodes a short window (a few tokens before the new ones) and emits only what the window adds, so
    byte-level pieces of one character are held back until complete (no U+FFFD in the stream) and
    tokenizers that drop a leading space at the start of a decode still get it right.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_ids[-5:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        text = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return text[len(prefix) :]
        return ""


class StopMatcher:
    """Finds stop strings in the streamed text, holding back a tail that could be the start of one."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """-> (text safe to emit now, stopped?)."""
        if not self.stop:
            return delta, False
        self.pending += delta
        # The stop string that *completes* first wins (ties: the longer one), wherever it starts: the same
        # answer whether the text arrives a character or a paragraph at a time.
        hits = [(i + len(s), i) for s in self.stop if (i := self.pending.find(s)) >= 0]
        if hits:
            cut = min(hits)[1]
            out, self.pending = self.pending[:cut], ""
            return out, True
        if self.hold == 0:
            out, self.pending = self.pending, ""
        else:
            out, self.pending = self.pending[: -self.hold], self.pending[-self.hold :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character -> byte (the mapping `tokenizers`' ByteLevel uses)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(tokenizer: PreTrainedTokenizerBase, ids: Sequence[int]) -> dict[int, bytes]:
    """Each token's own bytes (what OpenAI's logprobs `bytes` holds): for a byte-level BPE vocabulary the
    token's raw bytes, so that pieces of one UTF-8 character (an emoji split over two tokens) join back into
    it; otherwise its decoded text in UTF-8."""
    ids = list(ids)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
    special = set(getattr(tokenizer, "all_special_ids", ()))
    out: dict[int, bytes] = {}
    for token, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True):
        if byte_level and token not in special and piece is not None and all(c in _BYTE_LEVEL for c in piece):
            out[token] = bytes(_BYTE_LEVEL[c] for c in piece)
        else:
            out[token] = tokenizer.decode([token]).encode("utf-8")
    return out
