"""A training corpus that looks like traffic: the target writes its own user turns (Magpie, arXiv 2406.08464).

An aligned chat model given only its chat template up to the start of a user message samples a plausible
user message; it then answers it. The distribution of those turns is the model's own idea of its traffic,
far wider than any list of templates (the first corpus was templates and topic lists, and the head trained
on it did not hold up on prompts it had never seen). Six kinds of conversation, mixed by `KIND_WEIGHTS`:

- `open`: the template's default system prompt, a sampled user turn (sometimes started with an opener such
  as "Write" or "How do I", so the sampler does not collapse onto its favourite question);
- `system`: the same under one of the operator-style system prompts below;
- `multi`: an `open` or `system` conversation continued by a second sampled user turn and answer;
- `grounded`: a passage and an instruction on it (summarise, answer from it, rewrite, extract): the passage
  is either sampled by the target after the instruction or one of the corpus's own earlier answers;
- `tools`: tool definitions rendered as the service renders them, a user request that may need one, and the
  target's answer (a tool call or text);
- `code`: a programming request, its user turn started with one of `CODE_OPENERS` (write, fix, explain,
  test, in several languages), sometimes under the programmer system prompt (shards 17 on).

Every user turn is filtered (ended by the model within the length bound, mostly printable ASCII, no
degenerate repetition, no opening already in this or an earlier shard, no 8-word sequence shared with any
`bench/` prompt). What is
stored is token ids and texts, compactly (`*.jsonl.gz` shards, one record per answer: the exact prompt ids
the target answered from and its answer ids, `<|im_end|>` included), so generation can be spread over
several runs and resumed shard by shard, and training recomputes hidden states teacher-forced.

Licence: the corpus is the target's own output (SmolLM2, Apache-2.0) plus the lists below, written for this
project (Apache-2.0); no third-party data.
"""

from __future__ import annotations

import functools
import gzip
import json
import logging
import random
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from service.decoding.text import encode_chat
from service.executor.models import LoadedModel
from training.overlap import overlaps
from training.sampling import decode_batch

log = logging.getLogger(__name__)

KIND_WEIGHTS = {"open": 0.32, "system": 0.12, "multi": 0.2, "grounded": 0.2, "tools": 0.08, "code": 0.08}

CODE_SYSTEM_PROMPT = "You are an expert Python programmer. Give working code with short explanations."

# How a `code` conversation's user turn starts; the target samples the rest (the request, or code to work on)
CODE_OPENERS = [
    "Write a Python function that",
    "Write a Python script that",
    "Write a JavaScript function that",
    "Write a SQL query that",
    "Write a bash command that",
    "Fix this Python code:\n```python\n",
    "What does this code do?\n```python\n",
    "Why does this code raise an error?\n```python\n",
    "Write unit tests for this function:\n```python\n",
    "Refactor this code to be more readable:\n```python\n",
    "How do I read a file in",
    "Explain the difference between",
    "Write a regular expression that",
    "Convert this loop to a list comprehension:\n```python\n",
]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer in as few words as possible.",
    "You are a friendly customer support agent for an online shop that sells kitchen appliances.",
    "You are an expert Python programmer. Give working code with short explanations.",
    "You are a patient tutor for high-school students. Explain step by step.",
    "You are a travel planner. Suggest practical itineraries.",
    "You are a writing assistant that helps people improve their emails and essays.",
    "You answer questions about personal finance in plain language. You are not a licensed adviser.",
    "You are a cooking assistant. Give recipes with ingredient lists and numbered steps.",
    "You are a fitness coach who writes safe, simple workout plans.",
    "You are a support bot for a software company. Ask for details when a problem is unclear.",
    "Always answer in valid JSON.",
    "You are a helpful assistant. Format your answers in Markdown with headings and bullet lists.",
    "You are a historian who explains events with their causes and consequences.",
    "You are a science communicator for children aged 8 to 12.",
    "You are a careful assistant. If you are not sure about something, say so.",
    "You are an assistant for a small law firm. Summarise documents clearly and neutrally.",
    "You are a product manager who writes clear user stories and acceptance criteria.",
    "You are a data analyst. Explain results and suggest charts.",
    "You are a gardening expert who gives seasonal advice.",
    "You are a SQL expert. Answer with queries and a short explanation.",
    "You are a movie and book recommendation assistant.",
    "You are an English teacher. Correct grammar and explain the corrections.",
    "You are a helpful assistant for a city's public library.",
]

