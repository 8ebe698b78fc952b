"""The LM head from a GGUF's own 8-bit blocks (`service/decoding/q8_head.py`): the file's Q8_0 weights found
again exactly, a kernel whose rows keep their bits for any row and thread count, fp32 logits equal to the
fp32 head's to rounding, and the packed fp32 head where the kernel cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from service.decoding.cpu_kernels import PackedLinear
from service.decoding.models import load_model
from service.decoding.q8_head import Q8_MAX_ROWS, Q8Head, q8_blocks, q8_kernel

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


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_gives_a_row_the_same_bits_for_any_row_count(kernel, threads):
    dense, q, scales = q8_weight(1000, 576, seed=2)
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(3))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([kernel(x[i : i + 1].contiguous(), q, scales) for i in range(len(x))])
        for count in range(2, len(x) + 1):
            assert torch.equal(kernel(x[:count].contiguous(), q, scales), alone[:count]), count
    finally:
        torch.set_num_threads(before)
    # the dot products of the exact weights, to fp32 rounding
    exact = x.double() @ dense.double().T
    assert float((alone.double() - exact).abs().max()) < 1e-5


def test_the_kernel_refuses_what_it_cannot_read(kernel):
    _, q, scales = q8_weight(8, 64, seed=4)
    with pytest.raises(RuntimeError):
        kernel(torch.randn(2, 64, dtype=torch.float64), q, scales)
    with pytest.raises(RuntimeError):
        kernel(torch.randn(2, 96), q, scales)


def test_an_int4_model_serves_the_8_bit_head_with_the_fp32_heads_logits(kernel, dense_fp32):
    loaded = load_model("embedded", dtype="float32", weights="int4")
    head = loaded.model.get_output_embeddings()
    assert isinstance(head, Q8Head)
    # code that reads the head's weight still sees the model's own [vocab, hidden] matrix
    assert head.weight is loaded.model.get_input_embeddings().weight
    reference = PackedLinear(dense_fp32.model.get_output_embeddings())
    hidden = torch.randn(2, 3 * Q8_MAX_ROWS, 576, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        for count in (
            1,
            Q8_MAX_ROWS,
            Q8_MAX_ROWS + 1,
            3 * Q8_MAX_ROWS,
        ):  # the 8-bit kernel, then the wide one
            got, want = head(hidden[:, :count]), reference(hidden[:, :count])
            assert got.dtype == torch.float32
            assert float((got - want).abs().max()) < 1e-4, count
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_cache_the_kernel_cannot_be_built_in_gives_no_kernel_and_says_why(tmp_path):
    # a cache the kernel cannot be built into (a path under a file) is a real fault: no kernel, and a warning
    # that says why (load_model then keeps the packed fp32 head: `use_q8_head` needs the kernel)
    blocked = tmp_path / "file"
    blocked.write_text("")
    env = {**os.environ, "CSD_CACHE_DIR": str(blocked / "cache")}
    script = "from service.decoding.q8_head import q8_kernel; print('kernel', q8_kernel())"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kernel None" in out.stdout
    assert "LM head stays fp32" in out.stderr


def test_a_linear_from_8bit_blocks_is_the_dense_one_within_quantisation(kernel):
    from service.decoding.q8_head import Q8Linear, quantize_q8

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
    from service.decoding.q8_head import Q8Linear

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
        _, exact = reference.step(state, tokens)
        _, got = served.step(state, tokens)
        alone = torch.cat([served.step(state[i : i + 1], tokens[i : i + 1])[1] for i in range(8)])
    assert float((got - exact).norm() / exact.norm()) < 0.02
    assert float((got.argmax(-1) == exact.argmax(-1)).float().mean()) >= 0.9
    assert torch.equal(alone, got[:8])
