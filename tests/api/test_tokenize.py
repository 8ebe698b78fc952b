"""The small endpoints around generation, through real HTTP: vLLM's /tokenize, /detokenize and /version,
`max_model_len` on /v1/models, and `x-request-id` on every response (streams and errors included)."""

from __future__ import annotations

import httpx
import openai
import pytest

from service import __version__
from tests.api.conftest import API_KEYS, Server, assert_openai_error

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings
CHAT = [{"role": "user", "content": "Hello there"}]


def test_models_report_max_model_len(api_server: Server) -> None:
    with api_server.client() as http:
        listed = http.get("/v1/models").json()["data"]
        one = http.get(f"/v1/models/{MODEL}").json()
    assert [card["max_model_len"] for card in listed] == [CONTEXT]
    assert one["max_model_len"] == CONTEXT and one["id"] == MODEL
    client = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS[0], max_retries=0)
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == CONTEXT


def test_tokenize_a_prompt_and_back(api_server: Server) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    with api_server.client() as http:
        data = http.post("/tokenize", json={"model": MODEL, "prompt": text, "return_token_strs": True}).json()
        assert set(data) == {"count", "max_model_len", "tokens", "token_strs"}
        assert data["count"] == len(data["tokens"]) == len(data["token_strs"]) > 5
        assert data["max_model_len"] == CONTEXT
        assert data["token_strs"][1] == "Ġquick"  # the tokenizer's own piece, as vLLM returns it
        back = http.post("/detokenize", json={"model": MODEL, "tokens": data["tokens"]}).json()
        assert back == {"prompt": text}
        # model is optional (vLLM's too); without return_token_strs there is no token_strs key
        plain = http.post("/tokenize", json={"prompt": text}).json()
        assert set(plain) == {"count", "max_model_len", "tokens"} and plain["tokens"] == data["tokens"]
        empty = http.post("/tokenize", json={"prompt": ""}).json()
        assert empty["count"] == 0 and empty["tokens"] == []


def test_tokenize_messages_counts_the_chat_prompt_exactly(api_server: Server) -> None:
    with api_server.client() as http:
        tokenized = http.post("/tokenize", json={"model": MODEL, "messages": CHAT}).json()
        completion = http.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1}
        ).json()
        text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
        without_prompt = http.post(
            "/tokenize", json={"messages": CHAT, "add_generation_prompt": False}
        ).json()
    # The count is the prompt a chat completion of these messages really uses.
    assert tokenized["count"] == completion["usage"]["prompt_tokens"]
    assert text.endswith("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
    assert tokenized["tokens"][: without_prompt["count"]] == without_prompt["tokens"]
    assert without_prompt["count"] < tokenized["count"]


def test_tokenize_messages_continuing_the_last_one(api_server: Server) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "General Kenobi"}]
    with api_server.client() as http:
        tokens = http.post("/tokenize", json={"messages": messages, "continue_final_message": True}).json()
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        both = {"messages": messages, "continue_final_message": True, "add_generation_prompt": True}
        assert_openai_error(http.post("/tokenize", json=both), 400)
    assert text.endswith("<|im_start|>assistant\nGeneral Kenobi")  # left open, for the model to go on


