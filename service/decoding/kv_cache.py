"""KV cache helpers over transformers' `DynamicCache`."""

from __future__ import annotations

from transformers import Cache


def crop_cache(cache: Cache, length: int) -> None:
    """Keep the first `length` positions of every layer: the rollback after a rejected draft.

    transformers 5 takes the number of positions to *remove* as a negative integer.
    """
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)
