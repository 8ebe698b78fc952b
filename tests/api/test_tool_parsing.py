"""service/api/tools/ on hand-written text, without a model: the hermes parser (whole and streamed),
the "required" and named-function streams, the constraint schemas, the request's tool fields (`tool_plan`) and
the default rendering."""

from __future__ import annotations

import copy
import json
from typing import get_args

import jsonschema
import pytest
from pydantic import ValidationError

from service.api.errors import APIError
from service.api.schemas import ChatCompletionRequest, ChatMessage, Tool
from service.api.tools import (
    TOOL_CALL_PARSERS,
    CallArguments,
    CallStart,
    HermesToolStream,
    NamedToolStream,
    RequiredToolStream,
    TextDelta,
    ToolCallStream,
    arguments_schema,
    collect,
    parse_call,
    render_messages,
    required_schema,
    template_renders_tools,
    tool_plan,
)
from service.config import Settings, ToolCallParserName
from service.decoding.text import encode_chat

NAMES = frozenset({"get_weather", "add"})
WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
                "required": ["city"],
                "$defs": {"unit": {"enum": ["C", "F"]}},
            },
        },
    }
)
ADD = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    }
)
NO_ARGS = Tool.model_validate({"type": "function", "function": {"name": "now"}})


def whole(stream: ToolCallStream, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = collect([*stream.feed(text), *stream.close()])
    return content, [(c.function.name, c.function.arguments) for c in calls]


def piecewise(stream: ToolCallStream, text: str, size: int = 1) -> list:
    events = []
    for i in range(0, len(text), size):
        events += stream.feed(text[i : i + size])
    return events + stream.close()


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_CASES = [
    ("plain text", "Hello there.", "Hello there.", []),
    ("only a call", CALL, None, [("get_weather", '{"city": "Paris"}')]),
    ("text then call", "Let me check.\n" + CALL, "Let me check.", [("get_weather", '{"city": "Paris"}')]),
    (
        "two calls and text after",
        f"{CALL}\n{CALL.replace('Paris', 'Oslo')}\nDone.",
        "Done.",
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Oslo"}')],
    ),
    ("unclosed at the end", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [("add", '{"a": 1, "b": 2}')]),
    ("arguments as a string", '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>', None, [("add", '{"a": 1}')]),
    ("parameters for arguments", '<tool_call>{"name": "add", "parameters": {"a": 1}}</tool_call>', None, [("add", '{"a": 1}')]),
    ("not JSON stays text", "<tool_call>{oops}</tool_call>", "<tool_call>{oops}</tool_call>", []),
    ("unknown function stays text", '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', '<tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
    ("a lone < is text", "a < b and <tool but no call", "a < b and <tool but no call", []),
    ("text ending in half a tag", "wait <tool_ca", "wait <tool_ca", []),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "content", "calls"), [c[1:] for c in HERMES_CASES], ids=[c[0] for c in HERMES_CASES]
)
def test_hermes_parses_whole_and_streamed_alike(text: str, content: str | None, calls: list) -> None:
    assert whole(HermesToolStream(NAMES), text) == (content, calls)
    for size in (1, 3, 7):  # however the text is cut, the same content and calls
        events = piecewise(HermesToolStream(NAMES), text, size)
        got, got_calls = collect(events)
        assert (got, [(c.function.name, c.function.arguments) for c in got_calls]) == (content, calls)
        if calls:  # no piece of a tag ever reaches the content
            assert "<tool" not in "".join(e.text for e in events if isinstance(e, TextDelta))


def test_hermes_sends_a_call_as_openai_does() -> None:
    stream = HermesToolStream(NAMES)
    events = stream.feed("Sure. " + CALL) + stream.close()
    assert events[0] == TextDelta("Sure.")
    start, arguments = events[1:]
    assert isinstance(start, CallStart) and start.index == 0 and start.name == "get_weather"
    assert start.id.startswith("call_") and len(start.id) == 29
    assert arguments == CallArguments(0, '{"city": "Paris"}')


def test_hermes_streams_arguments_as_the_model_writes_them() -> None:
    stream = HermesToolStream(NAMES)
    assert stream.feed('<tool_call>\n{"name": "get_wea') == []  # not yet known to be a call
    start, first = stream.feed('ther", "arguments": {"city": "Pa')
    assert isinstance(start, CallStart) and start.name == "get_weather"
    assert first == CallArguments(0, '{"city": "Pa')
    assert stream.feed('ris"}}\n</tool_call> ok') == [CallArguments(0, 'ris"}'), TextDelta("ok")]
    assert stream.close() == []


def test_hermes_arguments_end_at_their_own_closing_brace() -> None:
    text = '<tool_call>{"name": "add", "arguments": {"q": "a } b \\" {", "n": [1, {"x": 2}]}}</tool_call>'
    expected = (None, [("add", '{"q": "a } b \\" {", "n": [1, {"x": 2}]}')])
    assert whole(HermesToolStream(NAMES), text) == expected
    assert json.loads(expected[1][0][1]) == {"q": 'a } b " {', "n": [1, {"x": 2}]}
    cut = '<tool_call>{"name": "add", "arguments": {"a": 1, "b'  # max_tokens cut it: the call stays, cut too
    assert whole(HermesToolStream(NAMES), cut) == (None, [("add", '{"a": 1, "b')])
    events = piecewise(HermesToolStream(NAMES), cut)
    assert "".join(e.arguments for e in events if isinstance(e, CallArguments)) == '{"a": 1, "b'


def test_hermes_holds_back_only_what_could_start_a_tag() -> None:
    stream = HermesToolStream(NAMES)
    assert stream.feed("Hello <tool") == [TextDelta("Hello")]  # the space waits: it may end the content
    assert stream.feed("box> world ") == [TextDelta(" <toolbox> world")]
    assert stream.close() == []


def test_hermes_keeps_one_call_without_parallel_tool_calls() -> None:
    text = f"{CALL}{CALL.replace('Paris', 'Oslo')}"
    assert whole(HermesToolStream(NAMES, parallel=False), text) == (
        None,
        [("get_weather", '{"city": "Paris"}')],
    )


def test_parse_call_needs_a_known_name_and_an_object() -> None:
    assert parse_call('{"name": "add", "arguments": {"a": 1}}', NAMES) == ("add", '{"a": 1}')
    assert parse_call('{"name": "add"}', NAMES) == ("add", "{}")
    for bad in ('{"name": "add", "arguments": [1]}', '["add"]', '{"arguments": {}}', '{"name": "x"}'):
        assert parse_call(bad, NAMES) is None, bad


def test_required_stream_sends_each_call_once_its_object_is_complete() -> None:
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    stream = RequiredToolStream(NAMES)
    first_end = text.index("}}") + 2
    events = stream.feed(text[:first_end])
    assert [type(e) for e in events] == [CallStart, CallArguments]
    assert events[1] == CallArguments(0, '{"a": 1, "b": 2}')
    rest = stream.feed(text[first_end:]) + stream.close()
    assert [(e.index, e.name) for e in rest if isinstance(e, CallStart)] == [(1, "get_weather")]
    assert whole(RequiredToolStream(NAMES), text)[0] is None
    assert collect(piecewise(RequiredToolStream(NAMES), text))[1][1].function.arguments == '{"city": "Rome"}'
    assert len(whole(RequiredToolStream(NAMES, parallel=False), text)[1]) == 1


def test_required_stream_returns_what_is_not_an_array_of_calls_as_content() -> None:
    for text in ("Sure, the weather is nice.", '[{"name": "rm", "arguments": {}}]', '[{"name": "add", "argu'):
        assert whole(RequiredToolStream(NAMES), text) == (text, [])


def test_named_stream_is_one_call_streamed_as_it_comes() -> None:
    events = piecewise(NamedToolStream("add"), '{"a": 1, "b": 2}', size=4)
    assert isinstance(events[0], CallStart) and events[0].name == "add"
    assert "".join(e.arguments for e in events[1:]) == '{"a": 1, "b": 2}'
    assert whole(NamedToolStream("add"), "")[1] == [("add", "")]  # nothing generated: still the call


def test_required_schema_accepts_calls_and_refuses_the_rest() -> None:
    schema = required_schema([WEATHER, ADD, NO_ARGS], parallel=True)
    jsonschema.Draft202012Validator.check_schema(schema)
    valid = [
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}},
        {"name": "add", "arguments": {"a": 1, "b": 2}},
        {"name": "now", "arguments": {}},
    ]
    jsonschema.validate(valid, schema)
    for bad in (
        [],  # at least one call
        [{"name": "add", "arguments": {"a": 1}}],  # its schema's required field
        [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "K"}}],  # the hoisted $defs apply
        [{"name": "rm", "arguments": {}}],
        [{"name": "now", "arguments": {"x": 1}}],  # no parameters: an empty object
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema([WEATHER, ADD], parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(valid[:2], single)
    assert arguments_schema(ADD) == ADD.function.parameters


def test_clashing_definitions_are_refused_naming_the_tool() -> None:
    other = WEATHER.model_copy(deep=True)
    other.function.name = "get_forecast"
    other.function.parameters["$defs"]["unit"] = {"enum": ["K"]}
    with pytest.raises(APIError) as refused:
        required_schema([WEATHER, other], parallel=True)
    assert refused.value.param == "tools.1.function.parameters"


def _messages(*raw: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in raw]


HISTORY = _messages(
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": "Weather in Rome and Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    {"role": "tool", "tool_call_id": "c2", "content": "snow"},
)


def test_default_rendering_round_trips_through_the_parser() -> None:
    rendered, template_tools = render_messages(HISTORY, [WEATHER], native=False)
    assert template_tools is None
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    system = rendered[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER.function.parameters) in system
    # The calls in the history are written exactly as the parser reads them back.
    assert whole(HermesToolStream(NAMES), rendered[2]["content"]) == (
        None,
        [("get_weather", '{"city": "Rome"}'), ("get_weather", '{"city": "Oslo"}')],
    )
    assert (
        rendered[3]["content"]
        == "<tool_response>\nrain\n</tool_response>\n<tool_response>\nsnow\n</tool_response>"
    )
    # Without tools, the history still renders, and no system block is added.
    assert render_messages(HISTORY, None, native=False)[0][0] == {"role": "system", "content": "Be brief."}


def test_native_rendering_hands_tools_and_tool_turns_to_the_template() -> None:
    rendered, template_tools = render_messages(HISTORY, [WEATHER], native=True)
    assert template_tools == [
        {"type": "function", "function": WEATHER.function.model_dump(exclude_none=True)}
    ]
    assert rendered[2]["tool_calls"][1]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert rendered[3] == {"role": "tool", "tool_call_id": "c1", "content": "rain"}


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ([{"role": "tool", "tool_call_id": "c9", "content": "x"}], "messages.0.tool_call_id"),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "user", "content": "hi"},
                {"role": "tool", "tool_call_id": "c1", "content": "late"},
            ],
            "messages.2.tool_call_id",
        ),
    ],
)
def test_a_broken_history_is_refused_naming_the_field(raw: list[dict], param: str) -> None:
    with pytest.raises(APIError) as refused:
        render_messages(_messages(*raw), None, native=False)
    assert refused.value.status_code == 400 and refused.value.param == param