BAD = [
    ("both-inputs", "/tokenize", {"prompt": "x", "messages": CHAT}, 400, None),
    ("no-input", "/tokenize", {"model": MODEL}, 400, None),
    ("prompt-not-text", "/tokenize", {"prompt": 5}, 400, "prompt"),
    ("bad-message", "/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role"),
    ("unknown-model", "/tokenize", {"model": "gpt-4o", "prompt": "x"}, 404, "model"),
    ("unknown-model-detok", "/detokenize", {"model": "gpt-4o", "tokens": [1]}, 404, "model"),
    ("token-too-big", "/detokenize", {"tokens": [1, 2, 10_000_000]}, 400, "tokens.2"),
    ("token-negative", "/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("token-not-int", "/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
    ("token-huge", "/detokenize", {"tokens": [2**70]}, 400, "tokens.0"),
    # JSON may escape a lone surrogate, which UTF-8 (and so the tokenizer) cannot hold
    ("lone-surrogate", "/tokenize", b'{"prompt": "\\ud800"}', 400, "prompt"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_tokenizer_requests(
    api_server: Server, path: str, body: dict | bytes, status: int, param: str | None
) -> None:
    with api_server.client() as http:
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = http.post(path, json=body)
        assert_openai_error(response, status, param=param)


def test_tokenizer_endpoints_need_the_key_and_version_does_not(api_server: Server) -> None:
    with httpx.Client(base_url=api_server.url, timeout=60) as http:
        assert_openai_error(http.post("/tokenize", json={"prompt": "x"}), 401, code="invalid_api_key")
        assert_openai_error(http.post("/detokenize", json={"tokens": [1]}), 401, code="invalid_api_key")
        assert http.get("/version").json() == {"version": __version__}


def test_request_id_is_echoed_or_made_up(api_server: Server) -> None:
    with api_server.client() as http:
        echoed = http.get("/v1/models", headers={"X-Request-Id": "my-trace-42"})
        assert echoed.headers["x-request-id"] == "my-trace-42"
        made = [http.get("/v1/models").headers["x-request-id"] for _ in range(2)]
        assert made[0] != made[1] and all(len(m) == 32 for m in made)
        # A header that is not short printable ASCII is replaced, never passed on to logs and proxies.
        for bad in ("x" * 129, "has space", "tab\tinside"):
            replaced = http.get("/v1/models", headers={"X-Request-Id": bad}).headers["x-request-id"]
            assert replaced != bad and len(replaced) == 32


def test_request_id_on_streams_and_on_errors(api_server: Server) -> None:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "stream": True}
    with api_server.client() as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": "s-1"}) as r:
            assert r.status_code == 200 and r.headers["x-request-id"] == "s-1"
            r.read()
        assert (
            http.post("/v1/completions", json={}, headers={"x-request-id": "e-400"}).headers["x-request-id"]
            == "e-400"
        )
        assert (
            http.get("/no/such/route", headers={"x-request-id": "e-404"}).headers["x-request-id"] == "e-404"
        )
        big = http.post(
            "/v1/completions", content=b"x" * 2_000_000, headers={"x-request-id": "e-413"}
        )  # refused by the body limit, before any route
        assert big.status_code == 413 and big.headers["x-request-id"] == "e-413"
    with httpx.Client(base_url=api_server.url, timeout=60) as anonymous:
        unauthorized = anonymous.get("/v1/models", headers={"x-request-id": "e-401"})
        assert unauthorized.status_code == 401 and unauthorized.headers["x-request-id"] == "e-401"
    # The official client reads it too (for its own request-id logging).
    client = openai.OpenAI(base_url=f"{api_server.url}/v1", api_key=API_KEYS[0], max_retries=0)
    raw = client.models.with_raw_response.list(extra_headers={"x-request-id": "c-1"})
    assert raw.headers["x-request-id"] == "c-1"


def test_tokenizer_info_names_the_special_tokens_and_the_template(api_server: Server) -> None:
    with api_server.client() as http:
        info = http.get("/tokenizer_info").json()
        eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert info["eos_token"] == "<|im_end|>" and len(eos["tokens"]) == 1  # one token: lm-eval's eot id
    assert "<|im_start|>" in info["chat_template"]
    assert info["model_max_length"] == 8192 and info["vocab_size"] == 49152
    assert httpx.get(f"{api_server.url}/tokenizer_info").status_code == 401  # behind the key, like /tokenize


def test_tokenize_messages_with_the_special_tokens(api_server: Server) -> None:
    """add_special_tokens with messages (a 500 once: transformers 5's tokenizers dropped the method we used)."""
    with api_server.client() as http:
        plain = http.post("/tokenize", json={"messages": CHAT}).json()
        marked = http.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True})
    assert marked.status_code == 200, marked.text
    # SmolLM2's tokenizer adds nothing around a text: the same ids
    assert marked.json()["tokens"] == plain["tokens"]


def test_special_tokens_around_a_text_are_found_both_sides() -> None:
    """The tokenizer's own additions (here BOS and EOS from a post-processor) go around the chat's ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    from service.api.routers.tokenize import _special_tokens

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}
    backend = Tokenizer(WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    backend.post_processor = TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 1), ("</s>", 2)]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert _special_tokens(tokenizer) == ([1], [2])
