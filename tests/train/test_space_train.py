"""SPACE training: the sample constructor (spec invariant 14), multi-group packing equal to
stand-alone truncated samples (invariant 15), the training mask built by the decoder's layout
function, the loss, and ``selfspec train space`` end to end on a tiny model: the output is a
model that loads for ``ar`` and ``space`` with identical greedy ids."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

import selfspec
import selfspec.train.pipeline as pipeline
from selfspec.cli import main
from selfspec.core.mask_groups import mask_groups
from selfspec.train.conversations import Example
from selfspec.train.space import IGNORE, SpaceObjective, SpaceOptions, cut_points, make_sample, masked_logits

from ..conftest import prompt_ids, tiny_model

M = 95  # the mask id on the 96-token random model


def example(n: int = 50, learn_from: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 90, (n,), generator=g)
    learn = torch.zeros(n, dtype=torch.bool)
    learn[learn_from:] = True
    return ids, learn


def test_truncated_sample_invariants():
    """groups = 1: prompt + resp[:m] + k masks; the anchor predicts the next token; exactly k masks
    carry labels, the k tokens after that; short responses are never masked; SAR rate ~ 1 - p_ar."""
    opts, rng = SpaceOptions(k=5, p_ar=0.5), random.Random(0)
    masked = 0
    for seed in range(400):
        ids, learn = example(seed=seed)
        s = make_sample(ids, learn, opts, rng)
        if not s.anchors:
            assert torch.equal(s.real, ids) and s.targets.numel() == ids.numel()
            continue
        masked += 1
        (a,) = s.anchors
        assert 9 <= a <= 50 - 5 - 2 and torch.equal(s.real, ids[: a + 1])
        n = a + 1
        assert s.targets[a] == ids[a + 1] and s.offsets[a] == 1
        assert s.targets[n:].tolist() == ids[a + 2 : a + 7].tolist() and s.offsets[n:].tolist() == [2, 3, 4, 5, 6]
        assert (s.targets[: 10 - 1] == IGNORE).all()  # prompt tokens are never labels
    assert 0.42 < masked / 400 < 0.58
    ids, learn = example(n=15, learn_from=10)  # a 5-token response < k + 1
    assert all(not make_sample(ids, learn, opts, rng).anchors for _ in range(20))
    assert cut_points([False, True, True, True], 2) == [0]


def test_batch_mask_is_the_decoders_layout():
    obj = SpaceObjective(SpaceOptions(k=3, p_ar=0.0, groups=4))
    obj.bind([M], 0)
    ex = [Example("e", *example(n=30 + 5 * i, seed=i)) for i in range(3)]
    rng = random.Random(1)
    state = rng.getstate()
    batch = obj.make_batch(ex, rng)
    rng.setstate(state)
    samples = [make_sample(e.input_ids, e.loss_mask.bool(), obj.opts, rng) for e in ex]
    n = max(s.real.numel() for s in samples)
    for r, s in enumerate(samples):
        blk, rel = mask_groups(n, s.anchors, 3)
        size = blk.shape[0]
        assert torch.equal(batch["block"][r, :size, :size], blk)
        assert torch.equal(batch["position_ids"][r, n:size], rel)
        assert (batch["input_ids"][r, n:size] == M).all()


def test_multi_group_equals_stand_alone_truncated_samples():
    """The CE at every mask of a packed multi-group sequence equals that of the same group in a
    stand-alone truncated sample; AR positions give the plain model's CE (fp64 model; the
    logits come back as fp32)."""
    model = tiny_model("llama", seed=2).double().eval()
    ids, learn = example(n=40, seed=3)
    k = 3
    obj = SpaceObjective(SpaceOptions(k=k, p_ar=0.0, groups=5))
    obj.bind([M], 0)
    batch = obj.make_batch([Example("e", ids, learn)], random.Random(0))
    sel = batch["targets"] != IGNORE
    with torch.no_grad():
        packed = masked_logits(model, batch["input_ids"], batch["position_ids"], batch["block"], sel)
        t, off = batch["targets"][sel], batch["offsets"][sel]
        plain = model(input_ids=ids[None]).logits[0]
        ar_ref = F.cross_entropy(plain[:-1][learn[1:]], ids[1:][learn[1:]], reduction="none")
        ar_got = F.cross_entropy(packed[off == 1], t[off == 1], reduction="none")
        assert torch.allclose(ar_got, ar_ref.float(), atol=1e-6)
        anchors = [int(a) for a in (batch["position_ids"][0, 40::k] - 1)]
        got = F.cross_entropy(packed[off >= 2], t[off >= 2], reduction="none").view(len(anchors), k)
        for g, a in enumerate(anchors):
            alone = model(input_ids=torch.cat([ids[: a + 1], torch.full((k,), M)])[None]).logits[0, a + 1 :]
            ref = F.cross_entropy(alone, ids[a + 2 : a + 2 + k], reduction="none")
            assert torch.allclose(got[g], ref.float(), atol=1e-6), g


def test_loss_weights_mask_positions():
    model = tiny_model("llama", seed=2).eval()
    ex = [Example("e", *example(n=40, seed=s)) for s in range(4)]
    losses = {}
    for w in (1.0, 0.5):
        obj = SpaceObjective(SpaceOptions(k=3, p_ar=0.0, groups=2, mask_weight=w))
        obj.bind([M], 0)
        with torch.no_grad():
            loss, m = obj.loss(model, obj.make_batch(ex, random.Random(0)))
        losses[w] = (float(loss), m)
    _, m = losses[1.0]
    n_p, n_m = m["n_plain"], m["n_mask"]
    assert losses[1.0][0] == pytest.approx((m["plain"] * n_p + m["mask"] * n_m) / (n_p + n_m), rel=1e-5)
    assert losses[0.5][0] == pytest.approx((m["plain"] * n_p + 0.5 * m["mask"] * n_m) / (n_p + n_m), rel=1e-5)
    assert {"acc1", "acc2", "acc4"} <= set(m)


# ------------------------------------------------------------------------------------------ CLI


@pytest.mark.parametrize("groups", ["1", "4"])
def test_train_space_end_to_end(tiny_dir, data_file, tmp_path, monkeypatch, groups):
    monkeypatch.setattr(pipeline, "evaluation_prompts", lambda: ["w90 w91"])
    out = tmp_path / "space"
    assert main(["train", "space", "--model", str(tiny_dir), "--data", str(data_file), "--out", str(out),
                 "--max-len", "40", "--batch-size", "4", "--no-progress", "--epochs", "4", "--lr", "3e-3",
                 "--lora-rank", "4", "--masks", "3", "--groups", groups]) == 0
    meta = json.loads((out / "selfspec_finetune.json").read_text())
    assert meta["method"] == "space" and meta["new_ids"] == [96]
    assert meta["validation"]["mask"] < meta["initial_validation"]["mask"]
    ar = selfspec.load(str(out), "ar")
    sp = selfspec.load(ar.target, "space", k=3, self_test=False)
    auto = selfspec.load(ar.target, "space", self_test=False)
    for s in range(4):
        p = prompt_ids(s, 6)
        ref = ar.generate(p, max_new_tokens=25, ignore_eos=True).token_ids
        assert sp.generate(p, max_new_tokens=25, ignore_eos=True).token_ids == ref
        assert auto.generate(p, max_new_tokens=25, ignore_eos=True).token_ids == ref


@pytest.mark.parametrize("bad", [["--masks", "0"], ["--p-ar", "1"], ["--groups", "0"]])
def test_bad_input(tiny_dir, data_file, tmp_path, bad, capsys):
    assert main(["train", "space", "--model", str(tiny_dir), "--data", str(data_file), "--out",
                 str(tmp_path / "x"), "--no-progress", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("selfspec: error:") and "Traceback" not in err
