"""The drafter that proposes nothing (``ar``), and the snapshot of what a drafter learns across
requests.

The drafter interface itself (:class:`~selfspec.decoding.protocol.Drafter`,
:class:`~selfspec.decoding.protocol.Proposal`, :class:`~selfspec.decoding.protocol.Piggyback`)
lives in :mod:`selfspec.decoding.protocol`, beside the loop that calls it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.acceptance import Verdict
from ..core.tree import DraftTree
from ..decoding.protocol import Budget, DrafterBase, Proposal, Sizer
from .spec import ALWAYS, BuildContext, MethodSpec

if TYPE_CHECKING:
    from ..decoding.state import DecodeState, VerifyOutput


@dataclass(frozen=True)
class NoOptions:
    """``ar`` takes no options."""


class NullDrafter(DrafterBase):
    """Proposes nothing: each step verifies only the pending token, i.e. plain decoding."""

    name = "ar"
    lossless = True
    needs_hidden = False
    request_state = ()  # what adapts across requests (LearnedState.snapshot / restore)
    sizer: Sizer | None = None  # it drafts nothing

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        pass

    def propose(self, state: DecodeState, budget: Budget | None = None) -> Proposal:
        return Proposal(DraftTree.chain([state.pending]))

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        pass


def build_ar(spec: MethodSpec, target, cfg: NoOptions, ctx: BuildContext) -> NullDrafter:
    return NullDrafter()


AR = MethodSpec("ar", NoOptions, build_ar, True, "plain autoregressive decoding on the same loop (the baseline)",
               auto=ALWAYS, largest_block=1)
