"""SDSAT training: the mixed-sequence constructor (spec invariant 13), the loss formula, and
``selfspec train sdsat`` end to end on a tiny model (LoRA and full fine-tuning): the output is a
model that loads for ``ar`` and ``sdsat`` with identical greedy ids, is rebuilt exactly from its
adapter, resumes, and refuses bad input."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import selfspec
import selfspec.train.pipeline as pipeline
from selfspec.cli import main
from selfspec.train.conversations import Example
from selfspec.train.sdsat import IGNORE, SdsatObjective, SdsatOptions, clean_targets, mix_sequence

from ..conftest import prompt_ids, tiny_model

A = 99


def example(n: int = 60, learn_from: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 90, (n,), generator=g)
    learn = torch.zeros(n, dtype=torch.bool)
    learn[learn_from:] = True
    return ids, learn


@pytest.mark.parametrize("loss_at", ["label", "input"])
def test_mixed_sequence_invariants(loss_at):
    opts = SdsatOptions(window=5, loss_at=loss_at)
    rng = random.Random(0)
    replaced_total = eligible_total = 0
    for seed in range(200):
        ids, learn = example(seed=seed)
        m = mix_sequence(ids, learn, [A], opts, rng)
        assert m.input_ids.shape == ids.shape
        changed = m.input_ids != ids
        assert torch.equal(changed, m.adaptive)  # only replaced positions differ, all with A
        assert (m.input_ids[m.adaptive] == A).all()
        assert not m.adaptive[0] and not m.adaptive[~learn].any()  # never position 0 or untrained text
        scored = m.targets != IGNORE
        assert (m.offsets[scored] >= 1).all() and (m.offsets[~scored] == 0).all()
        for i in scored.nonzero().flatten().tolist():
            j = int(m.offsets[i])
            if loss_at == "label":  # output at i predicts label i + 1, which is replaced
                assert m.adaptive[i + 1] and m.targets[i] == ids[i + 1]
            else:  # the output at adaptive input i predicts the original i + 1
                assert m.adaptive[i] and m.targets[i] == ids[i + 1]
            # the offset counts from the last real token at or before i
            assert not m.adaptive[i + 1 - j] and m.adaptive[i + 2 - j : i + 1].all()
        replaced_total += int(m.adaptive.sum())
        eligible_total += int(learn[1:].sum())
    # 10% starts, mean window 3, overlaps merge: about 25% of eligible positions replaced
    assert 0.18 < replaced_total / eligible_total < 0.30


def test_distinct_tokens_follow_the_window_position():
    opts = SdsatOptions(window=3, distinct=True)
    ids, learn = example(n=200)
    m = mix_sequence(ids, learn, [97, 98, 99], opts, random.Random(1))
    for i in m.adaptive.nonzero().flatten().tolist():
        run = 1
        while m.adaptive[i - run]:
            run += 1
        assert m.input_ids[i] == [97, 98, 99][min(run, 3) - 1]


def test_loss_is_half_plain_plus_weighted_adaptive():
    """The clean half's term is the plain HF causal-LM cross-entropy; the mixed half's term is the
    mean cross-entropy at the adaptive targets; loss = 1/2 (plain + w adaptive)."""
    model = tiny_model("llama", seed=2, layers=2, vocab=100)
    obj = SdsatObjective(SdsatOptions(weight=0.7))
    obj.bind([A], 0)
    exs = []
    for s in range(4):
        ids, learn = example(n=30 + s, seed=s)
        exs.append(Example(f"e{s}", ids, learn))
    batch = obj.make_batch(exs, random.Random(3))
    assert int(batch["mixed"].sum()) == 2
    loss, m = obj.loss(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    plain_rows = [r for r in range(4) if not batch["mixed"][r]]
    labels = torch.stack([torch.where(batch["attention_mask"][r].bool(), batch["input_ids"][r], IGNORE)
                          for r in plain_rows])
    for k, r in enumerate(plain_rows):  # HF labels: only learned tokens
        n = exs[r].input_ids.numel()
        labels[k, :n][~exs[r].loss_mask] = IGNORE
    hf = model(input_ids=batch["input_ids"][plain_rows], attention_mask=batch["attention_mask"][plain_rows],
               labels=labels).loss
    sel = batch["mixed"][:, None] & (batch["targets"] != IGNORE)
    adapt = F.cross_entropy(logits[sel], batch["targets"][sel])
    assert torch.isclose(torch.tensor(m["plain"]), hf, atol=1e-5)
    assert torch.isclose(loss, 0.5 * (hf + 0.7 * adapt), atol=1e-5)
    ids, learn = example()
    t = clean_targets(ids, learn)
    assert t[-1] == IGNORE and t[learn_from := 9] == ids[learn_from + 1] and t[0] == IGNORE


# ------------------------------------------------------------------------------------------ CLI


def train(tiny_dir, data_file, out: Path, *extra: str) -> int:
    return main(["train", "sdsat", "--model", str(tiny_dir), "--data", str(data_file), "--out", str(out),
                 "--max-len", "40", "--batch-size", "4", "--no-progress", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_dir, data_file):
    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "evaluation_prompts", lambda: ["w90 w91"])
    out = tmp_path_factory.mktemp("sdsat")
    assert train(tiny_dir, data_file, out / "lora", "--epochs", "6", "--lr", "3e-3", "--lora-rank", "4",
                 "--checkpoint-every", "10") == 0
    assert train(tiny_dir, data_file, out / "full", "--epochs", "2", "--lr", "1e-3", "--lora-rank", "0") == 0
    mp.undo()
    return out


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_finetuned_model_is_a_model(trained, kind):
    d = trained / kind
    meta = json.loads((d / "selfspec_finetune.json").read_text())
    assert meta["method"] == "sdsat" and meta["new_ids"] == [96] and meta["steps"] > 0
    assert (d / "train" / "history.json").is_file() and (d / "train" / "loss.png").is_file()
    ar = selfspec.load(str(d), "ar")
    assert ar.target.model.get_input_embeddings().weight.shape[0] == 97
    sd = selfspec.load(ar.target, "sdsat", k=3, self_test=False)
    auto = selfspec.load(ar.target, "sdsat", self_test=False)  # k from the cost profile and the prior
    for s in range(4):
        p = prompt_ids(s, 6)
        ref = ar.generate(p, max_new_tokens=25, ignore_eos=True).token_ids
        assert sd.generate(p, max_new_tokens=25, ignore_eos=True).token_ids == ref
        assert auto.generate(p, max_new_tokens=25, ignore_eos=True).token_ids == ref


def test_lora_training_learns_to_draft(trained):
    meta = json.loads((trained / "lora" / "selfspec_finetune.json").read_text())
    before, after = meta["initial_validation"], meta["validation"]
    assert after["adapt"] < before["adapt"]
    assert (trained / "lora" / "adapter" / "adapter_model.safetensors").is_file()


def test_adapter_rebuilds_the_model(trained, tiny_dir, tmp_path):
    """``apply_adapter`` (what a bundled fine-tuned model is built with) gives the same weights."""
    from safetensors.torch import load_file

    from selfspec.models.finetuned import apply_adapter

    d = trained / "lora"
    meta = json.loads((d / "selfspec_finetune.json").read_text())
    out = apply_adapter(tiny_dir, d / "adapter", tmp_path / "rebuilt", meta)
    a, b = load_file(str(d / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_and_refusal(trained, tiny_dir, data_file, monkeypatch, capsys):
    monkeypatch.setattr(pipeline, "evaluation_prompts", lambda: ["w90 w91"])
    d = trained / "lora"
    steps = json.loads((d / "selfspec_finetune.json").read_text())["steps"]
    assert train(tiny_dir, data_file, d, "--epochs", "6", "--lr", "3e-3", "--lora-rank", "4",
                 "--checkpoint-every", "10", "--resume") == 0
    assert json.loads((d / "train" / "history.json").read_text())["step"] == steps  # nothing left to do
    assert train(tiny_dir, data_file, d, "--epochs", "6", "--lr", "1e-3", "--lora-rank", "4", "--resume") == 2
    assert "other options" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--window", "0"], ["--clean-fraction", "1"], ["--lora-rank", "-1"],
                                 ["--start-fraction", "0"]])
def test_bad_input(tiny_dir, data_file, tmp_path, bad, capsys):
    assert train(tiny_dir, data_file, tmp_path / "x", *bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("selfspec: error:") and "Traceback" not in err


def test_interrupted_run_resumes_to_the_same_model(tiny_dir, data_file, tmp_path, monkeypatch):
    """Interrupted right after its first checkpoint, then resumed: the same steps, history and
    weights as a run that was never interrupted."""
    from safetensors.torch import load_file

    import selfspec.train.loop as loop_mod

    monkeypatch.setattr(pipeline, "evaluation_prompts", lambda: ["w90 w91"])
    args = ("--max-steps", "6", "--checkpoint-every", "3", "--lr", "3e-3", "--lora-rank", "4")
    assert train(tiny_dir, data_file, tmp_path / "whole", *args) == 0
    real = loop_mod._checkpoint

    def stop_after_first(acc, ckdir, state):
        real(acc, ckdir, state)
        raise KeyboardInterrupt

    monkeypatch.setattr(loop_mod, "_checkpoint", stop_after_first)
    assert train(tiny_dir, data_file, tmp_path / "cut", *args) == 130
    monkeypatch.setattr(loop_mod, "_checkpoint", real)
    assert train(tiny_dir, data_file, tmp_path / "cut", *args, "--resume") == 0
    h_whole = json.loads((tmp_path / "whole" / "train" / "history.json").read_text())["history"]
    h_cut = json.loads((tmp_path / "cut" / "train" / "history.json").read_text())["history"]
    assert [h["step"] for h in h_cut] == list(range(1, 7))
    assert [round(h["loss"], 5) for h in h_cut] == [round(h["loss"], 5) for h in h_whole]
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
