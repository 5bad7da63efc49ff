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

    Shapes: ``query[B, Hkv, G, D]`` (the token's G query heads of each KV group folded into
    rows, so no KV copy is made), ``key/value[B, Hkv, M, D]`` -> ``[B, Hkv, G, D]``.
    """
    return F.scaled_dot_product_attention(query, key, value, scale=scaling)


def rowwise_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function.

    Shapes: ``query[B, Hq, T, D]``, ``key/value[B, Hkv, N, D]`` (cached prefix + the T new
    tokens), ``attention_mask`` None (causal) or ``[B, 1, T, N]`` (bool: True = attend, or
    additive float: 0 = attend). Returns ``[B, T, Hq, D]``.
    """
    b, hq, t, d = query.shape
    n, hkv = key.shape[2], key.shape[1]
    if t == n:  # prompt prefill: no cached prefix, batched causal kernel
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    rows_q = query.reshape(b, hkv, hq // hkv, t, d).permute(0, 3, 1, 2, 4)  # [B, T, Hkv, G, D]
    rows = []
    for j in range(t):
        if attention_mask is None:
            m = n - t + j + 1
            rows.append(_one_row(rows_q[:, j], key[:, :, :m], value[:, :, :m], scaling))
            continue
        per_batch = []
        for i in range(b):
            row = attention_mask[i, 0, j]
            visible = row if row.dtype == torch.bool else row == 0
            idx = visible.nonzero().flatten()
            m = idx.numel()
            if m and int(idx[-1]) == m - 1:  # a prefix: slice, as one-token decoding sees it
                k, v = key[i:i + 1, :, :m], value[i:i + 1, :, :m]
            else:
                k, v = key[i:i + 1].index_select(2, idx), value[i:i + 1].index_select(2, idx)
            per_batch.append(_one_row(rows_q[i:i + 1, j], k, v, scaling))
        rows.append(per_batch[0] if b == 1 else torch.cat(per_batch))
    return torch.stack(rows, dim=1).reshape(b, t, hq, d), None


AttentionInterface.register(NAME, rowwise_attention_forward)
