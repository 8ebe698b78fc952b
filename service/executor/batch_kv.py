"""A KV cache shared by the sequences of a running batch: padding plus masks over one transformers cache.

Layout (the choice issue 6 asks us to explain): one `DynamicCache` whose tensors are [B, heads, L, dim] (its
layers `kv_cache.GrowingLayer`s: views of buffers that grow in place), a boolean mask [B, L] of which slots
hold a live token of row b, and per row the ordered list of its slots.
- A row's token at slot s has RoPE position = its index among the row's live slots, passed as
  `position_ids`, so left padding, holes and other rows' lengths never shift a sequence's positions.
- transformers builds the causal mask from slot order (query slot >= key slot) and ANDs our 2D mask into
  it, so a row attends to exactly its own live tokens, in order.
- A round appends T = max planned tokens to every row (shorter plans are right-padded with masked
  dummies). After verification each row marks the tokens it did not keep as dead: holes. The common dead
  tail is cropped at once; when holes make up most of the cache the batch is compacted (one gather).

Why not a packed layout: transformers' attention kernels take [B, heads, L, dim] caches, and packing would
need a paged cache and custom kernels; padding costs some wasted FLOPs on short drafts, which the
scheduler keeps small by choosing one draft cap for the batch. When the batch is one row and every slot is
live (a request served alone) no mask is passed at all: the single-request path is the plain one.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from service.decoding.types import DecodingError
from service.executor.fused_layers import lean_logits
from service.executor.kv_cache import GrowingLayer, crop_cache, new_cache

# transformers hands grouped-query attention to torch's SDPA natively (`enable_gqa`) only when no mask is
# passed; with our padding mask it would first copy every layer's cached keys and values once per query
# group (3x for SmolLM2), every forward: measured at 16 rows, a round took 374 ms instead of 127 ms. torch's
# SDPA takes enable_gqa with a mask on every backend we run; transformers' documented switch turns it on.
os.environ.setdefault("TRANSFORMERS_SDPA_FORCE_GQA", "1")

# Compact when dead slots exceed this share of the cache (and at least _COMPACT_MIN_SLOTS of them).
_COMPACT_DEAD_SHARE = 0.5
_COMPACT_MIN_SLOTS = 64


def supports_batching(model: torch.nn.Module) -> bool:
    """Whether this layout can batch the model: every cache layer must be full attention (sliding-window
    layers keep a rolling window that slot masks cannot address). Such models still decode one at a time."""
    layers = getattr(DynamicCache(config=model.config), "layers", None)
    return bool(layers) and not any(getattr(layer, "is_sliding", False) for layer in layers)


class BatchKV:
    def __init__(self, model: torch.nn.Module, device: torch.device, rows: int = 0) -> None:
        self.model = model
        self.device = device
        self._reset(rows)

    def _reset(self, rows: int) -> None:
        self.cache = new_cache(self.model.config)
        self.slots: list[list[int]] = [[] for _ in range(rows)]  # per row: its live slots, in sequence order
        self.mask = torch.zeros((rows, 0), dtype=torch.bool, device=self.device)

    # ------------------------------------------------------------------ shape

    @property
    def rows(self) -> int:
        return len(self.slots)

    @property
    def width(self) -> int:
        return self.mask.shape[1]

    def length(self, row: int) -> int:
        """Tokens row `row` holds: the RoPE position of its next token."""
        return len(self.slots[row])

    def _layers(self) -> list:
        layers = getattr(self.cache, "layers", None)
        if layers is None or any(getattr(layer, "is_sliding", False) for layer in layers):
            raise DecodingError("batched decoding needs a model whose cache layers are all full attention")
        return layers

    # ------------------------------------------------------------------ the forward

    def forward(self, token_rows: Sequence[Sequence[int]], logits_to_keep: int = 0) -> torch.Tensor:
        """Feed each row its tokens (ragged; every row at least one) in one forward; returns logits
        [B, T, V] (T = the longest row, or `logits_to_keep` last positions). Every fed token becomes live;
        `keep()` kills the ones the verification rejected."""
        if len(token_rows) != self.rows:
            raise ValueError(f"{len(token_rows)} token rows for a batch of {self.rows}")
        t = max(len(r) for r in token_rows)
        dense = all(len(r) == t for r in token_rows) and bool(self.mask.all())
        same_length = len({len(s) for s in self.slots}) <= 1
        ids = torch.zeros((self.rows, t), dtype=torch.long)
        new = torch.zeros((self.rows, t), dtype=torch.bool)
        for b, tokens in enumerate(token_rows):
            ids[b, : len(tokens)] = torch.tensor(list(tokens), dtype=torch.long)
            new[b, : len(tokens)] = True
        kwargs: dict = {}
        if not (dense and same_length):
            start = torch.tensor([len(s) for s in self.slots], dtype=torch.long)
            kwargs["position_ids"] = (start[:, None] + torch.arange(t)[None, :]).to(self.device)
            kwargs["attention_mask"] = torch.cat([self.mask, new.to(self.device)], dim=1)
        if logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        base = self.width
        ids = ids.to(self.device)
        logits = lean_logits(self.model, ids, self.cache, **kwargs)
        if logits is None:  # not the fused executor: the model's own forward
            logits = self.model(input_ids=ids, cache=self.cache, **kwargs).logits
        self.mask = torch.cat([self.mask, new.to(self.device)], dim=1)
        for b, tokens in enumerate(token_rows):
            self.slots[b].extend(range(base, base + len(tokens)))
        return logits

    def keep(self, row: int, length: int) -> None:
        """Row `row` keeps its first `length` tokens; later ones become dead slots."""
        slots = self.slots[row]
        if length < len(slots):
            dead = torch.tensor(slots[length:], dtype=torch.long, device=self.device)
            self.mask[row, dead] = False
            del slots[length:]

    def settle(self) -> None:
        """Drop the dead tail every row shares, and compact when holes dominate. Call after `keep()`s."""
        live_end = max((s[-1] + 1 for s in self.slots if s), default=0)
        if live_end < self.width:
            crop_cache(self.cache, live_end)
            self.mask = self.mask[:, :live_end]
        dead = self.rows * self.width - int(self.mask.sum())
        if dead >= _COMPACT_MIN_SLOTS and dead > _COMPACT_DEAD_SHARE * self.rows * self.width:
            self._compact()

    # ------------------------------------------------------------------ rows joining and leaving

    def copy(self) -> BatchKV:
        """An independent copy (for choices that share one prompt's prefill)."""
        clone = BatchKV(self.model, self.device)
        clone.cache = copy.deepcopy(self.cache)
        clone.slots = [list(s) for s in self.slots]
        clone.mask = self.mask.clone()
        return clone

    def add(self, other: BatchKV) -> None:
        """Append the rows of `other` (e.g. a prefilled request); `other` must not be used afterwards."""
        if other.rows == 0:
            return
        if self.rows == 0:
            self.cache, self.slots, self.mask = other.cache, other.slots, other.mask
            return
        width = max(self.width, other.width)
        if self.width and other.width and self._join_in_place(other, width):
            return
        self._pad_left(width - self.width)
        other._pad_left(width - other.width)
        if width:
            for mine, theirs in zip(self._layers(), other._layers(), strict=True):
                mine.keys = torch.cat([mine.keys, theirs.keys], dim=0)
                mine.values = torch.cat([mine.values, theirs.values], dim=0)
        self.mask = torch.cat([self.mask, other.mask], dim=0)
        self.slots.extend(other.slots)

    def _join_in_place(self, other: BatchKV, width: int) -> bool:
        """`add` for caches of `GrowingLayer`s: both batches' keys and values written once, left-padded with
        zeros, into each layer's new buffers (with room to grow), where padding, concatenating and the next
        forward's adoption of the result copied the cache three times (a request joining a running batch
        paid that on every layer). False, with nothing changed, where a layer is of another kind."""
        pairs = list(zip(self._layers(), other._layers(), strict=True))
        if any(type(mine) is not GrowingLayer or mine.keys.dim() != 4 for mine, _ in pairs):
            return False
        rows = self.rows
        for mine, theirs in pairs:
            held = (mine.keys, mine.values)
            keys, values = mine.fresh(rows + other.rows, width)
            for out, first, second in ((keys, held[0], theirs.keys), (values, held[1], theirs.values)):
                for part, rows_of in ((first, slice(0, rows)), (second, slice(rows, None))):
                    pad = width - part.shape[2]
                    out[rows_of, :, :pad].zero_()
                    out[rows_of, :, pad:].copy_(part)
        pad_self, pad_other = width - self.width, width - other.width
        self.mask = torch.cat(
            [
                torch.cat(
                    [torch.zeros((rows, pad_self), dtype=torch.bool, device=self.device), self.mask], 1
                ),
                torch.cat(
                    [torch.zeros((other.rows, pad_other), dtype=torch.bool, device=self.device), other.mask],
                    1,
                ),
            ],
            dim=0,
        )
        self.slots = [[s + pad_self for s in slots] for slots in self.slots]
        self.slots.extend([[s + pad_other for s in slots] for slots in other.slots])
        return True

    def remove(self, rows: Sequence[int]) -> None:
        """Drop rows (finished or cancelled sequences)."""
        gone = set(rows)
        keep = [b for b in range(self.rows) if b not in gone]
        if not keep:
            self._reset(0)
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        # Columns no remaining row uses, at the left (a long sequence left) or the right.
        first = min((self.slots[b][0] for b in keep if self.slots[b]), default=self.width)
        if first < self.width and self._select_in_place(keep, first):
            self.mask = self.mask[index][:, first:]
            self.slots = [[s - first for s in self.slots[b]] for b in keep]
            self.settle()
            return
        if self.width:
            self.cache.batch_select_indices(index)
        self.mask = self.mask[index]
        self.slots = [self.slots[b] for b in keep]
        if first > 0:
            self._drop_left(first)
        self.settle()

    def _select_in_place(self, keep: list[int], first: int) -> bool:
        """`remove` for caches of `GrowingLayer`s: the kept rows' keys and values from column `first` on, written
        once into each layer's new buffers, where selecting the rows and then adopting the selection (dropped
        columns make a view the layer does not own) copied them twice. False, with nothing changed, where a
        layer is of another kind."""
        layers = self._layers()
        if any(type(layer) is not GrowingLayer or layer.keys.dim() != 4 for layer in layers):
            return False
        width = self.width - first
        for layer in layers:
            held = (layer.keys, layer.values)
            for out, source in zip(layer.fresh(len(keep), width), held, strict=True):
                for i, b in enumerate(keep):
                    out[i].copy_(source[b, :, first:])
        return True

    # ------------------------------------------------------------------ prefix caching (prefix_cache.py)

    def load_prefix(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """An empty one-row cache takes a cached prefix: per layer [1, kv_heads, n, head_dim], positions
        0..n-1 in slots 0..n-1 (dense, so the next forward needs no mask and continues at position n)."""
        if self.rows != 1 or self.width:
            raise ValueError("a cached prefix goes into an empty one-row cache")
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            self.cache.update(k.to(self.device), v.to(self.device), i)  # initialises the empty layer
        n = keys[0].shape[2]
        self.mask = torch.ones((1, n), dtype=torch.bool, device=self.device)
        self.slots = [list(range(n))]

    def row_kv(self, row: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of row `row`'s first `length` tokens in sequence order,
        [kv_heads, length, head_dim] each (views when the slots are contiguous, else gathered copies)."""
        slots = self.slots[row][:length]
        if not slots:
            return []
        contiguous = slots[-1] - slots[0] + 1 == len(slots)
        index = None if contiguous else torch.tensor(slots, dtype=torch.long, device=self.device)
        out = []
        for layer in self._layers():
            if index is None:
                out.append(
                    (
                        layer.keys[row, :, slots[0] : slots[-1] + 1],
                        layer.values[row, :, slots[0] : slots[-1] + 1],
                    )
                )
            else:
                out.append((layer.keys[row].index_select(1, index), layer.values[row].index_select(1, index)))
        return out

    # ------------------------------------------------------------------ layout maintenance

    def _pad_left(self, n: int) -> None:
        if n <= 0:
            return
        if self.width:
            for layer in self._layers():
                pad = layer.keys.new_zeros((*layer.keys.shape[:2], n, layer.keys.shape[3]))
                layer.keys = torch.cat([pad, layer.keys], dim=2)
                layer.values = torch.cat([pad, layer.values], dim=2)
        else:
            # No tensors yet (prompts of one token): the first forward creates them at full width. Give the
            # layers the padding now so slots and tensors agree.
            self._materialise(n)
            n = 0
        self.mask = torch.cat(
            [torch.zeros((self.rows, n), dtype=torch.bool, device=self.device), self.mask], 1
        )
        self.slots = [[s + n for s in slots] for slots in self.slots]

    def _materialise(self, width: int) -> None:
        """Give an empty cache all-dead tensors of `width` slots (a row that has no cached token yet)."""
        config = self.model.config
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = next(self.model.parameters()).dtype
        zeros = torch.zeros((self.rows, heads, width, head_dim), dtype=dtype, device=self.device)
        for i in range(config.num_hidden_layers):
            # update() on an empty layer initialises it with these tensors
            self.cache.update(zeros, zeros.clone(), i)
        self.mask = torch.zeros((self.rows, width), dtype=torch.bool, device=self.device)

    def _drop_left(self, n: int) -> None:
        for layer in self._layers():
            layer.keys = layer.keys[:, :, n:]
            layer.values = layer.values[:, :, n:]
        self.mask = self.mask[:, n:]
        self.slots = [[s - n for s in slots] for slots in self.slots]

    def _compact(self) -> None:
        """Gather each row's live slots to the right end (left padding): one copy of the cache."""
        width = max(len(s) for s in self.slots)
        index = torch.zeros((self.rows, width), dtype=torch.long)
        mask = torch.zeros((self.rows, width), dtype=torch.bool)
        for b, slots in enumerate(self.slots):
            if slots:
                index[b, width - len(slots) :] = torch.tensor(slots, dtype=torch.long)
                mask[b, width - len(slots) :] = True
        index = index.to(self.device)
        for layer in self._layers():
            gather = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        self.mask = mask.to(self.device)
        self.slots = [list(range(width - len(s), width)) for s in self.slots]
