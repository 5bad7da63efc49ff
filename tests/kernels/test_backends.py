"""Backend selection: onednn keeps the fp32 model, auto measures and caches, bad input is refused."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.autoselect.kernels import choose, fastest_runner
from selfspec.core import store
from selfspec.core.cost import profile_key
from selfspec.errors import SelfspecError
from selfspec.kernels import KERNELS, current_backend
from selfspec.kernels.auto import candidates
from selfspec.kernels.onednn import available as onednn_available
from selfspec.models.loading import load_model

from ..conftest import COMPILED_OFFERED


@torch.inference_mode()
def test_onednn_is_the_same_model_up_to_rounding(tiny_dir):
    t = load_model(str(tiny_dir))
    ids = torch.tensor([[5, 9, 11, 4, 30, 7]])
    ref = t.model(input_ids=ids).logits
    o = t.runner("onednn")
    assert current_backend(o.model) == "onednn" and current_backend(t.model) == "stock"  # the stock runner unchanged
    got = o.model(input_ids=ids).logits
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(t.model(input_ids=ids).logits, ref)


def test_auto_picks_a_measured_fp32_backend_and_caches_it(tiny_dir, monkeypatch):
    from selfspec.autoselect import kernels as auto

    t = load_model(str(tiny_dir))
    assert set(candidates(t.model)) <= {"stock", "onednn"}
    choice = choose(t.model, "tiny", lambda k: t.runner(k).model)
    assert choice in candidates(t.model)
    path = store.path(store.key(store.Kind.KERNELS_CHOICE, t.model, "tiny", "auto"))
    if len(candidates(t.model)) > 1:
        saved = json.loads(path.read_text())["data"]
        assert saved["backend"] == choice and set(saved["seconds"]) == set(candidates(t.model))
    assert fastest_runner(load_model(str(tiny_dir)).base).backend in candidates(t.model)

    def no_timing(model):
        raise AssertionError("a cached choice must not be measured again")

    monkeypatch.setattr(auto, "quick_case", no_timing)
    assert choose(t.model, "tiny", lambda k: t.runner(k).model) == choice  # the cached choice, not a new measurement


def test_auto_remeasures_a_corrupt_choice(tiny_dir, monkeypatch):
    from selfspec.autoselect import kernels as auto

    t = load_model(str(tiny_dir))
    if len(candidates(t.model)) == 1:
        pytest.skip("only one fp32 backend here: nothing is measured")
    key = store.key(store.Kind.KERNELS_CHOICE, t.model, "tiny-corrupt", "auto")
    path = store.path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    timed = []
    monkeypatch.setattr(auto, "quick_case", lambda model: (lambda: timed.append(1), lambda: None))
    envelope = {"schema": store.SCHEMA, "kind": "kernels-choice", "key": key}
    for bad in ("{oops", json.dumps({**envelope, "data": {"backend": "warp", "seconds": {}}}), json.dumps(["stock"]),
                json.dumps({"backend": "stock", "seconds": {}})):
        path.write_text(bad)
        assert choose(t.model, "tiny-corrupt", lambda k: t.runner(k).model) in candidates(t.model)
    assert len(timed) == 4 * (auto.ROUNDS + 1) * len(candidates(t.model))  # measured again each time (+ warm-up)
    assert json.loads(path.read_text())["data"]["backend"] in candidates(t.model)


def test_load_defaults_to_auto_kernels(tiny_dir, monkeypatch):
    import selfspec

    monkeypatch.delenv("SELFSPEC_KERNELS")
    g = selfspec.load(str(tiny_dir), method="ar")
    assert g.kernels in candidates(g.target.model)
    assert g.generate([5, 9, 11], max_new_tokens=4).kernels == g.kernels


def test_unknown_kernels_are_refused(tiny_dir):
    with pytest.raises(SelfspecError, match="unknown kernels .fast.*auto, stock, onednn, int8, compiled, compact"):
        load_model(str(tiny_dir), kernels="fast")
    t = load_model(str(tiny_dir))
    with pytest.raises(SelfspecError, match="unknown kernels"):
        t.runner("int4")
    assert KERNELS == ("auto", "stock", "onednn", "int8", "compiled", "compact")


def test_onednn_needs_fp32(tiny_dir):
    with pytest.raises(SelfspecError, match="fp32 only"):
        load_model(str(tiny_dir), dtype="bfloat16", kernels="onednn")


def test_profiles_are_kept_per_backend(tiny_dir):
    t = load_model(str(tiny_dir))
    keys = {profile_key(t.model, "tiny", b) for b in ("stock", "onednn", "int8")}
    assert len(keys) == 3


@torch.inference_mode()
def test_release_fp32_keeps_outputs_and_pins_the_backend(tiny_dir):
    ids = torch.tensor([[5, 9, 11, 4]])
    ref = load_model(str(tiny_dir), kernels="int8")
    t = load_model(str(tiny_dir), kernels="int8", release_fp32=True)
    assert torch.equal(t.model(input_ids=ids).logits, ref.model(input_ids=ids).logits)
    assert t.runner("int8") is t and t.base.only == "int8"
    with pytest.raises(SelfspecError, match="fp32 weights were released"):
        t.runner("stock")
    assert all(m.weight.numel() == 0 for m in t.base.model.modules()
               if isinstance(m, torch.nn.Linear) and m is not t.base.model.get_output_embeddings())


@torch.inference_mode()
def test_building_a_runner_leaves_the_others_as_they_are(tiny_dir):
    """Each runner has a module tree of its own over the same weights: building another backend's
    runner changes neither the layers nor the attention function of one built before, nor the
    loaded model's stock tree; the same backend gives the same runner."""
    from selfspec.kernels.swap import linear_layers

    t = load_model(str(tiny_dir), kernels="int8")
    before = [m for _, _, m in linear_layers(t.model)]
    o = t.runner("onednn")
    assert t.model.config._attn_implementation == "selfspec_rowwise" and current_backend(t.model) == "int8"
    assert [m for _, _, m in linear_layers(t.model)] == before
    assert current_backend(o.model) == "onednn" and o.model.config._attn_implementation != "selfspec_rowwise"
    assert current_backend(t.base.model) == "stock" and t.base.model.config._attn_implementation == "sdpa"
    assert t.runner("onednn") is o and o.runner("int8") is t
    shared = {p.data_ptr() for p in t.base.model.parameters()}
    assert {p.data_ptr() for p in o.model.parameters()} <= shared  # no copy of the weights as parameters


