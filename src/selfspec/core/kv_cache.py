"""KV-cache bookkeeping on stock ``transformers`` caches: ``DynamicCache`` (every backend but
``compiled``) and ``StaticCache`` (the ``compiled`` backend's static-shape step).

Each layer is a :class:`PreallocLayer`: a ``DynamicLayer`` whose keys and values are views of a
preallocated buffer that grows by doubling, so appending a verify block writes only the new rows
instead of copying the whole cache (``torch.cat``) in every layer at every step.

Invariant between decode steps: the target cache holds the KV of every committed token except
the pending one. A verify forward appends the KV of all N tree nodes (and of any piggyback
tokens) after ``base``; :func:`commit` keeps the rows of the accepted path, copying them down
when the path is not a prefix of the verified block (a tree branch), and drops the rest.

A static cache holds ``[B, H, capacity, D]`` buffers addressed by position: its length is the
layers' ``cumulative_length`` counter (where the next block is written), so dropping rows only
moves the counter back; rows past it are stale and masked out, then overwritten.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, cast

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from ..errors import SelfspecError


@functools.cache
def _cache_arg_name(cls: type[torch.nn.Module]) -> str:
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_arg(module: torch.nn.Module, cache: Cache) -> dict[str, Cache]:
    """``{name: cache}`` for ``module(...)``, under the argument name the installed
    ``transformers`` expects: ``past_key_values`` up to 5.2x, ``cache`` later (the old name
    still works there but warns)."""
    return {_cache_arg_name(type(module)): cache}  # type: ignore[arg-type]  # classes hash; the stub says no


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

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = cast(torch.Tensor, self.keys).shape[-2] if self._kbuf is not None else 0
        t = key_states.shape[-2]
        if self._kbuf is None or n + t > self._kbuf.shape[-2] or self._kbuf.shape[:2] != key_states.shape[:2]:
            cap = max(self.MIN_CAPACITY, 2 * (n + t))
            b, h, _, d = key_states.shape
            kbuf = key_states.new_empty(b, h, cap, d)
            vbuf = value_states.new_empty(b, h, cap, value_states.shape[-1])
            if n:
                kbuf[..., :n, :] = cast(torch.Tensor, self.keys)
                vbuf[..., :n, :] = cast(torch.Tensor, self.values)
            self._kbuf, self._vbuf = kbuf, vbuf
        kbuf, vbuf = self._kbuf, cast(torch.Tensor, self._vbuf)
        kbuf[..., n:n + t, :] = key_states
        vbuf[..., n:n + t, :] = value_states
        self.keys = kbuf[..., :n + t, :]
        self.values = vbuf[..., :n + t, :]
        return self.keys, self.values

    def reset(self) -> None:
        super().reset()
        self._kbuf = self._vbuf = None


def _refuse_unrollable(model_config: Any, layers: list[Any]) -> None:
    """Refuse caches whose layers keep a state other than keys and values by position (linear
    attention, recurrent or state-space layers): a rejected draft could not be taken back."""
    for layer in layers:
        if type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer):
            family = getattr(model_config, "model_type", "this model")
            raise SelfspecError(f"{family}: its {type(layer).__name__} cache keeps a state that speculative decoding "
                                "cannot roll back; selfspec decodes models whose layers are full or sliding-window "
                                "attention")


def new_cache(model_config: Any, capacity: int | None = None) -> DynamicCache | StaticCache:
    """An empty cache for one sequence; refuses cache types that cannot be rolled back.

    ``capacity``: a ``StaticCache`` of that many positions (the ``compiled`` backend), else a
    growing ``DynamicCache`` with preallocated layers. Sliding-window layers get a full layer
    too: the window is applied in the verify mask (``models.adapter.layer_windows``), so rolling
    back is the same truncation as under full attention. The cost: a window layer holds every
    position of the request, not the last ``window`` (the same as a full-attention layer)."""
    if capacity is not None:
        static = StaticCache(config=model_config, max_cache_len=capacity)
        _refuse_unrollable(model_config, static.layers)
        static.layers = [layer if type(layer) is StaticLayer else StaticLayer(max_cache_len=capacity)
                         for layer in static.layers]
        return static
    cache = DynamicCache(config=model_config)
    _refuse_unrollable(model_config, cache.layers)
    cache.layers = [PreallocLayer() for _ in cache.layers]
    return cache


class _KVLayer(DynamicLayer):
    """What a cache layer holds once written, for the type checker: ``keys``/``values`` tensors."""

    keys: torch.Tensor
    values: torch.Tensor


class _StaticKVLayer(StaticLayer):
    """A static cache layer with its write counter (a ``[1]`` int64 tensor), for the type checker."""

    cumulative_length: torch.Tensor


def _kv_layers(cache: Cache) -> list[_KVLayer]:
    """``cache.layers`` as key/value layers (every cache :func:`new_cache` makes)."""
    return cast(list[_KVLayer], cache.layers)


def _static_layers(cache: Cache) -> list[_StaticKVLayer]:
    """A static cache's layers."""
    return cast(list[_StaticKVLayer], cache.layers)


