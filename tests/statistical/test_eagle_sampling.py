"""End-to-end sampling test of the EAGLE-2 tree drafter on a real (tiny, random-init) model with
an enumerable vocabulary (V = 6): the joint distribution of the first three generated tokens (the
second and third come from one tree step: 3 children of the root, each with children, verified
by recursive rejection with deterministic drafts) must equal the exact target distribution. A
verifier that does not remove a rejected sibling from p (so it can be drawn again as the bonus
token) must fail the same test."""

from __future__ import annotations

import pytest
import torch

import selfspec
import selfspec.core.acceptance as acceptance

from .conftest import PROMPT, V, check, exact_joint

pytestmark = pytest.mark.statistical

N = 2500


def run(target, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    g = selfspec.load(target, "hass", head="random:5", total_tokens=8, top_k=3, depth=1, min_prob=0.0,
                      self_test=False)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for seed in range(N):
        r = g.generate(PROMPT, max_new_tokens=4, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=True,
                       sampling="rejection")
        a, b, c = r.token_ids[:3]
        counts[(a * V + b) * V + c] += 1
        assert r.drafted_per_step[1] == 2  # the first speculative step verified a depth-2 tree
    return counts


def test_tree_sampling_matches_target(target):
    from selfspec.core.sampling import Warper

    pval, tv, bound = check(run(target, 0.7, top_p=0.9), exact_joint(target.model, Warper(0.7, top_p=0.9)))
    assert pval > 1e-3, f"chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"TV {tv:.4f} above the bound {bound:.4f}"


def test_negative_control_rejected_sibling_not_removed(target, monkeypatch):
    from selfspec.core.sampling import Warper

    monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)
    pval, tv, bound = check(run(target, 1.0), exact_joint(target.model, Warper(1.0)))
    assert pval < 1e-3 or tv > bound
