"""The LM head from a GGUF's own 8-bit blocks (`service/executor/q8_head.py`): the file's Q8_0 weights found
again exactly, the packed layout, a kernel whose rows keep their bits for any row and thread count and on
every instruction set, logits within the activations' 8-bit rounding of the fp32 head's with the same top
token, and the packed fp32 head where the kernel cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from service.executor import native
from service.executor.cpu_kernels import PackedLinear
from service.executor.models import load_model
from service.executor.q8_head import Q8Head, Q8Matrix, pack_q8, q8_blocks, q8_kernel

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def kernel():
    built = q8_kernel()
    if built is None:
        if os.environ.get("CI"):
            pytest.fail(
                "the 8-bit LM head kernel did not build (CI has g++ and ninja): see the warning logged"
            )
        pytest.skip("no C++ compiler or ninja here: the 8-bit LM head kernel cannot be built")
    return built


@pytest.fixture(scope="module")
def dense_fp32():
    return load_model("embedded", dtype="float32", weights="dense")


def q8_weight(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight [rows, k] that is exactly Q8_0 (fp16 scale * int8 q, a block's largest |q| 127), as
    (dense, q, scales)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (rows, k), generator=generator, dtype=torch.int8)
    q.view(rows, k // 32, 32)[..., 0] = 127  # llama.cpp's quantiser: the block's largest weight is +-127
    scales = (torch.rand(rows, k // 32, generator=generator) * 1e-3 + 1e-4).half().float()
    dense = (q.float().view(rows, k // 32, 32) * scales[..., None]).view(rows, k)
    return dense, q, scales


def test_the_embedded_ggufs_head_is_found_again_as_its_8_bit_blocks(dense_fp32):
    weight = dense_fp32.model.get_output_embeddings().weight
    blocks = q8_blocks(weight)
    assert blocks is not None  # the file's token embeddings are Q8_0, tied to the head
    q, scales = blocks
    assert q.dtype == torch.int8 and tuple(scales.shape) == (weight.shape[0], weight.shape[1] // 32)
    assert torch.equal((q.float().view(-1, 32) * scales.view(-1, 1)).view(weight.shape), weight.float())


def test_weights_that_are_not_8_bit_blocks_are_refused():
    dense, _, _ = q8_weight(64, 128, seed=1)
    assert q8_blocks(dense) is not None
    assert q8_blocks(dense + 1e-7) is None  # off the grid
    assert q8_blocks(torch.randn(64, 128)) is None
    assert q8_blocks(torch.randn(64, 100)) is None  # not a whole number of blocks


def test_the_packing_holds_every_weight_where_the_kernel_reads_it():
    _, q, scales = q8_weight(13, 96, seed=11)  # 13 rows: padded to 16 with zero rows
    w, packed_scales, sums = pack_q8(q, scales)
    assert (
        w.dtype == torch.int8
        and tuple(w.shape) == (16, 96)
        and sums.dtype == torch.int16
        and packed_scales.dtype == torch.float16
    )
    flat = w.reshape(-1)
    for row in (0, 7, 8, 12):
        group, c = divmod(row, 8)
        for block in range(3):
            base = (group * 3 + block) * 256
            for k in range(32):  # weight k of the block: run k // 4, byte k % 4 of column c
                assert int(flat[base + 32 * (k // 4) + 4 * c + k % 4]) == int(q[row, 32 * block + k])
            assert float(packed_scales.reshape(-1)[(group * 3 + block) * 8 + c]) == float(scales[row, block])
            assert int(sums.reshape(-1)[(group * 3 + block) * 8 + c]) == int(
                q[row, 32 * block : 32 * block + 32].sum()
            )
    # the padding: columns 13..15 (group 1, columns 5..7) are zero weights with zero scales
    assert (
        not w.reshape(2, 3, 8, 8, 4)[1, :, :, 5:].any() and not packed_scales.reshape(2, 3, 8)[1, :, 5:].any()
    )


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_gives_a_row_the_same_bits_for_any_row_count(kernel, threads):
    dense, q, scales = q8_weight(1003, 576, seed=2)  # not a whole number of 8-column groups
    matrix = Q8Matrix((q, scales), kernel)
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([matrix(x[i : i + 1]) for i in range(len(x))])
        for count in range(2, len(x) + 1):  # every tile (8 with AVX-512VL, 4, 3, 2, 1 rows) and mixes
            assert torch.equal(matrix(x[:count]), alone[:count]), count
    finally:
        torch.set_num_threads(before)
    assert tuple(alone.shape) == (19, 1003) and alone.dtype == torch.float32
    # the exact weights' products, the activations rounded to 8 bits a block: ~0.5 % of the product's norm
    exact = x.double() @ dense.double().T
    error = float((alone.double() - exact).norm() / exact.norm())
    assert 0 < error < 0.01, error


@pytest.mark.parametrize("cap", ["avx2", "default"])
def test_every_build_of_the_kernel_gives_the_same_bits(kernel, monkeypatch, cap):
    """VNNI's unsigned x signed dot products (activations offset by 128), AVX2's sign trick and the portable
    loop (CPUs without AVX2, or not x86) sum the same integers: a row's logits have the same bits on every CPU
    kind of a fleet."""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)  # native.build adds -mno-avx512f -mno-avxvnni, or -mno-avx
    capped = native.build("q8_linear")
    assert capped is not None
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    here = native.build("q8_linear")
    if capped.isa() == here.isa():
        pytest.skip(f"this CPU's build is already the {cap} one ({here.isa()})")
    _, q, scales = q8_weight(200, 576, seed=12)
    w, packed_scales, sums = pack_q8(q, scales)
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(13)) * 4
    for count in (1, 3, 4, 8, 11):
        rows = x[:count].contiguous()
        assert torch.equal(
            here.q8_linear(rows, w, packed_scales, sums, 200),
            capped.q8_linear(rows, w, packed_scales, sums, 200),
        )


def test_the_kernel_refuses_what_it_cannot_read(kernel):
    _, q, scales = q8_weight(8, 64, seed=4)
    w, packed_scales, sums = pack_q8(q, scales)
    with pytest.raises(RuntimeError):
        kernel(torch.randn(2, 64, dtype=torch.float64), w, packed_scales, sums, 8)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(torch.randn(2, 96), w, packed_scales, sums, 8)
    with pytest.raises(RuntimeError, match="padded"):
        kernel(torch.randn(2, 64), w, packed_scales, sums, 9)
    with pytest.raises(RuntimeError, match="sums"):
        kernel(torch.randn(2, 64), w, packed_scales, sums.int(), 8)


def test_an_int4_model_serves_the_8_bit_head_with_the_fp32_heads_top_tokens(kernel, dense_fp32):
    loaded = load_model("embedded", dtype="float32", weights="int4")
    head = loaded.model.get_output_embeddings()
    assert isinstance(head, Q8Head)
    # code that reads the head's weight still sees the model's own [vocab, hidden] matrix
    assert head.weight is loaded.model.get_input_embeddings().weight
    reference = PackedLinear(dense_fp32.model.get_output_embeddings())
    # real final hidden states of the fp32 model on a prompt, not noise: their logits have a clear top token
    ids = torch.tensor(
        [dense_fp32.tokenizer.encode("The capital of France is Paris. The tallest mountain on")]
    )
    with torch.inference_mode():
        states = dense_fp32.model.model(ids).last_hidden_state
        want = reference(states)
        got = head(states)
        alone = torch.cat([head(states[:, i : i + 1]) for i in range(states.shape[1])], dim=1)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(alone, got)  # every position's bits, alone or in the whole prompt's call
    error = float((got - want).norm() / want.norm())
    assert 0 < error < 0.02, error
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_a_cache_the_kernel_cannot_be_built_in_gives_no_kernel_and_says_why(tmp_path):
    # a cache the kernel cannot be built into (a path under a file) is a real fault: no kernel, and a warning
    # that says why (load_model then keeps the packed fp32 head: `use_q8_head` needs the kernel)
    blocked = tmp_path / "file"
    blocked.write_text("")
    env = {**os.environ, "CSD_CACHE_DIR": str(blocked / "cache")}
    script = "from service.executor.q8_head import q8_kernel; print('kernel', q8_kernel())"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kernel None" in out.stdout
    assert "LM head stays fp32" in out.stderr


def test_a_linear_from_8bit_blocks_is_the_dense_one_within_quantisation(kernel):
    from service.executor.q8_head import Q8Linear, quantize_q8

    linear = torch.nn.Linear(576, 200)
    with torch.no_grad():
        linear.weight.normal_(0, 0.05)
    q, scales = quantize_q8(linear.weight)
    assert q8_blocks((q.float().reshape(200, 18, 32) * scales[..., None]).reshape(200, 576)) is not None
    layer = Q8Linear(linear, kernel)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        exact = linear(x)
        got = layer(x)
    assert float((got - exact).norm() / exact.norm()) < 0.01
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(5)]), got)  # a row's bits, alone or not


def test_the_draft_head_drafts_from_8bit_blocks(kernel, embedded):
    """The served head reads its layers and its vocabulary's LM rows from 8-bit blocks (a quarter of the bytes
    a drafted position); its logits stay the fp32 head's within quantisation, with the same top token almost
    everywhere, and a row's bits do not depend on the rows drafted beside it."""
    from service.decoding import HeadDrafter
    from service.decoding.draft_head import EMBEDDED_HEAD_DIR, RecurrentDraftHead
    from service.executor.q8_head import Q8Linear

    served = HeadDrafter(embedded, EMBEDDED_HEAD_DIR).head
    assert served._lm_blocks is not None and isinstance(served.mix.up, Q8Linear)
    model = embedded.model
    reference = RecurrentDraftHead.load(EMBEDDED_HEAD_DIR).bind(
        model.get_input_embeddings().weight, model.get_output_embeddings().weight
    )
    generator = torch.Generator().manual_seed(10)
    state = torch.randn(64, 576, generator=generator)
    tokens = torch.randint(0, 49152, (64,), generator=generator)
    with torch.inference_mode():
        _, exact = reference.advance(state, tokens)
        _, got = served.advance(state, tokens)
        alone = torch.cat([served.advance(state[i : i + 1], tokens[i : i + 1])[1] for i in range(8)])
    assert float((got - exact).norm() / exact.norm()) < 0.02
    assert float((got.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.9
    assert torch.equal(alone, got[:8])
