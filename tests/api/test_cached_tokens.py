"""Usage that tells the truth about the prefix cache: `cached_tokens` on chat, completions and Responses,
streamed and not, through the official `openai` client, equal to what the server's prefix cache served (its
`vllm:prefix_cache_hits` counter moves by exactly that much)."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.api.conftest import Server

MODEL = "SmolLM2-135M-Instruct"


def _system() -> str:
    """A long system prompt no other test sent: its first request finds nothing cached."""
    tag = uuid.uuid4().hex[:8]
    return (
        f"Ticket {tag}. You are the support assistant of a bicycle shop. Be brief and friendly. Opening hours: "
        "Monday to Friday nine to six, Saturday ten to two, closed on Sundays and public holidays. Repairs "
        "take two days; a flat tyre is fixed while you wait. We sell city bikes, road bikes and children's "
        "bikes, and rent tandems by the day."
    )


def _cached(create, stream: bool, **request) -> int:
    """The cached tokens a chat or completions call reports, whole or in its streamed usage chunk."""
    if not stream:
        return create(**request).usage.prompt_tokens_details.cached_tokens
    chunks = create(**request, stream=True, stream_options={"include_usage": True})
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    return usage.prompt_tokens_details.cached_tokens


def _chat(client: openai.OpenAI, system: str, stream: bool) -> int:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "When are you open?"}]
    create = client.chat.completions.create
    return _cached(create, stream, model=MODEL, messages=messages, max_tokens=4, temperature=0)


def _completion(client: openai.OpenAI, system: str, stream: bool) -> int:
    prompt = f"{system}\nQuestion: when are you open?\nAnswer:"
    create = client.completions.create
    return _cached(create, stream, model=MODEL, prompt=prompt, max_tokens=4, temperature=0)


def _response(client: openai.OpenAI, system: str, stream: bool) -> int:
    kwargs = {"model": MODEL, "instructions": system, "input": "When are you open?", "max_output_tokens": 16}
    if not stream:
        return client.responses.create(**kwargs).usage.input_tokens_details.cached_tokens
    events = client.responses.create(**kwargs, stream=True)
    (done,) = [e for e in events if e.type == "response.completed"]
    return done.response.usage.input_tokens_details.cached_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("api", [_chat, _completion, _response], ids=["chat", "completions", "responses"])
def test_cached_tokens_are_what_the_prefix_cache_served(api_server: Server, api, stream: bool) -> None:
    client = openai.OpenAI(
        base_url=f"{api_server.url}/v1", api_key=api_server.api_key, max_retries=0, timeout=120
    )
    system = _system()
    hits = api_server.metrics().value("vllm:prefix_cache_hits_total")
    first = api(client, system, stream)
    after_first = api_server.metrics().value("vllm:prefix_cache_hits_total")
    second = api(client, system, stream)
    after_second = api_server.metrics().value("vllm:prefix_cache_hits_total")
    assert first == after_first - hits
    assert second == after_second - after_first
    assert second >= 64, "the repeated system prompt is served from the cache (its full 16-token blocks)"
