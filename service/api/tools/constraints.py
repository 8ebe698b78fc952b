"""Constraints: `tool_choice` "required" or a named function, enforced by constrained decoding (as vLLM does)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from service.api.errors import INCONSISTENT, bad_request
from service.api.schemas import (
    Tool,
)

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
