"""Tool calling through a real server and the official `openai` client, streamed and not.

"auto" runs on the real model: SmolLM2-135M follows the default (Hermes) rendering once the history
shows it two calls, so greedy decoding makes the call deterministically. "required" and a named function
are enforced by constrained decoding: their tests check that the arguments parse and match the schema.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from tests.api.conftest import Server, assert_openai_error, start_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": WEATHER_PARAMETERS,
    },
}
ADD_PARAMETERS = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ADD = {
    "type": "function",
    "function": {"name": "add", "description": "Add two integers", "parameters": ADD_PARAMETERS},
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "add": ADD_PARAMETERS}


def _asked(i: int, *cities: str) -> list[dict]:
    """A user question and the assistant's calls for it: the history that teaches the format."""
    calls = [
        {
            "id": f"call_{i}_{c}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": c})},
        }
        for c in cities
    ]
    return [
        {"role": "user", "content": f"Weather in {' and '.join(cities)}?"},
        {"role": "assistant", "content": None, "tool_calls": calls},
    ]


ONE_CALL = [*_asked(1, "Rome"), *_asked(2, "Oslo"), {"role": "user", "content": "Weather in Paris?"}]
TWO_CALLS = [
    *_asked(1, "Rome", "Oslo"),
    *_asked(2, "Lima", "Kyiv"),
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
]
PLAIN = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # Tool calls are longer than the shared server's 64-token cap allows.
    server = start_server(
        tmp_path_factory.mktemp("tools-server"), "--max-tokens-cap", "256", log_level="warning"
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _sse(raw: bytes) -> list[dict]:
    events = raw.decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


# ---------------------------------------------------------------- auto: the model's own calls, parsed


def test_auto_returns_the_models_call(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=ONE_CALL, tools=TOOLS, max_tokens=60)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris"})


def test_auto_stream_sends_openais_tool_call_deltas(server: Server, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "messages": ONE_CALL, "tools": TOOLS, "max_tokens": 60, "stream": True}
    with server.client() as http:
        chunks = _sse(http.post("/v1/chat/completions", json=body).content)
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    tool_deltas = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert all(len(d) == 1 for d in tool_deltas)  # one entry per delta, as OpenAI sends them
    first, *rest = [d[0] for d in tool_deltas]
    assert set(first) == {"index", "id", "type", "function"} and first["index"] == 0
    assert first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert rest and all(d["index"] == 0 and set(d) == {"index", "function"} for d in rest)
    assert all(set(d["function"]) == {"arguments"} for d in rest)
    assert json.loads("".join(d["function"]["arguments"] for d in rest)) == {"city": "Paris"}
    assert not any(d.get("content") for d in deltas)  # the <tool_call> text never leaks as content
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"

    # The official client's stream helper puts the deltas back together.
    with client.chat.completions.stream(model=MODEL, messages=ONE_CALL, tools=TOOLS, max_tokens=60) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert _calls(final.choices[0].message) == [("get_weather", {"city": "Paris"})]


def test_auto_parallel_calls_and_parallel_tool_calls_false(client: openai.OpenAI) -> None:
    both = client.chat.completions.create(model=MODEL, messages=TWO_CALLS, tools=TOOLS, max_tokens=80)
    assert _calls(both.choices[0].message) == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Tokyo"}),
    ]
    ids = [c.id for c in both.choices[0].message.tool_calls]
    assert len(set(ids)) == 2

    one = client.chat.completions.create(
        model=MODEL, messages=TWO_CALLS, tools=TOOLS, max_tokens=80, parallel_tool_calls=False
    )
    assert _calls(one.choices[0].message) == [("get_weather", {"city": "Paris"})]

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=TWO_CALLS, tools=TOOLS, max_tokens=80, stream=True
        )
    )
    starts = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or [] if t.id]
    assert [(t.index, t.function.name) for t in starts] == [(0, "get_weather"), (1, "get_weather")]


def test_auto_without_a_call_is_plain_content(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=PLAIN, tools=TOOLS, max_tokens=20)
    choice = response.choices[0]
    assert choice.message.content and choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length")
    streamed = list(
        client.chat.completions.create(model=MODEL, messages=PLAIN, tools=TOOLS, max_tokens=20, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == choice.message.content


def test_tool_choice_none_shows_the_model_no_tools(server: Server, client: openai.OpenAI) -> None:
    with server.client() as http:
        bare = http.post("/tokenize", json={"messages": ONE_CALL}).json()["count"]
        with_tools = http.post("/tokenize", json={"messages": ONE_CALL, "tools": TOOLS}).json()["count"]
    assert with_tools > bare + 50  # the definitions are in the prompt ...
    response = client.chat.completions.create(
        model=MODEL, messages=ONE_CALL, tools=TOOLS, tool_choice="none", max_tokens=30
    )
    assert response.usage.prompt_tokens == bare  # ... but not with tool_choice "none"
    assert response.choices[0].message.tool_calls is None
    auto = client.chat.completions.create(model=MODEL, messages=ONE_CALL, tools=TOOLS, max_tokens=1)
    assert auto.usage.prompt_tokens == with_tools  # /tokenize counts exactly what a chat request uses


# ------------------------------------------- required and a named function: enforced by constrained decoding


def test_named_function_arguments_match_its_schema(client: openai.OpenAI) -> None:
    choice = {"type": "function", "function": {"name": "add"}}
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=40
    )
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "add" and response.choices[0].message.content is None
    jsonschema.validate(json.loads(call.function.arguments), ADD_PARAMETERS)
    assert response.choices[0].finish_reason == "stop"  # OpenAI's, for a function the request forced

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=40, stream=True
        )
    )
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id and pieces[0].function.name == "add" and pieces[0].function.arguments == ""
    assert "".join(p.function.arguments for p in pieces[1:]) == call.function.arguments  # greedy: the same


