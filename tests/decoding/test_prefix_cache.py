"""Automatic prefix caching: outputs with the cache equal outputs without it, and the cache does its job.

Real embedded model and a tiny random Llama. At temperature 0 every method (vanilla, sd, csd) emits the same
tokens with and without the cache; a mismatch is shown with its logit gap (`assert_same_tokens`), never
excused. A shared system prompt gives hits; the bound holds under eviction; n > 1 shares one lookup; a batch
mixes rows that hit and rows that miss; rejected draft tokens never enter the cache.
"""

from __future__ import annotations

import pytest
import torch

from ocm_store import InMemoryStore, Namespace
from service.decoding import Engine, ModelDrafter, NgramDrafter, SamplingParams, SpeculativeConfig, run_alone
from service.decoding.batch import Batch
from service.decoding.prefix_cache import PrefixCache, prefix_caching_unsupported
from service.decoding.text import encode_chat
from service.decoding.types import DecodingError
from tests.conftest import make_tiny_model
from tests.decoding.test_lossless import assert_same_tokens

pytestmark = pytest.mark.usefixtures("single_thread")

MAX_TOKENS = 10
CHUNK = 48  # max_batched_tokens: several prefill chunks per prompt
SYSTEM = (
    "You are a careful assistant for a hardware shop. Answer in one or two sentences. Tools: "
    "lookup_stock(sku) returns the units in stock; price(sku) returns the price in euros; "
    "order(sku, units) places an order. Never invent a SKU. Always state the units."
)
QUESTIONS = ["How many hammers are in stock?", "What does a drill cost?", "Order two saws, please."]
BIG = 1 << 30


def chat(tokenizer, question: str, system: str = SYSTEM) -> list[int]:
    return encode_chat(
        tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": question}]
    )


def make_engine(target, cache: PrefixCache | None, drafter=None) -> Engine:
    drafter = drafter or NgramDrafter()
    store = InMemoryStore()
    return Engine(target, {"d": drafter}, {"d": store.memory(Namespace("t", "d", "v"))}, prefix_cache=cache)


def spec_for(method: str) -> SpeculativeConfig:
    if method == "csd":  # lambda 0 and a low tau: rescues happen, so the cache is tested under csd's rule
        return SpeculativeConfig(method="csd", lambda_=0, tau=0.001)
    return SpeculativeConfig(method=method)


def decode(
    engine: Engine,
    prompts: list[list[int]],
    method: str,
    batch_size: int = 1,
    n: int = 1,
    max_tokens: int = MAX_TOKENS,
):
    """Every prompt through one batch (all joining at once when batch_size > 1); the generations."""
    batch = Batch(engine.target, engine.policy, max_batch_size=max(batch_size, n), max_batched_tokens=CHUNK)
    sampling = SamplingParams(max_tokens=max_tokens)
    pending = [
        [engine.generate(ids, sampling, spec_for(method), drafter="d") for _ in range(n)] for ids in prompts
    ]
    done = []
    while pending or len(batch):
        while pending and batch.room() >= len(pending[0]):
            group = pending.pop(0)
            batch.add_group(group)
            done.extend(group)
        batch.step()
        assert not batch.failed
    return done


def ids_of(g) -> list[int]:
    return [t.token_id for t in g.tokens]


@pytest.fixture(scope="module")
def prompts(embedded) -> list[list[int]]:
    """Three questions under one system prompt, and one without it (a miss)."""
    colours = encode_chat(embedded.tokenizer, [{"role": "user", "content": "Name three colours."}])
    return [chat(embedded.tokenizer, q) for q in QUESTIONS] + [colours]


@pytest.fixture(scope="module")
def plain(embedded, prompts):
    """Each prompt decoded alone without a cache, per method (computed once, on first use)."""
    runs: dict[str, list[list[int]]] = {}

    def get(method: str) -> list[list[int]]:
        if method not in runs:
            runs[method] = [ids_of(g) for g in decode(make_engine(embedded, None), prompts, method)]
        return runs[method]

    return get


