"""`selfspec export --engine vllm|sglang|eagle`: loader-rule tests.

For each engine, the draft model is built here as that engine's published loading code builds it
from the exported ``config.json`` (module names, bias rules, norms at layer 0, architectures
mapping, RoPE base), then the export must load strictly into it (no missing or unexpected key,
no shape mismatch), an emulation of the engine's forward on the exported tensors must compute the
head's function, and ``import_eagle`` must give the head back with identical outputs. Llama and
Qwen2 targets, with and without an fc bias, with and without a reduced draft vocabulary.

The rules below were read from the engines' code (never imported, never copied):

vLLM (EAGLE-1/2 draft: ``--speculative-config '{"method": "eagle", ...}'``)
  - ``vllm/transformers_utils/configs/eagle.py`` ``EAGLEConfig``: each ``architectures`` entry A
    becomes ``EagleA`` (unless it starts with ``Eagle``); ``vllm/model_executor/models/registry.py``
    ``_SPECULATIVE_DECODING_MODELS`` has ``EagleLlamaForCausalLM`` (``llama_eagle``) and no EAGLE-1
    class for Qwen2.
  - ``vllm/model_executor/models/llama_eagle.py`` ``LlamaModel``: ``fc = Linear(2H, H, bias=False)``
    (a checkpoint ``fc.bias`` has no parameter: ``params_dict`` KeyError); layer 0's
    ``input_layernorm`` is deleted (identity); ``embed_tokens`` is skipped by ``load_weights`` when
    pipeline parallelism is 1, while ``utils.process_eagle_weight`` marks a draft that ships one
    as having its own embedding (so it stays uninitialised); ``EagleLlamaForCausalLM`` has no
    ``lm_head`` (the proposer shares the target's), hence no reduced vocabulary and no ``d2t``.
  - ``vllm/model_executor/models/llama.py`` ``LlamaDecoderLayer``: ``attention_bias = attention_bias
    or bias`` gives q/k/v and o biases; ``qkv_bias``, when present, overrides q/k/v only; MLP bias
    ``mlp_bias``; ``head_dim = config.head_dim or H // heads``; RoPE from ``rope_parameters``
    (filled from ``rope_theta`` on transformers 4); a ``layer_types`` list is indexed with the
    draft layer's global index (target layers + i), so it must be absent.
SGLang (``--speculative-algorithm EAGLE``)
  - ``python/sglang/srt/models/llama_eagle.py`` ``LlamaForCausalLMEagle`` and ``qwen2_eagle.py``
    ``Qwen2ForCausalLMEagle`` (``EntryClass``, chosen by ``architectures``, no renaming):
    ``fc = nn.Linear(2H, H)`` (always a bias; ``load_weights`` never reports a missing one, it keeps
    its random init); layer 0's ``input_layernorm`` deleted; ``load_weights`` drops names with
    ``lm_head``; the lm_head is the target's (``speculative/eagle_worker.py``
    ``set_embed_and_head``), sliced to ``--speculative-token-map`` ids (a ``torch.save`` list,
    ``load_token_map``) with ``hot_vocab_size`` sizing the untied head only.
  - ``python/sglang/srt/models/llama.py`` ``LlamaDecoderLayer``: q/k/v and o biases iff
    ``attention_bias or bias``; MLP without bias; ``head_dim = getattr(config, "head_dim", H //
    heads)``; ``rope_theta = getattr(config, "rope_theta", 10000)``; unknown ``.bias`` names are
    skipped silently. ``qwen2.py``: q/k/v biases always, o never, MLP never, ``head_dim = H //
    heads``, ``rope_theta`` default 1e6.
EAGLE (SafeAILab, ``EaModel.from_pretrained(use_eagle3=False, ...)``)
  - ``eagle/model/ea_model.py``: ``bias = config.json["bias"]`` (default True) is the fc bias;
    ``load_state_dict(strict=False)`` (a mismatch is dropped silently: hence the strict check
    here); the draft is cast to the base's dtype; the base's ``lm_head`` is used.
  - ``eagle/model/cnets1.py`` ``Model``: ``embed_tokens`` (loaded from the base by ``load_emb``, or
    from the checkpoint), ``fc = Linear(2H, H, bias=bias)``, ``LlamaDecoderLayer(config, index)``
    with ``input_layernorm`` only when ``index != 0``; ``LlamaAttention``: ``head_dim = H // heads``,
    q/k/v bias ``config.qkv_bias`` when present else none, ``o_proj`` never; RoPE base
    ``rope_theta`` when present else 10000 (non-persistent buffers); ``LlamaMLP`` without bias; no
    ``d2t``. ``eagle/model/configs.py`` ``EConfig``: ``rope_scaling`` None or
    ``{"type": linear|dynamic, "factor"}``.
All three read ``config.json`` with transformers 4 semantics (EAGLE's setup.py pins 4.46.2; on transformers 5
``rope_theta`` is folded into ``rope_parameters`` and ``getattr(config, "rope_theta", 10000)``
would fall back to 10000), so a JSON key is the attribute the loader sees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from selfspec.errors import SelfspecError
from selfspec.heads.checkpoints import TOKEN_MAP_FILE, exported_draft_ids, import_eagle
from selfspec.heads.eagle import EagleHead, load_head
from selfspec.heads.export import export_head

from ..conftest import VOCAB, bundled_path, tiny_model

ENGINES = ("vllm", "sglang", "eagle")
THETA = 50000.0  # not any loader's default, so a RoPE base read from the wrong key shows


# -- the engines' draft models, built from an exported config.json (rules: module docstring) ---------


@dataclass
class DraftModel:
    """What an engine builds from an exported ``config.json``.

    Attributes:
        cls: the class the engine instantiates.
        params: checkpoint name -> shape of every parameter it fills from the checkpoint.
        from_target: parameters it takes from the target (absent from the file, or overwritten).
        fc_bias / qkv_bias / o_bias: the bias rules' outcome (for the forward emulation).
        rope_theta: the RoPE base its layer uses.
        eps: the RMSNorm epsilon.
    """

    cls: str
    params: dict[str, tuple] = field(default_factory=dict)
    from_target: dict[str, tuple] = field(default_factory=dict)
    fc_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    rope_theta: float = 10000.0
    eps: float = 1e-6


def _layer(prefix: str, h: int, heads: int, kv: int, hd: int, inter: int, qkv: bool, o: bool, mlp: bool,
           input_norm: bool) -> dict[str, tuple]:
    p = {f"{prefix}self_attn.q_proj.weight": (heads * hd, h), f"{prefix}self_attn.k_proj.weight": (kv * hd, h),
         f"{prefix}self_attn.v_proj.weight": (kv * hd, h), f"{prefix}self_attn.o_proj.weight": (h, heads * hd),
         f"{prefix}mlp.gate_proj.weight": (inter, h), f"{prefix}mlp.up_proj.weight": (inter, h),
         f"{prefix}mlp.down_proj.weight": (h, inter), f"{prefix}post_attention_layernorm.weight": (h,)}
    if qkv:
        p |= {f"{prefix}self_attn.q_proj.bias": (heads * hd,), f"{prefix}self_attn.k_proj.bias": (kv * hd,),
              f"{prefix}self_attn.v_proj.bias": (kv * hd,)}
    if o:
        p[f"{prefix}self_attn.o_proj.bias"] = (h,)
    if mlp:
        p |= {f"{prefix}mlp.gate_proj.bias": (inter,), f"{prefix}mlp.up_proj.bias": (inter,),
              f"{prefix}mlp.down_proj.bias": (h,)}
    if input_norm:
        p[f"{prefix}input_layernorm.weight"] = (h,)
    return p


def _dims(cfg: dict) -> tuple[int, int, int, int]:
    return cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("num_key_value_heads") or \
        cfg["num_attention_heads"], cfg["intermediate_size"]


def vllm_draft(cfg: dict) -> DraftModel:
    """vLLM ``llama_eagle.py`` / ``llama.py`` / ``configs/eagle.py`` / ``registry.py``."""
    archs = [a if a.startswith("Eagle") else f"Eagle{a}" for a in cfg.get("architectures") or []]
    assert archs and archs[0] in {"EagleLlamaForCausalLM"}, f"vLLM has no EAGLE-1 model {archs}"
    assert not cfg.get("layer_types"), "layer_types is indexed with the draft's global layer index"
    h, heads, kv, inter = _dims(cfg)
    hd = cfg.get("head_dim") or h // heads
    attn_bias = bool(cfg.get("attention_bias", False) or cfg.get("bias", False))
    qkv = bool(cfg["qkv_bias"]) if "qkv_bias" in cfg else attn_bias
    m = DraftModel(archs[0], fc_bias=False, qkv_bias=qkv, o_bias=attn_bias, eps=cfg["rms_norm_eps"])
    m.params = {"fc.weight": (h, 2 * h)}
    for i in range(cfg["num_hidden_layers"]):
        m.params |= _layer(f"layers.{i}.", h, heads, kv, hd, inter, qkv, attn_bias, bool(cfg.get("mlp_bias")), i > 0)
    # embed_tokens and lm_head: the target's; a checkpoint copy is not loaded yet disables sharing
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    assert cfg.get("rope_theta", theta) == theta, "rope_theta and rope_parameters disagree"
    m.rope_theta = float(theta)
    return m


def sglang_draft(cfg: dict) -> DraftModel:
    """SGLang ``llama_eagle.py`` / ``qwen2_eagle.py`` / ``llama.py`` / ``qwen2.py``."""
    cls = (cfg.get("architectures") or [None])[0]
    assert cls in {"LlamaForCausalLMEagle", "Qwen2ForCausalLMEagle"}, f"SGLang has no EAGLE model {cls}"
    h, heads, kv, inter = _dims(cfg)
    if cls == "Qwen2ForCausalLMEagle":
        hd, qkv, o, theta = h // heads, True, False, cfg.get("rope_theta", 1000000.0)
    else:
        bias = bool(cfg.get("attention_bias", False) or cfg.get("bias", False))
        hd, qkv, o, theta = cfg.get("head_dim", h // heads), bias, bias, cfg.get("rope_theta", 10000.0)
    assert "hot_vocab_size" not in cfg, "hot_vocab_size comes from --speculative-token-map"
    assert not cfg.get("tie_word_embeddings"), "the token map sizes an untied lm_head only"
    m = DraftModel(cls, fc_bias=True, qkv_bias=qkv, o_bias=o, rope_theta=float(theta), eps=cfg["rms_norm_eps"])
    m.params = {"fc.weight": (h, 2 * h), "fc.bias": (h,)}
    for i in range(cfg["num_hidden_layers"]):
        m.params |= _layer(f"layers.{i}.", h, heads, kv, hd, inter, qkv, o, False, i > 0)
    m.from_target = {"embed_tokens.weight": (cfg["vocab_size"], h)}  # set_embed_and_head overwrites it
    return m


def eagle_draft(cfg: dict) -> DraftModel:
    """SafeAILab EAGLE ``ea_model.py`` / ``cnets1.py`` / ``configs.py`` (``use_eagle3=False``)."""
    scaling = cfg.get("rope_scaling")
    assert scaling is None or (set(scaling) == {"type", "factor"} and scaling["type"] in ("linear", "dynamic")), \
        f"EConfig refuses rope_scaling {scaling}"
    h, heads, kv, inter = _dims(cfg)
    fc_bias = bool(cfg.get("bias", True))
    qkv = bool(cfg["qkv_bias"]) if "qkv_bias" in cfg else False
    m = DraftModel("cnets1.Model", fc_bias=fc_bias, qkv_bias=qkv, o_bias=False,
                   rope_theta=float(cfg.get("rope_theta", 10000.0)), eps=cfg["rms_norm_eps"])
    m.params = {"fc.weight": (h, 2 * h)} | ({"fc.bias": (h,)} if fc_bias else {})
    for i in range(cfg["num_hidden_layers"]):
        m.params |= _layer(f"layers.{i}.", h, heads, kv, h // heads, inter, qkv, False, False, i > 0)
    m.from_target = {"embed_tokens.weight": (cfg["vocab_size"], h)}  # load_emb reads the base's
    return m


DRAFTS = {"vllm": vllm_draft, "sglang": sglang_draft, "eagle": eagle_draft}


def strict_load(model: DraftModel, shapes: dict[str, tuple]) -> tuple[list, list, list]:
    """Missing, unexpected and shape-mismatched names of a checkpoint for ``model``."""
    known = model.params | model.from_target
    missing = sorted(set(model.params) - set(shapes))
    unexpected = sorted(set(shapes) - set(known))
    mismatched = sorted(k for k in set(shapes) & set(known) if tuple(shapes[k]) != tuple(known[k]))
    return missing, unexpected, mismatched


def read_export(path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


# -- an engine's forward, emulated from the rules on the exported tensors (float64) -----------------


def _rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (all three engines) of ``x`` ``[T, heads, hd]`` at positions 0..T-1."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


def engine_forward(m: DraftModel, cfg: dict, t: dict[str, torch.Tensor], emb: torch.Tensor, feat: torch.Tensor):
    """One draft step over T positions as the engine's module tree computes it: ``[T, H]`` -> ``[T, H]``."""
    t = {k: v.double() for k, v in t.items()}
    h, heads, kv, _ = _dims(cfg)
    hd = t["layers.0.self_attn.q_proj.weight"].shape[0] // heads
    lin = lambda x, n, b: x @ t[f"{n}.weight"].T + (t[f"{n}.bias"] if b else 0)  # noqa: E731
    x = lin(torch.cat([emb, feat], -1), "fc", m.fc_bias)
    a = "layers.0.self_attn."
    q = _rope(lin(x, a + "q_proj", m.qkv_bias).view(-1, heads, hd), m.rope_theta)
    k = _rope(lin(x, a + "k_proj", m.qkv_bias).view(-1, kv, hd), m.rope_theta).repeat_interleave(heads // kv, 1)
    v = lin(x, a + "v_proj", m.qkv_bias).view(-1, kv, hd).repeat_interleave(heads // kv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    s = s.masked_fill(~torch.ones(len(x), len(x), dtype=torch.bool).tril(), float("-inf"))
    o = lin(torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(len(x), -1), a + "o_proj", m.o_bias)
    r = x + o  # layer 0: no input norm
    n = r * (r.pow(2).mean(-1, keepdim=True) + m.eps).rsqrt() * t["layers.0.post_attention_layernorm.weight"]
    g, u = lin(n, "layers.0.mlp.gate_proj", False), lin(n, "layers.0.mlp.up_proj", False)
    return r + lin(torch.nn.functional.silu(g) * u, "layers.0.mlp.down_proj", False)


# -- heads to export ---------------------------------------------------------------------------------


def make_target(family: str) -> torch.nn.Module:
    t = tiny_model(family, seed=4 if family == "llama" else 5)
    t.config.rope_parameters = {"rope_type": "default", "rope_theta": THETA}  # the head's rotary reads it
    return t


def save_head(target, path, fc_bias: bool, reduced: bool, seed: int = 0):
    """A random head (biases non-zero) saved as ``selfspec train hass`` does; ``reduced``: with an
    EAGLE-3-style reduced vocabulary (``d2t`` / ``t2d`` in the weights, ``draft_vocab_size`` in the
    metadata) written by hand. Returns the head and the draft vocabulary's target ids."""
    torch.manual_seed(seed)
    head = EagleHead(target, bias=fc_bias)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    head.save(path, {"target": "tiny", "method": "hass"})
    if not reduced:
        return head, None
    ids = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:40].sort().values
    state = load_file(str(path / "model.safetensors"))
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[ids] = True
    state |= {"d2t": ids - torch.arange(len(ids)), "t2d": t2d}
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    meta = json.loads((path / "selfspec_head.json").read_text())
    (path / "selfspec_head.json").write_text(json.dumps({**meta, "draft_vocab_size": len(ids)}))
    return head, ids


def inputs(target, n: int = 6, seed: int = 1):
    torch.manual_seed(seed)
    feats = torch.randn(1, n, target.config.hidden_size)
    emb = target.get_input_embeddings()(torch.randint(4, VOCAB, (1, n)))
    return feats, emb


def head_out(head: EagleHead, target, dtype=torch.float32) -> torch.Tensor:
    feats, emb = inputs(target)
    n = feats.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        return head.to(dtype)(feats.to(dtype), emb.to(dtype), torch.arange(n)[None], mask)[0]


def rounded(head: EagleHead, target, dtype: torch.dtype) -> EagleHead:
    """The head with its weights rounded to ``dtype`` (what an export in that dtype holds)."""
    ref = EagleHead(target, bias=head.fc.bias is not None)
    ref.load_state_dict({k: v.to(dtype).to(torch.float32) for k, v in head.state_dict().items()})
    return ref.eval()


# -- the tests ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def targets():
    return {f: make_target(f) for f in ("llama", "qwen2")}


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("fc_bias", [True, False], ids=["fc-bias", "no-fc-bias"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("engine", ENGINES)
def test_export_loads_strictly_computes_the_head_and_round_trips(engine, family, fc_bias, reduced, targets,
                                                                  tmp_path):
    target = targets[family]
    head, ids = save_head(target, tmp_path / "h", fc_bias, reduced)
    dtype = torch.float16
    res = export_head(tmp_path / "h", target, engine, tmp_path / engine, "fp16")
    cfg, tensors = read_export(res.out)
    modes = {f.name: f.stat().st_mode & 0o777 for f in res.out.iterdir()}
    assert len(set(modes.values())) == 1, modes  # the weights as readable as config.json (not 0600)

    # the engine's module tree, and a strict load into it
    model = DRAFTS[engine](cfg)
    missing, unexpected, mismatched = strict_load(model, {k: tuple(v.shape) for k, v in tensors.items()})
    assert (missing, unexpected, mismatched) == ([], [], []), model.cls
    assert not any("input_layernorm" in k for k in tensors) and cfg["num_hidden_layers"] == 1
    assert {v.dtype for v in tensors.values()} == {dtype} and cfg["torch_dtype"] == "float16"
    assert model.rope_theta == THETA and cfg["rope_parameters"]["rope_theta"] == cfg["rope_theta"] == THETA
    assert model.cls == {"vllm": "EagleLlamaForCausalLM", "eagle": "cnets1.Model",
                         "sglang": "Qwen2ForCausalLMEagle" if family == "qwen2" else "LlamaForCausalLMEagle"}[engine]

    # the engine's forward on the exported tensors computes the head (rounded to the export dtype)
    ref = rounded(head, target, dtype)
    feats, emb = inputs(target)
    got = engine_forward(model, cfg, tensors, emb[0].double(), feats[0].double())
    want = head_out(ref, target, torch.float64)
    folded = engine == "vllm" and fc_bias  # q/k/v/o biases rounded once more
    torch.testing.assert_close(got, want, rtol=1e-3 if folded else 1e-5, atol=1e-3 if folded else 1e-5)

    # the reduced vocabulary: held as SGLang's token map, refused (full vocabulary) by the others
    assert not {"d2t", "t2d", "lm_head.weight", "embed_tokens.weight"} & set(tensors)
    if ids is None:
        assert exported_draft_ids(res.out) is None and not any("vocabulary" in n for n in res.notes)
    elif engine == "sglang":
        assert torch.equal(exported_draft_ids(res.out), ids) and TOKEN_MAP_FILE in res.files
        assert type(torch.load(res.out / TOKEN_MAP_FILE, weights_only=True)) is list
    else:
        assert exported_draft_ids(res.out) is None
        assert any("drafts over the full vocabulary" in n for n in res.notes)
    assert sorted(p.name for p in res.out.iterdir()) == sorted(res.files)

    # back through import_eagle: the same head, identical outputs (the vLLM fold of a Qwen2 head's
    # own q/k/v biases is undone up to one fp16 rounding)
    back = import_eagle(res.out, target)
    assert (back.fc.bias is not None) == fc_bias
    if folded and family == "qwen2":
        torch.testing.assert_close(head_out(back, target), head_out(ref, target), rtol=1e-3, atol=1e-3)
    else:
        assert torch.equal(head_out(back, target), head_out(ref, target))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_old_single_layout_fails_vllm_and_sglang(family, targets, tmp_path):
    """The rules have teeth: the EAGLE export (fc bias + ``bias: true``, the former one-size layout)
    does not load into vLLM's or SGLang's draft (the issue's table)."""
    target = targets[family]
    save_head(target, tmp_path / "h", True, False)
    cfg, tensors = read_export(export_head(tmp_path / "h", target, "eagle", tmp_path / "e").out)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    cfg_v = {**cfg, "layer_types": None}
    missing, unexpected, _ = strict_load(vllm_draft(cfg_v | {"architectures": ["LlamaForCausalLM"]}), shapes)
    assert "fc.bias" in unexpected and "layers.0.self_attn.o_proj.bias" in missing  # bias read as attention bias
    with pytest.raises(AssertionError, match="no EAGLE model"):
        sglang_draft(cfg)  # architectures must name the EAGLE class
    arch = "Qwen2ForCausalLMEagle" if family == "qwen2" else "LlamaForCausalLMEagle"
    missing, _, _ = strict_load(sglang_draft({**cfg, "architectures": [arch], "tie_word_embeddings": False}), shapes)
    assert family == "qwen2" or "layers.0.self_attn.o_proj.bias" in missing
    if family == "llama":  # without rope_theta, SGLang and EAGLE fall back to 10000
        no_theta = {k: v for k, v in cfg.items() if k != "rope_theta"}
        assert eagle_draft(no_theta).rope_theta == 10000.0


def test_what_an_engine_cannot_hold_is_one_line(targets, tmp_path):
    target = targets["llama"]
    save_head(target, tmp_path / "h", True, False)
    for engine in ("vllm", "sglang"):
        with pytest.raises(SelfspecError, match="drop --with-embeddings") as e:
            export_head(tmp_path / "h", target, engine, tmp_path / engine, with_embeddings=True)
        assert "\n" not in str(e.value)
    res = export_head(tmp_path / "h", target, "eagle", tmp_path / "e", "bf16", with_embeddings=True)
    t = load_file(str(res.out / "model.safetensors"))
    assert t["embed_tokens.weight"].dtype == torch.bfloat16 and eagle_draft(read_export(res.out)[0])
    with pytest.raises(SelfspecError, match="--engine must be one of"):
        export_head(tmp_path / "h", target, "tgi", tmp_path / "x")
    # a target family none of the EAGLE-1/2 loaders covers (Qwen3: q/k norms)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    q3 = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    EagleHead(q3).save(tmp_path / "q3", {"target": "q3", "method": "hass"})
    for engine in ENGINES:
        with pytest.raises(SelfspecError, match=f"{engine} has no EAGLE-1/2 draft model for qwen3"):
            export_head(tmp_path / "q3", q3, engine, tmp_path / "o")
    # EAGLE's cnets1 has no o_proj bias and no llama3 RoPE scaling
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama(**kw):
        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            **kw)).eval()

    ab = llama(attention_bias=True)
    EagleHead(ab).save(tmp_path / "ab", {"target": "ab", "method": "hass"})
    with pytest.raises(SelfspecError, match="o_proj and the MLP without biases"):
        export_head(tmp_path / "ab", ab, "eagle", tmp_path / "o")
    for engine in ("vllm", "sglang"):  # both hold q/k/v/o biases
        cfg, tensors = read_export(export_head(tmp_path / "ab", ab, engine, tmp_path / engine).out)
        assert strict_load(DRAFTS[engine](cfg), {k: tuple(v.shape) for k, v in tensors.items()}) == ([], [], [])
    l3 = llama(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    EagleHead(l3).save(tmp_path / "l3", {"target": "l3", "method": "hass"})
    with pytest.raises(SelfspecError, match="linear and dynamic RoPE scaling only"):
        export_head(tmp_path / "l3", l3, "eagle", tmp_path / "o")
    cfg = read_export(export_head(tmp_path / "l3", l3, "sglang", tmp_path / "s").out)[0]
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"


def test_head_saved_with_a_draft_vocab_exports(targets, tmp_path):
    """A head saved through EagleHead.set_draft_vocab (the trainer's path) exports like the
    hand-built ones above: SGLang's token map holds its ids, vLLM drafts over the full vocabulary."""
    from selfspec.core.draft_vocab import DraftVocab

    target = targets["llama"]
    head = EagleHead(target)
    head.set_draft_vocab(DraftVocab([0, 1, 2, 7, 9, 30, 95], VOCAB))
    head.save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    res = export_head(tmp_path / "h", target, "sglang", tmp_path / "s")
    assert exported_draft_ids(res.out).tolist() == [0, 1, 2, 7, 9, 30, 95]
    assert "--speculative-token-map" in res.notes[-1]
    res = export_head(tmp_path / "h", target, "vllm", tmp_path / "v")
    assert "reduced vocabulary (7 tokens) is not held" in res.notes[-1]


def test_inconsistent_reduced_vocabulary_is_refused(targets, tmp_path):
    target = targets["qwen2"]
    save_head(target, tmp_path / "h", True, True)
    meta = json.loads((tmp_path / "h" / "selfspec_head.json").read_text())
    (tmp_path / "h" / "selfspec_head.json").write_text(json.dumps({**meta, "draft_vocab_size": 7}))
    with pytest.raises(SelfspecError, match="inconsistent reduced vocabulary"):
        export_head(tmp_path / "h", target, "sglang", tmp_path / "s")


def test_cli_export(tiny_dir, tmp_path, capsys):
    from selfspec.cli import main
    from selfspec.models.loading import load_model

    target = load_model(str(tiny_dir)).model
    EagleHead(target).save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    for engine in ENGINES:
        assert main(["export", str(tmp_path / "h"), "--model", str(tiny_dir), "--engine", engine,
                     "--out", str(tmp_path / engine)]) == 0
        out = capsys.readouterr().out
        assert f"{engine} EAGLE draft: {tmp_path / engine}" in out and "float16" in out and "serve: " in out
        assert ("folded exactly into q/k/v/o biases" in out) == (engine == "vllm")
        assert strict_load(DRAFTS[engine](read_export(tmp_path / engine)[0]),
                           {k: tuple(v.shape) for k, v in read_export(tmp_path / engine)[1].items()}) == ([], [], [])
    with pytest.raises(SystemExit):  # --engine is required
        main(["export", str(tmp_path / "h"), "--model", str(tiny_dir), "--out", str(tmp_path / "x")])
    assert "--engine" in capsys.readouterr().err
    assert main(["export", "hass", "--model", str(tiny_dir), "--engine", "vllm", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no trained hass head" in err and err.count("\n") == 1


def test_export_refuses_an_out_it_cannot_use_before_loading(tiny_dir, tmp_path, capsys, monkeypatch):
    """A non-empty directory (a bench folder) used to be written into without a word, which made it
    unloadable as a draft model; an --out that cannot be created ended in NotADirectoryError. An
    earlier export there is replaced only with --force."""
    import selfspec.models.loading as loading
    from selfspec.cli import main
    from selfspec.models.loading import load_model

    EagleHead(load_model(str(tiny_dir)).model).save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    bench = tmp_path / "bench-out"
    bench.mkdir()
    (bench / "records.jsonl").write_text("{}\n")
    (tmp_path / "a-file").write_text("")
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model before refusing"))
    for out, says in [(bench, "is not empty (1 other entries, e.g. records.jsonl)"),
                      (tmp_path / "a-file" / "x", "is a file, not a directory")]:
        assert main(["export", str(tmp_path / "h"), "--model", str(tiny_dir), "--engine", "vllm",
                     "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("selfspec: error: --out ") and says in err
    assert (bench / "records.jsonl").read_text() == "{}\n" and len(list(bench.iterdir())) == 1
    monkeypatch.setattr(loading, "load_model", real)
    for force in ([], ["--force"]):  # into a new directory, then over that export
        assert main(["export", str(tmp_path / "h"), "--model", str(tiny_dir), "--engine", "eagle",
                     "--out", str(tmp_path / "e"), *force]) == 0
        out = capsys.readouterr().out.splitlines()
        if not force:  # again without --force: refused, the export left as it was
            before = {p.name: p.read_bytes() for p in (tmp_path / "e").iterdir()}
            assert main(["export", str(tmp_path / "h"), "--model", str(tiny_dir), "--engine", "eagle",
                         "--out", str(tmp_path / "e")]) == 2
            assert "holds an earlier export; pass --force" in capsys.readouterr().err
            assert {p.name: p.read_bytes() for p in (tmp_path / "e").iterdir()} == before
        serve = next(i for i, line in enumerate(out) if line.startswith("serve:"))
        assert all(not line.startswith("note:") for line in out[serve:])  # notes come before the command


def test_train_no_fc_bias_gives_a_head_vllm_holds_as_is(tiny_dir, tmp_path, monkeypatch, capsys):
    """`selfspec train hass --no-fc-bias`: fc without a bias, so the vLLM export needs no fold."""
    import selfspec.train.pipeline as pipeline
    from selfspec.cli import main

    from ..conftest import WORDS

    monkeypatch.setattr(pipeline, "evaluation_prompts", lambda: ["w1 w2 w3 w4 w5 w6"])
    data = tmp_path / "conv.jsonl"
    data.write_text("".join(json.dumps({"id": f"c{i}", "messages": [
        {"role": "user", "content": " ".join(WORDS[i:i + 4])},
        {"role": "assistant", "content": " ".join(WORDS[i + 4:i + 16])}]}) + "\n" for i in range(8)))
    common = ["--model", str(tiny_dir), "--data", str(data), "--max-len", "32", "--epochs", "1", "--no-progress"]
    assert main(["train", "hass", *common, "--out", str(tmp_path / "h"), "--no-fc-bias"]) == 0
    assert "fc.bias" not in load_file(str(tmp_path / "h" / "model.safetensors"))
    assert main(["export", str(tmp_path / "h"), "--model", str(tiny_dir), "--engine", "vllm",
                 "--out", str(tmp_path / "v")]) == 0
    assert "folded" not in capsys.readouterr().out
    assert not any(k.endswith(".bias") for k in read_export(tmp_path / "v")[1])
    # continuing from a head with an fc bias while asking for none: one line
    from selfspec.models.loading import load_model

    EagleHead(load_model(str(tiny_dir)).model).save(tmp_path / "b", {"target": "tiny", "method": "hass"})
    assert main(["train", "hass", *common, "--out", str(tmp_path / "c"), "--features", str(tmp_path / "h" / "features"),
                 "--init", str(tmp_path / "b"), "--no-fc-bias"]) == 2
    assert "has an fc bias" in capsys.readouterr().err


@pytest.mark.real_model
@pytest.mark.parametrize("engine", ENGINES)
def test_real_smollm2_installed_head(engine, tmp_path, capsys):
    """`selfspec export hass --model smollm2-135m-instruct --engine E`: the shipped fp16 HASS head,
    exported in fp16, loads strictly into each engine's draft at RoPE base 100000, and comes back
    through import_eagle bit-identical."""
    from selfspec.cli import main
    from selfspec.heads import find_head_dir
    from selfspec.models.loading import load_model

    path = bundled_path("smollm2-135m-instruct")
    assert main(["export", "hass", "--model", path, "--engine", engine, "--out", str(tmp_path / engine)]) == 0
    out = capsys.readouterr().out
    target = load_model(path)
    cfg, tensors = read_export(tmp_path / engine)
    model = DRAFTS[engine](cfg)
    assert strict_load(model, {k: tuple(v.shape) for k, v in tensors.items()}) == ([], [], [])
    assert model.rope_theta == 100000.0 and {v.dtype for v in tensors.values()} == {torch.float16}
    shipped, _ = load_head(find_head_dir(target.name, "hass"), target.model)
    back = import_eagle(tmp_path / engine, target.model)
    assert torch.equal(head_out(back, target.model), head_out(shipped, target.model))
    feats, emb = inputs(target.model)
    torch.testing.assert_close(engine_forward(model, cfg, tensors, emb[0].double(), feats[0].double()),
                               head_out(shipped, target.model, torch.float64), rtol=2e-2, atol=2e-2)
    if engine == "eagle":
        assert "shard index" in out  # the bundled SmolLM2 is one file: the note says how to serve it
    with safe_open(str(tmp_path / engine / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == len(tensors)


# -- EAGLE-3 heads (`selfspec train hass --arch eagle3`): vLLM and SGLang `llama_eagle3.py` -----------
#
# Rules read from the engines' code (never imported, never copied):
# vLLM (``--speculative-config '{"method": "eagle3", ...}'``)
#   - ``vllm/model_executor/models/registry.py``: ``LlamaForCausalLMEagle3`` and ``Eagle3LlamaForCausalLM``
#     -> ``llama_eagle3.Eagle3LlamaForCausalLM``; ``vllm/transformers_utils/configs/eagle.py`` keeps an
#     architecture that starts or ends with ``Eagle3`` (else prefixes ``Eagle3``).
#   - ``vllm/model_executor/models/llama_eagle3.py``: ``load_weights`` renames ``midlayer.`` to ``layers.0.``,
#     prefixes ``model.`` to names without ``lm_head``, renames ``d2t`` to ``draft_id_to_target_id`` (int64
#     [draft_vocab_size]) and skips ``t2d``; an unknown name is a ``params_dict`` KeyError; ``embed_tokens``
#     is loaded only when shipped. ``LlamaModel``: ``fc = ReplicatedLinear(3 * target_hidden_size (else
#     3 * hidden_size), H, bias=False)`` when ``eagle_config.use_aux_hidden_state`` (default true); layer 0's
#     ``qkv_proj`` takes 2H (bias ``attention_bias``), ``o_proj`` bias ``attention_bias or bias``, MLP bias
#     ``mlp_bias``; ``input_layernorm`` on the embeddings, ``hidden_norm`` on the hidden state, residual =
#     the hidden state before ``hidden_norm`` unless ``norm_before_residual``; final ``norm``. The LM head
#     is ``[draft_vocab_size (default vocab_size), H]``; ``compute_logits`` scatters it to target ids
#     ``arange + d2t`` (-inf elsewhere). A ``layer_types`` list would be indexed with the target's layer count.
#   - aux layers: ``get_eagle3_aux_layers_from_config`` (``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py``)
#     reads a top-level ``eagle_aux_hidden_state_layer_ids``, else the target model's default ``(2, L // 2,
#     L - 3)``; ``llama.py`` ``LlamaModel.forward`` records ``hidden_states + residual`` *before* layer idx
#     for idx in that set: the input of layer idx, ``transformers``' ``hidden_states[idx]``.
# SGLang (``--speculative-algorithm EAGLE3``)
#   - ``python/sglang/srt/models/llama_eagle3.py`` ``LlamaForCausalLMEagle3`` (``EntryClass``): ``fc =
#     nn.Linear(3 * target_hidden_size (else hidden_size), H, bias=getattr(config, "bias", False))``;
#     ``midlayer``: ``llama.py`` ``LlamaDecoderLayer`` with ``qkv_proj`` over 2H without bias, ``o_proj`` bias
#     ``attention_bias or bias``, MLP without bias, plus ``hidden_norm``; ``norm``; ``lm_head`` ``[draft_vocab_size,
#     H]`` unless ``tie_word_embeddings`` (then the embedding), the target's when ``draft_vocab_size`` is None.
#     ``load_weights``: a name is looked up as is or under ``model.``, others are skipped silently (so a
#     missing tensor keeps its random init); ``d2t`` gives ``hot_token_id = d2t + arange``; ``t2d`` skipped.
#     ``set_embed`` takes the target's embedding. RoPE ``getattr(config, "rope_theta", 10000)``,
#     ``head_dim = getattr(config, "head_dim", H // heads)``.
#   - aux layers: the target's ``set_eagle3_layers_to_capture`` (``llama.py``, ``qwen2.py``, ...):
#     ``eagle_config.eagle_aux_hidden_state_layer_ids`` plus one (ids name layer outputs; SpecForge writes the
#     same convention, default ``[1, L // 2 - 1, L - 4]``), else ``[2, L // 2, L - 3]``; captured at the input
#     of that layer.

from selfspec.core.draft_vocab import DraftVocab  # noqa: E402
from selfspec.heads.checkpoints import import_eagle3  # noqa: E402
from selfspec.heads.eagle3 import Eagle3Head, default_feature_layers  # noqa: E402

AUX = "eagle_aux_hidden_state_layer_ids"
N_LAYERS = 6


@dataclass
class Eagle3Draft:
    """What an engine builds from an exported EAGLE-3 ``config.json``.

    Attributes:
        cls: the class it instantiates.
        params: checkpoint name -> shape of every tensor it fills from the checkpoint.
        ignored: checkpoint names its loader skips.
        from_target: tensors it takes from the target.
        layers: the target ``hidden_states`` indices it fuses, low to high.
        rope_theta / eps / o_bias: as :class:`DraftModel`.
    """

    cls: str
    params: dict[str, tuple] = field(default_factory=dict)
    ignored: set[str] = field(default_factory=set)
    from_target: dict[str, tuple] = field(default_factory=dict)
    layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    eps: float = 1e-6
    o_bias: bool = False


def _midlayer(h: int, heads: int, kv: int, hd: int, inter: int, qkv: bool, o: bool, mlp: bool) -> dict[str, tuple]:
    p = _layer("midlayer.", h, heads, kv, hd, inter, qkv, o, mlp, True)
    for n in ("q", "k", "v"):  # attention over [embedding; hidden]
        key = f"midlayer.self_attn.{n}_proj.weight"
        p[key] = (p[key][0], 2 * h)
    p["midlayer.hidden_norm.weight"] = (h,)
    return p


def vllm_eagle3_draft(cfg: dict, target_layers: int) -> Eagle3Draft:
    """vLLM ``llama_eagle3.py`` / ``registry.py`` / ``configs/eagle.py`` / ``eagle3_utils.py`` / ``llama.py``."""
    archs = [a if a.startswith("Eagle3") or a.endswith("Eagle3") else f"Eagle3{a}" for a in cfg["architectures"]]
    assert archs[0] in {"Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"}, f"vLLM has no EAGLE-3 model {archs}"
    assert not cfg.get("layer_types"), "layer_types is indexed with the target's layer count"
    assert not cfg.get("norm_before_residual"), "the residual is the hidden state before hidden_norm"
    h, heads, kv, inter = _dims(cfg)
    hd = cfg.get("head_dim") or h // heads
    o_bias = bool(cfg.get("attention_bias", False) or cfg.get("bias", False))
    n = cfg.get("draft_vocab_size") or cfg["vocab_size"]
    m = Eagle3Draft(archs[0], ignored={"t2d"}, o_bias=o_bias, eps=cfg["rms_norm_eps"])
    if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state", True):
        m.params["fc.weight"] = (h, 3 * (cfg.get("target_hidden_size") or h))
    m.params |= _midlayer(h, heads, kv, hd, inter, bool(cfg.get("attention_bias")), o_bias, bool(cfg.get("mlp_bias")))
    m.params |= {"norm.weight": (h,), "lm_head.weight": (n, h), "d2t": (n,)}
    m.from_target = {"embed_tokens.weight": (cfg["vocab_size"], h)}  # shared unless shipped
    ids = cfg.get(AUX)
    m.layers = tuple(ids) if ids else (2, target_layers // 2, target_layers - 3)
    params = cfg.get("rope_parameters") or {}
    m.rope_theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    return m


def sglang_eagle3_draft(cfg: dict, target_layers: int) -> Eagle3Draft:
    """SGLang ``llama_eagle3.py`` / ``llama.py`` (draft layer and the target's layer capture)."""
    cls = (cfg.get("architectures") or [None])[0]
    assert cls == "LlamaForCausalLMEagle3", f"SGLang has no EAGLE-3 model {cls}"
    assert cfg.get("draft_vocab_size"), "without draft_vocab_size the draft takes the target's LM head"
    h, heads, kv, inter = _dims(cfg)
    o_bias = bool(cfg.get("attention_bias", False) or cfg.get("bias", False))
    m = Eagle3Draft(cls, ignored={"t2d"}, o_bias=o_bias, rope_theta=float(cfg.get("rope_theta", 10000.0)),
                    eps=cfg["rms_norm_eps"])
    m.params = {"fc.weight": (h, 3 * (cfg.get("target_hidden_size") or h))}
    if cfg.get("bias", False):
        m.params["fc.bias"] = (h,)
    m.params |= _midlayer(h, heads, kv, cfg.get("head_dim", h // heads), inter, False, o_bias, False)
    m.params |= {"norm.weight": (h,), "d2t": (cfg["draft_vocab_size"],)}
    if cfg.get("tie_word_embeddings"):
        m.from_target["lm_head.weight"] = (cfg["vocab_size"], h)  # the (target's) embedding
    else:
        m.params["lm_head.weight"] = (cfg["draft_vocab_size"], h)
    m.from_target["embed_tokens.weight"] = (cfg["vocab_size"], h)  # set_embed
    ids = (cfg.get("eagle_config") or {}).get(AUX)
    m.layers = tuple(i + 1 for i in ids) if ids else (2, target_layers // 2, target_layers - 3)
    return m


EAGLE3_DRAFTS = {"vllm": vllm_eagle3_draft, "sglang": sglang_eagle3_draft}


def strict_load3(m: Eagle3Draft, shapes: dict[str, tuple]) -> tuple[list, list, list]:
    known = m.params | m.from_target
    missing = sorted(set(m.params) - set(shapes))
    unexpected = sorted(set(shapes) - set(known) - m.ignored)
    mismatched = sorted(k for k in set(shapes) & set(known) if tuple(shapes[k]) != tuple(known[k]))
    return missing, unexpected, mismatched


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * w


def engine_forward3(m: Eagle3Draft, cfg: dict, t: dict[str, torch.Tensor], emb: torch.Tensor, aux: torch.Tensor,
                    vocab_size: int) -> torch.Tensor:
    """One draft step over T positions as the engine computes it, float64: ``[T, 3·H_t]`` fused
    features and ``[T, H]`` embeddings -> ``[T, V]`` logits over the target vocabulary (-inf outside
    the draft vocabulary)."""
    d2t = t["d2t"].long()
    t = {k: v.double() for k, v in t.items() if v.is_floating_point()}
    h_, heads, kv, _ = _dims(cfg)
    hd = t["midlayer.self_attn.q_proj.weight"].shape[0] // heads
    lin = lambda x, n, b=False: x @ t[f"{n}.weight"].T + (t[f"{n}.bias"] if b else 0)  # noqa: E731
    hid = lin(aux, "fc", "fc.bias" in t)
    x = torch.cat([_rms(emb, t["midlayer.input_layernorm.weight"], m.eps),
                   _rms(hid, t["midlayer.hidden_norm.weight"], m.eps)], -1)
    a = "midlayer.self_attn."
    q = _rope(lin(x, a + "q_proj").view(-1, heads, hd), m.rope_theta)
    k = _rope(lin(x, a + "k_proj").view(-1, kv, hd), m.rope_theta).repeat_interleave(heads // kv, 1)
    v = lin(x, a + "v_proj").view(-1, kv, hd).repeat_interleave(heads // kv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) / hd ** 0.5
    s = s.masked_fill(~torch.ones(len(x), len(x), dtype=torch.bool).tril(), float("-inf"))
    r = hid + lin(torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(len(x), -1), a + "o_proj", m.o_bias)
    n = _rms(r, t["midlayer.post_attention_layernorm.weight"], m.eps)
    r = r + lin(torch.nn.functional.silu(lin(n, "midlayer.mlp.gate_proj")) * lin(n, "midlayer.mlp.up_proj"),
                "midlayer.mlp.down_proj")
    logits = lin(_rms(r, t["norm.weight"], m.eps), "lm_head")
    full = logits.new_full((len(x), vocab_size), float("-inf"))
    full[:, torch.arange(d2t.numel()) + d2t] = logits
    return full


def make_target3(family: str) -> torch.nn.Module:
    t = tiny_model(family, seed=4 if family == "llama" else 5, layers=N_LAYERS)
    t.config.rope_parameters = {"rope_type": "default", "rope_theta": THETA}
    return t


def random_head3(target, layers, reduced: bool, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    vocab = DraftVocab(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed))[:40], VOCAB) \
        if reduced else None
    head = Eagle3Head(target, layers, vocab)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head


def fused_inputs(target, head: Eagle3Head, n: int = 6, seed: int = 1):
    torch.manual_seed(seed)
    ids = torch.randint(4, VOCAB, (1, n + 1))
    with torch.no_grad():
        hidden = target.model(input_ids=ids[:, :n], output_hidden_states=True).hidden_states
    return head.select_features(hidden), target.get_input_embeddings()(ids[:, 1:]).detach()


def head3_logits(head: Eagle3Head, feats: torch.Tensor, emb: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """``[T, V]`` the head's target-vocabulary logits (-inf outside its draft vocabulary)."""
    n = feats.shape[1]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        h = head.to(dtype)
        out = h.logits(h(feats.to(dtype), emb.to(dtype), torch.arange(n)[None], mask))[0]
    return out if head.draft_vocab is None else head.draft_vocab.expand(out)


def rounded3(head: Eagle3Head, target, dtype: torch.dtype) -> Eagle3Head:
    ref = Eagle3Head(target, head.feature_layers, head.draft_vocab)
    ref.load_state_dict({k: v.to(dtype).to(torch.float32) for k, v in head.state_dict().items()})
    return ref.eval()


@pytest.fixture(scope="module")
def targets3():
    return {f: make_target3(f) for f in ("llama", "qwen2")}


@pytest.mark.parametrize("layers", ["default", "custom"])
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced-vocab"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_eagle3_export_loads_strictly_reads_the_layers_computes_the_head_and_round_trips(
        engine, family, reduced, layers, targets3, tmp_path):
    target = targets3[family]
    chosen = None if layers == "default" else (1, 3, 5)
    head = random_head3(target, chosen, reduced)
    head.save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    res = export_head(tmp_path / "h", target, engine, tmp_path / engine, "fp16")
    cfg, tensors = read_export(res.out)
    assert res.layout == "eagle3" and res.files == ["model.safetensors", "config.json"]
    assert ("not EAGLE-3's default" in " ".join(res.notes)) == (chosen is not None)

    # the EAGLE-3 layout, and a strict load into the engine's module tree
    model = EAGLE3_DRAFTS[engine](cfg, N_LAYERS)
    assert strict_load3(model, {k: tuple(v.shape) for k, v in tensors.items()}) == ([], [], []), model.cls
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["draft_vocab_size"] == head.lm_head.out_features == (40 if reduced else VOCAB)
    assert cfg["target_hidden_size"] == 64 and cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert any(k.startswith("midlayer.") for k in tensors) and not any(k.startswith("layers.") for k in tensors)
    assert not {"embed_tokens.weight", "fc.bias"} & set(tensors)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert {v.dtype for k, v in tensors.items() if k not in ("d2t", "t2d")} == {torch.float16}
    assert model.rope_theta == THETA and cfg["rope_theta"] == THETA
    # the engine fuses the layers the head was trained on (each engine's id convention)
    assert model.layers == head.feature_layers == (chosen or default_feature_layers(N_LAYERS))
    assert (AUX in cfg) == (engine == "vllm")

    # the engine's forward on the exported tensors computes the head's logits (rounded to fp16)
    ref = rounded3(head, target, torch.float16)
    feats, emb = fused_inputs(target, head)
    got = engine_forward3(model, cfg, tensors, emb[0].double(), feats[0].double(), VOCAB)
    want = head3_logits(ref, feats, emb, torch.float64)
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # the same draft vocabulary
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-6, atol=1e-6)

    # back through import_eagle3: the same head, identical outputs
    back = import_eagle3(res.out, target)
    assert back.feature_layers == head.feature_layers
    assert (back.draft_vocab is None) == (not reduced)
    assert torch.equal(head3_logits(back, feats, emb), head3_logits(ref, feats, emb))


def test_eagle3_rules_have_teeth(targets3, tmp_path):
    """What goes wrong without the export's choices: an EAGLE-1/2 layout does not load into either
    EAGLE-3 draft; SGLang reading vLLM's layer ids (or the reverse) fuses the wrong layers; a tied
    LM head becomes the embedding in SGLang; a reduced head without d2t drafts the wrong tokens."""
    target = targets3["llama"]
    head = random_head3(target, (1, 3, 5), True)
    head.save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    cfg, tensors = read_export(export_head(tmp_path / "h", target, "vllm", tmp_path / "v").out)
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    old = EagleHead(target, bias=False)
    old.save(tmp_path / "e2", {"target": "tiny", "method": "hass"})
    _, old_tensors = read_export(export_head(tmp_path / "e2", target, "vllm", tmp_path / "o").out)
    for engine, draft in EAGLE3_DRAFTS.items():
        missing, unexpected, _ = strict_load3(draft(cfg, N_LAYERS), {k: tuple(v.shape) for k, v in old_tensors.items()})
        assert "fc.weight" not in missing and any(k.startswith("layers.0.") for k in unexpected), engine
        assert "midlayer.hidden_norm.weight" in missing
    swapped = {**cfg, "eagle_config": {"use_aux_hidden_state": True, AUX: cfg[AUX]}}
    assert sglang_eagle3_draft(swapped, N_LAYERS).layers == (2, 4, 6) != head.feature_layers  # one layer off
    no_ids = {k: v for k, v in cfg.items() if k != AUX}
    assert vllm_eagle3_draft(no_ids, N_LAYERS).layers == (2, 3, 3) != head.feature_layers  # the default
    tied = sglang_eagle3_draft({**cfg, "tie_word_embeddings": True}, N_LAYERS)
    assert tied.from_target["lm_head.weight"][0] == VOCAB != cfg["draft_vocab_size"]
    feats, emb = fused_inputs(target, head)
    m = vllm_eagle3_draft(cfg, N_LAYERS)
    zero = {**tensors, "d2t": torch.zeros_like(tensors["d2t"])}  # vLLM's default when d2t is not shipped
    got = engine_forward3(m, cfg, zero, emb[0].double(), feats[0].double(), VOCAB)
    want = head3_logits(rounded3(head, target, torch.float16), feats, emb, torch.float64)
    assert not torch.equal(torch.isinf(got), torch.isinf(want))
    assert strict_load3(m, shapes) == ([], [], [])


def test_eagle3_export_refusals_and_cli(tiny_dir, tmp_path, capsys):
    from selfspec.cli import main
    from selfspec.models.loading import load_model

    target = load_model(str(tiny_dir)).model
    Eagle3Head(target).save(tmp_path / "h", {"target": "tiny", "method": "hass"})
    with pytest.raises(SelfspecError, match="use --engine vllm or sglang") as e:
        export_head(tmp_path / "h", target, "eagle", tmp_path / "e")
    assert "\n" not in str(e.value)
    with pytest.raises(SelfspecError, match="drop --with-embeddings"):
        export_head(tmp_path / "h", target, "sglang", tmp_path / "s", with_embeddings=True)
    for engine, hint in (("vllm", '"method": "eagle3"'), ("sglang", "--speculative-algorithm EAGLE3")):
        assert main(["export", str(tmp_path / "h"), "--model", str(tiny_dir), "--engine", engine,
                     "--out", str(tmp_path / engine)]) == 0
        out = capsys.readouterr().out
        assert hint in out and "float16" in out
        cfg, tensors = read_export(tmp_path / engine)
        assert strict_load3(EAGLE3_DRAFTS[engine](cfg, 3), {k: tuple(v.shape) for k, v in tensors.items()}) == \
            ([], [], [])
        assert not tensors["d2t"].any() and tensors["t2d"].all()  # full vocabulary: the identity map
        assert isinstance(import_eagle3(tmp_path / engine, target), Eagle3Head)
    assert main(["export", str(tmp_path / "h"), "--model", str(tiny_dir), "--engine", "eagle",
                 "--out", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
