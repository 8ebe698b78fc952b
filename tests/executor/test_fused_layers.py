"""The project's 4-bit kernels and the fused decoder layers (`kernels/int4_linear.cpp`, `int4_weights`,
`fused_layers`): the 4-bit product against the dequantised weights, a row's bits independent of the rows and
threads beside it, the C++ attention against SDPA and independent of the queries beside it, the fused layer
against the layer's own forward, hooks that still fire, and transformers' layers where the kernel cannot be
built."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from service.decoding import load_model
from service.decoding.text import encode_chat
from service.executor import native
from service.executor.cpu_kernels import default_cpu_dtype
from service.executor.int4_weights import (
    dequantize_int4,
    int4_supported,
    interleave_blocks,
    pack_int4,
    quantize_int4,
)
from service.executor.paths import default_cache_dir

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not int4_supported(), reason="this torch build has no CPU int4 kernels"),
]


@pytest.fixture(scope="module")
def kernels():
    built = native.build("int4_linear")
    if built is None:
        if os.environ.get("CI"):
            pytest.fail("the 4-bit kernel did not build (CI has g++ and ninja): see the warning logged")
        pytest.skip("no C++ compiler or ninja here: the 4-bit kernel cannot be built")
    return built


@pytest.fixture(scope="module")
def fused():
    return load_model("embedded", dtype="float32", weights="int4")


def int4_weight(n: int, k: int, seed: int):
    """A random weight [n, k] as the kernel's buffers, and the dense weight they stand for."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, scales_and_zeros = quantize_int4(weight)
    scale = scales_and_zeros[..., 0].t().contiguous()
    low = (scales_and_zeros[..., 1] - 8 * scales_and_zeros[..., 0]).t().contiguous()
    return (pack_int4(q), interleave_blocks(scale).half(), interleave_blocks(low).half()), dequantize_int4(
        q, scales_and_zeros
    )


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The layout `pack_int4` documents, read back byte by byte: per group of 8 columns and block of 32, four
    runs of 32 bytes, column c's bytes 4c..4c + 3 of run i holding its weights 4i + e (low nibble) and
    16 + 4i + e (high nibble)."""
    n = packed.shape[0]
    flat = packed.reshape(-1).tolist()
    q = torch.empty(n, k, dtype=torch.long)
    for row in range(n):
        group, c = divmod(row, 8)
        for block in range(k // 32):
            base = (group * (k // 32) + block) * 128
            for i in range(4):
                for e in range(4):
                    byte = flat[base + 32 * i + 4 * c + e]
                    q[row, block * 32 + 4 * i + e] = byte & 0x0F
                    q[row, block * 32 + 16 + 4 * i + e] = byte >> 4
    return q


@pytest.mark.parametrize("k", [576, 96, 32])
def test_the_packing_holds_every_weight_where_the_kernel_reads_it(k):
    q = torch.randint(0, 16, (16, k), generator=torch.Generator().manual_seed(k), dtype=torch.int32)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (16, k // 2)
    assert torch.equal(unpack_int4(packed, k), q.long())
    values = torch.arange(16 * (k // 32), dtype=torch.float32).reshape(16, k // 32)
    interleaved = interleave_blocks(values).reshape(2, k // 32, 8)  # [group, block, column]
    assert torch.equal(interleaved[1, :, 3], values[8 + 3])


@pytest.mark.parametrize("k", [576, 1536, 96])
def test_the_4bit_kernel_computes_the_dequantised_product(kernels, k):
    (packed, scale, low), dense = int4_weight(296, k, seed=1)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ dense.double().T
    got = kernels.int4_linear(x, packed, scale, low)
    assert got.dtype == torch.float32
    # activations quantised to 8 bits per group of 32 (centred on the weights' middle level): ~0.6 % of the
    # product's norm on random data, the order of bf16 rounding (~0.3 %)
    error = float((got.double() - exact).norm() / exact.norm())
    assert 0 < error < 0.01, error
    bf16 = kernels.int4_linear(x.to(torch.bfloat16), packed, scale, low)
    assert bf16.dtype == torch.bfloat16
    assert float((bf16.double() - exact).norm() / exact.norm()) < 0.015


@pytest.mark.parametrize("threads", [1, 2])
def test_the_4bit_kernel_gives_a_row_the_same_bits_for_any_row_and_thread_count(kernels, threads):
    (packed, scale, low), _ = int4_weight(200, 576, seed=3)
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat(
            [kernels.int4_linear(x[i : i + 1].contiguous(), packed, scale, low) for i in range(19)]
        )
        for count in range(2, 20):  # every tile (8 with AVX-512VL, 4, 3, 2, 1 rows), and mixes of them
            assert torch.equal(kernels.int4_linear(x[:count].contiguous(), packed, scale, low), alone[:count])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cap", ["avx2", "default"])
def test_every_build_of_the_kernels_gives_the_same_bits(kernels, monkeypatch, cap):
    """This CPU's build (VNNI where it has it), the AVX2 build that CPUs without AVX-512 run, and the portable
    loops that CPUs without AVX2 (or x86) run must give every 4-bit product and attention output the same bits:
    what a fleet of mixed CPUs serving one model, and a capped test run, rely on. (Compare on the same inputs:
    torch's own random generator fills tensors differently under a dispatch cap.)"""
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", cap)  # native.build adds -mno-avx512f -mno-avxvnni, or -mno-avx
    other = native.build("int4_linear")
    assert other is not None
    if other.isa() == kernels.isa():
        pytest.skip(f"this CPU's build is already the {cap} one ({kernels.isa()})")
    assert other.isa() == ("portable" if cap == "default" else other.isa())
    (packed, scale, low), _ = int4_weight(208, 1536, seed=6)
    x = torch.randn(11, 1536, generator=torch.Generator().manual_seed(7)) * 3
    for count in (1, 3, 4, 8, 11):
        rows = x[:count].contiguous()
        assert torch.equal(
            kernels.int4_linear(rows, packed, scale, low), other.int4_linear(rows, packed, scale, low)
        )
    q, k, v = gqa_inputs(2, 5, 40, seed=9)
    seen = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    seen[1, ..., :7] = False
    mask = seen & (torch.arange(40)[None, :] <= torch.arange(35, 40)[:, None])
    for given in (None, mask):
        assert torch.equal(kernels.attention(q, k, v, given, 0.125), other.attention(q, k, v, given, 0.125))
    # other head shapes: 8 query heads on one key head (groups split in chunks), 128 dimensions, a mask per head
    generator = torch.Generator().manual_seed(10)
    for heads, kv_heads, dim in ((8, 1, 64), (6, 2, 128), (5, 5, 64)):
        q = torch.randn(2, heads, 3, dim, generator=generator)
        k, v = (torch.randn(2, kv_heads, 30, dim, generator=generator) for _ in range(2))
        per_head = torch.rand(2, heads, 3, 30, generator=generator) > 0.3
        per_head[..., 0] = True
        for given in (None, mask[..., :3, :30], per_head):
            assert torch.equal(kernels.attention(q, k, v, given, 0.1), other.attention(q, k, v, given, 0.1))


def test_the_4bit_kernel_refuses_what_it_cannot_read(kernels):
    (packed, scale, low), _ = int4_weight(8, 576, seed=5)
    with pytest.raises(RuntimeError):
        kernels.int4_linear(torch.randn(2, 576, dtype=torch.float64), packed, scale, low)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.int4_linear(torch.randn(2, 560), packed, scale, low)
    (packed, scale, low), _ = int4_weight(16, 576, seed=5)  # 12 of its 16 columns: not whole groups of 8
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernels.int4_linear(torch.randn(2, 576), packed[:12].contiguous(), scale[:12], low[:12])


def gqa_inputs(batch: int, length: int, keys: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 9, length, 64, generator=generator)
    k = torch.randn(batch, 3, keys, 64, generator=generator)
    v = torch.randn(batch, 3, keys, 64, generator=generator)
    return q, k, v


def test_the_attention_is_softmax_attention_over_the_keys_each_query_sees(kernels):
    q, k, v = gqa_inputs(2, 5, 40, seed=6)
    # row 0: causal over all 40 keys; row 1: 7 padding keys in front and a hole at key 20
    seen = torch.ones(2, 40, dtype=torch.bool)
    seen[1, :7] = False
    seen[1, 20] = False
    causal = torch.arange(40)[None, :] <= torch.arange(35, 40)[:, None]  # [5, 40]
    mask = seen[:, None, None, :] & causal[None, None]
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True
    )
    want = want.transpose(1, 2).reshape(2, 5, 9 * 64)
    for given in (mask, additive):  # bool, or additive as transformers' eager mask
        got = kernels.attention(q, k, v, given, 0.125)
        assert float((got - want).abs().max()) < 1e-5
    # no mask: causal, the last query sees every key
    got = kernels.attention(q[:1], k[:1], v[:1], None, 0.125)
    assert float((got - want[:1]).abs().max()) < 1e-5


