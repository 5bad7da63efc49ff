"""Runners: one loaded model, several configurations over its weights, none switched under another.

Two generators built over one loaded model (the second from the first's ``target``), decoding at
the same time in two threads, each give exactly the ids of their solo runs: on different verify
backends, with a layer-skipping draft, with an int8 draft runner, and on the compiled backend with
its int8 draft step (run eagerly here, ``compile=False``; the compiled tier runs it compiled).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch

import selfspec
from selfspec.kernels import install_backend
from selfspec.kernels.onednn import available as onednn_available
from selfspec.kernels.swap import linear_layers, share_copy
from selfspec.models.compiled_step import StaticStep
from selfspec.models.loading import LoadedModel, Runner, load_model

from ..conftest import SAVED_ROUTE_ONLY, prompt_ids

NO_ONEDNN = onednn_available(torch.device("cpu"), torch.float32)
PROMPTS = [prompt_ids(11, 9), prompt_ids(12, 14)]
NEW = 20


def eager_compiled(base: LoadedModel) -> Runner:
    """``base``'s compiled runner with its step run eagerly (what it runs, not how fast: no compile in
    the default tier), put where :meth:`LoadedModel.runner` finds it."""
    model = share_copy(base.model)
    install_backend(model, "compiled")
    runner = Runner(base, model, "compiled", _step=StaticStep(model, compile=False))
    base._runners["compiled"] = runner
    return runner


def solo_then_together(gens: list, rounds: int = 2) -> None:
    """Each generator's ids on :data:`PROMPTS` alone, then again while all decode at once, one
    thread each (``rounds`` times): every concurrent run must equal its solo run."""
    solo = [[g.generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids for p in PROMPTS] for g in gens]
    together: dict[tuple[int, int, int], list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(gens))

    def work(i: int) -> None:
        try:
            torch.set_num_threads(1)
            start.wait()
            for r in range(rounds):
                for j, p in enumerate(PROMPTS):
                    together[(i, j, r)] = gens[i].generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(gens))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    wrong = [(i, j, r) for (i, j, r), ids in together.items() if ids != solo[i][j]]
    assert not wrong and len(together) == len(gens) * len(PROMPTS) * rounds, wrong


def layer_types(model: torch.nn.Module) -> list[str]:
    return [type(m).__name__ for m in model.modules()]


@pytest.mark.skipif(NO_ONEDNN is not None, reason=f"no oneDNN here: {NO_ONEDNN}")
def test_two_generators_over_one_model_in_two_threads_give_their_solo_ids(tiny_dir):
    """The issue's case: ``ar`` on oneDNN and ``self-spec`` on stock kernels over the same loaded
    model. The second load leaves the first generator's runner as it was (its layers, attention)."""
    g1 = selfspec.load(str(tiny_dir), method="ar", kernels="onednn", self_test=False)
    before = layer_types(g1.target.model)
    g2 = selfspec.load(g1.target, method="self-spec", kernels="stock", self_test=False, skip_attention=(1,),
                       skip_mlp=(0,), k=3, auto_k=False)
    assert g2.target.base is g1.target.base and g2.target is not g1.target and g2.kernels == "stock"
    assert layer_types(g1.target.model) == before and g1.kernels == "onednn"
    assert layer_types(g2.target.model) == layer_types(g1.target.base.model)  # the stock tree: not skipped
    solo_then_together([g1, g2])
    assert layer_types(g1.target.model) == before


@pytest.mark.skipif(NO_ONEDNN is not None, reason=f"no oneDNN here: {NO_ONEDNN}")
def test_two_generators_with_an_int8_draft_runner_give_their_solo_ids(tiny_dir):
    """``self-spec`` whose draft runs on an int8 copy (its own module tree) beside ``ar`` on the int8
    runner and ``ar`` on oneDNN: three generators, three threads, one loaded model."""
    t = load_model(str(tiny_dir), kernels="onednn")
    spec = selfspec.load(t, method="self-spec", self_test=False, skip_attention=(), skip_mlp=(2,),
                         draft_kernels="int8", draft_vocab=0, k=3, auto_k=False)
    assert spec.drafter.layers is not None and spec.drafter.draft_model is not t.model
    assert not any(type(m).__name__.startswith("Int8") for _, _, m in linear_layers(t.model))
    q = selfspec.load(t, method="ar", kernels="int8", self_test=False)
    ar = selfspec.load(t, method="ar", self_test=False)
    solo_then_together([spec, q, ar])
    assert spec.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True).token_ids == \
        ar.generate(PROMPTS[0], max_new_tokens=NEW, ignore_eos=True).token_ids  # lossless on its runner


