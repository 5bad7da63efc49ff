"""End-to-end sampling test of ``self-spec`` on a real (tiny, random-init) model with an
enumerable vocabulary (V = 6): the joint distribution of the first three generated tokens (the first
from the prompt forward, the next two from a speculative step that drafts two tokens with
skipped sub-layers) must equal the exact one computed from the target. A drafter that reports
its q but samples something else must fail the same test."""

from __future__ import annotations

import pytest
import torch

import selfspec
import selfspec.drafters.self_spec as self_spec_mod
from selfspec.core.sampling import Warper

from .conftest import PROMPT, V, check, exact_joint

pytestmark = pytest.mark.statistical

N = 2500


def run(target, warper: Warper) -> torch.Tensor:
    g = selfspec.load(target, "self-spec", skip_attention=(1,), skip_mlp=(2,), k=2, auto_k=False, self_test=False)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for seed in range(N):
        r = g.generate(PROMPT, max_new_tokens=4, temperature=warper.temperature, top_k=warper.top_k,
                       top_p=warper.top_p, seed=seed, ignore_eos=True, sampling="rejection")
        a, b, c = r.token_ids[:3]
        counts[(a * V + b) * V + c] += 1
        # the first step after the prompt forward drafts two tokens: x2 and x3 come from it
        assert r.drafted_per_step[1] == 2
    return counts


@pytest.mark.parametrize("on", ["target", "compiled_target"], ids=["stock", "compiled"])
def test_self_spec_sampling_matches_target(on, request):
    """On ``compiled``, the draft runs eagerly on the static cache and verification is compiled."""
    target = request.getfixturevalue(on)
    warper = Warper(0.8, top_k=4)  # drafts from the warped q: the rule must be told that q
    pval, tv, bound = check(run(target, warper), exact_joint(target.model, warper))
    assert pval > 1e-3, f"chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"TV {tv:.4f} above the bound {bound:.4f}"


def test_negative_control_draft_not_sampled_from_q(target, monkeypatch):
    """The draft reports q but always proposes its argmax: the output distribution shifts."""
    monkeypatch.setattr(self_spec_mod, "sample", lambda q, g: int(q.argmax()))
    warper = Warper(1.0)
    pval, tv, bound = check(run(target, warper), exact_joint(target.model, warper))
    assert pval < 1e-3 or tv > bound
