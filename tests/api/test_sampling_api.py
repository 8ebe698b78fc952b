"""Structured output, logprobs, n, penalties and vLLM's sampling extras through the official `openai`
client against a real server: each honoured (stream and not), each bad value a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.api.conftest import Server, assert_openai_error

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person: name, age and city."}]


@pytest.fixture(scope="module")
def http(api_server: Server):
    with api_server.client(timeout=120) as c:
        yield c


def spec(method: str) -> dict:
    return {"speculative": {"method": method}}


# ---------------------------------------------------------------- structured output


@pytest.mark.parametrize("method", ["vanilla", "sd", "csd"])
def test_json_schema_response_format_parses_and_validates(client, model, method):
    r = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
        extra_body=spec(method),
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    if method != "vanilla":  # the schema's keys are forced: drafted for free
        assert r.model_extra["speculative"]["tokens_per_forward"] > 1


class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: str = Field(max_length=20)
    legs: int = Field(ge=0, le=8)


def test_the_clients_own_structured_output_helper(client, model):
    """openai's `parse` sends a strict json_schema built from a pydantic model and parses the reply."""
    r = client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Describe a pet."}],
        max_tokens=64,
        response_format=Pet,
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.legs <= 8


def test_json_object_stream_concatenates_to_one_object(client, model):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give a JSON object describing a book."}],
        max_tokens=64,
        response_format={"type": "json_object"},
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    if finish == ["stop"]:
        assert isinstance(json.loads(text), dict), text
    else:  # cut by the token cap: still a valid prefix of an object
        assert finish == ["length"] and text.startswith("{")


@pytest.mark.parametrize(
    "structured, check",
    [
        ({"regex": r"(yes|no), because [a-z ]{1,30}\."}, lambda s: s.split(",")[0] in ("yes", "no")),
        ({"choice": ["red", "green", "blue"]}, lambda s: s in ("red", "green", "blue")),
        ({"grammar": 'start: "A" | "B"'}, lambda s: s in ("A", "B")),
        ({"grammar": 'root ::= "up" | "down"'}, lambda s: s in ("up", "down")),  # GBNF too
        ({"json": json.dumps(PERSON)}, lambda s: jsonschema.validate(json.loads(s), PERSON) is None),
    ],
    ids=["regex", "choice", "lark", "gbnf", "json-string"],
)
def test_vllm_structured_outputs(client, model, structured, check):
    r = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=64, extra_body={"structured_outputs": structured}
    )
    text = r.choices[0].message.content
    assert check(text), text


