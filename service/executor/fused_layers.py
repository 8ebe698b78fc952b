"""A Llama-style decoder layer of a 4-bit model in an fp32 body as two C++ calls around its attention.

Once the matmuls read 4-bit blocks, a one-token forward of the embedded model is mostly not matmul: eager
execution ran ~8,400 operator calls a forward (norms, RoPE, casts, views, residual adds, SiLU), each a few
microseconds of dispatch and allocation for a few hundred floats of work, and the host time between them
(`python -m bench.forward`: matmul a third of the forward). `fuse_decoder_layers` gives each decoder layer a
forward that runs
- `norm_qkv_rope`: the input RMSNorm, the fused q/k/v projection and the rotary embedding, in one call;
- the cache update (transformers' cache, as before), then `attention`: each query over the keys it sees, in
  their order, in C++ (what `batch_invariant.row_aligned_attention` does with gathers and padding, ~50
  operator calls a layer);
- `output_mlp`: the output projection and residual, the post-attention RMSNorm, the fused gate/up
  projection, SiLU(gate) * up, the down projection and the residual, in one call
(`kernels/int4_linear.cpp`), with the 4-bit matmuls of `int4_weights` inside: ~1,100 operator calls a
forward instead of ~8,400. Every step works row by row and a query's attention reads only the keys it sees,
so a row's bits do not depend on the batch, its padding or the holes rejected drafts leave: strict
speculative decoding stays plain decoding (tested).

The layer keeps its modules (weights, norms) and can still be called as a module, so forward hooks on it (the
draft head reads layer outputs through them) fire as before. Around the layers, a Llama decoder whose layers
are all fused runs `_lean_decoder_forward`, and with the engine's cache (`kv_cache.GrowingLayer`s) all its
layers as one C++ call, `DecoderStack`, which writes each layer's new keys and values straight into the cache's
buffers: a layer called from Python cost ~15 us beside its kernels (the module call, three calls into C++, the
cache update), the stack takes 0.91-0.93x the time of the per-layer path at widths 1-8 with the same bits
(tested); forward hooks on a layer still fire after it, with the layer's input and output, and under the
profiler (whose per-layer spans `bench.forward` splits by) or with pre-hooks the layers run one by one.
`_lean_decoder_forward` itself: transformers' own `LlamaModel.forward` cost about 0.8 ms a forward
beside its layers (a 4-D mask built by `create_causal_mask` for kernels that read a boolean one, a new
`ModuleList` sliced off each call, three decorators) against ~10 ms for a whole one-token forward (0.92x the
time at width 1 and 0.95x at width 8 or 8 rows, the same logits bit for bit). The fused layers apply where
every layer has the shape they compute: RMSNorm before attention and MLP, q/k/v and gate/up fused 4-bit
projections without bias, o and down 4-bit, SiLU, full (not sliding-window) attention without softcapping, an
fp32 body; any other model runs transformers' own layers.
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.models.llama.modeling_llama import LlamaForCausalLM

from service.executor import native
from service.executor.int4_weights import Int4Linear, Int4Projection
from service.executor.kv_cache import GrowingLayer, new_cache

log = logging.getLogger(__name__)

# the calls' spans under torch.profiler (they are no aten operators): the halves' matmuls with their norms,
# RoPE and SiLU, and the attention
PROFILE_SCOPES = ("csd::norm_qkv_rope", "csd::attention", "csd::output_mlp")


def _blocks(linear: Int4Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's kernel buffers as the calls take them: (packed weight, scales, minimums), the fp32 views
    made once here, not per forward (six views a layer were ~180 operator calls a forward)."""
    return linear.packed_weight, linear.scale, linear.low


@dataclass
class _LayerWeights:
    """What the two calls read, gathered once at load."""

    qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    o: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    input_norm: torch.Tensor
    input_eps: float
    post_norm: torch.Tensor
    post_eps: float
    heads: int
    kv_heads: int


def _kernel_linear(module: object, parts: tuple[int, ...] | None = None) -> Int4Linear | None:
    """The `Int4Linear` behind a layer's projection when it runs the project's kernel without bias: the layer
    itself, or for fused siblings (`parts`: their indices in order) the group's stacked layer."""
    if parts is not None:
        if not isinstance(module, Int4Projection) or module.index != parts[0]:
            return None
        module = module.group.fused
    if not isinstance(module, Int4Linear) or module._kernel is None or module.bias is not None:
        return None
    return module


