"""Leaner CPU forwards: the linear layers' weights packed once for oneDNN (MKL-DNN).

Speculative decoding lives on the gap between the cost of a forward over one token and over k + 1 tokens.
On a CPU, PyTorch's default fp32 matmul handles one row as a matrix-vector product (memory-bound and fast)
but a few rows as a general matmul that re-packs the whole weight matrix on every call: measured on the
embedded model with one thread, a 7-token forward cost 2.0x a 1-token one and a two-row vocabulary
projection 2.2x a one-row one. With the weights packed once at load, in oneDNN's blocked layout for a few
rows (`PackedLinear`, what inductor's CPU weight prepacking does), a forward of the embedded model in fp32
costs 1.33x a one-token one at 8 tokens (77 vs 58 ms), where weights in oneDNN's plain layout (`to_mkldnn`,
this module's packing until 2026-12) cost 1.76x (109 vs 62), and a 2-token forward about what a one-token one
costs (AMD EPYC under an AVX2 dispatch, 1 thread, 100 tokens of context).
Logits agree with the default kernels to float32 rounding (tested).

Applied by `load_model` to fp32 models on the CPU when oneDNN is available (`CSD_PACK_CPU_WEIGHTS=false`
turns it off). GPUs are untouched.

bf16 is the other half, on CPUs with native bf16 matmuls (AVX512-BF16, AMX, Arm BF16): a 7-token forward of
the embedded model costs ~1.1x a one-token one (packed fp32: ~1.6x), so every draft is cheaper to verify, and
one-token forwards are no slower. So `dtype=auto` loads bf16 on such a CPU (`default_cpu_dtype`) and fp32
elsewhere, where bf16 is emulated and slower; a bf16 model is made batch-invariant (`batch_invariant`) so strict
speculative decoding stays exactly plain decoding.
"""

from __future__ import annotations

import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)


# The row count oneDNN blocks the packed weights for: a verification's k + 1 tokens, a small batch. Packed for 8
# rows, a matmul of 2 rows costs about one of 1 row (the embedded model's LM head, 1 thread, AVX512: 8.7 vs
# 7.2 ms; weights in oneDNN's plain layout: 10.0 vs 7.7) and 8 rows 7.6 ms instead of 13.2; a row gets the
# same bits in every call of 2 to 64 rows, as with the plain layout (tested).
PACKED_FOR_ROWS = 8


class PackedLinear(torch.nn.Module):
    """An `nn.Linear` whose weight lives in oneDNN's blocked layout, reordered once for PACKED_FOR_ROWS rows
    (what inductor's CPU weight prepacking does); takes and returns dense tensors of any leading shape, like
    the layer it replaces."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            weight = linear.weight.detach().float()
            bias = linear.bias.detach().float().clone() if linear.bias is not None else None
            # buffers, not parameters: nothing trains them, and model.parameters() keeps listing dense tensors
            self.register_buffer(
                "packed_weight",
                torch.ops.mkldnn._reorder_linear_weight(weight, PACKED_FOR_ROWS),
                persistent=False,
            )
            self.register_buffer("bias", bias, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, rebuilt on access (for code that inspects it, e.g. a profile)."""
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        y = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)


def can_pack(model: torch.nn.Module) -> bool:
    try:
        parameter = next(model.parameters())
    except StopIteration:
        return False
    return (
        torch.backends.mkldnn.is_available()
        and parameter.device.type == "cpu"
        and parameter.dtype == torch.float32
    )


def pack_linear_layers(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` of an fp32 CPU model by a `PackedLinear`; returns how many were replaced
    (0 when the model is not an fp32 CPU model or oneDNN is missing)."""
    if not can_pack(model):
        return 0
    replaced = replace_linear_layers(model, PackedLinear)
    log.debug("packed %d linear layers for oneDNN", replaced)
    return replaced


def replace_linear_layers(model: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module]) -> int:
    """Replace every plain `nn.Linear` of `model` by `make(linear)`; returns how many were replaced."""
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(module, name, make(child))
                replaced += 1
    return replaced


# oneDNN ISA caps (`ONEDNN_MAX_CPU_ISA`, also read as `DNNL_MAX_CPU_ISA`) below AVX512_CORE_BF16, and
# ATen's dispatch caps (`ATEN_CPU_CAPABILITY`) below avx512: under them bf16 matmuls are emulated, whatever the
# CPU's flags say
_ONEDNN_ISAS_WITHOUT_BF16 = {
    "sse41",
    "avx",
    "avx2",
    "avx2_vnni",
    "avx2_vnni_2",
    "avx512_core",
    "avx512_core_vnni",
}
_ATEN_CAPABILITIES_WITHOUT_BF16 = {"default", "avx2", "zvector"}


def dispatch_caps_bf16() -> bool:
    """Whether the process runs under a CPU dispatch cap that rules native bf16 out: how a test run (and CI,
    see the Makefile) makes a CPU with AMX or AVX512-BF16 take the path AVX2-only CPUs take."""
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().lower()
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return isa in _ONEDNN_ISAS_WITHOUT_BF16 or aten in _ATEN_CAPABILITIES_WITHOUT_BF16


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


# the flags that decide which kernels run (printed with every figure and in the test log)
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def simd_summary() -> str:
    """The CPU's kernel-relevant flags, the dispatch torch uses and any cap, e.g. `avx2 fma avx512f
    avx512_bf16; torch dispatch AVX512; native bf16 yes`."""
    flags = cpu_flags()
    present = " ".join(f for f in SIMD_FLAGS if f in flags) or "none of " + "/".join(SIMD_FLAGS)
    caps = [
        f"{name}={os.environ[name]}"
        for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
        if name in os.environ
    ]
    capped = f"; capped by {' '.join(caps)}" if caps else ""
    return (
        f"{present}; torch dispatch {torch.backends.cpu.get_cpu_capability()}{capped}; "
        f"native bf16 {'yes' if has_native_bf16() else 'no'}"
    )


def has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (x86 AVX512-BF16 or AMX-BF16, Arm BF16) and the process may
    use it (`dispatch_caps_bf16`). torch's own check (`mkldnn._is_mkldnn_bf16_supported`) also says yes for
    plain AVX512, where bf16 is emulated and slower than fp32, so the CPU's flags are read instead."""
    if dispatch_caps_bf16():
        return False
    flags = cpu_flags()
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def default_cpu_dtype() -> torch.dtype:
    """The dtype `dtype=auto` loads a model in on the CPU: bf16 where the CPU multiplies it natively (a
    verification forward over 7 tokens then costs ~1.1x a one-token one instead of packed fp32's ~1.6x, and
    one-token forwards are faster too), fp32 elsewhere."""
    return torch.bfloat16 if has_native_bf16() else torch.float32
