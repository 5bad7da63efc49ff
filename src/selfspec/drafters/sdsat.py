"""``sdsat``: the model drafts k tokens at once from k appended semantic adaptive tokens.

The paper's two-step loop (SDSAT section 2.1; spec ``sdsat_space.md`` 1.2-1.4) on the one decode
loop, alternating two kinds of step:

1. *Draft step* (F1): the tree is the pending token t alone, and k adaptive tokens ride along as
   piggyback tokens (positions after t, plain causal mask; their KV is never committed). The
   target's output at t gives the next token exactly (the loop's bonus token); the outputs at the
   adaptive tokens are the k drafts.
2. *Verify step* (F2): the drafts, rooted at the token F1 committed, are verified like any tree.
   Greedy: a chain of the k argmax drafts (each loop emits 2..k+2 tokens in 2 forwards, identical
   to ``ar``). Sampling: the paper's fixed tree (children of every parent at depth d are the first
   n tokens of one ordered sample without replacement of ``candidates`` tokens from the warped
   draft distribution at adaptive position d), verified by the shared lossless recursive
   rejection rule with ``q`` = that distribution with the earlier siblings removed.

``sdsat-lossy`` keeps the paper's own sample-and-match verifier instead (each root-to-leaf path
draws its own samples from temperature + top-p without top-k, the longest matching path wins, the
next token is resampled): **not lossless**, kept to reproduce the paper and as the negative
control of the distribution tests.

k (greedy) comes from the measured verify-cost profile and the acceptance by position seen so
far: the k that maximises expected tokens per second of a loop, ``(2 + sum_j prod_{i<=j} a_i) /
(2 T(k+1))``; when no k beats plain decoding (1 / T(1)) the loop runs plain steps with probes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.acceptance import Verdict
from ..core.cost import CostProfile
from ..core.sampling import Warper, sample
from ..core.tree import DraftTree
from ..decoding.protocol import Budget, DrafterBase, Piggyback, Proposal, Sizer
from ..decoding.state import DecodeState, VerifyOutput
from ..errors import SelfspecError
from .budget import PositionalAcceptance
from .spec import IF_FINE_TUNED, BuildContext, MethodSpec, check_numbers, finetuned_ids, need, option

PAPER_TREE = "4;3,2,2,1;3,2,2,1;3,2;3"  # children per parent by depth: the paper's depth-5 tree (28 nodes)


@dataclass(frozen=True)
class SdsatConfig:
    """Options of ``sdsat`` / ``sdsat-lossy`` (each field's help is in its metadata)."""

    k: int = option(0, "adaptive tokens per draft step, fixed (sampling: the tree cut to depth k); 0 = chosen each "
                       "loop from the verify-cost profile and the measured acceptance (greedy: at most max_k; "
                       "sampling: the whole tree or a plain step)", flag="--k")
    max_k: int = option(8, "largest k considered when k is 0")
    tree: str = option(PAPER_TREE, "sampling tree: children per parent at each depth, ';' between depths and ',' "
                                   "between the parents of a depth (in node order; missing parents get none); "
                                   "default: the paper's depth-5 tree; '' = a chain of one sample per adaptive "
                                   "token", flag="--sdsat-tree")
    candidates: int = option(10, "size of the ordered sample per adaptive position (the paper's top_k 10)")
    adaptive_ids: str = option("", "the adaptive token id(s), comma-separated; empty = read from the model "
                                   "directory's selfspec_finetune.json (written by selfspec train sdsat)",
                               flag="--adaptive-ids")

    def __post_init__(self) -> None:
        object.__setattr__(self, "tree", str(self.tree))  # bench entries: sdsat:tree=4 arrives as a number
        object.__setattr__(self, "adaptive_ids", str(self.adaptive_ids))
        check_numbers(self, "sdsat")
        need(self, "sdsat", "k", self.k >= 0, ">= 0")
        need(self, "sdsat", "max_k", self.max_k >= 1, ">= 1")
        need(self, "sdsat", "candidates", self.candidates >= 1, ">= 1")
        parse_tree(self.tree)
        parse_ids(self.adaptive_ids)


def parse_ids(text: str) -> list[int]:
    """``"49152"`` or ``"5,6"`` (or ``"5+6"``) -> adaptive token ids; ``""`` -> ``[]``."""
    try:
        return [int(x) for x in text.replace("+", ",").split(",") if x.strip()]
    except ValueError as e:
        raise SelfspecError(f"sdsat adaptive_ids {text!r}: use integer ids like 49152 or 5,6 (--adaptive-ids)") from e


def parse_tree(spec: str) -> list[list[int]]:
    """``"4;3,2,2,1;..."`` -> children counts per depth (``[[4], [3, 2, 2, 1], ...]``)."""
    try:
        levels = [[int(x) for x in part.split(",")] for part in spec.split(";") if part.strip()]
    except ValueError as e:
        raise SelfspecError(f"sdsat tree {spec!r}: use counts like 4;3,2,2,1;3,2 (';' between depths)") from e
    if any(c < 0 for lv in levels for c in lv) or (levels and len(levels[0]) != 1):
        raise SelfspecError(f"sdsat tree {spec!r}: the first depth has one parent (the root); counts are >= 0")
    return levels


def tree_shape(levels: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
    """Parents, depths and sibling ranks of the tree nodes (node 0 = root).

    The children of the j-th node of depth d - 1 get ranks 0..n_j - 1: node of rank r carries the
    r-th token of depth d's ordered sample. Node order is by depth, then parent, then rank.
    """
    parents, depths, ranks = [-1], [0], [0]
    frontier = [0]
    for d, counts in enumerate(levels, start=1):
        nxt = []
        for j, parent in enumerate(frontier):
            for r in range(counts[j] if j < len(counts) else 0):
                parents.append(parent)
                depths.append(d)
                ranks.append(r)
                nxt.append(len(parents) - 1)
        frontier = nxt
        if not frontier:
            break
    return parents, depths, ranks


def ordered_sample(q: torch.Tensor, n: int, generator: torch.Generator | None) -> list[int]:
    """An ordered sample without replacement of at most ``n`` tokens from ``q`` (``[V]``), by
    Gumbel-top-k; tokens of probability 0 are never drawn (fewer returned if needed)."""
    support = int((q > 0).sum())
    n = min(n, support)
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=torch.float64).clamp_min(1e-300)
    keys = q.double().log() - (-u.log()).log()
    return torch.topk(keys, n).indices.tolist()


def without(q: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """``q`` with ``tokens`` removed and renormalised (the distribution of the next draw of a
    sample without replacement)."""
    r = q.clone()
    if tokens:
        r[tokens] = 0
    s = r.sum()
    return r / s if s > 0 else r


def sample_and_match(tree: DraftTree, target_logits: torch.Tensor, warper: Warper,
                     generator: torch.Generator | None) -> Verdict:
    """The paper's nucleus verifier (``sdsat-lossy``; NOT lossless, see the module docstring).

    Every root-to-leaf path draws its own token at each of its nodes' parents from temperature +
    top-p (no top-k); a node is accepted while the draw equals it; the longest run wins (the first
    path on ties); the next token is sampled afresh at the last accepted node.
    """
    verify = Warper(warper.temperature, 0, warper.top_p)
    probs = verify.probs(target_logits)
    tokens = tree.token_list
    best: list[int] = [0]
    for path in tree.paths:
        run = [0]
        for node in path[1:]:
            if sample(probs[run[-1]], generator) != tokens[node]:
                break
            run.append(node)
        if len(run) > len(best):
            best = run
    return Verdict(best, sample(warper.probs(target_logits[best[-1]]), generator))


class SdsatDrafter(DrafterBase):
    """Alternates draft steps (adaptive tokens as piggyback) and verify steps (module docstring).

    Args:
        name: ``sdsat`` or ``sdsat-lossy``.
        lossless: the lossless rule when sampling (``sdsat``), else the paper's sample-and-match
            verifier (``sdsat-lossy``); from the method's spec.
        adaptive_ids: one id, or distinct ids (the j-th adaptive token uses ``ids[min(j, n) - 1]``).
        cfg: options.
        profile: the target's verify-cost profile (None: fixed k).
        prior: expected acceptance by draft position (the fine-tune's validation accuracy).
    """

    needs_hidden = False
    request_state = ("sizer", "k")  # what adapts across requests (LearnedState.snapshot / restore)
    sizer: Sizer | None  # the Drafter protocol's member, set in __init__

    def __init__(self, name: str, lossless: bool, adaptive_ids: list[int], cfg: SdsatConfig,
                 profile: CostProfile | None, prior: list[float] | None = None) -> None:
        self.name = name
        self.lossless = lossless
        self.ids = adaptive_ids
        self.cfg = cfg
        self.levels = parse_tree(cfg.tree)
        self.shape = tree_shape(self.levels)
        self.sizer = PositionalAcceptance(profile if cfg.k == 0 else None, cfg.k or cfg.max_k, prior)
        self.drafts: torch.Tensor | None = None  # [k, V] piggyback logits of the last draft step
        self.k = 0

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        self.drafts = None

    def _deterministic(self, state: DecodeState) -> bool:
        """Draft argmax tokens (greedy, or coupled sampling); ``sdsat-lossy`` samples its drafts
        whenever it samples, for the paper's sample-and-match rule."""
        return state.warper.greedy or (self.lossless and state.deterministic)

    def _adaptive(self, k: int) -> torch.Tensor:
        return torch.tensor([self.ids[min(j, len(self.ids)) - 1] for j in range(1, k + 1)], dtype=torch.long)

    def propose(self, state: DecodeState, budget: Budget[PositionalAcceptance, None] | None) -> Proposal:
        if self.drafts is not None:
            tree = self._verify_tree(state, self.drafts)
            self.drafts = None
            return Proposal(tree, accept_rule=None if self.lossless or state.warper.greedy else sample_and_match)
        assert budget is not None  # the controller's: this drafter has a sizer
        room = state.draft_room - 1  # the draft step itself commits one token first
        if room <= 0:
            self.k = 0
        elif self._deterministic(state) or not self.levels:
            self.k = budget.sizer.choose(room)
        else:  # the fixed sampling tree (cut to depth k when k is fixed): draft its depth, or not at all
            depth = min(len(self.levels), self.cfg.k or len(self.levels))
            self.k = depth if budget.sizer.choose(room, (depth, len(self.shape[0]))) else 0
        root = DraftTree.chain([state.pending])
        if self.k == 0:
            return Proposal(root)
        base = len(state.ids) - 1  # cache length: the pending token sits at position base
        positions = torch.arange(1, self.k + 1, dtype=torch.long) + base
        mask = torch.tril(torch.ones(self.k, self.k + 1, dtype=torch.bool), diagonal=1)
        return Proposal(root, Piggyback(self._adaptive(self.k), positions, mask))

    def _verify_tree(self, state: DecodeState, logits: torch.Tensor) -> DraftTree:
        """The verify step's tree rooted at the pending token (``logits``: ``[k, V]``)."""
        if self._deterministic(state):  # greedy, or coupled: the same Gumbel noise as the target's
            scores = state.scores(logits, [state.draft_index(j + 1) for j in range(logits.shape[0])])
            return DraftTree.chain([state.pending] + scores.argmax(-1).tolist())
        q = state.warper.probs(logits)
        if not self.levels:
            toks = [sample(q[j], state.generator) for j in range(q.shape[0])]
            return DraftTree.chain([state.pending] + toks, torch.cat([q[:1] * 0, q]))
        parents, depths, ranks = self.shape
        deepest = min(len(self.levels), q.shape[0])
        need = [0] * (deepest + 1)
        for d, r in zip(depths, ranks):
            if d <= deepest:
                need[d] = max(need[d], r + 1)
        picks: list[list[int]] = [[]] + [ordered_sample(q[d - 1], max(need[d], self.cfg.candidates), state.generator)
                        for d in range(1, len(need))]
        keep = [0]
        tokens = [state.pending]
        rows = [torch.zeros_like(q[0])]
        for i in range(1, len(parents)):
            d, r = depths[i], ranks[i]
            if d > deepest or r >= len(picks[d]) or parents[i] not in keep:  # cut, or support < tree
                continue
            keep.append(i)
            tokens.append(picks[d][r])
            rows.append(without(q[d - 1], picks[d][:r]))
        remap = {old: new for new, old in enumerate(keep)}
        par = [-1] + [remap[parents[i]] for i in keep[1:]]
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(par, dtype=torch.long),
                         torch.stack(rows))

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        if proposal.piggyback is not None:  # a draft step: its adaptive tokens' logits are next step's drafts
            assert out.piggyback_logits is not None  # the loop's, for a proposal with piggyback tokens
            self.drafts = out.piggyback_logits.float()


def build(spec: MethodSpec, target, cfg: SdsatConfig, ctx: BuildContext) -> SdsatDrafter:
    ids, meta = finetuned_ids(target, "sdsat", parse_ids(cfg.adaptive_ids), "adaptive token", "adaptive_ids")
    val = (meta or {}).get("validation", {})
    prior = [val[f"acc{j}"] for j in range(2, (cfg.k or cfg.max_k) + 2) if f"acc{j}" in val]
    profile = target.cost_profile(measure=ctx.measure) if cfg.k == 0 else None
    return SdsatDrafter(spec.name, spec.lossless, ids, cfg, profile, prior)


SDSAT = MethodSpec("sdsat", SdsatConfig, build, True,
                   "SDSAT: a fine-tuned model drafts k tokens from k appended adaptive tokens, then verifies them "
                   "(two-step loop; sampling: the paper's tree with lossless acceptance)", auto=IF_FINE_TUNED)
SDSAT_LOSSY = MethodSpec("sdsat-lossy", SdsatConfig, build, False,
                         "NOT LOSSLESS when sampling: SDSAT with the paper's sample-and-match verifier (greedy is "
                         "still exact); for reproducing the paper")

