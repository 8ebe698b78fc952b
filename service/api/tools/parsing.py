"""Parsing: the generated text, piece by piece as it streams, as content and OpenAI tool-call deltas."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from service.api.schemas import (
    FunctionCall,
    ToolCall,
)
from service.api.tools.rendering import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArguments:
    index: int
    arguments: str


ToolEvent = TextDelta | CallStart | CallArguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Generated text in, content and tool-call events out. `feed` each piece as it comes, then `close`."""

    def __init__(self) -> None:
        self.calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        raise NotImplementedError

    def close(self) -> list[ToolEvent]:
        raise NotImplementedError

    def _call(self, name: str, arguments: str) -> list[ToolEvent]:
        index = self.calls
        self.calls += 1
        return [CallStart(index, new_call_id(), name), CallArguments(index, arguments)]


def collect(events: Sequence[ToolEvent]) -> tuple[str | None, list[ToolCall]]:
    """Events -> (content, tool calls) of a whole response, as a client accumulating the stream would."""
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls: list[ToolCall] = []
    for event in events:
        if isinstance(event, CallStart):
            calls.append(ToolCall(id=event.id, function=FunctionCall(name=event.name, arguments="")))
        elif isinstance(event, CallArguments):
            calls[event.index].function.arguments += event.arguments
    return (content or None), calls


def parse_call(block: str, names: frozenset[str]) -> tuple[str, str] | None:
    """A `<tool_call>` block's JSON -> (name, arguments as JSON text), or None if it is not a call of a
    known function. Accepts "parameters" for "arguments", and arguments given as a JSON string."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    return call_of(call, names)


def call_of(call: object, names: frozenset[str]) -> tuple[str, str] | None:
    """A decoded JSON value -> (name, arguments as JSON text) if it is a call of a known function."""
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


class HermesToolStream(ToolCallStream):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks anywhere in the text.

    Content is the text outside the blocks, without the whitespace at its ends or next to a block (held
    back while it streams, so the stream and the whole response carry the same content). A block that
    begins `{"name": <a known function>, "arguments": {` streams: the call starts there and its arguments
    follow as the model writes them, up to the object's closing brace. Any other block is read whole when
    it closes: a call if it parses, else it stays text. An unclosed block at the end (the model stopped
    after the JSON) counts too. With `parallel` false only the first call is kept."""

    def __init__(self, names: frozenset[str], parallel: bool = True) -> None:
        super().__init__()
        self.names = names
        self.parallel = parallel
        self.buffer = ""
        self.in_block = False
        self.held_space = ""  # trailing whitespace of the content, sent once more text follows
        self.strip_leading = True  # at the start and after a block
        self.arguments: _ObjectEnd | None = None  # while a call's arguments stream
        self.arguments_done = False

    def feed(self, text: str) -> list[ToolEvent]:
        self.buffer += text
        events: list[ToolEvent] = []
        while True:
            if self.in_block and self.arguments is None:
                events += self._open_call()
            if self.arguments is not None:
                if not self.arguments_done:
                    end = self.arguments.scan(self.buffer)
                    piece = self.buffer if end is None else self.buffer[:end]
                    self.buffer = "" if end is None else self.buffer[end:]
                    if piece:
                        events.append(CallArguments(self.calls - 1, piece))
                    if end is None:
                        return events
                    self.arguments_done = True
                close = self.buffer.find(TOOL_CALL_CLOSE)
                if close < 0:
                    return events  # the rest of the block (its closing brace) is not content
                self.buffer = self.buffer[close + len(TOOL_CALL_CLOSE) :]
                self._end_block()
                continue
            if self.in_block:
                end = self.buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    return events
                block, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_CALL_CLOSE) :]
                self.in_block = False
                events += self._block(block, closed=True)
                continue
            start = self.buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                events += self._text(self.buffer[:start], before_block=True)
                self.buffer = self.buffer[start + len(TOOL_CALL_OPEN) :]
                self.in_block = True
                continue
            keep = _partial_suffix(self.buffer, TOOL_CALL_OPEN)
            cut = len(self.buffer) - keep
            events += self._text(self.buffer[:cut])
            self.buffer = self.buffer[cut:]
            return events

    def close(self) -> list[ToolEvent]:
        rest, self.buffer = self.buffer, ""
        if self.arguments is not None:  # cut off while its arguments streamed: the call stays as it is
            self._end_block()
            return []
        if self.in_block:
            self.in_block = False
            return self._block(rest, closed=False)
        return self._text(rest, before_block=True)  # trailing whitespace at the end is dropped too

    def _text(self, text: str, before_block: bool = False) -> list[ToolEvent]:
        text = self.held_space + text
        self.held_space = ""
        if self.strip_leading:
            text = text.lstrip()
            if not text:
                return []
            self.strip_leading = False
        body = text.rstrip()
        if not before_block:
            self.held_space = text[len(body) :]
        return [TextDelta(body)] if body else []

    def _open_call(self) -> list[ToolEvent]:
        """Start streaming a call once the block's head names a known function (and more may be called)."""
        head = _CALL_HEAD.match(self.buffer)
        if head is None or self.buffer[head.end() : head.end() + 1] != "{":
            return []
        if head.group(1) not in self.names or (self.calls and not self.parallel):
            return []  # read whole when the block closes: text, or a dropped extra call
        self.buffer = self.buffer[head.end() :]
        self.arguments = _ObjectEnd()
        self.calls += 1
        return [CallStart(self.calls - 1, new_call_id(), head.group(1))]

    def _end_block(self) -> None:
        self.in_block = False
        self.arguments = None
        self.arguments_done = False
        self.strip_leading = True

    def _block(self, block: str, closed: bool) -> list[ToolEvent]:
        parsed = parse_call(block.strip(), self.names)
        if parsed is None:  # not a call: the model's text, tags and all
            return self._text(TOOL_CALL_OPEN + block + (TOOL_CALL_CLOSE if closed else ""))
        self.strip_leading = True
        if self.calls and not self.parallel:
            return []  # parallel_tool_calls: false keeps the first call only
        return self._call(*parsed)


