"""MSN's "ahead noise": tokens copied from uniformly chosen earlier positions of the same sequence.

Shared by the trainer (``train/msn.py``: one noised span per response, redrawn every time a sample
is seen) and the decoders (``drafters/jacobi.py``, ``drafters/msn.py``: free guess slots are
filled with it). Randomness is always an explicit ``torch.Generator``.
"""

from __future__ import annotations

import torch


def ahead_noise(ids: list[int], n: int, generator: torch.Generator) -> list[int]:
    """``n`` tokens, each ``ids[j]`` for ``j`` uniform in ``0..len(ids) - 1`` (the paper's
    ``random_sample(X_<i)`` at decode time: the pool is the whole committed text)."""
    if n <= 0:
        return []
    if not ids:
        raise ValueError("ahead noise needs at least one earlier token")
    idx = torch.randint(0, len(ids), (n,), generator=generator)
    return [ids[int(j)] for j in idx]


def noise_span(ids: torch.Tensor, start: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Overwrite ``ids[start : start + length]`` with ahead noise, in order: position ``i`` gets
    ``ids[j]`` for ``j`` uniform in ``0..i - 1`` of the *already noised* prefix (so a later noise
    token may copy an earlier one, as in the official snippet).

    Args:
        ids: ``[T]`` int64, modified in place and returned.
        start: first noised position, ``>= 1``.
        length: span length; positions past ``T`` are ignored.
    """
    if start < 1:
        raise ValueError("the noise span must start after the first token")
    for i in range(start, min(start + length, ids.numel())):
        j = int(torch.randint(0, i, (1,), generator=generator))
        ids[i] = ids[j]
    return ids
