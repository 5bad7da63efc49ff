"""Training an EAGLE / HASS draft head on cached target features, with Hugging Face Accelerate.

The same code runs in one process or under ``accelerate launch`` (several processes, CPUs or
GPUs): the head is wrapped by ``Accelerator.prepare`` (DDP when distributed); each process takes
every ``world``-th batch of one deterministic per-epoch order; only the main process writes
files. Checkpoints (``Accelerator.save_state`` plus ``trainer_state.json``) every N steps make
an interrupted run resumable at the step it reached (``resume=True``).

One optimiser step per batch: the n alignment passes' losses are summed (each pass's graph is
independent, the earlier passes' outputs enter later passes detached), as in the HASS code.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ..errors import SelfspecError
from ..heads.eagle import EagleHead, load_head
from .features import CachedSequence
from .hca import HcaModel
from .losses import LossWeights, pass_losses, teacher


@dataclass(frozen=True)
class TrainOptions:
    """Hyper-parameters (defaults: see ``docs/methods/hass.md`` for the paper's and why ours differ).

    Attributes:
        objective: ``eagle`` (passes 1, no top-K loss) or ``hass``; names the head's method.
        passes: HCA alignment passes n (1 = EAGLE).
        topk: K of the top-K distillation loss.
        topk_weight: its weight w (0 = off).
        reg_weight / cls_weight: EAGLE's feature-regression and soft cross-entropy weights.
        beta: per-pass weight ``beta ** (j - 1)``.
        epochs: passes over the training split.
        lr: AdamW peak learning rate (linear warm-up over ``warmup`` of the steps, linear decay).
        batch_size: sequences per process per step.
        noise: uniform noise amplitude added to input features (target features stay clean).
        clip: gradient clipping by value.
        weight_decay: AdamW weight decay.
        val_fraction: share of sequences held out (the last ones) for validation.
        seed: data order, noise and initialisation.
        checkpoint_every: steps between checkpoints.
        init: a head directory to continue from (the paper's ablation protocol), or empty.
    """

    objective: str = "hass"
    passes: int = 3
    topk: int = 10
    topk_weight: float = 1.0
    reg_weight: float = 1.0
    cls_weight: float = 0.1
    beta: float = 1.0
    epochs: int = 2
    lr: float = 3e-4
    batch_size: int = 4
    noise: float = 0.1
    clip: float = 0.5
    weight_decay: float = 0.01
    warmup: float = 0.01
    val_fraction: float = 0.05
    seed: int = 0
    checkpoint_every: int = 200
    init: str = ""

    @property
    def weights(self) -> LossWeights:
        return LossWeights(self.reg_weight, self.cls_weight, self.topk_weight, self.topk, self.beta)


@dataclass(frozen=True)
class Batch:
    """Training tensors of B padded sequences (draft position i pairs ``f_i`` with ``x_{i+1}``).

    Attributes:
        features: ``[B, L, H]`` float ``f_i`` (input; noise is added later).
        next_tokens: ``[B, L]`` int64 ``x_{i+1}`` (0 past the end).
        targets: ``[B, L, H]`` float ``f_{i+1}`` (0 past the end).
        mask: ``[B, L]`` bool: position i is trained when ``x_{i+2}``, the token its distribution
            predicts, is a learned token (the official code uses the mask of ``x_i``; see the doc).
    """

    features: torch.Tensor
    next_tokens: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor


def collate(seqs: list[CachedSequence], dtype: torch.dtype = torch.float32) -> Batch:
    b, length = len(seqs), max(s.input_ids.numel() for s in seqs)
    h = seqs[0].features.shape[-1]
    feats = torch.zeros(b, length, h, dtype=dtype)
    nxt = torch.zeros(b, length, dtype=torch.long)
    tgt = torch.zeros(b, length, h, dtype=dtype)
    mask = torch.zeros(b, length, dtype=torch.bool)
    for r, s in enumerate(seqs):
        n = s.input_ids.numel()
        feats[r, :n] = s.features.to(dtype)
        nxt[r, : n - 1] = s.input_ids[1:]
        tgt[r, : n - 1] = s.features[1:].to(dtype)
        mask[r, : max(n - 2, 0)] = s.loss_mask[2:].bool()
    return Batch(feats, nxt, tgt, mask)


def _batches(n: int, batch_size: int, epoch: int, seed: int, world: int) -> list[list[int]]:
    """Deterministic batches of one epoch, trimmed to a multiple of ``world``."""
    order = list(range(n))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    out = [order[i : i + batch_size] for i in range(0, n, batch_size)]
    return out[: len(out) - len(out) % world] if len(out) >= world else []


def _lr_lambda(total: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total - step) / max(1, total - warmup))
    return f


def compute_losses(model: HcaModel, target: torch.nn.Module, batch: Batch, opts: TrainOptions,
                   noise_gen: torch.Generator | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward all passes; returns the summed loss and per-pass metrics (``acc1``, ``loss1``, ...)."""
    device = next(model.parameters()).device
    feats = batch.features.to(device)
    if noise_gen is not None and opts.noise > 0:
        u = torch.rand(feats.shape, generator=noise_gen, dtype=feats.dtype)
        feats = feats + ((u - 0.5) * 2 * opts.noise).to(device)
    mask = batch.mask.to(device)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        tok_emb = embed(batch.next_tokens.to(device)).to(feats.dtype)
    preds = model(feats, tok_emb)
    tgt = batch.targets.to(device)[mask]
    w = opts.weights
    t = teacher(lm_head, tgt, w.k)
    total = torch.zeros((), device=device)
    metrics: dict[str, float] = {}
    for j, pred in enumerate(preds, start=1):
        parts = pass_losses(pred[mask], tgt, lm_head, t, w)
        total = total + w.beta ** (j - 1) * parts["loss"]
        for k in ("loss", "reg", "cls", "topk", "acc"):
            metrics[f"{k}{j}"] = float(parts[k].detach())
    metrics["loss"] = float(total.detach())
    metrics["tokens"] = int(mask.sum())
    return total, metrics


@torch.no_grad()
def evaluate(model: HcaModel, target: torch.nn.Module, seqs: list[CachedSequence], opts: TrainOptions,
             batch_size: int) -> dict[str, float]:
    """Token-weighted mean of every metric over ``seqs`` (no noise). ``acc{j}`` is the top-1
    agreement of pass j with the target: with HCA, the acceptance of drafting step j along the
    data (teacher-forced tokens)."""
    model.eval()
    sums: dict[str, float] = {}
    n = 0
    for i in range(0, len(seqs), batch_size):
        batch = collate(seqs[i : i + batch_size], next(model.parameters()).dtype)
        if not batch.mask.any():
            continue
        _, m = compute_losses(model, target, batch, opts, None)
        k = m.pop("tokens")
        n += k
        for key, v in m.items():
            sums[key] = sums.get(key, 0.0) + v * k
    model.train()
    return {k: v / max(n, 1) for k, v in sums.items()} | {"tokens": n}


def _latest_checkpoint(ckdir: Path) -> Path | None:
    cks = sorted(ckdir.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    return cks[-1] if cks else None


def train_head(target: torch.nn.Module, seqs: list[CachedSequence], out: Path, opts: TrainOptions, meta: dict,
               resume: bool = False, progress: bool = True, accelerator=None) -> dict:
    """Train a head on ``seqs`` and save it into ``out`` (see module docstring).

    Args:
        target: the frozen target (embedding and LM head are used).
        seqs: cached sequences (the last ``val_fraction`` are held out).
        out: output directory: the head files, ``train/`` (checkpoints, history, plot).
        opts: hyper-parameters.
        meta: recorded in the head's metadata (model name, data, ...).
        resume: continue from the latest checkpoint in ``out/train/checkpoints``.
        accelerator: an ``accelerate.Accelerator`` (made here when None).

    Returns:
        the final metrics (validation per pass, steps, tokens).
    """
    from accelerate import Accelerator

    acc = accelerator or Accelerator(cpu=next(target.parameters()).device.type == "cpu")
    torch.manual_seed(opts.seed)
    target.requires_grad_(False)
    if opts.init:
        head, _ = load_head(opts.init, target)
    else:
        head = EagleHead(target)
    head.train()
    model = HcaModel(head, opts.passes)
    n_val = max(1, int(len(seqs) * opts.val_fraction)) if len(seqs) > 1 else 0
    train_seqs, val_seqs = seqs[: len(seqs) - n_val], seqs[len(seqs) - n_val :]
    world = acc.num_processes
    per_epoch = len(_batches(len(train_seqs), opts.batch_size, 0, opts.seed, world)) // world
    if per_epoch == 0:
        raise SelfspecError(f"{len(train_seqs)} training sequences give no batch of {opts.batch_size} per process; "
                            "add data or lower --batch-size")
    total = per_epoch * opts.epochs
    optim = torch.optim.AdamW(head.parameters(), lr=opts.lr, betas=(0.9, 0.95), weight_decay=opts.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_lambda(total, max(1, int(total * opts.warmup))))
    model, optim, sched = acc.prepare(model, optim, sched)
    trdir = out / "train"
    ckdir = trdir / "checkpoints"
    state = {"step": 0, "history": [], "val": [], "options": asdict(opts)}
    if resume and (ck := _latest_checkpoint(ckdir)) is not None:
        saved = json.loads((ck / "trainer_state.json").read_text())
        if saved["options"] != asdict(opts):
            raise SelfspecError(f"{out} was trained with other options; resume with the same ones or use --fresh")
        acc.load_state(str(ck))
        state = saved
    elif acc.is_main_process and ckdir.exists():
        shutil.rmtree(ckdir)
    noise_gen = torch.Generator().manual_seed(opts.seed * 7919 + acc.process_index)
    bar = tqdm(total=total, initial=state["step"], desc=f"train {opts.objective}", unit="step",
               disable=not (progress and acc.is_main_process), file=sys.stderr)
    while state["step"] < total:
        epoch, within = divmod(state["step"], per_epoch)
        batches = _batches(len(train_seqs), opts.batch_size, epoch, opts.seed, world)
        mine = batches[acc.process_index :: world][within:per_epoch]
        for idx in mine:
            noise_gen.manual_seed(opts.seed * 7919 + acc.process_index + 104729 * state["step"])
            loss, m = compute_losses(model, target,
                                     collate([train_seqs[i] for i in idx]), opts, noise_gen)
            acc.backward(loss)
            acc.clip_grad_value_(model.parameters(), opts.clip)
            optim.step()
            sched.step()
            optim.zero_grad()
            state["step"] += 1
            m |= {"step": state["step"], "epoch": epoch, "lr": sched.get_last_lr()[0]}
            state["history"].append(m)
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", acc1=f"{m['acc1']:.2f}")
            if state["step"] % per_epoch == 0 and val_seqs:
                v = evaluate(acc.unwrap_model(model), target, val_seqs, opts, opts.batch_size)
                state["val"].append({"step": state["step"], **v})
            if state["step"] % opts.checkpoint_every == 0 or state["step"] == total:
                _checkpoint(acc, ckdir, state)
    bar.close()
    final = state["val"][-1] if state["val"] else {}
    if acc.is_main_process:
        head = acc.unwrap_model(model).head
        head.save(out, {**meta, "method": "eagle2" if opts.objective == "eagle" else "hass",
                        "options": asdict(opts), "steps": state["step"], "validation": final})
        (trdir / "history.json").write_text(json.dumps(state, indent=1) + "\n")
        try:
            plot_history(state, trdir / "loss.png")
        except ImportError:
            pass
    acc.wait_for_everyone()
    return {"steps": state["step"], **final}


def _checkpoint(acc, ckdir: Path, state: dict) -> None:
    path = ckdir / f"step_{state['step']}"
    acc.save_state(str(path))
    if acc.is_main_process:
        (path / "trainer_state.json").write_text(json.dumps(state) + "\n")
        for old in sorted(ckdir.glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()


def plot_history(state: dict, path: Path) -> None:
    """Training loss (smoothed) and validation top-1 agreement per pass, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = state["history"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in hist]
    window = max(1, len(hist) // 50)
    for key in ("loss", "reg1", "cls1"):
        ys = [h[key] for h in hist]
        sm = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
        a.plot(steps, sm, label=key)
    a.set_xlabel("step")
    a.set_ylabel("training loss (moving mean)")
    a.set_yscale("log")
    a.legend()
    passes = state["options"]["passes"]
    for j in range(1, passes + 1):
        xs = [v["step"] for v in state["val"]]
        b.plot(xs, [v[f"acc{j}"] for v in state["val"]], marker="o", label=f"pass {j}")
    if not state["val"]:
        ys = [h["acc1"] for h in hist]
        b.plot(steps, ys, label="train acc1")
    b.set_xlabel("step")
    b.set_ylabel("top-1 agreement with the target (validation)")
    b.legend()
    fig.suptitle(f"{state['options']['objective']} head training")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