@COMPILED_OFFERED
@torch.inference_mode()
def test_compiled_runs_the_onednn_layers_where_onednn_runs(tiny_dir):
    """On the CPU in fp32 the compiled backend's layers are oneDNN's prepacked ones (faster inside
    the compiled step than the stock ones), the siblings that read one input (q/k/v, gate/up)
    sharing one packed weight per group; where onednn cannot run (bf16) they stay stock."""
    from selfspec.kernels.onednn import SIBLINGS, OneDNNLinear, SharedProductLinear
    from selfspec.kernels.swap import linear_layers

    t = load_model(str(tiny_dir), kernels="compiled")
    assert t.backend == "compiled"
    layers = linear_layers(t.model)
    grouped = {n for names in SIBLINGS for n in names}
    assert all(isinstance(m, SharedProductLinear if name in grouped else OneDNNLinear) for _, name, m in layers)
    for attn in (p for p, name, _ in layers if name == "q_proj"):
        packed = {id(getattr(attn, n).packed) for n in SIBLINGS[0]}
        assert len(packed) == 1
        assert [getattr(attn, n).start for n in SIBLINGS[0]] == [0, attn.q_proj.out_features,
                                                                  attn.q_proj.out_features + attn.k_proj.out_features]
    assert current_backend(t.runner("stock").model) == "stock" and t.backend == "compiled"
    b = load_model(str(tiny_dir), dtype="bfloat16", kernels="compiled")
    assert all(isinstance(m, torch.nn.Linear) for _, _, m in linear_layers(b.model))


@torch.inference_mode()
def test_traced_onednn_layer_calls_the_same_kernel():
    """Under ``torch.compile`` a oneDNN layer is one opaque operator on its packed weight: the
    compiled layer's rows are the eager layer's, bit for bit, at q = 1 and q = 8 (and a q = 1 row
    is the q = 8 block's first row: oneDNN's packed kernel keeps rows independent of q)."""
    from selfspec.kernels.onednn import OneDNNLinear, onednn_linear

    torch.manual_seed(0)
    layer = OneDNNLinear(torch.nn.Linear(64, 96))
    x = torch.randn(8, 64)
    eager = layer(x)
    assert torch.equal(onednn_linear(x, layer.packed, layer.bias, 96), eager)
    compiled = torch.compile(lambda v: layer(v), dynamic=False, fullgraph=True)
    assert torch.equal(compiled(x), eager)
    assert torch.equal(compiled(x[:1]), eager[:1])
    assert torch.allclose(eager, x @ layer.original.weight.T + layer.original.bias, atol=1e-5)


