"""A k-token forward and a padded batch row give the same bits as one-token forwards of the sequence alone
(`service/executor/batch_invariant.py`), so strict SD stays exact, for every model whose matmuls round to bf16:
a bf16 model on a CPU with native bf16 matmuls (measured on AVX512-BF16; on CPUs that emulate bf16 the kernels
differ, so those tests skip there), and 4-bit weights in an fp32 body (what `--weights auto` serves for the
embedded model on a CPU without native bf16), which runs on every CPU."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers import DynamicCache

from service.decoding.text import encode_chat
from service.executor.batch_invariant import (
    ATTENTION,
    FP32_QUERY_BLOCK,
    ROW_BLOCK,
    FP32LogitsHead,
    FP32Norm,
    RowInvariantLinear,
    row_aligned_attention,
)
from service.executor.cpu_kernels import PackedLinear, has_native_bf16
from service.executor.int4_weights import int4_supported
from service.executor.models import load_model
from service.executor.q8_head import Q8Head, q8_kernel
from tests.decoding.test_batch import padded_and_solo_logits

pytestmark = pytest.mark.usefixtures("single_thread")
needs_native_bf16 = pytest.mark.skipif(not has_native_bf16(), reason="this CPU has no native bf16 matmuls")


@pytest.fixture(scope="module")
def bf16():
    if not has_native_bf16():
        pytest.skip("this CPU has no native bf16 matmuls")
    return load_model("embedded", dtype="bfloat16")


@pytest.fixture(scope="module")
def int4_fp32():
    if not int4_supported():
        pytest.skip("this torch build has no CPU int4 kernels")
    return load_model("embedded", dtype="float32", weights="int4")


@pytest.fixture(scope="module")
def int4_bf16():
    if not has_native_bf16() or not int4_supported():
        pytest.skip("this CPU has no native bf16 matmuls, or this torch build no CPU int4 kernels")
    return load_model("embedded", dtype="bfloat16", weights="int4")


@pytest.fixture(params=["bf16", "int4_fp32", "int4_bf16"])
def invariant(request):
    """Each batch-invariant model in turn."""
    return request.getfixturevalue(request.param)


@contextmanager
def head_inputs(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """The hidden states the LM head is fed, one tensor [B, T, d] a forward, while the block runs."""
    seen: list[torch.Tensor] = []
    hook = model.get_output_embeddings().register_forward_pre_hook(
        lambda _, args: seen.append(args[0].clone())
    )
    try:
        yield seen
    finally:
        hook.remove()


def assert_same_bits(loaded, got: torch.Tensor, want: torch.Tensor, got_hidden, want_hidden) -> None:
    """Logits (and the head's inputs) that batching must not change. A bf16 body's row-blocked fp32 head and
    the 8-bit one of a GGUF give bit-identical logits; an fp32 body's packed one may differ by fp32 rounding
    alone, on bit-identical inputs (the body's output)."""
    if isinstance(loaded.model.get_output_embeddings(), (FP32LogitsHead, Q8Head)):
        assert torch.equal(got, want)
        return
    assert torch.equal(got_hidden, want_hidden)
    assert float((got - want).abs().max()) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_native_bf16
def test_a_bf16_cpu_model_is_made_batch_invariant(bf16):
    assert bf16.model.config._attn_implementation == ATTENTION
    assert not any(type(m) is torch.nn.Linear for m in bf16.model.modules())
    assert any(isinstance(m, RowInvariantLinear) for m in bf16.model.modules())
    # a fp32 model keeps its own kernels, and so does a bf16 one loaded to write text compared with nothing
    assert load_model("embedded", dtype="float32").model.config._attn_implementation != ATTENTION
    writer = load_model("embedded", dtype="bfloat16", batch_invariant=False).model
    assert writer.config._attn_implementation != ATTENTION
    assert not any(isinstance(m, RowInvariantLinear) for m in writer.modules())


def chunks_and_one_token_forwards(loaded, prompt: str, chunks: list[int]) -> None:
    """Greedy decoding of `prompt` one token a forward, then the same tokens fed again in chunks of the given
    sizes after the same prefill: the chunks must give the one-token forwards' bits, position for position."""
    ids = encode_chat(loaded.tokenizer, [{"role": "user", "content": prompt}])
    model = loaded.model
    with torch.inference_mode(), head_inputs(model) as hidden:
        cache = DynamicCache()
        logits = model(input_ids=torch.tensor([ids]), cache=cache).logits[0, -1]
        tokens, single = [], []
        for _ in range(sum(chunks)):
            tokens.append(int(logits.argmax()))
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1]
            single.append(logits.float())
        chunked = DynamicCache()
        model(input_ids=torch.tensor([ids]), cache=chunked)
        rows, first = [], 0
        for size in chunks:
            rows.append(
                model(input_ids=torch.tensor([tokens[first : first + size]]), cache=chunked).logits[0]
            )
            first += size
    # recorded: a prefill, the one-token forwards, a prefill, the chunks
    single_hidden = torch.cat([h[0] for h in hidden[1 : 1 + len(single)]])
    chunked_hidden = torch.cat([h[0] for h in hidden[2 + len(single) :]])
    assert len(chunked_hidden) == sum(chunks) > 0
    assert_same_bits(loaded, torch.cat(rows).float(), torch.stack(single), chunked_hidden, single_hidden)


def test_a_chunk_gives_the_bits_of_one_token_forwards(invariant):
    chunks_and_one_token_forwards(invariant, "Explain how a bicycle gear works.", [7, 7, 7])


def test_chunks_of_every_width_give_the_bits_of_one_token_forwards(invariant):
    # widths below, at and past fp32's fixed query block, so short blocks are padded at every place
    chunks = [1, 3, FP32_QUERY_BLOCK - 1, FP32_QUERY_BLOCK, FP32_QUERY_BLOCK + 2, 2]
    chunks_and_one_token_forwards(invariant, "Name some rivers of Europe.", chunks)


def _bf16_linear_and_rows(out_features: int, count: int, seed: int) -> tuple[torch.nn.Linear, torch.Tensor]:
    """A random bf16 linear layer 576 -> out_features and `count` random bf16 input rows."""
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(576, out_features, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, 576, generator=generator))
    return linear, torch.randn(count, 576, generator=generator).to(torch.bfloat16)


