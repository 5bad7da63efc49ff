"""``selfspec train hass`` end to end on a tiny model: data -> features -> training -> a head that
decodes losslessly; resume, a 2-process ``accelerate launch`` run, and bad input."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import selfspec
import selfspec.train.pipeline as pipeline
from selfspec.cli import main
from selfspec.models.loading import load_model

from ..conftest import WORDS


@pytest.fixture(scope="module")
def data_file(tmp_path_factory, tiny_dir) -> Path:
    """Conversations whose answers are the tiny model's own greedy continuations (self-distilled),
    so a head can learn to predict them."""
    t = load_model(str(tiny_dir))
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "conv.jsonl"
    with open(path, "w") as f:
        for i in range(40):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            ids = t.tokenizer(prompt, return_tensors="pt").input_ids
            out = t.model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
            answer = t.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            f.write(json.dumps({"id": f"c{i}", "messages": [{"role": "user", "content": prompt},
                                                            {"role": "assistant", "content": answer}]}) + "\n")
    return path


def train(tiny_dir, data_file, out: Path, *extra: str) -> int:
    return main(["train", "hass", "--model", str(tiny_dir), "--data", str(data_file), "--out", str(out),
                 "--max-len", "48", "--batch-size", "4", "--no-progress", *extra])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_dir, data_file):
    mp = pytest.MonkeyPatch()
    mp.setattr(pipeline, "evaluation_prompts", lambda: ["w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15"])
    out = tmp_path_factory.mktemp("heads")
    feats = out / "features"
    assert train(tiny_dir, data_file, out / "hass", "--features", str(feats), "--epochs", "12", "--lr", "3e-3",
                 "--checkpoint-every", "20") == 0
    assert train(tiny_dir, data_file, out / "eagle", "--features", str(feats), "--objective", "eagle",
                 "--epochs", "2", "--lr", "3e-3") == 0
    mp.undo()
    return out


def test_outputs_and_metadata(trained):
    meta = json.loads((trained / "hass" / "selfspec_head.json").read_text())
    assert meta["method"] == "hass" and meta["options"]["passes"] == 3 and meta["options"]["topk_weight"] == 1.0
    assert json.loads((trained / "eagle" / "selfspec_head.json").read_text())["options"]["passes"] == 1
    assert (trained / "hass" / "train" / "loss.png").stat().st_size > 1000
    hist = json.loads((trained / "hass" / "train" / "history.json").read_text())
    first, last = hist["history"][0]["loss"], hist["history"][-1]["loss"]
    assert last < first  # it learned something
    assert set(hist["val"][-1]) >= {"acc1", "acc2", "acc3"}


def test_trained_head_is_lossless_and_accepts_drafts(trained, tiny_dir, data_file):
    ar = selfspec.load(str(tiny_dir), "ar", self_test=False)
    hass = selfspec.load(str(tiny_dir), "hass", head=str(trained / "hass"), total_tokens=8, top_k=2, depth=3,
                         self_test=False)
    rnd = selfspec.load(str(tiny_dir), "hass", head="random:0", total_tokens=8, top_k=2, depth=3, self_test=False)
    taus, rtaus = [], []
    for line in data_file.read_text().splitlines()[:6]:
        prompt = json.loads(line)["messages"][0]["content"]
        ref = ar.generate(prompt, max_new_tokens=24)
        r = hass.generate(prompt, max_new_tokens=24)
        assert r.token_ids == ref.token_ids
        taus.append(r.mean_accepted)
        rtaus.append(rnd.generate(prompt, max_new_tokens=24).mean_accepted)
    assert sum(taus) / len(taus) > sum(rtaus) / len(rtaus) + 0.3


def test_resume_continues_from_the_checkpoint(trained, tiny_dir, data_file):
    out = trained / "hass"
    steps = json.loads((out / "train" / "history.json").read_text())["step"]
    assert train(tiny_dir, data_file, out, "--features", str(trained / "features"), "--epochs", "12", "--lr", "3e-3",
                 "--checkpoint-every", "20", "--resume") == 0
    assert json.loads((out / "train" / "history.json").read_text())["step"] == steps  # nothing left to do
    assert train(tiny_dir, data_file, out, "--features", str(trained / "features"), "--epochs", "12", "--lr", "1e-3",
                 "--checkpoint-every", "20", "--resume") == 2  # other options: refused, one line


def test_two_processes_with_accelerate_launch(trained, tiny_dir, data_file, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    # one machine, no GPU: --multi_gpu picks the torchrun launcher; Accelerate runs MULTI_CPU (gloo)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "selfspec.cli", "train", "hass", "--model", str(tiny_dir), "--data", str(data_file),
           "--out", str(tmp_path / "ddp"), "--features", str(trained / "features"), "--max-len", "48",
           "--batch-size", "2", "--epochs", "1", "--no-progress", "--threads", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    meta = json.loads((tmp_path / "ddp" / "selfspec_head.json").read_text())
    # 2 processes x batch 2 per step: half the steps of one process at batch 2
    n_train = meta["sequences"] - max(1, int(meta["sequences"] * 0.05))
    assert meta["steps"] == (n_train // 2) // 2
    ar = selfspec.load(str(tiny_dir), "ar", self_test=False)
    h = selfspec.load(str(tiny_dir), "hass", head=str(tmp_path / "ddp"), total_tokens=6, top_k=2, self_test=False)
    assert h.generate("w3 w4 w5", max_new_tokens=16).token_ids == ar.generate("w3 w4 w5", max_new_tokens=16).token_ids


def test_bad_input_is_one_line(tiny_dir, data_file, tmp_path, capsys):
    assert train(tiny_dir, data_file, tmp_path / "x", "--objective", "medusa") == 2
    assert "eagle or hass" in capsys.readouterr().err
    assert main(["train", "hass", "--model", str(tiny_dir), "--data", "nosuch:3", "--out", str(tmp_path / "y"),
                 "--no-progress"]) == 2
    assert "neither" in capsys.readouterr().err
    with pytest.raises(Exception, match="not a selfspec draft head"):
        selfspec.load(str(tiny_dir), "hass", head=str(tmp_path), self_test=False)
    torch.manual_seed(0)


def test_self_distillation_replaces_answers_and_resumes(tiny_dir, data_file, tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "evaluation_prompts", lambda: [])
    args = ["--regenerate", "6", "--epochs", "1", "--features", str(tmp_path / "f")]
    assert train(tiny_dir, data_file, tmp_path / "h", *args) == 0
    answers = [json.loads(line) for line in (tmp_path / "f" / "answers.jsonl").read_text().splitlines()]
    assert len(answers) == 40 and all(len(a["answer"].split()) <= 6 for a in answers)
    assert train(tiny_dir, data_file, tmp_path / "h2", *args) == 0  # cached answers and features reused
    assert len((tmp_path / "f" / "answers.jsonl").read_text().splitlines()) == 40


@pytest.mark.parametrize("objective,left", [
    ("hass", "train/checkpoints/step_40/trainer_state.json"),  # interrupted at step 40
    ("hass", "selfspec_head.json"),  # a finished head
    ("sdsat", "train/checkpoints/step_40/trainer_state.json"),
    ("sdsat", "selfspec_finetune.json"),  # a finished model
])
def test_training_into_an_earlier_run_without_resume_is_refused_before_loading(refuse_loading, tmp_path, capsys,
                                                                              objective, left):
    """One forgotten --resume used to restart at step 0 and delete the checkpoints (or overwrite a
    finished head): now one line that names --resume and --out, exit 2, every file kept, and the
    model is not even loaded."""
    out = tmp_path / "run"
    (out / left).parent.mkdir(parents=True, exist_ok=True)
    (out / left).write_text('{"step": 40}')
    (out / "features").mkdir()
    (out / "features" / "shard_0.pt").write_text("x")
    before = sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file())
    code = main(["train", objective, "--model", "any-model", "--data", "code:4", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("selfspec: error: --out ")
    assert "--resume" in err and "another --out" in err and "Traceback" not in err
    assert sorted((p.relative_to(out), p.read_bytes()) for p in out.rglob("*") if p.is_file()) == before


@pytest.mark.parametrize("data,says", [("/no/such/conv.jsonl", "--data file /no/such/conv.jsonl not found"),
                                       ("missing.jsonl", "--data file missing.jsonl not found"),
                                       ("code:4,sharegpt:x", "must be an integer")])
def test_bad_data_is_named_before_loading(refuse_loading, tmp_path, capsys, data, says):
    assert main(["train", "hass", "--model", "m", "--data", data, "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


@pytest.mark.parametrize("objective", ["hass", "sdsat"])
def test_an_out_that_cannot_be_created_is_one_line_before_loading(refuse_loading, tmp_path, capsys, objective):
    (tmp_path / "a-file").write_text("")
    assert main(["train", objective, "--model", "m", "--data", "code:4", "--out", str(tmp_path / "a-file" / "x"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--out" in err and "is a file, not a directory" in err


@pytest.mark.parametrize("objective,flag,value,says", [
    ("hass", "--epochs", "0", "--epochs must be at least 1, not 0"),
    ("sdsat", "--epochs", "0", "--epochs must be at least 1, not 0"),
    ("hass", "--max-steps", "-1", "--max-steps must be at least 0, not -1"),
    ("hass", "--lr", "0", "--lr must be > 0, not 0.0"),
])
def test_a_bad_number_names_its_one_flag(refuse_loading, tmp_path, capsys, objective, flag, value, says):
    """`--epochs 0` used to name six flags ("train needs --passes >= 1, --topk >= 1, ...")."""
    assert main(["train", objective, "--model", "m", "--data", "code:4", "--out", str(tmp_path / "o"), flag,
                 value]) == 2
    err = capsys.readouterr().err
    assert err == f"selfspec: error: {says}\n"


def test_train_hass_takes_max_steps(tiny_dir, data_file, tmp_path, monkeypatch):
    """sdsat, space, msn and sft had --max-steps; hass had not. The precision is auto's by default."""
    import selfspec.train.precision as precision

    monkeypatch.setattr(pipeline, "evaluation_prompts", lambda: [])
    asked, real = [], precision.choose

    def choose(requested, *a, **k):
        asked.append(requested)
        return real(requested, *a, **k)

    monkeypatch.setattr(precision, "choose", choose)
    assert train(tiny_dir, data_file, tmp_path / "h", "--max-steps", "3", "--epochs", "5") == 0
    assert asked == ["auto"]
    meta = json.loads((tmp_path / "h" / "selfspec_head.json").read_text())
    assert meta["steps"] == 3 and meta["options"]["max_steps"] == 3
