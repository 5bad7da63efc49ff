"""Fine-tuning the target model itself (LoRA or full), with Hugging Face Accelerate.

The trainer of the methods that teach the model to draft for itself (SDSAT, SPACE, MSN and its
plain-SFT control). A method supplies a :class:`FinetuneObjective` (its special tokens, how a
training and a validation batch are built from tokenised examples, its loss and metrics); the
shared Accelerate loop (:mod:`.loop`) runs it: schedule, validation, checkpoints every N steps
and ``--resume``, progress bar, loss plot. This module owns what is particular to fine-tuning:
new special tokens (added to the tokenizer, embedding rows trainable, nothing else of the
embedding), LoRA through ``peft`` or full fine-tuning, and the output: an ordinary Hugging Face
model directory (merged weights, safetensors, tokenizer with the new
tokens) plus ``selfspec_finetune.json`` and, for LoRA, the small ``adapter/`` it was merged from.

A fine-tuned directory is made by :func:`~selfspec.models.finetuned.apply_adapter` from the base
model and ``adapter/``, the same function that builds a bundled fine-tuned model, so the two
cannot drift apart.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, cast

import torch

from ..models.finetuned import META_FILE, ROWS_FILE, add_tokens, apply_adapter
from ..paths import save_safetensors
from . import loop
from .conversations import Example
from .options import TrainingOptions

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class FinetuneOptions(TrainingOptions):
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
    final_lr: float = 0.2
    weight_decay: float = 0.0
    clip: float = 1.0
    warmup: float = 0.05
    checkpoint_every: int = 50

    SCHEDULE: ClassVar[str] = "cosine"
    CLIP_BY: ClassVar[str] = "norm"


class FinetuneObjective(loop.Objective, Protocol):
    """What a method contributes to :func:`finetune`: a :class:`~selfspec.train.loop.Objective`
    over tokenised examples (:class:`~selfspec.train.conversations.Example`; batches are dicts of
    ``[B, L]`` tensors) that may add special tokens.

    Attributes:
        name: the method (recorded in the metadata).
        new_tokens: special tokens the method adds (e.g. SDSAT's adaptive token).
    """

    new_tokens: list[str]

    def bind(self, new_ids: list[int], pad_id: int) -> None:
        """Called once the new tokens have ids."""


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
    # peft annotates lora_alpha as int; a float works (it only enters the scale alpha / r)
    cfg = LoraConfig(r=opts.lora_rank, lora_alpha=opts.lora_alpha,  # type: ignore[arg-type]
                     target_modules=targets, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, cfg)


# ---------------------------------------------------------------------------------- saving / loading


def _base_model(model: torch.nn.Module) -> PreTrainedModel:
    base = cast("PeftModel", model).get_base_model() if hasattr(model, "get_base_model") else model
    return cast("PreTrainedModel", base)


def save_adapter(model: torch.nn.Module, new_ids: list[int], out: Path, base_name: str = "") -> None:
    """LoRA weights (fp16, peft layout) and the new token rows (fp32) into ``out``; the adapter's
    config names the base model by ``base_name`` (not a local path)."""
    from safetensors.torch import load_file

    out.mkdir(parents=True, exist_ok=True)
    peft_model = cast("PeftModel", model)
    if base_name:
        for cfg in peft_model.peft_config.values():
            cfg.base_model_name_or_path = base_name
    peft_model.save_pretrained(str(out), safe_serialization=True, save_embedding_layers=False)
    (out / "README.md").unlink(missing_ok=True)  # peft's model-card template
    f = out / "adapter_model.safetensors"
    save_safetensors({k: v.half().contiguous() for k, v in load_file(str(f)).items()}, f)
    base = _base_model(model)
    rows = {"input": cast(torch.Tensor, base.get_input_embeddings().weight)[new_ids].detach().float().contiguous()}
    outw = base.get_output_embeddings()
    if outw is not None and outw.weight is not base.get_input_embeddings().weight:
        rows["output"] = outw.weight[new_ids].detach().float().contiguous()
    save_safetensors(rows, out / ROWS_FILE)


# ----------------------------------------------------------------------------------- fine-tuning


def finetune(model: torch.nn.Module, tokenizer, examples: list[Example], objective: FinetuneObjective, out: Path,
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
    acc = loop.accelerator_for(model, accelerator)
    torch.manual_seed(opts.seed)
    new_ids = add_tokens(model, tokenizer, objective.new_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    objective.bind(new_ids, int(pad))
    if opts.lora_rank > 0:
        model.requires_grad_(False)
        model = wrap_lora(model, opts)
        if new_ids:
            train_rows_only(cast(torch.nn.Parameter, _base_model(model).get_input_embeddings().weight), new_ids)
            outw = _base_model(model).get_output_embeddings()
            if outw is not None and outw.weight is not _base_model(model).get_input_embeddings().weight:
                train_rows_only(outw.weight, new_ids)
    else:
        model.requires_grad_(True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    emb = _base_model(model).get_input_embeddings().weight
    decay = [p for p in params if p is not emb and p.dim() >= 2 and opts.weight_decay > 0]
    rest = [p for p in params if all(p is not d for d in decay)]
    groups = [{"params": rest, "weight_decay": 0.0}] + ([{"params": decay, "weight_decay": opts.weight_decay}]
                                                          if decay else [])
    options = {"finetune": asdict(opts), objective.name: objective.options(), "data": meta.get("data")}

    def save(trained: torch.nn.Module, state: dict) -> None:
        info = {**meta, "method": objective.name, "new_tokens": objective.new_tokens, "new_ids": new_ids,
                "options": options, "steps": state["step"], "validation": state["val"][-1] if state["val"] else {},
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
            final_model = (cast("PeftModel", trained).merge_and_unload() if opts.lora_rank > 0
                           else cast("PreTrainedModel", trained))
            final_model.save_pretrained(str(out), safe_serialization=True)
            tokenizer.save_pretrained(str(out))
            (out / META_FILE).write_text(json.dumps(info, indent=1) + "\n")

    lopts = opts.loop_options(opts.final_lr)
    return loop.train(model, objective, examples, out, lopts, options, groups, save, resume=resume,
                      progress=progress, accelerator=acc)
