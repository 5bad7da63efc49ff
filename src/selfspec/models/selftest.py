"""Load-time self-test: a tree forward with the 4-D mask equals a plain causal forward of
every root-to-leaf path. If a model (or attention backend) ignored the mask or the explicit
positions, tree verification would silently be wrong; this refuses such a model instead.

In fp32 the logits must agree to ``1e-3``. In half precision (bf16, fp16) the tree forward and
the sequential forwards round differently (different matmul shapes, different reduction orders),
so raw logits can differ by more than 0.5 on a healthy model; there the test compares decisions:
the top token of every node must agree wherever the sequential top-2 gap exceeds the rounding
noise, and the logits must agree to a few percent of their spread. A model that ignored the
mask sees different tokens in its context and fails both by far.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ..core import kv_cache, store
from ..core.tree import DraftTree
from ..errors import SelfspecError
from .adapter import forward_block

if TYPE_CHECKING:
    from transformers import DynamicCache

log = logging.getLogger("selfspec.models")


def _half_precision_ok(tree_logits: torch.Tensor, seq_logits: torch.Tensor, dtype: torch.dtype) -> tuple[bool, str]:
    """Decision-level agreement of ``[N, V]`` tree and sequential logits in half precision."""
    a, b = tree_logits.float(), seq_logits.float()
    scale = float(b.abs().max())
    margin = max(0.5, 4 * torch.finfo(dtype).eps * scale)  # top-2 gaps below this are rounding ties
    top2 = b.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > margin
    flips = int(((a.argmax(-1) != b.argmax(-1)) & decided).sum())
    rel = float((a - b).abs().mean() / b.std().clamp_min(1e-6))
    ok = flips == 0 and rel < 0.1
    return ok, f"{flips} of {int(decided.sum())} clearly decided nodes chose another token, mean difference " \
               f"{rel:.1%} of the logits' spread"


@torch.inference_mode()
def tree_self_test(model: torch.nn.Module, prefix_len: int = 5, atol: float | None = None) -> float:
    """Returns the largest logit difference; raises SelfspecError when the tree forward does not
    match the sequential one (fp32: beyond ``atol``, default 1e-3; half precision: see the
    module docstring, or beyond ``atol`` when given)."""
    config: Any = model.config  # an HF model's (nn.Module types its attributes as Tensor | Module)
    vocab = config.vocab_size
    g = torch.Generator().manual_seed(1234)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=g)
    tokens = torch.randint(0, vocab, (6,), generator=g)
    tree = DraftTree(tokens, torch.tensor([-1, 0, 0, 1, 2, 2]))
    cache = cast("DynamicCache", kv_cache.new_cache(config))  # no capacity: a growing cache
    forward_block(model, cache, prefix, torch.arange(prefix_len), None)
    out = forward_block(model, cache, tree.tokens, tree.depths + prefix_len, tree.ancestor_mask)
    worst = 0.0
    tree_rows, seq_rows = [], []
    for path in tree.paths:
        kv_cache.truncate(cache, prefix_len)
        ref = forward_block(model, cache, tree.tokens[path], torch.arange(len(path)) + prefix_len, None)
        worst = max(worst, float((out.logits[path] - ref.logits).abs().max()))
        tree_rows.append(out.logits[path])
        seq_rows.append(ref.logits)
    half = model.dtype in (torch.bfloat16, torch.float16)
    if half and atol is None:
        ok, detail = _half_precision_ok(torch.cat(tree_rows), torch.cat(seq_rows), cast(torch.dtype, model.dtype))
    else:
        atol = 1e-3 if atol is None else atol
        ok, detail = worst <= atol, f"max logit difference {worst:.3g}, tolerance {atol:g}"
    if not ok:
        raise SelfspecError(
            f"tree attention self-test failed ({detail}): this model's attention ignores the 4-D tree mask or "
            "the explicit position ids, so speculative verification would change its output; selfspec loads "
            "models with attn_implementation='sdpa' - if this model has custom attention code, it is not "
            "supported (pass self_test=False only to debug)"
        )
    return worst


def self_test_key(target) -> str | None:
    """What a passed self-test of ``target`` (a :class:`~selfspec.models.loading.LoadedModel`)
    depends on: the code that runs it (model class, attention function, transformers, torch, the
    kernels backend and the machine, see :func:`~selfspec.core.store.key`) and the weights
    it ran on (the name, size and modification time of each weights file in the model's
    directory). None where the weights have no files (a model built in memory): tested each time."""
    import transformers

    if target.path is None or not Path(target.path).is_dir():
        return None
    files = sorted(f for f in Path(target.path).iterdir() if f.suffix in (".safetensors", ".json"))
    stamp = hashlib.sha256(repr([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]).encode())
    model = target.model
    return store.key(store.Kind.SELF_TEST, model, str(target.path), target.backend, type(model).__qualname__,
                     model.config._attn_implementation, f"transformers={transformers.__version__}",
                     stamp.hexdigest()[:16])


def cached_tree_self_test(target, save: bool = True) -> float:
    """:func:`tree_self_test` of ``target``'s model, or the largest difference a passed run recorded
    for the same :func:`self_test_key` on this machine (the test is five eager forwards: 0.65 s of
    SmolLM2's 10 s warm start on a 2-core EPYC). Only passes are recorded (not with ``save`` off):
    a failure raises every time."""
    key = self_test_key(target)
    if key is not None:
        passed = store.read(key, store.SelfTestPass)
        if passed is not None:
            return passed.worst
    worst = tree_self_test(target.model)
    if key is not None and save:
        store.write(key, store.SelfTestPass(worst), "self-test result")
    return worst


def keep_int8_promise(target, probe: Callable[[torch.nn.Module], float] | None = None):
    """Check the ``int8`` backend's promise on this machine: verify rows (tree and block) are
    bit-identical to one-token decoding, so speculative decoding on it is exact. Where the probe
    finds any difference, the ``stock`` fp32 runner of the same model (lossless by the same
    identity tests as every fp32 backend) is used instead, with a one-line warning; returns the
    runner to use.

    Args:
        target: a :class:`~selfspec.models.runner.Runner` (returned as it is unless on int8).
        probe: the check, ``probe(model) -> largest logit difference`` (default: the tree
            self-test with no tolerance; injected in tests).
    """
    if target.backend != "int8":
        return target
    probe = probe or (lambda m: tree_self_test(m, atol=float("inf")))
    worst = probe(target.model)
    if worst == 0.0:
        return target
    if target.base.only is not None:
        raise SelfspecError(f"int8 verify rows are not bit-identical to one-token decoding on this CPU (logits differ "
                            f"by up to {worst:.3g}) and the fp32 weights were released; load the model again without "
                            "releasing them, or use --kernels stock")
    log.warning("int8 verify rows are not bit-identical to one-token decoding on this CPU (logits differ by "
                "up to %.3g): using the stock fp32 kernels instead", worst)
    return target.runner("stock")