@pytest.mark.parametrize("arguments", ["{oops", "[1]", '{"city": "Par'])
def test_arguments_that_are_no_json_object_are_rendered_as_written(arguments: str) -> None:
    """A model may write invalid arguments (or be cut by max_tokens); the agent loop sends them back and the
    model sees them as they were, not a 400 that ends the conversation (OpenAI accepts any string)."""
    raw = [
        {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": arguments}}]}
    ]
    rendered, _ = render_messages(_messages(*raw), None, native=False)
    assert json.dumps(arguments) in rendered[-1]["content"]


class _Template:
    def __init__(self, chat_template: object) -> None:
        self.chat_template = chat_template


def test_template_detection() -> None:
    smollm = "{% for message in messages %}{{'<|im_start|>' + message['role'] }}{% endfor %}"
    qwen = (
        "{%- if tools %}{{- '<tools>' }}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}{%- endif %}"
    )
    assert not template_renders_tools(_Template(smollm))  # type: ignore[arg-type]
    assert template_renders_tools(_Template(qwen))  # type: ignore[arg-type]
    assert template_renders_tools(_Template({"default": smollm, "tool_use": qwen}))  # type: ignore[arg-type]


def test_the_setting_names_every_registered_parser() -> None:
    assert set(get_args(ToolCallParserName)) == set(TOOL_CALL_PARSERS)
    assert Settings().tool_call_parser == "hermes"
    with pytest.raises(ValidationError, match="tool_call_parser"):
        Settings(tool_call_parser="mistral")  # not registered: the server refuses to start


def _plan(**fields: object):
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )
    return tool_plan(body, "hermes")


