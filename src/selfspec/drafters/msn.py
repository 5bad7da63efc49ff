"""``msn``: TR-Jacobi decoding (tree + retrieval Jacobi), the decoder of MSN (Make Some Noise).

Each step verifies, in one forward with a tree mask, a tree built from a fixed template of
candidate slots: the node at (depth ``d``, rank ``r``) carries the ``r``-th of the top-10 tokens
the model predicted in the previous step ``d`` positions past its accepted point (the Jacobi
update, with alternatives), and a retrieval chain (rank 10) carries what followed the best
earlier match of the text's last trigram (prompt lookup over prompt + generated text). Slots with
nothing to offer (the first step, or past the previous best path) hold ahead noise. The template
is the official one: Medusa's ``mc_sim_7b_63`` plus a 5-node retrieval chain (68 nodes).

Deviations from the official code (``docs/methods/msn.md``):

- Paths are never padded: acceptance walks the verified tree (``core.acceptance``), so it cannot
  run past a leaf. The official code pads paths with the root's index, and a padded slot "matches"
  whenever the model predicts the root token again, over-counting acceptance and committing KV
  rows at the wrong positions (regression test: ``tests/drafters/test_msn.py``).
- Siblings carrying the same token (the template is a Cartesian product, and retrieval often
  repeats a top-k token) are merged into one node, so the verified tree has no duplicates.
- The tree is sized each step from the measured verify-cost profile: template nodes are ranked
  by their measured acceptance (``min`` along the path, so a prefix of the ranking is a tree) and
  the best-paying prefix is verified. ``tree_size=68`` verifies the whole template, as the paper.

Lossless: every draft is a deterministic token (one-hot ``q``); greedy ids equal ``ar``'s. The
paper defines TR-Jacobi for greedy decoding only; with sampling the tree is verified by the
shared lossless rule (recursive rejection with one-hot drafts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..core.acceptance import Verdict
from ..core.ahead_noise import ahead_noise
from ..core.cost import CostProfile
from ..core.tree import DraftTree
from ..decoding.protocol import Budget, DrafterBase, Proposal, Sizer
from ..decoding.state import DecodeState, StepTime, VerifyOutput
from .backoff import ProbeSchedule
from .budget import best_rate, expected_tokens
from .estimators import FIRST_PROBE, MAX_PROBE, RATE_DECAY, DecayedRates
from .spec import ALWAYS, BuildContext, MethodSpec, check_numbers, need, option

TOP_K = 10  # alternatives per depth (ranks 0..9)
RETRIEVAL = TOP_K  # the retrieval column's rank
MAX_DEPTH = 5
# Medusa mc_sim_7b_63 (Spec-Bench model/medusa/medusa_choices.py): rank paths, parents first
MEDUSA_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
    (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
    (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
    (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
    (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)
RETRIEVAL_CHAIN = tuple((RETRIEVAL,) * d for d in range(1, MAX_DEPTH + 1))
TEMPLATE = RETRIEVAL_CHAIN + MEDUSA_63  # 68 nodes, as the official noise_forward.py


@dataclass(frozen=True)
class MsnConfig:
    """Options of ``msn`` (each field's help is in its metadata)."""

    tree_size: int = option(0, "template nodes verified per step (the pending token excluded), the best-ranked "
                               "first; 0 = sized each step from the verify-cost profile and measured acceptance (up "
                               "to max_nodes); 68 = the whole template (the paper)", flag="--k", when="--fixed-k")
    max_nodes: int = option(68, "largest tree considered when tree_size is 0", flag="--k", unless="--fixed-k")
    retrieval: bool = option(True, "include the 5-node retrieval chain (TR-Jacobi); off = TR-Jacobi w/o R")
    ngram: int = option(3, "retrieval matches the last ngram tokens (the code: 3)")
    seed: int = option(0, "seed of the ahead-noise generator (drafts only; outputs never depend on it)")

    def __post_init__(self) -> None:
        check_numbers(self, "msn")
        need(self, "msn", "tree_size", self.tree_size >= 0, ">= 0")
        need(self, "msn", "max_nodes", self.max_nodes >= 1, ">= 1")
        need(self, "msn", "ngram", self.ngram >= 1, ">= 1")


def retrieve(seq: list[int], n: int = 3, m: int = MAX_DEPTH) -> list[int]:
    """Up to ``m`` tokens that followed the best earlier match of ``seq``'s last ``n`` tokens.

    Windows of ``n`` tokens ending before the last ``n`` are scored by how many of their trailing
    tokens equal the suffix's (``n`` = full match); the first (earliest) best window wins, as in
    the official code. No match at all (score 0) gives ``[]`` (the code would copy ``seq[n:]``).
    """
    size = len(seq)
    if size < 2 * n:
        return []
    tail = seq[-n:]
    best, best_start = 0, -1
    for s in range(0, size - 2 * n + 1):
        score = 0
        while score < n and seq[s + n - 1 - score] == tail[n - 1 - score]:
            score += 1
        if score > best:
            best, best_start = score, s
            if score == n:
                break
    return seq[best_start + n : best_start + n + m] if best else []


@dataclass(frozen=True)
class TemplateDraft:
    """A :class:`NodeRates`' record of one proposed tree: the template ``nodes`` verified
    (parents first) and, for each, its node in the tree (siblings with one token share one)."""

    nodes: tuple[int, ...]
    index: tuple[int, ...]


class NodeRates:
    """Acceptance of each template node (its whole path matched, given it was verified), with
    exponential forgetting, and the tree size that pays best under a cost profile: msn's
    :class:`~selfspec.decoding.protocol.Sizer`, fed by the controller.

    Args:
        template: rank paths, parents first.
        profile: the target's verify-cost profile, or None (then ``choose`` returns its cap).
        decay: weight of old observations per verified step.
        first_probe / max_probe: the :class:`~selfspec.drafters.backoff.ProbeSchedule` of small
            probe trees verified while no tree pays, so the estimates can recover.
    """

    def __init__(self, template: tuple[tuple[int, ...], ...], profile: CostProfile | None,
                 decay: float = RATE_DECAY, first_probe: int = FIRST_PROBE, max_probe: int = MAX_PROBE) -> None:
        self.template, self.profile = template, profile
        self.width = 1  # requests verifying in the same packed forward (set by the controller each step)
        self.parent = [template.index(p[:-1]) if len(p) > 1 else -1 for p in template]
        prior = [(0.3 if p[-1] == RETRIEVAL else 0.4 / (1 + p[-1])) * 0.6 ** (len(p) - 1) for p in template]
        self.acceptance = DecayedRates(prior, decay)
        self.probe = ProbeSchedule(first_probe, max_probe)

    def ranking(self, allowed: list[int]) -> tuple[list[int], list[float]]:
        """``allowed`` template nodes (parents first) ordered best first, so that every prefix of
        the order is a tree; with each node's path acceptance ``min`` along its path."""
        value: dict[int, float] = {}
        for i in allowed:
            par = self.parent[i]
            if par != -1 and par not in value:
                continue
            rate = self.acceptance.rate(i)
            value[i] = rate if par == -1 else min(rate, value[par])
        order = sorted(value, key=lambda i: (-value[i], len(self.template[i]), i))
        return order, [value[i] for i in order]

    def choose(self, values: list[float], cap: int) -> int:
        """Nodes to verify: the prefix length of ``values`` with the best expected tokens per
        unit of verify cost (0 = a plain step), at most ``cap``."""
        cap = min(cap, len(values))
        profile = self.profile
        if profile is None or cap == 0:
            return cap
        best_n, rate = best_rate(expected_tokens(values[:cap]), lambda n: profile.shared(n + 1, self.width))
        return self.probe.pick(best_n, rate, min(cap, 4), self.width)  # nothing pays: a small probe tree now and then

    def update(self, verified: Sequence[int], accepted: set[int]) -> None:
        """``verified`` template nodes; ``accepted`` those whose tree node was accepted."""
        for i in verified:
            self.acceptance.observe(i, i in accepted)

    def new_prompt(self) -> None:
        """Nothing restarts with a request (the :class:`~selfspec.decoding.protocol.Sizer` step)."""

    def observe(self, budget: Budget[NodeRates, TemplateDraft], tree: DraftTree, verdict: Verdict,
                step: StepTime) -> None:
        """The :class:`~selfspec.decoding.protocol.Sizer` step: each verified template node's
        acceptance (its tree node on the accepted path), from the drafter's :class:`TemplateDraft`."""
        made = budget.made
        if made is not None and made.nodes:
            accepted = set(verdict.accepted_nodes)
            self.update(made.nodes, {i for i, t in zip(made.nodes, made.index) if t in accepted})


def build_tree(pending: int, nodes: list[int], template, cand: list[list[int]]) -> tuple[DraftTree, list[int]]:
    """The verified tree of one step: template ``nodes`` (every parent listed before its child)
    with their candidate tokens, siblings carrying the same token merged.

    Args:
        cand: ``[MAX_DEPTH][TOP_K + 1]`` token ids (``cand[d - 1][r]`` for depth ``d``, rank ``r``).

    Returns:
        the tree (node 0 = ``pending``) and, for each of ``nodes``, its tree node index.
    """
    tokens, parents = [pending], [-1]
    children: list[dict[int, int]] = [{}]
    where: dict[tuple[int, ...], int] = {(): 0}
    index = []
    for i in nodes:
        path = template[i]
        par = where[path[:-1]]
        tok = cand[len(path) - 1][path[-1]]
        node = children[par].get(tok)
        if node is None:
            node = len(tokens)
            tokens.append(tok)
            parents.append(par)
            children.append({})
            children[par][tok] = node
        where[path] = node
        index.append(node)
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long)), index


