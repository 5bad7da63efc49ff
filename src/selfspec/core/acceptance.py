"""Acceptance rules: which drafted tokens the target keeps, and the bonus token.

* :func:`accept_greedy`: follow the child whose token is the target's argmax; the bonus token is
  the argmax at the last accepted node. Identical output to greedy decoding by construction.
* :func:`accept_sampling`: recursive rejection sampling over the tree (SpecInfer / EAGLE style).
  At a node with target distribution ``p`` the children are tried in order; child ``j`` with
  token ``x`` drawn from ``q_j`` is accepted with probability ``min(1, p(x) / q_j(x))``;
  otherwise ``p <- norm(max(p - q_j, 0))`` and the next sibling is tried. When every child is
  rejected the bonus token is drawn from the residual ``p``. For a chain this is the classic
  speculative sampling rule (Leviathan et al., Chen et al.); for deterministic drafts ``q_j`` is
  one-hot, so a draft is accepted with probability ``p(x)`` and rejected mass is removed from p.
  The output distribution equals the target's warped distribution (tested in
  ``tests/statistical/test_lossless_sampling.py``). A chain is verified as tensor operations with
  one transfer to the host per step; a tree walks its nodes on the host.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .sampling import Warper, sample
from .tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    """Result of verifying one tree.

    Attributes:
        accepted_nodes: node indices of the accepted path, starting with the root 0.
        bonus_token: the token the target chose after the last accepted node; it becomes the
            next pending token.
    """

    accepted_nodes: list[int]
    bonus_token: int

    @property
    def num_accepted(self) -> int:
        """Accepted drafted tokens (root excluded). Tokens committed this step = this + 1."""
        return len(self.accepted_nodes) - 1


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    """Greedy verification.

    Args:
        tree: the verified tree with N nodes.
        target_logits: ``[N, V]`` target logits at each node (they predict the node's children).
    """
    best = target_logits.argmax(dim=-1).tolist()
    node = 0
    path = [0]
    tokens = tree.token_list
    while True:
        nxt = next((c for c in tree.children[node] if tokens[c] == best[node]), None)
        if nxt is None:
            return Verdict(path, best[node])
        node = nxt
        path.append(node)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))`` along the last dim; returns ``p`` unchanged if nothing is left (q dominates p).

    The fallback can only be reached with probability zero (an exact ``p == q`` means the draft
    was accepted), but floating point can still land there, so it must not produce NaN.
    """
    r = (p - q).clamp_min(0.0)
    s = r.cumsum(dim=-1)[..., -1:]  # a serial scan: the same sum on any number of threads (a batch's request threads)
    return torch.where(s > 0, r / s.clamp_min(torch.finfo(r.dtype).tiny), p)  # on the device: no host read


def accept_sampling(
    tree: DraftTree,
    target_logits: torch.Tensor,
    warper: Warper,
    generator: torch.Generator | None,
) -> Verdict:
    """Lossless recursive rejection sampling over a tree (a chain is a tree).

    Args:
        tree: N nodes; ``tree.draft_probs`` (``[N, V]``) gives each drafted node's ``q``, or
            ``None`` for deterministic drafts (one-hot ``q``).
        target_logits: ``[N, V]`` raw target logits at each node.
        warper: the request's temperature / top-k / top-p, applied to the target here exactly as
            the drafter applied it to ``q``.
        generator: the request's RNG.
    """
    if tree.is_chain:
        return _accept_chain_sampling(tree, target_logits, warper, generator)
    tokens = tree.token_list
    node = 0
    path = [0]
    while True:
        p = warper.probs(target_logits[node])
        for child in tree.children[node]:
            x = tokens[child]
            if tree.draft_probs is None:
                qx = 1.0
            else:
                qx = float(tree.draft_probs[child, x])
            px = float(p[x])
            u = float(torch.rand((), generator=generator, device=p.device))
            if qx > 0 and u * qx < px:  # accept with probability min(1, px / qx)
                node = child
                path.append(child)
                break
            if tree.draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            else:
                q = tree.draft_probs[child].to(p)
            p = _residual(p, q)
        else:
            return Verdict(path, sample(p, generator))


def _accept_chain_sampling(
    tree: DraftTree,
    target_logits: torch.Tensor,
    warper: Warper,
    generator: torch.Generator | None,
) -> Verdict:
    """:func:`accept_sampling` for a chain, as tensor operations on the logits' device with one
    transfer to the host (the accepted count and the bonus token together): the same rule, with
    the uniforms of every depth drawn at once (independent draws either way).

    Args:
        tree: a chain of N nodes (N - 1 drafts).
        target_logits: ``[N, V]`` raw target logits at each node.
    """
    device = target_logits.device
    p = warper.probs(target_logits)  # [N, V]
    v = p.shape[-1]
    x = tree.tokens[1:].to(device)  # [N - 1] the drafted tokens
    px = p[:-1].gather(1, x[:, None])[:, 0]  # [N - 1] target probability of each draft
    if tree.draft_probs is None:  # deterministic drafts: one-hot q
        qx = torch.ones_like(px)
    else:
        q = tree.draft_probs[1:].to(p)  # [N - 1, V]
        qx = q.gather(1, x[:, None])[:, 0]
    u = torch.rand(x.numel(), generator=generator, device=device)
    ok = (qx > 0) & (u * qx < px)  # accept with probability min(1, px / qx)
    m = ok.long().cumprod(0).sum()  # accepted drafts: the leading run of acceptances
    # the bonus comes from norm(max(p[m] - q_rejected, 0)); with every draft accepted, q = 0
    rejected = (m < x.numel()).to(p.dtype)
    xm = torch.cat([x, x.new_zeros(1)])[m]
    if tree.draft_probs is None:
        qm = torch.zeros(v, dtype=p.dtype, device=device).index_put_((xm.view(1),), rejected.view(1))
    else:
        qm = torch.cat([q, q.new_zeros(1, v)])[m]
    bonus = torch.multinomial(_residual(p[m], qm), 1, generator=generator)
    accepted, token = torch.stack([m, bonus[0]]).tolist()  # the one transfer
    return Verdict(list(range(accepted + 1)), token)


def tally_by_depth(proposed: list[int], accepted: list[int], depth: int, num_accepted: int) -> None:
    """Count one verify step into the per-depth tallies (THE definition of acceptance by depth):
    a step whose verified tree is ``depth`` deep proposed a draft at every depth 1..depth and
    accepted the first ``num_accepted`` of them. ``proposed`` / ``accepted`` grow as needed."""
    while len(proposed) < depth:
        proposed.append(0)
        accepted.append(0)
    for d in range(depth):
        proposed[d] += 1
        accepted[d] += d < num_accepted


def acceptance_by_depth(depths: Iterable[int], num_accepted: Iterable[int]) -> list[float]:
    """Acceptance at draft depth d = steps that accepted their d-th draft / steps that verified a
    d-th draft, over steps given by their verified tree depth and accepted drafts
    (:func:`tally_by_depth`)."""
    proposed: list[int] = []
    accepted: list[int] = []
    for d, a in zip(depths, num_accepted):
        tally_by_depth(proposed, accepted, d, a)
    return [a / p if p else 0.0 for a, p in zip(accepted, proposed)]
