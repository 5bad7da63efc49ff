"""``msn`` (TR-Jacobi) pieces: the official template, retrieval semantics, sibling merging, the
path-padding regression (the official code over-counts; our acceptance cannot), the node
ranking and tree sizing, the fixed point of a constant model, and errors."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import selfspec
from selfspec.core.acceptance import accept_greedy
from selfspec.core.cost import CostProfile
from selfspec.drafters.msn import MEDUSA_63, RETRIEVAL, TEMPLATE, NodeRates, build_tree, retrieve
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model


def test_template_is_the_official_one():
    assert len(TEMPLATE) == 68 and len(MEDUSA_63) == 63
    assert Counter(len(p) for p in MEDUSA_63) == {1: 10, 2: 28, 3: 23, 4: 2}
    assert TEMPLATE[:5] == tuple((RETRIEVAL,) * d for d in range(1, 6))
    for i, p in enumerate(TEMPLATE):  # prefix-closed, parents listed first
        assert len(p) == 1 or TEMPLATE.index(p[:-1]) < i
    leaves = [p for p in MEDUSA_63 if not any(q[:-1] == p for q in MEDUSA_63)]
    assert len(leaves) == 42


def test_retrieve_takes_the_earliest_best_match():
    seq = [1, 2, 3, 40, 41, 9, 2, 3, 50, 51, 1, 2, 3]  # full match at 0 (earliest), partial at 5
    assert retrieve(seq, 3, 5) == [40, 41, 9, 2, 3]
    seq = [7, 2, 3, 40, 41, 5, 2, 3, 60, 8, 8, 2, 3]  # only the last bigram matches: first such window
    assert retrieve(seq, 3, 2) == [40, 41]
    assert retrieve([1, 2, 3, 4, 5, 6, 7], 3, 5) == []  # no match at all: nothing (not noise)
    assert retrieve([1, 2, 3, 1, 2], 3, 5) == []  # too short for a window before the suffix
    assert retrieve([5, 6, 7, 8, 9, 6, 7], 3, 5) == [8, 9, 6, 7]  # partial match, short continuation


def test_build_tree_merges_equal_siblings():
    cand = [[10 + r for r in range(11)] for _ in range(5)]
    cand[0][RETRIEVAL] = 10  # retrieval repeats rank 0 at depth 1
    nodes = [TEMPLATE.index(p) for p in [(RETRIEVAL,), (RETRIEVAL, RETRIEVAL), (0,), (0, 0), (1,), (0, 1)]]
    tree, index = build_tree(99, sorted(nodes), TEMPLATE, cand)
    assert tree.token_list[0] == 99
    by_path = dict(zip([TEMPLATE[i] for i in sorted(nodes)], index))
    assert by_path[(RETRIEVAL,)] == by_path[(0,)]  # merged: one node for token 10 at depth 1
    for node in range(tree.size):
        toks = [tree.token_list[c] for c in tree.children[node]]
        assert len(toks) == len(set(toks))
    # depth 1: tokens 10 (retrieval = rank 0) and 11; under 10: 20 (retrieval), 10 (rank 0), 11 (rank 1)
    assert tree.size == 1 + 2 + 3
    assert sorted(tree.token_list[c] for c in tree.children[by_path[(0,)]]) == [10, 11, 20]


def official_padded_reward(paths: list[list[int]], tokens: list[int], preds: list[int], pad_len: int) -> tuple:
    """The official noise_forward.py acceptance: paths padded to ``pad_len`` with index 0 (the
    root), reward = leading matches of ``tokens[p_j] == preds[p_{j-1}]``; first best path wins."""
    best, best_r = None, -1
    for p in paths:
        p = p + [0] * (pad_len - len(p))
        r = 0
        while r + 1 < pad_len and tokens[p[r + 1]] == preds[p[r]]:
            r += 1
        if r > best_r:
            best, best_r = p, r
    return best[: best_r + 1], best_r


def test_padding_regression():
    """Root R with one depth-1 child A. The model predicts A after R and R after A (the text
    alternates R A R A ...). The verified tree has depth 1, so at most R, A and the bonus R may
    be decided. The official padded paths [0, 1, 0, 0, ...] keep "matching" the root's token and
    accept it again at the wrong position (negative control); our acceptance stops at the leaf."""
    R, A, V = 5, 6, 10
    cand = [[A] * 11 for _ in range(5)]
    tree, _ = build_tree(R, [TEMPLATE.index((0,))], TEMPLATE, cand)
    preds = [A, R]  # argmax after node 0 (R) is A; after node 1 (A) is R
    logits = torch.zeros(2, V)
    logits[0, A] = logits[1, R] = 1.0
    verdict = accept_greedy(tree, logits)
    assert verdict.accepted_nodes == [0, 1] and verdict.bonus_token == R
    accepted, reward = official_padded_reward(tree.paths, tree.token_list, preds, pad_len=6)
    # 2 "accepted" from a depth-1 tree: the root's token again, its KV row (position |C|) gathered
    # to position |C| + 2, and the next token taken from the root's logits (context R only)
    assert reward == 2 and accepted == [0, 1, 0]


def test_ranking_is_prefix_closed_and_sizing_follows_cost():
    flat = CostProfile((1, 2, 64), (1.0, 1.0, 1.0), 0, "flat")  # a GPU-like profile: width is free
    steep = CostProfile((1, 2, 64), (1.0, 2.0, 64.0), 0, "steep")  # every token costs a forward
    rates = NodeRates(TEMPLATE, flat)
    order, values = rates.ranking(list(range(len(TEMPLATE))))
    seen = set()
    for i in order:
        p = TEMPLATE[i]
        assert len(p) == 1 or TEMPLATE.index(p[:-1]) in seen
        seen.add(i)
    assert values == sorted(values, reverse=True)
    assert rates.choose(values, 68) == 68
    assert NodeRates(TEMPLATE, steep).choose(values, 68) == 0
    rates.update([0, TEMPLATE.index((0,))], {TEMPLATE.index((0,))})
    for _ in range(50):
        rates.update([0], set())  # retrieval never right: it falls behind rank 0
    order, _ = rates.ranking(list(range(len(TEMPLATE))))
    assert order.index(TEMPLATE.index((0,))) < order.index(0)


def test_constant_model_accepts_the_whole_depth(tiny_dir):
    """A model that always predicts 7, on a text of 7s: every slot holds 7 (noise, top-1 and
    retrieval), so each step accepts 5 (the template's depth) plus the bonus."""
    target = load_model(str(tiny_dir))
    target.model.lm_head.register_forward_hook(lambda mod, inp, out: out + 100.0 * (torch.arange(out.shape[-1]) == 7))
    g = selfspec.load(target, "msn", tree_size=68, self_test=False)
    r = g.generate([7] * 8, max_new_tokens=25, ignore_eos=True)
    assert r.token_ids == [7] * 25 and r.committed_per_step == [1] + [6] * 4


def test_errors(tiny_dir):
    target = load_model(str(tiny_dir))
    with pytest.raises(SelfspecError, match="tree_size"):
        selfspec.load(target, "msn", tree_size=-1, self_test=False)