def _norm(module: object) -> tuple[torch.Tensor, float] | None:
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if not type(module).__name__.endswith("RMSNorm") or not isinstance(weight, torch.Tensor) or eps is None:
        return None
    if weight.dtype != torch.float32 or weight.dim() != 1:
        return None
    return weight.detach().contiguous(), float(eps)


def _layer_weights(layer: torch.nn.Module, config) -> _LayerWeights | None:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attn is None or mlp is None:
        return None
    qkv = _kernel_linear(getattr(attn, "q_proj", None), (0, 1, 2))
    gate_up = _kernel_linear(getattr(mlp, "gate_proj", None), (0, 1))
    o, down = _kernel_linear(getattr(attn, "o_proj", None)), _kernel_linear(getattr(mlp, "down_proj", None))
    input_norm = _norm(getattr(layer, "input_layernorm", None))
    post_norm = _norm(getattr(layer, "post_attention_layernorm", None))
    if None in (qkv, gate_up, o, down, input_norm, post_norm):
        return None
    # the fused siblings must be exactly q, k, v and gate, up (in that order), nothing more
    if len(attn.q_proj.group.sizes) != 3 or len(mlp.gate_proj.group.sizes) != 2:
        return None
    if getattr(attn, "k_proj", None) is None or attn.k_proj.group is not attn.q_proj.group:
        return None
    if getattr(mlp, "up_proj", None) is None or mlp.up_proj.group is not mlp.gate_proj.group:
        return None
    sizes = mlp.gate_proj.group.sizes
    if sizes[0] != sizes[1] or getattr(config, "hidden_act", None) != "silu":
        return None
    head_dim = getattr(attn, "head_dim", None)
    q_size, k_size, v_size = attn.q_proj.group.sizes
    if not head_dim or q_size % head_dim or k_size != v_size or k_size % head_dim:
        return None
    return _LayerWeights(
        qkv=_blocks(qkv),
        o=_blocks(o),
        gate_up=_blocks(gate_up),
        down=_blocks(down),
        input_norm=input_norm[0],
        input_eps=input_norm[1],
        post_norm=post_norm[0],
        post_eps=post_norm[1],
        heads=q_size // head_dim,
        kv_heads=k_size // head_dim,
    )


def _fused_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    use_cache: bool | None = False,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    **kwargs,
) -> torch.Tensor:
    weights: _LayerWeights = self._csd_fused
    kernels = self._csd_kernels
    if torch.autograd.profiler._is_profiler_enabled:  # spans cost as much as a one-row call: only when read
        kernels = _Scoped(kernels)
    x = hidden_states.contiguous()
    batch, length, _ = x.shape
    cos, sin = position_embeddings
    if cos.shape[0] != batch:  # one set of positions for every row
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
    query, key, value = kernels.norm_qkv_rope(
        x,
        weights.input_norm,
        weights.input_eps,
        *weights.qkv,
        cos.float().contiguous(),
        sin.float().contiguous(),
        weights.heads,
        weights.kv_heads,
    )
    attn = self.self_attn
    if cache is not None:
        key, value = cache.update(key, value, attn.layer_idx)
    output = kernels.attention(query, key, value, attention_mask, attn.scaling)
    return kernels.output_mlp(
        output, x, *weights.o, weights.post_norm, weights.post_eps, *weights.gate_up, *weights.down
    )


