"""Automatic prefix caching: the KV cache of earlier prompts, reused by every request that starts the same way.

vLLM's automatic prefix caching (and SGLang's RadixAttention) for our batch layout (batch_kv.py). Chat and
agent traffic resends the same system prompt, tool definitions and earlier turns on every call; on a CPU
their prefill is most of a turn's time to first token.

- A block is `block_size` consecutive positions of one sequence, on block boundaries from position 0. Its
  key is a chain hash, sha256(parent block's key + the block's token ids), so one key names every token
  from position 0 through the block's end: two sequences share a block iff they agree on all of them.
- A block holds those positions' keys and values for every layer, [layers, kv_heads, block_size, head_dim].
  Cached keys carry RoPE at their absolute positions, and a hit puts them back at the same absolute
  positions (slots 0..hit-1 of a joining row), so a cached prefix is what a prefill would have computed,
  up to the last bits of a differently shaped matmul (CSD.md's note on floating point).
- `lookup` walks the chain from block 0 and stops at the first miss. What enters the cache: a finished
  prefill's full blocks, and, when a sequence finishes, the full blocks of its committed tokens (so a
  chat's next turn, which resends this answer, hits it too). Draft tokens the target rejected never do:
  they are dead slots of the batch cache and not committed.
- Eviction is LRU over blocks within `max_bytes`. A chain is touched deepest block first, so its root is
  the most recent: the deepest blocks of the coldest chain go first, and a block never outlives its
  parent for long (an orphan is unreachable and is evicted as it ages).

Models whose cache is not plain full attention (sliding-window layers keep a rolling window; linear
attention keeps a state, not per-position keys) cannot reuse blocks this way: `prefix_caching_unsupported`
says why and the runtime then serves without the cache.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

DEFAULT_BLOCK_SIZE = 16
# Default bound: this share of the device's memory (the machine's RAM on a CPU, the GPU's memory on CUDA),
# and never more than DEFAULT_MAX_BYTES: the model, activations and the running batch's own cache need the
# rest.
DEFAULT_MEMORY_SHARE = 0.10
DEFAULT_MAX_BYTES = 8 << 30
_ROOT = b"csd-serve prefix cache v1"


def prefix_caching_unsupported(model: torch.nn.Module) -> str | None:
    """Why this model's KV cache cannot be shared by blocks, or None when it can."""
    layers = getattr(DynamicCache(config=model.config), "layers", None)
    if not layers:
        return "its cache has no per-layer keys and values"
    if any(getattr(layer, "is_sliding", False) for layer in layers):
        return "it has sliding-window attention layers (their cache is a rolling window, not positions)"
    if any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        return f"its cache layers are not plain full attention ({', '.join(kinds)})"
    return None


def default_max_bytes(device: torch.device | str = "cpu") -> int:
    """The bound when none is set: DEFAULT_MEMORY_SHARE of the device's memory, at most DEFAULT_MAX_BYTES."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(device).total_memory
    else:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 8 << 30
    return int(min(DEFAULT_MAX_BYTES, total * DEFAULT_MEMORY_SHARE))


@dataclass
class _Block:
    tokens: tuple[int, ...]
    keys: torch.Tensor  # [layers, kv_heads, block_size, head_dim]
    values: torch.Tensor
    nbytes: int


@dataclass
class PrefixCacheStats:
    """Counters in tokens, as vLLM counts `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`."""

    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens served from the cache
    stored_blocks: int = 0  # blocks added
    evicted_blocks: int = 0  # blocks dropped to stay within the bound


@dataclass
class PrefixHit:
    """A lookup's result: `tokens` cached positions (a multiple of the block size) and their per-layer
    keys and values, [1, kv_heads, tokens, head_dim] each (empty lists on a miss)."""

    tokens: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixCache:
    """Blocks of one target model's KV cache, keyed by chain hash, LRU within `max_bytes` (thread-safe)."""

    def __init__(self, max_bytes: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        if max_bytes < 0:
            raise ValueError("max_bytes must not be negative")
        self.max_bytes = max_bytes
        self.block_size = block_size
        self.stats = PrefixCacheStats()
        self._blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()  # LRU first
        self._bytes = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ state

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    def block_keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The chain key of every full block of `tokens`."""
        keys, parent, size = [], _ROOT, self.block_size
        for start in range(0, len(tokens) - size + 1, size):
            parent = _chain(parent, tokens[start : start + size])
            keys.append(parent)
        return keys

    # ------------------------------------------------------------------ lookup and store

    def lookup(self, tokens: Sequence[int], max_tokens: int | None = None) -> PrefixHit:
        """The longest cached prefix of `tokens` in whole blocks, at most `max_tokens` long. Counts
        len(tokens) queried and the hit's length as hits."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        size = self.block_size
        found: list[_Block] = []
        found_keys: list[bytes] = []
        with self._lock:
            self.stats.queries += len(tokens)
            for i, key in enumerate(self.block_keys(tokens[: limit - limit % size])):
                block = self._blocks.get(key)
                if block is None or block.tokens != tuple(tokens[i * size : (i + 1) * size]):
                    break
                found.append(block)
                found_keys.append(key)
            self._touch(found_keys)
            self.stats.hits += len(found) * size
        if not found:
            return PrefixHit(0, [], [])
        layers = found[0].keys.shape[0]
        keys = [torch.cat([b.keys[layer] for b in found], dim=1).unsqueeze(0) for layer in range(layers)]
        values = [torch.cat([b.values[layer] for b in found], dim=1).unsqueeze(0) for layer in range(layers)]
        return PrefixHit(len(found) * size, keys, values)

    def store(self, tokens: Sequence[int], layer_kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Add the full blocks of `tokens`, whose keys and values per layer are `layer_kv[l]`, each
        [kv_heads, >= len(tokens) // block_size * block_size, head_dim] (position i of the sequence at index
        i). Blocks already cached are only touched. Returns how many blocks were added."""
        keys = self.block_keys(tokens)
        if not keys or not layer_kv:
            return 0
        size = self.block_size
        with self._lock:
            missing = [i for i, key in enumerate(keys) if key not in self._blocks]
        new: dict[bytes, _Block] = {}
        for i in missing:
            span = slice(i * size, (i + 1) * size)
            k = torch.stack([layer_k[:, span] for layer_k, _ in layer_kv])  # copies: the batch cache moves on
            v = torch.stack([layer_v[:, span] for _, layer_v in layer_kv])
            nbytes = k.element_size() * k.numel() + v.element_size() * v.numel()
            if nbytes > self.max_bytes:
                return 0
            new[keys[i]] = _Block(tuple(tokens[span]), k, v, nbytes)
        with self._lock:
            for key, block in new.items():
                if key not in self._blocks:
                    self._blocks[key] = block
                    self._bytes += block.nbytes
                    self.stats.stored_blocks += 1
            self._touch(keys)
            self._evict()
        return len(new)

    # ------------------------------------------------------------------ LRU

    def _touch(self, chain: list[bytes]) -> None:
        """Most recent last; deepest first, so a chain's root is touched last and evicted last."""
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _evict(self) -> None:
        """Drop least recently used blocks until the bound holds. A chain just stored is the most recent,
        deepest block first: when it alone exceeds the bound, its deepest blocks go and its root stays."""
        while self._bytes > self.max_bytes and self._blocks:
            _, block = self._blocks.popitem(last=False)
            self._bytes -= block.nbytes
            self.stats.evicted_blocks += 1


def _chain(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(
        parent + b"".join(int(t).to_bytes(8, "little", signed=True) for t in tokens)
    ).digest()