def test_tool_plan_turns_the_request_into_a_constraint_and_a_parser() -> None:
    tools = [WEATHER.model_dump(exclude_none=True), ADD.model_dump(exclude_none=True)]
    assert _plan() is None and _plan(tools=tools, tool_choice="none") is None
    auto = _plan(tools=tools)
    assert auto.choice == "auto" and auto.constraint() is None
    assert isinstance(auto.stream(), HermesToolStream)
    assert auto.finish_reason("stop", called=True) == "tool_calls"
    assert auto.finish_reason("length", called=True) == "length"
    assert auto.finish_reason("stop", called=False) == "stop"

    named = _plan(tools=tools, tool_choice={"type": "function", "function": {"name": "add"}})
    assert named.constraint() == ADD.function.parameters  # the output is the arguments object itself
    assert isinstance(named.stream(), NamedToolStream)
    assert named.finish_reason("stop", called=True) == "stop"  # OpenAI's, for a forced function

    required = _plan(tools=tools, tool_choice="required", parallel_tool_calls=False)
    assert required.constraint() == required_schema([WEATHER, ADD], parallel=False)
    assert required.constraint()["maxItems"] == 1
    assert required.finish_reason("stop", called=True) == "tool_calls"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
        (
            {"tools": [ADD.model_dump()], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [ADD.model_dump(), ADD.model_dump()]}, "tools.1"),
        (
            {
                "tools": [ADD.model_dump()],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
    ],
)
def test_tool_plan_refuses_what_cannot_be_honoured(fields: dict, param: str) -> None:
    with pytest.raises(APIError) as refused:
        _plan(**fields)
    assert refused.value.status_code == 400 and refused.value.param == param


