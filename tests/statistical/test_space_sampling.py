"""End-to-end sampling test of ``space`` on a real (tiny, random-init) model with an enumerable
vocabulary (V = 6): prefill gives x1; the first step gives x2 and two candidates from mask group
0; the second verifies them and gives x3 (and x4 when a candidate is accepted). The joint
distribution of (x2, x3, x4) must equal the exact target distribution with the residual rule
(``space``), and must *not* with the paper's rule (``space-lossy``: the next token is sampled
from the target after a rejection): the negative control, documenting that the paper's
sampling is not lossless."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.core.sampling import Warper

from .conftest import PROMPT, V, check, exact_joint_234

pytestmark = pytest.mark.statistical

N = 2500
MASK = 5  # a random model: any id works as the mask token (drafts are simply poor)


def run(target, method: str, warper: Warper) -> torch.Tensor:
    g = selfspec.load(target, method, mask_id=MASK, k=2, self_test=False)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for seed in range(N):
        r = g.generate(PROMPT, max_new_tokens=5, temperature=warper.temperature, top_p=warper.top_p,
                       top_k=warper.top_k, seed=seed, ignore_eos=True, sampling="rejection")
        b, c, d = r.token_ids[1:4]
        counts[(b * V + c) * V + d] += 1
        assert r.drafted_per_step[1] == 0 and r.drafted_per_step[2] == 2  # masks only, then 2 candidates
    return counts


def test_space_sampling_matches_target(target):
    warper = Warper(0.8, top_p=0.95)
    pval, tv, bound = check(run(target, "space", warper), exact_joint_234(target.model, warper))
    assert pval > 1e-3, f"chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"TV {tv:.4f} above the bound {bound:.4f}"


def test_negative_control_paper_bonus_from_target(target):
    """After a rejection the paper samples from Q instead of norm(max(0, Q - p)): the output is
    the mixture min(p, Q) + (1 - beta) Q, biased toward the drafts."""
    warper = Warper(1.0)
    pval, tv, bound = check(run(target, "space-lossy", warper), exact_joint_234(target.model, warper))
    assert pval < 1e-3 or tv > bound, f"the lossy rule passed: p={pval:.2e}, TV={tv:.4f}"