def test_the_attention_reads_a_growing_caches_views_in_place(kernels):
    """Keys and values as `kv_cache.GrowingLayer` holds them (the first L positions of a longer buffer: rows
    and heads a capacity apart) give the bits the same keys give contiguous."""
    q, k, v = gqa_inputs(2, 3, 40, seed=8)
    buffers = [torch.randn(2, 3, 64, 64) for _ in range(2)]
    buffers[0][:, :, :40], buffers[1][:, :, :40] = k, v
    views = [b[:, :, :40] for b in buffers]
    assert not views[0].is_contiguous()
    assert torch.equal(kernels.attention(q, *views, None, 0.125), kernels.attention(q, k, v, None, 0.125))


def test_a_querys_attention_has_the_bits_it_has_alone(kernels):
    q, k, v = gqa_inputs(1, 6, 30, seed=7)
    together = kernels.attention(q, k, v, None, 0.125)
    for t in range(6):
        # query t alone sees the keys up to its own position, as in a one-token forward
        alone = kernels.attention(
            q[:, :, t : t + 1].contiguous(), k[:, :, : 25 + t], v[:, :, : 25 + t], None, 0.125
        )
        assert torch.equal(alone[:, 0], together[:, t])


def test_every_layer_of_the_embedded_int4_model_is_fused(kernels, fused):
    layers = fused.model.model.layers
    assert len(layers) == 30 and all(hasattr(layer, "_csd_fused") for layer in layers)
    weights = layers[0]._csd_fused
    assert (weights.heads, weights.kv_heads) == (9, 3)


