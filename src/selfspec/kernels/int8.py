"""``int8`` backend: int8 weights (one scale per output channel) times int8 activations (one
scale per row, i.e. per token), accumulated exactly in integers. Activations are 8 bits wide,
or 7 bits on x86 CPUs without VNNI, where that keeps oneDNN's fast product exact
(:func:`onednn_activation_bits`).

This changes the model (weights and activations are rounded to 8 bits), so it is opt-in. It
keeps speculative decoding exact *with respect to the quantised model*: integer accumulation is
exact whatever the kernel's blocking, and a row's activation scale depends only on that row, so
a token's logits do not depend on how many other tokens are verified with it. (Per-tensor
dynamic scales, as in ``torch.ao`` dynamic quantisation, break that: the scale would depend on
the other rows.)

Sibling layers that read the same input (``q/k/v_proj``, ``gate/up_proj``) share one quantised
activation and one matrix product over their concatenated weights; since every output column is
still its own exact integer sum times its own scales, that changes no bit of the result.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from ..errors import SelfspecError
from . import rowwise_attention
from .swap import SwappedLinear, flatten, linear_layers, original_of, swap_linears, use_attention

QMAX = 127.0  # weights: symmetric 8 bits
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_rows(x: torch.Tensor, qmax: float = QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantisation to integers in ``[-qmax, qmax]``.

    Args:
        x: ``[M, K]`` float.
        qmax: largest magnitude (127 for 8 bits, 63 for 7 bits).
    Returns:
        ``(q[M, K] int8, scale[M, 1] float)`` with ``x ~= q * scale``.
    """
    scale = row_scales(x, qmax)
    return torch.round(x / scale).to(torch.int8), scale


def row_scales(x: torch.Tensor, qmax: float = QMAX) -> torch.Tensor:
    """``amax(|x|) / qmax`` per row of ``x[M, K]`` -> ``[M, 1]``; a zero row gets a tiny scale
    (its values quantise to 0 all the same). ``|x / scale| <= qmax`` holds without clamping."""
    return x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30).div_(qmax)


def available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the int8 kernels can run here, else the reason they cannot."""
    if not hasattr(torch, "_int_mm"):
        return "this torch build has no torch._int_mm; use --kernels stock"
    if device.type not in ("cpu", "cuda"):
        return f"the int8 backend runs on CPU or CUDA (model is on {device}); use --kernels stock"
    return None


def _onednn_exact(bits: int) -> bool:
    """Whether oneDNN's u8 x s8 product gives exact integer sums for ``bits``-wide activations.

    The probe is the worst case for saturation: every activation at its largest magnitude times
    weights of +-127, so any pair of products summed in int16 overflows if it can.
    """
    zp = 1 << (bits - 1)
    k, n = 64, 8
    w = torch.full((n, k), 127, dtype=torch.int8)
    w[1::2] = -127
    xu = torch.full((3, k), 2 * zp - 1, dtype=torch.uint8)
    xu[1] = 0
    xu[2, ::2] = 0
    try:
        y = torch.ops.onednn.qlinear_pointwise(xu, 1.0, zp, torch.ops.onednn.qlinear_prepack(w, None),
                                               torch.ones(n), torch.zeros(n, dtype=torch.int64), None, 1.0, 0,
                                               torch.float32, "none", [], "")
    except RuntimeError:
        return False
    exact = ((xu.to(torch.int64) - zp) @ w.to(torch.int64).t()).float()
    return torch.equal(y, exact)


@functools.lru_cache(maxsize=1)
def onednn_activation_bits() -> int:
    """Widest activation width for which oneDNN's u8 x s8 CPU product is exact here (8 or 7), or 0.

    With VNNI (AVX-512 VNNI / AVX-VNNI) products accumulate in int32: 8 bits are exact. Without
    it (AVX2 only) oneDNN adds *pairs* of u8 x s8 products in saturating int16; with activations
    of 7 bits (|x| <= 63, stored as 1..127 with zero point 64) a pair is at most 2 * 127 * 127 =
    32258 < 2^15, so nothing saturates and the sums are exact again. 0 means no exact oneDNN path
    (then ``torch._int_mm``, exact but slow on CPU, is used).
    """
    if not (hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")
            and torch.backends.mkldnn.is_available()):
        return 0
    for bits in (8, 7):
        if _onednn_exact(bits):
            return bits
    print("selfspec: oneDNN's int8 product is not exact on this CPU; the int8 backend falls back to "
          "torch._int_mm (exact, slow on CPU). Use --kernels onednn here.", file=sys.stderr)
    return 0


def _onednn_int8() -> bool:
    """Whether the CPU int8 backend runs on oneDNN's fast, exact product (8- or 7-bit activations)."""
    return onednn_activation_bits() > 0


def fast_cpu_int8() -> bool:
    """True when the int8 backend runs on oneDNN's fast (and exact) product on this CPU."""
    return _onednn_int8()


def activation_bits(device: torch.device | str = "cpu") -> int:
    """Activation width of the int8 model on ``device``: 8, or 7 on x86 CPUs without VNNI.

    The width is part of the quantised model's definition (what it computes), so reports name it.
    """
    if torch.device(device).type == "cpu" and onednn_activation_bits() == 7:
        return 7
    return 8