def _lean_decoder_forward(
    self: torch.nn.Module,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    inputs_embeds: torch.Tensor | None = None,
    use_cache: bool | None = None,
    past_key_values=None,
    **kwargs,
) -> BaseModelOutputWithPast:
    """`LlamaModel.forward` for fused layers: the same embedding, positions, rotary tables, layers and final
    norm (`_lean_hidden`)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    cache = cache if cache is not None else past_key_values
    if cache is None and (self.config.use_cache if use_cache is None else use_cache):
        cache = new_cache(self.config)
    hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
    return BaseModelOutputWithPast(
        last_hidden_state=_lean_hidden(self, hidden, attention_mask, position_ids, cache), cache=cache
    )


def _lean_hidden(
    decoder: torch.nn.Module,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    cache,
) -> torch.Tensor:
    """The decoder's final (normed) hidden states of embedded tokens, with the mask built as the attention
    kernel reads it (a query sees a key where the 2-D mask keeps the key and the key is no later than the
    query's own position; no mask: causal, which the kernel does by itself)."""
    length = hidden.shape[1]
    if position_ids is None:
        past = cache.get_seq_length() if cache is not None else 0
        position_ids = (torch.arange(length, device=hidden.device) + past).unsqueeze(0)
    mask = None
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        keys = attention_mask.shape[1]
        visible = torch.arange(keys, device=hidden.device)[None, :] <= (
            torch.arange(length, device=hidden.device)[:, None] + (keys - length)
        )
        mask = (attention_mask.bool()[:, None, None, :] & visible[None, None]).contiguous()
    elif attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
    stacked = _stack_forward(decoder, hidden, position_embeddings, mask, cache)
    if stacked is not None:
        return decoder.norm(stacked)
    for layer in decoder.layers:
        hidden = layer(
            hidden,
            attention_mask=mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=cache is not None,
            position_embeddings=position_embeddings,
        )
    return decoder.norm(hidden)


def lean_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    logits_to_keep: int = 0,
) -> torch.Tensor | None:
    """`model(input_ids=..., cache=..., ...).logits` for a causal LM whose decoder runs the lean forward,
    without the two model-output objects, the decorators and the module calls around them (measured on a Zen 4
    EPYC, 1 thread: 1.8 % of plain decoding's CPU a token, about 0.14 of 7.9 ms): the engine's forward, once
    a token. The same operators in the same order, so the same logits bit for bit.
    None where the model is not that, or something watches or replaces the calls it skips (a hook on the model
    or its decoder, a wrapper, a forward set on the instance): the caller then calls the model."""
    # only transformers' own Llama causal LM, called as itself: a wrapper or a replaced forward (a fault
    # injected for a test, a profiler's scope) sits in the call this skips, so the caller must make that call
    if getattr(type(model), "forward", None) is not LlamaForCausalLM.forward or "forward" in vars(model):
        return None
    if cache is None:
        return None
    decoder = model.model
    if not getattr(decoder, "_csd_lean", False):
        return None
    if (
        model._forward_hooks
        or model._forward_pre_hooks
        or decoder._forward_hooks
        or decoder._forward_pre_hooks
    ):
        return None
    if _global_hooks():
        return None
    hidden = _lean_hidden(decoder, decoder.embed_tokens(input_ids), attention_mask, position_ids, cache)
    if logits_to_keep:
        hidden = hidden[:, -logits_to_keep:, :]
    return model.lm_head(hidden)


def _stack_forward(
    decoder: torch.nn.Module,
    hidden: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor | None,
    cache,
) -> torch.Tensor | None:
    """Every layer in one C++ call (`DecoderStack`), the new keys and values written into the cache's
    `GrowingLayer` buffers: the last layer's output, or None where the per-layer path must run (no such
    cache, hooks other than forward hooks on layers, a profiler reading the per-layer spans). A layer's forward
    hooks (the draft head's feature capture) still fire, after the stack, with the layer's input and output."""
    stack = getattr(decoder, "_csd_stack", None)
    if stack is None or cache is None or torch.autograd.profiler._is_profiler_enabled:
        return None
    layers = decoder.layers
    cache_layers = getattr(cache, "layers", None)
    if cache_layers is None or len(cache_layers) != len(layers):
        return None
    if any(type(layer) is not GrowingLayer for layer in cache_layers):
        return None
    if _global_hooks() or any(layer._forward_pre_hooks for layer in layers):
        return None
    hooked = [i for i, layer in enumerate(layers) if layer._forward_hooks]
    batch, length, _ = hidden.shape
    cos, sin = position_embeddings
    if cos.shape[0] != batch:
        cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
    keys, values, held = [], [], None
    for layer in cache_layers:
        reserved = layer.reserve(batch, stack.kv_heads, stack.head_dim, length, hidden.dtype, hidden.device)
        if reserved is None or (held is not None and reserved[2] != held):
            return None  # a layer of another shape or length: the per-layer path handles it
        keys.append(reserved[0])
        values.append(reserved[1])
        held = reserved[2]
    capture = sorted({j for i in hooked for j in (i - 1, i) if j >= 0})
    outputs = stack.kernels.forward(
        hidden.contiguous(),
        cos.float().contiguous(),
        sin.float().contiguous(),
        mask,
        keys,
        values,
        held,
        capture,
    )
    for layer in cache_layers:
        layer.advance(length, held)
    captured = dict(zip(capture, outputs[1:], strict=True))
    for i in hooked:
        layer_input = captured[i - 1] if i > 0 else hidden
        for hook in list(layers[i]._forward_hooks.values()):
            hook(layers[i], (layer_input,), captured[i])
    return outputs[0]


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(
        getattr(module, "_global_forward_hooks", None) or getattr(module, "_global_forward_pre_hooks", None)
    )


