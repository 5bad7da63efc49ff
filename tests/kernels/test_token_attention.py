"""The compact backend's one-token attention kernel (``kernels/token_attention.py``): SDPA's result
within rounding, and each request's output the same bit for bit alone, in any batch, on any number
of threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfspec.kernels.compact import available, load_ops
from selfspec.kernels.token_attention import compact_attention_forward, kernel_runs, packed_rows, rows_attention

NO_COMPACT = available(torch.device("cpu"), torch.float32)
pytestmark = pytest.mark.skipif(NO_COMPACT is not None, reason=str(NO_COMPACT))


def kv(lengths: list[int], hkv: int, d: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(1, hkv, n, d, generator=g) for n in lengths],
            [torch.randn(1, hkv, n, d, generator=g) for n in lengths])


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 8), (6, 2, 72), (2, 1, 136)])
def test_the_kernel_is_sdpa_within_rounding(hq, hkv, d):
    load_ops()
    lengths = [1, 7, 8, 9, 64, 301]  # one position, the 8-key groups' edges, a long cache
    keys, values = kv(lengths, hkv, d, 0)
    q = torch.randn(1, hq, len(lengths), d, generator=torch.Generator().manual_seed(1)) * 2
    out = rows_attention(q, keys, values, None)
    assert out.shape == (1, len(lengths), hq, d)
    for r, (k, v) in enumerate(zip(keys, values)):
        ref = F.scaled_dot_product_attention(q[:, :, r:r + 1], k, v, enable_gqa=hq != hkv)
        torch.testing.assert_close(out[:, r:r + 1], ref.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_a_requests_row_is_the_same_alone_in_any_batch_and_on_any_threads():
    """The invariance batching relies on (its negative control is in tests/models/test_batch.py)."""
    load_ops()
    lengths = [5, 33, 120, 1, 64, 17, 250, 9]
    keys, values = kv(lengths, 3, 64, 2)
    q = torch.randn(1, 9, len(lengths), 64, generator=torch.Generator().manual_seed(3))
    threads = torch.get_num_threads()
    try:
        alone = [rows_attention(q[:, :, r:r + 1], keys[r:r + 1], values[r:r + 1], 0.125) for r in range(len(lengths))]
        for n in (1, 2):
            torch.set_num_threads(n)
            together = rows_attention(q, keys, values, 0.125)
            assert all(torch.equal(together[:, r:r + 1], alone[r]) for r in range(len(lengths)))
            order = [6, 0, 3]
            some = rows_attention(q[:, :, order], [keys[i] for i in order], [values[i] for i in order], 0.125)
            assert all(torch.equal(some[:, j:j + 1], alone[i]) for j, i in enumerate(order))
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_reads_a_cache_through_its_strides():
    """A cache that is a view (e.g. a static cache's written positions) is read in place."""
    load_ops()
    (big_k,), (big_v,) = kv([40], 2, 16, 4)
    q = torch.randn(1, 4, 1, 16)
    view = rows_attention(q, [big_k[:, :, :23]], [big_v[:, :, :23]], None)
    copy = rows_attention(q, [big_k[:, :, :23].contiguous()], [big_v[:, :, :23].contiguous()], None)
    assert not big_k[:, :, :23].is_contiguous() and torch.equal(view, copy)


def test_other_blocks_take_the_shared_heads_path():
    """The kernel runs only for a one-token row that sees every position: a mask, a sliding window,
    a soft cap, attention sinks, another dtype or a head size not a multiple of 8 go to SDPA."""
    load_ops()
    q = torch.randn(1, 4, 1, 16)
    assert kernel_runs(q, None, {})
    assert not kernel_runs(q, torch.ones(1, 1, 1, 5, dtype=torch.bool), {})
    for key in ("sliding_window", "softcap", "s_aux"):
        assert not kernel_runs(q, None, {key: 4})
    assert not kernel_runs(q.double(), None, {}) and not kernel_runs(torch.randn(1, 4, 1, 12), None, {})
    k, v = kv([6], 2, 16, 5)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = compact_attention_forward(module, q, k[0], v[0], None, scaling=0.25)
    assert torch.equal(out, rows_attention(q, k, v, 0.25))
    block = torch.randn(1, 4, 3, 16)  # a verify block: SDPA with shared heads
    out, _ = compact_attention_forward(module, block, k[0], v[0], None, scaling=0.25)
    causal = torch.ones(3, 6, dtype=torch.bool).tril(3)[None, None]
    ref = F.scaled_dot_product_attention(block, k[0], v[0], attn_mask=causal, scale=0.25, enable_gqa=True)
    torch.testing.assert_close(out, ref.transpose(1, 2))


def test_a_packed_forward_uses_one_call_only_when_every_request_brings_one_unmasked_row():
    load_ops()
    keys, values = kv([3, 5], 2, 16, 6)
    q = torch.randn(1, 4, 2, 16)
    name = "selfspec_compact_sdpa"
    assert packed_rows(name, q, keys, values, [(0, 1), (1, 2)], [None, None], {}) is not None
    assert packed_rows("sdpa", q, keys, values, [(0, 1), (1, 2)], [None, None], {}) is None
    assert packed_rows(name, q, keys, values, [(0, 2)], [None], {}) is None  # a two-row block
    mask = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    assert packed_rows(name, q, keys, values, [(0, 1), (1, 2)], [mask, None], {}) is None


def test_bad_shapes_are_refused_by_the_kernel():
    load_ops()
    op = torch.ops.selfspec_compact.decode_attention
    k, v = kv([4], 2, 12, 7)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        op(torch.randn(1, 4, 12), k, v, 1.0)
    k, v = kv([4], 2, 16, 7)
    with pytest.raises(RuntimeError, match="one key and one value tensor per query row"):
        op(torch.randn(2, 4, 16), k, v, 1.0)
    with pytest.raises(RuntimeError, match="at least one position"):
        op(torch.randn(1, 4, 16), [k[0][:, :, :0]], [v[0][:, :, :0]], 1.0)
