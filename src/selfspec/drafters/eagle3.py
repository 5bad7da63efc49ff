"""The draft LM head of an EAGLE-3 head inside the EAGLE-2 tree drafter (``drafters/eagle.py``).

An EAGLE-3 head carries its own final norm and LM head over its draft vocabulary (``d2t``), so the
drafter scores tokens with those instead of the target's LM head. This class gives them the
:class:`~selfspec.drafters.vocab.DraftLMHead` interface the drafter uses (logits at least fp32,
``full`` over the target vocabulary, ``to_target``); verification stays the target's, so the
output is unchanged whatever the head drafts.
"""

from __future__ import annotations

from ..heads.eagle3 import Eagle3Head
from ..kernels.backends import convert_linear
from .vocab import DraftLMHead


class HeadLMHead(DraftLMHead):
    """``lm_head(norm(h))`` of an EAGLE-3 head over its draft vocabulary.

    Attributes:
        vocab: the head's draft vocabulary (None: the full vocabulary).
        size: N, the rows of its ``lm_head``.
        lm: that ``lm_head`` on the backend's kernels (the module itself on ``stock``).
    """

    def __init__(self, head: Eagle3Head, backend: str = "stock") -> None:
        """
        Args:
            head: the EAGLE-3 head (its ``norm`` and ``lm_head``; no target rows are taken).
            backend: kernels backend of the LM head (the target's, as for EAGLE-2 heads' subsets).
        """
        self.vocab = head.draft_vocab
        self.lm = lm = convert_linear(head.lm_head, backend)
        norm = head.norm
        self.layer = lambda h: lm(norm(h))
        self.size = int(head.lm_head.out_features)
