"""Several requests in one forward (issue 58): the verify (or prompt) blocks of every active request
packed along the sequence dimension, each over its **own** KV cache.

One packed forward of a runner's module tree carries the rows of ``n`` requests:
``input_ids [1, R]`` (``R`` = the requests' block sizes together), their own positions, and a
:class:`PackedCache` in place of a cache. The linear layers, norms, rotary embeddings and the LM
head see ``R`` rows; at each layer the cache hands every request's new keys and values to that
request's own cache (a stock ``DynamicCache``, rolled back by :mod:`~selfspec.core.kv_cache` as in a
solo run), and the attention (:data:`PACKED_NAME`) runs once per request, over exactly that request's
cache and block with its explicit mask, through the runner's own attention (compact's one-token rows: one call for all).

So a request's attention is computed as if it ran alone, and its rows differ from a solo run's only
where a linear-layer kernel's rows depend on how many rows it multiplies: the ``onednn`` and ``int8``
backends promise they do not (checked at load); PyTorch's stock BLAS does not promise it.
:func:`row_invariant` says which backends keep a request's output independent of the batch.

The packed tree is a runner's own module tree shared (:func:`~selfspec.kernels.swap.share_copy`, no
tensor copied) with the packed attention installed once (:meth:`~selfspec.models.runner.Runner.packed`).
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..core import kv_cache
from ..core.attention import decode_attention
from ..errors import SelfspecError
from ..kernels.token_attention import packed_rows
from .adapter import BOOL_MASK_IMPLS, FULL, SLIDING, BlockOutput, attention_masks, has_windows

PACKED_NAME = "selfspec_packed"
"""The attention function of a packed module tree (registered with ``transformers.AttentionInterface``)."""
ROW_INVARIANT = ("onednn", "int8", "compact")
"""Backends whose rows are bit-identical whatever the number of rows multiplied together (each
promises it and checks it at load), so a request's output does not depend on its batch."""


def row_invariant(backend: str) -> bool:
    """Whether a request decoded in a batch on ``backend`` gives exactly its solo output (:data:`ROW_INVARIANT`)."""
    return backend in ROW_INVARIANT


@dataclass
class Block:
    """One request's part of a packed forward.

    Attributes:
        cache: the request's own cache, holding ``base`` positions (its KV of the block is appended).
        ids: ``[T]`` int64 token ids.
        positions: ``[T]`` int64 position ids.
        block_mask: ``[T, T]`` bool visibility among the block's tokens, or None for causal.
        base: the cache's length before the block.
        keep: the rows whose logits are returned (None: every row; ``[]``: none).
        want_hidden: also return every layer's hidden states of the block's rows.
    """

    cache: Cache
    ids: torch.Tensor
    positions: torch.Tensor
    block_mask: torch.Tensor | None
    base: int
    keep: Sequence[int] | None = None
    want_hidden: bool = False


