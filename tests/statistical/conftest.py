"""Shared by the sampling tests: the chi-square + total-variation check, and the real (tiny,
random-init) model with an enumerable vocabulary (V = 6) that the end-to-end tests sample from,
with the exact joint distributions they compare against."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from selfspec.core.sampling import Warper
from selfspec.models.loading import LoadedModel

from ..conftest import TEST_DEVICE, tiny_model

V = 6
PROMPT = [1, 4, 3]


def check(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, float, float]:
    """Returns (chi-square p-value, empirical TV, TV bound at delta = 1e-6)."""
    n = counts.sum()
    exp = expected_p * n
    keep = exp > 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    ex = torch.cat([exp[keep], exp[~keep].sum()[None]])
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    obs_np, ex_np = obs.double().numpy(), ex.double().numpy()
    ex_np = ex_np * (obs_np.sum() / ex_np.sum())
    pval = chisquare(obs_np, ex_np).pvalue
    tv = 0.5 * float((counts / n - expected_p).abs().sum())
    cells = int((expected_p > 0).sum())
    bound = math.sqrt((cells * math.log(2) + math.log(1e6)) / (2 * float(n)))
    return float(pval), tv, bound


@pytest.fixture(scope="module")  # a fresh copy per file, as drafters may wrap its modules
def target():
    """The end-to-end tests' target: a 3-layer random Llama over V = 6 tokens."""
    model = tiny_model("llama", seed=3, layers=3, vocab=V)
    with torch.no_grad():  # milder logits than the shared fixture: many sequences have mass
        model.lm_head.weight.mul_(0.4)
    model.to(TEST_DEVICE)
    return LoadedModel(model=model, tokenizer=None, name="tiny-v6", path=None).runner("stock")


@pytest.fixture(scope="module")
def compiled_target(target):
    """The same model on the ``compiled`` backend (its static-shape verify step under
    ``torch.compile``): sampling through it must draw from the same exact distribution."""
    return target.runner("compiled")


def _probs(model, warper: Warper, ids: list[int]) -> torch.Tensor:
    dev = next(model.parameters()).device
    return warper.probs(model(input_ids=torch.tensor([ids], device=dev)).logits[0, -1].float()).double().cpu()


def exact_joint(model, warper: Warper) -> torch.Tensor:
    """P(x1, x2, x3 | PROMPT) as a flat ``[V**3]`` tensor."""
    out = torch.zeros(V ** 3, dtype=torch.float64)
    with torch.inference_mode():
        p1 = _probs(model, warper, PROMPT)
        for a in range(V):
            p2 = _probs(model, warper, PROMPT + [a])
            for b in range(V):
                p3 = _probs(model, warper, PROMPT + [a, b])
                for c in range(V):
                    out[(a * V + b) * V + c] = p1[a] * p2[b] * p3[c]
    return out


def exact_joint_234(model, warper: Warper) -> torch.Tensor:
    """P(x2, x3, x4 | PROMPT) (x1 summed out) as a flat ``[V**3]`` tensor."""
    out = torch.zeros(V ** 3, dtype=torch.float64)
    with torch.inference_mode():
        p1 = _probs(model, warper, PROMPT)
        for a in range(V):
            p2 = _probs(model, warper, PROMPT + [a])
            for b in range(V):
                p3 = _probs(model, warper, PROMPT + [a, b])
                for c in range(V):
                    p4 = _probs(model, warper, PROMPT + [a, b, c])
                    for d in range(V):
                        out[(b * V + c) * V + d] += p1[a] * p2[b] * p3[c] * p4[d]
    return out
