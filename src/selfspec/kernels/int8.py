"""``int8`` backend: int8 weights (one scale per output channel) times int8 activations (one
scale per row, i.e. per token), accumulated exactly in integers. Activations are 8 bits wide,
or 7 bits on x86 CPUs without VNNI, where that keeps oneDNN's fast product exact
(:func:`cpu_int8_path`).

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
import logging
import threading
import time
import warnings
from typing import Any, cast

import torch
from torch import nn

from ..errors import SelfspecError
from .gemv import LAYOUT as layout_version
from .gemv import blocked as blocked_layout
from .gemv import gemv as few_row_product
from .gemv import takes as layout_takes
from .rowwise_attention import NAME as ROWWISE_ATTENTION
from .swap import SwappedLinear, flatten, linear_layers, original_of, swap_linears, use_attention

log = logging.getLogger("selfspec.kernels")

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


ZERO_POINT = {8: 128, 7: 64}  # activations stored as uint8: value + zero point


def _prepack_fbgemm(q: torch.Tensor) -> object:
    """An ``[N, K]`` int8 matrix packed for fbgemm with unit scales (so the kernel returns the
    raw integer sums as fp32; our own scales are applied afterwards, as on every other path)."""
    n = q.shape[0]
    engine = torch.backends.quantized.engine
    with warnings.catch_warnings():  # quantized-tensor creation is deprecated in torch; the kernel is not
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q, torch.ones(n, dtype=torch.double),
                                                      torch.zeros(n, dtype=torch.long), 0)
        try:
            if "fbgemm" in torch.backends.quantized.supported_engines:
                torch.backends.quantized.engine = "fbgemm"
            return torch.ops.quantized.linear_prepack(qw, None)
        finally:
            torch.backends.quantized.engine = engine


def _fbgemm_sums(xi: torch.Tensor, packed: object, zero_point: int) -> torch.Tensor:
    """``xi[M, K]`` (integer-valued fp32) times the packed int8 matrix: ``[M, N]`` fp32 sums."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(xi, 1.0, zero_point, packed)


def _onednn_sums(xi: torch.Tensor, packed: object, zero_point: int, ones: torch.Tensor,
                 zeros: torch.Tensor) -> torch.Tensor:
    """Same as :func:`_fbgemm_sums` on oneDNN's u8 x s8 product (zero point compensated by oneDNN)."""
    xu = xi.add(zero_point).to(torch.uint8)
    return torch.ops.onednn.qlinear_pointwise(xu, 1.0, zero_point, packed, ones, zeros, None, 1.0, 0,
                                              torch.float32, "none", [], "")


def _kernel_available(kernel: str) -> bool:
    if kernel == "fbgemm":
        return (hasattr(torch.ops.quantized, "linear_with_input_q_dq_qweight_dq_output_fp32")
                and "fbgemm" in torch.backends.quantized.supported_engines)
    if kernel == "onednn":
        return (hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")
                and torch.backends.mkldnn.is_available())
    return False


class _CpuKernel:
    """One CPU int8 kernel on one packed matrix: ``sums(xi[M, K]) -> [M, N]`` fp32 integer sums."""

    def __init__(self, kernel: str, q: torch.Tensor, bits: int) -> None:
        self.kernel, self.zero_point = kernel, ZERO_POINT[bits]
        n = q.shape[0]
        if kernel == "fbgemm":
            self.packed = _prepack_fbgemm(q)
        else:
            self.packed = torch.ops.onednn.qlinear_prepack(q, None)
            self.ones, self.zeros = torch.ones(n), torch.zeros(n, dtype=torch.int64)

    def sums(self, xi: torch.Tensor) -> torch.Tensor:
        if self.kernel == "fbgemm":
            return _fbgemm_sums(xi, self.packed, self.zero_point)
        return _onednn_sums(xi, self.packed, self.zero_point, self.ones, self.zeros)


