"""``jacobi``: Jacobi decoding as used with MSN (single chain, ``docs/methods/msn.md``).

The model refines its own guesses: each step verifies ``[pending, d_1..d_m]`` in one forward,
accepts the longest prefix equal to the model's own greedy predictions (plus the bonus token),
and the next guesses are the predictions past the accepted point (the Jacobi update), free slots
refilled with ahead noise. No draft model and no training is needed; an MSN fine-tune (``selfspec
train msn``) teaches the model to denoise such guesses, which is what makes them accepted.

Lossless: guesses are deterministic tokens (one-hot ``q``), verified by the shared rule; greedy ids
equal ``ar``'s. The paper defines the method for greedy decoding only; with sampling the same
guesses are verified by lossless rejection sampling (one-hot ``q``) - correct, but the guesses are
the model's argmax, so acceptance is lower than greedy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.acceptance import Verdict
from ..core.ahead_noise import ahead_noise
from ..core.tree import DraftTree
from ..decoding.protocol import Budget, DrafterBase, Proposal, Sizer
from ..decoding.state import DecodeState, VerifyOutput
from .budget import ChainBudget, ChainDraft
from .spec import ALWAYS, BuildContext, MethodSpec, chain_budget, check_numbers, need, option


@dataclass(frozen=True)
class JacobiConfig:
    """Options of ``jacobi`` (each field's help is in its metadata)."""

    m: int = option(4, "guesses kept and refined per step (the paper: 4); every one is verified when auto_m is off "
                       "(--fixed-k)", flag="--k")
    auto_m: bool = option(True, "verify only as many guesses as the measured cost profile and acceptance pay for "
                                "(the rest are kept and refined anyway)", flag="--fixed-k", value=False)
    seed: int = option(0, "seed of the ahead-noise generator (drafts only; outputs never depend on it)")

    def __post_init__(self) -> None:
        check_numbers(self, "jacobi")
        need(self, "jacobi", "m", self.m >= 1, ">= 1")


class JacobiDrafter(DrafterBase):
    """Guesses ``d_1..d_m`` refined by the model's own predictions each step."""

    name = "jacobi"
    lossless = True
    needs_hidden = False
    request_state = ("sizer",)  # what adapts across requests (LearnedState.snapshot / restore)
    sizer: Sizer | None  # the Drafter protocol's member, set in __init__

    def __init__(self, cfg: JacobiConfig, sizer: ChainBudget) -> None:
        self.cfg = cfg
        self.sizer = sizer  # how many guesses are verified; fed by the controller
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.guesses: list[int] = []

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        self.generator.manual_seed(self.cfg.seed)
        self.guesses = []

    def propose(self, state: DecodeState, budget: Budget[ChainBudget, ChainDraft] | None) -> Proposal:
        assert budget is not None  # the controller's: this drafter has a sizer
        self.guesses += ahead_noise(state.ids, self.cfg.m - len(self.guesses), self.generator)
        k = budget.sizer.choose(state.draft_room)
        return Proposal(DraftTree.chain([state.pending, *self.guesses[:k]]))

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        """Next guesses: the predictions made at the inputs after the accepted ones (``o[a+1..k]``:
        ``o[a]`` became the pending token; ``o[k]`` is the newer guess for the slot of ``d_{k+1}``),
        then the guesses that were not verified, shifted likewise; ``propose`` refills with noise."""
        k = proposal.tree.size - 1
        a = verdict.num_accepted
        shifted: list[int] = []
        if k > a:
            logits = out.tree_logits[a + 1 : k + 1]
            if state.deterministic and not state.warper.greedy:  # coupled: the noised argmax
                logits = state.scores(logits, [state.draft_index(d + 1) for d in range(k - a)])
            shifted = logits.argmax(-1).tolist()
        self.guesses = (shifted + self.guesses[k + 1 :])[: self.cfg.m]


def build(spec: MethodSpec, target, cfg: JacobiConfig, ctx: BuildContext) -> JacobiDrafter:
    return JacobiDrafter(cfg, chain_budget(target, cfg.auto_m, cfg.m, ctx.measure))


SPEC = MethodSpec("jacobi", JacobiConfig, build, True,
                  "Jacobi decoding: the model refines m guesses in parallel (ahead noise in free slots); best on an "
                  "MSN fine-tune", auto=ALWAYS)
