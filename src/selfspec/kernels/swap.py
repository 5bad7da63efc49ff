"""Swap a model's ``nn.Linear`` layers for another implementation, in place, without forking
modelling code: HF models call ``self.q_proj(x)`` etc., so any module with the same call
signature works. Each replacement keeps the original layer so the swap can be undone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class KernelState:
    """What a model's kernel swaps remember, held by its :class:`~selfspec.models.loading.LoadedModel`
    (nothing is written onto the user's module).

    Attributes:
        kept: replacements kept for instant switching back, by (``id`` of the original layer, maker).
        attn_before: the attention function the model had before a backend switched it (None: not
            switched).
        noted: notes already logged for this model (a backend switched to again says them once).
    """

    kept: dict[tuple[int, object], nn.Module] = field(default_factory=dict)
    attn_before: str | None = None
    noted: set[str] = field(default_factory=set)


class SwappedLinear(nn.Module):
    """Base class of replacement layers: ``forward(x[..., in_features]) -> [..., out_features]``.

    Attributes:
        original: the ``nn.Linear`` it replaced (its weight stays shared with e.g. tied embeddings).
        in_features, out_features: as in ``nn.Linear``.
    """

    backend = "?"

    def __init__(self, original: nn.Linear) -> None:
        super().__init__()
        # Stored outside the module tree so state_dict / parameters() do not see it twice.
        self.__dict__["original"] = original
        self.in_features = original.in_features
        self.out_features = original.out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"


def original_of(layer: nn.Module) -> nn.Module:
    """The ``nn.Linear`` behind a swapped layer (the layer itself if it is not swapped)."""
    return layer.original if isinstance(layer, SwappedLinear) else layer


def linear_layers(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """Every ``(parent, attribute name, layer)`` whose layer is an ``nn.Linear`` or a swapped one."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, (nn.Linear, SwappedLinear)):
                found.append((parent, name, child))
    return found


def swap_linears(model: nn.Module, make: Callable[[nn.Linear], SwappedLinear], keep: bool = False,
                 only: set[int] | None = None, state: KernelState | None = None) -> int:
    """Replace every linear layer (or those whose ``id`` is in ``only``) by ``make(original)``;
    returns how many were replaced.

    With ``keep`` (and a ``state`` to keep them in), the replacement is remembered and reused
    next time (switching backends back and forth is then free, at the memory cost of both copies).
    """
    kept = state.kept if state is not None else {}
    n = 0
    for parent, name, child in linear_layers(model):
        if only is not None and id(child) not in only:
            continue
        original = original_of(child)
        layer = kept.get((id(original), make))
        if layer is None:
            layer = make(original)
            if keep:
                kept[(id(original), make)] = layer
        setattr(parent, name, layer)
        n += 1
    return n


def restore_linears(model: nn.Module, forget: bool = False, state: KernelState | None = None) -> None:
    """Undo :func:`swap_linears`: put the original ``nn.Linear`` layers back.

    ``forget`` also drops the replacements ``state`` kept (``swap_linears(..., keep=True)``).
    """
    if forget and state is not None:
        state.kept.clear()
    for parent, name, child in linear_layers(model):
        original = original_of(child)
        if child is not original:
            setattr(parent, name, original)


def use_attention(model: nn.Module, name: str, state: KernelState | None = None) -> None:
    """Switch the model's attention function to ``name`` (a backend's own), remembering in
    ``state`` the one it had so :func:`restore_attention` can put it back."""
    if state is not None and state.attn_before is None:
        state.attn_before = model.config._attn_implementation
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)


def restore_attention(model: nn.Module, state: KernelState | None = None) -> None:
    """Undo :func:`use_attention` (no-op if no backend switched it)."""
    before = state.attn_before if state is not None else None
    if state is not None:
        state.attn_before = None
    if before is not None and model.config._attn_implementation != before:
        model.set_attn_implementation(before)


def current_backend(model: nn.Module) -> str:
    """``stock`` if no layer is swapped, else the swapped layers' backend name."""
    for _, _, child in linear_layers(model):
        if isinstance(child, SwappedLinear):
            return child.backend
    return "stock"


def flatten(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``x[..., K]`` as a contiguous ``[M, K]`` matrix, plus the leading shape to restore."""
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


def release_originals(model: nn.Module) -> int:
    """Free the fp32 weights kept behind swapped layers (a model loaded for one backend for
    good, e.g. a draft model, need not hold both copies). Weights shared with the input
    embedding are kept. Returns the number of bytes freed; the model cannot go back to
    ``stock`` afterwards."""
    keep = model.get_input_embeddings().weight.data_ptr() if hasattr(model, "get_input_embeddings") else None
    freed = 0
    for _, _, child in linear_layers(model):
        if isinstance(child, SwappedLinear) and child.original.weight.data_ptr() != keep:
            w = child.original.weight
            freed += w.numel() * w.element_size()
            child.original.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device), requires_grad=False)
    return freed


def released(model: nn.Module) -> bool:
    """Whether :func:`release_originals` freed the fp32 weights behind this model's swapped layers
    (read from the layers themselves: an empty original weight)."""
    return any(isinstance(child, SwappedLinear) and child.original.weight.numel() == 0
               for _, _, child in linear_layers(model))
