"""The ``compiled`` backend's static-shape step: buckets, the padded mask, the static cache's
rollback (commit of a tree branch equals recomputing), and end to end under ``torch.compile``:
``ar`` on it equals ``transformers`` ``generate``, and drafts right for exactly j tokens give
``ar``'s ids on the same backend. The backend's column of the full method matrix is in
``tests/decoding/test_greedy_equivalence.py`` (``matrix`` tier)."""

from __future__ import annotations

import os

import pytest
import torch

import selfspec
from selfspec.core import kv_cache
from selfspec.core.tree import DraftTree
from selfspec.drafters.scripted import ScriptedDrafter
from selfspec.errors import SelfspecError
from selfspec.kernels.compact import available as compact_available
from selfspec.models import compiled_step
from selfspec.models.adapter import forward_block
from selfspec.models.compiled_step import StaticStep, bucket, capacity_for, padded_mask
from selfspec.models.loading import load_model

from ..conftest import COMPILED_OFFERED, SAVED_ROUTE_ONLY, VOCAB, prompt_ids, save_tiny, tiny_model

compact_unavailable = compact_available(torch.device("cpu"), torch.float32)

TREE = DraftTree(torch.tensor([11, 12, 13, 14, 15, 16, 17]), torch.tensor([-1, 0, 0, 1, 2, 2, 5]))


def test_buckets_and_capacity():
    assert [bucket(t) for t in (1, 2, 3, 5, 8, 9, 100, 128, 129, 300)] == [1, 2, 4, 8, 8, 16, 128, 128, 256, 384]
    with pytest.raises(ValueError):
        bucket(0)
    low = compiled_step.MIN_CAPACITY
    assert capacity_for(10) == low
    assert capacity_for(low - compiled_step.HEADROOM) == low
    assert capacity_for(low - compiled_step.HEADROOM + 1) == 2 * low


def test_padded_mask_rows():
    block = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    m = padded_mask(5, block, 3, 4, 16, "sdpa", torch.float32, torch.device("cpu"))[0, 0]
    assert m.shape == (4, 16)
    assert m[:, :5].all()  # everyone sees the prefix
    assert torch.equal(m[:3, 5:8], block)
    assert not m[:3, 8:].any()
    assert m[3, 8] and m[3, 5:].sum() == 1  # the padded row sees itself only
    causal = padded_mask(0, None, 2, 2, 4, "eager", torch.float32, torch.device("cpu"))[0, 0]
    assert causal[0, 1] == torch.finfo(torch.float32).min and causal[1, 1] == 0 and causal[1, 0] == 0


@pytest.fixture(params=["llama", "qwen2"])
def model(request):
    return tiny_model(request.param)


