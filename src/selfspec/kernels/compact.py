"""``compact`` backend: fp32 products that read each weight as the GGUF block it came from.

A decode step on a CPU is bound by reading the weights. The bundled models are dequantised from
GGUF blocks (SmolLM2-135M from Q4_1, its LM head Q8_0), so every fp32 weight is ``fl32(d * q + m)``
(Q4_1: a 4-bit code ``q`` and the two fp16 constants of its 32-weight block) or ``d * q`` (Q8_0).
This backend proves, layer by layer and bit for bit, that a weight matrix is such blocks
(:func:`q4_1_blocks`, :func:`q8_0_blocks`), keeps the codes (0.56 or 1.06 bytes a weight instead
of 4) and multiplies through a C++ kernel (``data/kernels/compact.cpp``, AVX2 + FMA, or AVX-512
where the CPU has it) that decompresses each block in registers to the very fp32 values of the fp32
copy and sums in fp32.

So the model is the same function up to the order of the sums, like ``onednn``: lossless with
respect to ``ar`` on the same backend, and each row's result does not depend on how many rows the
block has (the kernel runs every row's sum in one fixed order), as batching and tree verification
need. A layer that is not such blocks (most Hugging Face checkpoints, which are bf16) runs on
oneDNN's fp32 kernel, and the load log says how many did.

The kernel is built once per machine and torch (``g++ -O3 -mavx2 -mfma``, with ``-mavx512f`` where
the CPU has AVX-512: its sums of up to twelve rows then run in 16-lane registers, lane for lane the AVX2
build's operations, so the outputs are the same bit for bit; about half a minute) into the cache
(``$SELFSPEC_HOME/kernels``) and loaded with ``torch.ops.load_library``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..errors import SelfspecError
from ..paths import writable_cache_dir
from .swap import SwappedLinear, flatten, linear_layers, original_of, swap_linears, use_attention

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel

log = logging.getLogger("selfspec.kernels")

GROUP = 32
"""Weights per GGUF block (Q4_1 and Q8_0)."""
SOURCE = "compact.cpp"
_BUILD_LOCK = threading.Lock()


def _compiler() -> str | None:
    """The C++ compiler the kernel is built with: ``$CXX``, else ``g++`` or ``c++`` on the path."""
    env = os.environ.get("CXX")
    if env:
        return shutil.which(env)
    return shutil.which("g++") or shutil.which("c++")


def available(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the backend can run here, else the reason it cannot."""
    if device.type != "cpu":
        return f"the compact backend runs on CPU only (model is on {device}); use --kernels stock"
    if dtype != torch.float32:
        return f"the compact backend is fp32 only (model is {dtype}); use --dtype float32 or --kernels stock"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return (f"the compact backend needs an x86 CPU with AVX2 and FMA (this one: "
                f"{torch.backends.cpu.get_cpu_capability()}); use --kernels onednn")
    if _compiler() is None:
        return "the compact backend builds its kernel once with a C++ compiler: install g++ (or set CXX)"
    return None


def _source() -> str:
    return resources.files("selfspec").joinpath("data", "kernels", SOURCE).read_text()


ISA_FLAGS = {"avx2": ("-mavx2", "-mfma"), "avx512": ("-mavx2", "-mfma", "-mavx512f")}
"""The compiler's instruction-set flags per build (:func:`isa`)."""


def isa() -> str:
    """The build this CPU runs: ``avx512`` where torch finds AVX-512 (its sums of up to 12 rows in
    16-lane registers, the same results), else ``avx2``."""
    return "avx512" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "avx2"


def library_path(build: str | None = None) -> Path:
    """Where the built kernel lives: a file named by the hash of its source, its instruction set
    (``build``; None: :func:`isa`), the torch version and the Python ABI, under
    ``$SELFSPEC_HOME/kernels`` (else a temporary directory)."""
    build = isa() if build is None else build
    text = f"{_source()}|{build}|{torch.__version__}|{sys.implementation.cache_tag}"
    key = hashlib.sha256(text.encode()).hexdigest()[:16]
    d = writable_cache_dir("kernels")
    if d is None:
        d = Path(tempfile.gettempdir()) / f"selfspec-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}"
    return d / f"compact-{key}.so"


