"""``scripted``: an oracle drafter for tests and benchmarks of the engine itself.

It knows the reference continuation (e.g. the greedy output of ``ar``) and proposes drafts that
are right for exactly ``correct`` tokens, then wrong. ``correct >= k`` gives drafts that are all
accepted, ``correct = 0`` drafts that are all rejected. With ``tree=True`` every depth gets a
wrong sibling *before* the right child, so the accepted path is never a prefix of the verified
block and the KV copy-down path is exercised.

With ``accept_prob = p`` each drafted token is instead right with probability ``p``, independently,
(drawn from the drafter's own seeded ``random.Random``): a drafter of known acceptance for
measuring how much of the cost model's ideal speedup the loop keeps (``scripts/gpu_check.py``).
"""

from __future__ import annotations

import random

import torch

from ..core.acceptance import Verdict
from ..core.tree import DraftTree
from ..decoding.protocol import DrafterBase, Proposal
from ..decoding.state import DecodeState, VerifyOutput


class ScriptedDrafter(DrafterBase):
    name = "scripted"
    lossless = True
    needs_hidden = False
    request_state = ()  # what adapts across requests (LearnedState.snapshot / restore)
    sizer = None  # fixed drafts: nothing sizes them

    def __init__(self, script: list[int], k: int, correct: int, vocab_size: int, tree: bool = False,
                 accept_prob: float | None = None, seed: int = 0) -> None:
        """
        Args:
            script: the reference generated ids (what greedy decoding produces).
            k: draft depth.
            correct: how many leading drafts are right each step.
            vocab_size: used to make wrong tokens.
            tree: propose a tree with a wrong sibling before each right child.
            accept_prob: if set, ``correct`` is ignored and each step's number of leading right
                drafts is random: each token right with this probability (a geometric count, at most k).
            seed: seed of the draws of ``accept_prob``.
        """
        if accept_prob is not None and not 0.0 <= accept_prob <= 1.0:
            raise ValueError(f"accept_prob must lie in [0, 1], not {accept_prob}")
        self.script = script
        self.k = k
        self.correct = correct
        self.vocab = vocab_size
        self.tree = tree
        self.accept_prob = accept_prob
        self.rng = random.Random(seed)

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        pass

    def _wrong(self, t: int) -> int:
        return (t + 1) % self.vocab

    def _correct_now(self, k: int) -> int:
        """How many leading drafts are right at this step (``correct``, or a geometric draw)."""
        if self.accept_prob is None:
            return self.correct
        n = 0
        while n < k and self.rng.random() < self.accept_prob:
            n += 1
        return n

    def propose(self, state: DecodeState, budget: None = None) -> Proposal:
        n = len(state.generated)
        k = min(self.k, state.draft_room)
        truth = self.script[n : n + k]
        truth += [0] * (k - len(truth))
        correct = self._correct_now(k)
        draft = [t if i < correct else self._wrong(t) for i, t in enumerate(truth)]
        if not self.tree:
            return Proposal(DraftTree.chain([state.pending, *draft]))
        tokens, parents = [state.pending], [-1]
        node = 0
        for t in draft:
            tokens += [self._wrong(t) if self._wrong(t) != t else (t + 2) % self.vocab, t]
            parents += [node, node]
            node = len(tokens) - 1
        return Proposal(DraftTree(torch.tensor(tokens), torch.tensor(parents)))

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        pass