OPENERS = [
    "How do I",
    "Write",
    "Can you",
    "What is",
    "Explain",
    "Why",
    "Give me",
    "I need",
    "Help me",
    "Create",
    "List",
    "Compare",
    "Translate",
    "Fix",
    "Summarize",
    "What are",
    "I'm",
    "Is it",
    "Tell me",
    "Suggest",
    "Describe",
    "Write a Python function",
    "Rewrite",
    "Plan",
    "Draft an email",
    "What should I",
    "My",
    "Convert",
]

GROUNDED_INSTRUCTIONS = [
    "Summarize the following text in two sentences.",
    "Summarise this article for a busy reader.",
    "Read the passage below and list its three main points.",
    "Rewrite the following paragraph in simpler English.",
    "What is the main argument of this text?",
    "Extract every name, date and number mentioned in the text below.",
    "Give this article a short title.",
    "Answer using only the text below: what problem does it describe?",
    "Turn the following notes into a short paragraph.",
    "Proofread the following text and correct any mistakes.",
    "Write three questions a student could answer from this passage.",
    "Translate the following text into plain, formal English.",
    "Shorten this text to about half its length without losing information.",
    "Based on the passage, what happens next? Explain briefly.",
]

# Opening phrases after which the target itself writes the passage (a sampled grounded turn).
PASSAGE_SEEDS = [
    "Summarize the following article:\n\n",
    "Here is a paragraph from a news report:\n\n",
    "Read this text and tell me what it is about:\n\n",
    "Can you make this email more polite?\n\n",
    "Please check this paragraph for errors:\n\n",
    "What are the key points of the following text?\n\n",
    "Here is my code:\n\n```python\n",
    "I got this message from my landlord:\n\n",
]

