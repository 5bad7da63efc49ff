"""``coupled`` (Gumbel-max) sampling draws from the target distribution: chi-square and total
variation of the joint distribution of the first three generated tokens of ``ar`` on a real
(tiny, random-init) model with V = 6, over seeds. Because every method's coupled text equals
``ar``'s (``tests/decoding/test_coupled_sampling.py``), this covers them all. Negative controls:
noise reused across positions (the tokens become dependent), and noise that ignores the seed
(every seed gives the same text), must fail."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.core import sampling as sampling_mod
from selfspec.core.sampling import Warper

from .conftest import PROMPT, V, check, exact_joint

pytestmark = pytest.mark.statistical

N = 2500


def run(target, warper: Warper, n: int = N) -> torch.Tensor:
    g = selfspec.load(target, "ar", self_test=False)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for seed in range(n):
        r = g.generate(PROMPT, max_new_tokens=3, temperature=warper.temperature, top_k=warper.top_k,
                       top_p=warper.top_p, seed=seed, ignore_eos=True)
        a, b, c = r.token_ids[:3]
        counts[(a * V + b) * V + c] += 1
    return counts


@pytest.mark.parametrize("warper", [Warper(1.0), Warper(0.8, top_p=0.9, top_k=4)], ids=["t1", "t0.8-topp0.9-topk4"])
@pytest.mark.parametrize("on", ["target", "compiled_target"], ids=["stock", "compiled"])
def test_coupled_ar_matches_target(on, warper, request):
    target = request.getfixturevalue(on)
    pval, tv, bound = check(run(target, warper), exact_joint(target.model, warper))
    assert pval > 1e-3, f"chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"TV {tv:.4f} above the bound {bound:.4f}"


def test_negative_control_noise_reused_across_positions(target, monkeypatch):
    key = sampling_mod.GumbelNoise.key
    monkeypatch.setattr(sampling_mod.GumbelNoise, "key", lambda self, index: key(self, 0))
    warper = Warper(1.0)
    pval, tv, bound = check(run(target, warper, 1500), exact_joint(target.model, warper))
    assert pval < 1e-3 or tv > bound


def test_negative_control_noise_ignores_seed(target, monkeypatch):
    monkeypatch.setattr(sampling_mod.GumbelNoise, "key", lambda self, index: sampling_mod._splitmix64(index))
    warper = Warper(1.0)
    pval, tv, bound = check(run(target, warper, 200), exact_joint(target.model, warper))
    assert pval < 1e-3 or tv > bound
