"""``space`` drafter pieces: the mask-group layout (the paper's worked example), context
isolation of the masked forward (real and candidate logits equal plain causal logits; mask
logits equal the plain forward of their group's prefix), candidates taken from the group after
the last accepted token, the per-step emission bounds, the k budget, and errors."""

from __future__ import annotations

import copy

import pytest
import torch

import selfspec
from selfspec.core import kv_cache
from selfspec.core.acceptance import Verdict
from selfspec.core.cost import CostProfile
from selfspec.core.mask_groups import mask_groups
from selfspec.core.sampling import Warper
from selfspec.core.tree import DraftTree
from selfspec.decoding.protocol import Piggyback, Proposal
from selfspec.decoding.state import VerifyOutput
from selfspec.drafters.space import SpaceAcceptance, accept_paper, step_tokens
from selfspec.errors import SelfspecError
from selfspec.models.adapter import forward_block
from selfspec.models.loading import load_model

from ..conftest import VOCAB, prompt_ids

MASK = VOCAB - 1


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(str(tiny_dir))


def test_layout_is_the_papers_worked_example():
    """Paper Fig. 3 (k = 2, l = 2): ``LLMs are M M auto M M model M M``, positions
    0 1 2 3 2 3 4 3 4 5, and its allow matrix (reordered: real tokens first)."""
    block, rel = mask_groups(4, [1, 2, 3], 2)  # real: LLMs are auto model; groups after are/auto/model
    order = [0, 1, 4, 5, 2, 6, 7, 3, 8, 9]  # the paper's interleaved order
    positions = torch.cat([torch.arange(4), rel])[order]
    assert positions.tolist() == [0, 1, 2, 3, 2, 3, 4, 3, 4, 5]
    paper = ["1", "11", "111", "1111", "11..1", "11..11", "11..111", "11..1..1", "11..1..11", "11..1..111"]
    got = block[order][:, order]
    for i, row in enumerate(paper):
        assert got[i].tolist() == [c == "1" for c in row.ljust(10, ".")], i
    assert step_tokens(5) == 36  # the paper's steady-state forward for k = 5


def test_layout_rejects_anchors_outside_the_block():
    with pytest.raises(ValueError):
        mask_groups(3, [3], 2)


def test_masked_forward_context_isolation(target):
    """Real and candidate logits equal a plain causal forward; the logits of mask j of group g
    equal the plain forward of prefix + c_1..c_g + [M] * (j + 1); another group's content does
    not matter."""
    model = target.model
    prefix, cands, k = prompt_ids(1, 7), [9, 17, 33], 3
    real = torch.tensor(prefix[-1:] + cands)
    block, rel = mask_groups(real.numel(), list(range(real.numel())), k)
    with torch.inference_mode():
        from transformers import DynamicCache

        cache = DynamicCache()
        model(input_ids=torch.tensor([prefix[:-1]]), **kv_cache.cache_arg(model, cache), use_cache=True)
        base = cache.get_seq_length()
        ids = torch.cat([real, torch.full((rel.numel(),), MASK)])
        pos = torch.cat([torch.arange(real.numel()), rel]) + base
        out = forward_block(model, copy.deepcopy(cache), ids, pos, block).logits

        def plain(seq):
            return model(input_ids=torch.tensor([seq])).logits[0].float()

        full = plain(prefix + cands)
        assert torch.allclose(out[: real.numel()], full[len(prefix) - 1 :], atol=1e-5)
        for g in range(real.numel()):
            for j in range(k):
                ref = plain(prefix + cands[:g] + [MASK] * (j + 1))[-1]
                assert torch.allclose(out[real.numel() + g * k + j], ref, atol=1e-5), (g, j)
        other = ids.clone()
        other[real.numel() : real.numel() + k] = 11  # change group 0's tokens
        out2 = forward_block(model, copy.deepcopy(cache), other, pos, block).logits
        assert torch.allclose(out2[real.numel() + k :], out[real.numel() + k :], atol=1e-6)
        assert torch.allclose(out2[: real.numel()], out[: real.numel()], atol=1e-6)


