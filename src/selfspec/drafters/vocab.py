"""The draft LM head every drafter that computes logits while drafting shares: the target's own
LM head, or its rows over a reduced draft vocabulary (:mod:`selfspec.core.draft_vocab`) on the
target's kernels backend.

Verification never goes through here: the decode loop verifies with the full model, so greedy
output stays identical to ``ar`` whatever the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..core.draft_vocab import DraftVocab
from ..kernels.backends import convert_linear

DRAFT_VOCAB_HELP = ("draft LM head over the N most frequent tokens of the model's own generations (FR-Spec; "
                    "verification keeps the full vocabulary, so output is unchanged); -1 = the size stored with "
                    "the head or skip config (the full vocabulary where none is), 0 = the full vocabulary")


class DraftLMHead:
    """Logits of draft hidden states over the draft vocabulary.

    Attributes:
        vocab: the reduced vocabulary, or None for the full one.
        size: N (or V).
    """

    adapts = False  # fixed at load time: not part of a drafter's per-request state (drafters/base.py)

    def __init__(self, lm_head: nn.Module, vocab: DraftVocab | None, backend: str = "stock") -> None:
        """
        Args:
            lm_head: the target's output layer (``nn.Linear`` or a swapped layer wrapping one).
            vocab: the subset (None: use ``lm_head`` as it is).
            backend: kernels backend of the subset layer (the target's, so both run alike).
        """
        self.vocab = vocab
        if vocab is None:
            self.layer: Callable[[torch.Tensor], torch.Tensor] = lm_head
            self.size = int(getattr(lm_head, "out_features", 0))
            return
        self.layer = convert_linear(vocab.head(lm_head), backend)
        self.size = vocab.size

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., N]`` logits over the draft vocabulary, at least fp32."""
        logits = self.layer(h)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def full(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[..., N]`` as ``[..., V]``: ``-inf`` outside a reduced vocabulary."""
        return logits if self.vocab is None else self.vocab.expand(logits)

    def to_target(self, index: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary -> target token ids (same shape)."""
        return index if self.vocab is None else self.vocab.to_target(index)