def test_completions_take_response_format_too(client, model):
    r = client.completions.create(
        model=model, prompt="A JSON person:", max_tokens=64,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


# ---------------------------------------------------------------- logprobs


def test_chat_logprobs_one_entry_per_token_with_alternatives(client, model):
    r = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8") == r.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-6
        assert entry.top_logprobs[0].token == entry.token  # greedy: the chosen token is the best one


def test_chat_logprobs_stream_equal_the_json_ones(client, model):
    args = dict(model=model, messages=ASK, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**args).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in client.chat.completions.create(**args, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in full
    ]


def test_echo_logprobs_score_a_prompt_like_generation_does(client, model, http):
    """Loglikelihood as lm-eval's local-completions asks for it (token ids, echo, max_tokens 0 / 1): the
    prompt's logprob of a token equals the logprob the same token got when it was generated."""
    prompt = "The capital of France is"
    generated = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    token_lp = generated.choices[0].logprobs.token_logprobs[0]
    scored = client.completions.create(
        model=model, prompt=prompt + generated.choices[0].text, max_tokens=0, echo=True, logprobs=1
    )
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt + generated.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[-1] == pytest.approx(token_lp, abs=2e-3)
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == scored.choices[0].text
    assert scored.usage.completion_tokens == 0


def test_token_id_prompt_batches_number_their_choices(client, model):
    batch = [[504, 3575, 282, 4649, 314], [504, 1012, 282]]
    r = client.completions.create(
        model=model, prompt=batch, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    assert [c.index for c in r.choices] == [0, 1]
    for choice, ids in zip(r.choices, batch, strict=True):
        assert len(choice.logprobs.token_logprobs) == len(ids) + 1
        assert all(isinstance(x, float) for x in choice.logprobs.token_logprobs[1:])
        tokens = choice.logprobs.tokens
        for token, lp, top in zip(
            tokens[1:], choice.logprobs.token_logprobs[1:], choice.logprobs.top_logprobs[1:], strict=True
        ):
            assert top[token] == lp  # the chosen token is among its alternatives, with its own logprob
            assert lp <= 0
    assert r.usage.prompt_tokens == sum(len(ids) for ids in batch)


# ---------------------------------------------------------------- n and sampling controls


def test_n_choices_share_a_prompt(client, model):
    # strict: csd's memory learns while the choices run, so two csd choices may rescue differently
    greedy = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=10, temperature=0, n=2, extra_body=spec("sd")
    )
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    # vanilla: the speculative methods' random draws depend on the draft lengths the shared policy picks
    seeded = dict(model=model, messages=ASK, max_tokens=16, temperature=1.0, seed=7, n=3)
    sampled = client.chat.completions.create(**seeded, extra_body=spec("vanilla"))
    texts = [c.message.content for c in sampled.choices]
    assert len(set(texts)) > 1, texts  # each choice samples its own stream
    assert sampled.usage.completion_tokens > 16  # summed over the choices
    again = client.chat.completions.create(**seeded, extra_body=spec("vanilla"))
    assert [c.message.content for c in again.choices] == texts  # seeded: reproducible
    # any integer seeds, modulo 2^64 (the width of torch's generator): past 64 bits or negative
    for wide in (7 + 2**64, 7 - 2**64, 7 + 5 * 2**70):
        folded = client.chat.completions.create(**{**seeded, "seed": wide}, extra_body=spec("vanilla"))
        assert [c.message.content for c in folded.choices] == texts, wide


def test_n_choices_stream_with_their_indexes(client, model):
    chunks = list(
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=8, n=2, stream=True, temperature=0, extra_body=spec("sd")
        )
    )
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and texts[0] == texts[1] and texts[0]


@pytest.mark.parametrize(
    "extra",
    [
        {"presence_penalty": 1.5, "frequency_penalty": 1.0},
        {"repetition_penalty": 1.5},
    ],
    ids=["openai-penalties", "repetition"],
)
def test_penalties_change_the_output_and_sd_stays_equal_to_vanilla(client, model, extra):
    messages = [{"role": "user", "content": "Repeat the word 'cat' ten times."}]
    kwargs = dict(model=model, messages=messages, max_tokens=32, temperature=0)
    openai_fields = {k: v for k, v in extra.items() if k in ("presence_penalty", "frequency_penalty")}
    vllm_fields = {k: v for k, v in extra.items() if k not in openai_fields}
    plain = client.chat.completions.create(**kwargs, extra_body=spec("vanilla")).choices[0].message.content
    vanilla = (
        client.chat.completions.create(
            **kwargs, **openai_fields, extra_body={**spec("vanilla"), **vllm_fields}
        )
        .choices[0]
        .message.content
    )
    sd = (
        client.chat.completions.create(**kwargs, **openai_fields, extra_body={**spec("sd"), **vllm_fields})
        .choices[0]
        .message.content
    )
    assert vanilla != plain
    assert sd == vanilla


@pytest.fixture(scope="module")
def tokenizer():
    from service.executor.models import load_tokenizer_for_display

    return load_tokenizer_for_display("embedded")


