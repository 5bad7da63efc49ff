"""HASS context alignment and the training losses: the mask rule, pass j == j-step drafting at
inference (fp64), n = 1 == EAGLE, detachment, and the top-K loss's relation to the soft CE."""

from __future__ import annotations

import pytest
import torch

from selfspec.core import kv_cache
from selfspec.heads.eagle import EagleHead
from selfspec.train.hca import HcaModel, hca_mask
from selfspec.train.losses import LossWeights, pass_losses, teacher

from ..conftest import tiny_model

L = 9


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    target = tiny_model("llama", seed=2).double()
    head = EagleHead(target).double()
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    feats = torch.randn(1, L, target.config.hidden_size, dtype=torch.float64)
    tokens = torch.randint(4, 90, (L,))
    emb = target.get_input_embeddings()(tokens)[None].double()
    return target, head, feats, tokens, emb


@pytest.mark.parametrize("j", [1, 2, 3, 4])
def test_mask_rows_see_each_earlier_position_in_exactly_one_set(j):
    m = hca_mask(6, j)
    for i in range(6):
        for p in range(6):
            copies = [c for c in range(j) if m[i, c * 6 + p]]
            if p > i:
                assert copies == []
            else:
                off = i - p
                assert copies == [off if off <= j - 2 else j - 1]  # copy c holds S_{j-1-c}


def chained(head: EagleHead, feats: torch.Tensor, emb: torch.Tensor, t: int, steps: int) -> list[torch.Tensor]:
    """Inference drafting: true features f_0..f_t into a fresh cache, then feed the head's own
    output back ``steps - 1`` times (ground-truth tokens). Returns the outputs of each step."""
    cache = kv_cache.new_cache(head.config)
    n = t + 1
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    out = head(feats[:, :n], emb[:, :n], torch.arange(n)[None], mask, cache)[:, -1]
    outs = [out]
    for s in range(1, steps):
        pos = t + s
        mask = torch.ones(1, 1, 1, pos + 1, dtype=torch.bool)
        out = head(out[:, None], emb[:, pos : pos + 1], torch.tensor([[pos]]), mask, cache)[:, -1]
        outs.append(out)
    return outs


@torch.no_grad()
def test_pass_j_equals_j_step_drafting_fp64(setup):
    target, head, feats, tokens, emb = setup
    n = 3
    preds = HcaModel(head, n)(feats, emb)
    for t in range(L):
        outs = chained(head, feats, emb, t, min(n, L - t))
        for j in range(1, n + 1):
            if t + j - 1 < L:
                err = (preds[j - 1][0, t + j - 1] - outs[j - 1][0]).abs().max().item()
                assert err < 1e-10, f"t={t} j={j}: {err}"


@torch.no_grad()
def test_one_pass_is_the_eagle_forward_and_pass1_ignores_n(setup):
    target, head, feats, tokens, emb = setup
    mask = torch.ones(L, L, dtype=torch.bool).tril()[None, None]
    eagle = head(feats, emb, torch.arange(L)[None], mask)
    assert torch.equal(HcaModel(head, 1)(feats, emb)[0], eagle)
    assert torch.allclose(HcaModel(head, 3)(feats, emb)[0], eagle, atol=1e-12)


def test_earlier_passes_are_detached(setup):
    target, head, feats, tokens, emb = setup
    head.zero_grad()
    preds = HcaModel(head, 2)(feats, emb)
    preds[0].retain_grad()
    preds[1].pow(2).sum().backward()
    assert preds[0].grad is None
    assert head.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0
    assert head.fc.weight.grad.abs().sum() > 0
    head.zero_grad()


def test_topk_loss_bounds_and_monotone():
    torch.manual_seed(1)
    lm = torch.nn.Linear(16, 40, bias=False).double()
    pred, tgt = torch.randn(7, 16, dtype=torch.float64), torch.randn(7, 16, dtype=torch.float64)
    vals = []
    for k in (1, 5, 20, 40):
        t = teacher(lm, tgt, k)
        parts = pass_losses(pred, tgt, lm, t, LossWeights(k=k, topk=1.0))
        vals.append(float(parts["topk"].detach()))
        assert 0 <= parts["topk"] <= parts["cls"] + 1e-12
    assert vals == sorted(vals)
    assert vals[-1] == pytest.approx(float(parts["cls"]), rel=1e-12)  # K = V: the soft CE