@dataclass
class PackedKV:
    """What :class:`PackedCache` hands the attention in place of keys and values: each request's
    keys and values ``[1, Hkv, L_i, D]`` (its cache with its block), its rows of the packed block and
    its mask ``[1, 1, T_i, L_i]`` (None for a one-token block with no sliding window: it sees
    every position, as in a solo step), and the runner's own attention function by name."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    rows: list[tuple[int, int]]
    masks: list[torch.Tensor | dict[str, torch.Tensor] | None]  # a dict: one per layer type; None: sees all
    inner: str


class PackedCache(Cache):
    """The cache argument of a packed forward: hands each request's new keys and values to its own
    cache and gives the attention a :class:`PackedKV`. Built for one forward, then dropped."""

    def __init__(self, blocks: Sequence[Block], inner: str, model: torch.nn.Module) -> None:
        super().__init__(layers=[])
        self.caches = [b.cache for b in blocks]
        self.inner = inner
        self.rows: list[tuple[int, int]] = []
        start = 0
        for b in blocks:
            self.rows.append((start, start + b.ids.numel()))
            start += b.ids.numel()
        windows = has_windows(model)
        self.masks = [None if b.ids.numel() == 1 and not windows  # one token sees every position: no mask
                      else attention_masks(model, b.base, b.block_mask if b.block_mask is not None
                                           else torch.ones(b.ids.numel(), b.ids.numel(), dtype=torch.bool).tril(),
                                           b.positions, impl=inner) for b in blocks]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,  # type: ignore[override]
               *args, **kwargs) -> tuple[PackedKV, PackedKV]:  # by design: the packed attention takes PackedKV
        keys, values = [], []
        for cache, (r0, r1) in zip(self.caches, self.rows):
            k, v = cache.update(key_states[:, :, r0:r1], value_states[:, :, r0:r1], layer_idx)
            keys.append(k)
            values.append(v)
        packed = PackedKV(keys, values, self.rows, self.masks, self.inner)
        return packed, packed

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions are always given explicitly


def packed_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: PackedKV, value: PackedKV,
                             attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """The attention of a packed forward: the runner's own attention function once per request (or one
    :func:`~selfspec.kernels.token_attention.packed_rows`) on its rows of ``query [1, H, R, D]``; ``[1, R, H, D]``."""
    kind = SLIDING if kwargs.get("sliding_window") is not None else FULL  # this layer's (models with mixed layers)
    masks = [mask[kind] if isinstance(mask, dict) else mask for mask in key.masks]
    one = packed_rows(key.inner, query, key.keys, key.values, key.rows, masks, kwargs)
    if one is None:
        inner = ALL_ATTENTION_FUNCTIONS[key.inner]
        one = torch.cat([inner(module, query[:, :, r0:r1], k, v, mask, **kwargs)[0]
                         for (r0, r1), k, v, mask in zip(key.rows, key.keys, key.values, masks)], dim=1)
    return one, None


AttentionInterface.register(PACKED_NAME, packed_attention_forward)

_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # 4-D: transformers passes it through untouched (unused)


def packable(inner: str) -> bool:
    """Whether a runner with attention function ``inner`` can run inside a packed forward: a
    registered function that takes the explicit boolean masks the packed path builds (sdpa and
    selfspec's own; not eager, whose masks are additive and whose function is per model, nor flash
    or flex attention, which take no such mask)."""
    return inner in BOOL_MASK_IMPLS and inner in ALL_ATTENTION_FUNCTIONS


def check_packable(inner: str) -> None:
    """Refuse a runner whose attention function cannot run per request inside a packed forward."""
    if not packable(inner):
        raise SelfspecError(f"batched decoding needs sdpa attention (or selfspec's own), not {inner!r}; load the "
                            "model with attn_implementation='sdpa', or decode one request at a time")


@torch.inference_mode()
def packed_forward(model: torch.nn.Module, inner: str, blocks: Sequence[Block]) -> list[BlockOutput]:
    """One forward of the packed module tree ``model`` (attention :data:`PACKED_NAME`; ``inner``:
    the runner's own attention) over the ``blocks`` of several requests; each request's cache
    grows by its block. Returns each block's :class:`BlockOutput`: logits ``[len(keep), V]``
    (float) and, where asked, every layer's hidden states ``[T, H]``."""
    device = next(model.parameters()).device
    ids = torch.cat([b.ids for b in blocks]).to(device)
    positions = torch.cat([b.positions for b in blocks]).to(device)
    cache = PackedCache(blocks, inner, model)
    keep: list[int] = []
    spans = []
    for b, (r0, r1) in zip(blocks, cache.rows):
        rows = range(r0, r1) if b.keep is None else [r0 + i for i in b.keep]
        spans.append((len(keep), len(keep) + len(rows)))
        keep.extend(rows)
    want_hidden = any(b.want_hidden for b in blocks)
    with decode_attention(device):
        out = model(input_ids=ids[None], position_ids=positions[None], attention_mask=_NO_MASK.to(device),
                    **kv_cache.cache_arg(model, cache), use_cache=True, output_hidden_states=want_hidden,
                    logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device))
    logits = out.logits[0].float()
    results = []
    for b, (k0, k1), (r0, r1) in zip(blocks, spans, cache.rows):
        hidden = tuple(h[0, r0:r1] for h in out.hidden_states) if b.want_hidden else None
        results.append(BlockOutput(logits[k0:k1], hidden))
    return results


