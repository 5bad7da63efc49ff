"""One-token products of the ``compiled`` backend's step, as reductions Inductor writes itself.

At batch 1 every linear layer is a matrix-vector product, and a decode step's cost is the time to
read the weights once. The library kernels read them well below the memory's speed on some CPUs:
on a 2-core AMD EPYC (AVX2) MKL's and oneDNN's fp32 matrix-vector products reached 11-18 GB/s in
one decode step's worth of SmolLM2 layers, against 27-33 GB/s for a plain sum over memory (MKL's
did not use the second thread at all). Written as ``(W_blocked * x).sum(K)`` over weights
laid out as ``[N / 8, K, 8]`` (8 output rows interleaved, so that each block of 8 outputs reads
one contiguous stretch of memory), the same product is a reduction that Inductor generates as a
vectorised loop split over the threads, fused with the step's other loops: 1.5x faster per
decode step there (docs/performance.md, "one-token products").

Only one-token blocks use it: for blocks of more rows the same reduction reads the weights once
per row (8-token blocks 4x slower than oneDNN's), so they keep oneDNN's blocked kernel. The
layout is a copy of the weights, made once when a model is put on the ``compiled`` backend.
"""

from __future__ import annotations

import torch

BLOCK = 8
"""Output rows interleaved per block of the layout (one AVX2 register of fp32)."""
LAYOUT = "gemv-blocked8-1"
"""The version of the one-token product (saved compiled steps' names include it)."""


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


def gemv(x: torch.Tensor, wb: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x[1, K] @ W.T + b -> [1, N]`` with ``wb`` = :func:`blocked` ``(W)``: a sum over ``K`` in
    fp32 for each output, the same order whatever the model around it."""
    nb, k, b = wb.shape
    y = (wb * x.reshape(1, k, 1)).sum(1).reshape(1, nb * b)
    return y if bias is None else y + bias
