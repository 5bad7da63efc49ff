"""Continuous batching (issue 58, first part): several requests decode in one packed forward per
step, each over its own cache; on a row-invariant backend every request's tokens are exactly those
of its solo run, whatever else is in the batch, joins or leaves.

Prompts of random lengths (one longer than a prefill chunk, so its prompt runs in several blocks
beside the others' steps) and random lengths of output (requests leave the batch at different
steps). The negative control makes the rows depend on how many requests share the forward and must
be caught."""

from __future__ import annotations

import random

import pytest
import torch

import selfspec
from selfspec.errors import SelfspecError
from selfspec.kernels.compact import available as compact_available
from selfspec.kernels.onednn import available as onednn_available
from selfspec.models import batch
from selfspec.models.loading import load_model

from ..conftest import prompt_ids

NO_ONEDNN = onednn_available(torch.device("cpu"), torch.float32)
NO_COMPACT = compact_available(torch.device("cpu"), torch.float32)
KERNELS = [pytest.param("onednn", marks=pytest.mark.skipif(NO_ONEDNN is not None, reason=str(NO_ONEDNN))), "int8",
           pytest.param("compact", marks=pytest.mark.skipif(NO_COMPACT is not None, reason=str(NO_COMPACT)))]


def requests(seed: int, n: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [prompt_ids(100 + seed * 10 + i, rng.choice([3, 9, 17, batch.PREFILL_CHUNK + 11])) for i in range(n)]
    return prompts, [rng.randint(4, 24) for _ in range(n)]


@pytest.fixture(scope="module")
def base(tiny_dir):
    return load_model(str(tiny_dir)).base


@pytest.fixture(scope="module")
def gguf_base(tiny_gguf_dir):
    """The tiny model with GGUF-rounded weights, whose layers the compact kernels read as blocks."""
    return load_model(str(tiny_gguf_dir)).base


def model_for(kernels: str, request):
    """The model a backend's batch test runs: the GGUF-rounded one on compact, else the plain one."""
    return request.getfixturevalue("gguf_base" if kernels == "compact" else "base")


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("method", ["ar", "pld", pytest.param("self-spec", marks=pytest.mark.matrix)])
def test_every_request_in_a_batch_gives_its_solo_ids(kernels, method, request):
    base = model_for(kernels, request)
    opts = dict(skip_attention=(1,), skip_mlp=(0,), k=3, auto_k=False) if method == "self-spec" else {}
    g = selfspec.load(base.runner(kernels), method=method, kernels=kernels, self_test=False, **opts)
    prompts, lengths = requests(1, 4)
    solo = [g.generate(p, max_new_tokens=n, ignore_eos=True).token_ids for p, n in zip(prompts, lengths)]
    for seed in (1, 2):  # two arrival orders and output lengths: who shares which forward changes
        order = list(range(4))
        random.Random(seed).shuffle(order)
        out = g.generate_batch([prompts[i] for i in order], max_new_tokens=max(lengths), ignore_eos=True)
        assert max(g.last_batch_sizes) == 4 and min(g.last_batch_sizes) >= 1  # it did batch
        for j, i in enumerate(order):
            assert out[j].token_ids[:lengths[i]] == solo[i], (method, kernels, i)
            assert out[j].batch_invariant is True
    ended = g.generate_batch(prompts, max_new_tokens=lengths, ignore_eos=True)  # each leaves at its own step
    assert [r.token_ids for r in ended] == solo and len(set(lengths)) > 1


def test_coupled_sampling_in_a_batch_is_the_solo_run(base):
    g = selfspec.load(base.runner("int8"), method="pld", kernels="int8", self_test=False)
    prompts, _ = requests(4, 3)
    solo = [g.generate(p, max_new_tokens=16, temperature=0.9, seed=7 + i, ignore_eos=True).token_ids
            for i, p in enumerate(prompts)]
    out = g.generate_batch(prompts, max_new_tokens=16, temperature=0.9, seed=[7, 8, 9], ignore_eos=True)
    assert [r.token_ids for r in out] == solo


def test_drafts_are_sized_for_the_batch_except_under_rejection_sampling(base, monkeypatch):
    """The controller hands each step's sizer the number of requests in the forward (greedy: the
    draft lengths do not change the text); a rejection-sampled request's text depends on its draft
    lengths, so it is sized as if alone and stays its solo sample."""
    from selfspec.decoding.controller import DraftController

    widths: list[int] = []
    budget = DraftController.budget
    monkeypatch.setattr(DraftController, "budget", lambda self, width=1: widths.append(width) or budget(self, width))
    g = selfspec.load(base.runner("int8"), method="pld", kernels="int8", self_test=False)
    prompts, _ = requests(5, 4)
    g.generate_batch(prompts, max_new_tokens=12, ignore_eos=True)
    assert max(widths) == 4
    kw = dict(max_new_tokens=12, temperature=0.9, sampling="rejection", ignore_eos=True)
    solo = [g.generate(p, seed=3 + i, **kw).token_ids for i, p in enumerate(prompts)]
    widths.clear()
    out = g.generate_batch(prompts, seed=[3, 4, 5, 6], **kw)
    assert max(g.last_batch_sizes) == 4 and set(widths) == {1}
    assert [r.token_ids for r in out] == solo


def test_a_list_streams_as_one_batch(base):
    """``stream([...])`` decodes the prompts as one batch: ``(index, piece)`` pairs, interleaved,
    whose pieces join to each prompt's solo text; closing the iterator early stops the batch."""
    g = selfspec.load(base.runner("int8"), method="pld", kernels="int8", self_test=False)
    prompts, lengths = requests(8, 3)
    solo = [g.generate(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
    texts, order = ["", "", ""], []
    for i, piece in g.stream(prompts, max_new_tokens=lengths, ignore_eos=True):
        texts[i] += piece
        order.append(i)
    assert texts == [r.text for r in solo]
    assert [r.token_ids for r in g.last_results] == [r.token_ids for r in solo]
    assert max(g.last_batch_sizes) == 3 and set(order) == {0, 1, 2} and order != sorted(order)
    it = g.stream(prompts, max_new_tokens=40, ignore_eos=True)
    next(it)
    it.close()  # the batch stops; its threads are joined
    assert g.generate(prompts[0], max_new_tokens=4, ignore_eos=True).new_tokens == 4


def test_a_kernel_whose_rows_depend_on_the_batch_is_caught(base, monkeypatch):
    """Negative control: logits that move with the number of requests in the forward change some
    request's ids, and the identity check above would fail."""
    g = selfspec.load(base.runner("int8"), method="ar", kernels="int8", self_test=False)
    prompts, lengths = requests(5, 4)
    solo = [g.generate(p, max_new_tokens=16, ignore_eos=True).token_ids for p in prompts]
    real = batch.packed_forward

    def not_row_invariant(model, inner, blocks):
        outs = real(model, inner, blocks)
        noise = torch.Generator().manual_seed(len(blocks))
        return [batch.BlockOutput(o.logits + 3.0 * torch.randn(o.logits.shape, generator=noise), o.hidden)
                for o in outs]

    monkeypatch.setattr(batch, "packed_forward", not_row_invariant)
    out = g.generate_batch(prompts, max_new_tokens=16, ignore_eos=True)
    assert [r.token_ids for r in out] != solo


def test_stock_kernels_say_a_batch_may_differ_and_errors_reach_the_caller(base):
    g = selfspec.load(base.runner("stock"), method="ar", kernels="stock", self_test=False)
    prompts, _ = requests(6, 2)
    out = g.generate_batch(prompts, max_new_tokens=6, ignore_eos=True)
    assert all(r.batch_invariant is False for r in out)  # not promised: BLAS rows may depend on the row count
    with pytest.raises(SelfspecError, match="context"):
        g.generate_batch([prompts[0], prompt_ids(9, 600)], max_new_tokens=6)
    assert g.generate([prompts[0]], max_new_tokens=6, ignore_eos=True)[0].new_tokens == 6  # a list: a batch


def test_the_packed_tree_shares_the_runners_weights(base):
    r = base.runner("int8")
    packed = r.packed
    assert packed is r.packed and packed is not r.model
    assert packed.config._attn_implementation == batch.PACKED_NAME
    assert r.model.config._attn_implementation != batch.PACKED_NAME  # the runner's own tree is unchanged
    assert all(a is b for a, b in zip(packed.parameters(), r.model.parameters()))


def test_an_attention_without_packed_masks_decodes_one_at_a_time(tiny_dir):
    eager = load_model(str(tiny_dir), attn_implementation="eager")
    g = selfspec.load(eager, method="ar", kernels="stock", self_test=False)
    assert not g.batchable()
    prompts, _ = requests(7, 2)
    out = g.generate_batch(prompts, max_new_tokens=5, ignore_eos=True)
    assert [r.token_ids for r in out] == [g.generate(p, max_new_tokens=5, ignore_eos=True).token_ids for p in prompts]
    assert batch.packable("sdpa") and not batch.packable("eager") and not batch.packable("flash_attention_2")


def test_a_stopped_batch_answers_every_waiting_request(base):
    b = batch.Batcher(base.runner("int8"), max_batch=2)
    b.join()
    b.abort(KeyboardInterrupt())
    cache = batch.kv_cache.new_cache(base.model.config)
    with pytest.raises(SelfspecError, match="stopped"):
        b.slot().forward(cache, torch.tensor([5]), torch.tensor([0]), None, False, 0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_requests_logits_in_a_packed_forward_are_its_solo_logits_bit_for_bit(kernels, request):
    """The promise below the ids: on a row-invariant backend, each request's logits in a packed
    forward equal those of the same block run alone (``forward_block`` on its own cache), bit for
    bit, for one-token blocks (which attend with no mask, as a solo step does: with an all-True mask
    SDPA gave SmolLM2 logits up to 4e-5 apart), causal blocks and a tree block, whatever shares the
    forward."""
    from selfspec.core import kv_cache
    from selfspec.models.adapter import forward_block

    runner = model_for(kernels, request).runner(kernels)
    packed, inner = runner.packed, runner.model.config._attn_implementation
    prompts = [prompt_ids(300 + i, n) for i, n in enumerate((5, 13, 29))]
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # a root and two children
    blocks = [(prompt_ids(400, 1), None), (prompt_ids(401, 4), None), (prompt_ids(402, 3), tree)]
    for shift in range(3):  # each request beside other block kinds
        packed_caches, solo = [], []
        for p, (ids, mask) in zip(prompts, blocks[shift:] + blocks[:shift]):
            ids_t, p_t = torch.tensor(ids), torch.tensor(p)
            depth = torch.tensor([0, 1, 1]) if mask is not None else torch.arange(len(ids))
            c = kv_cache.new_cache(runner.model.config)
            forward_block(runner.model, c, p_t, torch.arange(len(p)), None)
            solo.append(forward_block(runner.model, c, ids_t, len(p) + depth, mask).logits)
            c2 = kv_cache.new_cache(runner.model.config)
            batch.packed_forward(packed, inner, [batch.Block(c2, p_t, torch.arange(len(p)), None, 0, [])])
            packed_caches.append(batch.Block(c2, ids_t, len(p) + depth, mask, len(p), None))
        out = batch.packed_forward(packed, inner, packed_caches)
        for o, s in zip(out, solo):
            assert torch.equal(o.logits, s), (kernels, shift, float((o.logits - s).abs().max()))


@pytest.mark.skipif(NO_COMPACT is not None, reason=str(NO_COMPACT))
def test_one_token_rows_on_compact_attend_in_one_call_and_are_their_solo_logits(gguf_base, monkeypatch):
    """A packed forward of one-token steps only (a batch of plain decoding) attends through one
    kernel call per layer on compact, and each request's logits are still its solo ones, bit for bit."""
    from selfspec.core import kv_cache
    from selfspec.kernels import token_attention
    from selfspec.models.adapter import forward_block

    runner = gguf_base.runner("compact")
    packed, inner = runner.packed, runner.model.config._attn_implementation
    calls = []
    real = token_attention.rows_attention
    monkeypatch.setattr(token_attention, "rows_attention", lambda q, *a: (calls.append(q.shape[2]), real(q, *a))[1])
    prompts = [prompt_ids(500 + i, n) for i, n in enumerate((4, 11, 23, 2))]
    blocks, solo = [], []
    for i, p in enumerate(prompts):
        p_t, ids_t, pos = torch.tensor(p), torch.tensor(prompt_ids(600 + i, 1)), torch.tensor([len(p)])
        c = kv_cache.new_cache(runner.model.config)
        forward_block(runner.model, c, p_t, torch.arange(len(p)), None)
        solo.append(forward_block(runner.model, c, ids_t, pos, None).logits)
        c2 = kv_cache.new_cache(runner.model.config)
        batch.packed_forward(packed, inner, [batch.Block(c2, p_t, torch.arange(len(p)), None, 0, [])])
        blocks.append(batch.Block(c2, ids_t, pos, None, len(p), None))
    calls.clear()
    out = batch.packed_forward(packed, inner, blocks)
    assert calls == [len(prompts)] * runner.model.config.num_hidden_layers
    for o, s in zip(out, solo):
        assert torch.equal(o.logits, s), float((o.logits - s).abs().max())


def test_the_driving_thread_runs_every_forward_on_the_batchers_threads(base):
    """``torch.set_num_threads(1)`` in a request thread also sets the count that a thread takes at its
    first parallel op: a driving thread that had run none yet (``selfspec serve``'s decode thread)
    then decoded on one core. The batcher sets its own count (the creating thread's) before each
    forward, and leaves that count for the threads started after."""
    import threading

    from selfspec.core import kv_cache
    from selfspec.models.batch_run import request_thread

    before = torch.get_num_threads()
    torch.set_num_threads(3)  # not what a fresh thread would take on its own, on any machine here
    try:
        b = batch.Batcher(base.runner("int8"), max_batch=1)
    finally:
        torch.set_num_threads(before)
    seen: list[int] = []
    hook = b._model.register_forward_hook(lambda *_: seen.append(torch.get_num_threads()))

    def request() -> None:
        request_thread()
        try:
            b.slot().forward(kv_cache.new_cache(base.model.config), torch.tensor([5]), torch.tensor([0]), None,
                             False, 0)
        finally:
            b.leave()

    def drive() -> None:  # a thread that has run no parallel op before its first forward
        b.join()
        r = threading.Thread(target=request)
        r.start()
        b.drive()
        r.join()

    try:
        t = threading.Thread(target=drive)
        t.start()
        t.join()
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
    finally:
        hook.remove()
        torch.set_num_threads(before)
    assert seen == [3] and later == [3]
