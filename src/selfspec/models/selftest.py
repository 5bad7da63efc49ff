"""Load-time self-test: a tree forward with the 4-D mask equals a plain causal forward of
every root-to-leaf path. If a model (or attention backend) ignored the mask or the explicit
positions, tree verification would silently be wrong; this refuses such a model instead."""

from __future__ import annotations

import torch

from ..core import kv_cache
from ..core.tree import DraftTree
from ..errors import SelfspecError
from .adapter import forward_block


@torch.inference_mode()
def tree_self_test(model: torch.nn.Module, prefix_len: int = 5, atol: float | None = None) -> float:
    """Returns the largest logit difference; raises SelfspecError beyond ``atol``."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1234)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=g)
    tokens = torch.randint(0, vocab, (6,), generator=g)
    tree = DraftTree(tokens, torch.tensor([-1, 0, 0, 1, 2, 2]))
    cache = kv_cache.new_cache(model.config)
    forward_block(model, cache, prefix, torch.arange(prefix_len), None)
    out = forward_block(model, cache, tree.tokens, tree.depths + prefix_len, tree.ancestor_mask)
    worst = 0.0
    for path in tree.paths:
        kv_cache.truncate(cache, prefix_len)
        ref = forward_block(model, cache, tree.tokens[path], torch.arange(len(path)) + prefix_len, None)
        worst = max(worst, float((out.logits[path] - ref.logits).abs().max()))
    if atol is None:
        atol = 1e-3 if model.dtype == torch.float32 else 0.1
    if worst > atol:
        raise SelfspecError(
            f"tree attention self-test failed (max logit difference {worst:.3g}): this model or attention "
            "backend ignores 4-D masks; load it with attn_implementation='sdpa' or 'eager'"
        )
    return worst
