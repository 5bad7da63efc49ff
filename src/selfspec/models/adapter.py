"""One forward over a block of new tokens on a stock HF causal LM, with an arbitrary block mask.

Trees and piggyback schemes need no forked modeling code: they go through a 4-D attention
mask and explicit position ids, which ``transformers`` passes through unchanged. A plain chain
uses the model's own causal mask (``attention_mask=None``), exactly the path ``generate`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache

from ..core import kv_cache
from ..core.attention import decode_attention
from ..errors import SelfspecError

# attention functions that take boolean 4-D masks: HF's sdpa and the kernels backends' own
# (kernels.rowwise_attention.NAME, kernels.gqa_attention.NAME and STATIC_NAME, kernels.token_attention.NAME;
# not imported: they register on import)
BOOL_MASK_IMPLS = ("sdpa", "selfspec_rowwise", "selfspec_gqa_sdpa", "selfspec_static_sdpa", "selfspec_compact_sdpa")


@dataclass(frozen=True)
class BlockOutput:
    """Result of :func:`forward_block`.

    Attributes:
        logits: ``[T, V]`` float logits of each new token.
        hidden: per-layer hidden states ``[T, H]`` (embeddings first, then after each decoder
            layer, the last one after the final norm as in HF), or None when not requested.
    """

    logits: torch.Tensor
    hidden: tuple[torch.Tensor, ...] | None


SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_windows(config) -> tuple[int | None, ...]:
    """Each decoder layer's attention window in positions (None: full attention), as the model's
    own code applies it: ``layer_types`` (its ``sliding_attention`` layers see ``sliding_window``
    positions: Gemma 2/3, Qwen2/3 with ``use_sliding_window``) or, without them, ``sliding_window``
    on every layer (Mistral, Phi-3, Starcoder2).

    Raises:
        SelfspecError: a layer type whose state is not a window over a KV cache (chunked, linear
            or recurrent attention)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not types:
        return (int(window) if window else None,) * int(config.num_hidden_layers)
    out: list[int | None] = []
    for kind in types:
        if kind not in (FULL, SLIDING):
            raise SelfspecError(f"{config.model_type}: its {kind!r} layers keep a state that speculative decoding "
                                "cannot roll back; selfspec decodes models whose layers are full or sliding-window "
                                "attention")
        out.append(int(window) if kind == SLIDING and window else None)
    return tuple(out)


