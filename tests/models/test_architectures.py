"""The architecture matrix (issue 59): tiny random-weight models of popular decoder families, built
from transformers' own config classes, decode greedily with ids identical to ``generate``, sliding
windows (Mistral, Gemma 2/3, Qwen2 with ``use_sliding_window``) and mixed local/global layers
included. The windows are small (8 positions) so that prompts and outputs run far past them.

The default tier runs ``ar`` and ``pld`` on the stock kernels for every family; the ``matrix`` tier
adds ``auto``, ``jacobi`` and ``self-spec`` with the int8 draft on stock and oneDNN, the
``int8`` backend, and ``compiled`` on one family per kind of attention (:data:`COMPILED`)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import selfspec
from selfspec.errors import SelfspecError
from selfspec.models.loading import load_model

from ..conftest import VOCAB, make_tokenizer, prompt_ids

WINDOW = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False)
FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2-sliding": dict(model_type="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2),
    "qwen3": dict(head_dim=16),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16),
    "gemma3_text": dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"] * 2),
    "phi3": dict(sliding_window=WINDOW),
    "phi": dict(partial_rotary_factor=0.5),
    "olmo2": {},
    "gpt_neox": dict(rotary_pct=0.25),
    "gpt2": dict(n_positions=512),
    "stablelm": {},
    "granite": {},
    "starcoder2": dict(sliding_window=WINDOW),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, decoder_sparse_step=1),
}
SLIDING = ("mistral", "qwen2-sliding", "gemma2", "gemma3_text", "phi3", "starcoder2")
NO_LAYER_SKIPPING = ("gpt2", "gpt_neox")  # self-spec skips model.layers[i].self_attn / .mlp: refused in one line
COMPILED = ("llama", "mistral", "gemma3_text", "qwen2_moe")  # full, sliding, mixed local/global, experts


def build(family: str, path: Path) -> Path:
    """A tiny random model of ``family`` (weights scaled up for clear winners) with the tests'
    word-level tokenizer, saved to ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = dict(FAMILIES[family])
    model_type = extra.pop("model_type", family)
    torch.manual_seed(sorted(FAMILIES).index(family))
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **extra})
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = build(request.param, tmp_path_factory.mktemp(request.param))
    runner = load_model(str(path))
    model = runner.base.model
    prompts = [prompt_ids(300 + i, n) for i, n in enumerate((5, 13, 21))]  # past the 8-position window
    return request.param, runner, prompts, generate_refs(model, prompts)


def generate_refs(model, prompts: list[list[int]]) -> list[list[int]]:
    """``transformers`` ``generate``'s 20 greedy tokens after each prompt, past EOS."""
    refs = []
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.max_new_tokens, gc.do_sample = [], 20, False  # past EOS, as ignore_eos decodes
    with torch.inference_mode():  # (min_new_tokens would forbid EOS instead, changing the text)
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 generation_config=gc)
            refs.append(out[0, len(p):].tolist())
    return refs


def check(runner, prompts, refs, method: str, kernels: str, **opts) -> None:
    g = selfspec.load(runner.base.runner(kernels) if kernels != "auto" else runner, method=method,
                      kernels=kernels, self_test=False, **opts)
    for p, ref in zip(prompts, refs):
        assert g.generate(p, max_new_tokens=20, ignore_eos=True).token_ids == ref, (method, kernels)


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_greedy_ids_equal_generate(family, method):
    name, runner, prompts, refs = family
    check(runner, prompts, refs, method, "stock")


@pytest.mark.matrix  # auto calibrates every candidate: seconds a family
def test_auto_equals_generate(family, monkeypatch, tmp_path):
    """auto calibrates on prompts the tests' word-level tokenizer encodes, and its choice is exact."""
    import selfspec.autoselect.choice as choice

    monkeypatch.setattr(choice, "calibration_prompts", lambda: ["w5 w6 w7 w8", "w9 w10 w5", "w6 w7"])
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))  # calibrated here, not read from another test's cache
    name, runner, prompts, refs = family
    if runner.base.tokenizer("w5 w6").input_ids == []:  # qwen2: transformers loads its own tokenizer class,
        pytest.skip("which cannot encode the tests' word-level text (auto calibrates on text)")
    g = selfspec.load(runner, method="auto", self_test=False)
    for p, ref in zip(prompts, refs):
        assert g.generate(p, max_new_tokens=20, ignore_eos=True).token_ids == ref, g.method


