"""4-bit weights (`service/executor/int4_weights.py`): the GGUF's own Q4_1 blocks found again exactly, a row's
output independent of how many rows run together, `--weights auto` choosing int4 only for a 4-bit GGUF on the
CPU in the body dtype the CPU runs best (bf16 with native bf16, fp32 elsewhere), and strict speculative decoding
on int4 equal to plain decoding of the same weights in either body."""

from __future__ import annotations

import pytest
import torch

from service.decoding import (
    DecodingError,
    Engine,
    NgramDrafter,
    SamplingParams,
    SpeculativeConfig,
    load_model,
    run_alone,
)
from service.decoding.text import encode_chat
from service.executor.batch_invariant import ATTENTION, FP32LogitsHead, FP32Norm
from service.executor.cpu_kernels import PackedLinear, default_cpu_dtype
from service.executor.int4_weights import (
    GROUP,
    Int4Linear,
    Int4Projection,
    _groups,
    dequantize_int4,
    gguf_is_4bit,
    int4_kernel,
    int4_supported,
    quantize_int4,
)
from service.executor.paths import embedded_gguf_path
from service.executor.q8_head import Q8Head, q8_kernel
from tests.conftest import make_word_model

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    pytest.mark.skipif(not int4_supported(), reason="this torch build has no CPU int4 kernels"),
]


@pytest.fixture(scope="module")
def fp32():
    return load_model("embedded", dtype="float32", weights="dense", pack_cpu_weights=False)


@pytest.fixture(scope="module")
def int4():
    return load_model("embedded")  # --weights auto


def test_requantising_the_embedded_q4_1_weights_finds_the_files_blocks_exactly(fp32):
    # llama.cpp's Q4_1 quantiser puts every block's min at q = 0 and its max at q = 15, so the groups' min
    # and max give back the file's d and m: nothing is lost against the fp32 weights transformers dequantised
    head = fp32.model.get_output_embeddings()
    linears = [m for m in fp32.model.modules() if type(m) is torch.nn.Linear and m is not head]
    assert len(linears) == 210  # 30 layers x (q, k, v, o, gate, up, down)
    for linear in linears[:: 7 * 3] + linears[-7:]:  # every projection kind, across the depth
        q, scales_and_zeros = quantize_int4(linear.weight)
        assert int(q.min()) == 0 and int(q.max()) == 15
        assert torch.equal(dequantize_int4(q, scales_and_zeros), linear.weight.detach())
        # the scales and minimums the kernel holds in float16 are the file's own (Q4_1 stores them so)
        _, scale, low = _groups(linear.weight)
        assert torch.equal(scale.half().float(), scale) and torch.equal(low.half().float(), low)


def test_weights_that_are_not_4bit_lose_what_4_bits_cannot_hold():
    weight = torch.randn(64, 4 * GROUP, generator=torch.Generator().manual_seed(0))
    q, scales_and_zeros = quantize_int4(weight)
    error = (dequantize_int4(q, scales_and_zeros) - weight).abs()
    spread = weight.reshape(64, 4, GROUP).amax(-1) - weight.reshape(64, 4, GROUP).amin(-1)
    # round to the nearest of 16 levels: at most half a step, and not nothing
    assert float(error.max()) > 0
    assert bool((error.reshape(64, 4, GROUP) <= spread[..., None] / 30 + 1e-6).all())
    constant = torch.full((8, GROUP), 0.25)  # a group with no spread keeps its one value
    assert torch.equal(dequantize_int4(*quantize_int4(constant)), constant)


