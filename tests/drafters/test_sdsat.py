"""``sdsat`` drafter pieces: the paper's tree, ordered samples without replacement, the k budget,
context isolation of the draft step, the per-loop emission bounds, the guard on non-lossless
acceptance rules, and errors."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.core import kv_cache
from selfspec.core.cost import CostProfile
from selfspec.core.tree import DraftTree
from selfspec.decoding import loop
from selfspec.decoding.protocol import Proposal
from selfspec.drafters.budget import PositionalAcceptance
from selfspec.drafters.sdsat import (
    PAPER_TREE,
    ordered_sample,
    parse_tree,
    tree_shape,
    without,
)
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model

from ..conftest import VOCAB, prompt_ids

ADAPTIVE = VOCAB - 1


@pytest.fixture(scope="module")
def target(tiny_dir):
    return load_model(str(tiny_dir))


def test_paper_tree_shape():
    """The official code's depth-5 tree: 4/8/8/5/3 nodes per depth (28 + root), 17 leaf paths,
    parents before children, and every parent's children are a prefix of its depth's list."""
    parents, depths, ranks = tree_shape(parse_tree(PAPER_TREE))
    assert len(parents) == 29
    assert [depths.count(d) for d in range(1, 6)] == [4, 8, 8, 5, 3]
    tree = DraftTree(torch.zeros(29, dtype=torch.long), torch.tensor(parents))
    assert len(tree.paths) == 17
    for node, kids in enumerate(tree.children):
        assert [ranks[c] for c in kids] == list(range(len(kids)))
        assert all(depths[c] == depths[node] + 1 for c in kids)


@pytest.mark.parametrize("bad", ["x", "4;3,-1", "2,2;1"])
def test_bad_tree_spec(bad):
    with pytest.raises(SelfspecError):
        parse_tree(bad)


def test_ordered_sample_without_replacement():
    q = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    firsts = torch.zeros(5)
    for _ in range(4000):
        s = ordered_sample(q, 10, g)
        assert sorted(s) == [0, 2, 3]  # the whole support, no zero-probability token, no repeat
        firsts[s[0]] += 1
    assert torch.allclose(firsts / 4000, q, atol=0.03)  # the first draw is a draw from q
    r = without(q, [0])
    assert r[0] == 0 and torch.isclose(r.sum(), torch.tensor(1.0)) and torch.isclose(r[2], torch.tensor(0.6))


def test_budget_chooses_k_from_cost_and_acceptance():
    flat = CostProfile((1, 2, 4, 8, 16), (0.01,) * 5, 256, "t")
    steep = CostProfile((1, 2, 4, 8, 16), (0.01, 0.02, 0.04, 0.08, 0.16), 256, "t")
    assert PositionalAcceptance(flat, 8, prior=[0.9] * 8).choose(10) == 8  # free verification: draft all
    b = PositionalAcceptance(steep, 8, prior=[0.1] * 8, first_probe=3)
    assert [b.choose(10) for _ in range(3)] == [0, 0, 1]  # never pays: plain steps, with a probe
    b = PositionalAcceptance(flat, 4, prior=[0.5] * 4)
    for _ in range(100):
        b.update(4, 4)
    assert min(b.rates()) > 0.95
    assert PositionalAcceptance(None, 3).choose(2) == 2  # fixed k, capped by the room


def test_draft_step_context_isolation(target):
    """The logits at the pending token are the same with k adaptive tokens after it (plain
    causal piggyback) as in a one-token forward."""
    g = selfspec.load(target, "sdsat", adaptive_ids=str(ADAPTIVE), k=4, self_test=False)
    seen = {}
    inner_verify = loop.verify

    def spy(state, runner, proposal, want_hidden):
        out = inner_verify(state, runner, proposal, want_hidden)
        if proposal.piggyback is not None and "with" not in seen:
            import copy

            cache = copy.deepcopy(state.cache)
            kv_cache.truncate(cache, out.base)  # drop the rows this forward wrote
            alone = runner.forward(cache, proposal.tree.tokens, proposal.tree.depths + out.base, None, False,
                                   out.base)
            seen["with"], seen["alone"] = out.tree_logits[0], alone.logits[0]
            assert out.piggyback_logits.shape == (4, VOCAB)
        return out

    loop.verify = spy
    try:
        g.generate(prompt_ids(3, 9), max_new_tokens=12)
    finally:
        loop.verify = inner_verify
    assert torch.allclose(seen["with"], seen["alone"], atol=1e-5)


def test_loop_emission_bounds(target):
    """Draft steps commit exactly one token, verify steps 1..k+1; prefill + 2 forwards per loop."""
    k = 3
    g = selfspec.load(target, "sdsat", adaptive_ids=str(ADAPTIVE), k=k, self_test=False)
    r = g.generate(prompt_ids(5, 6), max_new_tokens=40, ignore_eos=True)
    per = r.committed_per_step
    assert per[0] == 1  # the prompt forward
    body = per[1:]
    assert all(c == 1 for c in body[0::2])  # draft steps
    assert all(1 <= c <= k + 1 for c in body[1::2])  # verify steps
    assert all(d == 0 for d in r.drafted_per_step[1::2])
    assert all(1 <= d <= k for d in r.drafted_per_step[2::2])
    assert sum(per) == r.new_tokens == 40


def test_lossy_rule_refused_for_a_lossless_drafter(target):
    from selfspec.core.acceptance import Verdict

    g = selfspec.load(target, "sdsat", adaptive_ids=str(ADAPTIVE), k=2, self_test=False)
    d = g.drafter
    d.propose = lambda state, budget: Proposal(DraftTree.chain([state.pending]), accept_rule=lambda *a: Verdict([0], 5))
    with pytest.raises(RuntimeError, match="registered lossless"):
        g.generate([4, 5, 6], max_new_tokens=3, temperature=1.0, seed=0)


def test_needs_a_finetuned_model(target):
    with pytest.raises(SelfspecError, match="train sdsat"):
        selfspec.load(target, "sdsat", self_test=False)
    with pytest.raises(SelfspecError, match="adaptive"):
        selfspec.load(target, "sdsat", adaptive_ids="99999", self_test=False)
    with pytest.raises(SelfspecError):
        selfspec.load(target, "sdsat", adaptive_ids=str(ADAPTIVE), tree="1;x", self_test=False)
    assert selfspec.METHODS["sdsat-lossy"].lossless is False
    assert "NOT LOSSLESS" in selfspec.METHODS["sdsat-lossy"].help


def test_sampling_tree_cost_and_depth(target):
    """The fixed sampling tree is priced at its size; a fixed k cuts it to depth k."""
    steep = CostProfile((1, 2, 4, 8, 32), (0.01, 0.011, 0.012, 0.015, 0.05), 256, "t")
    b = PositionalAcceptance(steep, 8, prior=[0.6] * 8, first_probe=100)
    assert b.choose(10) > 0 and b.choose(10, (5, 29)) == 0  # a chain pays, the 29-node tree does not
    g = selfspec.load(target, "sdsat", adaptive_ids=str(ADAPTIVE), k=2, self_test=False)
    r = g.generate(prompt_ids(2, 5), max_new_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    verify_depths = r.drafted_per_step[2::2]
    assert verify_depths and max(verify_depths) <= 2 and r.new_tokens == 30
