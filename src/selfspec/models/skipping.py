"""Sub-layer skipping on a stock HF decoder (the Draft & Verify draft model).

A pre-norm decoder block computes ``h <- h + Attn(norm(h))`` then ``h <- h + MLP(norm(h))``.
Skipping a sub-layer bypasses its residual branch, so ``h`` passes through unchanged; attention
and MLP of the same block are skipped independently. Equivalent weight-space view (used by the
tests): skipping attention l is ``o_proj_l = 0``, skipping MLP l is ``down_proj_l = 0``.

:func:`skipped` builds the draft's module tree once: a :func:`~selfspec.models.runner.share_copy`
of the model (the same weights) whose skipped attention / MLP children are modules that return
zeros (the block's residual add then passes ``h`` through). No modelling file is forked and the
model itself is left as it is. A skipped attention sub-layer runs no projection and writes no KV
into the cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import SelfspecError


@dataclass(frozen=True)
class SkipSet:
    """Which sub-layers the draft skips.

    Attributes:
        attention: indices of decoder blocks whose attention sub-layer is skipped, increasing.
        mlp: indices of decoder blocks whose MLP sub-layer is skipped, increasing.
    """

    attention: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()

    @classmethod
    def of(cls, attention=(), mlp=()) -> SkipSet:
        return cls(tuple(sorted({int(i) for i in attention})), tuple(sorted({int(i) for i in mlp})))

    @property
    def size(self) -> int:
        return len(self.attention) + len(self.mlp)

    def ratio(self, num_layers: int) -> float:
        """Fraction of the ``2 * num_layers`` sub-layers skipped."""
        return self.size / (2 * num_layers) if num_layers else 0.0

    def check(self, num_layers: int) -> None:
        bad = [i for i in (*self.attention, *self.mlp) if not 0 <= i < num_layers]
        if bad:
            raise SelfspecError(f"skip set names layer {bad[0]}, but the model has layers 0..{num_layers - 1}")


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder blocks of a stock HF causal LM (``model.model.layers``), each with
    ``self_attn`` and ``mlp`` children."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not all(
            hasattr(b, "self_attn") and hasattr(b, "mlp") for b in layers):
        raise SelfspecError(
            f"self-spec needs a decoder with model.layers[i].self_attn / .mlp (Llama, Qwen2, Mistral, ...); "
            f"{type(model).__name__} has another layout"
        )
    return layers


class SkippedAttention(torch.nn.Module):
    """A bypassed attention sub-layer: ``forward(hidden_states[B, T, H], ...) -> (zeros, None)``."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        return torch.zeros_like(hidden_states), None


class SkippedMLP(torch.nn.Module):
    """A bypassed MLP sub-layer: ``forward(hidden_states[B, T, H]) -> zeros``."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def skipped(model: torch.nn.Module, skip: SkipSet) -> torch.nn.Module:
    """``model`` with the sub-layers of ``skip`` bypassed: a new module tree over the same weights
    (:func:`~selfspec.models.runner.share_copy`), ``model`` itself unchanged; ``model`` itself
    when nothing is skipped.

    Non-skipped attention layers append their KV to the cache as usual; skipped ones append
    nothing, so cache layers end up with different lengths: callers pass explicit position ids
    and masks (see :mod:`selfspec.drafters.self_spec`) and truncate afterwards.
    """
    from .runner import share_copy

    skip.check(len(decoder_layers(model)))
    if not skip.size:
        return model
    draft = share_copy(model)
    layers = decoder_layers(draft)
    for i in skip.attention:
        layers[i].self_attn = SkippedAttention()
    for i in skip.mlp:
        layers[i].mlp = SkippedMLP()
    return draft