def test_an_int4_layer_computes_its_dequantised_weights_product(fp32):
    linear = fp32.model.model.layers[3].mlp.down_proj
    layer = Int4Linear(linear)
    x = torch.randn(5, linear.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        got = layer(x).float()
        want = x.float() @ dequantize_int4(*quantize_int4(linear.weight)).t()
    # bf16 scales and zeros and a bf16 output: within a few bf16 steps of the exact product
    assert float((got - want).norm() / want.norm()) < 0.01
    assert layer(x[None]).shape == (1, 5, linear.out_features)


def test_a_rows_output_does_not_depend_on_how_many_rows_run_together(int4):
    layer = next(m for m in int4.model.modules() if isinstance(m, Int4Linear))
    rows = torch.randn(70, layer.in_features, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([layer(row[None]) for row in rows])
        for count in (2, 7, 32, 33, 49, 70):
            assert torch.equal(layer(rows[:count]), alone[:count]), count


def test_fused_projections_give_each_layer_the_bits_it_has_alone(fp32, int4):
    dense, fused = fp32.model.model.layers[5], int4.model.model.layers[5]
    generator = torch.Generator().manual_seed(3)
    for names, parent in ((("q_proj", "k_proj", "v_proj"), "self_attn"), (("gate_proj", "up_proj"), "mlp")):
        alone = [Int4Linear(getattr(getattr(dense, parent), n)) for n in names]
        parts = [getattr(getattr(fused, parent), n) for n in names]
        for rows in (1, 7, 40):
            x = torch.randn(1, rows, 576, generator=generator).to(torch.bfloat16)
            with torch.inference_mode():
                for part, layer in zip(parts, alone, strict=True):
                    assert torch.equal(part(x), layer(x)), (names, rows)
            assert parts[0].group._input is None  # every part taken: no activation held between forwards
        with torch.inference_mode():  # a caller that feeds one projection another tensor gets its own answer
            x, y = (torch.randn(2, 576, generator=generator).to(torch.bfloat16) for _ in range(2))
            assert torch.equal(parts[0](x), alone[0](x)) and torch.equal(parts[1](y), alone[1](y))


def test_auto_loads_the_embedded_4bit_gguf_as_int4_in_the_fastest_body(int4):
    assert gguf_is_4bit(embedded_gguf_path())
    assert int4.weights == "int4"
    model = int4.model
    # q, k, v and gate, up fused per layer (one matmul each); o and down alone
    assert sum(isinstance(m, Int4Projection) for m in model.modules()) == 150
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 120
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    # the body as `--dtype auto` picks it: the fused fp32 layers where the project's kernel builds, else bf16
    # where the CPU multiplies bf16 natively, fp32 elsewhere
    if int4_kernel() is not None:
        assert model.dtype == torch.float32
        assert all(hasattr(layer, "_csd_fused") for layer in model.model.layers)
    else:
        assert model.dtype == default_cpu_dtype()


def test_a_bf16_body_is_batch_invariant_with_fp32_logits():
    model = load_model("embedded", dtype="bfloat16", weights="int4").model
    assert model.dtype == torch.bfloat16
    assert model.config._attn_implementation == ATTENTION
    # logits stay fp32 (no bf16 ties): from the file's 8-bit blocks, or a packed fp32 copy without the kernel
    assert isinstance(model.get_output_embeddings(), Q8Head if q8_kernel() else FP32LogitsHead)
    assert isinstance(model.get_decoder().norm, FP32Norm)
    layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
    # the project's kernel keeps float16 scales and minimums (the file's own, untouched by the cast to bf16);
    # torch's takes bf16 ones
    if layer._kernel is not None:
        assert layer.scale.dtype == layer.low.dtype == torch.float16
    else:
        assert layer.scales_and_zeros.dtype == torch.bfloat16
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with torch.inference_mode():
        assert layer(x).dtype == torch.bfloat16


def test_an_fp32_body_keeps_fp32_activations_and_is_batch_invariant_too():
    # its int4 matmuls quantise their input per group (or round it to bf16 for torch's kernel), which would
    # grow fp32's last-bit differences into flipped near-ties: so its attention reads each row's own keys in
    # order (the fused layers' C++ attention, else row-aligned attention)
    model = load_model("embedded", dtype="float32", weights="int4").model
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == ATTENTION
    # fp32 rounding only, no bf16 after it
    assert isinstance(model.get_output_embeddings(), Q8Head if q8_kernel() else PackedLinear)
    layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        y = layer(x)
        assert y.dtype == torch.float32
        if layer._kernel is not None:  # fp32 activations read as they are, not rounded to bf16 first
            assert not torch.equal(y, layer(x.to(torch.bfloat16)).float())
        else:
            assert torch.equal(y, layer(x.to(torch.bfloat16)).float())


@pytest.mark.parametrize("body", ["bfloat16", "float32"])
def test_strict_sd_on_either_body_is_plain_decoding_of_the_same_weights(body):
    target = load_model("embedded", dtype=body, weights="int4")
    engine = Engine(target, {"ngram": NgramDrafter()})
    ids = encode_chat(
        target.tokenizer, [{"role": "user", "content": "Write the days of the week, one per line, twice."}]
    )
    runs = {}
    for method in ("vanilla", "sd"):
        generation = engine.generate(ids, SamplingParams(max_tokens=40), SpeculativeConfig(method), "ngram")
        list(run_alone(generation))
        runs[method] = generation
    assert runs["sd"].stats.num_accepted > 0  # the drafts were verified in multi-token forwards
    assert [t.token_id for t in runs["sd"].tokens] == [t.token_id for t in runs["vanilla"].tokens]


def test_weights_int4_and_dense_are_honoured_and_validated(fp32, tmp_path):
    assert fp32.weights == "dense" and not any(isinstance(m, Int4Linear) for m in fp32.model.modules())
    # an explicit dtype keeps the dtype's own weights under auto
    assert load_model("embedded", dtype="float32").weights == "dense"
    words = make_word_model(seed=0)
    folder = tmp_path / "words"
    words.model.save_pretrained(folder)
    words.tokenizer.save_pretrained(folder)
    assert load_model(str(folder)).weights == "dense"  # not a 4-bit file: auto keeps it dense
    with pytest.raises(DecodingError, match="unknown weights 'int3'"):
        load_model("embedded", weights="int3")
    with pytest.raises(DecodingError, match="bfloat16 or float32 body"):
        load_model("embedded", weights="int4", dtype="float16")
    with pytest.raises(DecodingError, match="CPU only"):
        load_model("embedded", weights="int4", device="cuda")


def test_int4_logits_stay_close_to_the_fp32_models(fp32, int4):
    ids = fp32.tokenizer("The colour of the theatre was grey, and the centre stage of the")["input_ids"]
    with torch.inference_mode():
        want = fp32.model(input_ids=torch.tensor([ids])).logits[0].float()
        got = int4.model(input_ids=torch.tensor([ids])).logits[0]
    assert got.dtype == torch.float32
    # the file's own weights, with activations quantised per group (the fused layers) or rounded to bf16:
    # the top token agrees at almost every position
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert float(agree) >= 0.8, float(agree)
    # and the distributions stay close: KL(fp32 || int4) per position (uniform logit shifts, which softmax
    # ignores, do not count). Measured: mean 0.02 nats, 0.13 at worst, at the third and fourth tokens, whose
    # hidden states hold the largest outliers (8-bit groups are coarsest there)
    log_want, log_got = want.log_softmax(-1), got.log_softmax(-1)
    kl = (log_want.exp() * (log_want - log_got)).sum(-1)
    assert float(kl.mean()) < 0.05 and float(kl.max()) < 0.3, kl
