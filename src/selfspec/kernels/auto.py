"""What ``--kernels auto`` chooses from where no decoding method is at hand, and the proxy it is
timed by (the choice itself: :mod:`selfspec.autoselect.kernels`).

``selfspec.load`` does not use this: it chooses kernels together with the method by decode
tokens/s (:mod:`selfspec.autoselect`), because the proxy below was wrong on an Intel AMX Xeon
(oneDNN won T(1) + T(4) while stock kernels decoded faster). What remains here serves the commands
that load a model without a method (``selfspec tune``, ``profile``):

Quick measurement: T(1) + T(4) after a 128-token prefix, each candidate's forwards interleaved over
:data:`ROUNDS` rounds after a warm-up (:func:`~selfspec.core.timing.interleaved`), stored next to
the cost profiles so it happens once per model, dtype, device and machine. Score = the median of
T(1) + T(4): one decoding step plus one typical verify step. A corrupt or unreadable record is
measured again, never trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from ..core import kv_cache
from ..core.attention import decode_attention
from .compact import available as compact_available
from .compact import reads_blocks
from .onednn import available as onednn_available

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel

log = logging.getLogger("selfspec.kernels")

ROUNDS = 5
QUICK_CONTEXT = 128


def candidates(model: nn.Module) -> list[str]:
    """The fp32 (lossless) backends that can run this model here."""
    p = next(model.parameters())
    out = ["stock"]
    if compact_available(p.device, p.dtype) is None and reads_blocks(model):
        # weights that are GGUF blocks: compact reads them in a seventh of oneDNN's bytes (its layers
        # where they are not blocks), and its products beat oneDNN's up to about 32 rows here (0.85x
        # at 64, a prompt's chunk; docs/performance.md); timing both would double the calibration
        out.append("compact")
    elif onednn_available(p.device, p.dtype) is None:
        out.append("onednn")
    return out


def batch_candidates(model: nn.Module) -> list[str]:
    """The fp32 backend a server times (on batches: ``autoselect.batches``): a row-invariant one, so
    every request is its solo run. ``onednn`` where it runs, else ``compact``, else ``stock``.

    ``compact`` wins one stream and a batch's short calibration, and lost the server's wide batches:
    on 2026-12-07 (2-core EPYC, AVX2, SmolLM2; ``docs/results/serving-batching-avx2-1207``)
    ``ar@compact`` served 1, 4 and 8 clients at 22.0, 44.6 and 47.0 tok/s against vLLM's 16.6, 49.3
    and 74.3 in the same run, and ``generate_batch`` of 8 requests ran ``ar`` at 43.6 tok/s on
    compact against 67.0 on oneDNN, minutes apart (its many-row products: a prompt's chunks, wide
    steps). Timing both in batches of 4 chose compact."""
    p = next(model.parameters())
    if onednn_available(p.device, p.dtype) is None:
        return ["onednn"]
    return [k for k in candidates(model) if k != "stock"] or ["stock"]


def quick_case(model: nn.Module, context: int = QUICK_CONTEXT) -> tuple[Callable[[], object], Callable[[], object]]:
    """What one round of the quick proxy runs on ``model`` (a runner's module tree): a one-token and
    a four-token forward after a ``context``-token prefix on a cache of its own, and what undoes
    them (the cache truncated back to the prefix). Returns ``(case, reset)``."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    vocab = cast("PreTrainedModel", model).config.vocab_size
    cache = kv_cache.new_cache(model.config)
    with torch.inference_mode():
        model(input_ids=torch.randint(0, vocab, (1, context), generator=g).to(device),
              **kv_cache.cache_arg(model, cache), use_cache=True, logits_to_keep=1)
    blocks = [torch.randint(0, vocab, (1, q), generator=g).to(device) for q in (1, 4)]

    @torch.inference_mode()
    def case() -> None:
        with decode_attention(device):
            for ids in blocks:
                q = ids.shape[1]
                model(input_ids=ids, position_ids=torch.arange(context, context + q, device=device)[None],
                      **kv_cache.cache_arg(model, cache), use_cache=True)
                kv_cache.truncate(cache, context)

    return case, lambda: kv_cache.truncate(cache, context)
