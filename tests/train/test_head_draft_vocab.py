"""Training a head over a reduced draft vocabulary (issue 21): the teacher is restricted to the
subset, the vocabulary is the training data's most frequent learned tokens plus EOS, and the
saved head carries its ``d2t`` map and loads with it."""

from __future__ import annotations

import torch
from torch import nn

from selfspec.heads.eagle import load_head, read_meta
from selfspec.train.features import CachedSequence
from selfspec.train.losses import teacher
from selfspec.train.trainer import TrainOptions, train_head, training_vocab

from ..conftest import VOCAB, tiny_model


def test_teacher_restricted_to_the_subset():
    torch.manual_seed(0)
    lm = nn.Linear(8, 10, bias=False)
    x = torch.randn(5, 8)
    full = teacher(lm, x, 3)
    ids = torch.tensor([1, 4, 7])
    t = teacher(lm, x, 2, ids)
    assert torch.equal(t.probs, full.probs[:, ids])
    for r in range(5):
        a = int(full.argmax[r])
        assert int(t.argmax[r]) == (ids.tolist().index(a) if a in ids.tolist() else -1)


def sequences(model, n: int = 6, length: int = 24) -> list[CachedSequence]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(3, 30, (length,), generator=g)  # learned tokens use ids 3..29 only
        with torch.no_grad():
            f = model.model(input_ids=ids[None]).last_hidden_state[0]
        out.append(CachedSequence(ids, torch.ones(length, dtype=torch.bool), f))
    return out


def test_train_head_with_reduced_vocab_saves_d2t(tmp_path):
    target = tiny_model("llama", seed=0, layers=2)
    seqs = sequences(target)
    vocab = training_vocab(target, seqs, 12)
    assert 2 in vocab.ids.tolist()  # EOS always
    assert set(vocab.ids.tolist()) - {2} <= set(range(3, 30))
    opts = TrainOptions(objective="hass", passes=2, epochs=1, batch_size=2, draft_vocab=12, checkpoint_every=1000)
    train_head(target, seqs, tmp_path, opts, {"target": "tiny"}, progress=False)
    meta = read_meta(tmp_path)
    assert meta["draft_vocab_size"] == vocab.size
    head, _ = load_head(tmp_path, target)
    assert head.draft_vocab is not None and head.draft_vocab.ids.tolist() == vocab.ids.tolist()
    assert VOCAB > vocab.size
