"""``int8`` backend: int8 weights (one scale per output channel) times int8 activations (one
scale per row, i.e. per token), accumulated in int32.

This changes the model (weights and activations are rounded to 8 bits), so it is opt-in. It
keeps speculative decoding exact *with respect to the quantised model*: integer accumulation is
exact whatever the kernel's blocking, and a row's activation scale depends only on that row, so
a token's logits do not depend on how many other tokens are verified with it. (Per-tensor
dynamic scales, as in ``torch.ao`` dynamic quantisation, break that: the scale would depend on
the other rows.)
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SelfspecError
from . import rowwise_attention
from .swap import SwappedLinear, flatten, swap_linears

QMAX = 127.0


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 quantisation.

    Args:
        x: ``[M, K]`` float.
    Returns:
        ``(q[M, K] int8, scale[M, 1] float)`` with ``x ~= q * scale``; a zero row gets scale 1.
    """
    amax = x.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = torch.round(x / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if ``torch._int_mm`` can run here, else the reason it cannot."""
    if not hasattr(torch, "_int_mm"):
        return "this torch build has no torch._int_mm; use --kernels stock"
    if device.type not in ("cpu", "cuda"):
        return f"the int8 backend runs on CPU or CUDA (model is on {device}); use --kernels stock"
    return None


def _onednn_int8() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise") \
        and torch.backends.mkldnn.is_available()


class Int8Linear(SwappedLinear):
    """``y = (q(x) @ Wq.T) * s_w * s_x + b`` with integer accumulation.

    Shapes: ``x[..., in_features] -> y[..., out_features]`` in ``x``'s dtype.

    Kernels: on CPU, oneDNN's u8 x s8 matrix product with the weight prepacked (the int8
    activations shifted to uint8 with zero point 128, which oneDNN compensates exactly; flat
    cost in the number of rows); elsewhere ``torch._int_mm`` on ``weight_t[in, out]``. Both
    return the exact int32 accumulator times ``s_w``, so the result is the same either way.
    """

    backend = "int8"

    def __init__(self, original: nn.Linear) -> None:
        super().__init__(original)
        w = original.weight.detach().float()
        q, scale = quantize_rows(w)
        self.weight_scale = scale.reshape(-1)  # [out] fp32
        self.bias = None if original.bias is None else original.bias.detach()
        self.use_onednn = w.device.type == "cpu" and _onednn_int8()
        if self.use_onednn:
            self.packed = torch.ops.onednn.qlinear_prepack(q, None)
            self.zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        else:
            self.weight_t = q.t()  # [in, out] view of a row-major [out, in] int8 matrix

    def _accumulate(self, xq: torch.Tensor) -> torch.Tensor:
        """``xq[M, in]`` int8 -> ``(xq @ Wq.T) * s_w`` ``[M, out]`` fp32 (exact int32 sums)."""
        if self.use_onednn:
            xu = (xq.to(torch.int16) + 128).to(torch.uint8)
            return torch.ops.onednn.qlinear_pointwise(xu, 1.0, 128, self.packed, self.weight_scale,
                                                      self.zero_points, None, 1.0, 0, torch.float32,
                                                      "none", [], "")
        if xq.is_cuda and xq.shape[0] <= 16:  # the CUDA kernel wants more than 16 rows
            pad = torch.zeros(17 - xq.shape[0], xq.shape[1], dtype=torch.int8, device=xq.device)
            acc = torch._int_mm(torch.cat([xq, pad]), self.weight_t)[: xq.shape[0]]
        else:
            acc = torch._int_mm(xq, self.weight_t)
        return acc.float().mul_(self.weight_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = flatten(x)
        xq, xs = quantize_rows(x2.float())
        y = self._accumulate(xq).mul_(xs)
        if self.bias is not None:
            y = y.add_(self.bias.float())
        return y.to(x.dtype).reshape(*lead, self.out_features)


def apply(model: nn.Module, keep: bool = False) -> None:
    """Swap every linear layer of ``model`` (the LM head too) for :class:`Int8Linear`."""
    p = next(model.parameters())
    reason = available(p.device, p.dtype)
    if reason:
        raise SelfspecError(reason)
    swap_linears(model, Int8Linear, keep)
    model.__dict__.setdefault("_selfspec_attn_before", model.config._attn_implementation)
    set_attention(model, rowwise_attention.NAME)


def set_attention(model: nn.Module, name: str) -> None:
    """Switch the model's attention function (``sdpa`` back when leaving the int8 backend)."""
    if model.config._attn_implementation != name:
        model.set_attn_implementation(name)
