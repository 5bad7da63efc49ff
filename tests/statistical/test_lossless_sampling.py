"""Speculative sampling preserves the target distribution: chi-square and total variation.

A toy Markov "model" over a small vocabulary gives a position-dependent target
``p(x_t | x_{t-1})`` and a draft ``q(x_t | x_{t-1})``. Full speculative decoding runs (draft a
chain or a tree, verify with :func:`accept_sampling`, commit, repeat) until two tokens are out,
and the joint distribution of those two tokens is compared with the exact one. Offsets, residual
and q-mismatch bugs change that joint distribution. Negative controls (deliberately wrong rules)
must fail the same test.
"""

from __future__ import annotations

import bisect

import pytest
import torch

import selfspec.core.acceptance as acc
from selfspec.core.sampling import Warper
from selfspec.core.tree import DraftTree

from .conftest import check

V = 6
N = 20_000
TOKENS_OUT = 2


def tables(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw target and draft logits tables ``[V, V]`` (row = previous token)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 1.5
    if kind == "random":
        draft = torch.randn(V, V, generator=g) * 1.5
    elif kind == "equal":  # q == p: everything accepted, residual all zero (must not NaN)
        draft = target.clone()
    elif kind == "disjoint":  # q's support is where p is (nearly) zero
        target = torch.full((V, V), -30.0)
        target[:, : V // 2] = torch.randn(V, V // 2, generator=g)
        draft = torch.full((V, V), -30.0)
        draft[:, V // 2 :] = torch.randn(V, V - V // 2, generator=g)
    elif kind == "onehot":  # a (near) one-hot draft
        draft = torch.full((V, V), -40.0)
        draft[torch.arange(V), torch.randint(0, V, (V,), generator=g)] = 40.0
    elif kind == "zeros":  # q is zero on tokens where p > 0
        draft = torch.randn(V, V, generator=g)
        draft[:, :2] = -40.0
    else:
        raise ValueError(kind)
    return target, draft


def exact_joint(target: torch.Tensor, warper: Warper, start: int) -> torch.Tensor:
    p1 = warper.probs(target[start])
    joint = p1[:, None] * warper.probs(target)  # [x1, x2]
    return joint.flatten()


class Draft:
    """The draft q of one run: warped probability tables, and a fast exact sampler from them.

    ``q[prev]`` is the warped q after token ``prev``; ``told[prev]`` is what the rule is told q
    was (a bug when it differs). Draws are by inverse CDF from uniforms taken from ``g`` in blocks:
    exact draws from q at a fraction of ``torch.multinomial``'s per-call cost. Trees are built once
    per distinct token sequence (they are immutable) and reused."""

    BLOCK = 4096

    def __init__(self, draft: torch.Tensor, warper: Warper, g: torch.Generator, probs_for_rule: str = "warped"):
        self.logits = draft
        self.q = warper.probs(draft)
        told = self.q if probs_for_rule == "warped" else torch.softmax(draft, -1)
        self.told = torch.cat([told, torch.zeros(1, V)])  # row V: the root's (unused) row
        cdf = self.q.double().cumsum(-1)
        self.cdf = (cdf / cdf[:, -1:]).tolist()
        self.g = g
        self.u: list[float] = []
        self.trees: dict[tuple[int, ...], DraftTree] = {}

    def sample(self, prev: int) -> int:
        if not self.u:
            self.u = torch.rand(self.BLOCK, generator=self.g, dtype=torch.float64).tolist()
        return bisect.bisect_right(self.cdf[prev], self.u.pop())  # u < 1 = cdf[-1]; p = 0 tokens never

    def tree(self, tokens: list[int], parents: list[int], prevs: list[int] | None) -> DraftTree:
        """The tree of these nodes; ``prevs[i]``: the token node i's q follows (``None``: one-hot q)."""
        key = tuple(tokens)
        if key not in self.trees:
            rows = None if prevs is None else self.told[prevs]
            self.trees[key] = DraftTree(torch.tensor(tokens), torch.tensor(parents), rows)
        return self.trees[key]


def draft_tree(pending: int, d: Draft, shape: str) -> DraftTree:
    """Draft from q. ``shape``: chain of 3, or a tree with 2 i.i.d. root children each followed by
    one child, or 2 distinct deterministic (top-2) root children."""
    tokens, parents, prevs = [pending], [-1], [V]  # prevs[i]: the token q of node i follows
    if shape == "chain":
        prev, node = pending, 0
        for _ in range(3):
            x = d.sample(prev)
            tokens.append(x), parents.append(node), prevs.append(prev)
            prev, node = x, len(tokens) - 1
        return d.tree(tokens, parents, prevs)
    if shape == "tree-iid":
        for _ in range(2):
            x = d.sample(pending)
            tokens.append(x), parents.append(0), prevs.append(pending)
            y = d.sample(x)
            tokens.append(y), parents.append(len(tokens) - 2), prevs.append(x)
        return d.tree(tokens, parents, prevs)
    if shape == "tree-top2":  # deterministic distinct siblings: one-hot q (draft_probs None)
        top = torch.topk(d.logits[pending], 2).indices.tolist()
        for x in top:
            tokens.append(x), parents.append(0)
            tokens.append(int(d.logits[x].argmax())), parents.append(len(tokens) - 2)
        return d.tree(tokens, parents, None)
    raise ValueError(shape)


def simulate(kind: str, shape: str, warper: Warper, seed: int = 0, rule=None,
             probs_for_rule: str = "warped", n: int = N) -> torch.Tensor:
    """Counts ``[V * V]`` of the first two emitted tokens over N runs."""
    rule = rule or acc.accept_sampling
    target, draft = tables(kind)
    g = torch.Generator().manual_seed(seed)
    d = Draft(draft, warper, g, probs_for_rule)
    counts = [0] * (V * V)
    rows: dict[DraftTree, torch.Tensor] = {}
    start = 0
    for _ in range(n):
        out: list[int] = []
        pending = start
        while len(out) < TOKENS_OUT:
            tree = draft_tree(pending, d, shape)
            if tree not in rows:
                rows[tree] = target[tree.tokens]  # row i: target logits after node i's token
            logits = rows[tree]
            v = rule(tree, logits, warper, g)
            new = tree.path_tokens(v.accepted_nodes[1:]) + [v.bonus_token]
            out += new
            pending = out[-1]
        counts[out[0] * V + out[1]] += 1
    return torch.tensor(counts, dtype=torch.float32)


WARPERS = {
    "t1": Warper(1.0),
    "t0.7-topk4": Warper(0.7, top_k=4),
    "t1.3-topp0.8": Warper(1.3, top_p=0.8),
}

_HEAVY = pytest.mark.statistical  # the rest of the grid: CI's second command (the default tier keeps one case per rule)
CASES = [
    ("random", "chain", "t1"),
    pytest.param("random", "chain", "t0.7-topk4", marks=_HEAVY),
    pytest.param("random", "chain", "t1.3-topp0.8", marks=_HEAVY),
    ("equal", "chain", "t1"),
    ("disjoint", "chain", "t1"),
    pytest.param("onehot", "chain", "t1", marks=_HEAVY),
    pytest.param("zeros", "chain", "t1", marks=_HEAVY),
    ("random", "tree-iid", "t1"),
    pytest.param("random", "tree-iid", "t0.7-topk4", marks=_HEAVY),
    pytest.param("disjoint", "tree-iid", "t1", marks=_HEAVY),
    ("random", "tree-top2", "t1"),
    ("random", "tree-top2", "t1.3-topp0.8"),
]


@pytest.mark.parametrize("kind,shape,w", CASES)
def test_speculative_sampling_matches_target(kind, shape, w):
    warper = WARPERS[w]
    target, _ = tables(kind)
    pval, tv, bound = check(simulate(kind, shape, warper), exact_joint(target, warper, 0))
    assert pval > 1e-3, f"chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"TV {tv:.4f} above the bound {bound:.4f}"


def test_seeded_runs_reproduce():
    a = simulate("random", "chain", WARPERS["t1"], seed=3, n=2000)
    b = simulate("random", "chain", WARPERS["t1"], seed=3, n=2000)
    c = simulate("random", "chain", WARPERS["t1"], seed=4, n=2000)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ---- negative controls: deliberately wrong rules must fail the same test -------------------

def always_accept(tree, logits, warper, g):
    path = [0]
    while tree.children[path[-1]]:
        path.append(tree.children[path[-1]][0])
    return acc.Verdict(path, int(torch.multinomial(warper.probs(logits[path[-1]]), 1, generator=g)))


def _fails(counts, expected) -> bool:
    pval, tv, bound = check(counts, expected)
    return pval < 1e-3 or tv > bound


def test_negative_control_always_accept():
    warper = WARPERS["t1"]
    target, _ = tables("random")
    assert _fails(simulate("random", "chain", warper, rule=always_accept), exact_joint(target, warper, 0))


def test_negative_control_residual_is_p(monkeypatch):
    monkeypatch.setattr(acc, "_residual", lambda p, q: p)
    warper = WARPERS["t1"]
    target, _ = tables("random")
    assert _fails(simulate("random", "chain", warper), exact_joint(target, warper, 0))


def test_negative_control_raw_q_for_processed_draft():
    """Draft sampled from the top-k-processed q but the rule told the raw softmax q
    (transformers#47932-style)."""
    warper = WARPERS["t0.7-topk4"]
    target, _ = tables("random")
    counts = simulate("random", "chain", warper, probs_for_rule="raw")
    assert _fails(counts, exact_joint(target, warper, 0))
