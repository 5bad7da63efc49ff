"""``pld``: prompt lookup decoding (Saxena 2023). Drafts by copying what followed the most
recent earlier occurrence of the text's last n-gram. No model, so drafting is nearly free; the
drafts are deterministic (one-hot q), which keeps speculative sampling lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.acceptance import Verdict
from ..core.tree import DraftTree
from ..decoding.protocol import Budget, DrafterBase, Proposal, Sizer
from ..decoding.state import DecodeState, VerifyOutput
from .budget import ChainBudget, ChainDraft
from .spec import ALWAYS, BuildContext, MethodSpec, chain_budget, check_numbers, need, option


@dataclass(frozen=True)
class PromptLookupConfig:
    """Options of ``pld`` (each field's help is in its metadata)."""

    max_ngram: int = option(3, "longest suffix n-gram to match")
    min_ngram: int = option(1, "shortest suffix n-gram to match")
    k: int = option(10, "the longest draft; every draft when auto_k is off (--fixed-k)", flag="--k")
    auto_k: bool = option(True, "size each draft from the measured verify-cost profile and acceptance, up to k",
                          flag="--fixed-k", value=False)

    def __post_init__(self) -> None:
        check_numbers(self, "pld")
        need(self, "pld", "min_ngram", self.min_ngram >= 1, ">= 1")
        need(self, "pld", "max_ngram", self.max_ngram >= self.min_ngram, f">= min_ngram ({self.min_ngram})")
        need(self, "pld", "k", self.k >= 1, ">= 1")


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


class PromptLookupDrafter(DrafterBase):
    name = "pld"
    lossless = True
    needs_hidden = False
    request_state = ("sizer",)  # what adapts across requests (LearnedState.snapshot / restore)
    sizer: Sizer | None  # the Drafter protocol's member, set in __init__

    def __init__(self, cfg: PromptLookupConfig, sizer: ChainBudget) -> None:
        self.cfg = cfg
        self.sizer = sizer  # the draft length; fed by the controller

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        pass

    def propose(self, state: DecodeState, budget: Budget[ChainBudget, ChainDraft] | None) -> Proposal:
        assert budget is not None  # the controller's: this drafter has a sizer
        k = budget.sizer.choose(state.draft_room)
        draft = lookup(state.ids, self.cfg.max_ngram, self.cfg.min_ngram, k) if k > 0 else []
        return Proposal(DraftTree.chain([state.pending, *draft]))

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        pass  # copied drafts: nothing to roll back (the controller feeds the sizer)


def build(spec: MethodSpec, target, cfg: PromptLookupConfig, ctx: BuildContext) -> PromptLookupDrafter:
    return PromptLookupDrafter(cfg, chain_budget(target, cfg.auto_k, cfg.k, ctx.measure))


SPEC = MethodSpec("pld", PromptLookupConfig, build, True, "prompt lookup: drafts copied from earlier text",
                  auto=ALWAYS)
