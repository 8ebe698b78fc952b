"""Offline calibration records every rejection of strict SD in the memory, and nothing else."""

from __future__ import annotations

from ocm_store.base import Namespace
from ocm_store.memory import InMemoryStore
from service.calibration import calibrate, encode_item
from service.decoding import Engine, NgramDrafter
from service.decoding.text import encode_chat, encode_prompt

ITEMS = [
    {
        "prompt": "Rewrite in American spelling: The colour of the theatre was grey and the programme was late."
    },
    {"text": "The colour of the sky is"},
]


def test_calibrate_counts_every_divergence(embedded):
    store = InMemoryStore()
    namespace = Namespace("t", "ngram", "v")
    engine = Engine(embedded, {"ngram": NgramDrafter()}, {"ngram": store.memory(namespace)})
    seen = []
    result = calibrate(engine, ITEMS, max_tokens=16, on_prompt=lambda r: seen.append(r.prompts))
    assert seen == [1, 2]
    assert result.prompts == 2 and 0 < result.completion_tokens <= 32
    assert result.divergences > 0
    # one recorded pattern per rejection, and only from the ngram drafter's namespace
    assert sum(p.count for p in store.top(namespace, 10**9)) == result.divergences
    assert store.namespaces() == [namespace]


def test_encode_item_shapes(embedded):
    tok = embedded.tokenizer
    chat = encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert encode_item(tok, {"prompt": "hi"}) == chat
    assert encode_item(tok, {"messages": [{"role": "user", "content": "hi"}]}) == chat
    assert encode_item(tok, {"text": "hi"}) == encode_prompt(tok, "hi")
