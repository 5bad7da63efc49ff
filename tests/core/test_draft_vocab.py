"""Reduced draft vocabularies: the EAGLE-3 maps, the subset LM head, the ranking file's rules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from selfspec.core.draft_vocab import DraftVocab, ranking_from_counts
from selfspec.errors import SelfspecError


def test_d2t_and_t2d_follow_eagle3_and_round_trip():
    dv = DraftVocab([7, 2, 9, 2, 0], vocab_size=12)
    assert dv.ids.tolist() == [0, 2, 7, 9] and dv.size == 4
    d2t = dv.d2t()
    assert (torch.arange(4) + d2t).tolist() == [0, 2, 7, 9] and (d2t >= 0).all()
    assert dv.t2d().nonzero().flatten().tolist() == [0, 2, 7, 9]
    assert DraftVocab.from_d2t(d2t, 12).ids.tolist() == dv.ids.tolist()
    assert dv.to_target(torch.tensor([[3, 0]])).tolist() == [[9, 0]]


@pytest.mark.parametrize("bias", [False, True])
def test_expand_puts_minus_infinity_outside_and_head_rows_match(bias):
    torch.manual_seed(0)
    lm = nn.Linear(8, 12, bias=bias)
    dv = DraftVocab([1, 5, 6], 12)
    rows = [1, 5, 6]
    head = dv.head(lm)
    # the subset head holds exactly the target head's rows (copied, never recomputed)
    assert torch.equal(head.weight, lm.weight[rows]) and not head.weight.requires_grad
    assert (head.bias is None) if not bias else torch.equal(head.bias, lm.bias[rows])
    h = torch.randn(2, 8)
    small = head(h)
    # a [2, 3] product against a [2, 12] one: the float sums may differ in the last bits on some
    # CPUs (AMX), so the outputs agree to rounding, not bit for bit
    torch.testing.assert_close(small, lm(h)[:, rows], rtol=1e-6, atol=1e-6)
    full = dv.expand(small)
    outside = [i for i in range(12) if i not in rows]
    assert full.shape == (2, 12) and (full[:, outside] == float("-inf")).all()
    assert torch.equal(full[:, dv.ids], small)  # expand only places the values: exact
    q = full.softmax(-1)
    assert float(q[:, outside].sum()) == 0.0 and torch.allclose(q.sum(-1), torch.ones(2))


def test_from_ranking_always_keeps_required_tokens():
    dv = DraftVocab.from_ranking([4, 3, 8, 1], 2, vocab_size=10, always=[9, 3])
    assert dv.ids.tolist() == [3, 4, 9]
    with pytest.raises(ValueError):
        DraftVocab([10], 10)


def test_ranking_orders_by_counts_then_prior_then_id():
    counts = torch.tensor([0, 5, 0, 5, 1, 0])
    assert ranking_from_counts(counts) == [1, 3, 4, 0, 2, 5]  # equal counts: lower id first
    prior = torch.tensor([0, 0, 2, 0, 0, 1])  # scaled to the own total: adds 7.3 and 3.7
    assert ranking_from_counts(counts, prior) == [2, 1, 3, 5, 4, 0]


def test_missing_ranking_is_a_one_line_error(tiny_dir, tmp_path, monkeypatch):
    import selfspec
    from selfspec.models.loading import load_model

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))  # other tests write rankings for this model's name
    t = load_model(str(tiny_dir))
    with pytest.raises(SelfspecError, match="no draft vocabulary ranking"):
        selfspec.load(t, "hass", head="random:0", draft_vocab=16, self_test=False)
