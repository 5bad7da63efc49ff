"""The one training loop, on Hugging Face Accelerate: draft heads and fine-tuned models alike.

A method contributes an :class:`Objective`: how a batch is built from its training items, the
loss and metrics of a batch, how a validation batch is built, and which losses to plot. The
loop owns everything else:

* the hold-out split (the last ``val_fraction`` of the items) and a deterministic batch order:
  one shuffle per epoch from the seed; each process takes every ``world``-th batch, so the same
  code runs in one process or under ``accelerate launch`` (DDP on CPUs or GPUs);
* AdamW (0.9, 0.95) over the caller's parameter groups, linear warm-up then linear or cosine
  decay to a floor, gradient clipping by global norm or by value;
* validation with a fixed RNG (the same batches every time): at step 0, about four times per run
  and at the end;
* checkpoints every N steps (``Accelerator.save_state`` plus ``trainer_state.json``; the last two
  kept) and resume: a resumed run takes the same batches, the same per-step randomness and the
  same optimiser and schedule state as an uninterrupted one, and refuses changed options;
* the progress bar, ``train/history.json`` and the loss plot ``train/loss.png``.

Only the main process writes files. Per-step randomness of an objective (windows, masks, noise)
comes from a ``random.Random`` seeded by (seed, step, process), never from global state.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from tqdm import tqdm

from ..errors import SelfspecError
from .options import LoopOptions

M = TypeVar("M", bound=torch.nn.Module)  # the trained model's type (what ``save`` gets back)


class Objective(Protocol):
    """What a training method contributes to :func:`train`.

    Attributes:
        name: the method (progress bar, plot title).
        plot_keys: training metrics drawn in the loss plot (those every step reports).
        eval_draws: passes over the held-out items per validation, each batch drawn afresh from
            the evaluation's fixed RNG (noise spans, masks): 1 unless a metric rests on a few
            random positions per example (MSN's accuracy by noise depth).
    """

    name: str
    plot_keys: tuple[str, ...]
    eval_draws: int

    def make_batch(self, items: list, rng: random.Random) -> Any:
        """The tensors of one training step from ``items`` (``rng``: the step's randomness)."""

    def make_eval_batch(self, items: list, rng: random.Random) -> Any:
        """The tensors of one validation batch (``rng`` is the evaluation's fixed RNG)."""

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss and metrics: each a mean weighted by ``n_<key>`` when given, else by
        ``tokens`` (a metric of weight 0 is ignored)."""

    def options(self) -> dict:
        """The method's own options (recorded; resume refuses a change)."""


def accelerator_for(model: torch.nn.Module, accelerator=None):
    """``accelerator``, or a new one on the device of ``model`` (CPU when it is there)."""
    if accelerator is not None:
        return accelerator
    from accelerate import Accelerator

    return Accelerator(cpu=next(model.parameters()).device.type == "cpu")


def split(items: Sequence, val_fraction: float) -> tuple[list, list]:
    """(training, validation): the last ``val_fraction`` of the items (at least one) are held out."""
    n_val = max(1, int(len(items) * val_fraction)) if len(items) > 1 else 0
    return list(items[: len(items) - n_val]), list(items[len(items) - n_val :])


def batches(n: int, batch_size: int, epoch: int, seed: int, world: int) -> list[list[int]]:
    """Deterministic batches of one epoch, trimmed to a multiple of ``world``."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    out = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return out[: len(out) - len(out) % world] if len(out) >= world else []


def lr_schedule(optim: torch.optim.Optimizer, total: int, warmup: int, floor: float = 0.0,
                schedule: str = "cosine") -> torch.optim.lr_scheduler.LambdaLR:
    """``transformers``' schedule for ``optim``: linear warm-up over ``warmup`` steps (from 0), then
    a linear or cosine decay from the peak to ``floor`` x the peak at step ``total``."""
    from transformers import get_cosine_with_min_lr_schedule_with_warmup, get_polynomial_decay_schedule_with_warmup

    if schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(optim, warmup, total, min_lr_rate=floor)
    if schedule == "linear":
        peak = optim.param_groups[0]["lr"]
        return get_polynomial_decay_schedule_with_warmup(optim, warmup, total, lr_end=peak * floor, power=1.0)
    raise ValueError(f"schedule must be linear or cosine, not {schedule!r}")


def merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Weighted means of metric dicts (key ``k`` weighted by ``n_k`` when present, else ``tokens``)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for m in parts:
        for k, v in m.items():
            if k == "tokens" or k.startswith("n_"):
                continue
            w = m.get(f"n_{k}", m.get("tokens", 1))
            if w:
                sums[k] = sums.get(k, 0.0) + v * w
                weights[k] = weights.get(k, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums}


@torch.no_grad()
def evaluate(model: torch.nn.Module, objective: Objective, items: list, batch_size: int, seed: int) -> dict[str, float]:
    """Metrics of ``objective.loss`` over ``items``, ``objective.eval_draws`` times
    (``make_eval_batch`` with a fixed RNG: the same batches every call), plus ``tokens``, their
    total weight."""
    was = model.training
    model.eval()
    rng = random.Random(seed)
    parts = []
    for _ in range(objective.eval_draws):
        for i in range(0, len(items), batch_size):
            _, m = objective.loss(model, objective.make_eval_batch(items[i : i + batch_size], rng))
            parts.append(m)
    model.train(was)
    return merge_metrics(parts) | {"tokens": int(sum(m.get("tokens", 0) for m in parts))}


def latest_checkpoint(ckdir: Path) -> Path | None:
    cks = sorted(ckdir.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return cks[-1] if cks else None


RUN_FILES = ("train/history.json",)  # what a finished run of the loop leaves in its output directory


def existing_run(out: Path, outputs: Sequence[str] = ()) -> str | None:
    """What a new run into ``out`` would overwrite, in words (None: nothing): an earlier run's
    checkpoints, its history, or one of ``outputs`` (the method's result files, e.g. a head)."""
    ck = latest_checkpoint(out / "train" / "checkpoints")
    if ck is not None:
        return f"a training run (checkpoint at step {ck.name.split('_')[1]})"
    for name in (*RUN_FILES, *outputs):
        if (out / name).exists():
            return f"a finished training run ({name})" if name in RUN_FILES else f"a trained model or head ({name})"
    return None


def check_out(out: Path, resume: bool, outputs: Sequence[str] = ()) -> None:
    """Refuse to train into ``out`` over an earlier run (see :func:`existing_run`) unless
    ``resume``, and to resume where there is nothing to resume but a result to overwrite. Nothing
    is changed; run it before loading anything."""
    found = existing_run(out, outputs)
    if found is None:
        return
    if not resume:
        raise SelfspecError(f"--out {out} already holds {found}; pass --resume to continue it, or another --out "
                            "to start a new run (nothing was changed)")
    if latest_checkpoint(out / "train" / "checkpoints") is None:
        raise SelfspecError(f"--out {out} holds {found} but no checkpoint to --resume from; pass another --out to "
                            "start a new run (nothing was changed)")


def options_diff(saved: object, now: object, prefix: str = "") -> list[str]:
    """The options that differ between two recorded option trees, as ``name: saved -> now``."""
    if isinstance(saved, dict) and isinstance(now, dict):
        out: list[str] = []
        for k in dict.fromkeys([*saved, *now]):
            out += options_diff(saved.get(k), now.get(k), f"{prefix}{'.' if prefix else ''}{k}")
        return out
    return [] if saved == now else [f"{prefix or 'options'}: {saved!r} -> {now!r}"]


def _checkpoint(acc, ckdir: Path, state: dict) -> None:
    path = ckdir / f"step_{state['step']}"
    acc.save_state(str(path))
    if acc.is_main_process:
        (path / "trainer_state.json").write_text(json.dumps(state) + "\n")
        for old in sorted(ckdir.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()


def train(model: M, objective: Objective, items: Sequence, out: Path, opts: LoopOptions,
          options: dict, param_groups: list[dict], save: Callable[[M, dict], None],
          resume: bool = False, progress: bool = True, accelerator=None) -> dict:
    """Train ``model`` on ``items`` with ``objective`` (see the module docstring).

    Args:
        model: what is trained (its trainable parameters are those in ``param_groups``).
        objective: batches, loss, validation batches, plot keys.
        items: training items (the last ``opts.val_fraction`` are held out).
        out: output directory; the loop writes ``out/train/`` (checkpoints, history, plot).
        opts: loop hyper-parameters.
        options: everything the run depends on, as recorded (resume compares it).
        param_groups: AdamW parameter groups (``params`` and ``weight_decay`` each).
        save: called on the main process with the trained (unwrapped) model and the final state
            (``step``, ``history``, ``val``, ``options``) to write the method's output.
        resume: continue from the latest checkpoint in ``out/train/checkpoints``.
        progress: a progress bar on stderr.
        accelerator: an ``accelerate.Accelerator`` (made here when None).

    Returns:
        the final validation metrics plus ``steps``.
    """
    acc = accelerator_for(model, accelerator)
    train_items, val_items = split(items, opts.val_fraction)
    world = acc.num_processes
    per_epoch = len(batches(len(train_items), opts.batch_size, 0, opts.seed, world)) // world
    if per_epoch == 0:
        raise SelfspecError(f"{len(train_items)} training examples give no batch of {opts.batch_size} per process; "
                            "add data or lower --batch-size")
    total = opts.max_steps or per_epoch * opts.epochs
    params = [p for g in param_groups for p in g["params"]]
    optim = torch.optim.AdamW(param_groups, lr=opts.lr, betas=(0.9, 0.95))
    sched = lr_schedule(optim, total, max(1, int(total * opts.warmup)), opts.final_lr, opts.schedule)
    model, optim, sched = acc.prepare(model, optim, sched)
    trdir = out / "train"
    ckdir = trdir / "checkpoints"
    state: dict[str, Any] = {"step": 0, "history": [], "val": [], "options": options}
    check_out(out, resume)  # never start over on top of an earlier run: its checkpoints would be lost
    if resume and (ck := latest_checkpoint(ckdir)) is not None:
        saved = json.loads((ck / "trainer_state.json").read_text())
        if saved["options"] != options:
            changed = ", ".join(options_diff(saved["options"], options)[:4])
            raise SelfspecError(f"{out} was trained with other options ({changed}); resume with the same ones, or "
                                "pass another --out to start a new run")
        acc.load_state(str(ck))
        state = saved

    def validate() -> None:
        with acc.autocast():
            v = evaluate(acc.unwrap_model(model), objective, val_items, opts.batch_size, opts.seed)
        state["val"].append({"step": state["step"], **v})

    if not state["val"] and val_items:
        validate()
    bar = tqdm(total=total, initial=state["step"], desc=f"train {objective.name}", unit="step",
               disable=not (progress and acc.is_main_process), file=sys.stderr)
    shown = ("loss", *objective.plot_keys, "acc1")
    eval_every = min(per_epoch, total // 4) or total  # about four validations per run
    while state["step"] < total:
        epoch, within = divmod(state["step"], per_epoch)
        mine = batches(len(train_items), opts.batch_size, epoch, opts.seed, world)[acc.process_index :: world]
        for idx in mine[within:per_epoch]:
            t0 = time.perf_counter()
            rng = random.Random(opts.seed * 1_000_003 + 7919 * state["step"] + acc.process_index)
            with acc.autocast():  # a no-op unless the Accelerator has mixed precision
                loss, m = objective.loss(model, objective.make_batch([train_items[i] for i in idx], rng))
            acc.backward(loss)
            if opts.clip_by == "value":
                acc.clip_grad_value_(params, opts.clip)
            else:
                acc.clip_grad_norm_(params, opts.clip)
            optim.step()
            sched.step()
            optim.zero_grad()
            state["step"] += 1
            m = {k: v for k, v in m.items() if not k.startswith("n_")}
            m |= {"step": state["step"], "epoch": epoch, "lr": sched.get_last_lr()[0],
                  "seconds": time.perf_counter() - t0}
            state["history"].append(m)
            bar.update(1)
            bar.set_postfix({k: f"{m[k]:.3f}" for k in dict.fromkeys(shown) if k in m})
            if val_items and (state["step"] % eval_every == 0 or state["step"] == total
                              or _log_spaced(state["step"])):
                validate()
            if state["step"] % opts.checkpoint_every == 0 or state["step"] == total:
                _checkpoint(acc, ckdir, state)
            if state["step"] >= total:
                break
    bar.close()
    if acc.is_main_process:
        save(acc.unwrap_model(model), state)
        trdir.mkdir(parents=True, exist_ok=True)
        (trdir / "history.json").write_text(json.dumps(state, indent=1) + "\n")
        try:
            plot_history(state, trdir / "loss.png", f"{objective.name} training", objective.plot_keys)
        except ImportError:
            pass
    acc.wait_for_everyone()
    return {"steps": state["step"], **(state["val"][-1] if state["val"] else {})}


def _log_spaced(step: int) -> bool:
    """Whether ``step`` is a power of two from 8 on: validations at these steps (besides the four
    evenly spaced ones) give held-out accuracy against training tokens on a log scale."""
    return step >= 8 and step & (step - 1) == 0


def plot_history(state: dict, path: Path, title: str, keys: Sequence[str] = ("loss",)) -> None:
    """Training losses ``keys`` (moving mean) and the validation top-1 accuracies (``acc{j}``,
    ``acc_noisy``; the training ``acc1`` when nothing was validated), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = state["history"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in hist]
    window = max(1, len(hist) // 40)
    lows = []
    for key in keys:
        ys = [h[key] for h in hist if key in h]
        if not ys or len(ys) != len(steps):
            continue
        sm = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
        a.plot(steps, sm, label=key)
        lows.append(min(sm))
    if lows and min(lows) > 0:
        a.set_yscale("log")
    a.set_xlabel("step")
    a.set_ylabel("training loss (moving mean)")
    if lows:
        a.legend()
    val = state["val"]
    xs = [v["step"] for v in val]
    accs = sorted({k for v in val for k in v if k[:3] == "acc" and k[3:].isdigit()}, key=lambda k: int(k[3:]))
    for k in accs + (["acc_noisy"] if any("acc_noisy" in v for v in val) else []):
        b.plot(xs, [v.get(k, float("nan")) for v in val], marker="o", label=k)
    if not val and hist and all("acc1" in h for h in hist):
        b.plot(steps, [h["acc1"] for h in hist], label="acc1 (training)")
    b.set_xlabel("step")
    b.set_ylabel("validation top-1 accuracy")
    if b.get_legend_handles_labels()[0]:
        b.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
