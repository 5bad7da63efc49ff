"""The ``compiled`` kernels backend: a static-shape verify step under ``torch.compile`` (issue 34).

Every method's speed is a multiple of one target forward, and at batch 1 a small model's eager
forward is mostly Python and dispatch over its layers (RMSNorm, rotary embeddings, the 4-D mask,
small copies). This backend runs the **stock** HF model's forward (no forked modelling code)
compiled by Inductor on static shapes:

- the KV cache is a ``transformers`` ``StaticCache`` of :func:`capacity_for` positions, addressed
  by position (:mod:`selfspec.core.kv_cache` rolls it back by moving its length counter);
- a verify block of ``T`` tokens (tree nodes and piggyback tokens alike) is padded to the next of
  :data:`BUCKETS`: padded rows sit after the real ones, see the cached prefix and themselves only,
  and their KV rows lie past the committed length (stale; overwritten by the next block);
- the mask is always the explicit ``[1, 1, P, capacity]`` one, so one graph serves chains, trees
  and piggyback blocks of the same padded size.

Shapes are static (``dynamic=False``): one compile per (padded size, hidden states or not), each
cached on disk by Inductor under ``$SELFSPEC_HOME/compile`` so that a second process reuses it.
On CUDA the graphs are captured (``mode="reduce-overhead"``). The prompt forward and drafts that
run the target themselves (self-spec) stay eager on the same static cache.

Linear layers are the ``onednn`` backend's prepacked ones where that backend runs (fp32 on the
CPU: 1.1x faster for one-token steps and 1.7x for 8-token blocks than the stock ones inside the
same graph), else the stock ones. Siblings that read one input (q/k/v, gate/up) share one packed
weight per group and the step computes each group's product once
(:class:`~selfspec.kernels.onednn.SharedProductLinear`, :func:`~selfspec.kernels.onednn.shared_products_pass`).
Blocks of up to 8 tokens (``ar``'s every step, and most verify blocks) run their products
instead as reductions that Inductor generates itself over a blocked copy of the weights
(:mod:`selfspec.kernels.gemv`: 1.5x faster products on an AVX2 EPYC, where the library kernels
read the weights at half the memory's speed; a block's rows share one read of the weights),
where free memory holds the copy; the step's Inductor settings
(:data:`~selfspec.models.aot_step.INDUCTOR_OPTIONS`) store a normalised input once instead of
recomputing it inside those loops.
Where the weights are GGUF blocks that the ``compact`` kernel reads (the bundled models), the
layers are compact's instead, and the graph calls its kernel as an extern op (SmolLM2, 2-core AMD
EPYC AVX-512: ``ar`` 69-86 tok/s against 44-61 with fp32 products, 59 on eager compact).
The compiled graph is the model as loaded, in a different operation order: ``compiled`` is a
backend of its own, lossless with respect to ``ar`` on it (a verify row is not bit-identical to
a one-token step: ids are proven identical by the same tests as every fp32 backend).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..core import kv_cache
from ..core.timing import now
from ..errors import SelfspecError
from ..kernels.gqa_attention import STATIC_NAME, WINDOW
from ..paths import writable_cache_dir
from . import aot_step
from .adapter import BlockOutput, padded_mask

log = logging.getLogger("selfspec.kernels")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
"""Padded verify-block sizes; a larger block is padded to a multiple of the last."""
MIN_CAPACITY = 512
"""Static caches hold at least this many positions (one compiled graph for most requests). Every
step attends over the whole capacity: on SmolLM2 (AVX2, 2 threads) a 1-token step took 70 ms at
512 positions and 74 ms at 1024, against 86 ms eager on a growing cache."""
INDUCTOR_DIR = "TORCHINDUCTOR_CACHE_DIR"
HEADROOM = BUCKETS[-1]
"""Positions kept free after the request's last token: a padded verify block, or a self-drafted
chain, is written past the committed length."""
COMPILING = threading.Lock()
"""Held while a step's shape is first called (compiled or loaded): the environment variable that
names Inductor's cache directory is the process's, so two runners never compile at once."""
PREFILL_BLOCK = 64
"""The prompt runs through the step in blocks of this many tokens (:meth:`StaticStep.prefill`):
the largest verify block of every method but ``msn``, so its steps are saved for all of them."""


def bucket(t: int) -> int:
    """The padded size of a ``t``-token block: the smallest of :data:`BUCKETS` that holds it."""
    if t < 1:
        raise ValueError(f"a verify block has at least one token, not {t}")
    for b in BUCKETS:
        if t <= b:
            return b
    return -(-t // BUCKETS[-1]) * BUCKETS[-1]


def block_sizes(largest: int) -> tuple[int, ...]:
    """The padded sizes of every verify block of 1 to ``largest`` tokens, compiled ahead of use by
    the benchmark's warm-up and ``selfspec compile`` (``auto`` tests that they are saved here); a
    larger block compiles when met. ``largest`` is a method's
    :attr:`~selfspec.drafters.spec.MethodSpec.largest_block` (see ``registry.compiled_blocks``)."""
    top = bucket(largest)
    return tuple(b for b in BUCKETS if b < top) + (top,)


def step_shapes(capacity: int, sizes: tuple[int, ...], want_hidden: bool) -> list[tuple[int, int, bool]]:
    """The shapes ``(padded T, capacity, hidden)`` blocks of ``sizes`` run on a ``capacity`` cache."""
    return sorted({(bucket(s), capacity, want_hidden) for s in sizes if bucket(s) + 1 <= capacity})


def capacity_for(tokens: int) -> int:
    """Static-cache positions for a request of ``tokens`` (prompt + new): a power of two, at
    least :data:`MIN_CAPACITY`, with :data:`HEADROOM` to spare. Powers of two keep the number
    of distinct shapes (and compiles) small."""
    return max(MIN_CAPACITY, 1 << (tokens + HEADROOM - 1).bit_length())


def compile_cache_dir() -> str | None:
    """Where Inductor keeps compiled graphs between processes: ``$SELFSPEC_HOME/compile`` (or
    the per-user cache; None where neither is writable), unless ``TORCHINDUCTOR_CACHE_DIR``
    names a place of the user's own (torch itself fills it with a temporary directory)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = os.environ.get(INDUCTOR_DIR)
    if env and os.path.abspath(env) != os.path.abspath(default_cache_dir()):
        return env
    d = writable_cache_dir("compile")
    return None if d is None else str(d)


