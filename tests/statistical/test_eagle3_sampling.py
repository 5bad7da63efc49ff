"""End-to-end sampling test of the EAGLE-2 tree drafter with an EAGLE-3 head on a real (tiny,
random-init) model with an enumerable vocabulary (V = 6): the joint distribution of the first
three generated tokens (the second and third from one tree step: 3 children of the root, each
with children, verified by recursive rejection with deterministic drafts) must equal the exact
target distribution, with the head's own LM head over the full vocabulary and over a reduced one
that leaves out the target's most likely first token. A verifier that does not remove a
rejected sibling from p (so it can be drawn again as the bonus token) must fail the same test."""

from __future__ import annotations

import pytest
import torch

import selfspec
import selfspec.core.acceptance as acceptance
from selfspec.core.sampling import Warper
from selfspec.heads.eagle3 import Eagle3Head

from ..conftest import write_draft_ranking
from .conftest import PROMPT, V, check, exact_joint

pytestmark = pytest.mark.statistical

N = 2500
SIZE = 3


def run(target, warper: Warper, draft_vocab: int = -1, absent: int | None = None) -> torch.Tensor:
    g = selfspec.load(target, "hass", head="random-eagle3:5", total_tokens=8, top_k=3, depth=1, min_prob=0.0,
                      draft_vocab=draft_vocab, self_test=False)
    assert isinstance(g.drafter.head, Eagle3Head)
    if absent is not None:  # the head's own LM head covers a subset without this token
        ids = g.drafter.lm_head.vocab.ids.tolist()
        assert absent not in ids and len(ids) < V and g.drafter.head.lm_head.out_features == len(ids)
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for seed in range(N):
        r = g.generate(PROMPT, max_new_tokens=4, temperature=warper.temperature, top_p=warper.top_p, seed=seed,
                       ignore_eos=True, sampling="rejection")
        a, b, c = r.token_ids[:3]
        counts[(a * V + b) * V + c] += 1
        assert r.drafted_per_step[1] == 2  # the first speculative step verified a depth-2 tree
    return counts


@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_eagle3_tree_sampling_matches_target(target, vocab):
    warper = Warper(0.7, top_p=0.9)
    size, mode = -1, None
    if vocab == "reduced":
        with torch.inference_mode():
            p1 = warper.probs(
                target.model(input_ids=torch.tensor([PROMPT], device=target.device)).logits[0, -1].float().cpu())
        write_draft_ranking(target.name, V, torch.argsort(p1).tolist())  # the mode ranks last: left out
        size, mode = SIZE, int(p1.argmax())
    pval, tv, bound = check(run(target, warper, size, mode), exact_joint(target.model, warper))
    assert pval > 1e-3, f"chi-square rejects: p={pval:.2e}, TV={tv:.4f}"
    assert tv < bound, f"TV {tv:.4f} above the bound {bound:.4f}"


def test_negative_control_rejected_sibling_not_removed(target, monkeypatch):
    monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)
    pval, tv, bound = check(run(target, Warper(1.0)), exact_joint(target.model, Warper(1.0)))
    assert pval < 1e-3 or tv > bound
