"""4-bit weights on the CPU: the linear layers of a 4-bit GGUF executed from 4-bit blocks, never widened.

A one-token forward of the embedded model is memory-bound: in fp32 it reads 539 MB of weights per token, where
llama.cpp reads the GGUF's own Q4_1 blocks (76 MB). `Int4Linear` keeps each linear layer in 4-bit groups of 32
along the input features, w = d * q + m with q in 0..15.

Q4_1 is exactly that shape: a block of 32 weights is d * q + m with q in 0..15, and llama.cpp's quantiser sets
m = the block's minimum and d = (max - min) / 15, so every block holds a q = 0 and a q = 15. Re-quantising the
dequantised weights by each group's min and max therefore finds the file's own q again (`quantize_int4`).
Other sources (Q4_0, an fp16 checkpoint) quantise the same way: lossy, which is why `load_model` asks for it
only where the file is 4-bit already (`gguf_is_4bit`) or the user says so.

Two kernels multiply them:
- **the project's** (`kernels/int4_linear.cpp`, compiled on first use for the CPU: `native`), where the input
  features are a multiple of 32 and the outputs of 8: the activations are quantised to 8 bits per group of 32
  inside it, as llama.cpp multiplies a Q4_1 weight (its Q8_1), and each row's products are exact integer dot
  products (AVX2 byte multiplies, 8 columns interleaved so one instruction serves 8 of them: `pack_int4`), a
  weight block unpacked once for up to 4 rows. The rounding of the
  activations meets q - 8, centred, not q: ~0.6 % of a product's norm on random data (bf16 rounding ~0.3 %).
  fp32 scales and minimums, fp32 or bf16 activations, a row's bits the same for any row and thread count.
  It also computes whole decoder layers around it (`fused_layers`), which is where most of its speed comes
  from: a one-token forward of the embedded model 2-2.5x faster than the eager layers on either kernel;
- **torch's** (`_weight_int4pack_mm_for_cpu`, groups of 32, bf16 scales and zeros) elsewhere: vectorised for
  bf16 activations only (fp32 ones take a scalar loop ~15x slower), so the layer rounds its input to bf16.

The rest of the model (the body) runs in fp32 where the project's kernel builds (the fused layers), else in the
dtype `--dtype auto` picks for the CPU: bf16 where the CPU multiplies bf16 natively, made batch-invariant like
any bf16 CPU model (`batch_invariant`), fp32 elsewhere (row-aligned attention). In every body the LM head reads
the GGUF's own 8-bit blocks where the file holds them (`q8_head`), fp32 logits; elsewhere a packed fp32 head.
Either way strict speculative decoding stays plain decoding of the same weights (tested).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from service.executor import native

log = logging.getLogger(__name__)

GROUP = 32  # weights per (scale, zero): Q4_0/Q4_1's block size
# the packing's inner tiling: the CPU kernel takes 1 (the CUDA one 2, 4 or 8)
_INNER_K_TILES = 1
PROFILE_SCOPE = "csd::int4_linear"  # the kernel's span under torch.profiler (it is no aten operator)


def int4_supported() -> bool:
    """Whether this torch build has the CPU int4 weight-only kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu"
    )


def _groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K / GROUP, GROUP] int32 in 0..15, scale, low [N, K / GROUP]): each group of GROUP input features
    as low + q * scale, scale = (max - min) / 15."""
    n, k = weight.shape
    blocks = weight.detach().float().reshape(n, k // GROUP, GROUP)
    low, high = blocks.amin(dim=-1), blocks.amax(dim=-1)
    scale = (high - low) / 15
    # a constant group (all weights equal) has no spread: any scale, q = 0 and its value as the minimum
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = ((blocks - low[..., None]) / safe[..., None]).round().clamp_(0, 15).to(torch.int32)
    return q, scale, low


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [N, K] (K a multiple of GROUP) as (q [N, K] int32 in 0..15, scales_and_zeros
    [K / GROUP, N, 2] fp32): asymmetric per group of GROUP input features, scale = (max - min) / 15 and
    zero = min + 8 scale, so w ~ (q - 8) * scale + zero (torch's int4 layout)."""
    q, scale, low = _groups(weight)
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return q.reshape(weight.shape), scales_and_zeros


