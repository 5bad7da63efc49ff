"""The kernels backends' attention functions (``selfspec.kernels.gqa_attention``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfspec.kernels import gqa_attention  # noqa: F401 - registers torch.ops.selfspec.windowed_sdpa


def _block(t: int, n: int, base: int) -> tuple[torch.Tensor, ...]:
    """Query of ``t`` rows over an ``n``-position cache whose first ``base + t`` positions are written;
    a tree-like mask: the prefix, then row i sees itself and every even row before it."""
    g = torch.Generator().manual_seed(t * 1000 + base)
    q = torch.randn(1, 6, t, 16, generator=g)
    k, v = torch.randn(1, 2, n, 16, generator=g), torch.randn(1, 2, n, 16, generator=g)
    mask = torch.zeros(1, 1, t, n, dtype=torch.bool)
    mask[..., :base] = True
    for i in range(t):
        mask[0, 0, i, base + i] = True
        mask[0, 0, i, base:base + i:2] = True
    return q, k, v, mask


def test_windowed_attention_is_full_width_attention_where_the_mask_hides_the_rest():
    """Over the written positions only, attention equals attention over the whole cache (what the
    mask hides past the window contributes nothing); a window one position short of the block
    drops a visible key (negative control)."""
    for t, base in ((1, 0), (1, 37), (4, 20), (8, 50)):
        q, k, v, mask = _block(t, 64, base)
        full = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
        windowed = torch.ops.selfspec.windowed_sdpa(q, k, v, mask, torch.tensor(base + t), 0.25)
        assert windowed.shape == full.shape == (1, 6, t, 16)
        torch.testing.assert_close(windowed, full, atol=1e-5, rtol=1e-5)
        short = torch.ops.selfspec.windowed_sdpa(q, k, v, mask, torch.tensor(base + t - 1), 0.25)
        assert not torch.allclose(short[..., -1, :], full[..., -1, :], atol=1e-3)
        k[..., base + t:, :] = float("nan")  # what lies past the window is never read
        assert torch.isfinite(torch.ops.selfspec.windowed_sdpa(q, k, v, mask, torch.tensor(base + t), 0.25)).all()