# The head of a Hermes call, up to the arguments object: {"name": "get_weather", "arguments": {
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class _ObjectEnd:
    """Finds where a JSON object ends as its text streams in (braces inside strings do not count)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def scan(self, text: str) -> int | None:
        """The index just past the object's closing brace in `text`, or None if the object goes on."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (to hold back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class NamedToolStream(ToolCallStream):
    """A forced named function: the whole output is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[ToolEvent]:
        events: list[ToolEvent] = []
        if not self.calls:
            self.calls = 1
            events.append(CallStart(0, new_call_id(), self.name))
        if text:
            events.append(CallArguments(0, text))
        return events

    def close(self) -> list[ToolEvent]:
        return self.feed("") if not self.calls else []


class RequiredToolStream(ToolCallStream):
    """tool_choice "required": the output is a JSON array of {"name", "arguments"} objects. Each call is
    sent once its object is complete; output that is not such an array (the constraint not enforced, or
    cut by max_tokens before the first call) is returned as content."""

    def __init__(self, names: frozenset[str], parallel: bool = True) -> None:
        super().__init__()
        self.names = names
        self.parallel = parallel
        self.text = ""
        self.position = 0  # where the next array item (or the opening bracket) starts
        self.opened = False
        self.failed = False
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> list[ToolEvent]:
        self.text += text
        events: list[ToolEvent] = []
        while not self.failed:
            rest = self.text[self.position :]
            stripped = rest.lstrip()
            if not stripped:
                return events
            at = self.position + len(rest) - len(stripped)
            if not self.opened:
                if stripped[0] != "[":
                    self.failed = True
                    return events
                self.opened = True
                self.position = at + 1
                continue
            if stripped[0] in ",]":
                self.position = at + 1
                continue
            try:
                item, end = self._decoder.raw_decode(self.text, at)
            except ValueError:
                return events  # not complete yet
            parsed = call_of(item, self.names)
            if parsed is None:
                self.failed = True
                return events
            self.position = end
            if self.calls and not self.parallel:
                continue
            events += self._call(*parsed)
        return events

    def close(self) -> list[ToolEvent]:
        if self.calls or not self.text.strip():
            return []
        return [TextDelta(self.text)]


TOOL_CALL_PARSERS: dict[str, Callable[[frozenset[str], bool], ToolCallStream]] = {
    "hermes": HermesToolStream,
}


def check_parser(name: str) -> str:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_CALL_PARSERS))}"
        )
    return name
