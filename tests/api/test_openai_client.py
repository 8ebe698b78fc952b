"""The official `openai` package against a real server: what existing clients do, unchanged."""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import API_KEYS, Server

CHAT = [{"role": "user", "content": "List three colours, separated by commas."}]
PROMPT = "The three primary colours are"


def test_models_list_names_the_served_model(client: openai.OpenAI, model: str) -> None:
    assert model == "SmolLM2-135M-Instruct"
    assert client.models.retrieve(model).id == model


def test_completion_and_its_stream_agree(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    choice = full.choices[0]
    assert choice.text and choice.finish_reason in ("stop", "length")
    assert full.object == "text_completion" and full.model == model
    usage = full.usage
    assert usage is not None and 1 <= usage.completion_tokens <= 12
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    speculative = full.model_extra["speculative"]
    assert speculative["method"] == "csd" and speculative["drafter"] == "combined"
    assert speculative["target_forwards"] >= 1

    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text  # greedy: the stream carries exactly the same text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == usage.completion_tokens


def test_chat_completion_and_its_stream_agree(client: openai.OpenAI, model: str) -> None:
    # strict: csd's memory learns from the first request, so the second could rescue differently
    strict = {"speculative": {"method": "sd"}}
    full = client.chat.completions.create(
        model=model, messages=CHAT, max_completion_tokens=12, extra_body=strict
    )
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert full.object == "chat.completion"
    assert full.usage is not None and full.usage.completion_tokens <= 12

    stream = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=strict,
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the stream's statistics are the generation's own (the draft policy adapts between the two requests,
    # so their forward counts may differ: a request's draft lengths follow the traffic before it)
    streamed = chunks[-1].model_extra["speculative"]
    assert streamed["method"] == "sd" and 1 <= streamed["target_forwards"] <= streamed["draft_tokens"] + 13


def test_chat_stop_sequence_ends_the_text(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Count from 1 to 10, one number per line."}]
    free = client.chat.completions.create(model=model, messages=messages, max_tokens=24)
    assert "\n" in free.choices[0].message.content, "the prompt should make the model write several lines"
    stopped = client.chat.completions.create(model=model, messages=messages, max_tokens=24, stop=["\n"])
    assert stopped.choices[0].finish_reason == "stop"
    assert "\n" not in stopped.choices[0].message.content
    assert free.choices[0].message.content.startswith(stopped.choices[0].message.content)


def test_sampling_with_a_seed_repeats(client: openai.OpenAI, model: str) -> None:
    # vanilla: with speculation the seed fixes the random stream, but the draft lengths the adaptive policy
    # picks (learnt from the traffic before) decide how it is consumed (docs/openai-api.md, "seed")
    kwargs = dict(
        model=model,
        messages=CHAT,
        max_tokens=10,
        temperature=1.0,
        top_p=0.95,
        seed=1234,
        extra_body={"speculative": {"method": "vanilla"}},
    )
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    second = client.chat.completions.create(**kwargs).choices[0].message.content
    assert first == second


def test_errors_raise_the_matching_openai_exceptions(api_server: Server, model: str) -> None:
    wrong = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    client = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS[1], max_retries=0)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert not_found.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=2, n=99)
    assert bad.value.body["param"] == "n"


def test_an_open_question_with_the_trained_drafter(client: openai.OpenAI, model: str) -> None:
    """What a new user does: ask an open question with each drafter; strict SD says exactly what plain
    decoding says, each answer names its drafter, and the head's drafts reach verification. Which drafter
    keeps more per forward is the drafters' business at a fixed length (tests/decoding/test_draft_head.py):
    here the server's adaptive policy verifies as much as pays on this machine, so the ratio is the policy's."""
    question = [{"role": "user", "content": "Why do leaves change colour in autumn?"}]
    answers = {}
    for drafter in ("ngram", "head", "combined"):
        answers[drafter] = client.chat.completions.create(
            model=model,
            messages=question,
            max_tokens=48,
            temperature=0,
            extra_body={"speculative": {"method": "sd", "drafter": drafter}},
        )
    vanilla = client.chat.completions.create(
        model=model,
        messages=question,
        max_tokens=48,
        temperature=0,
        extra_body={"speculative": {"method": "vanilla"}},
    )
    speculative = {d: a.model_extra["speculative"] for d, a in answers.items()}
    assert all(a.choices[0].message.content == vanilla.choices[0].message.content for a in answers.values())
    assert {d: s["drafter"] for d, s in speculative.items()} == {d: d for d in answers}
    assert speculative["head"]["draft_tokens"] > 0 and speculative["head"]["tokens_per_forward"] >= 1.0