TOOLS = [
    {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
    {
        "name": "search_web",
        "description": "Search the web and return the top results.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
    {
        "name": "send_email",
        "description": "Send an email.",
        "parameters": {
            "type": "object",
            "properties": {
                "to": {"type": "string"},
                "subject": {"type": "string"},
                "body": {"type": "string"},
            },
            "required": ["to", "subject", "body"],
        },
    },
    {
        "name": "create_event",
        "description": "Add an event to the user's calendar.",
        "parameters": {
            "type": "object",
            "properties": {
                "title": {"type": "string"},
                "date": {"type": "string"},
                "time": {"type": "string"},
            },
            "required": ["title", "date"],
        },
    },
    {
        "name": "convert_currency",
        "description": "Convert an amount between currencies.",
        "parameters": {
            "type": "object",
            "properties": {
                "amount": {"type": "number"},
                "from": {"type": "string"},
                "to": {"type": "string"},
            },
            "required": ["amount", "from", "to"],
        },
    },
    {
        "name": "lookup_order",
        "description": "Look up an order by its id.",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string"}},
            "required": ["order_id"],
        },
    },
    {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
    {
        "name": "get_stock_price",
        "description": "Get the latest price of a stock by its ticker.",
        "parameters": {
            "type": "object",
            "properties": {"ticker": {"type": "string"}},
            "required": ["ticker"],
        },
    },
]

USER_TURN_TOKENS = 160  # a sampled user turn must end (<|im_end|>) within this many tokens
PASSAGE_TOKENS = 220


def tools_system_prompt(tools: list[dict]) -> str:
    """The service's own rendering of tool definitions (so the corpus sees what serving sends)."""
    from service.api.schemas import Tool
    from service.api.tools import tools_system_prompt as render

    return render([Tool.model_validate({"type": "function", "function": t}) for t in tools], parallel=True)


@dataclass
class Conversation:
    kind: str
    messages: list[dict]
    pending: str = ""  # the opening of the user turn being sampled (an opener or a passage seed)
    records: list[dict] = field(default_factory=list)
    failed: bool = False


@dataclass
class CorpusConfig:
    seed: int = 0
    shard_size: int = 192
    batch_size: int = 96
    max_answer_tokens: int = 192
    temperature: float = 1.0
    top_p: float = 0.98


def opening(text: str) -> str:
    """A user turn's first ten words, lowercased: two turns that open alike are near-duplicates."""
    return " ".join(re.findall(r"[a-z0-9']+", text.lower())[:10])


class Filter:
    """Keeps a sampled user turn only if it reads like one; remembers openings to drop near-duplicates
    (`seen`: those of earlier shards too, so the corpus is deduplicated as a whole)."""

    def __init__(self, banned: set[tuple[str, ...]], seen: set[str] | None = None) -> None:
        self.banned = banned
        self.seen: set[str] = set() if seen is None else seen

    def accept(self, text: str) -> bool:
        words = text.split()
        if not 3 <= len(words) <= 400:
            return False
        printable = sum(1 for c in text if c.isascii() and (c.isprintable() or c in "\n\t"))
        if printable < 0.97 * len(text):
            return False  # mostly another language or garbage bytes
        if "<|im_" in text or "assistant\n" in text:
            return False
        lowered = [w.lower() for w in words]
        grams = [tuple(lowered[i : i + 4]) for i in range(len(lowered) - 3)]
        if grams and len(set(grams)) < 0.7 * len(grams):
            return False  # degenerate repetition
        key = opening(text)
        if key in self.seen or overlaps(text, self.banned):
            return False
        self.seen.add(key)
        return True


def _stop_ids(target: LoadedModel) -> set[int]:
    return target.eos_token_ids() | {target.tokenizer.convert_tokens_to_ids("<|im_end|>")}


def _user_prefix(target: LoadedModel, conv: Conversation) -> list[int]:
    """The template up to the start of a user message (plus its opening, if any): what Magpie samples from."""
    tokenizer = target.tokenizer
    # Render a user turn holding a marker, cut at the marker: the template's own framing, whatever it is.
    marker = "\x00MAGPIE\x00"
    text = tokenizer.apply_chat_template(
        [*conv.messages, {"role": "user", "content": marker}], tokenize=False, add_generation_prompt=False
    )
    text = text[: text.index(marker)] + conv.pending
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _batches(items: list, size: int, key) -> Iterator[list]:
    ordered = sorted(items, key=key)  # similar lengths share a batch: little padding
    for first in range(0, len(ordered), size):
        yield ordered[first : first + size]


def _sample_user_turns(
    target: LoadedModel, convs: list[Conversation], flt: Filter, config: CorpusConfig, gen: torch.Generator
) -> None:
    stop = _stop_ids(target)
    prefixed = [(c, _user_prefix(target, c)) for c in convs]
    for batch in _batches(prefixed, config.batch_size, key=lambda p: len(p[1])):
        limit = PASSAGE_TOKENS if any(c.pending for c, _ in batch) else USER_TURN_TOKENS
        log.info("sampling %d user turns (prefixes of %d tokens)", len(batch), len(batch[-1][1]))
        outs = decode_batch(
            target,
            [ids for _, ids in batch],
            limit,
            stop,
            temperature=config.temperature,
            top_p=config.top_p,
            generator=gen,
        )
        for (conv, _), (tokens, ended) in zip(batch, outs, strict=True):
            text = conv.pending + target.tokenizer.decode(tokens, skip_special_tokens=True)
            conv.pending = ""
            text = text.strip()
            if not ended or not flt.accept(text):
                conv.failed = True
                continue
            conv.messages.append({"role": "user", "content": text})


def _answer(target: LoadedModel, convs: list[Conversation], config: CorpusConfig) -> None:
    stop = _stop_ids(target)
    prompts = [(c, encode_chat(target.tokenizer, c.messages)) for c in convs]
    for batch in _batches(prompts, config.batch_size, key=lambda p: len(p[1])):
        log.info("answering %d prompts (of %d tokens)", len(batch), len(batch[-1][1]))
        outs = decode_batch(target, [ids for _, ids in batch], config.max_answer_tokens, stop)
        for (conv, prompt_ids), (tokens, ended) in zip(batch, outs, strict=True):
            text = target.tokenizer.decode(tokens, skip_special_tokens=True).strip()
            if not text:
                conv.failed = True
                continue
            conv.records.append(
                {
                    "kind": conv.kind,
                    "messages": list(conv.messages),
                    "answer": text,
                    "prompt_ids": prompt_ids,
                    "answer_ids": tokens,  # ends with <|im_end|> when the answer ended (`ended`)
                    "ended": ended,
                }
            )
            conv.messages.append({"role": "assistant", "content": text})


def _new_conversation(rng: random.Random, passages: list[str]) -> Conversation:
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    messages: list[dict] = []
    pending = ""
    if kind == "system" or (kind == "multi" and rng.random() < 0.4):
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if kind == "tools":
        tools = rng.sample(TOOLS, rng.randint(1, 3))
        messages.append({"role": "system", "content": tools_system_prompt(tools)})
    if kind == "code":
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": CODE_SYSTEM_PROMPT})
        pending = rng.choice(CODE_OPENERS)
    elif kind == "grounded":
        if passages and rng.random() < 0.5:
            instruction = rng.choice(GROUNDED_INSTRUCTIONS)
            passage = rng.choice(passages)
            content = f"{instruction}\n\n{passage}" if rng.random() < 0.7 else f"{passage}\n\n{instruction}"
            messages.append({"role": "user", "content": content})
        else:
            pending = rng.choice(PASSAGE_SEEDS)
    elif kind in ("open", "system", "multi") and rng.random() < 0.35:
        pending = rng.choice(OPENERS)
    return Conversation(kind=kind, messages=messages, pending=pending)


def build_shard(
    target: LoadedModel,
    shard: int,
    config: CorpusConfig,
    banned: set[tuple[str, ...]],
    passages: list[str],
    seen: set[str] | None = None,
) -> list[dict]:
    """One shard's records (seeded by the corpus seed and the shard number); `seen`: the openings of the
    user turns already in the corpus (a turn opening like one is dropped; the shard's own are added)."""
    rng = random.Random(f"{config.seed}-{shard}")
    gen = torch.Generator().manual_seed(config.seed * 100_003 + shard)
    flt = Filter(banned, seen)
    convs = [_new_conversation(rng, passages) for _ in range(config.shard_size)]
    needs_user = [c for c in convs if not c.messages or c.messages[-1]["role"] != "user"]
    _sample_user_turns(target, needs_user, flt, config, gen)
    live = [c for c in convs if not c.failed]
    _answer(target, live, config)
    follow = [c for c in live if c.kind == "multi" and not c.failed]
    for conv in follow:
        if rng.random() < 0.3:
            conv.pending = rng.choice(OPENERS)
    _sample_user_turns(target, follow, flt, config, gen)
    _answer(target, [c for c in follow if not c.failed], config)
    return [record for conv in convs for record in conv.records]


def shard_path(folder: Path, shard: int) -> Path:
    return folder / f"corpus-{shard:04d}.jsonl.gz"


def read_shard(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def write_shard(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    tmp.replace(path)  # atomic: an interrupted run leaves no half shard behind


def build_corpus(
    target: LoadedModel | Callable[[], LoadedModel],
    folder: Path,
    shards: int,
    config: CorpusConfig,
    banned: set[tuple[str, ...]],
    budget_seconds: float | None = None,
) -> list[Path]:
    """Shards 0..shards-1 in `folder`, skipping those already there (resumable across runs). Stops starting
    new shards after `budget_seconds`. `target` may be a loader, called only when a shard must be written
    (a resumed run whose shards are all there never loads the writer)."""
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    done: list[Path] = []
    for shard in range(shards):
        path = shard_path(folder, shard)
        if path.exists():
            done.append(path)
            continue
        if budget_seconds is not None and time.perf_counter() - started > budget_seconds:
            log.info("time budget spent: %d of %d shards built", len(done), shards)
            break
        passages = _passages(done[-4:])
        seen = set().union(*(_openings(p) for p in done))
        t0 = time.perf_counter()
        if callable(target):
            target = target()
        records = build_shard(target, shard, config, banned, passages, seen)
        write_shard(path, records)
        done.append(path)
        positions = sum(len(r["answer_ids"]) for r in records)
        log.info(
            "shard %d: %d answers, %d answer tokens in %.0f s (%s)",
            shard,
            len(records),
            positions,
            time.perf_counter() - t0,
            ", ".join(f"{k} {sum(r['kind'] == k for r in records)}" for k in KIND_WEIGHTS),
        )
    return done


@functools.cache
def _openings(path: Path) -> frozenset[str]:
    """The openings of a written shard's user turns (read once a process: a shard never changes)."""
    return frozenset(
        opening(m["content"]) for r in read_shard(path) for m in r["messages"] if m["role"] == "user"
    )


@functools.cache
def shard_positions(path: Path) -> int:
    """Answer positions in a written shard (what the head trains on)."""
    return sum(len(r["answer_ids"]) for r in read_shard(path))


def _passages(paths: list[Path]) -> list[str]:
    """Earlier answers long enough to serve as a grounded prompt's passage."""
    out = []
    for path in paths:
        for record in read_shard(path):
            if record["kind"] in ("open", "system") and 40 <= len(record["answer"].split()) <= 220:
                out.append(record["answer"])
    return out
