"""HASS harmonized context alignment (HCA): n training passes that see the head's own features.

Pass j (1-based) predicts, at every position i, what the head would output at its j-th
autoregressive drafting step. Its query at i is built from ``S_{j-1}[i]`` (``S_0`` = target
features; ``S_s[0] = f_0``, ``S_s[i] = P_s[i-1]`` detached, P_s = output of pass s). A key at
position ``p <= i`` with offset ``m = i - p`` comes from set ``S_{j-1-m}`` when ``m <= j - 2`` and
from the target features ``S_0`` otherwise: exactly the context chained drafting sees.

Implementation on the stock decoder layer: the j sets are laid side by side as one sequence of
``j * L`` rows (copy c holds ``fc([E(x); S_{j-1-c}])`` at positions ``0..L-1``); a boolean mask
lets each copy-0 row see, for every earlier position, exactly the one copy the rule names (the
−inf masking of the spec, so pass j equals j-step drafting; tested in fp64). Rows of the other
copies only attend causally within their copy; their outputs are discarded. With n = 1 this is
the EAGLE forward.
"""

from __future__ import annotations

import torch
from torch import nn

from ..heads.eagle import EagleHead


def hca_mask(length: int, j: int, device: torch.device | None = None) -> torch.Tensor:
    """``[j*L, j*L]`` bool visibility for pass ``j`` over ``j`` copies of ``L`` positions.

    Copy c (rows and columns ``c*L .. c*L+L-1``) carries feature set ``S_{j-1-c}``.
    """
    n = j * length
    i = torch.arange(length, device=device)
    off = i[:, None] - i[None, :]  # [L, L] offset m = i - p
    mask = torch.zeros(n, n, dtype=torch.bool, device=device)
    for c in range(j):
        if c < j - 1:
            sel = off == c  # offset m = c <= j-2 -> set S_{j-1-m}, copy m
        else:
            sel = off >= j - 1  # the oldest keys -> target features, copy j-1
        mask[:length, c * length : (c + 1) * length] = sel
    for c in range(1, j):  # filler rows (discarded): causal within their own copy
        mask[c * length : (c + 1) * length, c * length : (c + 1) * length] = off >= 0
    return mask


class HcaModel(nn.Module):
    """Training wrapper: one ``forward`` runs all n passes (one call, so DDP syncs once).

    Attributes:
        head: the draft head being trained.
        passes: n, the number of alignment passes (1 = EAGLE).
    """

    def __init__(self, head: EagleHead, passes: int) -> None:
        super().__init__()
        self.head = head
        self.passes = passes

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor) -> list[torch.Tensor]:
        """
        Args:
            features: ``[B, L, H]`` (noisy) target features ``f_0 .. f_{L-1}``.
            token_embeds: ``[B, L, H]`` embeddings of the next tokens ``x_1 .. x_L``.

        Returns:
            n tensors ``[B, L, H]``: pass j's predicted features (pass 1 = EAGLE's).
        """
        b, length, _ = features.shape
        pos1 = torch.arange(length, device=features.device)
        sets = [features]
        preds = []
        for j in range(1, self.passes + 1):
            copies = [self.head.project(sets[j - 1 - c], token_embeds) for c in range(j)]
            h = torch.cat(copies, dim=1)
            positions = pos1.repeat(j)[None].expand(b, -1)
            mask = hca_mask(length, j, features.device)[None, None].expand(b, 1, -1, -1)
            out = self.head.layer_forward(h, positions, mask)[:, :length]
            preds.append(out)
            if j < self.passes:
                prev = sets[-1]
                sets.append(torch.cat([prev[:, :1], out[:, :-1]], dim=1).detach())
        return preds