def _build(target: Path, build: str | None = None) -> None:
    """Compile the kernel for ``build`` (:data:`ISA_FLAGS`; None: :func:`isa`) into ``target``
    (written under a temporary name, then moved: processes that build at once each get a whole file)."""
    from torch.utils import cpp_extension

    cxx = _compiler()
    assert cxx is not None  # checked by available()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / SOURCE
        src.write_text(_source())
        out = Path(tmp) / target.name
        flags = ISA_FLAGS[isa() if build is None else build]
        cmd = [cxx, "-O3", *flags, "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-w",
               "-D_GLIBCXX_USE_CXX11_ABI=" + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)),
               *[f"-I{p}" for p in cpp_extension.include_paths()], str(src), "-o", str(out),
               *[f"-L{p}" for p in cpp_extension.library_paths()], "-lc10", "-ltorch_cpu", "-ltorch"]
        log.info("building the compact kernel once for this machine and torch (about half a minute)")
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise SelfspecError(f"building the compact kernel failed ({cxx}): {' | '.join(tail)}; use --kernels onednn")
        os.replace(out, target)


def load_ops() -> None:
    """Build (once per machine) and load the kernel's operators ``torch.ops.selfspec_compact``."""
    with _BUILD_LOCK:
        if hasattr(torch.ops, "selfspec_compact") and hasattr(torch.ops.selfspec_compact, "q4_1_linear"):
            return
        path = library_path()
        if not path.is_file():
            _build(path)
        torch.ops.load_library(str(path))
        # fake kernels: the output's shape, for the compiled backend's graphs (Inductor calls the
        # operators themselves as extern kernels)
        torch.library.register_fake("selfspec_compact::q4_1_linear")(_fake_q4_1)
        torch.library.register_fake("selfspec_compact::q8_0_linear")(_fake_q8_0)


def _fake_q4_1(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])


def _fake_q8_0(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], codes.shape[0])


