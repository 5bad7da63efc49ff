"""Reduced draft vocabularies (FR-Spec / EAGLE-3's ``d2t``): the draft's LM head covers only the
N most frequent tokens of the target's own generations.

Drafting then multiplies by ``N x H`` rows instead of ``V x H``; verification always uses the
full vocabulary, so greedy output stays identical to ``ar``. When sampling, a drafter's ``q`` is
zero outside the subset, which the shared acceptance rules handle exactly (a token q never
proposes is only reached through the residual ``norm(max(0, p - q))``), so sampling stays
lossless too (``tests/statistical/test_draft_vocab_sampling.py``).

The map between the two vocabularies is EAGLE-3's: draft index ``i`` is target token
``i + d2t[i]``; ``t2d[v]`` says whether target token ``v`` is in the subset. ``ids`` are sorted
ascending, so ``d2t`` is non-negative.

A *ranking* (every token id, most frequent first, counted on the target's own generations and
shipped per model in ``selfspec/data/draft_vocab/<model>.json``) gives the subset of any size N:
the top N of the ranking plus the tokens that must always be reachable (EOS, the chat
template's special tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
from torch import nn


class DraftVocab:
    """A sorted subset of the target vocabulary.

    Attributes:
        ids: ``[N]`` int64 target token ids, ascending.
        vocab_size: V, the target's vocabulary size.
    """

    def __init__(self, token_ids: torch.Tensor | Sequence[int], vocab_size: int) -> None:
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().unique(sorted=True)
        if ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token")
        if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size})")
        self.ids = ids
        self.vocab_size = int(vocab_size)
        self._on: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def from_ranking(cls, ranking: Sequence[int], size: int, vocab_size: int,
                     always: Iterable[int] = ()) -> DraftVocab:
        """The ``size`` best-ranked ids, plus ``always`` (which count towards ``size`` only
        where they are already among the best)."""
        keep = [int(t) for t in ranking[:size] if 0 <= int(t) < vocab_size]
        return cls(keep + [int(t) for t in always if 0 <= int(t) < vocab_size], vocab_size)

    @classmethod
    def from_d2t(cls, d2t: torch.Tensor, vocab_size: int) -> DraftVocab:
        """From EAGLE-3's offsets: draft index ``i`` is target token ``i + d2t[i]``."""
        return cls(torch.arange(d2t.numel()) + d2t.long().cpu(), vocab_size)

    @property
    def size(self) -> int:
        return int(self.ids.numel())

    def d2t(self) -> torch.Tensor:
        """``[N]`` int64 offsets: target id = ``i + d2t[i]``."""
        return self.ids - torch.arange(self.size)

    def t2d(self) -> torch.Tensor:
        """``[V]`` bool: True where the target token is in the subset."""
        m = torch.zeros(self.vocab_size, dtype=torch.bool)
        m[self.ids] = True
        return m

    def ids_on(self, device: torch.device) -> torch.Tensor:
        """``ids`` on ``device`` (cached)."""
        t = self._on.get(device)
        if t is None:
            t = self._on[device] = self.ids.to(device)
        return t

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Draft indices (any shape) -> target token ids (same shape)."""
        return self.ids_on(index.device)[index]

    def expand(self, logits: torch.Tensor) -> torch.Tensor:
        """``[..., N]`` draft logits -> ``[..., V]`` with ``-inf`` outside the subset, so a
        distribution built from them is zero there."""
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.ids_on(logits.device), logits)

    def coverage(self, counts: torch.Tensor) -> float:
        """Share of the tokens counted in ``counts`` (``[V]``) that the subset holds."""
        total = float(counts.sum())
        return float(counts[self.ids].sum()) / total if total else 0.0

    def head(self, lm_head: nn.Module) -> nn.Linear:
        """A new ``Linear(H -> N)`` whose rows are those of ``lm_head`` (an ``nn.Linear`` or a
        swapped layer wrapping one) at ``ids``, on its device and dtype; no gradient."""
        original = getattr(lm_head, "original", lm_head)
        weight = cast(torch.Tensor, original.weight)
        w = weight.detach()
        b = getattr(original, "bias", None)
        layer = nn.Linear(w.shape[1], self.size, bias=b is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            layer.weight.copy_(w.index_select(0, self.ids_on(w.device)))
            if b is not None:
                layer.bias.copy_(b.detach().index_select(0, self.ids_on(w.device)))
        layer.requires_grad_(False)
        return layer


def ranking_from_counts(counts: torch.Tensor, prior: torch.Tensor | None = None) -> list[int]:
    """Every token id, most frequent first: by ``counts`` (``[V]``, the target's own
    generations), then by ``prior`` (``[V]``, counts on a wider corpus, scaled to the same
    total), then by lower id (earlier BPE merges are the more frequent)."""
    v = counts.numel()
    score = counts.double()
    if prior is not None and float(prior.sum()) > 0:
        score = score + prior.double() * (float(counts.sum()) or 1.0) / float(prior.sum())
    score = score + (v - torch.arange(v, dtype=torch.float64)) / (v * 1e6)  # ties: lower id first
    return torch.argsort(score, descending=True).tolist()
