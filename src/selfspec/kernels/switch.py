"""Draft passes on other kernels than verification: a second module tree over the same model
whose linear layers are an int8 or bf16 copy of the model's own weights (for self-drafting).

Only the linear layers change; the attention function stays the verify runner's. Drafts need
not be exact, and verification runs on the verify runner's own module tree, which this never
touches, so output is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import psutil
from torch import nn

from ..errors import SelfspecError
from .bf16 import apply as apply_bf16
from .gemv import BLOCK as LAYOUT_BLOCK
from .int8 import CompiledInt8Path
from .int8 import apply as apply_int8
from .swap import layer_bytes, linear_layers, original_of, released, share_copy, use_attention

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel

DRAFT_KERNELS = ("same", "int8", "bf16")


def draft_precisions(device_type: str = "cpu") -> tuple[tuple[str, ...], dict[str, str]]:
    """The draft kernels that can pay on ``device_type`` (``same``, ``int8``, and ``bf16`` where
    the hardware multiplies it natively), and why each other one is left out."""
    from .bf16 import native_reason

    left_out = {}
    reason = native_reason(device_type)
    if reason is not None:
        left_out["bf16"] = reason
    return tuple(k for k in DRAFT_KERNELS if k not in left_out), left_out


def layout_fits(model: nn.Module) -> bool:
    """Whether an int8 draft of ``model`` can get the few-row layout (:meth:`DraftLayers.add_layout`):
    every linear layer's rows fill the layout's blocks, and the int8 copies take at most a third of
    the free memory (as for the fp32 layout)."""
    originals = [original_of(layer) for _, _, layer in linear_layers(model)]
    if any(o.out_features % LAYOUT_BLOCK for o in originals):
        return False
    return sum(o.in_features * o.out_features for o in originals) <= psutil.virtual_memory().available // 3


class DraftLayers:
    """The draft's module tree: the verify runner's model (``share_copy``: the same weights and
    modules' structure) with its linear layers on ``kernels``, built once, never switched.

    Attributes:
        model: the draft's module tree (its attention function the verify runner's).
        kernels: the draft's linear-layer backend (``int8`` or ``bf16``).
        extra_bytes: memory the draft's layers hold beyond the verify tree's tensors (:func:`layer_bytes`).
    """

    def __init__(self, model: nn.Module, kernels: str) -> None:
        """
        Args:
            model: the verify runner's module tree (left as it is).
            kernels: ``int8`` or ``bf16``.
        """
        if kernels not in DRAFT_KERNELS or kernels == "same":
            raise SelfspecError(f"draft kernels {kernels!r}: use int8 or bf16 (or same for the verify backend's)")
        if released(model):
            raise SelfspecError("this model's fp32 weights were released; load it again to draft on other kernels")
        self.kernels = kernels
        self.model = share_copy(model)
        attn = cast("PreTrainedModel", model).config._attn_implementation
        if kernels == "int8":
            apply_int8(self.model)  # builds the int8 layers from the fp32 originals
        else:
            apply_bf16(self.model)
        use_attention(self.model, attn)  # the verify runner's attention function
        self._verify = model

    @property
    def extra_bytes(self) -> int:
        return layer_bytes(self.model, self._verify)

    def add_layout(self) -> bool:
        """Give every int8 draft layer its compiled path (the few-row layout of its int8 weights, a
        quarter of the fp32 weights' memory more), so that a one-token forward of :attr:`model`
        compiled by ``torch.compile`` reads int8 weights in Inductor's own loop (the ``compiled``
        backend's draft step). True when every layer has it; False (and nothing kept) for bf16
        drafts, where a layer's rows do not fill the layout's blocks, or where the copies would
        take more than a third of the free memory."""
        all_layers = [layer for _, _, layer in linear_layers(self.model)]
        layers = [layer for layer in all_layers if isinstance(layer, CompiledInt8Path)]
        if self.kernels != "int8" or len(layers) != len(all_layers):
            return False
        if not layout_fits(self.model):
            return False
        if all(layer.add_layout() for layer in layers):
            return True
        for layer in layers:
            layer.blocked = layer.row_scale = None
        return False
