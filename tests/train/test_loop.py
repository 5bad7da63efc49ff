"""The shared training loop (``train/loop.py``) on a toy objective: schedules, metric merging, an
interrupted run resumed equals an uninterrupted one (both clipping modes and schedules), refusal
of changed options, the outputs it writes."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from selfspec.errors import SelfspecError
from selfspec.train import loop

W_TRUE = torch.tensor([1.5, -2.0, 0.5])


def items(n: int = 40) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n, 3, generator=g)
    return [(x, x @ W_TRUE) for x in xs]


class Toy:
    """Linear regression; training targets get noise from the step's RNG, validation's do not."""

    name = "toy"
    plot_keys = ("loss",)
    eval_draws = 1

    def options(self) -> dict:
        return {"toy": 1}

    def make_batch(self, batch, rng: random.Random):
        x, y = torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])
        return x, y + torch.tensor([rng.gauss(0, 0.3) for _ in batch])

    def make_eval_batch(self, batch, rng: random.Random):
        return torch.stack([b[0] for b in batch]), torch.stack([b[1] for b in batch])

    def loss(self, model, batch):
        x, y = batch
        err = model(x).squeeze(-1) - y
        loss = (err**2).mean()
        return loss, {"loss": float(loss.detach()), "acc1": float((err.abs() < 0.5).float().mean()),
                      "tokens": len(y)}


def run(out, opts: loop.LoopOptions, resume: bool = False, options: dict | None = None,
        items_: list | None = None) -> tuple[dict, dict]:
    from accelerate import Accelerator

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    saved = {}

    def save(m, state):
        saved["weight"] = m.weight.detach().clone()
        saved["state"] = state

    groups = [{"params": list(model.parameters()), "weight_decay": 0.01}]
    res = loop.train(model, Toy(), items() if items_ is None else items_, out, opts, options or {"run": 1}, groups,
                     save, resume=resume, progress=False, accelerator=Accelerator(cpu=True))
    return res, saved


def test_lr_schedules():
    """transformers' schedules: warm-up from 0, then the heads' linear decay to 0 and the fine-tunes'
    cosine decay to a floor."""
    def lrs(schedule: str, floor: float) -> list[float]:
        optim = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
        sched = loop.lr_schedule(optim, 10, 2, floor, schedule)
        out = []
        for _ in range(11):
            out.append(optim.param_groups[0]["lr"] / 2.0)
            optim.step()
            sched.step()
        return out

    lin = lrs("linear", 0.0)
    assert lin[:2] == [0.0, 0.5] and all(math.isclose(lin[s], (10 - s) / 8, abs_tol=1e-12) for s in range(2, 11))
    cos = lrs("cosine", 0.2)
    assert math.isclose(cos[2], 1.0) and math.isclose(cos[10], 0.2) and math.isclose(cos[6], 0.6)
    assert math.isclose(lrs("linear", 0.25)[10], 0.25)
    with pytest.raises(ValueError):
        loop.lr_schedule(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 10, 2, 0.0, "step")


def test_merge_metrics_weights_and_skips_empty_parts():
    parts = [{"loss": 1.0, "acc2": 0.5, "n_acc2": 3, "tokens": 2}, {"loss": 4.0, "acc2": float("nan"), "n_acc2": 0,
                                                                     "tokens": 1}, {"loss": float("nan"), "tokens": 0}]
    assert loop.merge_metrics(parts) == {"loss": 2.0, "acc2": 0.5}


def test_split_and_batches():
    tr, va = loop.split(list(range(40)), 0.05)
    assert tr == list(range(38)) and va == [38, 39]
    assert loop.split([7], 0.05) == ([7], [])
    b0 = loop.batches(10, 4, 0, 1, world=2)
    assert len(b0) == 2 and sorted(i for b in b0 for i in b) != list(range(10))  # the ragged batch is dropped
    assert b0 == loop.batches(10, 4, 0, 1, world=2) and b0 != loop.batches(10, 4, 1, 1, world=2)


@pytest.mark.parametrize("schedule,clip_by", [("linear", "value"), ("cosine", "norm")])
def test_interrupted_run_resumes_to_the_same_result(tmp_path, monkeypatch, schedule, clip_by):
    opts = loop.LoopOptions(epochs=3, lr=0.05, schedule=schedule, final_lr=0.1, batch_size=4, clip=0.5,
                            clip_by=clip_by, checkpoint_every=5, warmup=0.1)
    res, whole = run(tmp_path / "whole", opts)
    assert res["steps"] == 30 and whole["state"]["step"] == 30  # 38 training items: 10 batches per epoch
    assert whole["state"]["history"][-1]["loss"] < whole["state"]["history"][0]["loss"]
    real = loop._checkpoint
    calls = []

    def stop_at_second(acc, ckdir, state):
        real(acc, ckdir, state)
        calls.append(state["step"])
        if len(calls) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_checkpoint", stop_at_second)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", opts)
    monkeypatch.setattr(loop, "_checkpoint", real)
    assert calls == [5, 10]
    _, cut = run(tmp_path / "cut", opts, resume=True)
    assert [h["step"] for h in cut["state"]["history"]] == list(range(1, 31))
    strip = [{k: v for k, v in h.items() if k != "seconds"} for h in whole["state"]["history"]]
    assert [{k: v for k, v in h.items() if k != "seconds"} for h in cut["state"]["history"]] == strip
    assert cut["state"]["val"] == whole["state"]["val"]
    assert torch.equal(cut["weight"], whole["weight"])
    hist = json.loads((tmp_path / "cut" / "train" / "history.json").read_text())
    assert hist["step"] == 30 and hist["val"][0]["step"] == 0 and hist["val"][-1]["step"] == 30
    assert {8, 16} <= {v["step"] for v in hist["val"]}  # log-spaced points for accuracy-vs-tokens curves
    assert (tmp_path / "cut" / "train" / "loss.png").stat().st_size > 1000
    assert sorted(p.name for p in (tmp_path / "cut" / "train" / "checkpoints").iterdir()) == ["step_25", "step_30"]


def test_resume_refuses_other_options_and_max_steps(tmp_path):
    opts = loop.LoopOptions(epochs=1, max_steps=4, batch_size=4, checkpoint_every=2)
    res, saved = run(tmp_path / "a", opts)
    assert res["steps"] == 4 and set(res) >= {"loss", "acc1", "tokens"} and res["tokens"] == 2
    assert run(tmp_path / "a", opts, resume=True)[0]["steps"] == 4  # nothing left to do
    with pytest.raises(SelfspecError, match=r"other options \(run: 1 -> 2\)"):  # names what changed
        run(tmp_path / "a", opts, resume=True, options={"run": 2})
    with pytest.raises(SelfspecError, match="no batch"):
        run(tmp_path / "b", opts, items_=[])


def test_a_new_run_refuses_to_start_over_an_earlier_one(tmp_path, monkeypatch):
    """Without resume, a run into a directory that holds an interrupted or a finished run is
    refused, and its checkpoints, history and results are kept (they used to be deleted)."""
    opts = loop.LoopOptions(epochs=1, max_steps=6, batch_size=4, checkpoint_every=2)
    real = loop._checkpoint

    def stop_at_second(acc, ckdir, state):
        real(acc, ckdir, state)
        if state["step"] == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(loop, "_checkpoint", stop_at_second)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "cut", opts)
    monkeypatch.setattr(loop, "_checkpoint", real)
    before = sorted(p.name for p in (tmp_path / "cut" / "train" / "checkpoints").iterdir())
    with pytest.raises(SelfspecError, match=r"training run \(checkpoint at step 4\); pass --resume .* another --out"):
        run(tmp_path / "cut", opts)
    assert sorted(p.name for p in (tmp_path / "cut" / "train" / "checkpoints").iterdir()) == before == \
        ["step_2", "step_4"]
    assert run(tmp_path / "cut", opts, resume=True)[0]["steps"] == 6

    (tmp_path / "done" / "train").mkdir(parents=True)  # finished, its checkpoints since deleted
    (tmp_path / "done" / "train" / "history.json").write_text("{}")
    with pytest.raises(SelfspecError, match="finished training run"):
        run(tmp_path / "done", opts)
    with pytest.raises(SelfspecError, match="no checkpoint to --resume from"):
        run(tmp_path / "done", opts, resume=True)
    assert (tmp_path / "done" / "train" / "history.json").read_text() == "{}"


def test_options_diff_names_the_changed_options():
    assert loop.options_diff({"a": 1, "b": {"c": 2, "d": 3}}, {"a": 1, "b": {"c": 5, "d": 3}, "e": 0}) == \
        ["b.c: 2 -> 5", "e: None -> 0"]


def test_evaluate_makes_eval_draws_passes_with_fresh_draws():
    """Each pass draws its batches afresh from the one fixed RNG: the metric averages the draws,
    and a second call repeats them exactly."""

    class Draws(Toy):
        eval_draws = 3

        def make_eval_batch(self, batch, rng):
            return [rng.random() for _ in batch]

        def loss(self, model, batch):
            return torch.tensor(0.0), {"u": sum(batch) / len(batch), "n_u": len(batch)}

    got = loop.evaluate(torch.nn.Linear(3, 1), Draws(), items(10), 4, seed=5)
    rng = random.Random(5)
    want = [rng.random() for _ in range(30)]
    assert got["u"] == pytest.approx(sum(want) / 30)
    assert loop.evaluate(torch.nn.Linear(3, 1), Draws(), items(10), 4, seed=5) == got
    one = Draws()
    one.eval_draws = 1
    assert loop.evaluate(torch.nn.Linear(3, 1), one, items(10), 4, seed=5)["u"] == pytest.approx(sum(want[:10]) / 10)
