"""KV cache helpers over transformers' `DynamicCache`: the rollback after a rejected draft, and layers that
grow in place.

transformers' `DynamicLayer` appends a forward's keys and values with `torch.cat`: every forward copies every
layer's whole cache (at 400 tokens of context, 2 x 30 layers x 400 x 3 heads x 64 x 4 bytes = 18 MB read and
written for the embedded model, about a quarter of what its 4-bit weights cost to read). `GrowingLayer`
writes them into a buffer with room to spare and hands out a view of the filled part: a forward copies only
its own tokens. The views are not contiguous (rows and heads are a capacity apart); the project's attention
kernel reads them as they are (`kernels/int4_linear.cpp`), torch's attention takes strides too.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

# room a buffer is given past what it must hold: half as much again, at least this many positions (a grown
# buffer is copied once; geometric growth makes that amortised O(1) a token)
SPARE_POSITIONS = 256


def crop_cache(cache: Cache, length: int) -> None:
    """Keep the first `length` positions of every layer: the rollback after a rejected draft.

    transformers 5 takes the number of positions to *remove* as a negative integer.
    """
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose `update` writes into preallocated buffers [B, heads, capacity, dim]; `keys` and
    `values` are views of their first L positions. Whatever replaces `keys` with a tensor of its own (a batch
    select, padding, a gather: `BatchKV`'s layout changes) is taken in by copying it into a new buffer at the
    next update; a crop keeps a prefix view, so the buffer is reused. An update is a few tensor calls: it
    runs 30 times a forward, so ownership is an identity check on the views handed out, not a comparison of
    pointers and strides."""

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None  # (keys, values) as last handed out

    def _owns_views(self) -> bool:
        return self._views is not None and self.keys is self._views[0] and self.values is self._views[1]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self._held()
        count = key_states.shape[-2]
        self._make_room(key_states, held + count)
        self._key_buffer.narrow(2, held, count).copy_(key_states)
        self._value_buffer.narrow(2, held, count).copy_(value_states)
        self.advance(count)
        return self.keys, self.values

    def reserve(
        self, batch: int, heads: int, dim: int, count: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For a writer that puts `count` new positions into the buffers itself (the fused decoder stack):
        the key and value buffers [batch, heads, capacity, dim], contiguous, with room for them after the
        `held` positions returned; `advance(count)` then takes them in. None where the layer's shape is not
        that (a caller then updates it as transformers does)."""
        # the common case, once a layer a forward: the layer's own buffers have the room and the shape
        keys = self.keys if self._owns_views() else None
        if (
            keys is not None
            and keys.dtype == dtype
            and keys.shape[0] == batch
            and keys.shape[1] == heads
            and keys.shape[3] == dim
        ):
            held = keys.shape[2]
            if self._key_buffer.shape[2] >= held + count:
                return self._key_buffer, self._value_buffer, held
        if not self.is_initialized:
            self.lazy_initialization(torch.empty(0, dtype=dtype, device=device), torch.empty(0, dtype=dtype))
        held = self._held()
        if held and (tuple(self.keys.shape[:2]) != (batch, heads) or self.keys.shape[-1] != dim):
            return None
        if self.keys.dtype != dtype:
            return None
        self._make_room(torch.empty((batch, heads, 0, dim), dtype=dtype, device=device), held + count)
        return self._key_buffer, self._value_buffer, held

    def fresh(self, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """New buffers for `batch` rows of `width` positions (heads, head dim, dtype and device as the layer
        holds now), with room to grow: the layer's keys and values become their first `width` positions, owned,
        their contents unset; returns them for the caller to fill (a batch's layout change writes its new
        layout here once, where building it with `torch.cat` and then adopting it copied the cache twice)."""
        like = self.keys.new_empty((batch, self.keys.shape[1], 0, self.keys.shape[3]))
        self._key_buffer = self._grown(self.keys, like, 0, _capacity(width))
        self._value_buffer = self._grown(self.values, like, 0, _capacity(width))
        self.keys = self.values = like  # nothing held: advance() takes in the `width` new positions
        self.advance(width)
        return self.keys, self.values

    def advance(self, count: int, held: int | None = None) -> None:
        """Take in `count` positions written into the buffers after the held ones (`reserve`; a caller that
        has `held` from it passes it on)."""
        needed = (self._held() if held is None else held) + count
        self.keys = self._key_buffer.narrow(2, 0, needed)
        self.values = self._value_buffer.narrow(2, 0, needed)
        self._views = (self.keys, self.values)

    def _held(self) -> int:
        return self.keys.shape[-2] if self.keys.dim() == 4 else 0

    def _make_room(self, like: torch.Tensor, needed: int) -> None:
        """Buffers of `like`'s rows, heads and head dim with room for `needed` positions, the held ones copied
        in, unless the layer's own buffers already are that."""
        if (
            self._owns_views()
            and self._key_buffer.shape[-2] >= needed
            and self._key_buffer.shape[0] == like.shape[0]
        ):
            return
        held = self._held()
        self._key_buffer = self._grown(self.keys, like, held, _capacity(needed))
        self._value_buffer = self._grown(self.values, like, held, _capacity(needed))

    def crop(self, tokens_to_remove: int) -> None:
        owned = self._owns_views()
        super().crop(tokens_to_remove)  # a prefix view of the same buffers
        if owned:
            self._views = (self.keys, self.values)

    @staticmethod
    def _grown(held: torch.Tensor, new: torch.Tensor, length: int, capacity: int) -> torch.Tensor:
        buffer = new.new_empty((new.shape[0], new.shape[1], capacity, new.shape[3]))
        if length:
            buffer.narrow(2, 0, length).copy_(held)
        return buffer


def _capacity(needed: int) -> int:
    """Positions a buffer gets for `needed`: half as much again, at least SPARE_POSITIONS more."""
    return needed + max(SPARE_POSITIONS, needed // 2)


def use_growing_layers(cache: Cache) -> Cache:
    """Replace a cache's plain full-attention layers (`DynamicLayer`, not yet filled) with `GrowingLayer`s;
    sliding-window and other layer kinds stay as transformers made them. Returns the cache."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        for i, layer in enumerate(layers):
            if type(layer) is DynamicLayer and not layer.is_initialized:
                layers[i] = GrowingLayer()
    return cache


def new_cache(config) -> DynamicCache:
    """An empty cache for a model of this config, its full-attention layers `GrowingLayer`s: what the engine
    decodes with and what its forward costs are measured on."""
    return use_growing_layers(DynamicCache(config=config))