def test_a_fused_layer_computes_what_the_layer_itself_does(kernels, fused):
    model = fused.model
    ids = encode_chat(fused.tokenizer, [{"role": "user", "content": "Name three rivers and their seas."}])
    inputs = {}
    hook = model.model.layers[7].register_forward_pre_hook(
        lambda _, args, kwargs: inputs.update(args=args, kwargs=kwargs), with_kwargs=True
    )
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids]))
    finally:
        hook.remove()
    layer = model.model.layers[7]
    kwargs = {**inputs["kwargs"], "cache": None}
    # the lean decoder forward leaves causality to the fused attention (no mask); transformers' own layer
    # reads no mask as no masking, so it is given the causal mask spelled out
    assert kwargs["attention_mask"] is None
    n = inputs["args"][0].shape[1]
    kwargs["attention_mask"] = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.inference_mode():
        got = layer(*inputs["args"], **kwargs)
        # transformers' own forward of the same module: eager norms, RoPE and row-aligned attention around
        # the same 4-bit matmuls
        want = type(layer).forward(layer, *inputs["args"], **kwargs)
    assert got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 1e-3


def test_hooks_on_a_fused_layer_still_see_its_output(kernels, fused):
    # the draft head reads layer outputs through forward hooks: a fused layer is still called as a module
    seen, normed = [], []
    hooks = [
        fused.model.model.layers[-1].register_forward_hook(lambda _, __, output: seen.append(output)),
        fused.model.model.norm.register_forward_pre_hook(lambda _, args: normed.append(args[0])),
    ]
    try:
        with torch.inference_mode():
            fused.model(input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        for hook in hooks:
            hook.remove()
    assert len(seen) == 1 and seen[0].shape == (1, 3, 576)
    assert torch.equal(seen[0], normed[0])  # the last layer's output is what the final norm reads


def test_without_the_kernel_the_model_runs_transformers_layers_on_torchs_int4_kernel(tmp_path):
    # a cache whose kernel folder is a file (the converted model shared with the usual cache): a real fault.
    # The 4-bit model still loads and decodes, on torch's int4 kernel, in the body the CPU multiplies
    # fastest, unfused.
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "models").symlink_to(default_cache_dir() / "models")
    (cache / "kernels").write_text("")
    env = {**os.environ, "CSD_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    script = (
        "import torch\n"
        "from service.decoding import load_model\n"
        "from service.executor.int4_weights import Int4Linear\n"
        "loaded = load_model('embedded')\n"
        "layers = [m for m in loaded.model.modules() if isinstance(m, Int4Linear)]\n"
        "print('weights', loaded.weights, 'dtype', loaded.model.dtype)\n"
        "print('kernels', sum(m._kernel is not None for m in layers), 'of', len(layers))\n"
        "print('fused', sum(hasattr(m, '_csd_fused') for m in loaded.model.model.layers))\n"
        "with torch.inference_mode():\n"
        "    print('logits', tuple(loaded.model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert f"weights int4 dtype {default_cpu_dtype()}" in out.stdout
    assert "kernels 0 of 120" in out.stdout and "fused 0" in out.stdout
    assert "logits (1, 3, 49152)" in out.stdout
    assert "int4_linear kernel could not be built" in out.stderr


def test_a_layer_neither_kernel_can_hold_stays_dense(kernels):
    """Torch's int4 packing needs outputs in multiples of 16, the project's kernel of 8 and inputs of 32: a
    layer that is not whole groups keeps its dense weights, beside one that is quantised."""
    from service.executor.int4_weights import quantize_linear_layers

    class Body(torch.nn.Sequential):
        def get_output_embeddings(self) -> None:  # what a transformers model answers; no head here
            return None

    model = Body(torch.nn.Linear(96, 12), torch.nn.Linear(12, 16), torch.nn.Linear(96, 16))
    assert quantize_linear_layers(model) == 1
    assert [type(m).__name__ for m in model] == ["Linear", "Linear", "Int4Linear"]
    assert model[2]._kernel is not None


def test_the_lean_decoder_forward_gives_transformers_logits_in_a_ragged_batch(kernels, fused):
    """A fused Llama decoder runs `_lean_decoder_forward` (its own mask, no `create_causal_mask`), and the
    engine's forward skips the causal LM's own (`lean_logits`): a batch of rows with contexts of different
    lengths (padding masks in play) and a 2-token round give the same logits, bit for bit, as transformers'
    `LlamaForCausalLM.forward` and `LlamaModel.forward` around the same fused layers."""
    from service.executor.batch_kv import BatchKV

    decoder = fused.model.get_decoder()
    lean = decoder.__dict__["forward"]
    assert lean.__func__.__name__ == "_lean_decoder_forward"
    prompt = encode_chat(fused.tokenizer, [{"role": "user", "content": "Name three rivers and their seas."}])

    def ragged_round() -> torch.Tensor:
        kv = BatchKV(fused.model, fused.device)
        for row in range(3):
            own = BatchKV(fused.model, fused.device, rows=1)
            own.forward([prompt[: len(prompt) - 4 * row]], logits_to_keep=1)
            kv.add(own)
        return kv.forward([[11, 12], [13], [14, 15]])

    with torch.inference_mode():
        mine = ragged_round()
        # transformers' own forwards, for the reference: LlamaModel's, and LlamaForCausalLM's around it
        del decoder.forward
        decoder._csd_lean = False
        try:
            theirs = ragged_round()
        finally:
            decoder.forward = lean
            decoder._csd_lean = True
    assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[2], theirs[2])
    assert torch.equal(mine[1, :1], theirs[1, :1])  # row 1 fed one token: its padded position is noise


