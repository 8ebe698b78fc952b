"""Third-party clients people point at OpenAI-compatible servers, unchanged, against a real server:
LangChain's `ChatOpenAI` (structured output; tool binding is in test_tools.py), instructor (JSON-schema and tools
modes) and lm-eval (loglikelihood through local-completions)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field

from tests.api.conftest import API_KEYS, Server


class City(BaseModel):
    """A city and the country it is in."""

    name: str = Field(max_length=30, description="the city's name")
    country: str = Field(max_length=30, description="the country it is in")
    population_millions: float = Field(ge=0, le=50, multiple_of=0.1)


QUESTION = "Name a large European city, its country and its population in millions."


@pytest.fixture(scope="module")
def model_name(api_server: Server) -> str:
    import httpx

    return httpx.get(f"{api_server.url}/v1/models", headers=api_server.headers).json()["data"][0]["id"]


def test_langchain_with_structured_output(api_server: Server, model_name: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=model_name, base_url=f"{api_server.url}/v1", api_key=API_KEYS[0], max_tokens=64, max_retries=0
    )
    # LangChain's default structured output: a strict json_schema response_format, parsed into the model
    city = llm.with_structured_output(City).invoke(QUESTION)
    assert isinstance(city, City) and city.name
    # JSON mode constrains to some object (following the schema is the model's business): it parses
    reply = llm.bind(response_format={"type": "json_object"}).invoke(QUESTION + " Answer in JSON.")
    assert isinstance(json.loads(reply.content), dict)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor(api_server: Server, model_name: str, mode: str) -> None:
    """instructor's default TOOLS mode (a named tool_choice whose arguments the server enforces by their
    schema) and its JSON_SCHEMA mode (a json_schema response_format)."""
    import instructor
    import openai

    raw = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS[0], max_retries=0)
    client = (
        instructor.from_openai(raw)
        if mode == "TOOLS"
        else instructor.from_openai(raw, mode=instructor.Mode.JSON_SCHEMA)
    )
    assert client.mode is instructor.Mode[mode]  # TOOLS: what a user gets without choosing
    city = client.chat.completions.create(
        model=model_name,
        response_model=City,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=64,
        max_retries=0,
    )
    assert isinstance(city, City) and city.name


def test_lm_eval_local_completions_loglikelihood(api_server: Server, model_name: str) -> None:
    """lm-eval's `local-completions` model, as an evaluation harness drives it: it finds the server's
    tokenizer endpoints by itself (/tokenizer_info, /tokenize, /detokenize: no local tokenizer), then sends
    token-id prompts in batches with `echo`, `logprobs: 1` and `max_tokens: 1`."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        base_url=f"{api_server.url}/v1/completions",
        model=model_name,
        batch_size=2,
        max_retries=1,
        auth_token=API_KEYS[0],
        header={"Authorization": f"Bearer {API_KEYS[0]}"},
    )
    assert lm.tokenizer_backend == "remote"
    pairs = [
        ("The capital of France is", " Paris"),
        ("The capital of France is", " a banana"),
        ("Two plus two equals", " four"),
        ("Two plus two equals", " purple"),
    ]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    results = lm.loglikelihood(requests, disable_tqdm=True)
    assert len(results) == 4 and all(isinstance(lp, float) and lp < 0 for lp, _ in results)
    assert results[0][0] > results[1][0] and results[2][0] > results[3][0]
    assert results[0][1] is True  # " Paris" is the greedy continuation: lm-eval's is_greedy
