"""Drafters propose, the controller teaches: every sizer (ChainBudget, DraftRule, NodeRates,
TreeSizer) learns only through ``DraftController.observe``, never from its drafter, and each
sizer's ``observe`` reads the step budget's record as its drafter wrote it."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import selfspec
from selfspec.core.acceptance import Verdict
from selfspec.core.tree import DraftTree
from selfspec.decoding.protocol import Budget
from selfspec.decoding.state import StepTime
from selfspec.drafters.backoff import TreeDraft, TreeSizer
from selfspec.drafters.budget import ChainBudget, ChainDraft, PositionalAcceptance
from selfspec.models.loading import load_model

CASES = {  # fixed sizes: they draft on every machine, whatever the clock says
    "pld": dict(auto_k=False, k=4),
    "jacobi": dict(auto_m=False, m=4),
    "self-spec": dict(skip_attention=(1,), skip_mlp=(0,), auto_k=False, k=3),
    "msn": dict(tree_size=16),
    "eagle2": dict(head="random:0", total_tokens=10, top_k=3, depth=3, min_prob=0.0),
}


def learned(sizer) -> bytes:
    """The sizer's state, less the scratch of the draft in progress (DraftRule's running product)."""
    s = copy.deepcopy(sizer)
    if hasattr(s, "p_all"):
        s.p_all = 1.0
    return pickle.dumps(s)


@pytest.mark.parametrize("method", list(CASES))
def test_only_the_controller_teaches_the_sizer(tiny_dir, method):
    target = load_model(str(tiny_dir), kernels="stock")
    prompt = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"  # repeats: prompt lookup finds drafts
    kw = dict(max_new_tokens=24, chat=False, ignore_eos=True)
    g = selfspec.load(target, method, self_test=False, **CASES[method])
    before = learned(g.drafter.sizer)
    g.controller.observe = lambda *a: None  # the controller no longer feeds the sizer
    g.generate(prompt, **kw)
    assert learned(g.drafter.sizer) == before, "the drafter taught its own sizer"
    del g.controller.observe  # the negative control: fed by the controller, it learns
    g.generate(prompt, **kw)
    assert learned(g.drafter.sizer) != before


def _chain(n: int) -> DraftTree:
    return DraftTree.chain(list(range(n + 1)))


def test_chain_budget_learns_draft_cost_only_from_a_drafted_record():
    b = ChainBudget(None, 4)
    acc, rej = b.accepted, b.rejected
    b.observe(Budget(b), _chain(3), Verdict([0, 1], 9), StepTime(0.5, 1.0))  # copied drafts: acceptance only
    assert (b.accepted, b.rejected) == pytest.approx((acc * b.decay + 1, rej * b.decay + 1)) and b.draft_cost == 0
    b.observe(Budget(b, ChainDraft(4, (0.9, 0.8, 0.2, 0.1))), _chain(2), Verdict([0, 1, 2], 9),
              StepTime(0.4, 1.0))
    assert b.draft_cost == pytest.approx(0.1)  # 0.4 s for 4 drafted tokens (2 verified)
    cost = b.draft_cost
    b.observe(Budget(b, ChainDraft(2, (0.9, 0.8))), _chain(2), Verdict([0], 9), StepTime())  # rejection
    assert b.draft_cost == cost


def test_positional_acceptance_learns_along_the_verified_depth():
    p = PositionalAcceptance(None, 4, [0.5] * 4)
    start = p.rates()
    p.observe(Budget(p), _chain(0), Verdict([0], 9), StepTime(0.1, 0.2))  # a draft step: nothing verified
    assert p.rates() == start
    p.observe(Budget(p), _chain(3), Verdict([0, 1, 2, 3], 9), StepTime(0.1, 0.2))
    assert all(a > b for a, b in zip(p.rates()[:3], start[:3])) and p.rates()[3] == start[3]


def test_tree_sizer_calibrates_every_drafted_node_and_times_drafted_and_backed_off_steps():
    from selfspec.core.cost import CostProfile

    s = TreeSizer(CostProfile((1, 2, 5), (0.1, 0.15, 0.3), 256, "k"))
    tree = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]))  # two children of the root
    hits = list(s.calibration.hits)
    s.observe(Budget(s, TreeDraft((0.55, 0.35))), tree, Verdict([0, 2], 9), StepTime())
    assert s.calibration.hits[5] == pytest.approx(hits[5] * s.calibration.decay)  # node 1: tested, rejected
    assert s.calibration.hits[3] == pytest.approx(hits[3] * s.calibration.decay + 1)  # node 2: accepted
    assert s.backoff.steps == 0  # no seconds under rejection sampling
    s.observe(Budget(s, TreeDraft((0.55, 0.35))), tree, Verdict([0, 2], 9), StepTime(0.05, 0.2))
    assert s.backoff.steps == 1 and s.backoff.tokens > 0
    s.observe(Budget(s), _chain(0), Verdict([0], 9), StepTime(0.0, 0.12))  # a plain step while drafting is on
    assert s.backoff.plain_seconds == 0.0
    s.backoff.off = True
    s.observe(Budget(s), _chain(0), Verdict([0], 9), StepTime(0.0, 0.12))  # backed off: what drafting must beat
    assert s.backoff.plain_seconds == pytest.approx(0.12)