def cache_length(cache: DynamicCache | StaticCache) -> int:
    """Number of cached positions (all layers hold the same number)."""
    return int(cache.get_seq_length())


def is_static(cache: DynamicCache | StaticCache) -> bool:
    """Whether ``cache`` is a static (position-addressed, fixed-capacity) cache."""
    return bool(cache.layers) and isinstance(cache.layers[0], StaticLayer)


def capacity(cache: DynamicCache | StaticCache) -> int | None:
    """A static cache's positions (None for a growing one)."""
    return cast(StaticLayer, cache.layers[0]).max_cache_len if is_static(cache) else None


def initialised(cache: StaticCache) -> bool:
    """Whether every layer of a static cache holds its tensors (they are allocated on a layer's
    first write, which a compiled step cannot do); False where transformers does not say."""
    return all(getattr(layer, "is_initialized", False) for layer in cache.layers)


def set_length(cache: StaticCache, length: int) -> None:
    """Make a static cache hold ``length`` positions: the next block is written at ``length``.

    Runs in inference mode: a layer's counter that transformers moved to the device during a
    step (``.to(device)`` copies it on CUDA, not on the CPU) is an inference tensor, which only
    inference mode may update in place (a reused cache's reset failed on CUDA, 2026-11-27)."""
    with torch.inference_mode():
        for layer in _static_layers(cache):
            layer.cumulative_length.fill_(length)


def truncate(cache: DynamicCache | StaticCache, length: int) -> None:
    """Drop every cached position at or after ``length``."""
    if is_static(cache):  # per layer, lowered only (a draft that skipped a layer's attention left it
        with torch.inference_mode():  # behind), on the device: no read of the counter on the host
            for static in _static_layers(cache):  # (inference mode: see set_length)
                static.cumulative_length.clamp_(max=length)
        return
    for layer in _kv_layers(cache):
        if layer.is_initialized and layer.keys.shape[-2] > length:
            layer.keys = layer.keys[..., :length, :]
            layer.values = layer.values[..., :length, :]


def commit(cache: DynamicCache | StaticCache, base: int, kept: list[int]) -> None:
    """Keep the verified rows ``base + kept[i]`` at ``base + i`` and drop everything after.

    Args:
        cache: the cache after a verify forward wrote rows ``[base, base + N + M)``.
        base: cache length before the verify forward.
        kept: node indices of the accepted path (root first), increasing.
    """
    n = len(kept)
    if kept != list(range(n)):  # a tree branch: copy the accepted rows down (gather, then write)
        idx = torch.tensor(kept, dtype=torch.long) + base
        for layer in _kv_layers(cache):
            idx_d = idx.to(layer.keys.device)
            layer.keys[..., base : base + n, :] = layer.keys.index_select(-2, idx_d)
            layer.values[..., base : base + n, :] = layer.values.index_select(-2, idx_d)
    truncate(cache, base + n)
