"""Greedy equality on real models: SmolLM2-135M on every other one of the 20 built-in prompts (in
the suite; 10 prompts across the categories), and
Qwen2.5-Coder-1.5B with the 0.5B draft on 5 prompts (slow; run by scripts/bench_baselines.sh)."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.bench.datasets import builtin
from selfspec.decoding.text import encode_prompt

from ..conftest import bundled_path

MAX_NEW = 32


def hf_ids(model, ids: list[int], max_new: int) -> list[int]:
    t = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(t, attention_mask=torch.ones_like(t), do_sample=False, max_new_tokens=max_new)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def smol_refs(smollm2):
    prompts = [encode_prompt(smollm2.tokenizer, p.text, True, smollm2.model.config.vocab_size) for p in builtin()]
    assert len(prompts) == 20
    prompts = prompts[::2]
    return prompts, [hf_ids(smollm2.model, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("method,opts", [
    ("ar", {}),
    ("pld", {"k": 4, "auto_k": False}),
    ("pld", {}),  # draft length from the measured cost profile
    ("draft-model", {"draft_model": "smollm2", "k": 3, "auto_k": False}),
    ("jacobi", {"m": 4, "auto_m": False}),
    ("msn", {"tree_size": 68}),  # the paper's TR-Jacobi tree
])
@pytest.mark.real_model
def test_smollm2_greedy_matches_generate(smollm2, smol_refs, method, opts):
    prompts, refs = smol_refs
    if opts.get("draft_model") == "smollm2":  # the target drafting for itself: all accepted
        opts = dict(opts, draft_model=str(smollm2.path))
    g = selfspec.load(smollm2, method, self_test=method == "ar", **opts)
    mismatches = []
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        r = g.generate(p, max_new_tokens=MAX_NEW)
        if r.token_ids != ref:
            mismatches.append(i)
    assert not mismatches, f"{method}: prompts {mismatches} differ from transformers generate"


FAST_KERNEL_PROMPTS = 10


@pytest.fixture(scope="module", params=["onednn", "int8", "compact"])
def smol_fast(request):
    """A private SmolLM2 on a fast backend (the shared fixture stays on stock)."""
    from selfspec.kernels.compact import available as compact_available
    from selfspec.kernels.int8 import fast_cpu_int8
    from selfspec.models.loading import load_model

    if request.param == "compact" and compact_available(torch.device("cpu"), torch.float32):
        pytest.skip(compact_available(torch.device("cpu"), torch.float32))

    if request.param == "int8" and not fast_cpu_int8():
        pytest.skip("int8 here uses the exact but slow torch._int_mm fallback (this torch build has no exact "
                    "oneDNN int8 product); its exactness is covered by the tiny-model tests")
    target = load_model(bundled_path("smollm2-135m-instruct"), kernels=request.param)
    target.refs = None  # generate's ids on this same model (int8), computed once
    return target


@pytest.mark.parametrize("method,opts", [
    ("ar", {}),
    ("pld", {}),
    ("draft-model", {"draft_model": "self", "k": 4, "auto_k": False}),
])
@pytest.mark.real_model
def test_smollm2_fast_kernels_greedy(smol_fast, smol_refs, method, opts):
    """onednn and compact (fp32): identical to ``transformers`` ``generate`` on the stock fp32 model. int8: identical to
    ``generate`` on the same int8 model (it is a different model from the fp32 one)."""
    prompts, refs = smol_refs
    prompts = prompts[:FAST_KERNEL_PROMPTS]  # the stock tests above cover more
    if smol_fast.backend == "int8":
        if smol_fast.refs is None:
            smol_fast.refs = [hf_ids(smol_fast.model, p, MAX_NEW) for p in prompts]
        refs = smol_fast.refs
    if opts.get("draft_model") == "self":
        opts = dict(opts, draft_model=str(smol_fast.path))
    g = selfspec.load(smol_fast, method, self_test=method == "ar", **opts)
    mismatches = [i for i, (p, ref) in enumerate(zip(prompts, refs))
                  if g.generate(p, max_new_tokens=MAX_NEW).token_ids != ref]
    assert not mismatches, f"{method} on {smol_fast.backend}: prompts {mismatches} differ from generate"


@pytest.mark.slow
def test_qwen_1p5b_with_0p5b_draft_matches_generate():
    g = selfspec.load(bundled_path("qwen2.5-coder-1.5b-instruct"), "draft-model",
                      draft_model=bundled_path("qwen2.5-coder-0.5b-instruct"), k=3, auto_k=False)
    pld = selfspec.load(g.target, "pld", k=4, auto_k=False, self_test=False)
    ar = selfspec.load(g.target, "ar", self_test=False)
    model, tok = g.target.model, g.target.tokenizer
    for p in builtin()[:5]:
        ids = encode_prompt(tok, p.text, True, model.config.vocab_size)
        ref = hf_ids(model, ids, MAX_NEW)
        for gen in (ar, pld, g):
            assert gen.generate(ids, max_new_tokens=MAX_NEW).token_ids == ref, (gen.method, p.id)


SELF_SPEC_PROMPTS = 6  # of the 20; the tiny-model suite covers backends and skip sets broadly


@pytest.mark.parametrize("opts", [
    {"k": 3, "auto_k": False},  # the shipped skip config, drafting every step
    {"draft_exit": "gamma"},  # the paper's exit, backing off when drafts do not pay
], ids=["fixed-k", "gamma"])
@pytest.mark.real_model
def test_smollm2_self_spec_shipped_config(smollm2, smol_refs, opts):
    prompts, refs = smol_refs
    g = selfspec.load(smollm2, "self-spec", self_test=False, **opts)
    assert g.drafter.source.endswith("smollm2-135m-instruct.json")
    results = [g.generate(p, max_new_tokens=MAX_NEW) for p in prompts[:SELF_SPEC_PROMPTS]]
    mismatches = [i for i, (r, ref) in enumerate(zip(results, refs)) if r.token_ids != ref]
    assert not mismatches, f"self-spec: prompts {mismatches} differ from transformers generate"
    if opts.get("auto_k") is False:  # drafting every step: drafts were accepted
        assert sum(r.steps for r in results) < sum(r.new_tokens for r in results)


EAGLE_PROMPTS = 2


@pytest.mark.real_model
def test_smollm2_eagle_random_head_full_trees(smollm2, smol_refs):
    """A random head on the real model with the paper's tree shape (fewer nodes): deep trees of
    (mostly wrong) drafts, verified with tree masks on a real 30-layer model."""
    prompts, refs = smol_refs
    g = selfspec.load(smollm2, "eagle2", head="random:0", top_k=10, depth=3, total_tokens=24, min_prob=0.0,
                      self_test=False)
    for p, ref in zip(prompts[:EAGLE_PROMPTS], refs):
        assert g.generate(p, max_new_tokens=MAX_NEW).token_ids == ref


@pytest.mark.parametrize("method", ["eagle2", "hass"])
@pytest.mark.real_model
def test_smollm2_shipped_heads(smollm2, smol_refs, method):
    """The heads shipped in the package (`--method eagle2|hass` with no --head), on trees that
    always draft: identical to generate, and their drafts are accepted."""
    from selfspec.heads import shipped_head_dir

    prompts, refs = smol_refs
    g = selfspec.load(smollm2, method, total_tokens=16, top_k=4, depth=3, self_test=False)
    assert g.drafter.source == str(shipped_head_dir("smollm2-135m-instruct", method))
    results = [g.generate(p, max_new_tokens=MAX_NEW) for p in prompts]
    assert [r.token_ids for r in results] == refs
    assert sum(r.new_tokens for r in results) / sum(r.steps for r in results) > 1.2  # drafts are accepted


def shipped_finetune(method: str):
    """``smollm2-135m-instruct-<method>`` built from the default model and the adapter shipped in
    the package (skips, naming the build script, when none is shipped)."""
    from selfspec.models.bundled import adapter_dir
    from selfspec.models.loading import load_model

    name = f"smollm2-135m-instruct-{method}"
    if not (adapter_dir(name) / "selfspec_finetune.json").is_file():
        pytest.skip(f"no shipped {method} adapter (bash scripts/train_{method}.sh)")
    return load_model(bundled_path(name))


@pytest.fixture(scope="module")
def smol_sdsat():
    """The bundled SDSAT fine-tune, built from the default model and the shipped adapter."""
    return shipped_finetune("sdsat")


@pytest.mark.real_model
def test_smollm2_sdsat_finetune_greedy(smol_sdsat):
    """On the shipped fine-tune: sdsat (fixed k and cost-sized) == ar == generate, the adaptive
    token never appears, and drafts are accepted (the fine-tune learned to draft)."""
    import json

    meta = json.loads((smol_sdsat.path / "selfspec_finetune.json").read_text())
    adaptive = set(meta["new_ids"])
    prompts = [encode_prompt(smol_sdsat.tokenizer, p.text, True, smol_sdsat.model.config.vocab_size)
               for p in builtin()][1::4]
    refs = [hf_ids(smol_sdsat.model, p, MAX_NEW) for p in prompts]
    accepted = 0
    for opts in ({"k": 4}, {}):
        g = selfspec.load(smol_sdsat, "sdsat", self_test=False, **opts)
        results = [g.generate(p, max_new_tokens=MAX_NEW) for p in prompts]
        assert [r.token_ids for r in results] == refs
        assert not adaptive & {t for r in results for t in r.token_ids}
        if opts:  # the fixed k = 4 drafts every step
            accepted = sum(c - 1 for r in results for c, d in zip(r.committed_per_step, r.drafted_per_step) if d > 0)
    assert accepted > 0


@pytest.fixture(scope="module")
def smol_space():
    """The bundled SPACE fine-tune, built from the default model and the shipped adapter."""
    return shipped_finetune("space")


@pytest.mark.real_model
def test_smollm2_space_finetune_greedy(smol_space):
    """On the shipped fine-tune: space (the paper's k = 5 and cost-sized) == ar == generate, the
    mask token never appears, and candidates are accepted (the fine-tune learned to draft)."""
    import json

    meta = json.loads((smol_space.path / "selfspec_finetune.json").read_text())
    prompts = [encode_prompt(smol_space.tokenizer, p.text, True, smol_space.model.config.vocab_size)
               for p in builtin()][1::4]
    refs = [hf_ids(smol_space.model, p, MAX_NEW) for p in prompts]
    accepted = 0
    for opts in ({"k": 5}, {}):
        g = selfspec.load(smol_space, "space", self_test=False, **opts)
        results = [g.generate(p, max_new_tokens=MAX_NEW) for p in prompts]
        assert [r.token_ids for r in results] == refs
        assert not set(meta["new_ids"]) & {t for r in results for t in r.token_ids}
        if opts:
            accepted = sum(c - 1 for r in results for c in r.committed_per_step[1:])
    assert accepted > 0


@pytest.fixture(scope="module")
def smol_msn():
    """The bundled MSN fine-tune, built from the default model and the shipped adapter."""
    return shipped_finetune("msn")


@pytest.mark.real_model
def test_smollm2_msn_finetune_greedy(smol_msn):
    """On the shipped MSN fine-tune: jacobi (m = 4) and msn (the paper's 68-node tree and the
    cost-sized one) == ar == generate, and guesses are accepted."""
    prompts = [encode_prompt(smol_msn.tokenizer, p.text, True, smol_msn.model.config.vocab_size)
               for p in builtin()][1::4]
    refs = [hf_ids(smol_msn.model, p, MAX_NEW) for p in prompts]
    accepted = 0
    for method, opts in (("jacobi", {"m": 4, "auto_m": False}), ("msn", {"tree_size": 68}), ("msn", {})):
        g = selfspec.load(smol_msn, method, self_test=False, **opts)
        results = [g.generate(p, max_new_tokens=MAX_NEW) for p in prompts]
        assert [r.token_ids for r in results] == refs, f"{method} {opts}"
        accepted += sum(c - 1 for r in results for c in r.committed_per_step[1:])
    assert accepted > 0
