"""The LM head of a GGUF from its own 8-bit blocks: a quarter of fp32's bytes a forward, integer dot products.

A one-token forward of the embedded model read its fp32 LM head (49,152 x 576, 113 MB) in 7-9 ms: a quarter to
a third of the whole forward once the body runs from 4-bit blocks (`int4_weights`). The GGUF stores that
matrix (the token embeddings, tied) as Q8_0: blocks of 32 int8 weights and one float16 scale, 28 MB. llama.cpp
reads those bytes, and multiplies them as integers with the activations quantised to 8 bits per block (its
Q8_0 x Q8_0 dot product); so does `Q8Head`, with a small C++ kernel (`kernels/q8_linear.cpp`, its layout made
by `pack_q8`): 32 multiply-adds an instruction where fp32 did 8 (one VNNI instruction a 4-byte dot product
where the CPU has it), fp32 logits. The weights are the file's own (found again exactly, as the 4-bit body's
are: `q8_blocks`); the activations' 8-bit rounding moves the logits by 0.7 % of their norm (the embedded
model's head on its own hidden states over a 30-token sentence, the same top token at every position), the
order of the 4-bit body's own activation rounding (quality against the fp32 model: `bench.weight_quality`).

The kernel serves every row count: it is compute-light enough to beat oneDNN's fp32 sgemm on a packed copy at
any width (which the fp32-activation kernel before it handed calls past 8 rows to), so no fp32 copy is kept
(113 MB), and a row's logits have the same bits alone, in a wide verification or in a batch (every output is
computed by the same instructions, whatever the row and thread count and whether the VNNI, AVX2 or portable
path runs).

The kernel is compiled on first use, for this CPU, into the model cache (`native`): about 30-50 s once, a few
ms after. Without a C++ compiler and ninja (or if the build fails) the head stays the packed fp32 one, with a
warning: logits within the activations' rounding, slower.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from service.executor import native
from service.executor.int4_weights import KERNEL_COLUMNS, interleave_blocks

log = logging.getLogger(__name__)

BLOCK = 32  # weights per scale: GGUF's Q8_0 block
COLUMNS = KERNEL_COLUMNS  # output columns interleaved in the kernel's layout (one per 32-bit lane), as int4's
PROFILE_SCOPE = "csd::q8_linear"  # the kernel's span under torch.profiler (it is no aten operator)

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@functools.cache
def q8_kernel() -> Kernel | None:
    """`q8_linear(x [R, K] fp32, w, scales, sums, n) -> [R, n] fp32` over weights packed by `pack_q8`, built
    once per machine kind into the model cache (`native`); None where it cannot be built (logged)."""
    module = native.build("q8_linear")
    if module is None:
        log.warning("without the 8-bit kernel the LM head stays fp32")
        return None
    return module.q8_linear


def quantize_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [V, K] (K a multiple of 32) as Q8_0 blocks, (q [V, K] int8, scales [V, K / 32] fp32):
    scale = max|w| / 127 rounded to float16, as llama.cpp quantises; exact for weights that are Q8_0 already
    (`q8_blocks` finds them again), a relative error of ~0.2 % of a block's largest weight otherwise."""
    v, k = weight.shape
    blocks = weight.detach().float().reshape(v, k // BLOCK, BLOCK)
    scales = (blocks.abs().amax(dim=-1) / 127).half().float()
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (blocks / safe[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.reshape(v, k), scales.contiguous()


def q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q [V, K] int8, scales [V, K / 32] fp32) when every block of 32 weights of `weight` is exactly
    scale * q with q an int8 in -127..127 and scale a float16, as GGUF's Q8_0 stores them; None otherwise.

    A Q8_0 block's largest weight has |q| = 127 (llama.cpp's quantiser sets scale = max|w| / 127), so the
    dequantised block's max / 127 is its float16 scale again, exactly, and w / scale its q."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    q, scales = quantize_q8(weight)
    v, k = weight.shape
    decoded = q.float().reshape(v, k // BLOCK, BLOCK) * scales[..., None]
    if not torch.equal(decoded.reshape(v, k), weight.detach().float()):
        return None
    return q, scales


def pack_q8(q: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (q [N, K] int8, scales [N, K / 32] fp32) in `kernels/q8_linear.cpp`'s layout, the N rows
    padded with zeros to a multiple of 8: (w [N', K] int8 in memory order [N' / 8, K / 32, 8, 8, 4]: per group
    of 8 columns and block of 32 weights, eight runs of 32 bytes, column c's 4 bytes of run i its block weights
    4i..4i + 3; float16 scales and the blocks' int16 weight sums [N' / 8, K / 32, 8] held as [N', K / 32])."""
    n, k = q.shape
    padded = -(-n // COLUMNS) * COLUMNS
    if padded != n:
        q = torch.cat([q, q.new_zeros(padded - n, k)])
        scales = torch.cat([scales, scales.new_zeros(padded - n, k // BLOCK)])
    # [group, column, block, run i, byte e] -> [group, block, run, column, byte]
    w = q.reshape(padded // COLUMNS, COLUMNS, k // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).reshape(padded, k)
    # float16 scales (Q8_0's own: `quantize_q8` rounds to them) and int16 weight sums (at most 32 x 127)
    sums = q.reshape(padded, k // BLOCK, BLOCK).sum(-1, dtype=torch.int32).to(torch.int16)
    # per-block values in the 4-bit kernel's order, which this kernel shares
    return w.contiguous(), interleave_blocks(scales.half()), interleave_blocks(sums)


class Q8Matrix(torch.nn.Module):
    """A weight [N, K] as packed 8-bit blocks and the kernel that multiplies by it: `matrix(x [R, K])` is
    x W^T, [R, N] fp32, for any R. The packed layouts are buffers, never saved."""

    def __init__(self, blocks: tuple[torch.Tensor, torch.Tensor], kernel: Kernel) -> None:
        super().__init__()
        q, scales = blocks
        self.out_features, self.in_features = q.shape
        w, packed_scales, sums = pack_q8(q, scales)
        self.register_buffer("w", w, persistent=False)
        self.register_buffer("scales", packed_scales, persistent=False)
        self.register_buffer("sums", sums, persistent=False)
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float().contiguous()
        if torch.autograd.profiler._is_profiler_enabled:  # a span costs about a drafted position's small call
            with torch.profiler.record_function(PROFILE_SCOPE):
                y = self._kernel(rows, self.w, self.scales, self.sums, self.out_features)
        else:
            y = self._kernel(rows, self.w, self.scales, self.sums, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)


class Q8Head(torch.nn.Module):
    """An LM head (`nn.Linear` without bias) from 8-bit blocks: fp32 logits from fp32 or bf16 hidden states.
    `weight` stays the model's own (tied) Parameter, for code that reads it (a draft head binds it)."""

    def __init__(
        self, linear: torch.nn.Linear, blocks: tuple[torch.Tensor, torch.Tensor], kernel: Kernel
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.matrix = Q8Matrix(blocks, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matrix(x)


class Q8Linear(torch.nn.Module):
    """An `nn.Linear` (bias or not) read from 8-bit blocks by the kernel, fp32 in and out, for every row count:
    the draft head's layers, a fifth of its fp32 bytes (`RecurrentDraftHead.use_8bit_blocks`)."""

    def __init__(self, linear: torch.nn.Linear, kernel: Kernel) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.matrix = Q8Matrix(quantize_q8(linear.weight), kernel)
        bias = linear.bias.detach().float().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matrix(x)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def head_blocks(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's LM head as 8-bit blocks, if it is exactly that (read it from the fp32 weights, before any
    cast) and is a CPU `nn.Linear` without bias."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or head.weight.device.type != "cpu":
        return None
    return q8_blocks(head.weight)


def use_q8_head(model: torch.nn.Module, blocks: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Serve the model's LM head from `blocks` (`head_blocks`) when the kernel builds; returns whether it
    does."""
    kernel = q8_kernel()
    if kernel is None:
        return False
    model.set_output_embeddings(Q8Head(model.get_output_embeddings(), blocks, kernel))
    log.debug("LM head from 8-bit blocks (%d x %d)", *blocks[0].shape)
    return True
