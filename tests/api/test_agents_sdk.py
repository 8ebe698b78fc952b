"""The OpenAI Agents SDK (`openai-agents`) against the real server over real HTTP, offline (tracing off):
a tool-using agent turn through `/v1/responses`, as the SDK calls it by default, run and streamed."""

from __future__ import annotations

import asyncio

import pytest

from tests.api.conftest import API_KEYS, Server

agents = pytest.importorskip("agents")  # the test extra installs it; CI has it

MODEL = "SmolLM2-135M-Instruct"


def _agent(api_server: Server, calls: list[str]):
    from openai import AsyncOpenAI

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    client = AsyncOpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS[0], max_retries=0, timeout=120)
    return agents.Agent(
        name="weather",
        instructions="Use get_weather, then answer.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        # required on the first turn; the SDK resets it to auto once the tool ran (reset_tool_choice)
        model_settings=agents.ModelSettings(tool_choice="required", max_tokens=48),
    )


@pytest.fixture(autouse=True)
def _offline() -> None:
    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers


def test_an_agent_calls_its_tool_and_answers(api_server: Server) -> None:
    calls: list[str] = []
    result = asyncio.run(
        agents.Runner.run(_agent(api_server, calls), "What is the weather in Paris?", max_turns=4)
    )
    assert calls == ["Paris"]  # the model's function_call reached the Python function, with its argument
    kinds = [type(item).__name__ for item in result.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, str) and result.final_output
    first, second = result.raw_responses
    # the second turn read the call and its output (function_call + function_call_output input items)
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


def test_a_streamed_agent_run(api_server: Server) -> None:
    calls: list[str] = []

    async def run() -> tuple[list[str], object]:
        streamed = agents.Runner.run_streamed(_agent(api_server, calls), "Weather in Rome?", max_turns=4)
        kinds = [event.type async for event in streamed.stream_events()]
        return kinds, streamed.final_output

    kinds, final = asyncio.run(run())
    assert calls == ["Rome"]
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert isinstance(final, str) and final
