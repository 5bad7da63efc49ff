"""KV-cache bookkeeping on stock ``transformers`` ``DynamicCache`` objects.

Each layer is a :class:`PreallocLayer`: a ``DynamicLayer`` whose keys and values are views of a
preallocated buffer that grows by doubling, so appending a verify block writes only the new rows
instead of copying the whole cache (``torch.cat``) in every layer at every step.

Invariant between decode steps: the target cache holds the KV of every committed token except
the pending one. A verify forward appends the KV of all N tree nodes (and of any piggyback
tokens) after ``base``; :func:`commit` keeps the rows of the accepted path, copying them down
when the path is not a prefix of the verified block (a tree branch), and drops the rest.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from ..errors import SelfspecError


@functools.cache
def _cache_arg_name(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(module: torch.nn.Module, cache) -> dict:
    """``{name: cache}`` for ``module(...)``, under the argument name the installed
    ``transformers`` expects: ``past_key_values`` up to 5.2x, ``cache`` later (the old name
    still works there but warns)."""
    return {_cache_arg_name(type(module)): cache}


class PreallocLayer(DynamicLayer):
    """``DynamicLayer`` with in-place appends.

    ``keys``/``values`` are ``[B, H, n, D]`` views of ``[B, H, capacity, D]`` buffers; truncating
    (``keys = keys[..., :m, :]``) and copying rows down (writes into the view) work unchanged,
    and the next update appends after the view's last row.
    """

    MIN_CAPACITY = 256

    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.keys.shape[-2] if self._kbuf is not None else 0
        t = key_states.shape[-2]
        if self._kbuf is None or n + t > self._kbuf.shape[-2] or self._kbuf.shape[:2] != key_states.shape[:2]:
            cap = max(self.MIN_CAPACITY, 2 * (n + t))
            b, h, _, d = key_states.shape
            kbuf = key_states.new_empty(b, h, cap, d)
            vbuf = value_states.new_empty(b, h, cap, value_states.shape[-1])
            if n:
                kbuf[..., :n, :] = self.keys
                vbuf[..., :n, :] = self.values
            self._kbuf, self._vbuf = kbuf, vbuf
        self._kbuf[..., n:n + t, :] = key_states
        self._vbuf[..., n:n + t, :] = value_states
        self.keys = self._kbuf[..., :n + t, :]
        self.values = self._vbuf[..., :n + t, :]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None


def new_cache(model_config) -> DynamicCache:
    """An empty cache for one sequence; refuses cache types that cannot be rolled back."""
    cache = DynamicCache(config=model_config)
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise SelfspecError(
                f"this model uses a {type(layer).__name__} cache (sliding-window or hybrid), which "
                "speculative decoding cannot roll back; use a model with full attention"
            )
    cache.layers = [PreallocLayer() for _ in cache.layers]
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
