"""Sampling with a reduced draft vocabulary (issue 21) stays lossless: ``self-spec`` drafts from
q restricted to 3 of the V = 6 tokens, chosen so that the target's most likely first token lies
outside the subset, and the joint distribution of the first three tokens must equal the
target's. The negative control reports the unrestricted q while sampling from the subset (the
bug of forgetting that q is zero outside it): the distribution shifts and the test must fail."""

from __future__ import annotations

import pytest
import torch

import selfspec
import selfspec.drafters.self_spec as self_spec_mod
from selfspec.core.sampling import Warper, sample
from selfspec.models.draft_vocab import always_ids

from ..conftest import write_draft_ranking
from .conftest import PROMPT, V, check, exact_joint

pytestmark = pytest.mark.statistical

N = 2500
SIZE = 3


def subset_ranking(target, warper: Warper) -> list[int]:
    """The SIZE least likely first tokens first: the target's mode is left out of the subset."""
    with torch.inference_mode():
        p1 = warper.probs(
            target.model(input_ids=torch.tensor([PROMPT], device=target.device)).logits[0, -1].float().cpu())
    return torch.argsort(p1).tolist()


def run(g, warper: Warper) -> torch.Tensor:
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for seed in range(N):
        r = g.generate(PROMPT, max_new_tokens=4, temperature=warper.temperature, top_k=warper.top_k,
                       top_p=warper.top_p, seed=seed, ignore_eos=True, sampling="rejection")
        a, b, c = r.token_ids[:3]
        counts[(a * V + b) * V + c] += 1
        assert r.drafted_per_step[1] == 2
    return counts


def load(target, draft_vocab: int):
    return selfspec.load(target, "self-spec", skip_attention=(1,), skip_mlp=(2,), k=2, auto_k=False,
                         draft_vocab=draft_vocab, self_test=False)


def test_reduced_vocab_sampling_matches_target(target):
    warper = Warper(0.9)
    ranking = subset_ranking(target, warper)
    write_draft_ranking(target.name, V, ranking)
    g = load(target, SIZE)
    ids = set(g.drafter.lm_head.vocab.ids.tolist())
    assert ranking[-1] not in ids, "the target's mode must lie outside the subset"
    assert len(ids - set(always_ids(target.model, None))) <= SIZE < V
    pval, tv, bound = check(run(g, warper), exact_joint(target.model, warper))
    assert pval > 1e-3, f"chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"TV {tv:.4f} above the bound {bound:.4f}"


def test_negative_control_unrestricted_q_reported(target, monkeypatch):
    """Drafts come from the subset, but the rule is told the full-vocabulary q."""
    warper = Warper(0.9)
    ranking = subset_ranking(target, warper)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[ranking[:SIZE]] = True

    def restricted(q, gen):
        r = q * keep.to(q.device)
        return sample(r / r.sum(), gen)

    monkeypatch.setattr(self_spec_mod, "sample", restricted)
    g = load(target, 0)
    pval, tv, bound = check(run(g, warper), exact_joint(target.model, warper))
    assert pval < 1e-3 or tv > bound