SIZES_KEPT = 4096
"""Batch sizes a :class:`Batcher` keeps (a server's runs for its life; the metrics count them all)."""


class Batcher:
    """Continuous batching of the forwards of several requests, each decoding in a thread of its own
    through the one decode loop with a :class:`SlotRunner`: a request's forward waits until every
    request in the batch has one waiting (the others are drafting); then the driving thread
    (:meth:`drive`) runs them all as one packed forward and hands each request its rows. Requests
    join and leave between forwards.

    Every packed forward runs in the one driving thread: torch's CPU thread pools belong to the
    thread that calls them, and forwards that hopped between threads ran a third slower on a 2-core
    EPYC (oneDNN, SmolLM2: 10.6-11.1 against 14.9-15.2 tok/s) while the other pool's workers spun.

    It runs them on :attr:`threads` torch threads, set before each (a request thread's 1 is also the
    count a new thread takes: serve's decode thread took it, 52 against 40 ms a token at 1 client).

    Attributes:
        runner: the verify runner (its packed module tree runs the forwards).
        max_batch: the most requests in one packed forward.
        sizes: the number of requests in each of the latest :data:`SIZES_KEPT` packed forwards.
        forwards: packed forwards run so far.
        on_forward: called with the number of requests after each packed forward (metrics).
        threads: the torch CPU threads of every packed forward: the creating thread's count.
    """

    def __init__(self, runner, max_batch: int = 8) -> None:
        if max_batch < 1:
            raise SelfspecError(f"max_batch is at least 1, not {max_batch}")
        self.runner = runner
        self.max_batch = max_batch
        self.threads = torch.get_num_threads()
        self.sizes: collections.deque[int] = collections.deque(maxlen=SIZES_KEPT)
        self.forwards = 0
        self._model = runner.packed
        self._inner = runner.model.config._attn_implementation
        check_packable(self._inner)
        self._cond = threading.Condition()
        self._active = 0
        self._waiting: list[tuple[Block, list]] = []
        self._woken = False
        self._error: BaseException | None = None
        self.on_forward: Callable[[int], object] | None = None  # called with each forward's batch size

    def slot(self) -> SlotRunner:
        """A runner for one request's decode loop (join it with :meth:`join`)."""
        return SlotRunner(self)

    def join(self) -> None:
        """A request starts decoding: its forwards are batched with the others'."""
        with self._cond:
            self._active += 1

    def leave(self) -> None:
        """A request ended (finished, failed or cancelled): the others no longer wait for it."""
        with self._cond:
            self._active -= 1
            self._cond.notify_all()

    def submit(self, block: Block) -> BlockOutput:
        """Run ``block`` in the next packed forward (called from a request's thread); returns its
        output, or raises what the forward raised."""
        box: list = []
        with self._cond:
            if self._error is not None:
                raise SelfspecError(f"the batch was stopped ({type(self._error).__name__})")
            self._waiting.append((block, box))
            self._cond.notify_all()
            while not box:
                self._cond.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def abort(self, error: BaseException) -> None:
        """Stop the batch: every request waiting for a forward, and every later one, raises (the
        driving thread was interrupted or failed); their threads then leave."""
        with self._cond:
            self._error = error
            for _, box in self._waiting:
                box.append(SelfspecError(f"the batch was stopped ({type(error).__name__})"))
            self._waiting = []
            self._cond.notify_all()

    @property
    def active(self) -> int:
        """Requests decoding now (joined, not yet left)."""
        with self._cond:
            return self._active

    def wake(self) -> None:
        """Interrupt a :meth:`step` that waits (e.g. a new request arrived to be admitted)."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def _ready(self) -> bool:  # under the condition's lock
        return bool(self._waiting) and len(self._waiting) >= min(self._active, self.max_batch)

    def drive(self) -> None:
        """Run packed forwards in this thread until no request is active: each as soon as every
        active request (up to :attr:`max_batch`) has a block waiting."""
        while True:
            with self._cond:
                while not self._ready():
                    if self._active == 0 and not self._waiting:
                        return
                    self._cond.wait()
            self.step(wait=0.0)

    def step(self, wait: float | None = None) -> bool:
        """Run one packed forward in this thread once every active request (up to
        :attr:`max_batch`) has a block waiting; wait up to ``wait`` seconds for that (None: until
        it happens or :meth:`wake` is called). Returns whether a forward ran."""
        with self._cond:
            self._woken = False
            if not self._ready():
                self._cond.wait_for(lambda: self._ready() or self._woken, timeout=wait)
            if not self._ready():
                return False
            batch, self._waiting = self._waiting[:self.max_batch], self._waiting[self.max_batch:]
        self._run(batch)
        return True

    def _run(self, batch: list[tuple[Block, list]]) -> None:
        interrupted: BaseException | None = None
        torch.set_num_threads(self.threads)  # this thread's pool; it also undoes a request thread's 1 for new threads
        try:
            outs: list = packed_forward(self._model, self._inner, [b for b, _ in batch])
        except Exception as e:  # noqa: BLE001 - each request of the forward raises it in its own thread
            outs = [e] * len(batch)
        except BaseException as e:  # Ctrl-C in the driving thread: the requests still get an answer
            interrupted = e
            outs = [SelfspecError(f"the batch was stopped ({type(e).__name__})")] * len(batch)
        with self._cond:
            self.sizes.append(len(batch))
            self.forwards += 1
            for (_, box), out in zip(batch, outs):
                box.append(out)
            self._cond.notify_all()
        if interrupted is not None:
            raise interrupted
        if self.on_forward is not None:
            self.on_forward(len(batch))


PREFILL_CHUNK = 64
"""A prompt runs through the batch in blocks of this many tokens, so a long prompt does not stall
the requests decoding beside it (each of its blocks shares a packed forward with their steps)."""


class SlotRunner:
    """What one request's decode loop runs in a :class:`Batcher`: the verify runner's calls
    (``new_cache``, ``prefill``, ``forward``, ``release``), each forward a block of the next packed
    forward. Everything else is the verify runner's."""

    step = None  # eager caches: the loop checks their length on the host

    def __init__(self, batcher: Batcher) -> None:
        self.batcher = batcher
        self.target = batcher.runner

    @property
    def model(self) -> torch.nn.Module:
        return self.target.model

    @property
    def backend(self) -> str:
        return self.target.backend

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def context_length(self) -> int:
        return self.target.context_length

    @property
    def batch_width(self) -> int:
        """Requests whose blocks share the next packed forward: those decoding now, up to
        ``max_batch`` (what the draft controller sizes drafts against)."""
        return max(1, min(self.batcher.active, self.batcher.max_batch))

    @property
    def device(self) -> torch.device:
        return self.target.device

    def new_cache(self, tokens: int):
        return kv_cache.new_cache(self.target.model.config)

    def release(self, cache) -> None:
        pass

    def prefill(self, cache, ids: torch.Tensor, want_hidden: bool) -> BlockOutput:
        """The prompt ``ids [P]`` in blocks of :data:`PREFILL_CHUNK` tokens; logits ``[1, V]`` of
        its last token (and every layer's hidden states ``[P, H]`` when asked)."""
        outs = []
        for start in range(0, ids.numel(), PREFILL_CHUNK):
            chunk = ids[start:start + PREFILL_CHUNK]
            last = start + PREFILL_CHUNK >= ids.numel()
            outs.append(self.batcher.submit(Block(cache, chunk, torch.arange(start, start + chunk.numel()), None,
                                                  start, [chunk.numel() - 1] if last else [], want_hidden)))
        hidden = None
        if want_hidden:
            hidden = tuple(torch.cat(h) for h in zip(*(o.hidden for o in outs)))
        return BlockOutput(outs[-1].logits, hidden)

    def forward(self, cache, ids: torch.Tensor, positions: torch.Tensor, block_mask: torch.Tensor | None,
                want_hidden: bool, base: int) -> BlockOutput:
        return self.batcher.submit(Block(cache, ids, positions, block_mask, base, None, want_hidden))