def test_the_decoder_stack_gives_the_per_layer_paths_bits_cache_and_hooked_features(
    kernels, fused, monkeypatch
):
    """A fused Llama decoder with a `GrowingLayer` cache runs its layers as one C++ call (`DecoderStack`),
    writing keys and values into the cache's buffers: over a ragged batch's prefills, joins (the cache's layout
    replaced), a 2-token round, a rollback and another round, its logits, every layer's cache and what forward
    hooks on two layers see are those of the layer-by-layer path, bit for bit."""
    from service.executor import fused_layers
    from service.executor.batch_kv import BatchKV

    decoder = fused.model.get_decoder()
    stack = decoder._csd_stack
    assert stack is not None
    ran = []
    real = fused_layers._stack_forward

    def spy(*args):
        out = real(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(fused_layers, "_stack_forward", spy)
    prompt = encode_chat(fused.tokenizer, [{"role": "user", "content": "Name three rivers and their seas."}])

    def rounds() -> tuple[list[torch.Tensor], list[tuple], BatchKV]:
        seen = []
        hooks = [
            decoder.layers[i].register_forward_hook(
                lambda _, args, output: seen.append((args[0].clone(), output.clone()))
            )
            for i in (0, 17)
        ]
        try:
            kv = BatchKV(fused.model, fused.device)
            for row in range(3):
                own = BatchKV(fused.model, fused.device, rows=1)
                own.forward([prompt[: len(prompt) - 4 * row]], logits_to_keep=1)
                kv.add(own)
            logits = [kv.forward([[11, 12], [13], [14, 15]])]
            kv.keep(0, kv.length(0) - 1)  # row 0 keeps 1 of its 2, row 2 neither: holes, a dead tail
            kv.keep(2, kv.length(2) - 2)
            kv.settle()
            logits.append(kv.forward([[21, 22, 23], [24], [25]]))
        finally:
            for hook in hooks:
                hook.remove()
        return logits, seen, kv

    with torch.inference_mode():
        mine, my_seen, my_kv = rounds()
        assert ran and all(ran)  # every forward took the stack
        ran.clear()
        decoder._csd_stack = None
        try:
            theirs, their_seen, their_kv = rounds()
        finally:
            decoder._csd_stack = stack
        assert ran and not any(ran)
    for a, b in zip(mine, theirs, strict=True):
        for row, fed in enumerate((2, 1, 2) if a.shape[1] == 2 else (3, 1, 1)):
            assert torch.equal(a[row, :fed], b[row, :fed])
    assert len(my_seen) == len(their_seen) == 2 * 5
    for (a_in, a_out), (b_in, b_out) in zip(my_seen, their_seen, strict=True):
        assert torch.equal(a_in, b_in) and torch.equal(a_out, b_out)
    for a, b in zip(my_kv.cache.layers, their_kv.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_lean_logits_are_the_models_logits_and_step_aside_for_a_hook_on_the_model(kernels, fused):
    """`lean_logits` (the engine's forward) gives `model(...).logits` bit for bit, with `logits_to_keep`, and
    the LM head's pre-hook (the final hidden states the draft head reads) still fires; a hook on the model
    itself would be skipped by it, so it declines (None) and the caller calls the model."""
    from service.executor.fused_layers import lean_logits
    from service.executor.kv_cache import new_cache

    prompt = encode_chat(fused.tokenizer, [{"role": "user", "content": "Why is the sky blue?"}])
    ids = torch.tensor([prompt])
    seen = []
    head_hook = fused.model.lm_head.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape))
    try:
        with torch.inference_mode():
            mine = lean_logits(fused.model, ids, new_cache(fused.model.config), logits_to_keep=3)
            theirs = fused.model(input_ids=ids, cache=new_cache(fused.model.config), logits_to_keep=3).logits
    finally:
        head_hook.remove()
    assert mine is not None and mine.shape == theirs.shape == (1, 3, fused.vocab_size)
    assert torch.equal(mine, theirs)
    assert seen == [torch.Size([1, 3, fused.model.config.hidden_size])] * 2
    hook = fused.model.register_forward_hook(lambda *_: None)
    try:
        assert lean_logits(fused.model, ids, new_cache(fused.model.config)) is None
    finally:
        hook.remove()
    # a forward set on the instance, or a wrapper that hands every other attribute through, is in the call
    fused.model.forward = fused.model.forward
    try:
        assert lean_logits(fused.model, ids, new_cache(fused.model.config)) is None
    finally:
        del fused.model.forward

    class Wrapper:
        def __getattr__(self, name: str):
            return getattr(fused.model, name)

    assert lean_logits(Wrapper(), ids, new_cache(fused.model.config)) is None
    assert lean_logits(fused.model, ids, new_cache(fused.model.config)) is not None
