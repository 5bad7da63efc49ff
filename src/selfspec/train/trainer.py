"""Training an EAGLE / HASS draft head on cached target features: the head's objective on the
shared Accelerate loop (:mod:`.loop`: schedule, validation, checkpoints and resume, plots).

A batch pairs each cached target feature ``f_i`` with the next token; the input features get
uniform noise (the targets stay clean). One optimiser step per batch: the n alignment passes'
losses are summed (each pass's graph is independent, the earlier passes' outputs enter later
passes detached), as in the HASS code; one ``forward`` runs all passes, so DDP syncs once.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ..core.draft_vocab import DraftVocab, ranking_from_counts
from ..errors import SelfspecError
from ..heads.eagle import EagleHead, load_head
from ..models.draft_vocab import always_ids
from . import loop
from .features import CachedSequence
from .hca import HcaModel
from .losses import LossWeights, pass_losses, teacher
from .options import TrainingOptions

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel


@dataclass(frozen=True)
class TrainOptions(TrainingOptions):
    """Hyper-parameters (defaults: see ``docs/methods/hass.md`` for the paper's and why ours differ).

    Attributes:
        objective: ``eagle`` (passes 1, no top-K loss) or ``hass``; names the head's method.
        passes: HCA alignment passes n (1 = EAGLE).
        topk: K of the top-K distillation loss.
        topk_weight: its weight w (0 = off).
        reg_weight / cls_weight: EAGLE's feature-regression and soft cross-entropy weights.
        beta: per-pass weight ``beta ** (j - 1)``.
        epochs: passes over the training split.
        max_steps: optimiser steps; 0 = ``epochs`` decides (recorded only when set, so runs made
            before it existed still resume).
        lr: AdamW peak learning rate (linear warm-up over ``warmup`` of the steps, linear decay).
        batch_size: sequences per process per step.
        noise: uniform noise amplitude added to input features (target features stay clean).
        clip: gradient clipping by value.
        weight_decay: AdamW weight decay.
        val_fraction: share of sequences held out (the last ones) for validation.
        seed: data order, noise and initialisation.
        checkpoint_every: steps between checkpoints.
        init: a head directory to continue from (the paper's ablation protocol), or empty.
        fc_bias: give ``fc`` a bias (EAGLE's default); False for heads that vLLM loads as they are.
        draft_vocab: N > 0 = a reduced draft vocabulary: the N most frequent learned tokens of
            the training data (the target's own answers) plus EOS; the losses' LM head covers
            only those rows (cheaper training), and the head is saved with its ``d2t`` map.
    """

    objective: str = "hass"
    passes: int = 3
    topk: int = 10
    topk_weight: float = 1.0
    reg_weight: float = 1.0
    cls_weight: float = 0.1
    beta: float = 1.0
    noise: float = 0.1
    init: str = ""
    fc_bias: bool = True
    draft_vocab: int = 0

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


def compute_losses(model: torch.nn.Module, target: torch.nn.Module, batch: Batch,
                   opts: TrainOptions, draft_lm: torch.nn.Module | None = None,
                   vocab: DraftVocab | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward all passes; returns the summed loss and per-pass metrics (``acc1``, ``loss1``, ...).

    With a reduced vocabulary (``draft_lm``: the LM head's rows at ``vocab.ids``), the draft's
    distribution covers only the subset and the teacher's probabilities are restricted to it."""
    param = next(model.parameters())
    device = param.device
    feats = batch.features.to(device=device, dtype=param.dtype)
    mask = batch.mask.to(device)
    lm = cast("PreTrainedModel", target)
    embed, lm_head = lm.get_input_embeddings(), lm.get_output_embeddings()
    with torch.no_grad():
        tok_emb = embed(batch.next_tokens.to(device)).to(feats.dtype)
    preds = model(feats, tok_emb)
    tgt = batch.targets.to(device=device, dtype=param.dtype)[mask]
    w = opts.weights
    t = teacher(lm_head, tgt, w.k, None if vocab is None else vocab.ids_on(device))
    total = torch.zeros((), device=device)
    metrics: dict[str, float] = {}
    for j, pred in enumerate(preds, start=1):
        parts = pass_losses(pred[mask], tgt, draft_lm if draft_lm is not None else lm_head, t, w)
        total = total + w.beta ** (j - 1) * parts["loss"]
        for k in ("loss", "reg", "cls", "topk", "acc"):
            metrics[f"{k}{j}"] = float(parts[k].detach())
    metrics["loss"] = float(total.detach())
    metrics["tokens"] = int(mask.sum())
    return total, metrics


def with_feature_noise(batch, noise: float, rng: random.Random):
    """``batch`` with uniform noise in [-noise, noise] added to its input ``features`` (EAGLE's
    robustness trick; the teacher's targets are untouched), drawn from a generator seeded by ``rng``.
    ``batch`` is any dataclass with a ``features`` tensor; ``noise <= 0`` returns it unchanged."""
    if noise <= 0:
        return batch
    gen = torch.Generator().manual_seed(rng.getrandbits(62))
    u = torch.rand(batch.features.shape, generator=gen, dtype=batch.features.dtype)
    return replace(batch, features=batch.features + (u - 0.5) * 2 * noise)


class HeadObjective:
    """The :class:`~selfspec.train.loop.Objective` of EAGLE / HASS head training: batches of
    cached sequences (:func:`collate`), uniform noise on the input features of training batches
    (drawn from the step's RNG; validation batches stay clean), and :func:`compute_losses`."""

    plot_keys: tuple[str, ...] = ("loss", "reg1", "cls1")
    eval_draws = 1  # validation passes (see loop.Objective)

    def __init__(self, target: torch.nn.Module, opts: TrainOptions, vocab: DraftVocab | None = None) -> None:
        self.target, self.opts, self.name = target, opts, opts.objective
        self.vocab = vocab
        self.draft_lm = None if vocab is None else vocab.head(cast("PreTrainedModel", target).get_output_embeddings())

    def options(self) -> dict:
        return asdict(self.opts)

    def make_batch(self, seqs: list[CachedSequence], rng: random.Random) -> Batch:
        return with_feature_noise(collate(seqs), self.opts.noise, rng)

    def make_eval_batch(self, seqs: list[CachedSequence], rng: random.Random) -> Batch:
        return collate(seqs)

    def loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        return compute_losses(model, self.target, batch, self.opts, self.draft_lm, self.vocab)


def evaluate(model: HcaModel, target: torch.nn.Module, seqs: list[CachedSequence], opts: TrainOptions,
             batch_size: int) -> dict[str, float]:
    """Token-weighted mean of every metric over ``seqs`` (no noise). ``acc{j}`` is the top-1
    agreement of pass j with the target: with HCA, the acceptance of drafting step j along the
    data (teacher-forced tokens)."""
    return loop.evaluate(model, HeadObjective(target, opts, model.head.draft_vocab), seqs, batch_size, opts.seed)


def training_vocab(target: torch.nn.Module, seqs: list[CachedSequence], size: int) -> DraftVocab:
    """The ``size`` most frequent learned tokens of ``seqs`` (the target's own answers where the
    data was self-distilled), then lower ids, plus the model's EOS ids."""
    vocab = int(cast("PreTrainedConfig", target.config).vocab_size)
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        ids = s.input_ids[s.loss_mask.bool()]
        counts += torch.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)
    return DraftVocab.from_ranking(ranking_from_counts(counts), size, vocab, always_ids(target, None))


def recorded_options(opts) -> dict:
    """A head's options as recorded (resume compares them): ``max_steps`` only when set, so a
    run checkpointed before the option existed still resumes."""
    options = json.loads(json.dumps(asdict(opts)))
    if not options.get("max_steps"):
        options.pop("max_steps", None)
    return options


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
    acc = loop.accelerator_for(target, accelerator)
    torch.manual_seed(opts.seed)
    target.requires_grad_(False)
    head = load_head(opts.init, target)[0] if opts.init else EagleHead(target, bias=opts.fc_bias)
    if (head.fc.bias is not None) != opts.fc_bias:
        raise SelfspecError(f"--init head {opts.init} {'has' if head.fc.bias is not None else 'has no'} "
                            "an fc bias; drop or add --no-fc-bias to match it")
    if opts.draft_vocab > 0 and head.draft_vocab is None:
        head.set_draft_vocab(training_vocab(target, seqs, opts.draft_vocab))
    head.train()
    method = "eagle2" if opts.objective == "eagle" else "hass"

    options = recorded_options(opts)

    def save(model: HcaModel, state: dict) -> None:
        model.head.save(out, {**meta, "method": method, "options": options, "steps": state["step"],
                              "validation": state["val"][-1] if state["val"] else {}})

    lopts = opts.loop_options()
    groups = [{"params": list(head.parameters()), "weight_decay": opts.weight_decay}]
    objective = HeadObjective(target, opts, head.draft_vocab)
    return loop.train(HcaModel(head, opts.passes), objective, seqs, out, lopts, options,
                      groups, save, resume=resume, progress=progress, accelerator=acc)
