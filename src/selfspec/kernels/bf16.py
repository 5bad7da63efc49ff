"""``bf16`` draft kernels: a bfloat16 copy of a model's linear weights, for draft passes only.

Drafts need no exactness (verification stays on the verify kernels, in fp32), only acceptance per
unit of cost. Where the CPU multiplies bf16 natively (``avx512_bf16``, AMX tiles), oneDNN runs a
bf16 product at up to twice the fp32 rate and reads half the bytes; elsewhere bf16 is emulated and
slower than fp32, so ``auto`` offers bf16 drafts only where :func:`native_reason` finds the units
(and then keeps them only where they measure faster).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from ..core.machine import cpu_flag_set
from .swap import SwappedLinear, flatten

log = logging.getLogger("selfspec.kernels")

NATIVE_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs that multiply bf16 natively


class Bf16Linear(SwappedLinear):
    """``y = (bf16(x) @ bf16(W).T + b)`` returned in ``x``'s dtype.

    Shapes: ``x[..., in_features] -> y[..., out_features]``. Weights are held in bf16 (half the
    fp32 memory); the bias stays fp32 and is added after the product.
    """

    backend = "bf16"

    def __init__(self, original: nn.Linear) -> None:
        super().__init__(original)
        self.weight = original.weight.detach().to(torch.bfloat16)
        self.bias = None if original.bias is None else original.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = flatten(x)
        y = torch.nn.functional.linear(x2.to(torch.bfloat16), self.weight).to(x.dtype)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.reshape(*lead, self.out_features)


def _probe(device: torch.device) -> str | None:
    """None if a small bf16 product runs here and agrees with fp32 to bf16 precision, else why not
    (a sandbox may refuse the AMX tile state; a build may lack the kernel)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    x = torch.randn(4, 128, generator=g)
    try:
        layer = nn.Linear(128, 64, bias=False).to(device)
        with torch.no_grad():
            layer.weight.copy_(w)
            y = Bf16Linear(layer)(x.to(device)).float().cpu()
    except RuntimeError as e:
        return f"a bf16 product failed here ({str(e).splitlines()[0][:120]})"
    want = x @ w.t()
    if not torch.allclose(y, want, rtol=0.05, atol=0.5):
        return "a bf16 product disagreed with fp32 beyond bf16 rounding here"
    return None


@functools.lru_cache(maxsize=4)
def native_reason(device_type: str = "cpu", flags: frozenset[str] | None = None) -> str | None:
    """None where bf16 drafts can pay on ``device_type`` (CUDA; a CPU with ``avx512_bf16`` or
    AMX bf16 tiles, whose bf16 product also passes a probe), else the one-line reason they are
    left out of ``auto``. ``flags``: the CPU's flags (default: this CPU's, ``core.machine.cpu_flag_set``)."""
    if device_type == "cuda":
        return None
    if device_type != "cpu":
        return f"bf16 drafts are offered on CPU and CUDA only (device {device_type})"
    flags = cpu_flag_set() if flags is None else flags
    if not any(f in flags for f in NATIVE_FLAGS):
        return "this CPU has no native bf16 units (avx512_bf16 or amx_bf16): bf16 would be emulated, slower than fp32"
    return _probe(torch.device("cpu"))


def apply(model: nn.Module) -> None:
    """Swap every linear layer of ``model`` (the LM head too) for :class:`Bf16Linear`, in place."""
    from .swap import swap_linears

    swap_linears(model, Bf16Linear)