class Int8Matmul:
    """``x[M, K] -> (q(x) @ Wq.T) * s_w * s_x + b`` ``[M, N]`` for one int8 weight matrix.

    Kernels: on CPU, oneDNN's u8 x s8 product with the weight prepacked (the signed activations
    shifted to uint8 with zero point 128, or 64 for 7-bit activations, which oneDNN compensates
    exactly; flat cost in M); elsewhere ``torch._int_mm``. Both give the exact integer sums, so
    for the same activation width the results are the same bits.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        q, scale = quantize_rows(weight.detach().float())
        self.out_features = weight.shape[0]
        self.weight_scale = scale.reshape(-1)  # [N] fp32
        self.bias = None if bias is None else bias.detach().float()
        bits = activation_bits(weight.device)
        self.act_qmax = float((1 << (bits - 1)) - 1)  # 127 or 63
        self.zero_point = 1 << (bits - 1)  # 128 or 64
        self.use_onednn = weight.device.type == "cpu" and _onednn_int8()
        if self.use_onednn:
            self.packed = torch.ops.onednn.qlinear_prepack(q, None)
            self.zero_points = torch.zeros(self.out_features, dtype=torch.int64)
        else:
            self.weight_t = q.t()  # [K, N] view of a row-major [N, K] int8 matrix (torch._int_mm)

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2[M, K]`` float -> ``[M, N]`` fp32."""
        if self.use_onednn:
            xs = row_scales(x2, self.act_qmax)
            xu = torch.round(x2 / xs).add_(self.zero_point).to(torch.uint8)
            y = torch.ops.onednn.qlinear_pointwise(xu, 1.0, self.zero_point, self.packed, self.weight_scale,
                                                   self.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        else:
            xq, xs = quantize_rows(x2, self.act_qmax)
            if xq.is_cuda and xq.shape[0] <= 16:  # the CUDA kernel wants more than 16 rows
                pad = torch.zeros(17 - xq.shape[0], xq.shape[1], dtype=torch.int8, device=xq.device)
                acc = torch._int_mm(torch.cat([xq, pad]), self.weight_t)[: xq.shape[0]]
            else:
                acc = torch._int_mm(xq, self.weight_t)
            y = acc.float().mul_(self.weight_scale)
        y = y.mul_(xs.float())
        return y if self.bias is None else y.add_(self.bias)


class Int8Linear(SwappedLinear):
    """One linear layer on :class:`Int8Matmul`. Shapes: ``x[..., in] -> [..., out]`` in ``x``'s dtype."""

    backend = "int8"

    def __init__(self, original: nn.Linear) -> None:
        super().__init__(original)
        self.matmul = Int8Matmul(original.weight, original.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = flatten(x)
        return self.matmul(x2).to(x.dtype).reshape(*lead, self.out_features)


class Int8Group:
    """Sibling layers reading the same input, as one product over their concatenated weights.

    The first sibling called computes all outputs; each other sibling takes its slice once.
    The cache is keyed by the input tensor object (and its version counter outside inference
    mode), so a different input, or a sibling asking twice, is always recomputed.
    """

    def __init__(self, layers: list[nn.Linear]) -> None:
        weight = torch.cat([layer.weight.detach() for layer in layers])
        biases = [layer.bias.detach() if layer.bias is not None
                  else torch.zeros(layer.out_features, dtype=layer.weight.dtype, device=layer.weight.device)
                  for layer in layers]
        has_bias = any(layer.bias is not None for layer in layers)
        self.matmul = Int8Matmul(weight, torch.cat(biases) if has_bias else None)
        self.sizes = [layer.out_features for layer in layers]
        self._input: torch.Tensor | None = None
        self._version = -1
        self._outputs: list[torch.Tensor | None] = []

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Output of sibling ``index`` for ``x[..., K]``: ``[..., sizes[index]]``."""
        version = -1 if x.is_inference() else x._version
        if x is not self._input or version != self._version or self._outputs[index] is None:
            x2, lead = flatten(x)
            y = self.matmul(x2).to(x.dtype)
            self._outputs = [part.reshape(*lead, n) for part, n in zip(y.split(self.sizes, dim=1), self.sizes)]
            self._input, self._version = x, version
        out, self._outputs[index] = self._outputs[index], None
        if all(o is None for o in self._outputs):
            self._input = None  # all taken: hold no reference to the input
        return out


class Int8GroupMember(SwappedLinear):
    """One sibling of an :class:`Int8Group`. Shapes: ``x[..., in] -> [..., out]``."""

    backend = "int8"

    def __init__(self, original: nn.Linear, group: Int8Group, index: int) -> None:
        super().__init__(original)
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.index)


def apply(model: nn.Module, keep: bool = False) -> None:
    """Swap every linear layer of ``model`` (the LM head too) for int8: sibling groups for
    ``q/k/v_proj`` and ``gate/up_proj``, :class:`Int8Linear` for the rest."""
    p = next(model.parameters())
    reason = available(p.device, p.dtype)
    if reason:
        raise SelfspecError(reason)
    grouped = set()
    for parent in model.modules():
        for names in SIBLINGS:
            layers = [getattr(parent, n, None) for n in names]
            if not all(isinstance(x, (nn.Linear, SwappedLinear)) for x in layers):
                continue
            originals = [original_of(x) for x in layers]
            if len({o.in_features for o in originals}) != 1:
                continue
            kept = originals[0].__dict__.get("_selfspec_kept", {})
            members = kept.get(Int8GroupMember)
            if members is None:
                group = Int8Group(originals)
                members = [Int8GroupMember(o, group, i) for i, o in enumerate(originals)]
                if keep:
                    originals[0].__dict__.setdefault("_selfspec_kept", {})[Int8GroupMember] = members
            for n, m in zip(names, members):
                setattr(parent, n, m)
                grouped.add(id(m))
    rest = [child for _, _, child in linear_layers(model) if id(child) not in grouped]
    if rest:
        swap_linears(model, Int8Linear, keep, only={id(c) for c in rest})
    use_attention(model, rowwise_attention.NAME)
