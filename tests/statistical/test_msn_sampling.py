"""``msn`` with sampling on a real (tiny, random-init) model with an enumerable vocabulary (V = 6):
TR-Jacobi's deterministic tree (every sibling a different token after merging; noise, top-k and
retrieval slots) verified by the shared lossless rule with one-hot q. The joint distribution of
(x2, x3, x4) must equal the exact target distribution. (The paper defines TR-Jacobi for greedy
decoding only; this is what makes sampling with it safe. The shared rule's negative controls -
always-accept, a residual that keeps rejected mass - are in ``test_lossless_sampling.py``.)"""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.core.sampling import Warper

from .conftest import PROMPT, V, check, exact_joint_234

pytestmark = pytest.mark.statistical

N = 2500


def test_msn_tree_sampling_matches_target(target):
    warper = Warper(0.8, top_p=0.95)
    g = selfspec.load(target, "msn", tree_size=12, self_test=False)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    multi = 0
    for seed in range(N):
        r = g.generate(PROMPT, max_new_tokens=5, temperature=warper.temperature, top_p=warper.top_p,
                       seed=seed, ignore_eos=True, sampling="rejection")
        b, c, d = r.token_ids[1:4]
        counts[(b * V + c) * V + d] += 1
        multi += max(r.committed_per_step[1:]) > 1
    assert multi > N // 10  # drafts were accepted often enough for the test to mean something
    pval, tv, bound = check(counts, exact_joint_234(target.model, warper))
    assert pval > 1e-3, f"chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"TV {tv:.4f} above the bound {bound:.4f}"
