"""Forwards whose every position gets the same bits however the work is batched (bf16 on the CPU).

Strict speculative decoding promises plain decoding's tokens exactly. It verifies k draft tokens in one
forward, where plain decoding runs k one-token forwards, and it serves requests in padded batches, where a
request alone runs one row. In fp32 the kernels' different summation orders move logits by ~1e-6 and a flip
needs a near-tie that close. In bf16 every matmul output is rounded to 8 bits of mantissa, so the same
differences grow to ~0.05 in the logits and flip real near-ties: with torch's stock kernels, strict SD equalled
plain decoding on only 7 of 24 bench runs. So instead of tolerating the differences, this module removes them.
What differs, measured on the embedded model (one thread, AVX512-BF16, torch 2.13):

- **Row counts.** oneDNN's bf16 matmul gives each row the same bits for any number of rows from 2 to 32, but
  a single row takes a matrix-vector path that sums in another order (1 ulp apart in ~3 % of rows), and past
  32 rows it switches to other blockings (33 to a few hundred rows one, larger counts others), each summing
  differently: a batch verifying 7 rows x 7 tokens (49 rows) flipped near-ties the same rows alone did not.
  `RowInvariantLinear` runs every matmul in blocks of 2 to 32 rows (a single row as the row twice), and
  attention's two matmuls in blocks of at most 32 rows (the queries of the heads that share a kv head are
  the rows of one matmul: 3 heads x 10 queries for the embedded model), where every count gives the same
  bits.
- **Attention.** torch's fused SDPA kernel sums a one-query attention differently from a k-query one; eager
  attention (matmul, softmax, matmul) does not, as long as a query's visible keys sit at the same positions of
  the key axis: keys masked at the end of the axis add exact zeros, keys masked in front of them (a batch's
  left padding, the holes rejected drafts leave) shift which vector lane sums which key. `row_aligned_attention`
  gathers each row's visible keys to the front, in order, and pads the key axis to a multiple of 64 (so no
  length takes a scalar tail loop), then runs eager attention.

**Logits in fp32.** A bf16 LM head rounds every logit to 8 bits of mantissa: steps of 0.125 at |logit| 16-32,
so two tokens tie exactly again and again (on the embedded model a rescued draft token and the target's top
came out at the same -0.8097 logprob), greedy then picks by token id, and a tie between a draft token and the
target's top decides what "accepted" and "rescued" mean. So the final norm and the LM head run in fp32
(`FP32LogitsHead`, `FP32Norm`) while the body stays bf16: the logits verification compares are fp32, with
ties as rare as on an fp32 model. The head's fp32 weight (a packed copy of the tied bf16 one) runs in the
same row blocks, a single row as two: oneDNN's packed fp32 kernel gives a row the same bits for any count
from 2 to 80 rows tested, 1 and 2 threads. It costs a read of 113 MB of fp32 weights instead of 57 MB of
bf16 ones: measured on the embedded model (Intel Xeon with AMX, 1 thread, 100 tokens of context, a busy
host) +5.8 ms at width 1 (85.0 vs 79.1 ms, 1.07x), +8.3 ms at width 4 (1.11x), +9.7 ms at width 8 (1.12x).

**4-bit weights in an fp32 body** (what an AVX2-only CPU serves for a 4-bit GGUF, `int4_weights`) need the
same: each int4 layer rounds its input to bf16, so fp32's last-bit differences between batch shapes become
bf16-ulp differences there and grow to ~0.3 in the logits. Such a model gets row-aligned attention too (its
int4 matmuls are row-invariant, its norms elementwise). Its LM head is not made row-invariant: no bf16
rounding follows it, so its logits differ across batch shapes by fp32 rounding only, as a dense fp32 model's
do, and running a single row as two would have doubled its cost on an AVX2 CPU (oneDNN's one-row kernel read
the 113 MB weight in 7.6 ms, its two-row one in 14.7). A 4-bit GGUF's head, in either body, reads the file's
8-bit blocks (`q8_head.Q8Head`: fp32 logits, a row's bits the same for any row count), so its logits are
bit-identical across batch shapes too, on bit-identical hidden states.
fp32 attention needs one more step: MKL's fp32 matmul (same CPU) sums a row of a 4-row or larger matmul
in another order than one of 1 to 3 rows, yet a row's bits do not depend on its place in a matmul of fixed
shape; so in fp32 each attention matmul runs exactly FP32_QUERY_BLOCK queries, a short block padded with
zero queries.

With all three, a 7-token chunk gives bit-identical logits to 7 one-token forwards, a 48-token chunk too, and a row
of a padded batch the bits of the same sequence alone (tests/executor/test_batch_invariant.py). It costs
little where it matters most: the 7-token forward of the embedded model stays ~1.1x a one-token one (packed
fp32: ~1.6x), and eager attention decodes faster here than SDPA, whose one-query bf16 path was slower than its
7-query one at 1,500 tokens of context. Wide forwards pay more, since they run the small-row kernels block
by block (Intel Xeon, one thread, the embedded model): a 200- or 600-token prefill 1.7x its one-call time, a
16-row x 7-token verification 1.28x; a 1,500-token prefill got faster (4.85 vs 6.63 s: 32-query blocks keep
eager attention's score matrices small). Prefill is eager anyway (SDPA bf16 took 2.3 s for those 1,500
tokens): the price of the guarantee.

**The fused layers** of a 4-bit model in an fp32 body (`fused_layers`, where the project's C++ kernel builds)
keep the same guarantee without any of this: their norms, RoPE, 4-bit matmuls and SiLU work row by row, and
their attention reads each query's visible keys one by one, in order, so a row's bits cannot depend on the
batch, its padding or the holes rejected drafts leave. Such a model still gets row-aligned attention here: it
is what runs wherever a layer falls back to transformers' own forward.
"""

