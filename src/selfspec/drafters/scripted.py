"""``scripted``: an oracle drafter for tests and benchmarks of the engine itself.

It knows the reference continuation (e.g. the greedy output of ``ar``) and proposes drafts that
are right for exactly ``correct`` tokens, then wrong. ``correct >= k`` gives drafts that are all
accepted, ``correct = 0`` drafts that are all rejected. With ``tree=True`` every depth gets a
wrong sibling *before* the right child, so the accepted path is never a prefix of the verified
block and the KV copy-down path is exercised.
"""

from __future__ import annotations

import torch

from ..core.acceptance import Verdict
from ..core.tree import DraftTree
from ..decoding.protocol import Proposal
from ..decoding.state import DecodeState, VerifyOutput


class ScriptedDrafter:
    name = "scripted"
    lossless = True
    needs_hidden = False

    def __init__(self, script: list[int], k: int, correct: int, vocab_size: int, tree: bool = False) -> None:
        """
        Args:
            script: the reference generated ids (what greedy decoding produces).
            k: draft depth.
            correct: how many leading drafts are right each step.
            vocab_size: used to make wrong tokens.
            tree: propose a tree with a wrong sibling before each right child.
        """
        self.script = script
        self.k = k
        self.correct = correct
        self.vocab = vocab_size
        self.tree = tree

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        pass

    def _wrong(self, t: int) -> int:
        return (t + 1) % self.vocab

    def propose(self, state: DecodeState) -> Proposal:
        n = len(state.generated)
        k = min(self.k, state.draft_room)
        truth = self.script[n : n + k]
        truth += [0] * (k - len(truth))
        draft = [t if i < self.correct else self._wrong(t) for i, t in enumerate(truth)]
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
