"""MSN training: the noised span (learned tokens only, the last token clean, copies of earlier
tokens, redrawn every time), clean labels, ``span = 0`` = plain SFT, and ``selfspec train msn`` /
``train sft`` end to end on a tiny model: the output loads for ``ar``, ``jacobi`` and ``msn`` with
identical greedy ids, and learning to denoise shows in the validation metrics."""

from __future__ import annotations

import json
import random

import pytest
import torch

import selfspec
import selfspec.train.pipeline as pipeline
from selfspec.cli import main
from selfspec.train.conversations import Example
from selfspec.train.msn import IGNORE, MsnObjective, MsnOptions, noise_example, span_starts

from ..conftest import prompt_ids


def example(n: int = 40, learn_from: int = 10, seed: int = 0) -> Example:
    ids = 100 + torch.arange(n)  # distinct tokens: every copy is traceable
    learn = torch.zeros(n, dtype=torch.bool)
    learn[learn_from:] = True
    return Example(f"e{seed}", ids, learn)


def test_span_starts_stay_in_learned_text_and_spare_the_last_token():
    learn = torch.tensor([0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1])
    assert span_starts(learn, 4) == [2, 7]  # 7..10 leaves index 11 (the last) clean
    assert span_starts(learn, 5) == []
    assert span_starts(torch.ones(3, dtype=torch.long), 4) == []


def test_noise_is_one_span_of_earlier_copies_with_clean_labels():
    e = example()
    obj = MsnObjective(MsnOptions(span=4))
    rng = random.Random(0)
    starts = set()
    for _ in range(300):
        b = obj.make_batch([e], rng)
        inp, tgt, noisy = b["input_ids"][0], b["targets"][0], b["noisy"][0]
        s = int(noisy.nonzero()[0])
        starts.add(s)
        assert noisy.sum() == 4 and noisy[s : s + 4].all() and 10 <= s and s + 4 < 40
        changed = (inp != e.input_ids).nonzero().flatten().tolist()
        assert all(s <= i < s + 4 for i in changed)
        for i in range(s, s + 4):
            assert 100 <= int(inp[i]) < 100 + i  # a copy of an earlier (possibly noised) token
        assert torch.equal(tgt[9:-1], e.input_ids[10:]) and (tgt[:9] == IGNORE).all() and tgt[-1] == IGNORE
    assert starts == set(range(10, 36))  # redrawn each time: every allowed start occurs


def test_accuracy_by_noise_depth():
    """acc{k+1} is scored exactly where the input is the span's k-th noise token; acc1 where it is clean."""
    e = example()
    obj = MsnObjective(MsnOptions(span=3))
    b = obj.make_batch([e], random.Random(3))
    depth = b["noise_depth"][0]
    s = int(b["noisy"][0].nonzero()[0])
    assert depth[s : s + 3].tolist() == [1, 2, 3] and int((depth > 0).sum()) == 3

    class Oracle(torch.nn.Module):
        """Right everywhere except after the 2nd noised input (a known accuracy pattern); its
        "hidden states" are the logits and its output embedding the identity."""

        def __init__(self) -> None:
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(1))  # the loss reads the device from here

        def forward(self, input_ids, attention_mask=None, **kw):
            tgt = b["targets"].clamp(min=0)
            logits = torch.zeros(*input_ids.shape, 256).scatter_(-1, tgt.unsqueeze(-1), 1.0)
            logits[..., 0] += 5.0 * (b["noise_depth"] == 2)  # token 0 wins after the 2nd noise token
            return type("Out", (), {"hidden_states": (logits,)})()

        def get_output_embeddings(self):
            return torch.nn.Identity()

    _, m = obj.loss(Oracle(), b)
    assert m["acc1"] == 1.0 and m["acc2"] == 1.0 and m["acc3"] == 0.0 and m["acc4"] == 1.0
    assert m["n_acc2"] == m["n_acc3"] == m["n_acc4"] == 1 and "acc5" not in m


def test_span_zero_is_plain_sft():
    e = example()
    obj = MsnObjective(MsnOptions(span=0))
    b = obj.make_batch([e], random.Random(0))
    assert obj.name == "sft" and torch.equal(b["input_ids"][0], e.input_ids) and not b["noisy"].any()
    assert noise_example(e.input_ids, e.loss_mask, 4, random.Random(1))[1] >= 10


def test_msn_and_sft_are_validated_on_the_same_noised_batches():
    es = [example(seed=i) for i in range(3)]
    msn, sft = MsnObjective(MsnOptions(span=4)), MsnObjective(MsnOptions(span=0), eval_span=4)
    a, b = msn.make_eval_batch(es, random.Random(7)), sft.make_eval_batch(es, random.Random(7))
    assert all(torch.equal(a[k], b[k]) for k in a) and a["noisy"].sum() == 12
    assert not sft.make_batch(es, random.Random(7))["noisy"].any()  # sft still trains on clean inputs
    assert msn.options() == {"span": 4} and sft.options() == {"span": 0, "eval_span": 4}


@pytest.mark.parametrize("what", ["msn", "sft"])
def test_train_end_to_end(tiny_dir, data_file, tmp_path, monkeypatch, what):
    monkeypatch.setattr(pipeline, "evaluation_prompts", lambda: ["w90 w91"])
    out = tmp_path / what
    assert main(["train", what, "--model", str(tiny_dir), "--data", str(data_file), "--out", str(out),
                 "--max-len", "40", "--batch-size", "4", "--no-progress", "--epochs", "4", "--lr", "3e-3",
                 "--lora-rank", "4", "--span", "3"]) == 0
    meta = json.loads((out / "selfspec_finetune.json").read_text())
    assert meta["method"] == what and meta["new_ids"] == []
    assert meta["validation"]["loss"] < meta["initial_validation"]["loss"]
    # both runs are validated on noised inputs (the same batches), so their denoising compares
    assert "acc_noisy" in meta["validation"] and "acc_noisy" in meta["initial_validation"]
    if what == "msn":
        assert meta["validation"]["noisy"] < meta["initial_validation"]["noisy"]
    ar = selfspec.load(str(out), "ar")
    for method, opts in [("jacobi", dict(m=4, auto_m=False)), ("msn", dict(tree_size=16)), ("msn", {})]:
        g = selfspec.load(ar.target, method, self_test=False, **opts)
        for s in range(3):
            p = prompt_ids(s, 6)
            assert g.generate(p, max_new_tokens=20).token_ids == ar.generate(p, max_new_tokens=20).token_ids


def test_bad_input(tiny_dir, data_file, tmp_path, capsys):
    assert main(["train", "msn", "--model", str(tiny_dir), "--data", str(data_file), "--out",
                 str(tmp_path / "x"), "--no-progress", "--span", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("selfspec: error:") and "--span" in err and "Traceback" not in err
