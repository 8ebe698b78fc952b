"""Rendering: tool definitions and the tool turns of a conversation as chat template messages."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from service.api.errors import INCONSISTENT, bad_request
from service.api.schemas import (
    ChatMessage,
    Tool,
)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


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
