"""``eagle2`` / ``hass``: a trained EAGLE draft head expands an EAGLE-2 dynamic tree.

One drafter, two default heads (EAGLE-trained for ``eagle2``, HASS-trained for ``hass``).

Each step:

1. *Catch-up*: the head encodes the committed positions it has not seen, pairing each true target
   feature ``f_p`` (post-norm last hidden state, returned by the verify forward) with the token
   ``x_{p+1}``; these entries form the head's *stable* cache. The last output estimates the feature
   after the pending token.
2. *Expansion* (EAGLE-2): the top-k children of the root by draft log-probability; then, up to
   ``depth`` times, the current k frontier nodes are run through the head (each with its
   parent's output feature), each gets its top-k children scored by cumulative log-probability,
   and the global top-k become the next frontier. With a cost profile, expansion also stops
   when the next level cannot pay for itself: it adds at most the frontier's summed acceptance
   chance in expected tokens, worth that many ar steps T(1), against the measured time of
   a level. Acceptance chances are draft path probabilities calibrated online: the acceptance
   that verification showed for nodes of that path probability (per decile, from the identity).
   Expansion KV is written after the stable cache
   (each node sees the context plus its ancestors) and truncated away afterwards.
3. *Rerank*: the best nodes by cumulative score (ties broken so a node ranks after its
   ancestors; the chosen set is parent-closed, asserted) form the tree, sized by the measured
   verify-cost profile: the tree size maximises expected committed tokens (1 + the sum of the
   chosen nodes' draft path probabilities) per second of drafting plus verification.

Drafts are deterministic (top-k), so the loop's acceptance rule treats each as ``q = one-hot``:
greedy follows the target argmax, sampling accepts sibling x with probability ``p(x)`` and
renormalises ``p`` without it (lossless; see ``core/acceptance.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from ..core import kv_cache
from ..core.acceptance import Verdict
from ..core.cost import CostProfile
from ..core.tree import DraftTree
from ..decoding.protocol import Budget, DrafterBase, Proposal, Sizer
from ..decoding.state import DecodeState, VerifyOutput
from ..heads.eagle import EagleHead
from ..heads.eagle3 import Eagle3Head, target_features
from .backoff import TreeDraft, TreeSizer
from .budget import best_rate
from .eagle_heads import draft_lm_head, load_head_for
from .estimators import PLAIN_RATE, ConfidenceCalibration
from .spec import AutoCandidacy, AutoContext, BuildContext, MethodSpec, check_numbers, need, option
from .vocab import DRAFT_VOCAB_HELP, DraftLMHead

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class EagleConfig:
    """Options of ``eagle2`` and ``hass`` (each field's help is in its metadata)."""

    head: str = option("", "draft head directory; empty = the trained one for the model in "
                           "$SELFSPEC_HOME/heads/<model>-<method>, else the one shipped "
                           "with selfspec; random[:SEED] or random-eagle3[:SEED] = an untrained EAGLE-2 or "
                           "EAGLE-3 head (tests, lower bounds)",
                       flag="--head")
    top_k: int = option(10, "children per expanded node, and the frontier width (EAGLE-2: 10)", flag="--tree-top-k")
    depth: int = option(5, "expansion rounds after the first level: paths hold up to depth + 1 drafted tokens "
                           "(EAGLE-2 code: 5, the paper's depth 6)", flag="--tree-depth")
    total_tokens: int = option(0, "tree size including the root (EAGLE-2: 60); 0 = sized each step from the "
                                  "verify-cost profile, at most max_tokens", flag="--tree-tokens")
    max_tokens: int = option(64, "largest tree considered when total_tokens is 0")
    min_prob: float = option(0.02, "stop expanding once no frontier path has draft probability above this")
    backoff: bool = option(True, "with a cost profile, verify only the pending token while measured drafting "
                                 "steps commit fewer tokens per second than measured plain steps, judged over runs "
                                 "of 4 drafted steps; a probe of 4 drafted steps every 8 plain ones, the interval "
                                 "doubling up to 64 while drafts keep not paying")
    draft_vocab: int = option(-1, DRAFT_VOCAB_HELP, flag="--draft-vocab")
    calibrate: bool = option(True, "size trees by draft path probabilities calibrated online against what "
                                   "verification accepted (off: EAGLE-2's raw draft confidence)",
                             flag="--raw-confidence", value=False)

    def __post_init__(self) -> None:
        check_numbers(self, "eagle2/hass")
        need(self, "eagle2/hass", "top_k", self.top_k >= 1, ">= 1")
        need(self, "eagle2/hass", "depth", self.depth >= 0, ">= 0")
        need(self, "eagle2/hass", "total_tokens", self.total_tokens >= 0, ">= 0")
        need(self, "eagle2/hass", "max_tokens", self.max_tokens >= 2, ">= 2")
        need(self, "eagle2/hass", "min_prob", 0.0 <= self.min_prob < 1.0, "in [0, 1)")
        need(self, "eagle2/hass", "draft_vocab", self.draft_vocab >= -1, ">= -1")


@dataclass(frozen=True)
class Pool:
    """Every scored candidate of one expansion, in breadth-first order.

    Attributes:
        scores: ``[P]`` cumulative draft log-probability of each candidate's path.
        tokens: ``[P]`` int64 token ids.
        parents: ``[P]`` int64 pool index of the parent, -1 for children of the root.
    """

    scores: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor


def rerank(pool: Pool, pending: int, n: int) -> tuple[DraftTree, torch.Tensor]:
    """The tree of the root plus the ``n`` best pool nodes.

    Ties are broken by pool index, and a child never scores above its parent, so the chosen set
    is parent-closed (asserted).

    Returns:
        the tree and ``[n]`` the chosen pool indices in tree order (node ``i + 1``).
    """
    # tensor operations on the pool's device; the tree's one transfer to the host is its own
    scores = pool.scores
    order = torch.sort(scores, descending=True, stable=True).indices  # ties: lower pool index first
    idx = torch.sort(order[:n]).values  # [n] chosen pool indices, in pool order (parents first)
    where = torch.zeros(scores.numel() + 1, dtype=torch.long, device=scores.device)  # pool index + 1 -> tree node
    where[idx + 1] = torch.arange(1, idx.numel() + 1, device=scores.device)
    par = pool.parents[idx]
    tree_par = where[par + 1]  # children of the root (-1) land on where[0] = 0: the root
    orphan = (tree_par == 0) & (par >= 0)  # a chosen node whose parent was not chosen
    host = torch.stack([pool.tokens[idx], tree_par, orphan.long(), idx]).cpu()  # the one transfer
    if bool(host[2].any()):
        raise AssertionError("EAGLE-2 rerank: a chosen node's parent was not chosen")
    tree = DraftTree(torch.cat([torch.tensor([pending]), host[0]]), torch.cat([torch.tensor([-1]), host[1]]))
    return tree, host[3]


def calibrated(path_probs: torch.Tensor, calibration: ConfidenceCalibration | None) -> torch.Tensor:
    """``[P]`` chances that each node is accepted: its draft path probability mapped through
    ``calibration`` (None: the path probability itself, EAGLE-2's assumption)."""
    if calibration is None:
        return path_probs
    ratios = torch.tensor(calibration.table(), dtype=path_probs.dtype, device=path_probs.device)
    # the decile rule of ConfidenceCalibration, vectorised
    idx = (path_probs * ConfidenceCalibration.BINS).long().clamp_(0, ConfidenceCalibration.BINS - 1)
    return (path_probs * ratios[idx]).clamp_(max=1.0)


def best_size(path_probs: torch.Tensor, draft_s: float, profile: CostProfile | None, max_tokens: int,
              calibration: ConfidenceCalibration | None = None) -> int:
    """Drafted nodes to verify: maximise (1 + sum of the acceptance chances of the n best nodes)
    / (draft time + T(n + 1)). Nodes rank by draft path probability (the rerank order); their
    acceptance chances are those path probabilities through ``calibration`` (what verification
    showed for nodes of that path probability; None: EAGLE-2's assumption that draft confidence
    is the acceptance). Without a profile: ``max_tokens - 1``."""
    cap = min(int(path_probs.numel()), max_tokens - 1)
    if profile is None:
        return cap
    ranked = torch.sort(path_probs, descending=True).values
    gains = calibrated(ranked, calibration).cumsum(0).tolist()
    # in seconds: drafting is spent either way, so a plain step yields 1 token in draft_s + T(1)
    best_n, rate = best_rate([1.0 + g for g in gains[:cap]], lambda n: draft_s + profile.t1 * profile.ratio(n + 1))
    return best_n if rate > PLAIN_RATE / (draft_s + profile.t1) else 0


class EagleDrafter(DrafterBase):
    """EAGLE-2 dynamic-tree drafting with a one-layer head (see module docstring)."""

    lossless = True
    needs_hidden = True
    request_state = ("length", "sizer")  # adapts across requests (LearnedState)
    sizer: Sizer | None  # the Drafter protocol's member, set in __init__

    def __init__(self, name: str, target: torch.nn.Module, head: EagleHead | Eagle3Head, cfg: EagleConfig,
                 profile: CostProfile | None, source: str = "", lm_head: DraftLMHead | None = None) -> None:
        """
        Args:
            name: ``eagle2`` or ``hass`` (reports only).
            target: the stock HF target (its embedding and LM head are used, frozen).
            head: the draft head, same device and dtype as the target.
            cfg: tree settings.
            profile: the target's measured verify-cost profile (sizes the tree when
                ``cfg.total_tokens`` is 0).
            source: where the head came from (reports).
            lm_head: the draft LM head (a reduced vocabulary's rows); default: the target's.
        """
        self.name = name
        self.head = head
        self.cfg = cfg
        self.source = source
        hf = cast("PreTrainedModel", target)
        self.embed = hf.get_input_embeddings()
        self.lm_head = lm_head or DraftLMHead(hf.get_output_embeddings(), None)
        self.device = next(head.parameters()).device
        self.dtype = next(head.parameters()).dtype
        self.cache = kv_cache.new_cache(head.config)
        self.length = 0  # draft positions in the stable cache
        self.features: torch.Tensor | None = None  # [m, H] true features of positions not yet encoded
        # back-off, and the acceptance of a node against its draft path probability; fed by the controller
        self.sizer = TreeSizer(profile, cfg.backoff, cfg.calibrate)
        # the pool a step's tree is chosen from: the head's expansion; an oracle test injects its own
        # (same signature), and catch-up, rerank, commit and the feature bookkeeping still run for real
        self.expansion: Callable[[torch.Tensor, int, DecodeState | None, TreeSizer | None], Pool] = self.expand

    # -- state ---------------------------------------------------------------------------------

    def prefill(self, state: DecodeState, out: VerifyOutput) -> None:
        self.cache = kv_cache.new_cache(self.head.config)
        self.length = 0
        # [P, H] (EAGLE-3: [P, 3·H] fused low/mid/high layers): positions 0..P-1 of the prompt
        assert out.hidden is not None  # the loop's: this drafter needs_hidden
        self.features = target_features(self.head, out.hidden).to(self.dtype)

    def observe(self, state: DecodeState, proposal: Proposal, verdict: Verdict, out: VerifyOutput) -> None:
        assert out.hidden is not None  # the loop's: this drafter needs_hidden
        idx = torch.tensor(verdict.accepted_nodes, device=out.hidden[-1].device)
        new = target_features(self.head, out.hidden, idx).to(self.dtype)  # root + accepted drafts
        self.features = new if self.features is None or self.features.numel() == 0 else torch.cat([self.features, new])

    # -- drafting ------------------------------------------------------------------------------

    def _run(self, feats: torch.Tensor, toks: torch.Tensor, positions: torch.Tensor, block: torch.Tensor
             ) -> torch.Tensor:
        """Head over T new entries after the cache. Every entry sees the stable cache; ``block``
        (``[T, E + T]`` bool) says which expansion entries already cached (E) and which new ones
        it sees. Returns ``[T, H]`` outputs; their KV is appended to the cache."""
        base = kv_cache.cache_length(self.cache)
        t = feats.shape[0]
        mask = torch.ones(t, base + t, dtype=torch.bool, device=self.device)
        mask[:, self.length :] = block
        out = self.head(feats[None], self.embed(toks.to(self.device))[None], positions.to(self.device)[None],
                        mask[None, None], self.cache)
        return out[0]

    def _top(self, h: torch.Tensor, k: int, state: DecodeState | None = None, depth: int = 1
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` best draft tokens after each of ``h`` (``[T, H]``) at tree depth ``depth``:
        ``([T, k]`` log-probabilities, at least fp32 (fp64 heads stay fp64), ``[T, k]`` target
        token ids). With a reduced draft vocabulary only its tokens are scored. With coupled
        sampling the log-probabilities are those of the warped logits plus the target's Gumbel
        noise at that depth, so the tree ranks the tokens the target will pick with that noise."""
        logits = self.lm_head(h)
        if state is not None and state.deterministic and not state.warper.greedy:
            index = state.draft_index(depth)
            logits = state.scores(self.lm_head.full(logits), [index] * logits.shape[0])
            lp, tok = torch.topk(torch.log_softmax(logits, dim=-1), min(k, logits.shape[-1]), dim=-1)
            return lp, tok
        # top-k of the raw logits, normalised afterwards: no [T, V] log-softmax is written
        vals, idx = torch.topk(logits, min(k, logits.shape[-1]), dim=-1)
        return vals - torch.logsumexp(logits, dim=-1, keepdim=True), self.lm_head.to_target(idx)

    @torch.no_grad()
    def catch_up(self, ids: list[int]) -> torch.Tensor:
        """Encode the committed positions the head has not seen; returns the last output ``[H]``
        (the estimated feature after the pending token ``ids[-1]``)."""
        n = len(ids) - 1  # positions with a true feature: 0 .. n-1, paired with ids[1..n]
        m = n - self.length
        if self.features is None or self.features.shape[0] != m or m < 1:
            raise RuntimeError(f"{self.name}: {0 if self.features is None else self.features.shape[0]} pending "
                               f"features for {m} new positions")
        toks = torch.tensor(ids[self.length + 1 : n + 1], dtype=torch.long)
        pos = torch.arange(self.length, n)
        block = torch.ones(m, m, dtype=torch.bool, device=self.device).tril()
        out = self._run(self.features.to(self.device), toks, pos, block)  # stable cache: self.length = base
        self.length = n
        self.features = self.features[:0]
        return out[-1]

    @torch.no_grad()
    def expand(self, h_last: torch.Tensor, position: int, state: DecodeState | None = None,
               sizer: TreeSizer | None = None) -> Pool:
        """EAGLE-2 expansion from the root's estimated feature ``h_last`` (``[H]``); the
        depth-1 nodes sit at draft position ``position``. Levels are timed on ``state.clock``
        and expansion stops where a level costs more than it can add; without ``state``, or under
        rejection sampling, it never stops on wall-clock cost (the tree must depend on the request
        alone); with coupled sampling the draft uses the target's noise. ``sizer``: the step's (its
        profile prices levels, its calibration turns path probabilities into acceptance); None:
        unpriced."""
        cfg = self.cfg
        profile, calibration = (sizer.profile, sizer.calibration) if sizer is not None else (None, None)
        priced = state is not None and not state.rejection and profile is not None
        depth = 1
        s1, tok1 = (t[0] for t in self._top(h_last[None], cfg.top_k, state, depth))
        k = s1.numel()
        scores, tokens, parents = [s1], [tok1], [torch.full((k,), -1, dtype=torch.long, device=s1.device)]
        f_score, f_tok, f_ids = s1, tok1, torch.arange(k, device=s1.device)
        f_feat = h_last[None].expand(k, -1)
        eye = torch.eye(k, dtype=torch.bool, device=self.device)
        level_pos = torch.empty(k, dtype=torch.long, device=self.device)
        tmask = eye
        size = k
        level_s = 0.0
        for _ in range(cfg.depth):
            if math.exp(float(f_score.max())) < cfg.min_prob:
                break
            # the next level adds at most the frontier's summed acceptance chances in expected
            # tokens; stop when even that is worth less than the level costs (one ar step per token)
            if priced and level_s > 0:
                assert profile is not None  # priced
                frontier = float(calibrated(f_score.exp(), calibration).sum())
                if frontier * profile.t1 < level_s:
                    break
            started = state.clock(None) if priced and state is not None else 0.0  # priced: a state
            out = self._run(f_feat, f_tok, level_pos.fill_(position), tmask)
            position += 1
            depth += 1
            clp, ctok = self._top(out, k, state, depth)  # [k, k]
            cum = (f_score[:, None] + clp).flatten()
            scores.append(cum)
            tokens.append(ctok.flatten())
            parents.append(f_ids.repeat_interleave(k))
            f_score, sel = torch.topk(cum, k)
            u = sel // k
            f_feat, f_tok = out[u], ctok.flatten()[sel]
            f_ids = size + sel
            size += k * k
            tmask = torch.cat([tmask[u], eye], dim=1)
            level_s = state.clock(self.device) - started if priced and state is not None else 0.0
        return Pool(torch.cat(scores).cpu(), torch.cat(tokens).cpu(), torch.cat(parents).cpu())

    def propose(self, state: DecodeState, budget: Budget[TreeSizer, TreeDraft] | None) -> Proposal:
        # timed only where the clock sizes something: never under rejection sampling
        assert budget is not None  # the controller's: this drafter has a sizer
        sizer = budget.sizer
        timed = sizer.profile is not None and not state.rejection
        started = state.clock(None) if timed else 0.0
        if state.draft_room == 0 or not sizer.backoff.draft_now():
            return Proposal(DraftTree.chain([state.pending]))  # plain (the back-off learns its seconds)
        h_last = self.catch_up(state.ids)
        pool = self.expansion(h_last, self.length, state, sizer)
        kv_cache.truncate(self.cache, self.length)
        if self.cfg.total_tokens:
            n = self.cfg.total_tokens - 1
        else:
            spent = state.clock(self.device) - started if timed else 0.0  # rejection: no wall clock
            n = best_size(pool.scores.exp(), spent, sizer.profile, self.cfg.max_tokens, sizer.calibration)
        n = min(n, pool.scores.numel())
        if n == 0:  # drafted, even if nothing is verified: the drafting was paid for
            budget.made = TreeDraft(())
            return Proposal(DraftTree.chain([state.pending]))
        tree, chosen = rerank(pool, state.pending, n)
        budget.made = TreeDraft(tuple(pool.scores[chosen].exp().tolist()))
        return Proposal(tree)


def build(spec: MethodSpec, target, cfg: EagleConfig, ctx: BuildContext) -> EagleDrafter:
    from ..kernels.backends import convert_linears

    head, source = load_head_for(target, cfg.head, cfg.draft_vocab, spec.name)
    convert_linears(head, target.backend)  # the head's layer on the target's kernels, like its LM head
    profile = None if cfg.total_tokens else target.cost_profile(hidden=True, measure=ctx.measure)
    return EagleDrafter(spec.name, target.model, head, cfg, profile, source,
                        draft_lm_head(target, head, cfg.draft_vocab))


def _head_installed(name: str, target, ctx: AutoContext) -> dict | None:
    from ..heads import find_head_dir

    return {} if find_head_dir(target.name, name) is not None else None


WITH_HEAD = AutoCandidacy(_head_installed)  # an auto candidate where a head is installed or shipped
EAGLE2 = MethodSpec("eagle2", EagleConfig, build, True,
                    "EAGLE-2: a one-layer draft head (EAGLE-trained) expands a dynamic draft tree (--head)",
                    auto=WITH_HEAD, draft_weights=True)
HASS = MethodSpec("hass", EagleConfig, build, True,
                  "HASS: EAGLE-2 trees from a head trained with harmonized objectives (--head)", auto=WITH_HEAD,
                  draft_weights=True)
