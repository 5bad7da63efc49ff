"""Verify-block attention without copying the KV cache (the ``onednn`` backend uses it).

For a block of several new tokens after a cached prefix, ``transformers``' sdpa path repeats
every KV head for its query heads (a copy of the whole cache per layer per step, ~10% of a
verify step of Qwen2.5-1.5B here). This calls ``scaled_dot_product_attention`` with
``enable_gqa=True`` instead. One-token decoding and the prompt forward go through the stock
path unchanged, so ``ar`` computes exactly what ``transformers`` computes.

Registered with ``transformers.AttentionInterface`` under :data:`NAME` (no mask function: the
model passes ``attention_mask=None`` for plain causal blocks and our 4-D boolean masks as is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "selfspec_gqa_sdpa"
STATIC_NAME = "selfspec_static_sdpa"


def gqa_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                          **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function. Shapes: ``query[B, Hq, T, D]``, ``key/value[B, Hkv, N, D]``,
    ``attention_mask`` None (causal) or ``[B, 1, T, N]``. Returns ``[B, T, Hq, D]``."""
    t, n = query.shape[2], key.shape[2]
    if t == 1 or t == n or kwargs.get("softcap") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is None:  # causal, aligned to the end of the cache
        attention_mask = torch.ones(t, n, dtype=torch.bool, device=query.device).tril(n - t)[None, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def static_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """The ``compiled`` backend's attention: every block (one token included) attends over the
    whole static cache through its ``[B, 1, T, capacity]`` mask, so the repeated KV heads of
    the stock path would copy the whole capacity per layer per step; this never copies them.
    Shapes as :func:`gqa_attention_forward`."""
    if kwargs.get("softcap") is not None or attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, gqa_attention_forward)
AttentionInterface.register(STATIC_NAME, static_attention_forward)