def _exact(kernel: str, bits: int) -> bool:
    """Whether ``kernel`` gives exact integer sums for ``bits``-wide activations on this CPU.

    The probe is the worst case for saturation: activations at their largest magnitudes times
    weights of +-127, so any pair of products summed in int16 (x86 CPUs without VNNI) overflows
    if it can. Rows: all +qmax, all -qmax-1 (8 bits) or -qmax, and alternating signs.
    """
    if not _kernel_available(kernel):
        return False
    qmax = (1 << (bits - 1)) - 1
    lo = -qmax - 1 if bits == 8 else -qmax
    k, n = 64, 8
    w = torch.full((n, k), 127, dtype=torch.int8)
    w[1::2] = -127
    x = torch.full((3, k), float(qmax))
    x[1] = lo
    x[2, ::2] = lo
    try:
        y = _CpuKernel(kernel, w, bits).sums(x)
    except RuntimeError:
        return False
    return torch.equal(y, (x.to(torch.int64) @ w.to(torch.int64).t()).float())


def _fastest(kernels: list[str], bits: int) -> str:
    """The fastest of ``kernels`` on a 1024 x 4096 matrix at M = 1 and M = 8 (the two regimes),
    timed interleaved over a few rounds (best round of each), so machine load hits all alike."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (4096, 1024), dtype=torch.int8, generator=g)
    qmax = (1 << (bits - 1)) - 1
    xs = [torch.randint(-qmax, qmax + 1, (m, 1024), generator=g).float() for m in (1, 8)]
    kerns = {k: _CpuKernel(k, q, bits) for k in kernels}
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(6):
        for k, kern in kerns.items():
            t0 = time.perf_counter()
            for x in xs:
                kern.sums(x)
            best[k] = min(best[k], time.perf_counter() - t0)
    return min(kernels, key=best.__getitem__)


@functools.lru_cache(maxsize=1)
def cpu_int8_path() -> tuple[str, int]:
    """``(kernel, activation bits)`` of the CPU int8 backend on this machine.

    The widest activation width with an exact fast kernel wins (8 bits with VNNI); among exact
    kernels of that width, the faster by a quick timing. Without VNNI (AVX2 only) both fbgemm
    and oneDNN add *pairs* of u8 x s8 products in saturating int16; with 7-bit activations
    (|x| <= 63, stored as 1..127 with zero point 64) a pair is at most 2 * 127 * 127 = 32258 <
    2^15, so nothing saturates and the sums are exact again. ``("int_mm", 8)``: no exact fast
    kernel (``torch._int_mm``, exact but slow on CPU).
    """
    for bits in (8, 7):
        exact = [k for k in ("fbgemm", "onednn") if _exact(k, bits)]
        if exact:
            return (_fastest(exact, bits) if len(exact) > 1 else exact[0]), bits
    log.warning("no exact fast int8 product on this CPU; the int8 backend falls back to torch._int_mm "
          "(exact, slow on CPU). Use --kernels onednn here.")
    return "int_mm", 8


def fast_cpu_int8() -> bool:
    """True when the int8 backend runs on an exact fast kernel (fbgemm or oneDNN) on this CPU."""
    return cpu_int8_path()[0] != "int_mm"


def activation_bits(device: torch.device | str = "cpu") -> int:
    """Activation width of the int8 model on ``device``: 8, or 7 on x86 CPUs without VNNI.

    The width is part of the quantised model's definition (what it computes), so reports name it.
    """
    return cpu_int8_path()[1] if torch.device(device).type == "cpu" else 8


class Int8Matmul:
    """``x[M, K] -> (q(x) @ Wq.T) * s_w * s_x + b`` ``[M, N]`` for one int8 weight matrix.

    Kernels: on CPU, the exact fast kernel :func:`cpu_int8_path` picks (fbgemm or oneDNN, the
    weight prepacked once, activations shifted to uint8 by a zero point that the kernel
    compensates exactly; nearly flat cost in M); elsewhere ``torch._int_mm``. Every kernel
    returns the exact integer sums, so for one activation width the results are the same bits.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str | None = None) -> None:
        q, scale = quantize_rows(weight.detach().float())
        self.out_features = weight.shape[0]
        self.weight_scale = scale.reshape(-1)  # [N] fp32
        self.bias = None if bias is None else bias.detach().float()
        bits = activation_bits(weight.device)
        self.act_qmax = float((1 << (bits - 1)) - 1)  # 127 or 63
        if kernel is None:
            kernel = cpu_int8_path()[0] if weight.device.type == "cpu" else "int_mm"
        self.kernel = kernel
        self.nbytes = q.numel() * q.element_size() + 4 * self.out_features  # held (kernels.swap.layer_bytes)
        if kernel == "int_mm":
            self.weight_t = q.t()  # [K, N] view of a row-major [N, K] int8 matrix (torch._int_mm)
        else:
            self.cpu = _CpuKernel(kernel, q, bits)

    def __call__(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2[M, K]`` float -> ``[M, N]`` fp32."""
        xs = row_scales(x2, self.act_qmax)
        xi = torch.round(x2 / xs)  # integers in [-qmax, qmax], as fp32
        if self.kernel == "int_mm":
            xq = xi.to(torch.int8)
            if xq.is_cuda and xq.shape[0] <= 16:  # the CUDA kernel wants more than 16 rows
                pad = torch.zeros(17 - xq.shape[0], xq.shape[1], dtype=torch.int8, device=xq.device)
                acc = torch._int_mm(torch.cat([xq, pad]), self.weight_t)[: xq.shape[0]]
            else:
                acc = torch._int_mm(xq, self.weight_t)
            y = acc.float()
        else:
            y = self.cpu.sums(xi.float())
        y = y.mul_(self.weight_scale).mul_(xs.float())
        return y if self.bias is None else y.add_(self.bias)


DRAFT_LAYOUT = "int8-weight-only-" + layout_version
"""The version of the compiled int8 draft's product (:class:`CompiledInt8Path`), part of the compiled
step's code version (``aot_step.code_version``): ``auto``'s cached choice is measured again when it
changes, since self-spec on ``compiled`` drafts through it."""


class CompiledInt8Path:
    """What an int8 layer runs inside a compiled graph (the ``compiled`` backend's int8 draft step,
    :meth:`~selfspec.kernels.switch.DraftLayers.add_layout`): its weights, quantised as
    :class:`Int8Matmul` quantises them, in the few-row layout (``blocked``, int8 ``[N / B, K, B]``,
    and ``row_scale[N]``), multiplied by the fp32 activations (weight-only: the eager layer also
    rounds activations to 8 bits). Drafts need not be exact: verification never runs these."""

    blocked: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    original: nn.Linear  # as in SwappedLinear, which every class of this mixin also is
    out_features: int

    def add_layout(self) -> bool:
        """Build the layout from the fp32 original; False where its rows do not fill blocks."""
        w = self.original.weight.detach().float()
        q, scale = quantize_rows(w)
        self.blocked = blocked_layout(q)
        self.row_scale = scale.reshape(-1)
        return self.blocked is not None

    def compiled_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """``x[..., in] -> [..., out]`` on the layout when traced by ``torch.compile`` for a block the
        layout takes, else None (the caller runs its eager kernel)."""
        x2, lead = flatten(x)
        if self.blocked is None or not torch.compiler.is_compiling() or not layout_takes(x2.shape[0]):
            return None
        bias = self.original.bias
        y = few_row_product(x2.float(), self.blocked, None if bias is None else bias.float(), self.row_scale)
        return y.to(x.dtype).reshape(*lead, self.out_features)


class Int8Linear(SwappedLinear, CompiledInt8Path):
    """One linear layer on :class:`Int8Matmul`. Shapes: ``x[..., in] -> [..., out]`` in ``x``'s dtype."""

    backend = "int8"

    def __init__(self, original: nn.Linear) -> None:
        super().__init__(original)
        self.matmul = Int8Matmul(original.weight, original.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.compiled_product(x)
        if y is not None:
            return y
        x2, lead = flatten(x)
        return self.matmul(x2).to(x.dtype).reshape(*lead, self.out_features)


class Int8Group:
    """Sibling layers reading the same input, as one product over their concatenated weights.

    The first sibling called computes all outputs; each other sibling takes its slice once.
    The cache is keyed by the input tensor object (and its version counter outside inference
    mode), so a different input, or a sibling asking twice, is always recomputed. It is held per
    thread: runners over one model may run in several threads at once.
    """

    def __init__(self, layers: list[nn.Linear]) -> None:
        weight = torch.cat([layer.weight.detach() for layer in layers])
        biases = [layer.bias.detach() if layer.bias is not None
                  else torch.zeros(layer.out_features, dtype=layer.weight.dtype, device=layer.weight.device)
                  for layer in layers]
        has_bias = any(layer.bias is not None for layer in layers)
        self.matmul = Int8Matmul(weight, torch.cat(biases) if has_bias else None)
        self.sizes = [layer.out_features for layer in layers]
        self._seen = threading.local()  # per thread: .input, .version, .outputs

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Output of sibling ``index`` for ``x[..., K]``: ``[..., sizes[index]]``."""
        seen = self._seen
        version = -1 if x.is_inference() else x._version
        outputs: list[torch.Tensor | None] | None = getattr(seen, "outputs", None)
        if (x is not getattr(seen, "input", None) or version != seen.version or outputs is None
                or outputs[index] is None):
            x2, lead = flatten(x)
            y = self.matmul(x2).to(x.dtype)
            outputs = [part.reshape(*lead, n) for part, n in zip(y.split(self.sizes, dim=1), self.sizes)]
            seen.outputs, seen.input, seen.version = outputs, x, version
        out, outputs[index] = outputs[index], None
        if all(o is None for o in outputs):
            seen.input = None  # all taken: hold no reference to the input
        return cast(torch.Tensor, out)  # not None: just computed, or checked above


class Int8GroupMember(SwappedLinear, CompiledInt8Path):
    """One sibling of an :class:`Int8Group`. Shapes: ``x[..., in] -> [..., out]``. In a compiled
    graph each member runs its own product (the group's shared output is Python state)."""

    backend = "int8"

    def __init__(self, original: nn.Linear, group: Int8Group, index: int) -> None:
        super().__init__(original)
        self.group, self.index = group, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.compiled_product(x)
        return y if y is not None else self.group.output(x, self.index)


def sibling_groups(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...], list[nn.Linear]]]:
    """The sibling layers :func:`apply` fuses into one product each: ``(parent, attribute names,
    their fp32 originals)`` for every set of :data:`SIBLINGS` that reads one input."""
    groups: list[tuple[nn.Module, tuple[str, ...], list[nn.Linear]]] = []
    for parent in model.modules():
        for names in SIBLINGS:
            layers = [x for x in (getattr(parent, n, None) for n in names) if isinstance(x, (nn.Linear, SwappedLinear))]
            if len(layers) != len(names):
                continue
            originals = [original_of(x) for x in layers]
            if len({o.in_features for o in originals}) == 1:
                groups.append((parent, names, originals))
    return groups


def layer_classes(model: nn.Module) -> set[type]:
    """The classes :func:`apply` puts in ``model``'s linear slots, found without quantising (seconds)."""
    groups = sibling_groups(model)
    grouped = {id(o) for _, _, originals in groups for o in originals}
    rest = [child for _, _, child in linear_layers(model) if id(original_of(child)) not in grouped]
    return ({Int8GroupMember} if groups else set()) | ({Int8Linear} if rest else set())


def apply(model: nn.Module) -> None:
    """Swap every linear layer of ``model`` (a runner's own module tree; the LM head too) for
    int8: sibling groups for ``q/k/v_proj`` and ``gate/up_proj``, :class:`Int8Linear` for the rest."""
    p = next(model.parameters())
    reason = available(p.device, p.dtype)
    if reason:
        raise SelfspecError(reason)
    grouped = set()
    for parent, names, originals in sibling_groups(model):
        group = Int8Group(originals)
        for i, (n, o) in enumerate(zip(names, originals)):
            m = Int8GroupMember(o, group, i)
            setattr(parent, n, m)
            grouped.add(id(m))
    rest = [child for _, _, child in linear_layers(model) if id(child) not in grouped]
    if rest:
        swap_linears(model, Int8Linear, only={id(c) for c in rest})
    # an eager-only model (Gemma 2's softcap) keeps its own
    if cast(Any, model).config._attn_implementation == "sdpa":
        use_attention(model, ROWWISE_ATTENTION)