# A tool-aware template in the style of Qwen2.5's (tools listed in the system turn, calls and results as
# their own blocks), set on the real tokenizer: the native path through transformers' own Jinja rendering.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for tool in tools %}{{ tool | tojson }}{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}CALL {{ call.function.name }} {{ call.function.arguments | tojson }}"
    "{% endfor %}{% if message.role == 'tool' %} FOR {{ message.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_tools_gets_them_as_they_are(embedded) -> None:
    tokenizer = copy.deepcopy(embedded.tokenizer)
    assert not template_renders_tools(tokenizer)  # SmolLM2's own template: the default rendering
    tokenizer.chat_template = TOOL_TEMPLATE
    assert template_renders_tools(tokenizer)
    messages, tools = render_messages(HISTORY, [WEATHER], native=True)
    text = tokenizer.decode(encode_chat(tokenizer, messages, tools=tools))
    assert f"TOOLS:{json.dumps(tools[0])}<|im_end|>" in text  # the definitions, as the template lists them
    assert 'CALL get_weather {"city": "Rome"}CALL get_weather {"city": "Oslo"}' in text
    assert "<|im_start|>tool\nrain FOR c1<|im_end|>" in text and "snow FOR c2" in text
    assert "<tool_call>" not in text and "<tool_response>" not in text  # no default rendering on top
