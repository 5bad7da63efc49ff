"""The options of training: the loop's hyper-parameters (:class:`LoopOptions`) and the base every
method's recorded options derive from (:class:`TrainingOptions`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class LoopOptions:
    """Hyper-parameters of the loop (callers derive them from their own recorded options).

    Attributes:
        epochs: passes over the training split (``max_steps`` > 0 overrides).
        max_steps: optimiser steps, 0 = ``epochs`` decides.
        lr: AdamW peak learning rate.
        schedule: ``linear`` or ``cosine`` decay after the warm-up.
        final_lr: the decay's floor as a fraction of ``lr``.
        warmup: share of the steps with a linear warm-up.
        batch_size: items per process and step.
        clip: gradient clipping threshold.
        clip_by: ``norm`` (global norm) or ``value``.
        val_fraction: share of the items held out (the last ones) for validation.
        seed: data order and per-step randomness.
        checkpoint_every: steps between checkpoints.
    """

    epochs: int = 2
    max_steps: int = 0
    lr: float = 3e-4
    schedule: str = "cosine"
    final_lr: float = 0.0
    warmup: float = 0.05
    batch_size: int = 4
    clip: float = 1.0
    clip_by: str = "norm"
    val_fraction: float = 0.05
    seed: int = 0
    checkpoint_every: int = 50


@dataclass(frozen=True)
class TrainingOptions:
    """The options every trained method shares (each method's options derive from it and add their
    own; the defaults are the draft heads', fine-tunes override theirs). ``schedule`` and
    ``clip_by`` are the method's, not options (class constants: not recorded).

    Attributes:
        epochs: passes over the training split (``max_steps`` > 0 overrides).
        max_steps: optimiser steps, 0 = ``epochs`` decides.
        lr: AdamW peak learning rate (linear warm-up over ``warmup`` of the steps, then the
            method's ``schedule``).
        batch_size: sequences per process and step.
        clip: gradient clipping threshold (by the method's ``clip_by``).
        weight_decay: AdamW weight decay.
        warmup: share of the steps with a linear warm-up.
        val_fraction: share of the examples held out (the last ones) for validation.
        seed: data order and per-step randomness (noise, windows, masks, initialisation).
        checkpoint_every: steps between checkpoints.
    """

    SCHEDULE: ClassVar[str] = "linear"
    CLIP_BY: ClassVar[str] = "value"

    epochs: int = 2
    max_steps: int = 0
    lr: float = 3e-4
    batch_size: int = 4
    clip: float = 0.5
    weight_decay: float = 0.01
    warmup: float = 0.01
    val_fraction: float = 0.05
    seed: int = 0
    checkpoint_every: int = 200

    def loop_options(self, final_lr: float = 0.0) -> LoopOptions:
        """The loop's hyper-parameters for these options (decaying to ``final_lr`` x ``lr``)."""
        return LoopOptions(epochs=self.epochs, max_steps=self.max_steps, lr=self.lr, schedule=self.SCHEDULE,
                           final_lr=final_lr, warmup=self.warmup, batch_size=self.batch_size, clip=self.clip,
                           clip_by=self.CLIP_BY, val_fraction=self.val_fraction, seed=self.seed,
                           checkpoint_every=self.checkpoint_every)