@pytest.mark.matrix
@pytest.mark.parametrize("kernels", ["stock", "onednn"])
@pytest.mark.parametrize("method", ["ar", "pld", "jacobi", "self-spec"])
def test_drafting_methods_equal_generate(family, method, kernels):
    from selfspec.kernels.onednn import available

    if kernels == "stock" and method in ("ar", "pld"):
        pytest.skip("the default tier's test")
    if kernels == "onednn" and available(torch.device("cpu"), torch.float32) is not None:
        pytest.skip("no oneDNN here")
    name, runner, prompts, refs = family
    opts = dict(skip_attention=(1,), skip_mlp=(2,), draft_kernels="int8") if method == "self-spec" else {}
    if method == "self-spec" and name in NO_LAYER_SKIPPING:
        with pytest.raises(SelfspecError, match="self-spec needs a decoder with model.layers"):
            check(runner, prompts, refs, method, kernels, **opts)
        return
    check(runner, prompts, refs, method, kernels, **opts)


@pytest.mark.matrix
@pytest.mark.parametrize("kernels", ["int8", "compiled"])
def test_other_backends_decode_exactly(family, kernels):
    """int8 quantises the model (its own ar is the reference); compiled must equal generate."""
    name, runner, prompts, refs = family
    if kernels == "compiled":
        if name not in COMPILED:
            pytest.skip("compiling costs ~1 min a family on 2 cores: one family per kind of attention")
        # Four graphs, not the seven a measured pld compiles (its cost profile runs every bucket to 64):
        # blocks of 1-4 tokens (drafts of up to 3, padded to 4) and one 16-token prefill block,
        # prompts of 9-15 tokens, past the 8-position window
        prompts = [prompt_ids(500 + i, n) for i, n in enumerate((9, 12, 15))]
        check(runner, prompts, generate_refs(runner.base.model, prompts), "pld", "compiled", k=3, auto_k=False)
        return
    r = runner.base.runner("int8")
    ar = selfspec.load(r, method="ar", kernels="int8", self_test=False)
    pld = selfspec.load(r, method="pld", kernels="int8", self_test=False)
    for p in prompts:
        assert pld.generate(p, max_new_tokens=20, ignore_eos=True).token_ids == \
            ar.generate(p, max_new_tokens=20, ignore_eos=True).token_ids


@pytest.mark.parametrize("family_name", SLIDING)
def test_windows_are_read_from_the_config(family_name, tmp_path):
    from selfspec.models.adapter import layer_windows

    path = build(family_name, tmp_path / family_name)
    windows = layer_windows(load_model(str(path)).base.model.config)
    assert WINDOW in windows and len(windows) == COMMON["num_hidden_layers"]


def test_a_recurrent_cache_is_refused_in_one_line():
    """Hybrid models whose layers keep a recurrent or linear-attention state cannot roll a draft back."""
    from types import SimpleNamespace

    from selfspec.models.adapter import layer_windows

    cfg = SimpleNamespace(model_type="qwen3_next", sliding_window=None, num_hidden_layers=2,
                          layer_types=["linear_attention", "full_attention"])
    with pytest.raises(SelfspecError, match="qwen3_next: its 'linear_attention' layers"):
        layer_windows(cfg)


def test_a_window_left_out_is_caught(tmp_path, monkeypatch):
    """Negative control: decoding a sliding-window model as if its attention were full changes its
    ids, so the windows bite in these tests and the identity above checks them."""
    import selfspec.models.adapter as adapter

    runner = load_model(str(build("mistral", tmp_path / "mistral")))
    prompts = [prompt_ids(300 + i, n) for i, n in enumerate((5, 13, 21))]
    # int8: selfspec's own attention function, which sees only the masks selfspec builds
    g = selfspec.load(runner.base.runner("int8"), method="pld", kernels="int8", self_test=False)
    windowed = [g.generate(p, max_new_tokens=20, ignore_eos=True).token_ids for p in prompts]
    monkeypatch.setattr(adapter, "layer_windows", lambda config: (None,) * config.num_hidden_layers)
    full = [g.generate(p, max_new_tokens=20, ignore_eos=True).token_ids for p in prompts]
    assert full != windowed


@pytest.mark.parametrize("name", ["mistral", "gemma3_text"])
def test_a_batch_of_windowed_requests_is_each_its_solo_run(name, tmp_path):
    """Continuous batching with windows (one mask per layer type in the packed attention)."""
    runner = load_model(str(build(name, tmp_path / name)))
    g = selfspec.load(runner.base.runner("int8"), method="pld", kernels="int8", self_test=False)
    prompts = [prompt_ids(400 + i, n) for i, n in enumerate((5, 13, 21))]
    solo = [g.generate(p, max_new_tokens=20, ignore_eos=True).token_ids for p in prompts]
    out = g.generate_batch(prompts, max_new_tokens=20, ignore_eos=True)
    assert max(g.last_batch_sizes) == 3 and [r.token_ids for r in out] == solo