def test_rows_past_a_kernels_32_row_block_keep_the_bits_they_have_alone():
    # oneDNN switches to another blocking past 32 rows, which sums a row in another order: a batch verifying
    # 7 rows x 7 tokens flipped near-ties its rows alone did not. Blocks of at most ROW_BLOCK rows keep them.
    linear, rows = _bf16_linear_and_rows(1536, 100, seed=0)
    blocked = RowInvariantLinear(linear)
    with torch.inference_mode():
        alone = torch.cat([blocked(row[None]) for row in rows])
        for count in (2, ROW_BLOCK, ROW_BLOCK + 1, 49, 100):
            assert torch.equal(blocked(rows[:count]), alone[:count]), count


def test_a_chunk_wider_than_a_row_block_gives_the_bits_of_one_token_forwards(invariant):
    # a 48-token chunk: every projection and both attention matmuls run over more than ROW_BLOCK rows
    assert ROW_BLOCK < 48
    chunks_and_one_token_forwards(invariant, "List ten animals and where they live.", [48])


def test_a_padded_batch_row_gives_the_bits_of_the_row_alone(invariant):
    a = encode_chat(
        invariant.tokenizer, [{"role": "user", "content": "Rewrite in American spelling: the colour grey."}]
    )
    b = encode_chat(
        invariant.tokenizer, [{"role": "user", "content": "Write the days of the week, one per line."}]
    )
    with head_inputs(invariant.model) as hidden:
        logits, solo = padded_and_solo_logits(invariant, a, b)  # b's keys no longer start the key axis
    # recorded: b alone, a's and b's prefills, then the batched forward (b is its second row)
    solo_hidden, batched_hidden = hidden[0][0, 5:], hidden[-1][1, : len(b) - 5]
    assert_same_bits(invariant, logits, solo[5:], batched_hidden, solo_hidden)