class MsnDrafter(DrafterBase):
    """TR-Jacobi: template tree of last step's top-k predictions + retrieval chain."""

    name = "msn"
    lossless = True
    needs_hidden = False
    request_state = ("sizer",)  # what adapts across requests (LearnedState.snapshot / restore)
    sizer: Sizer | None  # the Drafter protocol's member, set in __init__

    def __init__(self, cfg: MsnConfig, profile: CostProfile | None) -> None:
        self.cfg = cfg
        self.template = TEMPLATE if cfg.retrieval else MEDUSA_63
        self.sizer = NodeRates(self.template, profile)  # the tree size; fed by the controller
        self.generator = torch.Generator().manual_seed(cfg.seed)
        self.topk: list[list[int]] = []  # [depth - 1] -> up to TOP_K tokens from the last step

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        self.generator.manual_seed(self.cfg.seed)
        self.topk = []

    def candidates(self, ids: list[int]) -> list[list[int]]:
        """``[MAX_DEPTH][TOP_K + 1]``: last step's top-k by depth, retrieval in the last column,
        ahead noise wherever there is nothing (``ids``: the text so far, pending token last)."""
        found = retrieve(ids, self.cfg.ngram) if self.cfg.retrieval and self.topk else []
        cand = []
        for d in range(MAX_DEPTH):
            row = list(self.topk[d]) if d < len(self.topk) else []
            row += [-1] * (TOP_K - len(row))
            row.append(found[d] if d < len(found) else -1)
            cand.append(row)
        empty = [(d, r) for d in range(MAX_DEPTH) for r in range(TOP_K + 1) if cand[d][r] < 0]
        for (d, r), tok in zip(empty, ahead_noise(ids, len(empty), self.generator)):
            cand[d][r] = tok
        return cand

    def propose(self, state: DecodeState, budget: Budget[NodeRates, TemplateDraft] | None) -> Proposal:
        assert budget is not None  # the controller's: this drafter has a sizer
        room = state.draft_room
        allowed = [i for i, p in enumerate(self.template) if len(p) <= room]
        order, values = budget.sizer.ranking(allowed)
        cap = self.cfg.tree_size or self.cfg.max_nodes
        n = budget.sizer.choose(values, cap) if self.cfg.tree_size == 0 else min(cap, len(order))
        chosen = set(order[:n])
        nodes = [i for i in range(len(self.template)) if i in chosen]  # parents first
        if not nodes:
            return Proposal(DraftTree.chain([state.pending]))
        tree, index = build_tree(state.pending, nodes, self.template, self.candidates(state.ids))
        budget.made = TemplateDraft(tuple(nodes), tuple(index))
        return Proposal(tree)

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        """Next top-k by depth from the nodes past the accepted point on the best path (the last
        accepted node's first child, its first child, ...; never the root or any node twice).
        Which template nodes were accepted is the sizer's to learn (the controller feeds it)."""
        tree = proposal.tree
        rows: list[int] = []
        node = verdict.accepted_nodes[-1]
        children = tree.children
        while children[node] and len(rows) < MAX_DEPTH:
            node = children[node][0]
            rows.append(node)
        k = min(TOP_K, out.tree_logits.shape[-1])
        logits = out.tree_logits[rows]
        if rows and state.deterministic and not state.warper.greedy:  # coupled: rank by the noised logits
            logits = state.scores(logits, [state.draft_index(d + 1) for d in range(len(rows))])
        self.topk = logits.topk(k, dim=-1).indices.tolist() if rows else []


def build(spec: MethodSpec, target, cfg: MsnConfig, ctx: BuildContext) -> MsnDrafter:
    extra = tuple(q for q in (24, 32, 48, len(TEMPLATE) + 1) if q <= cfg.max_nodes + 1)  # the trees it may verify
    profile = target.cost_profile(extra_qs=extra, measure=ctx.measure) if cfg.tree_size == 0 else None
    return MsnDrafter(cfg, profile)


SPEC = MethodSpec("msn", MsnConfig, build, True,
                  "MSN's TR-Jacobi: a tree of last step's top-k predictions plus a prompt-lookup chain, verified in "
                  "one forward; best on an MSN fine-tune (selfspec train msn)", auto=ALWAYS,
                  largest_block=len(TEMPLATE) + 1)  # the whole template and the pending token
