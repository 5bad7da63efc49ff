"""Few-row products of the ``compiled`` backend's step, as reductions Inductor writes itself.

At batch 1 every linear layer of a decode step (or of a short verify block) reads the whole
weight matrix for a handful of rows, and the step's cost is the time to read the weights once.
The library kernels read them well below the memory's speed on some CPUs: on a 2-core AMD EPYC
(AVX2) MKL's and oneDNN's fp32 matrix-vector products reached 11-18 GB/s in one decode step's
worth of SmolLM2 layers, against 27-33 GB/s for a plain sum over memory (MKL's did not use the
second thread at all). Written as ``(W_blocked * x).sum(K)`` over weights laid out as
``[N / B, K, B]`` (B output rows interleaved, so that each block of B outputs reads one
contiguous stretch of memory; B is one vector register of fp32, :data:`BLOCK`), the same
product is a reduction that Inductor generates as a vectorised loop split over the threads,
fused with the step's other loops: 1.5x faster per decode step there (docs/performance.md,
"one-token products"). A block of up to :data:`ROWS` rows is one such reduction per row over
the same weights, which Inductor fuses into one loop that reads each weight block once for all
rows (docs/lab-notes/compiled-step.md, "few-row products": SmolLM2's compiled 2-, 4- and 8-token steps
1.6x, 1.7x and 1.5x faster than with oneDNN's kernel there).

The block must be the width of the vectors Inductor writes: with 8 lanes on an AVX-512 CPU (16-lane
vectors), Inductor vectorised the lanes with masked half-width loads and split each block's sum over
``K`` across the threads instead, one parallel region per block of 8 outputs, and SmolLM2's compiled
one-token step took 59 ms against 15 ms with 16 lanes (docs/lab-notes/compiled-step.md, "The compiled step on
AVX-512").

Larger blocks keep oneDNN's blocked kernel (the fused loop's accumulators run out of registers
and its compile time grows with the rows). The layout is a copy of the weights, made once when
a model is put on the ``compiled`` backend.
"""

from __future__ import annotations

import torch


def vector_lanes(capability: str | None = None) -> int:
    """fp32 lanes of one vector register of the widest instruction set PyTorch dispatches to on
    this CPU (``capability``: ``torch.backends.cpu.get_cpu_capability()``, e.g. ``AVX2``,
    ``AVX512``): 16 with AVX-512, else 8 (AVX2, and the layout's width elsewhere)."""
    if capability is None:
        capability = torch.backends.cpu.get_cpu_capability()
    return 16 if capability.upper().startswith("AVX512") else 8


BLOCK = vector_lanes()
"""Output rows interleaved per block of the layout: one vector register of fp32 on this CPU (8
with AVX2, 16 with AVX-512), the width of the vectors Inductor writes for the product's loop."""
ROWS = 8
"""The largest block the layout's product computes (:func:`takes`); larger blocks keep oneDNN."""


def layout(rows: int) -> str:
    """The version of the few-row product for blocks of up to ``rows`` (saved steps' names)."""
    return f"gemv-blocked{BLOCK}-rows{rows}"


LAYOUT = layout(ROWS)
"""The version of the few-row product (saved compiled steps' names include it)."""


def takes(rows: int) -> bool:
    """Whether a block of ``rows`` tokens runs its products on the layout (:func:`gemv`)."""
    return rows <= ROWS


def blocked(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``W[N, K]`` laid out as ``[N / BLOCK, K, BLOCK]`` (block ``j``, column ``k``, lane ``i`` is
    ``W[j * BLOCK + i, k]``), written into ``out`` (``N * K`` contiguous elements) when given;
    None where ``N`` is not a multiple of :data:`BLOCK`."""
    n, k = w.shape
    if n % BLOCK:
        return None
    src = w.detach().reshape(n // BLOCK, BLOCK, k).transpose(1, 2)
    if out is None:
        return src.contiguous()
    return out.view(n // BLOCK, k, BLOCK).copy_(src)


def gemv(x: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None = None,
         scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x[M, K] @ W.T + b -> [M, N]`` with ``wb`` = :func:`blocked` ``(W)``: for each row a sum over
    ``K`` in fp32 for each output, the same order whatever the model around it. Each row is its
    own reduction over the same weights; Inductor fuses the M reductions into one loop that loads
    each block of weights once and multiplies it by every row (M accumulators), so a block of a
    few rows reads the weights once, as a single row does.

    ``wb`` may hold integers (int8 weights ``Q`` with ``W = Q * scale[:, None]``, ``scale[N]``): each
    weight is converted to ``x``'s dtype as it is read and each output multiplied by its row's
    scale after the sum (a quarter of fp32's bytes read: the compiled int8 draft step)."""
    nb, k, b = wb.shape
    w = wb if wb.dtype == x.dtype else wb.to(x.dtype)
    rows = [(w * x[m].reshape(1, k, 1)).sum(1).reshape(1, nb * b) for m in range(x.shape[0])]
    y = rows[0] if len(rows) == 1 else torch.cat(rows, 0)
    y = y if scale is None else y * scale
    return y if bias is None else y + bias
