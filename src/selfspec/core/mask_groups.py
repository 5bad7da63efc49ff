"""SPACE's mask-group layout: one function for the decoder and the trainer, so they cannot drift.

A block of ``n`` real tokens (the decoder: the pending token and the candidates; the trainer: a
whole training sequence) is followed by ``G`` groups of ``k`` mask tokens. Group ``g`` is
*anchored* after real token ``anchors[g]``:

* real tokens see earlier real tokens only (plain causal; they never see a mask), so their
  outputs are exactly the model's causal outputs;
* mask ``j`` of group ``g`` sees real tokens ``0..anchors[g]`` and masks ``0..j`` of its own
  group (never another group: the paper's code, not its eq. 6);
* positions: real token ``i`` at ``i``, mask ``j`` of group ``g`` at ``anchors[g] + 1 + j``
  (relative to real token 0; the paper's eq. 7).

Mask ``j`` (0-based) of a group then learns / drafts the token ``j + 2`` places after its anchor
(the anchor's own output gives the token right after it).
"""

from __future__ import annotations

import torch


def mask_groups(n: int, anchors: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block mask and mask positions of ``n`` real tokens followed by ``len(anchors)`` groups.

    Args:
        n: real tokens in the block.
        anchors: ``G`` indices in ``[0, n)``, the last real token each group sees.
        k: masks per group.

    Returns:
        ``(block [n + G*k, n + G*k] bool, positions [G*k] int64)``: ``block[i, j]`` = token i
        sees token j; mask positions relative to real token 0.
    """
    g = len(anchors)
    if any(not 0 <= a < n for a in anchors):
        raise ValueError(f"anchors {anchors} must lie in [0, {n})")
    total = n + g * k
    block = torch.zeros(total, total, dtype=torch.bool)
    block[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    own = torch.ones(k, k, dtype=torch.bool).tril()
    positions = torch.empty(g * k, dtype=torch.long)
    for gi, a in enumerate(anchors):
        rows = slice(n + gi * k, n + (gi + 1) * k)
        block[rows, : a + 1] = True
        block[rows, rows] = own
        positions[gi * k : (gi + 1) * k] = torch.arange(a + 1, a + 1 + k)
    return block, positions
