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
from .compact import isa as compact_isa
from .compact import reads_blocks_here
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
    if reads_blocks_here(model):
        # weights that are GGUF blocks: compact reads them in a seventh of oneDNN's bytes (its layers
        # where they are not blocks), and its products beat oneDNN's up to about 32 rows here (0.85x
        # at 64, a prompt's chunk; docs/performance.md); timing both would double the calibration
        out.append("compact")
    elif onednn_available(p.device, p.dtype) is None:
        out.append("onednn")
    return out


def batch_candidates(model: nn.Module) -> list[str]:
    """The fp32 backends a server times (on batches: ``autoselect.batches``): row-invariant ones, so
    every request is its solo run. ``compact`` and ``onednn`` both where compact's AVX-512 build reads
    the model's blocks, else ``onednn`` where it runs, else ``compact``, else ``stock``.

    On AVX2 ``compact`` won one stream and a batch's short calibration, and lost the wide batches:
    on 2026-12-07 (2-core EPYC, SmolLM2) ``generate_batch`` of 8 requests ran ``ar`` at 43.6 tok/s on
    compact against 67.0 on oneDNN, minutes apart (its many-row products: a prompt's chunks, wide
    steps), while timing both in batches of 4 chose compact; so AVX2 servers time oneDNN alone.
    Compact's AVX-512 build (sixteen-lane sums of up to twelve rows) won every width measured: on a
    2-core AMD EPYC (AVX-512 VNNI, 2026-12-08) ``selfspec serve --method ar`` gave 52.0 / 127.7 / 151.3
    tok/s at 1 / 4 / 8 clients on compact against 22.3 / 74.5 / 117.1 on oneDNN, one after the other;
    in process (``generate_batch``, two interleaved passes) 102.7 and 124.3 against 73.3 and 72.7 at 4
    requests, 119.6 and 125.6 against 115.0 and 111.7 at 8. There both are timed, and the faster wins."""
    p = next(model.parameters())
    wide = reads_blocks_here(model) and compact_isa() == "avx512"
    if onednn_available(p.device, p.dtype) is None:
        return ["compact", "onednn"] if wide else ["onednn"]
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
