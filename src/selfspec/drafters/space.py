"""``space``: SPACE's auto-correct decoding - draft and verify in the same forward.

SPACE (paper section 3.2, Alg. 1; spec ``sdsat_space.md`` 2.2-2.3) fine-tunes the model so that
k ``[MASK]`` tokens appended after a text predict its next k + 1 .. 2 tokens. Each step is one
forward over the pending token, the k candidates of the previous step, and k + 1 groups of k
masks, group g anchored after candidate g (layout: :func:`selfspec.core.mask_groups.mask_groups`,
shared with the trainer). On the one decode loop the candidates are the draft tree (a chain) and
the mask groups ride along as piggyback tokens (their KV is never committed; accepted candidates'
KV is committed by the loop as for any draft). The candidates are verified left to right; the
next candidates are read from the group after the last accepted token.

* Greedy: candidates are the argmax of each mask; the shared greedy rule makes the ids exactly
  ``ar``'s.
* Sampling (``space``): each candidate is sampled from its mask's warped distribution p_i, kept
  whole, and verified by the shared lossless rule (accept with min(1, Q/p), on rejection sample
  from norm(max(0, Q - p_i))).
* ``space-lossy``: the paper's Alg. 1 / official code - after a rejection the next token is
  sampled from Q instead of the residual. **Not lossless** (the output is a mixture of Q and
  norm(min(p, Q))); kept to reproduce the paper and as the distribution tests' negative control.

k (masks per group, hence candidates per step) comes from the verify-cost profile when
``k = 0``: a step over k candidates costs T(1 + k + (k + 1) k) and yields 1 + sum_j prod_{i<=j}
a_i tokens; when no k beats a plain step the loop runs plain steps, probing now and then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.acceptance import Verdict
from ..core.cost import CostProfile
from ..core.mask_groups import mask_groups
from ..core.sampling import Warper, sample
from ..core.tree import DraftTree
from ..decoding.protocol import Budget, DrafterBase, Piggyback, Proposal, Sizer
from ..decoding.state import DecodeState, VerifyOutput
from .budget import PositionalAcceptance
from .estimators import PLAIN_RATE
from .spec import IF_FINE_TUNED, BuildContext, MethodSpec, check_numbers, finetuned_ids, need, option


@dataclass(frozen=True)
class SpaceConfig:
    """Options of ``space`` / ``space-lossy`` (each field's help is in its metadata)."""

    k: int = option(0, "masks per group (= candidates per step), fixed; 0 = chosen each step from the verify-cost "
                       "profile and the measured acceptance, at most max_k (paper: 5)", flag="--k")
    max_k: int = option(6, "largest k considered when k is 0")
    mask_id: int = option(-1, "the [MASK] token id; -1 = read from the model directory's selfspec_finetune.json "
                              "(written by selfspec train space)", flag="--mask-id")

    def __post_init__(self) -> None:
        check_numbers(self, "space")
        need(self, "space", "k", self.k >= 0, ">= 0")
        need(self, "space", "max_k", self.max_k >= 1, ">= 1")
        need(self, "space", "mask_id", self.mask_id >= -1, ">= 0, or -1 (from the model)")


def step_tokens(k: int, candidates: int | None = None) -> int:
    """Tokens in one forward: the pending token, ``candidates`` (default k) candidates and
    ``candidates + 1`` groups of ``k`` masks (36 for the paper's k = 5)."""
    c = k if candidates is None else candidates
    return 1 + c + (c + 1) * k


class SpaceAcceptance(PositionalAcceptance):
    """Acceptance by candidate position; values a step of k candidates at
    ``(1 + sum_j prod_{i<=j} a_i) / T(step_tokens(k))`` (a plain step is 1 / T(1))."""

    first_tokens = 1.0  # one forward: the verify step's bonus token

    def cost(self, k: int, verify_tokens: int | None = None) -> float:
        """T(``verify_tokens``) (default the whole masked forward, ``step_tokens(k)``) / T(1)."""
        assert self.profile is not None  # priced only with a profile (value and choose check)
        return self.profile.shared(verify_tokens or step_tokens(k), self.width)


def accept_paper(tree: DraftTree, target_logits: torch.Tensor, warper: Warper,
                 generator: torch.Generator | None) -> Verdict:
    """The paper's acceptance (``space-lossy``; NOT lossless): candidate i is accepted with
    probability min(1, Q(c_i) / p_i(c_i)); the next token is then sampled from Q at the last
    accepted node - after a rejection too, where the residual would be exact."""
    tokens = tree.token_list
    path = [0]
    for node in range(1, tree.size):  # a chain: node i is candidate i
        q = warper.probs(target_logits[node - 1])
        assert tree.draft_probs is not None  # sampled candidates carry their draft distributions
        px = float(tree.draft_probs[node, tokens[node]])
        u = float(torch.rand((), generator=generator, device=q.device))
        if not (px > 0 and u * px < float(q[tokens[node]])):
            break
        path.append(node)
    return Verdict(path, sample(warper.probs(target_logits[path[-1]]), generator))


class SpaceDrafter(DrafterBase):
    """Candidates from the previous step's mask group, verified while the next groups are read.

    Args:
        name: ``space`` or ``space-lossy``.
        lossless: the residual rule after a rejection (``space``), else the paper's rule
            (``space-lossy``); from the method's spec.
        mask_id: the ``[MASK]`` token.
        cfg: options.
        profile: the target's verify-cost profile (None: fixed k).
        prior: expected acceptance by candidate position (the fine-tune's validation accuracy).
    """

    needs_hidden = False
    request_state = ("sizer",)  # what adapts across requests (LearnedState.snapshot / restore)
    sizer: Sizer | None  # the Drafter protocol's member, set in __init__

    def __init__(self, name: str, lossless: bool, mask_id: int, cfg: SpaceConfig, profile: CostProfile | None,
                 prior: list[float] | None = None) -> None:
        self.name = name
        self.lossless = lossless
        self.mask_id = mask_id
        self.cfg = cfg
        self.sizer = SpaceAcceptance(profile if cfg.k == 0 else None, cfg.k or cfg.max_k, prior)
        self.cands: list[int] = []  # candidates for the next step
        self.probs: torch.Tensor | None = None  # [len(cands), V] their warped draft distributions

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        self.cands, self.probs = [], None

    def propose(self, state: DecodeState, budget: Budget[SpaceAcceptance, None] | None) -> Proposal:
        assert budget is not None  # the controller's: this drafter has a sizer
        room = state.draft_room
        c = min(len(self.cands), room)
        sizer = budget.sizer
        k = sizer.choose(max(1, room - 1)) if room > 1 else 0  # masks for the next step
        if k == 0 and c and sizer.profile is not None and sizer.value(c, c + 1) <= PLAIN_RATE:
            c = 0  # verifying the candidates alone does not pay either
        toks = [state.pending] + self.cands[:c]
        probs = None
        if c and self.probs is not None:
            probs = torch.cat([torch.zeros_like(self.probs[:1]), self.probs[:c]])
        tree = DraftTree.chain(toks, probs)
        rule = None if self.lossless or state.warper.greedy else accept_paper
        if k == 0:
            return Proposal(tree, accept_rule=rule)
        block, rel = mask_groups(c + 1, list(range(c + 1)), k)
        base = len(state.ids) - 1  # cache length: the pending token sits at position base
        pig = Piggyback(torch.full((rel.numel(),), self.mask_id, dtype=torch.long), rel + base, block[c + 1 :])
        return Proposal(tree, pig, rule)

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        self.cands, self.probs = [], None
        if proposal.piggyback is None:
            return
        k = proposal.piggyback.tokens.numel() // proposal.tree.size
        g = verdict.num_accepted  # the group anchored after the last accepted token
        assert out.piggyback_logits is not None  # the loop's, for a proposal with piggyback tokens
        logits = out.piggyback_logits[g * k : (g + 1) * k].float()
        if state.warper.greedy or (self.lossless and state.deterministic):  # coupled: the target's noise
            self.cands = state.scores(logits, [state.draft_index(j + 1) for j in range(k)]).argmax(-1).tolist()
            return
        self.probs = state.warper.probs(logits)
        self.cands = [sample(self.probs[j], state.generator) for j in range(k)]


def build(spec: MethodSpec, target, cfg: SpaceConfig, ctx: BuildContext) -> SpaceDrafter:
    ids, meta = finetuned_ids(target, "space", [cfg.mask_id] if cfg.mask_id >= 0 else [], "mask token", "mask_id")
    val = (meta or {}).get("validation", {})
    prior = [val[f"acc{j}"] for j in range(2, (cfg.k or cfg.max_k) + 2) if f"acc{j}" in val]
    extra = tuple(step_tokens(k) for k in range(2, cfg.max_k + 1))  # masked forwards: up to 1 + k(k + 2)
    profile = target.cost_profile(extra_qs=extra, measure=ctx.measure) if cfg.k == 0 else None
    return SpaceDrafter(spec.name, spec.lossless, ids[0], cfg, profile, prior)


SPACE = MethodSpec("space", SpaceConfig, build, True,
                   "SPACE: a fine-tuned model drafts k tokens from k [MASK] tokens and verifies the last step's "
                   "drafts in the same forward (sampling: lossless residual rule)", auto=IF_FINE_TUNED)
SPACE_LOSSY = MethodSpec("space-lossy", SpaceConfig, build, False,
                         "NOT LOSSLESS when sampling: SPACE with the paper's rule (next token from the target after "
                         "a rejection, not the residual; greedy is still exact); for reproducing the paper")
