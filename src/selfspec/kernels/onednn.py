"""``onednn`` backend: fp32 Linear layers through oneDNN with weights prepacked once at load.

Same model, same precision; only the summation order (rounding) differs from MKL. On CPUs where
MKL treats a few-row matrix product as separate matrix-vector products (the verify step of
speculative decoding), oneDNN's blocked kernel keeps T(q) nearly flat. Verify blocks also use
attention without KV copies (:mod:`selfspec.kernels.gqa_attention`).

The same layers run inside the ``compiled`` backend's step (:mod:`selfspec.models.compiled_step`):
Inductor lowers oneDNN's linear only for weights frozen into the graph as constants, so a traced
call goes through :func:`onednn_linear`, an operator Inductor calls as it is, the packed weight an
input like any parameter (nothing is baked into a saved step).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SelfspecError
from .swap import KernelState, SwappedLinear, flatten, swap_linears, use_attention


def available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the backend can run here, else the reason it cannot."""
    if device.type != "cpu":
        return f"the onednn backend runs on CPU only (model is on {device}); use --kernels stock"
    if dtype != torch.float32:
        return f"the onednn backend is fp32 only (model is {dtype}); use --dtype float32 or --kernels stock"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn); use --kernels stock"
    return None


@torch.library.custom_op("selfspec::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x[M, K] @ W.T + b -> [M, out_features]`` with ``packed`` = ``W`` in oneDNN's blocked layout
    (``torch.ops.mkldnn._reorder_linear_weight``): what a compiled graph calls (see the module)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


class OneDNNLinear(SwappedLinear):
    """``y = x @ W.T + b`` with ``W`` reordered into oneDNN's blocked layout.

    Shapes: ``x[..., in_features] -> y[..., out_features]`` (fp32).
    """

    backend = "onednn"

    def __init__(self, original: nn.Linear) -> None:
        super().__init__(original)
        w = original.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())
        self.bias = None if original.bias is None else original.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = flatten(x)
        if torch.compiler.is_compiling():  # traced by the compiled backend's step: an opaque call
            return onednn_linear(x2, self.packed, self.bias, self.out_features).reshape(*lead, self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y.reshape(*lead, self.out_features)


def apply(model: nn.Module, keep: bool = False, state: KernelState | None = None) -> None:
    """Swap every linear layer of ``model`` for :class:`OneDNNLinear`."""
    p = next(model.parameters())
    reason = available(p.device, p.dtype)
    if reason:
        raise SelfspecError(reason)
    swap_linears(model, OneDNNLinear, keep, state=state)
    if model.config._attn_implementation == "sdpa":
        from .gqa_attention import NAME

        use_attention(model, NAME, state)