@pytest.mark.parametrize("acc", range(4))
def test_candidates_come_from_the_group_after_the_last_accepted(target, acc):
    g = selfspec.load(target, "space", mask_id=MASK, k=3, self_test=False)
    d = g.drafter
    k, groups = 3, 4
    logits = torch.zeros(groups * k, VOCAB)
    for gi in range(groups):
        for j in range(k):
            logits[gi * k + j, 10 * gi + j + 4] = 5.0
    tree = DraftTree.chain([1, 2, 3, 4])
    pig = Piggyback(torch.full((groups * k,), MASK), torch.arange(groups * k),
                    torch.ones(groups * k, 4 + groups * k, dtype=torch.bool))

    class S:  # a greedy decode state, as far as observe reads it
        warper = Warper(0.0)
        generator = None
        deterministic = True
        ids = [0, 1, 2, 3]

        def scores(self, logits, indices):
            return logits

        def draft_index(self, depth):
            return len(self.ids) - 1 + depth

    d.observe(S(), Proposal(tree, pig), Verdict(list(range(acc + 1)), 7), VerifyOutput(0, torch.zeros(4, VOCAB),
                                                                                       logits))
    assert d.cands == [10 * acc + j + 4 for j in range(k)]


def test_emission_bounds(target):
    """Every step after the first verifies up to k candidates and commits 1..k+1 tokens; one
    forward per step."""
    k = 3
    g = selfspec.load(target, "space", mask_id=MASK, k=k, self_test=False)
    r = g.generate(prompt_ids(5, 6), max_new_tokens=40, ignore_eos=True)
    assert r.committed_per_step[0] == 1 and r.drafted_per_step[1] == 0
    assert all(1 <= c <= k + 1 for c in r.committed_per_step[1:])
    assert all(0 <= d <= k for d in r.drafted_per_step)
    assert sum(r.committed_per_step) == r.new_tokens == 40 and r.steps == len(r.committed_per_step)


def test_budget_prices_the_whole_masked_forward():
    steep = CostProfile((1, 2, 4, 8, 16, 36), (0.01, 0.011, 0.012, 0.015, 0.02, 0.05), 256, "t")
    b = SpaceAcceptance(steep, 6, prior=[0.5] * 6, first_probe=100)
    assert b.choose(10) == 1  # 4 tokens pay; 9 (k = 2) and more do not at 50% acceptance
    flat = CostProfile((1, 64), (0.01, 0.0101), 256, "t")
    assert SpaceAcceptance(flat, 6, prior=[0.9] * 6).choose(10) == 6
    poor = SpaceAcceptance(steep, 6, prior=[0.0] * 6, first_probe=100)
    assert poor.choose(10) == 0


def test_paper_rule_resamples_from_the_target():
    """The paper's rule: a rejected candidate's next token is drawn from Q, so a token the draft
    over-proposes keeps Q's full mass after a rejection (the residual would give it 0)."""
    q_logits = torch.log(torch.tensor([[0.5, 0.5, 1e-9, 1e-9], [0.25] * 4]))
    draft = torch.zeros(2, 4)
    draft[1] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # always proposes token 0 (p = 1, Q = 0.5)
    tree = DraftTree.chain([3, 0], draft)
    gen = torch.Generator().manual_seed(0)
    bonus = [accept_paper(tree, q_logits, Warper(1.0), gen) for _ in range(4000)]
    rejected = [v.bonus_token for v in bonus if v.num_accepted == 0]
    assert 0.4 < len(rejected) / 4000 < 0.6
    assert sum(t == 0 for t in rejected) / len(rejected) > 0.4  # the residual would never give 0


def test_needs_a_finetuned_model(target):
    with pytest.raises(SelfspecError, match="train space"):
        selfspec.load(target, "space", self_test=False)
    with pytest.raises(SelfspecError):
        selfspec.load(target, "space", mask_id=99999, self_test=False)
    assert selfspec.METHODS["space-lossy"].lossless is False
    assert "NOT LOSSLESS" in selfspec.METHODS["space-lossy"].help
