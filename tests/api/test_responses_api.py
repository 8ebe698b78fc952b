"""`/v1/responses` (OpenAI's Responses API) through the official `openai` client's `responses.create` and
`responses.stream`, against the shared real server (greedy decoding, token cap 512)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from service.api.response_store import ResponseStore, StoredResponse
from service.api.schemas import ChatMessage
from tests.api.conftest import Server, assert_openai_error

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather of a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
QUESTION = "What is the weather in Paris?"


def test_text_input_with_instructions(client: openai.OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model, input="Name a fruit.", instructions="Answer in one word.", max_output_tokens=12
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete")
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant"
    assert response.output_text and response.output_text == message.content[0].text
    assert response.instructions == "Answer in one word."
    usage = response.usage
    assert 1 <= usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    # instructions are a system message before the input: the chat prompt with that system message
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Name a fruit."},
        ],
        max_tokens=12,
    )
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    # the speculative statistics, as in chat completions
    spec = response.model_extra["speculative"]
    assert spec["method"] == "csd" and spec["target_forwards"] >= 1
    assert spec["accepted_tokens"] + spec["rescued_tokens"] <= spec["draft_tokens"]


def test_a_message_list_is_the_same_conversation_as_chat(client: openai.OpenAI, model: str) -> None:
    """Message items (with input_text / output_text parts) render exactly as the chat messages do: the same
    prompt, and at temperature 0 the same answer."""
    items = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Say a colour."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"role": "user", "content": "Another one."},
    ]
    response = client.responses.create(model=model, input=items, max_output_tokens=10)
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one."},
        ],
        max_tokens=10,
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    # length-cut: status incomplete, with its reason (OpenAI's shape)
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"


def test_stream_sends_the_typed_events(client: openai.OpenAI, model: str) -> None:
    with client.responses.stream(model=model, input="Count to five.", max_output_tokens=10) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == final.output_text
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.usage.output_tokens == 10 and final.status == "incomplete"
    spec = final.model_extra["speculative"]  # the statistics ride on response.completed's response
    assert spec["method"] == "csd" and spec["target_forwards"] >= 1
    # the stream and the JSON answer agree (greedy)
    same = client.responses.create(model=model, input="Count to five.", max_output_tokens=10)
    assert same.output_text == final.output_text


def test_a_function_call_and_its_output(client: openai.OpenAI, model: str) -> None:
    called = client.responses.create(
        model=model, input=QUESTION, tools=[WEATHER], tool_choice="required", max_output_tokens=40
    )
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    # the agent loop: the call and its output go back as input items
    answered = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": QUESTION},
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        max_output_tokens=20,
    )
    assert answered.status in ("completed", "incomplete")
    assert (
        answered.usage.input_tokens > called.usage.input_tokens
    )  # the call and its result are in the prompt
    # tool_choice by name, streamed: the arguments arrive as deltas
    with client.responses.stream(
        model=model,
        input="Weather in Rome?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    (item,) = final.output
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == item.arguments and json.loads(arguments)["city"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == arguments


def test_text_format_json_schema(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    response = client.responses.create(
        model=model,
        input="Describe a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
        max_output_tokens=40,
    )
    value = json.loads(response.output_text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert response.text.format.type == "json_schema"


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input="Name a fruit.", max_output_tokens=8)
    second = client.responses.create(
        model=model, input="Name another.", previous_response_id=first.id, max_output_tokens=8
    )
    assert second.previous_response_id == first.id
    # the same conversation sent in full: the same prompt, token for token (greedy: the same answer)
    full = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Name another."},
        ],
        max_output_tokens=8,
    )
    assert second.usage.input_tokens == full.usage.input_tokens
    assert second.output_text == full.output_text
    # store: false keeps nothing
    unstored = client.responses.create(model=model, input="Hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(
            model=model, input="Hi", previous_response_id=unstored.id, max_output_tokens=2
        )
    assert raised.value.body["code"] == "previous_response_not_found"
    assert raised.value.body["param"] == "previous_response_id"


def test_the_store_is_bounded_least_recently_used_out() -> None:
    store = ResponseStore(2)
    turn = [ChatMessage(role="user", content="x")]
    done = {"status": "completed"}
    for name in ("a", "b"):
        store.put(name, StoredResponse(done, turn))
    store.conversation("a")  # a is now the most recently used
    store.put("c", StoredResponse(done, turn))
    assert len(store) == 2
    assert store.conversation("a") == turn and store.conversation("c") == turn
    with pytest.raises(Exception, match="no stored response"):
        store.conversation("b")
    empty = ResponseStore(0)
    empty.put("a", StoredResponse(done, turn))
    assert len(empty) == 0


def test_the_store_never_evicts_a_background_response_that_runs() -> None:
    """Evicting one would lose a generation its client polls for; only finished responses go."""
    store = ResponseStore(2)
    store.put("running", StoredResponse({"status": "in_progress"}, background=True))
    store.put("queued", StoredResponse({"status": "queued"}, background=True))
    store.put("done", StoredResponse({"status": "completed"}, []))
    assert len(store) == 2
    assert store.get("running").status == "in_progress" and store.get("queued").status == "queued"
    with pytest.raises(Exception, match="no stored response"):
        store.get("done")
    with pytest.raises(Exception, match="is in_progress") as raised:  # nothing to continue from yet
        store.conversation("running")
    assert raised.value.code == "previous_response_not_completed"


MODEL = "SmolLM2-135M-Instruct"
# (case id, body, param, code): each bad field named in the Responses API's own terms
BAD = [
    ("no-input", {"model": MODEL}, "input", "invalid_value"),
    ("empty-input-list", {"model": MODEL, "input": []}, "input", "invalid_value"),
    ("unknown-item", {"model": MODEL, "input": [{"type": "reasoning", "summary": []}]}, "input.0", "invalid_value"),
    ("image-part", {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0.type", "invalid_value"),
    ("call-without-call-id", {"model": MODEL, "input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", "invalid_value"),
    ("orphan-call-output", {"model": MODEL, "input": [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "call_1", "output": "y"}]}, "input.1", "inconsistent_parameters"),
    ("max-output-tokens-above-cap", {"model": MODEL, "input": "x", "max_output_tokens": 1000}, "max_output_tokens", "max_tokens_exceeded"),
    ("max-output-tokens-zero", {"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ("web-search-tool", {"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "invalid_value"),
    ("tool-choice-unknown-function", {"model": MODEL, "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "inconsistent_parameters"),
    ("json-schema-without-name", {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name", "inconsistent_parameters"),
    ("json-schema-that-does-not-compile", {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "text.format.schema", "invalid_grammar"),
    ("unknown-previous-response", {"model": MODEL, "input": "x", "previous_response_id": "resp_nope"}, "previous_response_id", "previous_response_not_found"),
    ("unknown-model", {"model": "gpt-5", "input": "x"}, "model", "model_not_found"),
    # what OpenAI refuses too (issue 35)
    ("empty-input", {"model": MODEL, "input": ""}, "input", "invalid_value"),
    ("empty-previous-response-id", {"model": MODEL, "input": "x", "previous_response_id": ""}, "previous_response_id", "invalid_value"),
    ("json-schema-without-schema", {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema", "inconsistent_parameters"),
    ("schema-name-with-a-space", {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "my schema", "schema": {"type": "object"}}}}, "text.format.name", "invalid_value"),
    ("schema-name-of-65-characters", {"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema", "name": "n" * 65, "schema": {"type": "object"}}}}, "text.format.name", "invalid_value"),
    ("background-without-store", {"model": MODEL, "input": "x", "background": True, "store": False}, "store", "inconsistent_parameters"),
    ("truncation-unknown", {"model": MODEL, "input": "x", "truncation": "middle"}, "truncation", "invalid_value"),
    ("include-unknown", {"model": MODEL, "input": "x", "include": ["usage.details"]}, "include.0", "invalid_value"),
    ("reasoning-effort-unknown", {"model": MODEL, "input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "invalid_value"),
    # what OpenAI honours and this server cannot: refused, never ignored
    ("reasoning-effort", {"model": MODEL, "input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort", "unsupported_parameter"),
    ("reasoning-summary", {"model": MODEL, "input": "x", "reasoning": {"summary": "auto"}}, "reasoning.summary", "unsupported_parameter"),
    ("include-logprobs", {"model": MODEL, "input": "x", "include": ["message.output_text.logprobs"]}, "include", "unsupported_parameter"),
    ("top-logprobs", {"model": MODEL, "input": "x", "top_logprobs": 3}, "top_logprobs", "unsupported_parameter"),
    ("conversation", {"model": MODEL, "input": "x", "conversation": "conv_1"}, "conversation", "unsupported_parameter"),
    ("stored-prompt", {"model": MODEL, "input": "x", "prompt": {"id": "pmpt_1"}}, "prompt", "unsupported_parameter"),
    ("context-management", {"model": MODEL, "input": "x", "context_management": [{"type": "compaction"}]}, "context_management", "unsupported_parameter"),
    ("background-with-stream", {"model": MODEL, "input": "x", "background": True, "stream": True}, "background", "unsupported_parameter"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "code"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_a_400_naming_the_field(api_server: Server, body: dict, param: str, code: str) -> None:
    with api_server.client() as http:
        status = 404 if code == "model_not_found" else 400
        assert_openai_error(http.post("/v1/responses", json=body), status, param=param, code=code)


def test_what_is_harmless_is_accepted(client: openai.OpenAI, model: str) -> None:
    """Values this server honours as OpenAI would (no reasoning, nothing to truncate, nothing to include
    from items it never makes) are served, and the response says what it did. Lossless speculation: csd's
    memory learns between requests, so its greedy text may change from one to the next."""
    asked = {"model": model, "input": "Name a fruit.", "max_output_tokens": 6}
    lossless = {"speculative": {"method": "sd"}}
    plain = client.responses.create(**asked, extra_body=lossless)
    for extra in (
        {"reasoning": {"effort": "none"}},
        {"reasoning": {"effort": None, "summary": None}},
        {"include": ["reasoning.encrypted_content", "file_search_call.results"]},
        {"truncation": "disabled"},
        {"truncation": "auto"},
        {"top_logprobs": 0},
        {"service_tier": "auto", "prompt_cache_key": "k", "safety_identifier": "u1", "max_tool_calls": 2},
    ):
        response = client.responses.create(**asked, **extra, extra_body=lossless)
        assert response.output_text == plain.output_text, extra
        if "truncation" in extra:
            assert response.truncation == extra["truncation"]
        if "reasoning" in extra:
            assert response.reasoning.effort == extra["reasoning"]["effort"]


def test_truncation_auto_over_the_context_says_nothing_is_truncated(api_server: Server) -> None:
    body = {"model": MODEL, "input": "word " * 9000, "truncation": "auto"}
    with api_server.client() as http:
        error = assert_openai_error(
            http.post("/v1/responses", json=body), 400, code="context_length_exceeded"
        )
    assert "truncation 'auto' drops nothing" in error["message"]


def test_function_call_arguments_that_are_no_json_go_back_as_they_were(
    client: openai.OpenAI, model: str
) -> None:
    """As in chat (tests/api/test_tools.py): a model may write invalid arguments, or be cut by the token
    budget, and an agent loop sends its call back; the conversation goes on instead of ending in a 400."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Par'}
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "error: bad arguments"}
    response = client.responses.create(
        model=model,
        input=[{"role": "user", "content": QUESTION}, call, answer],
        tools=[WEATHER],
        max_output_tokens=8,
    )
    plain = client.responses.create(model=model, input=QUESTION, tools=[WEATHER], max_output_tokens=8)
    assert response.usage.input_tokens > plain.usage.input_tokens  # the broken call reached the prompt


def test_needs_the_api_key(api_server: Server) -> None:
    response = httpx.post(f"{api_server.url}/v1/responses", json={"model": MODEL, "input": "x"}, timeout=30)
    assert_openai_error(response, 401)