@COMPILED_OFFERED
@pytest.mark.matrix  # compiles a step of its own (30 s here): CI's second command
@torch.inference_mode()
def test_siblings_share_one_product_in_the_compiled_step(tiny_qwen_dir):
    """Members of a sibling group (with biases: Qwen2's q/k/v) give the separate layers' values
    eagerly (they are the stock layers) and under ``torch.compile``, where each group's product
    runs once: one oneDNN call per group, per other layer and for the LM head (a block of more
    rows than the few-row product takes, kernels/gemv.py)."""
    from torch._inductor.utils import run_and_get_code

    from selfspec.kernels import gemv
    from selfspec.kernels.onednn import shared_products_pass
    from selfspec.kernels.swap import linear_layers

    t = load_model(str(tiny_qwen_dir), kernels="compiled")
    model = t.model
    ids = torch.tensor([[3, 17, 42, 7] * (gemv.ROWS // 4 + 1)])
    ref = load_model(str(tiny_qwen_dir), kernels="stock").model(input_ids=ids).logits
    torch.testing.assert_close(model(input_ids=ids).logits, ref, atol=1e-5, rtol=1e-5)  # eager: stock + oneDNN

    fn = torch.compile(lambda x: model(input_ids=x, use_cache=False).logits, dynamic=False, fullgraph=True,
                       options={"post_grad_custom_pre_pass": shared_products_pass()})
    out, code = run_and_get_code(fn, ids)  # Inductor's generated code: one line per oneDNN call
    calls = sum(c.count("torch.ops.selfspec.onednn_linear.default(") for c in code)
    layers = model.config.num_hidden_layers
    assert calls == 4 * layers + 1  # qkv, o, gate-up, down per layer; the head
    assert len(linear_layers(model)) == 7 * layers + 1
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(onednn_available(torch.device("cpu"), torch.float32) is not None, reason="no oneDNN here")
def test_keep_only_frees_the_runners_not_chosen(tiny_dir):
    """``auto`` builds a runner per candidate backend, then keeps its choice: the others are dropped
    (their packed copies freed once nothing holds them); the kept one is the same object."""
    t = load_model(str(tiny_dir))
    compiled = t.runner("compiled")
    t.runner("onednn")
    assert set(t.base.built()) == {"stock", "compiled", "onednn"}
    t.base.keep_only("compiled")
    assert t.base.built() == ["compiled"] and t.runner("compiled") is compiled
    assert t.runner("onednn").model is not None and set(t.base.built()) == {"compiled", "onednn"}  # built anew


@COMPILED_OFFERED
def test_no_room_for_the_few_row_layout_is_said_once_per_runner(tiny_dir, monkeypatch, caplog):
    """Where free memory cannot hold the few-row copy, the compiled backend keeps oneDNN and says so
    when its runner is built, once: asking for the runner again builds nothing."""
    import logging
    from types import SimpleNamespace

    from selfspec.kernels import backends

    if onednn_available(torch.device("cpu"), torch.float32) is not None:
        pytest.skip("oneDNN cannot run here: the compiled backend keeps the stock layers")
    monkeypatch.setattr(backends.psutil, "virtual_memory", lambda: SimpleNamespace(available=0))
    t = load_model(str(tiny_dir))
    with caplog.at_level(logging.INFO, logger="selfspec.kernels"):
        for kernels in ("compiled", "stock", "compiled", "onednn", "compiled"):
            t.runner(kernels)
    said = [r for r in caplog.records if "few-token steps of the compiled backend use oneDNN" in r.getMessage()]
    assert len(said) == 1 and not said[0].getMessage().startswith("selfspec:")
    other = load_model(str(tiny_dir))  # another model: its own note
    with caplog.at_level(logging.INFO, logger="selfspec.kernels"):
        other.runner("compiled")
    assert len([r for r in caplog.records if "few-token steps" in r.getMessage()]) == 2


def test_layers_beside_the_compiled_step_run_on_its_own_kernels():
    """A stand-alone layer for the compiled backend (an EAGLE head's, a reduced draft LM head) runs
    eagerly beside the step on that backend's own layers: oneDNN's prepacked ones in fp32 on the
    CPU (not the stock matrix-vector product), stock where oneDNN cannot run; same outputs."""
    from selfspec.kernels.backends import convert_linear, convert_linears
    from selfspec.kernels.onednn import OneDNNLinear
    from selfspec.kernels.swap import linear_layers

    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 48)
    x = torch.randn(3, 64)
    got = convert_linear(layer, "compiled")
    if onednn_available(torch.device("cpu"), torch.float32) is None:
        assert isinstance(got, OneDNNLinear) and convert_linear(got, "compiled") is got
        head = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        convert_linears(head, "compiled")
        assert {type(m) for _, _, m in linear_layers(head)} == {OneDNNLinear}
    else:
        assert got is layer
    assert torch.allclose(got(x), layer(x), atol=1e-5, rtol=1e-5)
    half = torch.nn.Linear(64, 48).to(torch.bfloat16)  # oneDNN's backend is fp32 only: stock
    assert convert_linear(half, "compiled") is half
