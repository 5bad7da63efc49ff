"""Row-wise attention: each new query token attends through its own one-token attention call.

Why: a batched attention kernel sums in an order that depends on how many query rows it is
given, so row j of a q-token verify differs from decoding that token alone in the last bits.
With fp32 weights that is harmless noise; with int8 activations a last-bit change can flip an
activation's rounding and move logits visibly. Here every query row runs the *same* call with
the *same* shapes as one-token decoding of that token (its visible keys, sliced or gathered in
position order), so the ``int8`` backend's verify logits are bit-identical to one-token decoding.

The prompt (a forward with no cached prefix) uses the batched kernel: speculative decoding and
``ar`` share that prefill, so it does not affect equality between methods.

Registered with ``transformers.AttentionInterface`` under :data:`NAME`; no mask function is
registered, so the model passes ``attention_mask=None`` for plain causal blocks and our own 4-D
boolean masks (trees) unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

NAME = "selfspec_rowwise"


def _one_row(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """One query token against its visible keys.

    Shapes: ``query[B, Hq, 1, D]``, ``key/value[B, Hkv, M, D]`` -> ``[B, Hq, 1, D]``.
    Query heads of a KV group are folded into rows (``[B, Hkv, G, D]``) so no KV copy is made.
    """
    b, hq, _, d = query.shape
    hkv = key.shape[1]
    packed = query.reshape(b, hkv, hq // hkv, d)
    out = F.scaled_dot_product_attention(packed, key, value, scale=scaling)
    return out.reshape(b, hq, 1, d)


def rowwise_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function.

    Shapes: ``query[B, Hq, T, D]``, ``key/value[B, Hkv, N, D]`` (cached prefix + the T new
    tokens), ``attention_mask`` None (causal) or ``[B, 1, T, N]`` (bool: True = attend, or
    additive float: 0 = attend). Returns ``[B, T, Hq, D]``.
    """
    t, n = query.shape[2], key.shape[2]
    if t == n:  # prompt prefill: no cached prefix, batched causal kernel
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    rows = []
    for j in range(t):
        if attention_mask is None:
            m = n - t + j + 1
            rows.append(_one_row(query[:, :, j:j + 1], key[:, :, :m], value[:, :, :m], scaling))
            continue
        per_batch = []
        for b in range(query.shape[0]):
            row = attention_mask[b, 0, j]
            visible = row if row.dtype == torch.bool else row == 0
            idx = visible.nonzero().flatten()
            m = idx.numel()
            if m and int(idx[-1]) == m - 1:  # a prefix: slice, as one-token decoding sees it
                k, v = key[b:b + 1, :, :m], value[b:b + 1, :, :m]
            else:
                k, v = key[b:b + 1].index_select(2, idx), value[b:b + 1].index_select(2, idx)
            per_batch.append(_one_row(query[b:b + 1, :, j:j + 1], k, v, scaling))
        rows.append(torch.cat(per_batch))
    out = torch.cat(rows, dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, rowwise_attention_forward)