def build_mask(base: int, block_mask: torch.Tensor, attn_impl: str, dtype: torch.dtype,
               device: torch.device, width: int | None = None, positions: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
    """A ``[1, 1, T, width]`` mask (``width`` defaults to ``base + T``, a growing cache's
    length; a static cache's is its capacity): every new token sees the whole cached prefix,
    ``block_mask[i, j]`` says whether new token i sees new token j, and nothing after the
    block is seen. With a ``window``, new token i (at ``positions[i]``; default ``base + i``) sees
    only keys less than ``window`` positions before it (cached key j sits at position j), as the
    model's own sliding-window mask does; the cache itself keeps every position, so a rollback is
    the same truncation as under full attention.

    Boolean (True = attend) for sdpa and the int8 backend's row-wise attention; additive (0 or
    dtype-min) for eager attention.
    """
    t = block_mask.shape[0]
    full = torch.zeros(t, width or base + t, dtype=torch.bool, device=device)
    full[:, :base] = True
    full[:, base:base + t] = block_mask.to(device)
    if window is not None:
        q = (positions.to(device) if positions is not None else torch.arange(base, base + t, device=device))
        k = torch.arange(full.shape[1], device=device)
        k[base:base + t] = q  # a block token's key sits at its own position (a tree node's depth)
        full &= (q[:, None] - k[None, :]) < window
    full = full[None, None]
    if attn_impl in BOOL_MASK_IMPLS:
        return full
    return torch.zeros(full.shape, dtype=dtype, device=device).masked_fill(~full, torch.finfo(dtype).min)


def attention_masks(model: torch.nn.Module, base: int, block_mask: torch.Tensor, positions: torch.Tensor | None,
                    width: int | None = None, impl: str | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The verify mask of ``model`` (:func:`build_mask`; for attention ``impl``, default the
    model's) with its layers' windows (:func:`layer_windows`): one mask where every layer attends
    alike, else one per layer type (``{"full_attention": ..., "sliding_attention": ...}``, which
    the models with mixed layers take)."""
    device = next(model.parameters()).device
    config: Any = model.config  # an HF model's (nn.Module types its attributes as Tensor | Module)
    impl, dtype = impl or cast(str, config._attn_implementation), cast(torch.dtype, model.dtype)
    windows = set(layer_windows(config))
    if len(windows) == 1:
        return build_mask(base, block_mask, impl, dtype, device, width, positions, next(iter(windows)))
    window = max(w for w in windows if w is not None)
    return {FULL: build_mask(base, block_mask, impl, dtype, device, width),
            SLIDING: build_mask(base, block_mask, impl, dtype, device, width, positions, window)}


def padded_mask(base: int, block_mask: torch.Tensor | None, t: int, p: int, width: int, attn_impl: str,
                dtype: torch.dtype, device: torch.device, model: torch.nn.Module | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``[1, 1, p, width]`` mask of a ``t``-token block padded to ``p`` rows after ``base``
    cached positions: real row i sees the prefix and the block's ``block_mask[i]`` (causal when
    None); padded row r sees the prefix and itself (:func:`~selfspec.models.adapter.build_mask`).
    With ``model``, its layers' sliding windows too, at the padded rows' ``positions [p]``
    (:func:`~selfspec.models.adapter.attention_masks`: one mask per layer type where they differ)."""
    block = torch.eye(p, dtype=torch.bool)
    block[:t, :t] = block_mask if block_mask is not None else torch.ones(t, t, dtype=torch.bool).tril()
    if model is not None and has_windows(model):
        return attention_masks(model, base, block, positions, width)
    return build_mask(base, block, attn_impl, dtype, device, width)


def has_windows(model: torch.nn.Module) -> bool:
    """Whether any layer of ``model`` attends through a sliding window."""
    return any(w is not None for w in layer_windows(model.config))


def forward_block(
    model: torch.nn.Module,
    cache: DynamicCache,
    ids: torch.Tensor,
    positions: torch.Tensor,
    block_mask: torch.Tensor | None,
    want_hidden: bool = False,
) -> BlockOutput:
    """Run the model over T new tokens after the cached prefix; appends their KV to ``cache``.

    Args:
        model: a stock HF causal LM.
        cache: its cache holding ``base`` positions.
        ids: ``[T]`` int64 new token ids.
        positions: ``[T]`` int64 position ids (depth-based for trees).
        block_mask: ``[T, T]`` bool visibility among the new tokens, or None for plain causal.
        want_hidden: also return every layer's hidden states.
    """
    device = next(model.parameters()).device
    base = cache.get_seq_length()
    mask = None
    if block_mask is None and has_windows(model):  # the window in our mask: the cache keeps every position
        block_mask = torch.ones(ids.numel(), ids.numel(), dtype=torch.bool).tril()
    if block_mask is not None:
        impl = cast(Any, model.config)._attn_implementation
        if impl not in (*BOOL_MASK_IMPLS, "eager"):
            raise SelfspecError(f"tree verification needs attn_implementation sdpa or eager, not {impl}")
        mask = attention_masks(model, base, block_mask, positions)
    with decode_attention(device):
        out = model(
            input_ids=ids.to(device)[None],
            position_ids=positions.to(device)[None],
            attention_mask=mask,
            **kv_cache.cache_arg(model, cache),
            use_cache=True,
            output_hidden_states=want_hidden,
        )
    hidden = tuple(h[0] for h in out.hidden_states) if want_hidden else None
    return BlockOutput(out.logits[0].float(), hidden)
