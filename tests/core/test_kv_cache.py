"""KV commit of an accepted tree path equals recomputing the cache from scratch; a tree forward
with the 4-D mask equals the sequential forward of every path."""

import pytest
import torch

from selfspec.core import kv_cache
from selfspec.core.tree import DraftTree
from selfspec.models.adapter import forward_block
from selfspec.models.selftest import tree_self_test

from ..conftest import tiny_model


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param)


TREE = DraftTree(torch.tensor([11, 12, 13, 14, 15, 16, 17]), torch.tensor([-1, 0, 0, 1, 2, 2, 5]))


@torch.inference_mode()
@pytest.mark.parametrize("path", TREE.paths + [[0, 2], [0]])
def test_commit_equals_recompute(model, path):
    prefix = torch.arange(20, 29)
    base = len(prefix)
    cache = kv_cache.new_cache(model.config)
    forward_block(model, cache, prefix, torch.arange(base), None)
    forward_block(model, cache, TREE.tokens, TREE.depths + base, TREE.ancestor_mask)
    kv_cache.commit(cache, base, path)
    ref = kv_cache.new_cache(model.config)
    forward_block(model, ref, torch.cat([prefix, TREE.tokens[path]]), torch.arange(base + len(path)), None)
    assert kv_cache.cache_length(cache) == base + len(path)
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a.values, b.values, atol=1e-5, rtol=1e-5)
    # and the next step sees the same thing
    nxt = torch.tensor([5])
    pos = torch.tensor([base + len(path)])
    torch.testing.assert_close(forward_block(model, cache, nxt, pos, None).logits,
                               forward_block(model, ref, nxt, pos, None).logits, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_tree_forward_equals_sequential_per_path(model):
    assert tree_self_test(model) < 1e-4
    prefix = torch.arange(30, 37)
    cache = kv_cache.new_cache(model.config)
    forward_block(model, cache, prefix, torch.arange(7), None)
    out = forward_block(model, cache, TREE.tokens, TREE.depths + 7, TREE.ancestor_mask)
    for path in TREE.paths:
        kv_cache.truncate(cache, 7)
        ref = forward_block(model, cache, TREE.tokens[path], torch.arange(len(path)) + 7, None)
        torch.testing.assert_close(out.logits[path], ref.logits, atol=1e-4, rtol=1e-4)


def test_eager_attention_uses_additive_mask():
    model = tiny_model("llama")
    model.config._attn_implementation = "eager"
    assert tree_self_test(model) < 1e-4


def test_self_test_catches_ignored_mask(monkeypatch):
    """If the 4-D mask were dropped, the self-test must refuse the model."""
    import selfspec.models.adapter as adapter

    monkeypatch.setattr(adapter, "build_mask", lambda base, block, impl, dtype, device, *a: None)
    from selfspec.errors import SelfspecError

    with pytest.raises(SelfspecError, match="self-test"):
        tree_self_test(tiny_model("llama"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_self_test_passes_and_catches_ignored_mask(dtype, monkeypatch):
    """bf16/fp16: tree and sequential forwards round differently, so the self-test compares
    decisions and the logits' relative difference, not an fp32 tolerance; a dropped mask still
    fails it."""
    from selfspec.errors import SelfspecError

    model = tiny_model("llama").to(dtype)
    tree_self_test(model)  # healthy: passes
    import selfspec.models.adapter as adapter

    monkeypatch.setattr(adapter, "build_mask", lambda base, block, impl, dtype, device, *a: None)
    with pytest.raises(SelfspecError, match="ignores the 4-D tree mask"):
        tree_self_test(model)


def test_static_cache_length_resets_outside_inference_mode(model):
    """On CUDA, transformers moves a static layer's counter to the device inside the first step
    (inference mode), which makes it an inference tensor; a reused cache's reset runs outside
    inference mode (a request's set-up) and must still set it. On the CPU the move is a no-op,
    so the test makes the counters inference tensors the way the device does."""
    cache = kv_cache.new_cache(model.config, 64)
    with torch.inference_mode():
        forward_block(model, cache, torch.arange(20, 29), torch.arange(9), None)
        for layer in cache.layers:
            layer.cumulative_length = layer.cumulative_length.clone()
    assert all(layer.cumulative_length.is_inference() for layer in cache.layers)
    kv_cache.truncate(cache, 5)
    assert kv_cache.cache_length(cache) == 5
    kv_cache.set_length(cache, 0)
    assert kv_cache.cache_length(cache) == 0
