"""The heads of the EAGLE tree drafter (``drafters/eagle.py``): which head it loads
(:func:`load_head_for`: ``--head``, the user's trained head, the shipped one, or a random one for
tests) and the draft LM head it scores tokens with (:func:`draft_lm_head`).

An EAGLE-3 head carries its own final norm and LM head over its draft vocabulary (``d2t``), so the
drafter scores tokens with those instead of the target's LM head: :class:`HeadLMHead` gives them
the :class:`~selfspec.drafters.vocab.DraftLMHead` interface the drafter uses (logits at least fp32,
``full`` over the target vocabulary, ``to_target``); verification stays the target's, so the
output is unchanged whatever the head drafts.
"""

from __future__ import annotations

import torch

from ..errors import SelfspecError
from ..heads.eagle import EagleHead
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


def load_head_for(target, head: str, draft_vocab: int, method: str) -> tuple[EagleHead | Eagle3Head, str]:
    """The head of ``eagle2`` / ``hass`` and where it came from: ``head`` (a directory holding
    an EAGLE-1/2 or EAGLE-3 head: selfspec's own, an export, or an official EAGLE checkpoint in
    safetensors; or ``random[:SEED]`` / ``random-eagle3[:SEED]`` for an untrained
    EAGLE-2 / EAGLE-3 head: tests and lower bounds), else the trained one in
    ``$SELFSPEC_HOME/heads``, else the one shipped with the package."""
    from pathlib import Path

    from ..heads import HEAD_RECIPES, find_head_dir
    from ..heads.checkpoints import load_draft_head

    if head.startswith("random"):
        kind, _, seed_text = head.partition(":")
        try:
            if kind not in ("random", "random-eagle3"):
                raise ValueError(kind)
            seed = int(seed_text or 0)
        except ValueError as e:
            raise SelfspecError(f"head {head!r}: use random[:SEED] or random-eagle3[:SEED] (SEED an "
                                "integer)") from e
        with torch.random.fork_rng(devices=[]):  # the caller's RNG stays untouched
            torch.manual_seed(seed)
            if kind == "random-eagle3":  # drafts over the vocabulary asked for (draft_vocab N > 0), else all
                from ..models.draft_vocab import draft_vocab_for

                vocab = draft_vocab_for(target, draft_vocab) if draft_vocab > 0 else None
                return Eagle3Head(target.model, draft_vocab=vocab).eval(), f"random-eagle3:{seed}"
            return EagleHead(target.model).eval(), f"random:{seed}"
    found = None if head else find_head_dir(target.name, method)
    if not head and found is None:
        raise SelfspecError(
            f"no trained {method} head for model '{target.name}': train one with `selfspec train hass --model "
            f"{target.name} --objective {'hass' if method == 'hass' else 'eagle'} --out DIR` (SmolLM2's shipped "
            f"head: `bash {HEAD_RECIPES[method]}`) and pass head=DIR (--head DIR)")
    path = head or str(found)
    if head and not Path(head).exists():  # a file: load_head says so
        raise SelfspecError(f"head directory {head} does not exist; pass a directory written by "
                            "`selfspec train hass`, or an EAGLE checkpoint directory (--head DIR)")
    loaded, _ = load_draft_head(path, target.model)
    return loaded, path


def draft_lm_head(target, head: EagleHead | Eagle3Head, size: int) -> DraftLMHead:
    """The head's draft LM head: ``size`` -1 = the head's stored draft vocabulary (the full one
    where it has none), 0 = the full vocabulary, N = the model's top-N ranking. An EAGLE-3 head
    drafts with its own norm and LM head over the vocabulary it was trained with, so ``size``
    must be -1 or name that same vocabulary."""
    from ..models.draft_vocab import draft_vocab_for

    if isinstance(head, Eagle3Head):
        if size != -1:
            want = draft_vocab_for(target, size)
            have = head.draft_vocab
            if (want is None) != (have is None) or (want is not None and have is not None
                                                    and not torch.equal(want.ids, have.ids)):
                n = head.lm_head.out_features
                raise SelfspecError(f"an EAGLE-3 head drafts with its own LM head over the vocabulary it was trained "
                                    f"with ({n} tokens); drop draft_vocab (--draft-vocab) or pass -1")
        return HeadLMHead(head, target.backend)
    vocab = head.draft_vocab if size == -1 else draft_vocab_for(target, size)
    return DraftLMHead(target.model.get_output_embeddings(), vocab, target.backend)