def test_logit_bias_min_tokens_ignore_eos_and_stop_token_ids(client, model, tokenizer):
    short = [{"role": "user", "content": "Answer with one word: what colour is the sky?"}]
    ended = client.chat.completions.create(model=model, messages=short, max_tokens=40, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 40
    ignored = client.chat.completions.create(
        model=model, messages=short, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert ignored.choices[0].finish_reason == "length" and ignored.usage.completion_tokens == 40
    longer = client.chat.completions.create(
        model=model, messages=short, max_tokens=40, temperature=0, extra_body={"min_tokens": 20}
    )
    assert longer.usage.completion_tokens >= 20
    # the calls below compare their texts: strict SD, so no rescue the OCM learnt in between changes them
    strict = {"method": "sd"}
    first = (
        client.chat.completions.create(
            model=model,
            messages=short,
            max_tokens=40,
            temperature=0,
            logprobs=True,
            extra_body={"speculative": strict},
        )
        .choices[0]
        .logprobs.content
    )
    # ban the greedy first token: the answer starts differently
    token_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(first[0].token))[0]
    banned = client.chat.completions.create(
        model=model, messages=short, max_tokens=5, temperature=0, logit_bias={str(token_id): -100},
        extra_body={"speculative": strict},
    )  # fmt: skip
    assert not banned.choices[0].message.content.startswith(first[0].token)
    stopped = client.chat.completions.create(
        model=model, messages=short, max_tokens=40, temperature=0,
        extra_body={
            "stop_token_ids": tokenizer.encode(first[2].token, add_special_tokens=False)[:1],
            "speculative": strict,
        },
    )  # fmt: skip
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == "".join(e.token for e in first[:2])


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "body, param",
    [
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 99}, "n"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias.abc"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias.5"),
        ({"stop_token_ids": [-1]}, "stop_token_ids.0"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"min_tokens": 100, "max_tokens": 10}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 5e-324}, "repetition_penalty"),  # divided logits into inf: a 500 once
    ],
)
def test_bad_values_are_400s_naming_the_field(http, model, body, param):
    r = http.post("/v1/chat/completions", json={"model": model, "messages": ASK, "max_tokens": 8, **body})
    assert_openai_error(r, 400, param=param)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [[1, 2], [3]], "stream": True}, "prompt"),
        ({"prompt": [1, 99999999]}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "best_of": 3}, "best_of"),
    ],
)
def test_bad_completion_values_are_400s_naming_the_field(http, model, body, param):
    r = http.post("/v1/completions", json={"model": model, "max_tokens": 4, **body})
    assert_openai_error(r, 400, param=param)


def test_scoring_with_n_choices_and_streamed_offsets(client, model):
    """Review findings: echo-only scoring answered one choice for n = 2, and a stream's text_offset restarted
    at 0 in every chunk."""
    scored = client.completions.create(
        model=model, prompt="Hello there", max_tokens=0, echo=True, logprobs=0, n=2
    )
    assert [c.index for c in scored.choices] == [0, 1]
    assert all(c.text == "Hello there" for c in scored.choices)
    chunks = list(
        client.completions.create(
            model=model, prompt="Count: one, two,", max_tokens=8, logprobs=1, stream=True
        )
    )
    offsets = [
        o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ]
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert len(offsets) > 2 and offsets[0] == 0
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]


def test_top_logprobs_zero_needs_no_logprobs_flag(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, max_tokens=2, top_logprobs=0)
    assert r.choices[0].logprobs is None


def test_chat_logprob_bytes_join_back_into_a_character_split_over_tokens(client, model):
    """Byte-level BPE splits an emoji over two tokens whose texts alone are U+FFFD: `bytes` holds each
    token's own bytes, which join back into the character (a review finding: they held the text's)."""
    r = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Reply with the emoji 😀 only."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body={"structured_outputs": {"choice": ["😀 yes"]}},
    )
    content = r.choices[0].logprobs.content
    assert r.choices[0].message.content == "😀 yes"
    assert any(entry.token == "\ufffd" for entry in content)  # a piece of the emoji, alone
    assert b"".join(bytes(entry.bytes) for entry in content).decode("utf-8") == "😀 yes"
