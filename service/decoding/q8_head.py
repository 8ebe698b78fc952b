"""The LM head of a GGUF from its own 8-bit blocks: a quarter of fp32's bytes a forward, fp32 logits.

A one-token forward of the embedded model read its fp32 LM head (49,152 x 576, 113 MB) in 7-9 ms: a quarter to
a third of the whole forward once the body runs from 4-bit blocks (`int4_weights`). The GGUF stores that
matrix (the token embeddings, tied) as Q8_0: blocks of 32 int8 weights and one float16 scale, 28 MB. llama.cpp
reads those bytes; so does `Q8Head`, with a small C++ kernel (`kernels/q8_linear.cpp`): fp32 activations
times scale * q, decoded in registers, fp32 logits. The weights are the file's own (found again exactly, as
the 4-bit body's are: `q8_blocks`), and every logit is their dot product in fp32 to rounding, so quality is
the fp32 head's. Measured on the embedded model's head (AMD EPYC with AVX512-BF16, 1 thread): 3.3 ms for one
row against 7.8 for the oneDNN-packed fp32 head, 5.9 against 7.0 at 4 rows, 10.8 against 9.4 at 8; a whole
forward of the embedded model (int4 body in bf16) 28.5 against 34.9 ms at width 1, 31.6 against 37.2 at 2.
On AVX2 the kernel holds a row's lanes in registers (the generic loop's stayed in memory) and decodes a block
once for up to 4 rows: on an AVX2-only EPYC (Zen 3, 1 thread) 3.1 ms at one row, 5.0 at 4, 9.0 at 8 against
4.3-5.2, 7.9 and 13.6 for the generic loop (and 8.2 / 11.7 / 16.1 for the packed fp32 head).

Past Q8_MAX_ROWS rows (wide verifications, batches) the kernel, which is compute-bound (it decodes every
weight block once per 4 rows and multiplies in fp32), loses to oneDNN's blocked sgemm (on the AVX512-BF16 EPYC,
with the generic loop, 16 rows 22 vs 12 ms; on the AVX2 EPYC it still wins at 16 rows, 20.0 vs 21.4),
so such calls take the packed fp32 copy of the same weights (`cpu_kernels.PackedLinear`). The two kernels sum in different orders: a row's logits in a wide batch
and alone differ by fp32 rounding (~1e-6), as the logits of any fp32 model do across batch shapes; the
hidden states they are computed from keep their bits (`batch_invariant`). Within the 8-bit kernel a row gets
the same bits for any row count and thread count (every output is computed by the same instructions).

The kernel is compiled on first use, for this CPU, into the model cache (`native`): about 30-50 s once, a few
ms after. Without a C++ compiler and ninja (or if the build fails) the
head stays the packed fp32 one, with a warning: the same logits to fp32 rounding, slower.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from service.decoding import native
from service.decoding.cpu_kernels import PackedLinear

log = logging.getLogger(__name__)

BLOCK = 32  # weights per scale: GGUF's Q8_0 block
# rows (positions) up to which a call runs the 8-bit kernel; wider calls run the packed fp32 copy. Measured on
# an AVX2 EPYC, 1 thread, the embedded head: 8 rows 9.0 ms against 16.1 for the packed copy, 16 rows 20.0 vs 21.4
Q8_MAX_ROWS = 8
PROFILE_SCOPE = "csd::q8_linear"  # the kernel's span under torch.profiler (it is no aten operator)


@functools.cache
def q8_kernel() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """`q8_linear(x [N, K] fp32, q [V, K] int8, scales [V, K / 32] fp32) -> [N, V] fp32`, built once per
    machine kind into the model cache (`native`); None where it cannot be built (logged)."""
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


class Q8Head(torch.nn.Module):
    """An LM head (`nn.Linear` without bias) from 8-bit blocks: fp32 logits from fp32 or bf16 hidden states.
    `weight` stays the model's own (tied) Parameter, for code that reads it (a draft head binds it)."""

    def __init__(
        self,
        linear: torch.nn.Linear,
        blocks: tuple[torch.Tensor, torch.Tensor],
        kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        q, scales = blocks
        # derived layouts: buffers, never saved
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        dense = torch.nn.Linear(self.in_features, self.out_features, bias=False)
        with torch.no_grad():
            dense.weight.copy_((q.float().reshape(-1, BLOCK) * scales.reshape(-1, 1)).reshape(q.shape))
        self.wide = PackedLinear(dense)
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1]).float().contiguous()
        if rows.shape[0] > Q8_MAX_ROWS:
            y = self.wide(rows)
        else:
            with torch.profiler.record_function(PROFILE_SCOPE):
                y = self._kernel(rows, self.q, self.scales)
        return y.reshape(*shape[:-1], self.out_features)


class Q8Linear(torch.nn.Module):
    """An `nn.Linear` (bias or not) read from 8-bit blocks by the kernel, fp32 in and out, for every row count:
    the draft head's layers, a fifth of its fp32 bytes (`RecurrentDraftHead.use_8bit_blocks`)."""

    def __init__(
        self,
        linear: torch.nn.Linear,
        kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        q, scales = quantize_q8(linear.weight)
        self.register_buffer("q", q, persistent=False)
        self.register_buffer("scales", scales, persistent=False)
        bias = linear.bias.detach().float().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias, persistent=False)
        self._kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = self._kernel(x.reshape(-1, shape[-1]).float().contiguous(), self.q, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features).to(x.dtype)


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