@contextlib.contextmanager
def inductor_cache(directory: str | None) -> Iterator[None]:
    """Inductor's on-disk caches under ``directory`` for the block (the environment variable it
    reads at each compile), restored afterwards; as it is when ``directory`` is None."""
    before = os.environ.get(INDUCTOR_DIR) if directory is not None else None
    if directory is None:
        yield
        return
    os.environ[INDUCTOR_DIR] = directory
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(INDUCTOR_DIR, None)
        else:
            os.environ[INDUCTOR_DIR] = before


def window_arg(model: torch.nn.Module, written: int) -> dict[str, torch.Tensor]:
    """The keyword that has the compiled backend's attention read only the ``written`` first
    positions of the static cache (:func:`~selfspec.kernels.gqa_attention.windowed_sdpa`), as a
    0-d int64 CPU tensor, where that attention runs on the CPU; else none (on CUDA the length
    would be a device transfer per layer, and captured graphs replay fixed shapes)."""
    if cast(Any, model.config)._attn_implementation != STATIC_NAME or next(model.parameters()).device.type != "cpu":
        return {}
    return {WINDOW: torch.tensor(written, dtype=torch.long)}


@dataclass
class StaticStep:
    """The compiled forward of one runner's module tree (kept on its ``Runner``).

    Attributes:
        model: the stock HF causal LM (its forward is compiled, the module is left as it is).
        compile: False runs the same padded static-shape step eagerly (tests of the padding and
            the static cache, and a baseline that isolates what compiling buys).
        compile_s: seconds the first call of each shape took (compile included), by shape
            ``(padded T, capacity, hidden)``; its keys are the shapes compiled in this process.
    """

    model: torch.nn.Module
    compile: bool = True
    compile_s: dict[tuple[int, int, bool], float] = field(default_factory=dict)
    _fn: object = field(default=None, repr=False)
    _aot: dict[tuple[int, int, bool], Callable | None] = field(default_factory=dict, repr=False)
    _free: dict[int, list] = field(default_factory=dict, repr=False)
    _dir: str | None = field(default=None, repr=False)
    _loaded: set[tuple[int, int, bool]] = field(default_factory=set, repr=False)  # loaded, not compiled, here

    @staticmethod
    def capacity_for(tokens: int) -> int:
        """Static-cache positions for a request of ``tokens`` (module :func:`capacity_for`)."""
        return capacity_for(tokens)

    def take_cache(self, capacity: int):
        """An empty static cache of ``capacity`` positions for one request: one an earlier request
        gave back (:meth:`give_back`) when there is one, else a new one. Reuse keeps the cache's
        tensors at the same addresses, so CUDA graphs captured on them replay instead of being
        captured again for every request (and no request allocates a cache on the CPU). Requests
        in flight together hold different caches; what a reused cache holds past its length is
        never read (every step's mask covers the committed positions and its block only)."""
        pool = self._free.get(capacity)
        if pool:
            cache = pool.pop()
            kv_cache.set_length(cache, 0)
            return cache
        return kv_cache.new_cache(self.model.config, capacity)

    def give_back(self, cache) -> None:
        """Return a request's static cache for later requests (:meth:`take_cache`)."""
        self._free.setdefault(cast(int, kv_cache.capacity(cache)), []).append(cache)  # a static cache's: an int

    @property
    def compiled(self) -> set[tuple[int, int, bool]]:
        """The shapes compiled so far in this process."""
        return set(self.compile_s)

    def _step_for(self, shape: tuple[int, int, bool], kwargs: dict) -> Callable:
        """What runs a block of ``shape`` (called with ``kwargs``): the eager forward (``compile``
        off); on CPU a step compiled ahead of time, loaded from the cache directory when an earlier
        process saved it (no trace: :mod:`~selfspec.models.aot_step`); elsewhere ``torch.compile``."""
        if not self.compile:
            return self.model.forward
        if shape not in self._aot:
            if not aot_step.supported(next(self.model.parameters()).device):  # torch.compile's own cache
                if shape not in self.compile_s:
                    self._compiling(shape)
                return self._compiled_forward()
            path = aot_step.artifact_path(self._dir, self.model, shape) if self._dir else None
            fn = aot_step.load_step(path, self.model) if path is not None else None
            if fn is not None:
                self._loaded.add(shape)
            else:
                self._compiling(shape)
                try:
                    fn = aot_step.compile_step(self.model, kwargs, path)  # under the first call's cache directory
                except Exception as e:  # noqa: BLE001 - e.g. a graph break: torch.compile's own path
                    log.info(f"compiling the step ahead of time failed ({type(e).__name__}: {str(e)[:200]}); "
                             "compiling it for this process only")
            self._aot[shape] = fn
        fn = self._aot[shape]
        return functools.partial(fn, self.model) if fn is not None else self._compiled_forward()

    def _compiling(self, shape: tuple[int, int, bool]) -> None:
        p, width, want_hidden = shape
        log.info(f"compiling the decode step for {p}-token blocks ({'with' if want_hidden else 'no'} hidden states, "
                 f"{width}-position cache; once per machine and thread count, then loaded from "
                 f"{self._dir or 'nowhere: no writable cache directory'}) ...")

    def _compiled_forward(self):
        if not self.compile:
            return self.model.forward
        if self._fn is None:
            device = next(self.model.parameters()).device
            if device.type == "cuda":  # CUDA graphs (stock layers: no shared products)
                self._fn = torch.compile(self.model.forward, dynamic=False, mode="reduce-overhead")
            else:
                self._fn = torch.compile(self.model.forward, dynamic=False,
                                         options=aot_step.cpu_step_options())
        return self._fn

    def missing(self, capacity: int, sizes: tuple[int, ...], want_hidden: bool) -> list[tuple[int, int, bool]]:
        """The shapes ``(padded T, capacity, hidden)`` of blocks of ``sizes`` that neither ran in this
        process nor are saved on disk here (a later process loads a saved step in a fraction of a
        second instead of compiling it). On devices whose steps are not saved (CUDA), every shape
        not compiled in this process."""
        if not self.compile:
            return []
        todo = [sh for sh in step_shapes(capacity, sizes, want_hidden) if sh not in self.compile_s]
        d = compile_cache_dir()
        if d is None or not aot_step.supported(next(self.model.parameters()).device):
            return todo
        paths = aot_step.artifact_paths(d, self.model, todo)
        return [sh for sh, path in zip(todo, paths) if not path.is_file()]

    def warm_up(self, capacity: int, sizes: tuple[int, ...], want_hidden: bool) -> float:
        """Compile the step for blocks of each of ``sizes`` (padded as :func:`bucket`) on a
        ``capacity``-position cache ahead of use, so that no later request pays a compile (the
        benchmark does this before it times anything). Returns the seconds it took.

        It compiles what decoding will run, or the first request would trace and compile again:
        under ``torch.inference_mode()``, as the decode loop runs (the grad mode is in Dynamo's
        guards), on a cache that a one-token prompt forward has initialised, as a request's
        prompt forward does (the cache layers' initialisation is in the guards too)."""
        t0 = now(None)
        device = next(self.model.parameters()).device
        for size in sorted({bucket(s) for s in sizes}):
            if (size, capacity, want_hidden) in self.compile_s or size + 1 > capacity:
                continue
            cache = self.take_cache(capacity)  # the cache requests will reuse: graphs captured on it replay
            with torch.inference_mode():
                self.prefill(cache, torch.full((1,), 4, dtype=torch.long), want_hidden)
                self.forward(cache, torch.full((size,), 4, dtype=torch.long), torch.arange(1, size + 1), None,
                             want_hidden, base=1)
            self.give_back(cache)
        return now(device) - t0

    def prefill(self, cache, ids: torch.Tensor, want_hidden: bool) -> BlockOutput:
        """The prompt forward on the static ``cache``: the prompt in blocks of :data:`PREFILL_BLOCK`
        tokens through the step itself (each padded as :func:`bucket`, the last one included), so
        the prompt costs a few compiled steps instead of an eager forward. On SmolLM2 (AVX-512, 2
        threads) an eager forward took 49-98 ms for prompts of 8-60 tokens, the padded step 21-59 ms.
        A new cache's layers allocate their tensors on their first write, which a compiled step
        cannot do, and a step compiles only after an eager forward as it runs (with hidden states
        when it returns them: transformers sets up their recording on the first such call, which a
        trace cannot hold): such a cache, or a prompt whose blocks were not run in this process yet,
        first runs one eager token (written again by the first block).

        Args:
            cache: an empty static cache.
            ids: ``[P]`` int64 prompt ids.
            want_hidden: also return every layer's hidden states ``[P, H]``.

        Returns:
            logits ``[1, V]`` of the last prompt token, and the hidden states when asked.
        """
        t, width = ids.numel(), cast(int, kv_cache.capacity(cache))  # a static cache's: an int
        starts = range(0, t, PREFILL_BLOCK)
        ends = [min(t, i + PREFILL_BLOCK) for i in starts]
        if starts[-1] + bucket(ends[-1] - starts[-1]) > width:  # the padded blocks would not fit (tiny caches)
            return self._eager_prefill(cache, ids, want_hidden)
        shapes = {(bucket(e - i), width, want_hidden) for i, e in zip(starts, ends)}
        if not kv_cache.initialised(cache) or (self.compile and not shapes <= self.compiled):
            self._eager_prefill(cache, ids[:1], want_hidden)  # what a step compiles after (see warm_up)
        blocks = [self.forward(cache, ids[i:e], torch.arange(i, e), None, want_hidden, base=i)
                  for i, e in zip(starts, ends)]
        hidden = None
        if want_hidden:
            per_layer = zip(*(b.hidden for b in blocks))
            hidden = tuple(h[0] if len(h) == 1 else torch.cat(h) for h in per_layer)
        return BlockOutput(blocks[-1].logits[-1:], hidden)

    def _eager_prefill(self, cache, ids: torch.Tensor, want_hidden: bool) -> BlockOutput:
        """``ids[P]`` as the empty cache's first positions (its layers count them), one eager forward
        through the explicit mask; logits ``[1, V]`` of the last token (and hidden states ``[P, H]``
        when asked)."""
        model = self.model
        device = next(model.parameters()).device
        t = ids.numel()
        mask = padded_mask(0, None, t, t, cast(int, kv_cache.capacity(cache)),
                           cast(Any, model.config)._attn_implementation, cast(torch.dtype, model.dtype), device, model)
        out = model(input_ids=ids.to(device)[None], position_ids=torch.arange(t, device=device)[None],
                    attention_mask=mask, **kv_cache.cache_arg(model, cache), use_cache=True,
                    output_hidden_states=want_hidden, logits_to_keep=1, **window_arg(model, t))
        hidden = tuple(h[0] for h in out.hidden_states) if want_hidden else None
        return BlockOutput(out.logits[0].float(), hidden)

    def forward(self, cache, ids: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor | None,
                want_hidden: bool, base: int | None = None) -> BlockOutput:
        """Run ``T`` new tokens after the cached prefix, padded to :func:`bucket` ``(T)``; their KV
        is appended to the static ``cache`` (its length grows by exactly ``T``).

        Args:
            cache: a static cache (:func:`~selfspec.core.kv_cache.new_cache` with a capacity).
            ids: ``[T]`` int64 token ids.
            positions: ``[T]`` int64 position ids.
            block_mask: ``[T, T]`` bool visibility among the new tokens, or None for causal.
            want_hidden: also return every layer's hidden states.
            base: the cache's length when the caller knows it (the decode loop does): reading
                the static cache's length counter is a device-to-host transfer.

        Returns:
            the :class:`~selfspec.models.adapter.BlockOutput` of the ``T`` real tokens.
        """
        model = self.model
        device = next(model.parameters()).device
        if base is None:
            base = kv_cache.cache_length(cache)
        else:  # the block is written at base whatever a draft left in the cache past it
            kv_cache.set_length(cache, base)
        width = cast(int, kv_cache.capacity(cache))  # a static cache's: an int
        t = ids.numel()
        p = bucket(t)
        if base + p > width:
            raise SelfspecError(f"a {t}-token verify block (padded to {p}) after {base} positions overflows the "
                                f"{width}-position static cache of the compiled backend; draft trees of at most "
                                f"{HEADROOM} tokens fit, or use --kernels stock")
        ids_p = torch.zeros(p, dtype=torch.long)
        ids_p[:t] = ids.cpu()
        pos_p = torch.full((p,), int(positions[-1]), dtype=torch.long)
        pos_p[:t] = positions.cpu()
        mask = padded_mask(base, block_mask.cpu() if block_mask is not None else None, t, p, width,
                           cast(Any, model.config)._attn_implementation, cast(torch.dtype, model.dtype), device, model,
                           pos_p)
        shape = (p, width, want_hidden)
        first = self.compile and shape not in self.compile_s
        kwargs = dict(input_ids=ids_p.to(device)[None], position_ids=pos_p.to(device)[None], attention_mask=mask,
                      **kv_cache.cache_arg(model, cache), use_cache=True, output_hidden_states=want_hidden,
                      **window_arg(model, base + p))
        if first:  # the cache directory, resolved before anything compiles (Inductor reads it then)
            self._dir = compile_cache_dir()
        t0 = now(None)
        if first:  # Inductor reads its cache directory from the environment when it compiles: set for a
            # shape's first call only (a later call compiles nothing), one compile at a time in the process
            lock = aot_step.artifact_path(self._dir, model, shape) if self._dir else None
            with COMPILING, aot_step.step_lock(lock), inductor_cache(self._dir):  # one compile across processes
                out = self._step_for(shape, kwargs)(**kwargs)
        else:
            out = self._step_for(shape, kwargs)(**kwargs)
        if first:
            self.compile_s[shape] = now(device) - t0
            if shape in self._loaded:
                log.debug(f"loaded the saved {p}-token step ({self.compile_s[shape]:.1f} s)")
            else:
                log.info(f"the {p}-token step is ready ({self.compile_s[shape]:.1f} s)")
        kv_cache.set_length(cache, base + t)
        hidden = tuple(h[0, :t] for h in out.hidden_states) if want_hidden else None
        return BlockOutput(out.logits[0, :t].float(), hidden)
