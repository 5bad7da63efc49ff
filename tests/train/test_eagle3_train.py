"""``selfspec train hass --arch eagle3`` end to end on a tiny model: data -> fused-layer features (their
own cache) -> training-time test on the shared loop -> an EAGLE-3 head that decodes losslessly and
accepts more drafts than an untrained one -> vLLM / SGLang exports; an interrupted run resumes to the
same head, HASS's options, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import selfspec
import selfspec.train.loop as loop
import selfspec.train.pipeline as pipeline
from selfspec.cli import main
from selfspec.heads.checkpoints import load_draft_head
from selfspec.heads.eagle3 import Eagle3Head
from selfspec.models.loading import load_model
from selfspec.train.eagle3 import Eagle3Options, train_eagle3
from selfspec.train.features import read_sequences

from .test_train_cli import data_file  # noqa: F401  (the self-distilled conversations)

EVAL = ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15"]


def train(tiny_dir, data_file, out: Path, *extra: str) -> int:  # noqa: F811
    return main(["train", "hass", "--arch", "eagle3", "--model", str(tiny_dir), "--data", str(data_file),
                 "--out", str(out), "--max-len", "48", "--batch-size", "4", "--no-progress", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_dir, data_file):  # noqa: F811
    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "evaluation_prompts", lambda: EVAL)
    out = tmp_path_factory.mktemp("heads3")
    feats = out / "features"
    assert train(tiny_dir, data_file, out / "eagle3", "--features", str(feats), "--objective", "eagle",
                 "--passes", "3", "--draft-vocab", "40", "--epochs", "20", "--lr", "3e-3",
                 "--checkpoint-every", "40") == 0
    assert train(tiny_dir, data_file, out / "hass3", "--features", str(feats), "--passes", "2",
                 "--draft-vocab", "40", "--epochs", "2", "--lr", "3e-3") == 0
    mp.undo()
    return out


def test_outputs_metadata_and_the_feature_cache(trained):
    meta = json.loads((trained / "eagle3" / "selfspec_head.json").read_text())
    assert meta["head_arch"] == "eagle3" and meta["method"] == "eagle2" and meta["feature_layers"] == [0, 1, 2]
    opts = meta["options"]
    assert opts["steps"] == 3 and opts["topk_weight"] == 0.0 and opts["detach"] is False and opts["noise"] == 0.0
    assert 40 <= meta["draft_vocab_size"] <= 41  # the 40 most frequent learned tokens, plus EOS
    hass = json.loads((trained / "hass3" / "selfspec_head.json").read_text())
    assert hass["method"] == "hass" and hass["options"]["detach"] is True and hass["options"]["topk_weight"] == 1.0
    state = load_file(str(trained / "eagle3" / "model.safetensors"))
    assert state["lm_head.weight"].shape[0] == meta["draft_vocab_size"] == state["d2t"].numel()
    hist = json.loads((trained / "eagle3" / "train" / "history.json").read_text())
    first, last = hist["history"][0]["loss"], hist["history"][-1]["loss"]
    assert last < 0.9 * first  # it learned something
    assert set(hist["val"][-1]) >= {"acc1", "acc2", "acc3", "cls1", "topk3"}
    assert (trained / "eagle3" / "train" / "loss.png").stat().st_size > 1000
    # the fused features have their own cache, keyed by the layers; both heads shared it
    cache = trained / "features" / "eagle3-0-1-2"
    settings = json.loads((cache / "manifest.json").read_text())["settings"]
    assert settings["layers"] == [0, 1, 2]
    seq = next(read_sequences(cache))
    assert seq.features.shape[-1] == 3 * 64 and seq.last.shape[-1] == 64
    assert not (trained / "features" / "manifest.json").exists()  # no EAGLE-2 cache was made


def test_trained_head_is_lossless_accepts_drafts_and_exports(trained, tiny_dir, data_file, tmp_path):  # noqa: F811
    ar = selfspec.load(str(tiny_dir), "ar", self_test=False)
    opts = dict(total_tokens=8, top_k=2, depth=3, self_test=False)
    eagle3 = selfspec.load(str(tiny_dir), "eagle2", head=str(trained / "eagle3"), **opts)
    hass3 = selfspec.load(str(tiny_dir), "hass", head=str(trained / "hass3"), **opts)
    rnd = selfspec.load(str(tiny_dir), "eagle2", head="random-eagle3:0", **opts)
    assert isinstance(eagle3.drafter.head, Eagle3Head) and eagle3.drafter.lm_head.size == 40 + 1
    taus, rtaus = [], []
    for line in data_file.read_text().splitlines()[:6]:
        prompt = json.loads(line)["messages"][0]["content"]
        ref = ar.generate(prompt, max_new_tokens=24).token_ids
        r = eagle3.generate(prompt, max_new_tokens=24)
        assert r.token_ids == ref
        assert hass3.generate(prompt, max_new_tokens=24).token_ids == ref
        taus.append(r.mean_accepted)
        rtaus.append(rnd.generate(prompt, max_new_tokens=24).mean_accepted)
    assert sum(taus) / len(taus) > sum(rtaus) / len(rtaus) + 0.2
    for engine in ("vllm", "sglang"):
        assert main(["export", str(trained / "eagle3"), "--model", str(tiny_dir), "--engine", engine,
                     "--out", str(tmp_path / engine)]) == 0
        cfg = json.loads((tmp_path / engine / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 41


def test_interrupted_run_resumes_to_the_same_head(trained, tiny_dir, tmp_path, monkeypatch):
    target = load_model(str(tiny_dir)).model
    seqs = list(read_sequences(trained / "features" / "eagle3-0-1-2"))
    opts = Eagle3Options(steps=2, draft_vocab=40, feature_layers=(0, 1, 2), epochs=1, lr=3e-3, batch_size=4,
                         noise=0.05, checkpoint_every=3, topk_weight=0.5)

    def run(out: Path, resume: bool = False) -> dict:
        from accelerate import Accelerator

        return train_eagle3(target, seqs, out, opts, {"target": "tiny"}, resume=resume, progress=False,
                            accelerator=Accelerator(cpu=True))

    whole = run(tmp_path / "whole")
    assert whole["steps"] == 10  # 38 training sequences: 10 batches of at most 4
    real = loop._checkpoint
    calls = []

    def stop_at_second(acc, ckdir, state):
        real(acc, ckdir, state)
        calls.append(state["step"])
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_checkpoint", stop_at_second)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut")
    monkeypatch.setattr(loop, "_checkpoint", real)
    assert calls == [3, 6] and not (tmp_path / "cut" / "model.safetensors").exists()
    run(tmp_path / "cut", resume=True)
    a = load_file(str(tmp_path / "whole" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hist = [json.loads((tmp_path / d / "train" / "history.json").read_text()) for d in ("whole", "cut")]
    strip = [[{k: v for k, v in h.items() if k != "seconds"} for h in x["history"]] for x in hist]
    assert strip[0] == strip[1] and hist[0]["val"] == hist[1]["val"]
    # --init continues the head; other options on --resume are refused
    head, _ = load_draft_head(tmp_path / "whole", target)
    assert isinstance(head, Eagle3Head)
    from selfspec.errors import SelfspecError

    with pytest.raises(SelfspecError, match="other options"):
        train_eagle3(target, seqs, tmp_path / "cut", Eagle3Options(**{**opts.__dict__, "lr": 1e-3}), {},
                     resume=True, progress=False)


def test_bad_input_is_one_line(trained, tiny_dir, data_file, tmp_path, capsys):  # noqa: F811
    feats = ["--features", str(trained / "features")]
    cases = [
        (["--feature-layers", "1,2"], "three comma-separated"),
        (["--feature-layers", "0,1,3"], "three hidden-state indices in [0, 2]"),
        (["--init", str(trained / "missing")], "does not exist"),
    ]
    for extra, msg in cases:
        assert train(tiny_dir, data_file, tmp_path / "x", *feats, "--epochs", "1", *extra) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
    assert main(["train", "hass", "--model", str(tiny_dir), "--data", str(data_file), "--out", str(tmp_path / "y"),
                 "--feature-layers", "0,1,2", "--no-progress"]) == 2
    assert "applies to --arch eagle3" in capsys.readouterr().err