@dataclass
class _Stack:
    """The decoder's layers as one C++ object (`kernels/int4_linear.cpp`'s DecoderStack) and the cache shape
    its layers write."""

    kernels: object
    kv_heads: int
    head_dim: int


def _build_stack(kernels, layers, found: list[_LayerWeights]) -> _Stack | None:
    """The stack of every fused layer, where they share heads and attention scaling (else None: layer by
    layer)."""
    first = found[0]
    scalings = {float(layer.self_attn.scaling) for layer in layers}
    dims = {int(layer.self_attn.head_dim) for layer in layers}
    if len(scalings) != 1 or len(dims) != 1:
        return None
    if any((w.heads, w.kv_heads) != (first.heads, first.kv_heads) for w in found):
        return None
    stack = kernels.DecoderStack(
        [[*w.qkv, *w.o, *w.gate_up, *w.down, w.input_norm, w.post_norm] for w in found],
        [[w.input_eps, w.post_eps] for w in found],
        first.heads,
        first.kv_heads,
        scalings.pop(),
    )
    return _Stack(kernels=stack, kv_heads=first.kv_heads, head_dim=dims.pop())


def _full_attention(config) -> bool:
    """Whether every layer attends to all earlier positions with plain softmax (no window, cap or sinks)."""
    if getattr(config, "attn_logit_softcapping", None):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    window = getattr(config, "sliding_window", None)
    return window is None or getattr(config, "use_sliding_window", True) is False


class _Scoped:
    """The kernels' calls, each in its profiler span (PROFILE_SCOPES)."""

    def __init__(self, kernels) -> None:
        self._kernels = kernels

    def __getattr__(self, name: str):
        function = getattr(self._kernels, name)

        def scoped(*args):
            with torch.profiler.record_function(f"csd::{name}"):
                return function(*args)

        return scoped


def fuse_decoder_layers(model: torch.nn.Module) -> int:
    """Give every decoder layer of a 4-bit model in an fp32 body the fused forward where all of them have the
    shape it computes (module doc); returns how many layers were fused (0: the model keeps its own)."""
    kernels = native.build("int4_linear")
    if kernels is None or not _full_attention(model.config):
        return 0
    try:
        if next(model.parameters()).dtype != torch.float32:
            return 0
    except StopIteration:
        return 0
    layers = getattr(model.get_decoder(), "layers", None)
    if not layers:
        return 0
    found = [_layer_weights(layer, model.config) for layer in layers]
    if any(weights is None for weights in found):
        log.debug("decoder layers not of the fusable shape: transformers' own layers run")
        return 0
    for layer, weights in zip(layers, found, strict=True):
        layer._csd_fused = weights
        layer._csd_kernels = kernels
        layer.forward = types.MethodType(_fused_forward, layer)
    decoder = model.get_decoder()
    if type(decoder).__name__ == "LlamaModel" and len(layers) == model.config.num_hidden_layers:
        decoder.forward = types.MethodType(_lean_decoder_forward, decoder)
        decoder._csd_lean = True  # `lean_logits` may call it without the model's own forward
        decoder._csd_stack = _build_stack(kernels, layers, found)
    log.debug("%d decoder layers fused around their attention", len(layers))
    return len(layers)


def executor_name(model: torch.nn.Module) -> str:
    """ "fused", "int4-kernel", "int4-torch" or "eager": see `LoadedModel.executor`."""
    layers = getattr(model.get_decoder(), "layers", None) or []
    if layers and all(hasattr(layer, "_csd_fused") for layer in layers):
        return "fused"
    int4 = [m for m in model.modules() if isinstance(m, Int4Linear)]
    if not int4:
        return "eager"
    return "int4-kernel" if all(m._kernel is not None for m in int4) else "int4-torch"
