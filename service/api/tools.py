"""Tool calling in OpenAI's shape, on models that write their tool calls as text.

Three parts, each a pure function or a small state machine, testable on hand-written text:

1. **Rendering** (`render_messages`): tool definitions and the tool turns of a conversation become chat
   template messages. A template that renders tools itself (it uses the `tools` variable, as Qwen2.5's,
   Llama 3.1's and Hermes' do) gets them as they are, with OpenAI's `tool_calls` and `tool` messages. Any
   other template (SmolLM2's, for one) gets the *default rendering*, the Hermes convention: a system block
   listing the functions as JSON inside `<tools></tools>` and asking for
   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier calls are written back in that
   format and tool results become a user turn of `<tool_response>...</tool_response>` blocks.
2. **Constraints** (`ToolPlan.constraint`): `tool_choice` "required" or a named function is enforced by
   constrained decoding, as vLLM does: a named function's output is the JSON of its arguments (its
   `parameters` schema); "required" outputs a JSON array of `{"name", "arguments"}` objects (one `anyOf`
   branch per tool; at most one item when `parallel_tool_calls` is false).
3. **Parsing** (`ToolCallStream`): turns the generated text, piece by piece as it streams, into content
   and OpenAI tool-call deltas. With "auto" a named parser from `TOOL_CALL_PARSERS` reads the model's own
   format (`hermes`: `<tool_call>` JSON blocks); a block that does not parse, or names an unknown
   function, stays text.

Streaming: content streams until a `<tool_call>` tag begins (a tail that could be the start of the tag is
held back); then each call goes out as OpenAI sends it: a delta with id, type and name (`arguments: ""`),
then deltas carrying pieces of the arguments. An "auto" call starts once its block names a known function
and its arguments stream as they are generated (a block in another shape is read when it closes); so do a
named function's; a "required" array sends each call as soon as its object is complete.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from transformers import PreTrainedTokenizerBase

from service.api.errors import INCONSISTENT, bad_request
from service.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    NamedToolChoice,
    Tool,
    ToolCall,
)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ToolChoice = Literal["auto", "required", "function"]

# ---------------------------------------------------------------- the request


@dataclass(frozen=True)
class ToolPlan:
    """What a request's `tools`, `tool_choice` and `parallel_tool_calls` ask of one generation."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    function: str | None = None  # the named function, when choice == "function"
    parallel: bool = True
    parser: str = "hermes"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(tool.function.name for tool in self.tools)

    def constraint(self) -> dict[str, Any] | None:
        """The JSON Schema the whole output must match ("required", a named function), or None."""
        if self.choice == "function":
            tool = next(t for t in self.tools if t.function.name == self.function)
            return arguments_schema(tool)
        if self.choice == "required":
            return required_schema(self.tools, self.parallel)
        return None

    def stream(self) -> ToolCallStream:
        """A fresh parser for one generation's text."""
        if self.choice == "function":
            assert self.function is not None
            return NamedToolStream(self.function)
        if self.choice == "required":
            return RequiredToolStream(self.names, self.parallel)
        return TOOL_CALL_PARSERS[self.parser](self.names, self.parallel)

    def finish_reason(self, generation: str, called: bool) -> str:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required), "stop" for a forced named
        function; a generation cut by max_tokens stays "length"."""
        if called and generation == "stop" and self.choice != "function":
            return "tool_calls"
        return generation


def tool_plan(body: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """Validates the request's tool fields; None when the generation is plain text (no tools, or
    tool_choice "none")."""
    tools = tuple(body.tools or ())
    choice = body.tool_choice
    if not tools:
        # Agent frameworks send `tools: []`, "auto" and parallel_tool_calls with no tools to offer: honoured
        # as they stand (nothing to call). Only a call the request insists on cannot be made.
        if choice == "required" or isinstance(choice, NamedToolChoice):
            raise bad_request(
                "tool_choice asks for a tool call, but tools is empty", param="tool_choice", code=INCONSISTENT
            )
        return None
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            raise bad_request(
                f"two tools are named {tool.function.name!r}; names must be unique",
                param=f"tools.{i}",
                code=INCONSISTENT,
            )
        seen.add(tool.function.name)
    if choice == "none":
        return None
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    formatted = body.structured_outputs is not None or (
        body.response_format is not None and body.response_format.type != "text"
    )
    if forced and formatted:
        raise bad_request(
            "tool_choice required or a named function constrains the output already: it cannot go with a "
            "response_format or structured_outputs",
            param="tool_choice",
            code=INCONSISTENT,
        )
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in seen:
            raise bad_request(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                f"({', '.join(sorted(seen))})",
                param="tool_choice",
                code=INCONSISTENT,
            )
        plan = ToolPlan(tools, "function", function=choice.function.name, parallel=parallel, parser=parser)
    else:
        plan = ToolPlan(tools, choice or "auto", parallel=parallel, parser=parser)
    plan.constraint()  # a clash between the tools' $defs is the request's fault: refuse it now
    return plan


# ---------------------------------------------------------------- constraints

_EMPTY_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_DEFS_KEYS = ("$defs", "definitions")


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The JSON Schema of a function's arguments object (no `parameters`: an empty object)."""
    return dict(tool.function.parameters) if tool.function.parameters is not None else dict(_EMPTY_ARGUMENTS)