from __future__ import annotations

import copy
import logging

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

from service.decoding.types import DecodingError
from service.executor.cpu_kernels import PackedLinear, replace_linear_layers
from service.executor.int4_weights import Int4Linear
from service.executor.q8_head import Q8Head

log = logging.getLogger(__name__)

ATTENTION = "csd_row_aligned"
_KEY_BLOCK = 64  # key axis padded to a multiple of this: AVX512 lanes x unrolling, no scalar tail
# the most rows (queries) one matmul call takes: oneDNN's bf16 kernels give a row the same bits for any count
# from 2 to 32 and other bits past it (measured on AVX512-BF16, 1 and 2 threads)
ROW_BLOCK = 32
# queries per attention matmul in fp32, every one (see row_aligned_attention)
FP32_QUERY_BLOCK = 8


class RowInvariantLinear(torch.nn.Module):
    """An `nn.Linear` whose output rows do not depend on how many rows run together: rows run in blocks of at
    most ROW_BLOCK, and a block of one row as two (the same row twice), so every row takes the kernel a
    2-row call takes."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight  # the same Parameter: tied embeddings stay tied
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = _row_blocks(x.reshape(-1, shape[-1]), self._block)
        return y.reshape(*shape[:-1], self.out_features)

    def _block(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(rows, self.weight, self.bias)


def _row_blocks(rows: torch.Tensor, run) -> torch.Tensor:
    """`run` over rows [N, d] in blocks of at most ROW_BLOCK rows, a block of one row as the row twice."""
    outputs = []
    for block in rows.split(ROW_BLOCK):
        outputs.append(run(block.expand(2, -1))[:1] if block.shape[0] == 1 else run(block))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


class FP32LogitsHead(torch.nn.Module):
    """An LM head that returns fp32 logits from bf16 (or fp32) hidden states: an fp32 copy of the weight,
    packed for oneDNN (`cpu_kernels.PackedLinear`), run in row blocks (`_row_blocks`) so a row's logits do not
    depend on the batch. `weight` stays the model's own (tied) bf16 Parameter, for code that reads it (a draft
    head binds it)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.packed = PackedLinear(linear)  # a derived kernel layout: buffers, never saved

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = _row_blocks(x.reshape(-1, shape[-1]).float(), self.packed)
        return y.reshape(*shape[:-1], self.out_features)