@pytest.mark.parametrize("method", ["vanilla", "sd", "csd"])
def test_embedded_same_tokens_with_and_without_cache(embedded, prompts, plain, method):
    prompts, expected = prompts[:3], plain(method)
    cache = PrefixCache(BIG)
    cached = decode(make_engine(embedded, cache), prompts, method)
    # the shared system prompt hit for the second and third question
    assert [g.stats.cached_tokens for g in cached][0] == 0
    assert all(g.stats.cached_tokens >= 48 for g in cached[1:])
    assert cache.stats.hits == sum(g.stats.cached_tokens for g in cached)
    assert cache.stats.queries == sum(len(p) for p in prompts)
    for p, a, b in zip(prompts, cached, expected, strict=False):
        assert_same_tokens(embedded, p, ids_of(a), b)
    # a resend of the first prompt now hits all but its last block's remainder, and still matches
    again = decode(make_engine(embedded, cache), prompts[:1], method)[0]
    assert again.stats.cached_tokens >= len(prompts[0]) - 1 - cache.block_size
    assert_same_tokens(embedded, prompts[0], ids_of(again), expected[0])


@pytest.mark.parametrize("method", ["vanilla", "sd"])
def test_tiny_model_same_tokens(embedded, tiny, method):
    """A second architecture shape (2 layers, 2 KV heads), with a draft model drafter: the drafter is fed
    the cached tokens as prefill, so its drafts, and sd's output, are as without the cache."""
    prompts = [chat(tiny.tokenizer, q) for q in QUESTIONS]
    drafter = ModelDrafter(make_tiny_model(embedded, seed=1))
    plain = decode(make_engine(tiny, None, drafter), prompts, method)
    cache = PrefixCache(BIG)
    cached = decode(make_engine(tiny, cache, drafter), prompts, method)
    assert cache.stats.hits > 0
    for p, a, b in zip(prompts, cached, plain, strict=True):
        assert_same_tokens(tiny, p, ids_of(a), ids_of(b))
    if method == "sd":  # the drafter saw the same prompt: the same drafts were verified
        assert [g.stats.num_draft_tokens for g in cached] == [g.stats.num_draft_tokens for g in plain]


