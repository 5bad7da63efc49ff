"""One-token attention of the ``compact`` backend: one kernel call per layer for a whole batch.

A one-token step attends one query row to its request's cached keys. ``scaled_dot_product_attention``
costs some 30 us a call on a 2-core EPYC whatever the work, and a packed forward of several requests
(:mod:`selfspec.models.batch`) made one call per request per layer: 240 calls, about 7 ms, of an
8-request SmolLM2 step. Here one call of ``torch.ops.selfspec_compact.decode_attention`` (in
``data/kernels/compact.cpp``, built with the compact kernels) attends every request's row, each to
its own keys and values. It runs each (request, head) on one thread in one fixed order that depends
only on that request's own positions, so a request's output is the same bit for bit alone or in any
batch, on any number of threads: a solo step calls the same kernel with one row.

The kernel sums in its own order (and its own ``exp``, within 2 ulp), so it is not bit-identical
to SDPA, like the compact products are not to oneDNN's: lossless with respect to ``ar`` on the same
backend, and ids against ``transformers`` ``generate`` are measured.

:data:`NAME` (registered with ``transformers.AttentionInterface``) is the ``compact`` backend's
attention: the kernel for a one-token row that sees every cached position (no mask, no sliding
window, no soft cap, no sinks, fp32 on the CPU, head size a multiple of 8); :mod:`.gqa_attention`'s
shared-heads path otherwise (verify blocks, trees, prompts).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AttentionInterface

from .gqa_attention import gqa_attention_forward

NAME = "selfspec_compact_sdpa"

_CHANGES_ATTENTION = ("softcap", "sliding_window", "s_aux")
"""Keyword arguments of a model's attention call that the kernel does not implement."""


def kernel_runs(query: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict) -> bool:
    """Whether the kernel attends ``query [1, Hq, T, D]`` (rows of one-token steps): fp32 on the
    CPU, ``D % 8 == 0``, no mask and none of :data:`_CHANGES_ATTENTION` set (a model's soft cap,
    sliding window or attention sinks). The compact backend has loaded the kernel library."""
    return (attention_mask is None and query.device.type == "cpu" and query.dtype == torch.float32
            and query.shape[0] == 1 and query.shape[-1] % 8 == 0
            and all(kwargs.get(k) is None for k in _CHANGES_ATTENTION))


def rows_attention(query: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                   scaling: float | None) -> torch.Tensor:
    """Row ``r`` of ``query [1, Hq, R, D]`` against ``keys[r]`` and ``values[r]`` (``[1, Hkv, L_r, D]``,
    every position visible) in one kernel call. Returns ``[1, R, Hq, D]``."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    q = query[0].transpose(0, 1).contiguous()  # [R, Hq, D]
    return torch.ops.selfspec_compact.decode_attention(q, list(keys), list(values), float(scale))[None]


def compact_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function: ``query [1, Hq, 1, D]`` of a one-token step through the kernel
    (:func:`kernel_runs`), else :func:`~.gqa_attention.gqa_attention_forward`. Returns ``[1, T, Hq, D]``."""
    if query.shape[2] == 1 and kernel_runs(query, attention_mask, kwargs):
        return rows_attention(query, [key], [value], scaling), None
    return gqa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def packed_rows(inner: str, query: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                rows: Sequence[tuple[int, int]], masks: Sequence[torch.Tensor | None],
                kwargs: dict) -> torch.Tensor | None:
    """The attention of a packed forward (:mod:`selfspec.models.batch`) whose requests each bring
    one row ``rows[r]`` of ``query [1, Hq, R, D]`` with no mask, on attention function ``inner``
    :data:`NAME`: one kernel call, ``[1, R, Hq, D]``, bit for bit each request's own call. None
    where that does not hold (the packed forward then calls ``inner`` once per request)."""
    if (inner != NAME or any(r1 - r0 != 1 for r0, r1 in rows) or any(m is not None for m in masks)
            or not kernel_runs(query, None, kwargs)):
        return None
    return rows_attention(query, keys, values, kwargs.get("scaling"))


AttentionInterface.register(NAME, compact_attention_forward)