class FP32Norm(torch.nn.Module):
    """The model's final norm run in fp32 on fp32 input, so its output (the LM head's input) is not rounded
    to bf16 first. Elementwise per position: batch-invariant by construction."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = copy.deepcopy(norm).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.float())


class _Alignment:
    """Where each row's visible keys are, worked out once per forward (every layer gets the same mask)."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask  # kept to recognise the next layer's call (the same tensor object)
        visible = mask[:, 0] > torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else mask[:, 0]
        keys = visible.any(dim=1)  # [B, L]: a key some query of the row sees
        counts = keys.sum(dim=-1)
        length = keys.shape[1]
        prefix = torch.arange(length, device=keys.device)[None, :] < counts[:, None]
        self.order: torch.Tensor | None = None  # None: every row's keys already start the axis
        self.aligned_mask = mask
        if not torch.equal(keys, prefix):
            width = int(counts.max())
            self.order = torch.argsort((~keys).to(torch.int8), dim=-1, stable=True)[
                :, :width
            ]  # visible first
            b = mask.shape[0]
            gathered = mask.gather(
                -1, self.order[:, None, None, :].expand(b, mask.shape[1], mask.shape[2], width)
            )
            # past a row's own keys: masked for every query (they gathered other slots' keys)
            beyond = torch.arange(width, device=keys.device)[None, :] >= counts[:, None]
            self.aligned_mask = _masked(gathered, beyond[:, None, None, :])


_last: _Alignment | None = None


def _alignment(mask: torch.Tensor) -> _Alignment:
    global _last
    if _last is None or _last.mask is not mask:
        _last = _Alignment(mask)
    return _last


def _aligned(
    key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, query_length: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each row's visible keys moved to the front of the key axis (in order), the axis padded to a multiple
    of _KEY_BLOCK with masked zero keys."""
    b, _, length, _ = key.shape
    if mask is not None:
        alignment = _alignment(mask)
        if alignment.order is not None:
            width = alignment.order.shape[1]
            gather = alignment.order[:, None, :, None]
            key = key.gather(2, gather.expand(b, key.shape[1], width, key.shape[3]))
            value = value.gather(2, gather.expand(b, value.shape[1], width, value.shape[3]))
            length = width
        mask = alignment.aligned_mask
    pad = -length % _KEY_BLOCK
    if pad:
        key = torch.nn.functional.pad(key, (0, 0, 0, pad))
        value = torch.nn.functional.pad(value, (0, 0, 0, pad))
        if mask is None:
            mask = torch.zeros((b, 1, query_length, length), dtype=key.dtype, device=key.device)
        fill = torch.finfo(mask.dtype).min if mask.is_floating_point() else False
        mask = torch.nn.functional.pad(mask, (0, pad), value=fill)
    return key, value, mask


def _masked(mask: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    if mask.is_floating_point():
        return mask.masked_fill(hidden, torch.finfo(mask.dtype).min)
    return mask & ~hidden


def row_aligned_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Eager attention (transformers' `eager_attention_forward`) over row-aligned keys: query [B, Hq, T, D],
    key/value [B, Hkv, L, D], attention_mask [B, 1, T, L] (additive, eager's) or None."""
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None:
        raise DecodingError("row-aligned attention has no logit softcap or attention sinks")
    key, value, mask = _aligned(key, value, attention_mask, query.shape[2])
    b, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    # grouped-query attention without copying keys and values once per query group: the queries of the
    # heads that share a kv head are rows of one matmul against it (query head h reads kv head h // groups,
    # as transformers' repeat_kv). The copies cost more than the matmuls: in the bf16 body at width 1
    # they were 60 strided copies a forward, the biggest op after the LM head under the profiler.
    grouped = query.reshape(b, kv_heads, groups, length, dim)
    keys_t = key.transpose(2, 3)
    # bf16: at most ROW_BLOCK rows a matmul (oneDNN gives every count from 2 to 32 the same bits); fp32
    # (MKL's sgemm sums a row differently for 1-3 rows than for 4 or more): exactly FP32_QUERY_BLOCK
    # queries a head a matmul, a short block padded with zero queries, since a row's bits do not depend on
    # its place in a matmul of a fixed shape
    fixed = query.dtype == torch.float32
    block = FP32_QUERY_BLOCK if fixed else max(1, ROW_BLOCK // groups)
    outputs = []
    for first in range(0, length, block):
        rows = grouped[:, :, :, first : first + block]
        count = rows.shape[3]
        size = block if fixed else count
        if size > count:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, size - count))
        weights = torch.matmul(rows.reshape(b, kv_heads, groups * size, dim), keys_t) * scaling
        weights = weights.view(b, kv_heads, groups, size, keys)[:, :, :, :count]
        if mask is not None:
            part = (mask[:, :, first : first + block] if mask.shape[2] > 1 else mask)[:, :, None]
            weights = (
                weights + part if part.is_floating_point() else weights.masked_fill(~part, float("-inf"))
            )
        weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
        if size > count:
            weights = torch.nn.functional.pad(weights, (0, 0, 0, size - count))
        out = torch.matmul(weights.reshape(b, kv_heads, groups * size, keys), value)
        outputs.append(out.view(b, kv_heads, groups, size, dim)[:, :, :, :count])
    output = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=3)
    output = output.reshape(b, heads, length, dim)
    # no attention weights (as SDPA): nothing here asks for them, and a long prefill's would be [T, T] a head
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, row_aligned_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, eager_mask)


