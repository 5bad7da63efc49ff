"""Verify-block attention without copying the KV cache (the ``onednn`` and ``compiled`` backends).

For a block of several new tokens after a cached prefix, ``transformers``' sdpa path repeats
every KV head for its query heads (a copy of the whole cache per layer per step, ~10% of a
verify step of Qwen2.5-1.5B here). This calls ``scaled_dot_product_attention`` with
``enable_gqa=True`` instead. One-token decoding and the prompt forward go through the stock
path unchanged, so ``ar`` computes exactly what ``transformers`` computes.

The ``compiled`` backend's static cache is attended through a mask as wide as its capacity at
every step, one-token steps included: :data:`STATIC_NAME` shares KV heads for those too, and reads
only the cache's written positions. The step passes their count as a tensor (keyword
:data:`WINDOW`, which HF models hand on to their attention function), and attention is one
custom op (:func:`windowed_sdpa`) that slices the cache and the mask to it at run time: the
compiled graph keeps its static shapes, and a step's attention costs what its context needs, not
what the capacity holds. On SmolLM2 (AVX-512, 2 threads, 60 positions written) a 512-position
cache's 8-token step took 0.90x the full-width time, and on a 2048-position cache (requests of
897-1,920 tokens) the one-token and 8-token steps took 0.64x and 0.62x
(``experiments/windowed_attention.py``).

Registered with ``transformers.AttentionInterface`` under :data:`NAME` and :data:`STATIC_NAME`
(no mask function: the model passes ``attention_mask=None`` for plain causal blocks and our 4-D
boolean masks as is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "selfspec_gqa_sdpa"
STATIC_NAME = "selfspec_static_sdpa"
WINDOW = "selfspec_window"
"""The keyword of the static step's forward that carries the written positions (a 0-d int64 CPU
tensor: ``base + padded block``); named in saved steps' keys, whose graphs take it."""


def windowed_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  window: torch.Tensor, scale: float | None) -> torch.Tensor:
    """``scaled_dot_product_attention`` over the first ``window`` cache positions only: the
    positions the mask hides past them cost nothing. Shapes: ``query[B, Hq, T, D]``,
    ``key/value[B, Hkv, N, D]``, ``mask[B, 1, T, N]`` (bool, True = attend; nothing visible at or
    past ``window``), ``window`` a 0-d int64 CPU tensor (``<= N``). Returns ``[B, Hq, T, D]``.

    A one-row block (``T == 1``, a one-token step) sees every written position, the prefix and
    itself, so its mask is not read: SDPA without a mask skips converting it (about 4 us of a
    call of some 20 here).

    The op ``torch.ops.selfspec.windowed_sdpa`` (:data:`_OPS`) so that a compiled graph keeps
    static shapes: the slice's length is read at run time (a CPU tensor: no device transfer).
    Defined through ``torch.library.Library`` rather than ``custom_op``, whose Python wrapper
    added about 6 us to each of a step's 30 calls."""
    w = int(window)
    return F.scaled_dot_product_attention(query, key[:, :, :w], value[:, :, :w],
                                          attn_mask=None if query.shape[2] == 1 else mask[..., :w], scale=scale,
                                          enable_gqa=key.shape[1] != query.shape[1])


_OPS = torch.library.Library("selfspec", "FRAGMENT")  # beside onednn.py's definitions in the namespace
_OPS.define("windowed_sdpa(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor window, float? scale) "
            "-> Tensor")
_OPS.impl("windowed_sdpa", windowed_sdpa, "CompositeExplicitAutograd")


@torch.library.register_fake("selfspec::windowed_sdpa")
def _windowed_sdpa_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                         window: torch.Tensor, scale: float | None) -> torch.Tensor:
    return torch.empty_like(query)


def _shared_heads_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                            every_masked_block: bool, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention with ``enable_gqa`` (no repeated KV heads) for blocks of several new tokens after
    a cached prefix, and, with ``every_masked_block``, for every block given a mask (one token
    included); the stock sdpa path otherwise. Shapes: ``query[B, Hq, T, D]``,
    ``key/value[B, Hkv, N, D]``, ``attention_mask`` None (causal) or ``[B, 1, T, N]``.
    Returns ``[B, T, Hq, D]``."""
    t, n = query.shape[2], key.shape[2]
    plain = t == 1 or t == n
    if kwargs.get("softcap") is not None or (plain and (attention_mask is None or not every_masked_block)):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # a sliding-window layer's mask hides old positions too, which the written-positions op would not
    # read for one token: it attends through the whole mask instead
    sliding = kwargs.get("sliding_window") is not None
    window = kwargs.get(WINDOW) if every_masked_block and attention_mask is not None and not sliding else None
    if attention_mask is None:  # causal, aligned to the end of the cache
        attention_mask = torch.ones(t, n, dtype=torch.bool, device=query.device).tril(n - t)[None, None]
    if window is not None:  # the static step's written positions
        out = torch.ops.selfspec.windowed_sdpa(query, key, value, attention_mask, window, scaling)
        return out.transpose(1, 2).contiguous(), None
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """The ``onednn`` backend's attention (HF attention function): verify blocks share KV heads;
    one-token decoding and the prompt forward take the stock path, so ``ar`` computes exactly
    what ``transformers`` computes."""
    return _shared_heads_attention(module, query, key, value, attention_mask, dropout, scaling, False, **kwargs)


def static_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """The ``compiled`` backend's attention: every block (one token included) attends through its
    ``[B, 1, T, capacity]`` mask with shared KV heads, where the stock path's repeated KV heads
    would copy the whole capacity per layer per step; over the written positions only when the
    forward was given them (keyword :data:`WINDOW`: :func:`windowed_sdpa`). Eager forwards on
    growing caches (the tree self-test, cost profiles) get a causal mask when given none."""
    return _shared_heads_attention(module, query, key, value, attention_mask, dropout, scaling, True, **kwargs)


AttentionInterface.register(NAME, gqa_attention_forward)
AttentionInterface.register(STATIC_NAME, static_attention_forward)
