"""The draft controller restores what a drafter learns across requests before every
rejection-sampled request (whose text depends on the draft lengths): a seed reproduces a sample
whatever ran before. Greedy and coupled requests keep learning."""

from __future__ import annotations

import selfspec
from selfspec.decoding.controller import DraftController
from selfspec.models.loading import load_model

KW = dict(max_new_tokens=40, temperature=0.9, chat=False, ignore_eos=True, sampling="rejection")


def _draft_model(tiny_dir, tiny_draft_dir, **opts):
    target = load_model(str(tiny_dir), kernels="stock")
    return selfspec.load(target, "draft-model", draft_model=str(tiny_draft_dir), self_test=False, **opts)


def test_a_rejection_sampled_request_does_not_depend_on_earlier_ones(tiny_dir, tiny_draft_dir):
    fresh = _draft_model(tiny_dir, tiny_draft_dir).generate("w1 w2 w3", seed=5, **KW).token_ids
    g = _draft_model(tiny_dir, tiny_draft_dir)
    for i in range(3):  # earlier requests teach the budget (greedy ones too)
        g.generate(f"w{i + 4} w{i + 7}", seed=i, **{**KW, "sampling": "coupled"})
        g.generate(f"w{i + 4} w{i + 7}", seed=i, **KW)
    assert g.generate("w1 w2 w3", seed=5, **KW).token_ids == fresh


def test_greedy_requests_keep_what_the_drafter_learned(tiny_dir, tiny_draft_dir):
    g = _draft_model(tiny_dir, tiny_draft_dir, auto_k=False)  # drafts every step, whatever the clock says
    before = g.drafter.snapshot()
    g.generate("w1 w2 w3", max_new_tokens=30, chat=False, ignore_eos=True)
    after = g.drafter.snapshot()
    assert after["sizer"].accepted != before["sizer"].accepted  # the budget learned, and kept it
    g.drafter.restore(before)
    assert g.drafter.sizer.accepted == before["sizer"].accepted
    g.drafter.sizer.accepted += 1  # the snapshot is a copy: restoring it twice gives the same state
    g.drafter.restore(before)
    assert g.drafter.sizer.accepted == before["sizer"].accepted


def test_a_new_drafter_brings_its_own_state_and_profile(tiny_dir, tiny_draft_dir):
    g = _draft_model(tiny_dir, tiny_draft_dir)
    c = DraftController(g.drafter)
    assert c.online is not None and c.online.profile is g.drafter.sizer.profile
    ar = selfspec.load(load_model(str(tiny_dir), kernels="stock"), "ar", self_test=False)
    c.drafter = ar.drafter
    assert c.online is None


def test_reset_forgets_what_was_learned_since_adoption(tiny_dir, tiny_draft_dir):
    g = _draft_model(tiny_dir, tiny_draft_dir, auto_k=False)
    start = g.drafter.sizer.accepted
    g.generate("w1 w2 w3", max_new_tokens=30, chat=False, ignore_eos=True)
    assert g.drafter.sizer.accepted != start
    g.controller.reset()
    assert g.drafter.sizer.accepted == start