def make_batch_invariant(model: torch.nn.Module) -> bool:
    """Make a CPU model whose matmuls round to bf16 batch-invariant: a bf16 model (one-row matmuls as two,
    row-aligned eager attention, the final norm and LM head in fp32: fp32 logits), or one with 4-bit weights
    (`Int4Linear` rounds its input to bf16) in an fp32 body (row-aligned attention; its LM head, fed by no
    bf16 rounding, keeps its packed kernel, whose logits differ across batch shapes by fp32 rounding only, as
    a dense fp32 model's do). Returns whether it applied (idempotent)."""
    try:
        parameter = next(model.parameters())
    except StopIteration:
        return False
    if parameter.device.type != "cpu":
        return False
    bf16 = parameter.dtype == torch.bfloat16
    if not bf16 and not any(isinstance(m, Int4Linear) for m in model.modules()):
        return False
    head = model.get_output_embeddings()
    if bf16 and type(head) is torch.nn.Linear and torch.backends.mkldnn.is_available():
        head = FP32LogitsHead(head)
        model.set_output_embeddings(head)
    # a head that gives fp32 logits (the packed fp32 copy, or the file's 8-bit blocks: `q8_head`) reads the
    # final norm's output unrounded
    if bf16 and isinstance(head, (FP32LogitsHead, Q8Head)):
        decoder = model.get_decoder()
        if isinstance(getattr(decoder, "norm", None), torch.nn.Module):
            decoder.norm = FP32Norm(decoder.norm)
    replaced = replace_linear_layers(model, RowInvariantLinear)
    if getattr(model.config, "attn_logit_softcapping", None):
        # row-aligned attention has no softcap: such a model keeps its own attention (and its near-tie flips)
        log.warning(
            "bf16 on the CPU: %s softcaps attention logits; strict SD may flip near-ties", type(model)
        )
        return True
    model.set_attn_implementation(ATTENTION)
    log.debug("bf16 CPU model made batch-invariant: %d linear layers, row-aligned eager attention", replaced)
    return True
