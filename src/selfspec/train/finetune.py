"""Fine-tuning the target model itself (LoRA or full), with Hugging Face Accelerate.

The trainer of the methods that teach the model to draft for itself (``sdsat``; SPACE and MSN
reuse it). A method supplies an :class:`Objective` (how a batch is built from tokenised
examples, its loss, its validation metrics); this module owns everything else: new special
tokens (added to the tokenizer, embedding rows trainable, nothing else of the embedding), LoRA
through ``peft`` or full fine-tuning, the Accelerate loop (one process or ``accelerate launch``),
progress bars, checkpoints every N steps and ``--resume``, the loss plot, and the output: an
ordinary Hugging Face model directory (merged weights, safetensors, tokenizer with the new
tokens) plus ``selfspec_finetune.json`` and, for LoRA, the small ``adapter/`` it was merged from.

A fine-tuned directory is made by :func:`~selfspec.models.finetuned.apply_adapter` from the base
model and ``adapter/``, the same function that builds a bundled fine-tuned model, so the two
cannot drift apart.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm import tqdm

from ..errors import SelfspecError
from ..models.finetuned import META_FILE, ROWS_FILE, add_tokens, apply_adapter
from .conversations import Example
from .trainer import _batches, _checkpoint, _latest_checkpoint


@dataclass(frozen=True)
class FinetuneOptions:
    """Hyper-parameters of the shared fine-tuning loop.

    Attributes:
        lora_rank: LoRA rank r; 0 = full fine-tuning (every weight trained).
        lora_alpha: LoRA scale numerator (update = alpha / r * B A).
        lora_targets: ``all-linear`` (every linear layer of the decoder) or comma-separated names.
        epochs: passes over the training split (``max_steps`` > 0 overrides).
        max_steps: optimiser steps, 0 = ``epochs`` decides.
        lr: AdamW peak learning rate (linear warm-up over ``warmup`` of the steps, cosine decay
            to ``lr * final_lr``).
        final_lr: the decay's floor as a fraction of ``lr`` (SDSAT: 5e-5 -> 1e-5 = 0.2).
        batch_size: sequences per process and step.
        weight_decay: AdamW weight decay (never on the new token rows).
        clip: gradient clipping by global norm.
        val_fraction: share of the examples held out (the last ones) for validation.
        seed: data order and method randomness (windows, masks).
        checkpoint_every: steps between checkpoints.
    """

    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: str = "all-linear"
    epochs: int = 2
    max_steps: int = 0
    lr: float = 3e-4
    final_lr: float = 0.2
    batch_size: int = 4
    weight_decay: float = 0.0
    clip: float = 1.0
    warmup: float = 0.05
    val_fraction: float = 0.05
    seed: int = 0
    checkpoint_every: int = 50


class Objective(Protocol):
    """What a method contributes to :func:`finetune`.

    Attributes:
        name: the method (recorded in the metadata).
        new_tokens: special tokens the method adds (e.g. SDSAT's adaptive token).
    """

    name: str
    new_tokens: list[str]

    def bind(self, new_ids: list[int], pad_id: int) -> None:
        """Called once the new tokens have ids."""

    def make_batch(self, examples: list[Example], rng: random.Random) -> dict[str, torch.Tensor]:
        """Padded training tensors of one step (``input_ids [B, L]``, ``attention_mask [B, L]``, ...)."""

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss and metrics (each metric a token-weighted mean; ``tokens`` = its weight)."""

    def options(self) -> dict:
        """The method's own options (recorded; resume refuses a change)."""


# ------------------------------------------------------------------------------------ new tokens


def train_rows_only(weight: torch.nn.Parameter, rows: list[int]) -> None:
    """Make ``weight`` trainable in ``rows`` only: gradients of every other row are zeroed."""
    keep = torch.zeros(weight.shape[0], 1, dtype=weight.dtype, device=weight.device)
    keep[rows] = 1
    weight.requires_grad_(True)
    weight.register_hook(lambda g: g * keep)


def wrap_lora(model: torch.nn.Module, opts: FinetuneOptions) -> torch.nn.Module:
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:
        from ..errors import missing_dependency

        raise missing_dependency("peft", "peft", "LoRA fine-tuning (or pass --lora-rank 0)") from e
    targets = opts.lora_targets if opts.lora_targets == "all-linear" else [
        t.strip() for t in opts.lora_targets.split(",") if t.strip()]
    cfg = LoraConfig(r=opts.lora_rank, lora_alpha=opts.lora_alpha, target_modules=targets, lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


# ---------------------------------------------------------------------------------- saving / loading


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def save_adapter(model: torch.nn.Module, new_ids: list[int], out: Path, base_name: str = "") -> None:
    """LoRA weights (fp16, peft layout) and the new token rows (fp32) into ``out``; the adapter's
    config names the base model by ``base_name`` (not a local path)."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    if base_name:
        for cfg in model.peft_config.values():
            cfg.base_model_name_or_path = base_name
    model.save_pretrained(str(out), safe_serialization=True, save_embedding_layers=False)
    (out / "README.md").unlink(missing_ok=True)  # peft's model-card template
    f = out / "adapter_model.safetensors"
    save_file({k: v.half().contiguous() for k, v in load_file(str(f)).items()}, str(f))
    base = _base_model(model)
    rows = {"input": base.get_input_embeddings().weight[new_ids].detach().float().contiguous()}
    outw = base.get_output_embeddings()
    if outw is not None and outw.weight is not base.get_input_embeddings().weight:
        rows["output"] = outw.weight[new_ids].detach().float().contiguous()
    save_file(rows, str(out / ROWS_FILE))


# --------------------------------------------------------------------------------------- the loop


def _lr_cosine(total: int, warmup: int, floor: float):
    import math

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    return f


def _merge_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted means of metric dicts (keys ``k`` weighted by ``n_k`` when present, else ``tokens``)."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    for m in parts:
        for k, v in m.items():
            if k == "tokens" or k.startswith("n_"):
                continue
            w = m.get(f"n_{k}", m.get("tokens", 1))
            sums[k] = sums.get(k, 0.0) + v * w
            weights[k] = weights.get(k, 0.0) + w
    return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


@torch.no_grad()
def evaluate(model: torch.nn.Module, objective: Objective, examples: list[Example], batch_size: int,
             seed: int) -> dict[str, float]:
    """Metrics of ``objective.loss`` over ``examples`` with a fixed RNG (same batches every call).

    An objective may build its validation batches differently from its training batches
    (``make_eval_batch``; MSN's plain-SFT control is validated on noised inputs, so that the two
    runs are measured on the same batches)."""
    was = model.training
    model.eval()
    rng = random.Random(seed)
    make = getattr(objective, "make_eval_batch", objective.make_batch)
    parts = []
    for i in range(0, len(examples), batch_size):
        _, m = objective.loss(model, make(examples[i : i + batch_size], rng))
        parts.append(m)
    model.train(was)
    return _merge_metrics(parts)


def finetune(model: torch.nn.Module, tokenizer, examples: list[Example], objective: Objective, out: Path,
             opts: FinetuneOptions, meta: dict, base_dir: Path | None, resume: bool = False, progress: bool = True,
             accelerator=None) -> dict:
    """Fine-tune ``model`` with ``objective`` and write the fine-tuned model directory ``out``.

    Args:
        model: the base model (fp32; it is changed in place).
        tokenizer: its tokenizer (the new tokens are added to it).
        examples: tokenised examples (the last ``val_fraction`` are held out).
        objective: the method's batch construction and loss.
        out: output: the model directory; ``adapter/`` (LoRA) and ``train/`` (checkpoints, history,
            plot) inside.
        opts: loop hyper-parameters.
        meta: recorded in ``selfspec_finetune.json`` (base model name, data, ...).
        base_dir: the base model's directory (LoRA: the output is rebuilt from it with
            :func:`apply_adapter`); None saves the trained model directly.
        resume: continue from the latest checkpoint in ``out/train/checkpoints``.

    Returns:
        final validation metrics plus ``steps``.
    """
    from accelerate import Accelerator

    acc = accelerator or Accelerator(cpu=next(model.parameters()).device.type == "cpu")
    torch.manual_seed(opts.seed)
    new_ids = add_tokens(model, tokenizer, objective.new_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    objective.bind(new_ids, int(pad))
    if opts.lora_rank > 0:
        model.requires_grad_(False)
        model = wrap_lora(model, opts)
        if new_ids:
            train_rows_only(_base_model(model).get_input_embeddings().weight, new_ids)
            outw = _base_model(model).get_output_embeddings()
            if outw is not None and outw.weight is not _base_model(model).get_input_embeddings().weight:
                train_rows_only(outw.weight, new_ids)
    else:
        model.requires_grad_(True)
    model.train()
    n_val = max(1, int(len(examples) * opts.val_fraction)) if len(examples) > 1 else 0
    train_ex, val_ex = examples[: len(examples) - n_val], examples[len(examples) - n_val :]
    world = acc.num_processes
    per_epoch = len(_batches(len(train_ex), opts.batch_size, 0, opts.seed, world)) // world
    if per_epoch == 0:
        raise SelfspecError(f"{len(train_ex)} training examples give no batch of {opts.batch_size} per process; "
                            "add data or lower --batch-size")
    total = opts.max_steps or per_epoch * opts.epochs
    params = [p for p in model.parameters() if p.requires_grad]
    emb = _base_model(model).get_input_embeddings().weight
    decay = [p for p in params if p is not emb and p.dim() >= 2 and opts.weight_decay > 0]
    rest = [p for p in params if all(p is not d for d in decay)]
    groups = [{"params": rest, "weight_decay": 0.0}] + ([{"params": decay, "weight_decay": opts.weight_decay}]
                                                          if decay else [])
    optim = torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, _lr_cosine(total, max(1, int(total * opts.warmup)),
                                                                opts.final_lr))
    model, optim, sched = acc.prepare(model, optim, sched)
    trdir = out / "train"
    ckdir = trdir / "checkpoints"
    options = {"finetune": asdict(opts), objective.name: objective.options(), "data": meta.get("data")}
    state = {"step": 0, "history": [], "val": [], "options": options}
    if resume and (ck := _latest_checkpoint(ckdir)) is not None:
        saved = json.loads((ck / "trainer_state.json").read_text())
        if saved["options"] != options:
            raise SelfspecError(f"{out} was trained with other options; resume with the same ones or drop --resume")
        acc.load_state(str(ck))
        state = saved
    elif acc.is_main_process and ckdir.exists():
        shutil.rmtree(ckdir)
    if not state["val"] and val_ex:
        state["val"].append({"step": 0, **evaluate(acc.unwrap_model(model), objective, val_ex, opts.batch_size,
                                                   opts.seed)})
    bar = tqdm(total=total, initial=state["step"], desc=f"train {objective.name}", unit="step",
               disable=not (progress and acc.is_main_process), file=sys.stderr)
    eval_every = min(per_epoch, total // 4) or total  # about four validations per run
    while state["step"] < total:
        epoch, within = divmod(state["step"], per_epoch)
        batches = _batches(len(train_ex), opts.batch_size, epoch, opts.seed, world)
        mine = batches[acc.process_index :: world][within:per_epoch]
        for idx in mine:
            t0 = time.perf_counter()
            rng = random.Random(opts.seed * 1_000_003 + 7919 * state["step"] + acc.process_index)
            batch = objective.make_batch([train_ex[i] for i in idx], rng)
            loss, m = objective.loss(model, batch)
            acc.backward(loss)
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
            bar.set_postfix({k: f"{v:.3f}" for k, v in m.items() if k in ("loss", "plain", "adapt", "acc1")})
            if (state["step"] % eval_every == 0 or state["step"] == total) and val_ex:
                v = evaluate(acc.unwrap_model(model), objective, val_ex, opts.batch_size, opts.seed)
                state["val"].append({"step": state["step"], **v})
            if state["step"] % opts.checkpoint_every == 0 or state["step"] == total:
                _checkpoint(acc, ckdir, state)
            if state["step"] >= total:
                break
    bar.close()
    final = state["val"][-1] if state["val"] else {}
    if acc.is_main_process:
        trained = acc.unwrap_model(model)
        info = {**meta, "method": objective.name, "new_tokens": objective.new_tokens, "new_ids": new_ids,
                "options": options, "steps": state["step"], "validation": final,
                "initial_validation": state["val"][0] if state["val"] else {}}
        adapter = out / "adapter"
        if opts.lora_rank > 0 and base_dir is not None:
            save_adapter(trained, new_ids, adapter, str(meta.get("base", "")))
            (adapter / META_FILE).write_text(json.dumps(info, indent=1) + "\n")
            apply_adapter(base_dir, adapter, out / "model.part", info)
            for p in (out / "model.part").iterdir():
                shutil.move(str(p), str(out / p.name))
            (out / "model.part").rmdir()
        else:
            final_model = trained.merge_and_unload() if opts.lora_rank > 0 else trained
            final_model.save_pretrained(str(out), safe_serialization=True)
            tokenizer.save_pretrained(str(out))
            (out / META_FILE).write_text(json.dumps(info, indent=1) + "\n")
        trdir.mkdir(parents=True, exist_ok=True)
        (trdir / "history.json").write_text(json.dumps(state, indent=1) + "\n")
        try:
            plot_history(state, trdir / "loss.png", objective.name)
        except ImportError:
            pass
    acc.wait_for_everyone()
    return {"steps": state["step"], **final}


def plot_history(state: dict, path: Path, title: str) -> None:
    """Training losses (moving mean) and validation metrics, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = state["history"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [h["step"] for h in hist]
    window = max(1, len(hist) // 30)
    for key in ("loss", "plain", "adapt", "mask", "noisy"):
        ys = [h[key] for h in hist if key in h]
        if len(ys) != len(steps):
            continue
        sm = [sum(ys[max(0, i - window + 1) : i + 1]) / len(ys[max(0, i - window + 1) : i + 1]) for i in range(len(ys))]
        a.plot(steps, sm, label=key)
    a.set_xlabel("step")
    a.set_ylabel("training loss (moving mean)")
    a.legend()
    val = state["val"]
    xs = [v["step"] for v in val]
    keys = sorted({k for v in val for k in v if k[:3] == "acc" and k[3:].isdigit()}, key=lambda k: int(k[3:]))
    for k in keys:
        b.plot(xs, [v.get(k, float("nan")) for v in val], marker="o", label=f"offset {k[3:]}")
    if any("acc_noisy" in v for v in val):  # MSN: next-token accuracy where the input is noise
        keys.append("acc_noisy")
        b.plot(xs, [v.get("acc_noisy", float("nan")) for v in val], marker="s", label="after noise (msn)")
    b.set_xlabel("step")
    b.set_ylabel("validation top-1 accuracy of the draft at offset j")
    if keys:
        b.legend()
    fig.suptitle(f"{title} fine-tuning")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
