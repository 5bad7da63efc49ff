"""``pld``: prompt lookup decoding (Saxena 2023). Drafts by copying what followed the most
recent earlier occurrence of the text's last n-gram. No model, so drafting is nearly free; the
drafts are deterministic (one-hot q), which keeps speculative sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.acceptance import Verdict
from ..core.tree import DraftTree
from ..decoding.state import DecodeState, VerifyOutput
from .base import Proposal
from .budget import ChainBudget


@dataclass(frozen=True)
class PromptLookupConfig:
    """Options of ``pld``.

    Attributes:
        max_ngram: longest suffix n-gram to match.
        min_ngram: shortest suffix n-gram to match.
        k: fixed draft length, or the largest considered when ``auto_k``.
        auto_k: size drafts from the measured cost profile and acceptance.
    """

    max_ngram: int = 3
    min_ngram: int = 1
    k: int = 10
    auto_k: bool = True


def lookup(ids: list[int], max_ngram: int, min_ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest suffix n-gram.

    Args:
        ids: the whole text so far (prompt + generated), pending token last.
    """
    n_ids = len(ids)
    for n in range(min(max_ngram, n_ids - 1), min_ngram - 1, -1):
        suffix = ids[n_ids - n :]
        first = suffix[0]
        # scan right to left for the most recent match that is followed by at least one token
        for start in range(n_ids - n - 1, -1, -1):
            if ids[start] == first and ids[start : start + n] == suffix:
                cont = ids[start + n : start + n + k]
                if cont:
                    return cont
    return []


class PromptLookupDrafter:
    name = "pld"
    lossless = True
    needs_hidden = False

    def __init__(self, cfg: PromptLookupConfig, budget: ChainBudget) -> None:
        self.cfg = cfg
        self.budget = budget

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        pass

    def propose(self, state: DecodeState) -> Proposal:
        k = self.budget.choose(state.draft_room)
        draft = lookup(state.ids, self.cfg.max_ngram, self.cfg.min_ngram, k) if k > 0 else []
        return Proposal(DraftTree.chain([state.pending, *draft]))

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        self.budget.update(proposal.tree.size - 1, verdict.num_accepted)
