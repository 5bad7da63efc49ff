"""``jacobi`` guess bookkeeping: the Jacobi shift after a verdict, noise refill, the fixed point
of a deterministic model (every guess becomes right), and errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import selfspec
from selfspec.core.acceptance import Verdict
from selfspec.core.sampling import Warper
from selfspec.core.tree import DraftTree
from selfspec.decoding.protocol import Proposal
from selfspec.decoding.state import VerifyOutput
from selfspec.drafters.budget import ChainBudget
from selfspec.drafters.jacobi import JacobiConfig, JacobiDrafter
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model

from ..conftest import prompt_ids


def one_hot_logits(preds: list[int], vocab: int = 50) -> torch.Tensor:
    out = torch.zeros(len(preds), vocab)
    out[torch.arange(len(preds)), torch.tensor(preds)] = 1.0
    return out


@pytest.mark.parametrize("a", range(5))
def test_shift_after_a_accepted(a):
    """Verified [r, d1..d4] (m = 6: d5, d6 unverified) with predictions o0..o4: a accepted ->
    next guesses o[a+1..4], then d6.. (d5's slot is o4's), refilled to m by propose."""
    d = JacobiDrafter(JacobiConfig(m=6, auto_m=False), ChainBudget(None, 4))
    d.guesses = [11, 12, 13, 14, 15, 16]
    tree = DraftTree.chain([10, 11, 12, 13, 14])
    preds = [20, 21, 22, 23, 24]
    out = VerifyOutput(base=0, tree_logits=one_hot_logits(preds))
    greedy = SimpleNamespace(warper=Warper(0.0), deterministic=True)  # what observe reads of the state
    d.observe(greedy, Proposal(tree), Verdict(list(range(a + 1)), preds[a]), out)
    assert d.guesses == preds[a + 1 :] + [16]


def test_matches_ar(tiny_dir):
    target = load_model(str(tiny_dir))
    ar = selfspec.load(target, "ar", self_test=False)
    g = selfspec.load(target, "jacobi", m=4, auto_m=False, self_test=False)
    for s in range(3):
        p = prompt_ids(s, 12)
        assert g.generate(p, max_new_tokens=30).token_ids == ar.generate(p, max_new_tokens=30).token_ids


def test_fixed_point_accepts_every_guess(tiny_dir):
    """A model that always predicts token 7, on a text of 7s: the ahead noise (copies of earlier
    tokens) is exactly right, so every step accepts all m guesses plus the bonus; on a text of
    other tokens the first guesses are noise and only the Jacobi updates become right."""
    target = load_model(str(tiny_dir))
    target.model.lm_head.register_forward_hook(lambda mod, inp, out: out + 100.0 * (torch.arange(out.shape[-1]) == 7))
    g = selfspec.load(target, "jacobi", m=4, auto_m=False, self_test=False)
    r = g.generate([7] * 8, max_new_tokens=21, ignore_eos=True)
    assert r.token_ids == [7] * 21
    assert r.committed_per_step == [1] + [5] * 4  # prefill, then four steps of 4 guesses + bonus
    r = g.generate(list(range(20, 28)), max_new_tokens=21, ignore_eos=True)
    assert r.token_ids == [7] * 21
    assert r.committed_per_step[1] < 5 and max(r.committed_per_step) == 5


def test_errors(tiny_dir):
    target = load_model(str(tiny_dir))
    with pytest.raises(SelfspecError, match="m >= 1"):
        selfspec.load(target, "jacobi", m=0, self_test=False)