def test_required_calls_match_their_schemas(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=80
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for name, arguments in _calls(choice.message):
        jsonschema.validate(arguments, SCHEMAS[name])

    single = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
    )
    assert len(single.choices[0].message.tool_calls) == 1

    with client.chat.completions.stream(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", max_tokens=80
    ) as stream:
        final = stream.get_final_completion()
    assert _calls(final.choices[0].message) == _calls(choice.message)


# ---------------------------------------------------------------- what is refused, and how

CHAT = [{"role": "user", "content": "Hi"}]
BAD = [
    ("required-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("named-with-empty-tools", {"tools": [], "tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ("named-not-in-tools", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice"),
    ("choice-bogus", {"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ("tool-not-a-function", {"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ("tool-name-with-space", {"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
    ("parameters-not-an-object", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools.0.function.parameters"),
    ("duplicate-names", {"tools": [ADD, ADD]}, "tools.1"),
    ("legacy-functions", {"functions": [{"name": "f"}]}, "functions"),
    ("legacy-function-call", {"function_call": "auto"}, "function_call"),
    ("tool-result-for-no-call", {"messages": [*CHAT, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages.1.tool_call_id"),
    ("tool-without-id", {"messages": [*CHAT, {"role": "tool", "content": "1"}]}, "messages.1"),
    ("arguments-not-a-string", {"messages": [*CHAT, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]}]}, "messages.1.tool_calls.0.function.arguments"),
    ("user-tool-calls", {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
    ("user-without-content", {"messages": [{"role": "user"}]}, "messages.0"),
    ("legacy-function-call-in-history", {"messages": [*CHAT, {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": "{}"}}]}, "messages.1"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tool_requests_name_the_field(server: Server, fields: dict, param: str) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, **fields}
    with server.client() as http:
        error = assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param=param)
    assert "Traceback" not in error["message"]


def test_no_tools_to_offer_is_plain_chat(client: openai.OpenAI) -> None:
    """What agent frameworks send with an empty toolbox: honoured as it stands, nothing to call."""
    response = client.chat.completions.create(
        model=MODEL, messages=PLAIN, tools=[], tool_choice="auto", parallel_tool_calls=False, max_tokens=8
    )
    assert response.choices[0].message.content and response.choices[0].message.tool_calls is None


def test_the_openai_agent_loop(client: openai.OpenAI) -> None:
    """The loop of OpenAI's function-calling guide: the reply's message goes back as it is (content null,
    function_call null, refusal ...), then one tool result per call."""
    messages = list(ONE_CALL)
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=60)
    message = reply.choices[0].message
    messages.append(message)
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"})
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=30)
    assert answer.choices[0].message.content or answer.choices[0].message.tool_calls
    # the call and its result reached the prompt
    assert answer.usage.prompt_tokens > reply.usage.prompt_tokens + len(message.tool_calls) * 5


def test_arguments_a_model_got_wrong_go_back_as_they_were(client: openai.OpenAI) -> None:
    """OpenAI documents that a model may write invalid arguments (and ours may, cut by max_tokens): an agent
    loop sends them back, and the conversation goes on instead of ending in a 400."""
    messages = [
        *CHAT,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "error: bad arguments"},
    ]
    # served (a 400 raises BadRequestError here), with the broken call rendered into the prompt as it was
    response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8)
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=8)
    assert response.usage.prompt_tokens > plain.usage.prompt_tokens


def test_a_history_with_tool_calls_and_results_is_served(client: openai.OpenAI) -> None:
    messages = [
        *_asked(1, "Rome"),
        {"role": "tool", "tool_call_id": "call_1_Rome", "content": "rain, 12 C"},
        {"role": "user", "content": "Thanks. And what is 2 plus 2?"},
    ]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8)
    assert response.choices[0].message.content  # no tools this turn: plain text, the history rendered


# ---------------------------------------------------------------- LangChain, as a user points it here


@pytest.fixture(scope="module")
def chat_model(server: Server) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key="unused",
        model=MODEL,
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )


def _langchain_history() -> list:
    history = []
    for i, city in enumerate(("Rome", "Oslo")):
        call = {"id": f"call_{i}", "name": "get_weather", "args": {"city": city}}
        history += [HumanMessage(f"Weather in {city}?"), AIMessage(content="", tool_calls=[call])]
    return [*history, HumanMessage("Weather in Paris?")]


def test_langchain_bind_tools_invoke_and_stream(chat_model: ChatOpenAI) -> None:
    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city"""
        return "sunny"

    bound = chat_model.bind_tools([get_weather])
    messages = _langchain_history()
    reply = bound.invoke(messages)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert not reply.invalid_tool_calls

    merged = None
    for chunk in bound.stream(messages):  # LangChain adds the chunks up by index, as with OpenAI
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", {"city": "Paris"})]

    # The agent loop's next step: LangChain's own AIMessage and ToolMessage go back into the history.
    answered = [*messages, reply, ToolMessage(content="sunny, 21 C", tool_call_id=reply.tool_calls[0]["id"])]
    final = bound.invoke(answered)
    assert final.content or final.tool_calls


def test_langchain_structured_output_by_function_calling(chat_model: ChatOpenAI) -> None:
    class Weather(BaseModel):
        city: str
        temperature_c: int

    # A named tool_choice under the hood: constrained decoding makes the arguments a Weather.
    extract = chat_model.with_structured_output(Weather, method="function_calling", include_raw=True)
    out = extract.invoke("Paris is 21 degrees C today. Extract the weather.")
    assert out["parsing_error"] is None and isinstance(out["parsed"], Weather), out["raw"]