@torch.inference_mode()
@pytest.mark.parametrize("path", TREE.paths + [[0, 2], [0]])
def test_static_commit_equals_recompute(model, path):
    """A tree through the padded static step (7 nodes -> 8 rows), the branch committed by moving
    rows down in the static cache: the next step's logits equal a cache recomputed from scratch."""
    step = StaticStep(model, compile=False)
    prefix = torch.arange(20, 29)
    base = len(prefix)
    cache = kv_cache.new_cache(model.config, capacity=64)
    assert kv_cache.is_static(cache) and kv_cache.capacity(cache) == 64
    step.forward(cache, prefix, torch.arange(base), None, False)
    out = step.forward(cache, TREE.tokens, TREE.depths + base, TREE.ancestor_mask, False)
    assert out.logits.shape[0] == TREE.size and kv_cache.cache_length(cache) == base + TREE.size
    kv_cache.commit(cache, base, path)
    assert kv_cache.cache_length(cache) == base + len(path)
    ref = kv_cache.new_cache(model.config)
    forward_block(model, ref, torch.cat([prefix, TREE.tokens[path]]), torch.arange(base + len(path)), None)
    nxt, pos = torch.tensor([5]), torch.tensor([base + len(path)])
    torch.testing.assert_close(step.forward(cache, nxt, pos, None, False).logits,
                               forward_block(model, ref, nxt, pos, None).logits, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_padding_leaves_real_rows_and_hidden_states(model):
    """3 tokens padded to 4 give the unpadded dynamic forward's logits and hidden states."""
    step = StaticStep(model, compile=False)
    prefix, block = torch.arange(30, 40), torch.tensor([7, 8, 9])
    static, dynamic = kv_cache.new_cache(model.config, capacity=32), kv_cache.new_cache(model.config)
    for cache, fwd in ((static, step.forward), (dynamic, lambda *a: forward_block(model, *a))):
        fwd(cache, prefix, torch.arange(10), None, False)
    a = step.forward(static, block, torch.arange(10, 13), None, True)
    b = forward_block(model, dynamic, block, torch.arange(10, 13), None, True)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    assert len(a.hidden) == len(b.hidden)
    for x, y in zip(a.hidden, b.hidden):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_the_prompt_runs_through_the_step_in_blocks(model, monkeypatch):
    """A 150-token prompt runs as blocks of 64, 64 and 22 (padded to 32) through the step, on a new
    cache after one eager token that allocates its layers: its last logits, every layer's hidden
    states and the cache it leaves equal one eager forward of the whole prompt. Negative control:
    one token changed in the first block changes the last logits (later blocks read it)."""
    step = StaticStep(model, compile=False)
    prompt = torch.arange(150) % VOCAB
    blocks: list[int] = []
    real = step.forward
    monkeypatch.setattr(step, "forward", lambda cache, ids, *a, **kw: blocks.append(ids.numel()) or real(
        cache, ids, *a, **kw))
    cache, ref = (kv_cache.new_cache(model.config, capacity=256) for _ in range(2))
    assert not kv_cache.initialised(cache)
    out = step.prefill(cache, prompt, True)
    assert blocks == [64, 64, 22] and kv_cache.initialised(cache) and kv_cache.cache_length(cache) == 150
    eager = step._eager_prefill(ref, prompt, True)
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-5, rtol=1e-5)
    assert out.logits.shape == (1, VOCAB) and len(out.hidden) == len(eager.hidden)
    for x, y in zip(out.hidden, eager.hidden):
        assert x.shape == (150, model.config.hidden_size)
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys[..., :150, :], b.keys[..., :150, :], atol=1e-5, rtol=1e-5)
    changed = prompt.clone()
    changed[3] = (changed[3] + 1) % VOCAB
    other = step.prefill(kv_cache.new_cache(model.config, capacity=256), changed, False)
    assert not torch.allclose(other.logits, out.logits, atol=1e-3)


def test_overflowing_block_is_refused():
    model = tiny_model("llama")
    cache = kv_cache.new_cache(model.config, capacity=8)
    with torch.inference_mode(), pytest.raises(SelfspecError, match="overflows.*--kernels stock"):
        StaticStep(model, compile=False).forward(cache, torch.arange(4, 13), torch.arange(9), None, False)


