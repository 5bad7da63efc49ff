"""End-to-end sampling test of ``sdsat`` on a real (tiny, random-init) model with an enumerable
vocabulary (V = 6): prefill gives x1, the draft step gives x2 and the adaptive-token drafts, and
the verify step checks the paper's tree (4 children of the root, 3/2/2/1 grandchildren; ordered
samples without replacement) and gives x3 and x4. The joint distribution of (x2, x3, x4) must
equal the exact target distribution with the shared lossless rule (``sdsat``), and must *not*
with the paper's sample-and-match verifier (``sdsat-lossy``): the negative control, which
documents that the paper's nucleus rule is not lossless."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.core.sampling import Warper

from .conftest import PROMPT, V, check, exact_joint_234

pytestmark = pytest.mark.statistical

N = 2500
ADAPTIVE = 5  # a random model: any id works as the adaptive token (drafts are simply poor)


def run(target, method: str, warper: Warper) -> torch.Tensor:
    g = selfspec.load(target, method, adaptive_ids=str(ADAPTIVE), k=2, self_test=False)  # fixed: no profile
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for seed in range(N):
        r = g.generate(PROMPT, max_new_tokens=5, temperature=warper.temperature, top_p=warper.top_p,
                       top_k=warper.top_k, seed=seed, ignore_eos=True, sampling="rejection")
        b, c, d = r.token_ids[1:4]
        counts[(b * V + c) * V + d] += 1
        assert r.drafted_per_step[1] == 0 and r.drafted_per_step[2] == 2  # draft step, then a depth-2 tree
    return counts


def test_sdsat_tree_sampling_matches_target(target):
    warper = Warper(0.8, top_p=0.95)
    pval, tv, bound = check(run(target, "sdsat", warper), exact_joint_234(target.model, warper))
    assert pval > 1e-3, f"chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"TV {tv:.4f} above the bound {bound:.4f}"


def test_negative_control_paper_sample_and_match(target):
    """The paper's verifier gives shared prefixes one chance per path and resamples after a
    rejection: the output distribution is biased toward the drafts."""
    warper = Warper(1.0)
    pval, tv, bound = check(run(target, "sdsat-lossy", warper), exact_joint_234(target.model, warper))
    assert pval < 1e-3 or tv > bound, f"the lossy rule passed: p={pval:.2e}, TV={tv:.4f}"