@pytest.mark.skipif(NO_ONEDNN is not None, reason=f"no oneDNN here: {NO_ONEDNN}")
def test_two_generators_on_the_compiled_runner_and_its_int8_draft_step_give_their_solo_ids(tiny_dir):
    """The compiled runner (its step and cache pool) with ``ar`` and with ``self-spec`` drafting
    through its own int8 draft step, beside ``pld`` on oneDNN, all over one loaded model."""
    t = load_model(str(tiny_dir), kernels="stock")
    compiled = eager_compiled(t.base)
    ar = selfspec.load(compiled, method="ar", self_test=False)
    spec = selfspec.load(compiled, method="self-spec", self_test=False, skip_attention=(), skip_mlp=(),
                         draft_kernels="int8", draft_vocab=0, k=3, auto_k=False)
    assert spec.target is compiled and spec.drafter.draft_step is not None
    assert spec.drafter.draft_step.model is spec.drafter.draft_model is not compiled.model
    pld = selfspec.load(t, method="pld", kernels="onednn", self_test=False)
    solo_then_together([ar, spec, pld])
    assert spec.generate(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True).token_ids == \
        ar.generate(PROMPTS[1], max_new_tokens=NEW, ignore_eos=True).token_ids


def test_share_copy_shares_every_tensor_and_nothing_else(tiny_dir):
    """A runner's module tree: new module objects and config, the same parameter and buffer tensors."""
    t = load_model(str(tiny_dir))
    copy = share_copy(t.model)
    assert all(a is b for a, b in zip(t.model.parameters(), copy.parameters()))
    assert all(a is b for a, b in zip(t.model.buffers(), copy.buffers()))
    assert not {id(m) for m in t.model.modules()} & {id(m) for m in copy.modules()}
    assert copy.config is not t.model.config and copy.model.layers[0].self_attn.config is copy.config
    copy.set_attn_implementation("eager")
    assert t.model.config._attn_implementation == "sdpa"


def test_no_model_is_switched_in_place_in_the_package():
    """What the runners replace stays gone: no run-time kernel switch, no patched instance
    ``forward``, no second step on one module tree chosen by the layers installed (``layers_as``),
    no sizing record on a proposal for sizers to dispatch on by type (the step's ``Budget`` instead)."""
    src = Path(selfspec.__file__).parent
    text = {p: p.read_text() for p in src.rglob("*.py")}
    patterns = {"use_kernels": r"\buse_kernels\b", "forward patch": r"\.forward\s*=(?!=)", "layers_as": r"layers_as",
                "a sizing record dispatched by type": r"\.sizing\b|\bsizing="}
    found = {name: [str(p.relative_to(src)) for p, s in text.items() if re.search(rx, s)]
             for name, rx in patterns.items()}
    assert found == {name: [] for name in patterns}, found


@pytest.mark.matrix
@pytest.mark.skipif(NO_ONEDNN is not None, reason=f"no oneDNN here: {NO_ONEDNN}")
def test_two_generators_on_the_compiled_runner_compiled_give_their_solo_ids(tiny_dir):
    """As the eager-step case above, through the steps compiled by ``torch.compile`` (CI's compiled
    tier): ``ar`` and ``self-spec`` with its int8 draft step share the compiled runner, ``pld``
    decodes on oneDNN, all at once."""
    t = load_model(str(tiny_dir), kernels="compiled")
    ar = selfspec.load(t, method="ar", self_test=False)
    spec = selfspec.load(t, method="self-spec", self_test=False, skip_attention=(), skip_mlp=(), draft_kernels="int8",
                         draft_vocab=0, k=3, auto_k=False)
    assert spec.target is t and spec.drafter.draft_step is not None and spec.drafter.draft_step.compile
    pld = selfspec.load(t, method="pld", kernels="onednn", self_test=False)
    solo_then_together([ar, spec, pld])


