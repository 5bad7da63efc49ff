"""KV-cache bookkeeping on stock ``transformers`` ``DynamicCache`` objects.

Invariant between decode steps: the target cache holds the KV of every committed token except
the pending one. A verify forward appends the KV of all N tree nodes (and of any piggyback
tokens) after ``base``; :func:`commit` keeps the rows of the accepted path, copying them down
when the path is not a prefix of the verified block (a tree branch), and drops the rest.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..errors import SelfspecError


def new_cache(model_config) -> DynamicCache:
    """An empty cache for one sequence; refuses cache types that cannot be rolled back."""
    cache = DynamicCache(config=model_config)
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise SelfspecError(
                f"this model uses a {type(layer).__name__} cache (sliding-window or hybrid), which "
                "speculative decoding cannot roll back; use a model with full attention"
            )
    return cache


def cache_length(cache: DynamicCache) -> int:
    """Number of cached positions (all layers hold the same number)."""
    return cache.get_seq_length()


def truncate(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at or after ``length``."""
    for layer in cache.layers:
        if layer.is_initialized and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def commit(cache: DynamicCache, base: int, kept: list[int]) -> None:
    """Keep the verified rows ``base + kept[i]`` at ``base + i`` and drop everything after.

    Args:
        cache: the cache after a verify forward wrote rows ``[base, base + N + M)``.
        base: cache length before the verify forward.
        kept: node indices of the accepted path (root first), increasing.
    """
    n = len(kept)
    if kept != list(range(n)):  # a tree branch: copy the accepted rows down (gather, then write)
        idx = torch.tensor(kept, dtype=torch.long) + base
        for layer in cache.layers:
            idx_d = idx.to(layer.keys.device)
            layer.keys[..., base : base + n, :] = layer.keys.index_select(-2, idx_d)
            layer.values[..., base : base + n, :] = layer.values.index_select(-2, idx_d)
    truncate(cache, base + n)
