"""A loaded model's weights and the runners over them.

:class:`LoadedModel` holds what was loaded: the stock HF model (its weights), the tokenizer and
where they came from. It is never switched: nothing installs other layers or another attention
function on its modules.

A :class:`Runner` is one configuration that runs those weights: a linear-layer backend
(``stock``, ``onednn``, ``int8``, ``compiled``; :mod:`selfspec.kernels`), its attention function,
and on ``compiled`` its static-shape step with the step's cache pool. Each runner has a module
tree of its own (:func:`share_copy`: new module objects over the same parameter and buffer
tensors), on which its backend's layers are installed once, when it is built. A runner is
built once per configuration and model (:meth:`LoadedModel.runner`) and never switched, so two
generators over one loaded model, in two threads, each run exactly what they were built with.
The extra copies a backend needs (oneDNN's packed weights, int8 weights, the few-row layout)
belong to the runner that made them; their size is logged.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from ..core import kv_cache
from ..core.attention import decode_attention
from ..core.cost import CostProfile, load_or_measure, profile_key, read_cached
from ..errors import SelfspecError
from ..kernels.swap import layer_bytes, share_copy, use_attention
from .adapter import BlockOutput, attention_masks, forward_block, has_windows
from .compiled_step import StaticStep

log = logging.getLogger("selfspec.models")


@dataclass
class LoadedModel:
    """A stock ``AutoModelForCausalLM`` in eval mode plus its tokenizer: the weights that every
    runner over it shares. Nothing switches it; :meth:`runner` gives the configurations that run it.

    Attributes:
        model: the HF model as loaded (``attn_implementation`` sdpa or eager, stock layers).
        tokenizer: its tokenizer.
        name: what the user asked for (shown in reports).
        path: the local directory the weights came from (None for a hub id).
        only: the one backend this model runs on, where its fp32 weights were released after
            that backend's runner was built (:func:`~selfspec.models.loading.load_model`); else None.
    """

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path | None
    only: str | None = None
    _runners: dict[str, Runner] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def base(self) -> LoadedModel:
        return self

    def runner(self, kernels: str) -> Runner:
        """The runner of this model on concrete backend ``kernels`` (``stock``, ``onednn``,
        ``int8``, ``compiled``, ``compact``): built on first use (the backend's layers installed on a module
        tree of its own), then the same object every time. Thread-safe."""
        from ..kernels import KERNELS

        if kernels not in KERNELS or kernels == "auto":
            raise SelfspecError(f"unknown kernels '{kernels}'; choose one of: {', '.join(KERNELS[1:])}")
        with self._lock:
            r = self._runners.get(kernels)
            if r is None:
                if self.only is not None and kernels != self.only:
                    raise SelfspecError(f"{self.name} was loaded for {self.only} kernels only (its fp32 weights were "
                                        "released); load it again to use other kernels")
                r = self._runners[kernels] = self._build(kernels)
            return r

    def _build(self, kernels: str) -> Runner:
        from ..kernels import install_backend

        if kernels == "stock":
            return Runner(self, self.model, "stock")
        if kernels == "compiled":
            from . import aot_step

            if aot_step.route(self.device) is None:
                from ..kernels.backends import compiled_layers

                instead = compiled_layers(next(self.model.parameters()))  # onednn where it runs, else stock
                log.warning(f"the compiled backend is not offered on torch {torch.__version__} (this selfspec knows "
                            f"{', '.join(aot_step.KNOWN_TORCH)}): {self.name} runs on the {instead} kernels instead")
                r = self._runners.get(instead)
                if r is None:  # kept under its own name too: asking for it later builds no second copy
                    r = self._runners[instead] = self._build(instead)
                return r
        model = share_copy(self.model)
        install_backend(model, kernels)
        return self._made(Runner(self, model, kernels), f"the {kernels} runner")

    def _made(self, runner: Runner, what: str) -> Runner:
        """``runner`` with the bytes of its own weight copies counted (:func:`layer_bytes`) and logged."""
        runner.extra_bytes = layer_bytes(runner.model, self.model)
        if runner.extra_bytes:
            log.info(f"{self.name}: {what} holds {runner.extra_bytes / 2**20:.0f} MiB of its own weight copies")
        return runner

    def draft_runner(self, verify: Runner, kernels: str, layout: bool = False) -> Runner:
        """The draft runner over ``verify``'s module tree (:class:`~selfspec.kernels.switch.DraftLayers`:
        its linear layers on ``kernels``, ``int8`` or ``bf16``; ``verify``'s attention), built once
        per (verify backend, kernels, layout) and shared by every drafter that asks (its weight copy
        is made once). With ``layout`` (int8 beside the ``compiled`` runner) its layers also get the
        few-row layout and the runner its own one-token :class:`StaticStep`, where the layout fits;
        else it has no step (``runner.step`` is None) and drafts run eagerly."""
        from ..kernels.switch import DraftLayers

        key = f"{verify.backend}>{kernels}{'+layout' if layout else ''}"
        with self._lock:
            r = self._runners.get(key)
            if r is None:
                layers = DraftLayers(verify.model, kernels)
                step = None
                if layout and layers.add_layout():
                    step = StaticStep(layers.model, compile=verify.step.compile if verify.step is not None else True)
                r = self._runners[key] = self._made(Runner(self, layers.model, kernels, _step=step),
                                                    f"the {kernels} draft beside the {verify.backend} runner")
            return r

    def built(self) -> list[str]:
        """The runners built (and held) now: backends, and draft runners as ``verify>kernels[+layout]``."""
        with self._lock:
            return list(self._runners)

    def keep_only(self, kernels: str) -> None:
        """Drop every runner but the one on ``kernels`` and its draft runners (their weight copies are
        freed once nothing else holds them): ``auto`` keeps its choice and frees the candidates it timed."""
        with self._lock:
            for k in [k for k in self._runners if k != kernels and not k.startswith(f"{kernels}>")]:
                del self._runners[k]

    def release_fp32(self, kernels: str) -> int:
        """Keep only the runner on ``kernels`` and free the fp32 weights behind its converted layers
        (a model loaded for one backend for good, e.g. a draft model, need not hold both copies;
        weights shared with the input embedding are kept). Returns the bytes freed; the model runs
        on ``kernels`` only afterwards."""
        from ..kernels import release_originals

        runner = self.runner(kernels)
        self.keep_only(kernels)
        self.only = kernels
        embed = cast(Any, self.model).get_input_embeddings().weight.data_ptr()  # an HF model's method
        freed = release_originals(runner.model)
        for m in self.model.modules():  # the stock tree's references to the same tensors
            if isinstance(m, nn.Linear) and m.weight.numel() and m.weight.data_ptr() != embed:
                m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
        return freed

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)


@dataclass
class Runner:
    """One configuration of a :class:`LoadedModel`: its weights on one linear-layer backend, with
    that backend's attention function and, on ``compiled``, the static-shape step. Built once by
    :meth:`LoadedModel.runner`, never switched; what a decode loop and a drafter run.

    Attributes:
        base: the loaded model whose weights it runs.
        model: this runner's module tree (stock HF classes; the backend's linear layers installed).
        backend: ``stock``, ``onednn``, ``int8`` (a quantised model) or ``compiled``; a draft
            runner's (:meth:`LoadedModel.draft_runner`): its draft kernels, ``int8`` or ``bf16``.
        extra_bytes: what its own weight copies take (packed, quantised, re-laid out; logged at build).
    """

    base: LoadedModel
    model: torch.nn.Module
    backend: str
    _step: StaticStep | None = field(default=None, repr=False)
    extra_bytes: int = 0
    _packed: nn.Module | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def runner(self, kernels: str) -> Runner:
        """The runner of the same weights on ``kernels`` (:meth:`LoadedModel.runner`)."""
        return self.base.runner(kernels)

    @property
    def tokenizer(self):
        return self.base.tokenizer

    @property
    def batch_width(self) -> int:
        """Requests whose blocks share this runner's forwards: 1 (a batch's runners are
        :class:`~selfspec.models.batch.SlotRunner`)."""
        return 1

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def path(self) -> Path | None:
        return self.base.path

    @property
    def step(self) -> StaticStep | None:
        """The compiled static-shape step of the ``compiled`` runner (made on first use, then kept with
        its compiled graphs and its cache pool) or of a draft runner that has one, else None:
        verification runs eagerly."""
        with self._lock:
            if self._step is None and self.backend == "compiled":
                self._step = StaticStep(self.model)
            return self._step

    @property
    def packed(self) -> torch.nn.Module:
        """This runner's module tree for packed forwards of several requests
        (:mod:`~selfspec.models.batch`): shared with :attr:`model` (no tensor copied), with the
        packed attention over the runner's own attention function; built on first use, then kept."""
        from .batch import PACKED_NAME

        with self._lock:
            if self._packed is None:
                if self.backend == "compiled":
                    raise SelfspecError("batched decoding runs on the eager backends (stock, onednn, int8, compact), "
                                        "not on compiled's static-shape step; use --kernels onednn")
                tree = share_copy(self.model)
                use_attention(tree, PACKED_NAME)
                self._packed = tree
            return self._packed

    def new_cache(self, tokens: int):
        """An empty KV cache for one request of ``tokens`` positions (prompt + new): on a runner with
        a step, a static cache of :meth:`StaticStep.capacity_for` positions from its pool (give it
        back with :meth:`release`); else a growing ``DynamicCache``."""
        step = self.step
        return step.take_cache(step.capacity_for(tokens)) if step is not None else kv_cache.new_cache(self.model.config)

    def release(self, cache) -> None:
        """A request's cache, finished, failed or cancelled: back to the step's pool for the next
        request (a static cache); nothing to do for a growing one."""
        if self.step is not None:
            self.step.give_back(cache)

    def prefill(self, cache, ids: torch.Tensor, want_hidden: bool) -> BlockOutput:
        """The prompt forward on the empty ``cache`` (the step's padded blocks on a runner with one,
        else one eager forward).

        Args:
            ids: ``[P]`` int64 prompt ids.
            want_hidden: also return every layer's hidden states ``[P, H]``.

        Returns:
            logits ``[1, V]`` of the last prompt token, and the hidden states when asked.
        """
        if self.step is not None:
            return self.step.prefill(cache, ids, want_hidden)
        model, device = self.model, self.device
        mask = None
        if has_windows(model):  # our attention functions get no mask from transformers: the window in ours
            mask = attention_masks(model, 0, torch.ones(ids.numel(), ids.numel(), dtype=torch.bool).tril(), None)
        with decode_attention(device):
            out = model(input_ids=ids.to(device)[None], **kv_cache.cache_arg(model, cache), use_cache=True,
                        output_hidden_states=want_hidden, logits_to_keep=1, attention_mask=mask)
        hidden = tuple(h[0] for h in out.hidden_states) if want_hidden else None
        return BlockOutput(out.logits[0, -1:].float(), hidden)

    def forward(self, cache, ids: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor | None,
                want_hidden: bool, base: int) -> BlockOutput:
        """One block of ``T`` new tokens after the ``base`` cached positions, its KV appended to
        ``cache``: through the step (padded to a static shape) on a runner with one, else the eager
        forward (:func:`~selfspec.models.adapter.forward_block`).

        Args:
            ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 position ids (depth-based for trees).
            block_mask: ``[T, T]`` bool visibility among the new tokens, or None for causal.
            want_hidden: also return every layer's hidden states ``[T, H]``.
            base: the cache's committed length (the caller knows it: no device read).

        Returns:
            logits ``[T, V]`` (float) and the hidden states when asked.
        """
        if self.step is not None:
            return self.step.forward(cache, ids, positions, block_mask, want_hidden, base)
        return forward_block(self.model, cache, ids, positions, block_mask, want_hidden)

    @property
    def cost_key(self) -> str:
        """The cache key of :meth:`cost_profile` (``core.cost.profile_key``; the one place it is
        built for a runner): ``+step`` where the backend verifies through its own step, and
        then the version of the step's code (:func:`~selfspec.models.aot_step.code_version`: a new
        layout or Inductor option makes another step, whose profile is measured anew)."""
        if self.step is None:
            return profile_key(self.model, self.name, self.backend)
        from .aot_step import code_version

        version = hashlib.sha256(code_version().encode()).hexdigest()[:12]
        return f"{profile_key(self.model, self.name, self.backend, stepped=True)}|step-code={version}"

    def cost_profile(self, hidden: bool = False, extra_qs: tuple[int, ...] = (), remeasure: bool = False,
                     measure: bool = True) -> CostProfile | None:
        """The verify cost profile T(q) of this runner, cached per machine
        (:func:`~selfspec.core.cost.load_or_measure`): timed through the compiled step on the
        ``compiled`` backend (with hidden states when the method verifies with them, ``hidden``),
        else through the eager forward. ``measure`` off: the cached profile, else None (nothing
        is timed or written)."""
        if not measure:
            return read_cached(self.cost_key)
        return load_or_measure(self.model, self.cost_key, self.name, remeasure=remeasure, extra_qs=extra_qs,
                               step=self.step, hidden=hidden)

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def context_length(self) -> int:
        return self.base.context_length