@needs_native_bf16
def test_the_logits_are_fp32_while_the_body_stays_bf16(bf16):
    """bf16 logits step by 0.125 at |logit| 16-32 and tie exactly; the final norm and LM head run in fp32."""
    model = bf16.model
    assert isinstance(model.get_output_embeddings(), FP32LogitsHead)
    assert isinstance(model.get_decoder().norm, FP32Norm)
    # the head still exposes the tied bf16 weight that a draft head binds
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_decoder().layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    ids = encode_chat(bf16.tokenizer, [{"role": "user", "content": "Name three rivers."}])
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    assert logits.dtype == torch.float32
    # far more distinct values than bf16's 8-bit mantissa allows among the 1,000 best
    assert logits.topk(1000).values.unique().numel() > 990


def test_fp32_logits_keep_their_bits_for_any_row_count():
    linear, rows = _bf16_linear_and_rows(4096, 80, seed=1)
    head = FP32LogitsHead(linear)
    with torch.inference_mode():
        alone = torch.cat([head(row[None]) for row in rows])
        assert alone.dtype == torch.float32
        for count in (2, 3, 7, ROW_BLOCK, ROW_BLOCK + 1, 49, 80):
            assert torch.equal(head(rows[:count]), alone[:count]), count
        # and they are the fp32 products of the bf16 weight, not a bf16-rounded result
        exact = rows.double() @ linear.weight.double().T
        assert (alone.double() - exact).abs().max() < 1e-3


def test_an_int4_model_in_an_fp32_body_is_made_batch_invariant(int4_fp32):
    model = int4_fp32.model
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == ATTENTION
    # its head gives fp32 logits from the file's 8-bit blocks (fp32 rounding across batch shapes, no bf16 after
    # it), or the packed fp32 kernel where the 8-bit one cannot be built; its norms stay fp32
    assert isinstance(model.get_output_embeddings(), Q8Head if q8_kernel() else PackedLinear)
    assert not isinstance(model.get_decoder().norm, FP32Norm)
    # loaded to write text compared with nothing, it keeps SDPA
    writer = load_model("embedded", dtype="float32", weights="int4", batch_invariant=False).model
    assert writer.config._attn_implementation == "sdpa"


def test_fp32_attention_gives_a_query_the_bits_it_has_alone_for_any_query_count():
    # MKL's fp32 matmul sums a row of 4 or more rows in another order than one of 1-3: every matmul runs
    # exactly FP32_QUERY_BLOCK queries, so a query's bits do not depend on how many came with it
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(1, 9, 40, 64, generator=generator)
    key, value = (torch.randn(1, 3, 128, 64, generator=generator) for _ in range(2))
    module = torch.nn.Module()

    def attend(q):
        return row_aligned_attention(module, q, key, value, None, 0.125)[0]

    with torch.inference_mode():
        alone = torch.cat([attend(query[:, :, i : i + 1]) for i in range(40)], dim=1)
        for count in (2, 3, 4, FP32_QUERY_BLOCK, FP32_QUERY_BLOCK + 1, 40):
            assert torch.equal(attend(query[:, :, :count]), alone[:, :count]), count


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_aligned_attention_is_attention_with_grouped_query_heads(dtype):
    # it runs the query heads that share a kv head as rows of one matmul against it (no copy of the keys per
    # group): the result must be SDPA's with GQA, head for head, through a mask with left padding and a hole
    generator = torch.Generator().manual_seed(3)
    queries, length = 13, 70
    query = torch.randn(2, 9, queries, 64, generator=generator).to(dtype)
    key, value = (torch.randn(2, 3, length, 64, generator=generator).to(dtype) for _ in range(2))
    visible = torch.ones(2, length, dtype=torch.bool)
    visible[1, :5] = False  # row 1: left padding
    visible[1, 30:33] = False  # and a hole (rejected drafts)
    causal = torch.ones(queries, length, dtype=torch.bool).tril(length - queries)
    allowed = causal[None, None] & visible[:, None, None, :]  # [B, 1, T, L]
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    with torch.inference_mode():
        got = row_aligned_attention(torch.nn.Module(), query, key, value, additive, 0.125)[0]
        want = torch.nn.functional.scaled_dot_product_attention(
            query.float(), key.float(), value.float(), attn_mask=allowed, scale=0.125, enable_gqa=True
        )
    assert got.shape == (2, queries, 9, 64)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert float((got.float() - want.transpose(1, 2)).abs().max()) < tolerance
