"""bf16 on a CPU with native bf16 matmuls: a k-token forward and a padded batch row give the same bits as
one-token forwards of the sequence alone (`service/decoding/batch_invariant.py`), so strict SD stays exact.
Measured on AVX512-BF16; on CPUs that emulate bf16 the kernels differ, so these tests skip there."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from service.decoding.batch_invariant import (
    ATTENTION,
    ROW_BLOCK,
    FP32LogitsHead,
    FP32Norm,
    RowInvariantLinear,
)
from service.decoding.cpu_kernels import has_native_bf16
from service.decoding.models import load_model
from service.decoding.text import encode_chat
from tests.decoding.test_batch import padded_and_solo_logits

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not has_native_bf16(), reason="this CPU has no native bf16 matmuls"),
]


@pytest.fixture(scope="module")
def bf16():
    return load_model("embedded", dtype="bfloat16")


def test_a_bf16_cpu_model_is_made_batch_invariant(bf16):
    assert bf16.model.config._attn_implementation == ATTENTION
    assert not any(type(m) is torch.nn.Linear for m in bf16.model.modules())
    assert any(isinstance(m, RowInvariantLinear) for m in bf16.model.modules())
    # a fp32 model keeps its own kernels, and so does a bf16 one loaded to write text compared with nothing
    assert load_model("embedded", dtype="float32").model.config._attn_implementation != ATTENTION
    writer = load_model("embedded", dtype="bfloat16", batch_invariant=False).model
    assert writer.config._attn_implementation != ATTENTION
    assert not any(isinstance(m, RowInvariantLinear) for m in writer.modules())


def chunks_and_one_token_forwards(bf16, prompt: str, chunks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy decoding of `prompt` one token a forward, then the same tokens fed again in chunks of the given
    sizes after the same prefill: (chunked logits, one-token logits), position for position, as float."""
    ids = encode_chat(bf16.tokenizer, [{"role": "user", "content": prompt}])
    model = bf16.model
    with torch.inference_mode():
        cache = DynamicCache()
        step = model(input_ids=torch.tensor([ids]), cache=cache).logits[0, -1]
        tokens, single = [], []
        for _ in range(sum(chunks)):
            tokens.append(int(step.argmax()))
            step = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache).logits[0, -1]
            single.append(step.float())
        chunked = DynamicCache()
        model(input_ids=torch.tensor([ids]), cache=chunked)
        rows, first = [], 0
        for size in chunks:
            rows.append(
                model(input_ids=torch.tensor([tokens[first : first + size]]), cache=chunked).logits[0]
            )
            first += size
    return torch.cat(rows).float(), torch.stack(single)


def test_a_chunk_gives_the_bits_of_one_token_forwards(bf16):
    chunked, single = chunks_and_one_token_forwards(bf16, "Explain how a bicycle gear works.", [7, 7, 7])
    assert torch.equal(chunked, single)


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


def test_a_chunk_wider_than_a_row_block_gives_the_bits_of_one_token_forwards(bf16):
    # a 48-token chunk: every projection and both attention matmuls run over more than ROW_BLOCK rows
    chunked, single = chunks_and_one_token_forwards(bf16, "List ten animals and where they live.", [48])
    assert len(chunked) > ROW_BLOCK and torch.equal(chunked, single)


def test_a_padded_batch_row_gives_the_bits_of_the_row_alone(bf16):
    a = encode_chat(
        bf16.tokenizer, [{"role": "user", "content": "Rewrite in American spelling: the colour grey."}]
    )
    b = encode_chat(
        bf16.tokenizer, [{"role": "user", "content": "Write the days of the week, one per line."}]
    )
    logits, solo = padded_and_solo_logits(bf16, a, b)  # b's keys no longer start the key axis
    assert torch.equal(logits, solo[5:])


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