def test_compile_cache_dir(monkeypatch, tmp_path):
    """Under SELFSPEC_HOME unless the user named a directory; torch's own default does not count."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    assert compiled_step.compile_cache_dir() == str(tmp_path / "home" / "compile")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert compiled_step.compile_cache_dir() == str(tmp_path / "mine")
    with compiled_step.inductor_cache(str(tmp_path / "x")):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "x")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_the_test_processes_share_one_compile_cache():
    """Every test process (pytest-xdist workers, CI's commands) keeps compiled steps in the one directory
    the conftest names, not under its own SELFSPEC_HOME: otherwise each recompiles every graph (the
    conftest once set the directory after importing selfspec, which had already filled it)."""
    from ..conftest import INDUCTOR_CACHE

    assert compiled_step.compile_cache_dir() == INDUCTOR_CACHE, (
        "the tests' compiled steps go to a per-process directory: set TORCHINDUCTOR_CACHE_DIR before importing "
        "selfspec (tests/conftest.py)")


# End to end under torch.compile: one loaded model for the module, so its graphs are compiled once.
MAX_NEW, K = 23, 4
PROMPTS = [prompt_ids(s, n) for s, n in [(1, 5), (3, 40)]]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A one-layer Llama on the compiled backend: compile time grows with the layers traced, and
    the default tier compiles two block sizes (the matrix tier runs the 3-layer models)."""
    path = save_tiny(tmp_path_factory.mktemp("tiny-llama-1layer"), "llama", 0, layers=1)
    t = load_model(str(path), kernels="compiled")
    assert t.backend == "compiled" and t.step is not None and t.step.compile
    return t


@pytest.fixture(scope="module")
def ar_ids(compiled):
    g = selfspec.load(compiled, method="ar", self_test=False)
    return [g.generate(p, max_new_tokens=MAX_NEW, chat=False).token_ids for p in PROMPTS]


@COMPILED_OFFERED
def test_ar_on_compiled_matches_generate(compiled, ar_ids):
    for p, ids in zip(PROMPTS, ar_ids):
        out = compiled.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                      do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
        assert ids == out[0, len(p):].tolist()
    assert (1, capacity_for(len(PROMPTS[0]) + MAX_NEW), False) in compiled.step.compiled


# chains (8-token blocks) here; trees (16-token blocks: another compile) in the matrix tier
@COMPILED_OFFERED
@pytest.mark.parametrize("tree", [False, pytest.param(True, marks=pytest.mark.matrix)], ids=["chain", "tree"])
@pytest.mark.parametrize("j", [0, 2, K])
def test_drafts_right_for_exactly_j_on_compiled(compiled, ar_ids, j, tree):
    g = selfspec.load(compiled, method="ar", self_test=False)
    for p, ref in zip(PROMPTS, ar_ids):
        g.drafter = ScriptedDrafter(ref, K, j, VOCAB, tree=tree)
        r = g.generate(p, max_new_tokens=MAX_NEW, chat=False)
        assert r.token_ids == ref
        assert r.kernels == "compiled"
        if ref[-1] != 2 and len(ref) == MAX_NEW:  # no early EOS: accepted counts are exact
            assert all(c == j + 1 for c in r.committed_per_step[1:-1]), r.committed_per_step


@COMPILED_OFFERED
@torch.inference_mode()
def test_steps_read_only_the_written_cache_positions(compiled, monkeypatch):
    """On the compiled backend a step attends over the positions written so far, not the whole
    capacity: NaNs in the static cache past a padded block leave its logits finite and equal to a
    clean cache's. Negative control: attending over the whole capacity reads them."""
    model = compiled.model
    step = StaticStep(model, compile=False)  # the same forward and keywords, eagerly
    prefix, block = torch.arange(20, 30), torch.tensor([7, 8, 9])  # 3 tokens, padded to 4

    def run(poison: bool):
        cache = kv_cache.new_cache(model.config, capacity=64)
        step.prefill(cache, prefix, False)
        if poison:
            for layer in cache.layers:
                layer.keys[..., len(prefix) + 4:, :] = float("nan")
                layer.values[..., len(prefix) + 4:, :] = float("nan")
        return step.forward(cache, block, torch.arange(10, 13), None, False).logits

    clean, poisoned = run(False), run(True)
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(compiled_step, "window_arg", lambda model, written: {})
    assert torch.isnan(run(True)).any()


@COMPILED_OFFERED
@SAVED_ROUTE_ONLY
def test_decoding_after_the_load_time_compile_compiles_nothing(tmp_path):
    """The one-token step compiled at load is the graph decoding runs: the warm-up runs under
    inference mode like the decode loop (grad mode is in Dynamo's guards; compiled outside it,
    the first request traced and compiled the step again). The saved route's premise: it stops
    ``aot_step.compile_step``; on the public route (``torch.compile`` and its caches) a 7-token
    prompt's 8-token block is traced at the first request (seen 2026-11-29, also at 5d289c7)."""
    path = save_tiny(tmp_path / "m", "llama", 0, layers=1)
    g = selfspec.load(str(path), method="ar", kernels="compiled", self_test=False)
    assert (1, capacity_for(40), False) in g.target.step.compiled
    from selfspec.models import aot_step

    with torch._dynamo.config.patch(error_on_recompile=True), pytest.MonkeyPatch.context() as m:
        m.setattr(aot_step, "compile_step", no_compiling)  # CPU: steps compiled ahead of time
        r = g.generate(prompt_ids(5, 7), max_new_tokens=6, chat=False)
    assert r.new_tokens == 6


@pytest.mark.matrix  # a second process (16 s here): CI's second command
def test_a_second_process_loads_the_saved_step_without_tracing(compiled, ar_ids, tmp_path, monkeypatch):
    """On CPU each shape's step is compiled ahead of time and saved; a new step (as in a second
    process) loads it from the cache directory and traces nothing, with ids unchanged. A file
    that does not load is compiled again."""
    from torch._dynamo.utils import counters

    from selfspec.models import aot_step

    if not aot_step.supported(torch.device("cpu")):
        pytest.skip("this PyTorch has no aot_compile")
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    g = selfspec.load(compiled, method="ar", self_test=False)
    first = StaticStep(compiled.model)
    compiled._step = first
    assert g.generate(PROMPTS[0], max_new_tokens=MAX_NEW, chat=False).token_ids == ar_ids[0]
    saved = sorted((tmp_path / "home" / "compile" / "aot").glob("step-1x*.bin"))
    assert len(saved) == 1
    compiled._step = StaticStep(compiled.model)
    traced = counters["frames"]["total"]
    with monkeypatch.context() as m:
        m.setattr(aot_step, "compile_step", no_compiling)
        assert g.generate(PROMPTS[0], max_new_tokens=MAX_NEW, chat=False).token_ids == ar_ids[0]
    assert counters["frames"]["total"] == traced  # loaded, not traced
    saved[0].write_bytes(b"not a saved step")
    compiled._step = StaticStep(compiled.model)
    assert g.generate(PROMPTS[0], max_new_tokens=MAX_NEW, chat=False).token_ids == ar_ids[0]
    assert saved[0].stat().st_size > 1000  # compiled again and replaced


@COMPILED_OFFERED
def test_a_model_of_the_same_architecture_loads_the_saved_steps(compiled, ar_ids, tmp_path, monkeypatch):
    """A saved step takes the weights as inputs, so another model of the same architecture (a
    fine-tune, a copy in another directory) loads the steps saved for the first instead of compiling
    its own, and decodes with its own weights: ``generate``'s ids on it, not the first model's."""
    from selfspec.models import aot_step

    if not aot_step.supported(torch.device("cpu")):
        pytest.skip("this PyTorch has no aot_compile")
    from torch._dynamo.utils import counters

    other = save_tiny(tmp_path / "fine-tune", "llama", 5, layers=1)
    traced = counters["frames"]["total"]
    with monkeypatch.context() as m:
        m.setattr(aot_step, "compile_step", no_compiling)  # (a failed compile falls back to torch.compile)
        t = load_model(str(other), kernels="compiled")
        g = selfspec.load(t, method="ar", self_test=False)
        got = [g.generate(p, max_new_tokens=MAX_NEW, chat=False).token_ids for p in PROMPTS]
    assert counters["frames"]["total"] == traced  # loaded, not traced
    for p, ids in zip(PROMPTS, got):
        out = t.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
        assert ids == out[0, len(p):].tolist()
    assert got != ar_ids  # its own weights decoded, not the first model's


def test_module_references_of_every_saved_step_are_found():
    """The references a step saved as a process's second or later compile needs (counted ``_c1``,
    ``_c2``, ...: seen on SmolLM2's hidden-states steps) are found, not only a first step's ``_c0``."""
    from selfspec.models import aot_step

    message = ("Missing required external references: ['___module_collections_140176445960528_c1', "
               "'___module_torch_nn_functional_7_c0']. Please load AOT compiled function with `f_globals=...`")
    assert aot_step.module_refs(message) == [("___module_collections_140176445960528_c1", "collections"),
                                             ("___module_torch_nn_functional_7_c0", "torch_nn_functional")]


def test_vector_isa_probe_is_skipped_only_where_it_passed_before(tmp_path):
    """Inductor probes the CPU's vector instruction sets once per process (a child Python per
    set). A step's load records what the probe found; a later load trusts the record only where
    every set the CPU's flags list passed, on this machine and torch version."""
    import json

    from torch._inductor import config

    from selfspec.core.machine import machine_id
    from selfspec.models import aot_step

    candidates = aot_step._isa_candidates()
    if candidates is None:
        pytest.skip("not an x86 CPU: Inductor's probe is left as it is")
    record = tmp_path / aot_step.ISA_RECORD
    with aot_step._probed_isa(tmp_path):
        assert config.cpp.vec_isa_ok is None  # nothing recorded: the probe runs
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    assert json.loads(record.read_text()) == {machine_id(): [str(i) for i in valid_vec_isa_list()]}
    record.write_text(json.dumps({machine_id(): candidates}))
    with aot_step._probed_isa(tmp_path):
        assert config.cpp.vec_isa_ok is True
    assert config.cpp.vec_isa_ok is None  # for the load only
    for other in ({machine_id(): candidates + ["a set the probe failed"]}, {"another machine": candidates}):
        record.write_text(json.dumps(other))
        with aot_step._probed_isa(tmp_path):
            assert config.cpp.vec_isa_ok is None
    record.write_text("not json")
    with aot_step._probed_isa(tmp_path):
        assert config.cpp.vec_isa_ok is None


@pytest.mark.matrix  # compiles three steps
def test_every_step_a_process_saved_loads_in_the_next(tmp_path, monkeypatch):
    """A process that compiles several steps names a module their graphs refer to with a count
    (``___module_collections_<id>_c1`` in its second hidden-states step): every step it saved loads
    in a new process all the same (once, only the first did, and the rest compiled again)."""
    from selfspec.models import aot_step

    if not aot_step.supported(torch.device("cpu")):
        pytest.skip("this PyTorch has no aot_compile")
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    t = load_model(str(save_tiny(tmp_path / "m", "llama", 0, layers=1)), kernels="compiled")
    assert t.step.missing(512, (1, 2, 4), True) == [(1, 512, True), (2, 512, True), (4, 512, True)]
    t.step.warm_up(512, (1, 2, 4), True)
    fresh = StaticStep(t.model)  # as in the next process
    assert fresh.missing(512, (1, 2, 4), True) == []
    with monkeypatch.context() as m:
        m.setattr(aot_step, "compile_step", no_compiling)
        fresh.warm_up(512, (1, 2, 4), True)
    assert fresh.compiled == {(1, 512, True), (2, 512, True), (4, 512, True)}


def test_saved_steps_are_kept_per_linear_layer_kind(tiny_dir, tmp_path):
    """A step saved for one kind of linear layer (the graph calls oneDNN's operator, or the stock
    matrix product) is never loaded for a model on another: the file name differs."""
    from selfspec.models import aot_step

    t = load_model(str(tiny_dir), kernels="compiled")
    on_onednn = aot_step.artifact_path(str(tmp_path), t.model, (1, 512, False))
    assert aot_step.artifact_path(str(tmp_path), t.runner("stock").model, (1, 512, False)) != on_onednn


def test_saved_steps_are_kept_per_torch_install(tiny_dir, tmp_path, monkeypatch):
    """Inductor's build key for a step's C++ kernels names the torch install's headers, so a step
    saved from another virtual environment would rebuild them all on load (minutes, inside auto's
    calibration, which never compiles): another install's steps are not this one's."""
    from selfspec.models import aot_step

    t = load_model(str(tiny_dir), kernels="compiled")
    here = aot_step.artifact_path(str(tmp_path), t.model, (1, 512, False))
    monkeypatch.setattr(torch, "__file__", "/another/venv/site-packages/torch/__init__.py")
    assert aot_step.artifact_path(str(tmp_path), t.model, (1, 512, False)) != here


@COMPILED_OFFERED
@torch.inference_mode()
def test_saved_steps_are_named_by_whether_they_use_the_layout(tiny_dir, tmp_path):
    from selfspec.kernels.swap import linear_layers
    from selfspec.models import aot_step

    t = load_model(str(tiny_dir), kernels="compiled")
    with_layout = aot_step.artifact_path(str(tmp_path), t.model, (1, 512, False))
    for _, _, m in linear_layers(t.model):
        m.blocked = None
    assert aot_step.artifact_path(str(tmp_path), t.model, (1, 512, False)) != with_layout


def no_compiling(*args, **kwargs):
    raise AssertionError("compiled a step that should have been loaded")


@COMPILED_OFFERED
def test_requests_reuse_static_caches_and_interleaved_ones_hold_their_own(compiled, ar_ids):
    """A finished request's static cache serves the next one (fixed addresses: CUDA graphs captured
    on it replay); two requests in flight together hold two caches and both give ``ar``'s ids."""
    from itertools import zip_longest

    g = selfspec.load(compiled, method="ar", self_test=False)
    h = selfspec.load(compiled, method="ar", self_test=False)
    a = g.steps(PROMPTS[1], chat=False, max_new_tokens=MAX_NEW)
    b = h.steps(PROMPTS[0], chat=False, max_new_tokens=MAX_NEW)
    caches = []
    for x, y in zip_longest(a, b):
        caches += [item[0].cache for item in (x, y) if item is not None]
    assert len({id(c) for c in caches}) == 2
    assert g.last_result.token_ids == ar_ids[1] and h.last_result.token_ids == ar_ids[0]
    state, _ = next(iter(g.steps(PROMPTS[0], chat=False, max_new_tokens=MAX_NEW)))  # cancelled after its prefill
    assert any(state.cache is c for c in caches)
    assert g.generate(PROMPTS[0], max_new_tokens=MAX_NEW, chat=False).token_ids == ar_ids[0]


@COMPILED_OFFERED
def test_load_time_self_test_passes_on_the_compiled_backend(tiny_dir):
    """The backend's attention (KV heads shared over the static cache) also serves the eager
    forwards on growing caches (the tree self-test, cost profiles), causal when given no mask."""
    from selfspec.models.selftest import tree_self_test

    t = load_model(str(tiny_dir), kernels="compiled")
    assert t.model.config._attn_implementation == "selfspec_static_sdpa"
    assert tree_self_test(t.model) < 1e-4


@COMPILED_OFFERED
def test_auto_method_on_compiled_kernels_without_saved_steps_is_refused(tiny_dir):
    """auto never compiles while it chooses: with no step saved, it says what to run instead."""
    with pytest.raises(SelfspecError, match="selfspec compile.*name a method"):
        selfspec.load(str(tiny_dir), method="auto", kernels="compiled")


def test_cost_sized_drafts_on_compiled_are_priced_by_the_step(tiny_dir, tmp_path, monkeypatch):
    """A cost-sized drafter on the compiled backend loads a profile timed through the padded static
    step (here run eagerly, ``compile=False``: what it runs, not how fast), with the hidden states it
    verifies with; on another backend, through the eager forward (negative control)."""
    from selfspec.models.loading import LoadedModel, Runner

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    base = load_model(str(tiny_dir), kernels="stock")
    step = StaticStep(base.model, compile=False)
    blocks: list[tuple[int, bool]] = []
    real = step.forward
    monkeypatch.setattr(step, "forward", lambda cache, ids, *a, **kw: blocks.append((ids.numel(), a[2])) or real(
        cache, ids, *a, **kw))
    t = Runner(LoadedModel(model=base.model, tokenizer=base.tokenizer, name="tiny-priced", path=None), base.model,
               "compiled", _step=step)
    g = selfspec.load(t, "pld", self_test=False)  # auto_k: sized from the profile
    prof = g.drafter.sizer.profile
    assert prof is not None and prof.key == t.cost_key and "compiled+step" in prof.key
    prompt_blocks = {compiled_step.PREFILL_BLOCK}  # the profile's 256-token context, in blocks of 64
    assert {q for q, _ in blocks} == set(prof.qs) | prompt_blocks and not any(h for _, h in blocks)
    blocks.clear()
    assert selfspec.load(base, "pld", self_test=False).drafter.sizer.profile.key == base.cost_key
    assert blocks == []


def test_every_block_a_method_prices_is_compiled_ahead(tiny_dir, tmp_path, monkeypatch):
    """Each method that builds on the tiny model measures its cost profile through the step at
    block sizes whose padded step ``selfspec compile`` saves (``registry.compiled_blocks``), so
    neither ``auto``'s calibration nor a request compiles one: msn prices its whole 69-node tree,
    a 128-row step. Negative control: 64-row steps, every method's but msn's largest, miss it."""
    from selfspec.models.loading import LoadedModel, Runner
    from selfspec.registry import METHODS, compiled_blocks

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    base = load_model(str(tiny_dir), kernels="stock")
    step = StaticStep(base.model, compile=False)
    blocks: list[int] = []
    real = step.forward
    monkeypatch.setattr(step, "forward", lambda cache, ids, *a, **kw: blocks.append(ids.numel()) or real(
        cache, ids, *a, **kw))
    built = {}
    for name in METHODS:
        blocks.clear()
        t = Runner(LoadedModel(model=base.model, tokenizer=base.tokenizer, name=f"tiny-{name}", path=None),
                   base.model, "compiled", _step=step)
        try:
            selfspec.load(t, name, self_test=False)
        except SelfspecError:  # needs an artefact the tiny model has not (a head, a fine-tune)
            continue
        built[name] = {bucket(q) for q in blocks}
    assert {"ar", "msn", "pld", "jacobi"} <= set(built), built
    for name, padded in built.items():
        assert padded <= set(compiled_blocks(name)), (name, padded)
    assert 128 in built["msn"] and 128 not in compiled_step.block_sizes(64)
    assert compiled_blocks("ar") == (1, 2, 4, 8, 16, 32, 64)  # the prompt's blocks


def test_a_step_saved_by_other_code_is_not_loaded(tmp_path, monkeypatch):
    """A saved step's name carries a digest of selfspec's traced sources: after an upgrade or an edit
    of ``kernels/`` or ``models/``, the step is compiled again instead of loaded (and the tests' shared
    cache cannot hand one commit's steps to another)."""
    from selfspec.models import aot_step

    model = tiny_model("llama")
    shape = [(1, 512, False)]
    before = aot_step.artifact_paths(str(tmp_path), model, shape)
    assert aot_step.artifact_paths(str(tmp_path), model, shape) == before
    monkeypatch.setattr(aot_step, "code_digest", lambda: "other-sources")
    assert aot_step.artifact_paths(str(tmp_path), model, shape) != before


def test_a_step_another_process_is_compiling_is_waited_for(tmp_path, caplog):
    """The lock that makes a second process wait for the first to compile and save a step excludes
    another holder (here a thread: a lock file's locks are per open file, as between processes),
    is free again once its holder's block ends, an exception included, and where it cannot be
    taken in time, the step compiles without it, with the reason logged."""
    import threading

    from selfspec.models import aot_step

    path = tmp_path / "compile" / "aot" / "step-1x512-abc.bin"
    held, release, done = threading.Event(), threading.Event(), threading.Event()

    def holder() -> None:
        with aot_step.step_lock(path):
            held.set()
            release.wait(30)
        done.set()

    t = threading.Thread(target=holder)
    t.start()
    assert held.wait(30)
    with caplog.at_level("INFO", logger="selfspec.models.aot_step"), aot_step.step_lock(path, wait_s=0.05):
        pass  # waited 50 ms, then went on without the lock
    assert "without waiting for other processes (Timeout" in caplog.text
    release.set()
    t.join(30)
    assert done.is_set()
    caplog.clear()
    with pytest.raises(RuntimeError), aot_step.step_lock(path, wait_s=0.05):
        raise RuntimeError("the compile failed")
    with caplog.at_level("INFO", logger="selfspec.models.aot_step"), aot_step.step_lock(path, wait_s=0.05):
        pass
    assert "without waiting" not in caplog.text  # released after the exception: taken at once


@COMPILED_OFFERED
@SAVED_ROUTE_ONLY
def test_a_steps_first_call_holds_the_lock_of_its_saved_file(compiled, ar_ids, monkeypatch):
    """A step's first call (load or compile, then run) holds the lock named after its saved file,
    so two processes never compile the same step at once (CI's two test workers did)."""
    import contextlib

    from selfspec.models import aot_step

    taken = []

    @contextlib.contextmanager
    def recording(path, wait_s=aot_step.LOCK_WAIT_S):
        taken.append(path)
        yield

    monkeypatch.setattr(aot_step, "step_lock", recording)
    step = StaticStep(compiled.model)  # a new step, as in a new process: loads the one the fixture saved
    cache = kv_cache.new_cache(compiled.model.config, capacity=capacity_for(len(PROMPTS[0]) + MAX_NEW))
    with torch.inference_mode():
        step.prefill(cache, torch.tensor(PROMPTS[0]), False)
        step.forward(cache, torch.tensor([5]), torch.tensor([len(PROMPTS[0])]), None, False)
    shape = (1, kv_cache.capacity(cache), False)
    assert aot_step.artifact_path(compiled_step.compile_cache_dir(), compiled.model, shape) in taken


@COMPILED_OFFERED
@pytest.mark.skipif(compact_unavailable is not None, reason=str(compact_unavailable))
def test_a_model_of_gguf_blocks_runs_compacts_kernel_inside_the_step(tmp_path):
    """Weights that are GGUF blocks: the step's linear layers are compact's (the graph calls its
    kernel as an extern op), and the step is lossless: ``ar`` gives ``generate``'s ids on the same
    module tree, and drafts right for exactly j tokens change nothing."""
    from selfspec.kernels.compact import CompactLinear
    from selfspec.kernels.swap import linear_layers

    path = save_tiny(tmp_path / "tiny-gguf-1layer", "llama", 0, layers=1, gguf=True)
    t = load_model(str(path), kernels="compiled")
    assert t.step is not None and all(isinstance(m, CompactLinear) for _, _, m in linear_layers(t.model))
    g, scripted = selfspec.load(t, method="ar", self_test=False), selfspec.load(t, method="ar", self_test=False)
    for p in PROMPTS:
        ids = g.generate(p, max_new_tokens=MAX_NEW, chat=False).token_ids
        out = t.model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
        assert ids == out[0, len(p):].tolist()
        scripted.drafter = ScriptedDrafter(ids, K, 2, VOCAB)
        assert scripted.generate(p, max_new_tokens=MAX_NEW, chat=False).token_ids == ids
    assert (1, capacity_for(len(PROMPTS[0]) + MAX_NEW), False) in t.step.compiled