@SAVED_ROUTE_ONLY  # the public route runs torch.compile on any torch
def test_the_compiled_backend_on_a_torch_it_does_not_know_runs_onednn_with_a_note(tiny_dir, monkeypatch, caplog):
    """The saved steps rest on private torch internals written for :data:`aot_step.KNOWN_TORCH`: on
    another release the compiled runner is the onednn one (stock where onednn cannot run), said in
    one line, and decodes ``ar``'s ids there; on a known release it is the compiled one."""
    import logging

    from selfspec.models import aot_step

    t = load_model(str(tiny_dir))
    known = ".".join(torch.__version__.split("+")[0].split(".")[:2]) in aot_step.KNOWN_TORCH
    assert (aot_step.route(torch.device("cpu")) in ("saved", "public")) == known
    monkeypatch.setattr(torch, "__version__", "9.1.0+cpu")
    assert aot_step.route(torch.device("cpu")) is None and not aot_step.supported(torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="selfspec.models"):
        r = t.runner("compiled")
    said = [x.getMessage() for x in caplog.records if "not offered on torch 9.1.0" in x.getMessage()]
    expected = "onednn" if NO_ONEDNN is None else "stock"
    assert len(said) == 1 and r.backend == expected and r.step is None
    g = selfspec.load(t, method="ar", kernels="compiled", self_test=False)
    assert g.kernels == expected
    monkeypatch.setenv(aot_step.ROUTE_ENV, "public")  # the public route asks for no private internal
    assert aot_step.route(torch.device("cpu")) == "public"


@pytest.mark.matrix
@pytest.mark.skipif(NO_ONEDNN is not None, reason=f"no oneDNN here: {NO_ONEDNN}")
def test_the_compiled_tier_on_the_public_route_gives_ars_ids(tiny_dir, monkeypatch):
    """With ``$SELFSPEC_COMPILE_ROUTE=public`` the compiled backend compiles with ``torch.compile``
    and its own caches (no saved steps, no private torch internals): ``ar`` through the compiled
    step, and ``self-spec`` verifying through it and drafting through its own compiled int8 step,
    give the ids of ``ar`` on the eager kernels; nothing is saved."""
    from selfspec.models import aot_step

    monkeypatch.setenv(aot_step.ROUTE_ENV, "public")
    monkeypatch.setattr(aot_step, "compile_step", lambda *a, **kw: pytest.fail("the private route ran"))
    monkeypatch.setattr(aot_step, "load_step", lambda *a, **kw: pytest.fail("the private route ran"))
    t = load_model(str(tiny_dir), kernels="compiled")
    ar = selfspec.load(t, method="ar", self_test=False)
    spec = selfspec.load(t, method="self-spec", self_test=False, skip_attention=(), skip_mlp=(), draft_kernels="int8",
                         draft_vocab=0, k=3, auto_k=False)
    assert spec.drafter.draft_step is not None
    ref = selfspec.load(t, method="ar", kernels="stock", self_test=False)
    for p in PROMPTS:
        want = ref.generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids
        assert ar.generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids == want
        assert spec.generate(p, max_new_tokens=NEW, ignore_eos=True).token_ids == want


@pytest.mark.skipif(NO_ONEDNN is not None, reason=f"no oneDNN here: {NO_ONEDNN}")
def test_self_spec_drafters_over_one_model_share_one_int8_draft_runner(tiny_dir):
    """The int8 copy of the weights is made once per (verify runner, kernels, layout) and shared by
    every self-spec drafter over the loaded model, in two threads too; another skip set is a tree
    of its own over the same draft runner; ``auto`` keeping a backend keeps its draft runners."""
    t = load_model(str(tiny_dir), kernels="onednn")
    a = selfspec.load(t, method="self-spec", self_test=False, skip_attention=(), skip_mlp=(2,), draft_kernels="int8",
                      draft_vocab=0, k=3, auto_k=False)
    b = selfspec.load(t, method="self-spec", self_test=False, skip_attention=(1,), skip_mlp=(), draft_kernels="int8",
                      draft_vocab=0, k=2, auto_k=False)
    assert a.drafter.layers is b.drafter.layers and a.drafter.layers.extra_bytes > 0
    assert a.drafter.draft_model is not b.drafter.draft_model
    assert "onednn>int8" in t.base.built()
    solo_then_together([a, b])
    t.base.keep_only("onednn")
    assert set(t.base.built()) == {"onednn", "onednn>int8"}