def required_schema(tools: Sequence[Tool], parallel: bool) -> dict[str, Any]:
    """`tool_choice: "required"`: a JSON array of calls, each `{"name": <a tool>, "arguments": <its
    schema>}`. Definitions (`$defs`) move to the root, where the tools' `$ref`s ("#/$defs/...") point."""
    defs: dict[str, dict[str, Any]] = {}
    branches = []
    for i, tool in enumerate(tools):
        arguments = arguments_schema(tool)
        for key in _DEFS_KEYS:
            for name, definition in (arguments.pop(key, None) or {}).items():
                known = defs.setdefault(key, {})
                if name in known and known[name] != definition:
                    raise bad_request(
                        f"tools define {key}/{name} twice, differently: give the definitions distinct names",
                        param=f"tools.{i}.function.parameters",
                        code=INCONSISTENT,
                    )
                known[name] = definition
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": branches}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


# ---------------------------------------------------------------- rendering


def template_renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer's chat template renders tool definitions itself (it reads `tools`)."""
    template = tokenizer.chat_template
    templates = template.values() if isinstance(template, dict) else [template]
    return any(isinstance(t, str) and re.search(r"\btools\b", t) for t in templates)


def tools_system_prompt(tools: Sequence[Tool], parallel: bool) -> str:
    """The default rendering of tool definitions (Hermes' convention), for templates without their own."""
    listed = "\n".join(json.dumps(_tool_dict(tool), ensure_ascii=False) for tool in tools)
    how_many = "one or more functions" if parallel else "at most one function"
    return (
        "# Tools\n\n"
        f"You may call {how_many} to help with the user's request. The functions you can call are "
        f"described as JSON Schema inside <tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments inside "
        "<tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": <function name>, "arguments": <arguments as a JSON object>}\n</tool_call>'
    )


def render_tool_call(name: str, arguments: dict[str, Any] | str) -> str:
    """One call in the default rendering (the same text the hermes parser reads back)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"


def render_messages(
    messages: Sequence[ChatMessage],
    tools: Sequence[Tool] | None,
    *,
    native: bool,
    parallel: bool = True,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(template messages, template tools). `native`: the template renders tools and tool turns itself.
    Raises an APIError (400, naming the field) for a history that does not hold together."""
    _check_history(messages)
    rendered: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        # Chat templates know "system"; OpenAI's newer "developer" role means the same thing.
        role = "system" if message.role == "developer" else message.role
        text = message.text
        if message.role == "assistant" and message.tool_calls:
            calls = [(call, _history_arguments(call.function.arguments)) for call in message.tool_calls]
            if native:
                rendered.append(
                    {
                        "role": "assistant",
                        "content": text,
                        # transformers' convention: arguments as a mapping (templates apply `tojson`)
                        "tool_calls": [
                            {
                                "id": call.id,
                                "type": "function",
                                "function": {"name": call.function.name, "arguments": arguments},
                            }
                            for call, arguments in calls
                        ],
                    }
                )
            else:
                blocks = [render_tool_call(call.function.name, arguments) for call, arguments in calls]
                rendered.append(
                    {"role": "assistant", "content": "\n".join([text, *blocks] if text else blocks)}
                )
        elif message.role == "tool":
            if native:
                entry = {"role": "tool", "tool_call_id": message.tool_call_id, "content": text}
                if message.name:
                    entry["name"] = message.name
                rendered.append(entry)
            else:
                block = f"<tool_response>\n{text}\n</tool_response>"
                # Consecutive results answer one turn's calls: one user turn holds them all.
                if i > 0 and messages[i - 1].role == "tool":
                    rendered[-1]["content"] += "\n" + block
                else:
                    rendered.append({"role": "user", "content": block})
        else:
            rendered.append({"role": role, "content": text})
    if not tools:
        return rendered, None
    if native:
        return rendered, [_tool_dict(tool) for tool in tools]
    prompt = tools_system_prompt(tools, parallel)
    if rendered and rendered[0]["role"] == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{prompt}"}
    else:
        rendered.insert(0, {"role": "system", "content": prompt})
    return rendered, None


def _tool_dict(tool: Tool) -> dict[str, Any]:
    return {"type": "function", "function": tool.function.model_dump(exclude_none=True)}


def _history_arguments(arguments: str) -> dict[str, Any] | str:
    """A history call's arguments as a mapping, or the text as it came when it is no JSON object: OpenAI
    documents that a model may write invalid arguments (and ours may, cut by max_tokens), and an agent
    loop sends them back as they were; refusing them would end its conversation."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _check_history(messages: Sequence[ChatMessage]) -> None:
    """A tool message answers a call of the assistant turn before it (OpenAI refuses anything else)."""
    open_calls: set[str] = set()
    for i, message in enumerate(messages):
        if message.role == "assistant":
            open_calls = {call.id for call in message.tool_calls or ()}
        elif message.role == "tool":
            if message.tool_call_id not in open_calls:
                raise bad_request(
                    f"messages.{i} is a tool result for {message.tool_call_id!r}, but no tool call of the "
                    "assistant message before it has that id",
                    param=f"messages.{i}.tool_call_id",
                    code=INCONSISTENT,
                )
        else:
            open_calls = set()


# ---------------------------------------------------------------- parsing


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