def dequantize_int4(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The dense fp32 weight [N, K] that (q, scales_and_zeros) stand for (the reference the kernel computes
    with, scales and zeros as stored)."""
    scale = scales_and_zeros[..., 0].float().t().repeat_interleave(GROUP, dim=1)
    zero = scales_and_zeros[..., 1].float().t().repeat_interleave(GROUP, dim=1)
    return (q.float() - 8) * scale + zero


KERNEL_COLUMNS = 8  # output columns the kernel's layout interleaves


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (0..15; N a multiple of 8, K of 32) in `kernels/int4_linear.cpp`'s layout, [N, K / 2] uint8 in
    memory order [N / 8, K / 32, 4, 8, 4]: per group of 8 columns and block of 32 weights, four runs of 32 bytes;
    in run i, column c's 4 bytes hold its block weights 4i..4i + 3 in the low nibbles and 16 + 4i..16 + 4i + 3
    in the high ones (one 32-bit lane a column)."""
    n, k = q.shape
    cols = KERNEL_COLUMNS
    # [group, column, block, half (weights 0..15 or 16..31), run i, byte e] -> [group, block, run, column, byte]
    g = q.reshape(n // cols, cols, k // GROUP, 2, 4, 4).to(torch.uint8).permute(0, 2, 4, 1, 5, 3)
    return (g[..., 0] | (g[..., 1] << 4)).reshape(n, k // 2).contiguous()


def interleave_blocks(t: torch.Tensor) -> torch.Tensor:
    """Per-block values [N, K / 32] (scales, minimums) in the kernel's order, [N / 8, K / 32, 8] held as
    [N, K / 32]: a block's 8 interleaved columns read as one vector."""
    n, blocks = t.shape
    return (
        t.reshape(n // KERNEL_COLUMNS, KERNEL_COLUMNS, blocks).transpose(1, 2).contiguous().reshape(n, blocks)
    )


def kernel_supports(in_features: int, out_features: int) -> bool:
    """Whether the project's kernel can hold a layer of this shape (else torch's int4 kernel runs it)."""
    return in_features % GROUP == 0 and out_features % KERNEL_COLUMNS == 0


def int4_kernel() -> Callable[..., torch.Tensor] | None:
    """`int4_linear(x [R, K] fp32 or bf16, packed [N, K / 2] uint8, scale [N, K / 64 * 2] fp32, low) -> [R, N]`
    in x's dtype (`kernels/int4_linear.cpp`), or None where it cannot be built."""
    module = native.build("int4_linear")
    return None if module is None else module.int4_linear


class Int4Linear(torch.nn.Module):
    """An `nn.Linear` with 4-bit grouped weights (any leading shape; returns its input's dtype, bf16 or fp32).
    Buffers, not parameters: nothing trains them, and a saved model never holds them (derived at load).

    With the project's kernel (`kernels/int4_linear.cpp`, built on first use; `kernel_supports`) the
    activations are quantised to 8 bits per group of 32 inside it, as llama.cpp multiplies a Q4_1 weight;
    otherwise torch's int4 kernel runs, on the activations rounded to bf16."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        q, scale, low = _groups(linear.weight)
        q = q.reshape(linear.weight.shape)
        self._kernel = int4_kernel() if kernel_supports(self.in_features, self.out_features) else None
        if self._kernel is not None:
            self.register_buffer("packed_weight", pack_int4(q), persistent=False)
            # float16 scales and minimums, as a GGUF's Q4_1 blocks hold them (exact for those; a relative
            # 2^-11 for weights quantised here, far below 4 bits' own error): a sixth fewer bytes a forward
            # than fp32. Held as their bits (int16), so casting the body to bf16 (`model.to`) leaves them as
            # they are; `scale` and `low` read them as float16, in the kernel's interleaved order
            self.register_buffer(
                "scale_bits", interleave_blocks(scale).half().view(torch.int16), persistent=False
            )
            self.register_buffer(
                "low_bits", interleave_blocks(low).half().view(torch.int16), persistent=False
            )
        else:
            self.register_buffer(
                "packed_weight",
                torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES),
                persistent=False,
            )
            scales_and_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1).contiguous()
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(torch.bfloat16), persistent=False)
        bias = linear.bias.detach().float() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    @property
    def scale(self) -> torch.Tensor:
        """The groups' scales d, float16, in the kernel's order (`interleave_blocks`; the project's kernel only)."""
        return self.scale_bits.view(torch.float16)

    @property
    def low(self) -> torch.Tensor:
        """The groups' minimums m, float16, in the kernel's order (`interleave_blocks`; the project's kernel only)."""
        return self.low_bits.view(torch.float16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self._kernel is not None:
            rows = x.reshape(-1, shape[-1]).contiguous()
            if torch.autograd.profiler._is_profiler_enabled:  # a span costs as much as a one-row call
                with torch.profiler.record_function(PROFILE_SCOPE):
                    y = self._kernel(rows, self.packed_weight, self.scale, self.low)
            else:
                y = self._kernel(rows, self.packed_weight, self.scale, self.low)
        else:
            rows = x.reshape(-1, shape[-1]).to(torch.bfloat16)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.packed_weight, GROUP, self.scales_and_zeros
            ).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)


class Int4Projections(torch.nn.Module):
    """Sibling linear layers that read the same input (an attention's q, k and v; an MLP's gate and up) as one
    int4 matmul over their stacked weights: one kernel call instead of three or two, on a wider output,
    which at one row saves ~0.02 ms a layer (0.066 -> 0.043 ms for q, k, v on the embedded model). The
    kernel computes each output column alone, so every part has the bits its own layer gives (tested).

    The model still calls each projection (`Int4Projection`) with the same input tensor; the first call
    computes all parts, the others take theirs, and the parts are dropped once each was taken. A call with
    another input (a caller that feeds the projections different tensors) just computes again."""

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        super().__init__()
        stacked = torch.nn.Linear(
            linears[0].in_features, sum(layer.out_features for layer in linears), bias=False
        )
        with torch.no_grad():
            stacked.weight.copy_(torch.cat([layer.weight.detach().float() for layer in linears]))
            if all(layer.bias is not None for layer in linears):
                stacked.bias = torch.nn.Parameter(
                    torch.cat([layer.bias.detach().float() for layer in linears])
                )
        self.fused = Int4Linear(stacked)
        self.sizes = [layer.out_features for layer in linears]
        self._input: torch.Tensor | None = None
        self._parts: list[torch.Tensor | None] = []

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if x is not self._input or self._parts[index] is None:
            self._input, self._parts = x, list(self.fused(x).split(self.sizes, dim=-1))
        out, self._parts[index] = self._parts[index], None
        if all(p is None for p in self._parts):  # every part taken: hold no activations between forwards
            self._input = None
        return out


class Int4Projection(torch.nn.Module):
    """One layer's share of an `Int4Projections` (where its `nn.Linear` was)."""

    def __init__(self, group: Int4Projections, index: int, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.group = group  # the same module under every sibling: its buffers count once
        self.index = index
        self.in_features = linear.in_features
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.part(x, self.index)


# sibling projections of one input, by the names Llama-style decoders give them (Llama, Mistral, Qwen, SmolLM)
FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_linear_layers(model: torch.nn.Module) -> int:
    """Replace every plain `nn.Linear` of the model's body (not its LM head, whose logits stay fp32; not a
    layer whose input features are not a multiple of GROUP, or whose outputs not of 16, which both kernels need)
    by 4-bit weights, from the weights as they are
    (call it on the fp32 weights, before any cast to bf16): siblings that read one input (FUSED_SIBLINGS)
    as one `Int4Projections`, the rest as `Int4Linear`. Returns how many layers were replaced."""
    head = model.get_output_embeddings()

    def quantisable(child: object) -> bool:
        return (
            type(child) is torch.nn.Linear
            and child is not head
            and child.in_features % GROUP == 0
            and child.out_features % 16 == 0
        )

    replaced = 0
    for module in list(model.modules()):
        for names in FUSED_SIBLINGS:
            linears = [getattr(module, n, None) for n in names]
            if (
                all(quantisable(layer) for layer in linears)
                and len({layer.in_features for layer in linears}) == 1
            ):
                if len({layer.bias is None for layer in linears}) != 1:
                    continue  # some with a bias, some without: left to the layer-by-layer pass
                group = Int4Projections(linears)
                for index, (name, linear) in enumerate(zip(names, linears, strict=True)):
                    setattr(module, name, Int4Projection(group, index, linear))
                replaced += len(names)
        for name, child in list(module.named_children()):
            if quantisable(child):
                setattr(module, name, Int4Linear(child))
                replaced += 1
    log.debug("%d linear layers hold 4-bit weights", replaced)
    return replaced


# GGUF tensor types that hold 4 bits a weight (what "the file is 4-bit already" means for --weights auto)
_GGUF_4BIT = {"Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "IQ4_XS"}


def gguf_is_4bit(path) -> bool:
    """Whether the linear layers of a GGUF file (its 2-D tensors but the token embedding and output head)
    are 4-bit. Reads the header only."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        log.debug("cannot read the tensor types of %s: %s", path, exc)
        return False
    kinds = {
        t.tensor_type.name
        for t in reader.tensors
        if len(t.shape) == 2 and t.name.split(".")[0] not in ("token_embd", "output")
    }
    return bool(kinds) and kinds <= _GGUF_4BIT
