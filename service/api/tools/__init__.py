"""Tool calling in OpenAI's shape, on models that write their tool calls as text.

Three parts, a module each, every one a pure function or a small state machine, testable on hand-written
text (this module holds the request's side, `ToolPlan`):

1. **Rendering** (`rendering.py`: `render_messages`): tool definitions and the tool turns of a conversation become chat
   template messages. A template that renders tools itself (it uses the `tools` variable, as Qwen2.5's,
   Llama 3.1's and Hermes' do) gets them as they are, with OpenAI's `tool_calls` and `tool` messages. Any
   other template (SmolLM2's, for one) gets the *default rendering*, the Hermes convention: a system block
   listing the functions as JSON inside `<tools></tools>` and asking for
   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; earlier calls are written back in that
   format and tool results become a user turn of `<tool_response>...</tool_response>` blocks.
2. **Constraints** (`constraints.py`, used by `ToolPlan.constraint`): `tool_choice` "required" or a named function is enforced by
   constrained decoding, as vLLM does: a named function's output is the JSON of its arguments (its
   `parameters` schema); "required" outputs a JSON array of `{"name", "arguments"}` objects (one `anyOf`
   branch per tool; at most one item when `parallel_tool_calls` is false).
3. **Parsing** (`parsing.py`: `ToolCallStream`): turns the generated text, piece by piece as it streams, into content
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

from dataclasses import dataclass
from typing import Any, Literal

from service.api.errors import INCONSISTENT, bad_request
from service.api.schemas import ChatCompletionRequest, NamedToolChoice, Tool
from service.api.tools.constraints import arguments_schema, required_schema
from service.api.tools.parsing import (
    TOOL_CALL_PARSERS,
    CallArguments,
    CallStart,
    HermesToolStream,
    NamedToolStream,
    RequiredToolStream,
    TextDelta,
    ToolCallStream,
    ToolEvent,
    check_parser,
    collect,
    parse_call,
)
from service.api.tools.rendering import render_messages, template_renders_tools, tools_system_prompt

ToolChoice = Literal["auto", "required", "function"]

__all__ = [
    "TOOL_CALL_PARSERS",
    "CallArguments",
    "CallStart",
    "HermesToolStream",
    "NamedToolStream",
    "RequiredToolStream",
    "TextDelta",
    "ToolCallStream",
    "ToolEvent",
    "ToolPlan",
    "arguments_schema",
    "check_parser",
    "collect",
    "parse_call",
    "render_messages",
    "required_schema",
    "template_renders_tools",
    "tool_plan",
    "tools_system_prompt",
]

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
