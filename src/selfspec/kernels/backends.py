"""Putting a model on one concrete backend (``stock``, ``onednn``, ``int8``, ``compact``, ``compiled``).

Below both :mod:`selfspec.kernels` (which adds ``auto`` and the checks of a name) and
:mod:`selfspec.kernels.auto` (which times the concrete fp32 backends), so neither imports the other.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, cast

import psutil
import torch
from torch import nn

from .bf16 import Bf16Linear
from .compact import CompactLinear, compact_linear, load_ops, reads_blocks_here
from .compact import apply as apply_compact
from .gqa_attention import STATIC_NAME
from .int8 import Int8Linear
from .int8 import apply as apply_int8
from .onednn import OneDNNLinear, SharedProductLinear, add_blocked, share_products
from .onednn import apply as apply_onednn
from .onednn import available as onednn_available
from .swap import SwappedLinear, linear_layers, original_of, swap_linears, use_attention

if TYPE_CHECKING:
    from transformers.modeling_utils import PreTrainedModel

log = logging.getLogger("selfspec.kernels")


def install_backend(model: nn.Module, kernels: str) -> None:
    """Install concrete backend ``kernels``' linear layers (and attention function) on ``model``:
    a runner's own module tree, with stock layers, while the runner is built
    (:meth:`~selfspec.models.runner.LoadedModel.runner`). ``compiled`` installs oneDNN's prepacked
    layers where the ``onednn`` backend can run (fp32 on the CPU), else keeps the stock ones: what
    it changes is the step that runs them; where the weights are GGUF blocks that the ``compact``
    kernel reads, its layers are compact's, and the step calls that kernel."""
    if kernels == "onednn":
        apply_onednn(model)
    elif kernels == "int8":
        apply_int8(model)
    elif kernels == "compact":
        apply_compact(model)
    elif kernels == "compiled":
        sdpa = cast("PreTrainedModel", model).config._attn_implementation == "sdpa"
        onednn = compiled_layers(next(model.parameters())) == "onednn"
        if onednn and reads_blocks_here(model):
            # GGUF blocks: the step calls compact's kernel as an extern op (a fake kernel gives Inductor
            # its shapes): SmolLM2, 2-core AMD EPYC AVX-512, ar 69-86 tok/s against 44-61 with the fp32
            # products in the same graph, and 59 for eager compact
            apply_compact(model)
        elif onednn:
            share_products(model)  # q/k/v and gate/up: one product each in the step
            rest = {id(m) for _, _, m in linear_layers(model) if not isinstance(m, SharedProductLinear)}
            swap_linears(model, OneDNNLinear, only=rest)  # each weight packed once
            # blocks of up to 8 tokens: Inductor's own reductions over a copy of the weights, 1.5x
            # faster on AVX2 (kernels/gemv.py), where a third of the free memory holds the copy
            if add_blocked(model, psutil.virtual_memory().available // 3) is None:
                log.info("few-token steps of the compiled backend use oneDNN's kernel (too little "
                         "free memory for a second copy of the weights)")
        if sdpa:
            use_attention(model, STATIC_NAME)  # attends over the static cache without copying KV heads
    elif kernels != "stock":
        raise ValueError(f"not a concrete backend: {kernels!r}")


def compiled_layers(weight: torch.Tensor) -> str:
    """The eager linear layers of the ``compiled`` backend for a weight like ``weight``: oneDNN's
    prepacked ones where oneDNN runs (fp32 on the CPU; 1.1x faster at q = 1, 1.7x at q = 8 inside
    the step, docs/performance.md), else the stock ones. The step's layers and those that run
    beside it (:func:`convert_linear`) are chosen here alike."""
    return "onednn" if onednn_available(weight.device, weight.dtype) is None else "stock"


def convert_linear(layer: nn.Linear | SwappedLinear, kernels: str) -> nn.Module:
    """One stand-alone ``nn.Linear`` on concrete backend ``kernels`` (e.g. a draft LM head over a
    reduced vocabulary, which lives outside the model). Same call signature as ``layer``; a layer
    already on ``kernels`` is returned as it is, one on another backend is converted from its
    original. Such layers run eagerly beside the ``compiled`` backend's step, on that backend's
    own layers: oneDNN's prepacked ones where they run (the stock matrix-vector product uses one of
    two threads: a HASS head drafting on every step took 9.1 ms a step on stock layers and 4.6 ms
    on these, SmolLM2, AVX-512, ``docs/results/heads-policy-compiled*-avx512``)."""
    if kernels == "compiled":
        kernels = compiled_layers(original_of(layer).weight)
    if isinstance(layer, SwappedLinear) and layer.backend == kernels:
        return layer
    layer = original_of(layer)
    if kernels == "onednn":
        return OneDNNLinear(layer)
    if kernels == "int8":
        return Int8Linear(layer)
    if kernels == "compact":
        compact = compact_linear(layer)
        if isinstance(compact, CompactLinear):
            load_ops()
        return compact
    if kernels == "bf16":  # draft-only kernels (a reduced-vocabulary draft LM head)
        return Bf16Linear(layer)
    return layer


def convert_linears(module: nn.Module, kernels: str) -> None:
    """Every linear layer of a stand-alone module (e.g. an EAGLE draft head, which lives outside
    the model) on concrete backend ``kernels``, in place; its attention is left as it is. On CPU
    the head's one layer costs 2.8 ms per token on stock kernels against 1.3 ms prepacked
    (SmolLM2 head, 2 threads): drafts follow the target's backend, as its LM head does."""
    swap_linears(module, lambda layer: convert_linear(layer, kernels))
