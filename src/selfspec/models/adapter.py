"""One forward over a block of new tokens on a stock HF causal LM, with an arbitrary block mask.

Trees and piggyback schemes need no forked modeling code: they go through a 4-D attention
mask and explicit position ids, which ``transformers`` passes through unchanged. A plain chain
uses the model's own causal mask (``attention_mask=None``), exactly the path ``generate`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..core import kv_cache
from ..core.attention import decode_attention
from ..errors import SelfspecError

# attention functions that take boolean 4-D masks: HF's sdpa and the kernels backends' own
# (kernels.rowwise_attention.NAME, kernels.gqa_attention.NAME and STATIC_NAME; not imported: they
# register on import)
BOOL_MASK_IMPLS = ("sdpa", "selfspec_rowwise", "selfspec_gqa_sdpa", "selfspec_static_sdpa")


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


def build_mask(base: int, block_mask: torch.Tensor, attn_impl: str, dtype: torch.dtype,
               device: torch.device, width: int | None = None) -> torch.Tensor:
    """A ``[1, 1, T, width]`` mask (``width`` defaults to ``base + T``, a growing cache's
    length; a static cache's is its capacity): every new token sees the whole cached prefix,
    ``block_mask[i, j]`` says whether new token i sees new token j, and nothing after the
    block is seen.

    Boolean (True = attend) for sdpa and the int8 backend's row-wise attention; additive (0 or
    dtype-min) for eager attention.
    """
    t = block_mask.shape[0]
    full = torch.zeros(t, width or base + t, dtype=torch.bool, device=device)
    full[:, :base] = True
    full[:, base:base + t] = block_mask.to(device)
    full = full[None, None]
    if attn_impl in BOOL_MASK_IMPLS:
        return full
    return torch.zeros(full.shape, dtype=dtype, device=device).masked_fill(~full, torch.finfo(dtype).min)


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
    if block_mask is not None:
        impl = model.config._attn_implementation
        if impl not in (*BOOL_MASK_IMPLS, "eager"):
            raise SelfspecError(f"tree verification needs attn_implementation sdpa or eager, not {impl}")
        mask = build_mask(base, block_mask, impl, model.dtype, device)
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