def test_cached_keys_equal_a_prefill(embedded):
    """The blocks a hit loads are the keys and values a one-row prefill computes at those positions."""
    ids = chat(embedded.tokenizer, QUESTIONS[0])
    cache = PrefixCache(BIG)
    decode(make_engine(embedded, cache), [ids], "vanilla")
    hit = cache.lookup(ids)
    assert hit.tokens == (len(ids) // cache.block_size) * cache.block_size
    with torch.inference_mode():
        out = embedded.model(input_ids=torch.tensor([ids[: hit.tokens]]), use_cache=True)
    layer = out.past_key_values.layers[3]
    torch.testing.assert_close(hit.keys[3], layer.keys, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hit.values[3], layer.values, rtol=1e-4, atol=1e-4)


def test_mixed_hits_and_misses_in_one_batch_and_n_choices(embedded, prompts, plain):
    """A batch whose rows hit, partly hit (the shared system prompt) and miss, then a request for n = 2
    choices: every row emits what it emits alone without the cache."""
    expected = [plain("sd")[i] for i in (0, 1, 3)]
    prompts = [prompts[i] for i in (0, 1, 3)]
    cache = PrefixCache(BIG)
    decode(make_engine(embedded, cache), prompts[:1], "sd")  # warms the system prompt
    mixed = decode(make_engine(embedded, cache), prompts, "sd", batch_size=4, n=1)
    hits = [g.stats.cached_tokens for g in mixed]
    assert hits[0] > hits[1] > 0 and hits[2] == 0
    for p, a, b in zip(prompts, mixed, expected, strict=True):
        assert_same_tokens(embedded, p, ids_of(a), b)
    queries = cache.stats.queries
    choices = decode(make_engine(embedded, cache), prompts[1:2], "sd", n=2)
    assert cache.stats.queries - queries == len(prompts[1])  # one lookup for the group
    assert [g.stats.cached_tokens for g in choices] == [choices[0].stats.cached_tokens] * 2 > [0]
    for g in choices:
        assert_same_tokens(embedded, prompts[1], ids_of(g), expected[1])


def test_committed_tokens_enter_the_cache_and_rejected_drafts_do_not(embedded):
    """A finished sequence's committed tokens are stored: a next turn that resends the answer hits it.
    The stored blocks are exactly the committed tokens (chain keys of prompt + output), never a rejected
    draft token: each block's tokens are checked on lookup and match the committed sequence."""
    ids = chat(embedded.tokenizer, "Count from one to twenty in words, separated by commas.")
    cache = PrefixCache(BIG)
    g = decode(make_engine(embedded, cache), [ids], "sd", max_tokens=24)[0]
    assert g.stats.num_draft_tokens > g.stats.num_accepted  # some draft tokens were rejected
    committed = ids + ids_of(g)
    hit = cache.lookup(committed)
    assert hit.tokens == ((len(committed) - 1) // cache.block_size) * cache.block_size
    assert hit.tokens > len(ids)
    with torch.inference_mode():
        out = embedded.model(input_ids=torch.tensor([committed[: hit.tokens]]), use_cache=True)
    torch.testing.assert_close(hit.keys[-1], out.past_key_values.layers[-1].keys, rtol=1e-3, atol=1e-3)


def test_eviction_keeps_the_bound(embedded):
    prompts = [chat(embedded.tokenizer, q, system=f"Rule {i}. " * 8) for i, q in enumerate(QUESTIONS)]
    probe = PrefixCache(BIG)
    decode(make_engine(embedded, probe), prompts[:1], "vanilla", max_tokens=1)
    block_bytes = probe.bytes_used // len(probe)
    bound = 5 * block_bytes
    cache = PrefixCache(bound)
    decode(make_engine(embedded, cache), prompts, "vanilla", max_tokens=1)
    assert cache.bytes_used <= bound and len(cache) == 5
    assert cache.stats.evicted_blocks == cache.stats.stored_blocks - 5
    # the most recent sequence's root blocks are what is left: the last prompt's start hits
    assert cache.lookup(prompts[-1]).tokens > 0
    assert cache.lookup(prompts[0]).tokens == 0
    nothing = PrefixCache(0)
    decode(make_engine(embedded, nothing), prompts[:2], "vanilla", max_tokens=1)
    assert len(nothing) == 0 and nothing.bytes_used == 0


def test_lru_order_and_chain_keys():
    cache = PrefixCache(BIG, block_size=2)
    kv = [(torch.arange(12.0).reshape(1, 6, 2), torch.zeros(1, 6, 2))]
    assert cache.store([1, 2, 3, 4, 5, 6], kv) == 3
    assert cache.store([1, 2, 3, 4, 9, 9], kv) == 1  # shares two blocks, adds one
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7]).tokens == 6
    assert cache.lookup([1, 2, 3, 4, 9, 9]).tokens == 6
    assert cache.lookup([2, 1, 3, 4]).tokens == 0  # same block tokens, other prefix: other keys
    assert cache.lookup([1, 2, 3, 4, 5, 6], max_tokens=5).tokens == 4
    hit = cache.lookup([1, 2, 3])
    assert hit.tokens == 2 and hit.keys[0].shape == (1, 1, 2, 2)
    torch.testing.assert_close(hit.keys[0][0], kv[0][0][:, :2])


def test_unsupported_models_refuse_with_a_reason(embedded):
    assert prefix_caching_unsupported(embedded.model) is None
    from transformers import MistralConfig, MistralForCausalLM

    sliding = MistralForCausalLM(
        MistralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=8,
        )  # fmt: skip
    )
    reason = prefix_caching_unsupported(sliding)
    assert reason and "sliding" in reason
    from service.executor.models import LoadedModel

    loaded = LoadedModel(name="sliding", model=sliding, tokenizer=embedded.tokenizer, revision="0")
    with pytest.raises(DecodingError, match="sliding"):
        Engine(loaded, prefix_cache=PrefixCache(BIG))


def test_run_alone_uses_the_engine_cache(embedded):
    cache = PrefixCache(BIG)
    engine = make_engine(embedded, cache)
    ids = chat(embedded.tokenizer, QUESTIONS[2])
    for _ in range(2):
        g = engine.generate(
            ids, SamplingParams(max_tokens=4), SpeculativeConfig(method="vanilla"), drafter="d"
        )
        list(run_alone(g))
    assert g.stats.cached_tokens > 0