def q4_1_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The Q4_1 blocks of ``w[N, K]`` (fp32) if every 32-weight block along ``K`` is
    ``fl32(d * q + m)`` for fp16 ``d``, ``m`` and codes ``q`` in 0..15, proven bit for bit; else None.

    Returns:
        ``codes[N, K / 2]`` uint8 (GGUF's order: per block, element ``i`` in the low nibble of byte
        ``i`` and element ``i + 16`` in the high one), ``d[N, K / 32]`` and ``m[N, K / 32]`` fp32.
    """
    n, k = w.shape
    if k % GROUP or w.dtype != torch.float32:
        return None
    g = w.reshape(n, k // GROUP, GROUP)
    m = g.amin(-1)  # code 0 is the block's smallest value
    if not torch.equal(m.half().float(), m):
        return None
    span = (g.amax(-1) - m) / 15

    def attempt(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidate ``d`` (the fp16 ``step`` places from span / 15), its codes, which blocks it proves."""
        d = span.half()
        toward = torch.full_like(d, float("inf") if step > 0 else float("-inf"))
        for _ in range(abs(step)):
            d = torch.nextafter(d, toward)
        d = d.float()
        q = torch.round((g - m[..., None]) / torch.where(d > 0, d, torch.ones_like(d))[..., None]).clamp(0, 15)
        return d, q, ((q * d[..., None] + m[..., None]) == g).all(-1)

    d, q, ok = attempt(0)
    for step in (-1, 1, -2, 2):  # blocks the nearest fp16 does not prove: its neighbours
        if bool(ok.all()):
            break
        d2, q2, ok2 = attempt(step)
        take = ~ok & ok2
        d, q, ok = torch.where(take, d2, d), torch.where(take[..., None], q2, q), ok | ok2
    if bool(ok.all()):
        c = q.to(torch.uint8)
        return (c[..., :16] | (c[..., 16:] << 4)).reshape(n, k // 2).contiguous(), d.contiguous(), m.contiguous()
    return None


def q8_0_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Q8_0 blocks of ``w[N, K]`` (fp32) if every 32-weight block is ``d * q`` for the fp16
    ``d = amax / 127`` and int8 codes ``q``, proven bit for bit; else None. Returns
    ``codes[N, K]`` int8 and ``d[N, K / 32]`` fp32."""
    n, k = w.shape
    if k % GROUP or w.dtype != torch.float32:
        return None
    g = w.reshape(n, k // GROUP, GROUP)
    d = (g.abs().amax(-1) / 127).half().float()
    q = torch.round(g / torch.where(d > 0, d, torch.ones_like(d))[..., None]).clamp(-127, 127)
    if not bool(((q * d[..., None]) == g).all()):
        return None
    return q.to(torch.int8).reshape(n, k).contiguous(), d.contiguous()


def reads_blocks(model: nn.Module) -> bool:
    """Whether the compact backend would read ``model``'s weights as blocks: its first linear
    layer's weight is proven Q4_1 or Q8_0 (fp32, on the CPU). ``auto`` times the backend only then:
    on other weights its layers are the ``onednn`` ones."""
    for _, _, layer in linear_layers(model):
        w = original_of(layer).weight.detach()
        if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
            return False
        w = w.contiguous()
        return q4_1_blocks(w) is not None or q8_0_blocks(w) is not None
    return False


def reads_blocks_here(model: nn.Module) -> bool:
    """Whether the compact backend runs on this machine (:func:`available`) and reads ``model``'s
    weights as blocks (:func:`reads_blocks`): where ``auto`` times it and the compiled step uses it."""
    p = next(model.parameters())
    return available(p.device, p.dtype) is None and reads_blocks(model)


class CompactLinear(SwappedLinear):
    """``y = x @ W.T + b`` with ``W`` read from its GGUF blocks (:func:`q4_1_blocks` or
    :func:`q8_0_blocks`), decompressed in registers to the fp32 weights bit for bit.

    Shapes: ``x[..., in_features] -> y[..., out_features]`` (fp32).

    Attributes:
        kind: ``"Q4_1"`` or ``"Q8_0"``.
        blocks: the codes and constants the kernel reads (see the two provers).
    """

    backend = "compact"

    def __init__(self, original: nn.Linear, kind: str, blocks: tuple[torch.Tensor, ...]) -> None:
        super().__init__(original)
        self.kind, self.blocks = kind, blocks
        self.bias = None if original.bias is None else original.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2, lead = flatten(x)
        x2 = x2.contiguous()
        ops = torch.ops.selfspec_compact
        y = ops.q4_1_linear(x2, *self.blocks) if self.kind == "Q4_1" else ops.q8_0_linear(x2, *self.blocks)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def weight_bytes(self) -> int:
        """Bytes the kernel reads for this layer's weights (codes and block constants)."""
        return sum(t.numel() * t.element_size() for t in self.blocks)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", blocks={self.kind}"


def compact_linear(original: nn.Linear) -> nn.Module:
    """``original`` as a :class:`CompactLinear` where its weight is proven to be Q4_1 or Q8_0
    blocks, else on oneDNN's fp32 kernel (the ``onednn`` backend's layer)."""
    w = original.weight.detach()
    if w.device.type == "cpu" and w.dtype == torch.float32:
        q4 = q4_1_blocks(w.contiguous())
        if q4 is not None:
            return CompactLinear(original, "Q4_1", q4)
        q8 = q8_0_blocks(w.contiguous())
        if q8 is not None:
            return CompactLinear(original, "Q8_0", q8)
    from .onednn import OneDNNLinear

    return OneDNNLinear(original)


def apply(model: nn.Module) -> None:
    """Swap every linear layer of ``model`` (a runner's own module tree) for :func:`compact_linear`'s,
    and log how many read their GGUF blocks."""
    p = next(model.parameters())
    reason = available(p.device, p.dtype)
    if reason:
        raise SelfspecError(reason)
    load_ops()
    layers: list[nn.Module] = []

    def make(original: nn.Linear) -> nn.Module:
        layers.append(compact_linear(original))
        return layers[-1]

    swap_linears(model, make)
    kinds = [layer.kind for layer in layers if isinstance(layer, CompactLinear)]
    kept = len(layers) - len(kinds)
    read = sum(layer.weight_bytes() for layer in layers if isinstance(layer, CompactLinear))
    log.info("compact kernels: %d of %d linear layers read their GGUF blocks (%d Q4_1, %d Q8_0; %.0f MiB), %d stay "
             "fp32 on oneDNN%s", len(kinds), len(layers), kinds.count("Q4_1"), kinds.count("Q8_0"), read / 2**20, kept,
             " (their weights are not GGUF blocks)" if kept else "")
    if cast("PreTrainedModel", model).config._attn_implementation == "sdpa":
        from .token_attention import NAME  # one-token rows through compact's attention kernel

        use_attention(model, NAME)
