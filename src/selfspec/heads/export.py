"""Export a head to the EAGLE-1/2 checkpoint each serving engine loads: vLLM, SGLang, SafeAILab EAGLE.

The three loaders read the same tensor names but build different module trees from
``config.json`` (see ``docs/methods/hass.md`` "Serving the head elsewhere" and the rules written
down, with file references, in ``tests/heads/test_export.py``). Each export writes exactly the
tensors its engine's module tree has, and a config that makes the engine build that tree:

==============  ==============================  ================================  ===========================
                vLLM (``llama_eagle.py``)       SGLang (``llama_eagle.py``,       EAGLE (``cnets1.py``)
                                                ``qwen2_eagle.py``)
==============  ==============================  ================================  ===========================
``fc.bias``     none (fc has ``bias=False``):   always (fc is ``nn.Linear`` with  iff config ``bias``
                folded exactly into q/k/v/o     a bias): zeros when the head has
                biases, ``attention_bias: true`` none
q/k/v biases    ``qkv_bias`` (else              Llama: ``attention_bias or bias``  iff ``qkv_bias``
                ``attention_bias or bias``)     (q/k/v/o); Qwen2: always (q/k/v)
o bias          ``attention_bias or bias``      as q/k/v (Llama), never (Qwen2)    never
architectures   ``LlamaForCausalLM`` (renamed   ``LlamaForCausalLMEagle`` /        ignored (target's kept)
                ``EagleLlamaForCausalLM``; a    ``Qwen2ForCausalLMEagle``
                Qwen2 head goes as a Llama
                with ``qkv_bias``)
RoPE base       ``rope_parameters``             ``rope_theta`` (default 10000)     ``rope_theta`` (10000)
embedding       never (shipping it disables     never (replaced by the target's)   ``--with-embeddings``
                sharing the target's)
reduced vocab   not held: full vocabulary       ``hot_token_map.pt`` for           not held: full vocabulary
                                                ``--speculative-token-map``
==============  ==============================  ================================  ===========================

Layer 0 never has ``input_layernorm`` (all three replace it by identity), the LM head is always
the target's. Weights are written in the serving dtype (fp16 or bf16). The vLLM fold: the head
computes ``h = W x + b`` and feeds ``h`` to q/k/v and to the residual; with ``h' = W x``,
q/k/v biases ``W_{q,k,v} b`` (plus their own) and o bias ``b`` give the same layer output,
because attention weights sum to one (``attn(v + c) = attn(v) + c``). ``import_eagle`` undoes it.

EAGLE-3 heads (``heads/eagle3.py``) export to the EAGLE-3 layout of vLLM's and SGLang's
``llama_eagle3.py`` (:func:`export_eagle3`, chosen by the head's metadata): ``fc`` [H, 3·H_t]
without bias, ``midlayer.*`` (2H-input q/k/v, ``hidden_norm``), ``norm``, its own ``lm_head``
[N, H], ``d2t`` / ``t2d``; config ``architectures: [LlamaForCausalLMEagle3]``, ``draft_vocab_size``,
``target_hidden_size``, ``eagle_config``. The feature layers are written in each engine's
convention: vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` as the inputs of those
target layers (``hidden_states`` indices), SGLang (and SpecForge) read
``eagle_config.eagle_aux_hidden_state_layer_ids`` as the outputs of those layers (index - 1).
``import_eagle3`` reads such a checkpoint back (or an official EAGLE-3 head in safetensors).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..core.draft_vocab import DraftVocab
from ..errors import SelfspecError
from ..paths import check_output_dir
from .eagle import WEIGHTS_FILE, EagleHead, arch_hash, read_meta
from .eagle3 import ARCH_FIELD, HEAD_ARCH, Eagle3Head, default_feature_layers, load_eagle3_head

ENGINES = ("vllm", "sglang", "eagle")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOKEN_MAP_FILE = "hot_token_map.pt"  # SGLang --speculative-token-map (FR-Spec): a list of target token ids
EMBED = "embed_tokens.weight"
VOCAB_KEYS = ("d2t", "t2d")  # a reduced draft vocabulary, EAGLE-3 style (not part of the EAGLE-1/2 layer)
LLAMA_LIKE = ("llama", "mistral")
ATTN = "layers.0.self_attn."
_DROP_KEYS = ("_attn_implementation_autoset", "_name_or_path", "_model_name_or_path", "hot_vocab_size",
              "draft_vocab_size")


@dataclass
class Export:
    """What :func:`export_head` wrote.

    Attributes:
        out: the output directory.
        engine: ``vllm``, ``sglang`` or ``eagle``.
        dtype: ``float16`` or ``bfloat16``.
        files: the file names written into ``out``.
        notes: one line each: what the engine could not hold as the head has it, and what was
            written instead.
        layout: ``eagle`` (EAGLE-1/2 draft) or ``eagle3``.
    """

    out: Path
    engine: str
    dtype: str
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    layout: str = "eagle"


def read_head_files(head_dir: Path | str, target: torch.nn.Module) -> tuple[EagleHead, dict, torch.Tensor | None]:
    """A saved head for ``target``, its metadata, and its reduced draft vocabulary as target token
    ids (``i + d2t[i]``; None for the full vocabulary). Reads ``d2t`` / ``t2d`` from the weights
    file itself, so it works whether or not :class:`EagleHead` carries them."""
    path = Path(head_dir)
    meta = read_meta(path)
    if meta["arch"] != arch_hash(target.config):
        raise SelfspecError(f"draft head {path} was trained for another architecture "
                            f"(target '{meta.get('target', '?')}'); pass the model it was trained for")
    state = load_file(str(path / WEIGHTS_FILE))
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    head = EagleHead(target, bias=bool(meta.get("bias", True)))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SelfspecError(f"draft head {path} does not match its config (missing {missing[:2]}, "
                            f"unexpected {unexpected[:2]})")
    ids = None
    if d2t is not None:
        vocab = int(target.config.vocab_size)
        ids = torch.arange(d2t.numel()) + d2t.long()
        n = meta.get("draft_vocab_size", d2t.numel())
        if (n != d2t.numel() or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab
                or ids.unique().numel() != ids.numel()
                or (t2d is not None and (t2d.numel() != vocab or not bool(t2d.bool()[ids].all())
                                         or int(t2d.bool().sum()) != ids.numel()))):
            raise SelfspecError(f"draft head {path} has an inconsistent reduced vocabulary (d2t / t2d / "
                                "draft_vocab_size); retrain or restore the head")
    return head.eval(), meta, ids


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """RoPE base and non-default scaling of a config dict (transformers 5 ``rope_parameters`` or 4's
    ``rope_theta`` / ``rope_scaling``)."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise SelfspecError("the target's config has no RoPE base (rope_theta / rope_parameters)")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"} if params else dict(cfg.get("rope_scaling") or {})
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def _base_config(head: EagleHead, meta: dict, dtype: torch.dtype, engine: str) -> dict:
    cfg = head.config.to_dict()
    for k in _DROP_KEYS:
        cfg.pop(k, None)
    theta, scaling = _rope(cfg)
    cfg["num_hidden_layers"] = 1
    cfg["rope_theta"] = theta  # SGLang and EAGLE read this (default 10000), vLLM rope_parameters
    if scaling is None:
        cfg["rope_scaling"] = None
    else:  # the legacy form for loaders on transformers 4 ("type" for the oldest)
        cfg["rope_scaling"] = {**scaling, "type": scaling.get("rope_type", scaling.get("type"))}
    name = str(dtype).removeprefix("torch.")
    cfg["torch_dtype"] = cfg["dtype"] = name
    cfg["selfspec_method"] = meta.get("method")
    cfg["selfspec_engine"] = engine
    return cfg


def _check_family(cfg: dict, engine: str) -> str:
    mt = cfg.get("model_type")
    if mt not in LLAMA_LIKE + ("qwen2",):
        raise SelfspecError(f"{engine} has no EAGLE-1/2 draft model for {mt} targets (its loaders cover Llama, "
                            "Mistral and Qwen2 families); serve this head with selfspec itself")
    types = cfg.get("layer_types") or ["full_attention"]
    if types[0] != "full_attention":
        raise SelfspecError(f"this head's layer uses {types[0]}; {engine}'s EAGLE layer attends over the whole "
                            "context, so it cannot hold it")
    if cfg.get("hidden_act", "silu") != "silu":
        raise SelfspecError(f"{engine}'s EAGLE layer supports silu MLPs only, this head has {cfg['hidden_act']}")
    return mt


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _check_plain_head_dim(cfg: dict, engine: str) -> None:
    if _head_dim(cfg) * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise SelfspecError(f"{engine}'s EAGLE layer computes head_dim = hidden_size / heads, this target has "
                            f"head_dim {_head_dim(cfg)}; it cannot hold this head")


def _fold_fc_bias(state: dict[str, torch.Tensor]) -> None:
    """Move ``fc.bias`` into q/k/v/o biases (exact in real arithmetic; computed in float64)."""
    b = state.pop("fc.bias").double()
    for p in ("q", "k", "v"):
        w = state[f"{ATTN}{p}_proj.weight"].double()
        own = state.get(f"{ATTN}{p}_proj.bias")
        state[f"{ATTN}{p}_proj.bias"] = w @ b + (own.double() if own is not None else 0)
    own = state.get(f"{ATTN}o_proj.bias")
    state[f"{ATTN}o_proj.bias"] = b + (own.double() if own is not None else 0)


def check_export_dir(out: Path | str) -> Path:
    """``out`` as an export directory: new, empty, or holding an earlier export only (which is
    replaced). Anything else there (a bench folder, a model) would mix with the draft and make
    the directory unloadable, so it is a one-line error; checked before a model loads."""
    d = check_output_dir(out)
    if d.is_dir():
        other = sorted(p.name for p in d.iterdir() if p.name not in (WEIGHTS_FILE, "config.json", TOKEN_MAP_FILE,
                                                                     "pytorch_model.bin"))
        if other:
            raise SelfspecError(f"--out {out} is not empty ({len(other)} other entries, e.g. {other[0]}); an export "
                                "there would not load as a draft model: pass a new or empty directory")
    return d


def export_head(head_dir: Path | str, target: torch.nn.Module, engine: str, out: Path | str, dtype: str = "fp16",
                with_embeddings: bool = False) -> Export:
    """Write ``head_dir``'s head into ``out`` as ``engine`` loads an EAGLE-1/2 draft (module docstring).

    Args:
        head_dir: a head directory written by ``selfspec train hass``.
        target: its target model (config, and the embedding for ``with_embeddings``).
        engine: ``vllm``, ``sglang`` or ``eagle``.
        out: output directory (created): new, empty or an earlier export (see :func:`check_export_dir`).
        dtype: ``fp16`` or ``bf16``: the serving dtype the weights are written in.
        with_embeddings: also write ``embed_tokens.weight`` (EAGLE only; the other engines take the
            target's and refuse or ignore a draft's own).

    Returns:
        the :class:`Export` record, with one note per thing the engine could not hold as trained.

    Raises:
        SelfspecError: a head or option the engine cannot hold (one line saying why and what to do).
    """
    if engine not in ENGINES:
        raise SelfspecError(f"--engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if dtype not in DTYPES:
        raise SelfspecError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    check_export_dir(out)
    if read_meta(head_dir).get(ARCH_FIELD) == HEAD_ARCH:
        return export_eagle3(head_dir, target, engine, out, dtype, with_embeddings)
    head, meta, ids = read_head_files(head_dir, target)
    tdtype = DTYPES[dtype]
    state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    if any(k.startswith("layers.0.input_layernorm") for k in state):
        raise SelfspecError("this head has an input norm at layer 0; EAGLE-1/2 loaders have none there")
    res = Export(Path(out), engine, str(tdtype).removeprefix("torch."))
    cfg = _base_config(head, meta, tdtype, engine)
    mt = _check_family(cfg, engine)
    has_qkv = f"{ATTN}q_proj.bias" in state
    has_o = f"{ATTN}o_proj.bias" in state
    full_vocab = (f"{engine}'s EAGLE-1/2 draft has no d2t or lm_head of its own: the head's reduced vocabulary "
                  f"({0 if ids is None else ids.numel()} tokens) is not held, it drafts over the full vocabulary")
    extra: dict[str, object] = {}
    if engine == "vllm":
        if with_embeddings:
            raise SelfspecError("vLLM shares the target's embedding only when the draft ships none (a draft's "
                                "embed_tokens is skipped, yet marks it as having its own); drop --with-embeddings")
        if "fc.bias" in state:
            _fold_fc_bias(state)
            res.notes.append("vLLM builds fc without a bias (llama_eagle.py); the fc bias is folded exactly into "
                             "q/k/v/o biases (config attention_bias: true); train with --no-fc-bias to avoid them")
        has_qkv, has_o = f"{ATTN}q_proj.bias" in state, f"{ATTN}o_proj.bias" in state
        if mt == "qwen2":
            res.notes.append("vLLM registers no EAGLE model for Qwen2 targets; the Qwen2 layer is written as a "
                             "Llama layer with q/k/v biases (architectures LlamaForCausalLM, qkv_bias: true)")
        for k in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers", "bias"):
            cfg.pop(k, None)
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"], head_dim=_head_dim(cfg),
                   bias=False, attention_bias=has_o, qkv_bias=has_qkv, mlp_bias=bool(cfg.get("mlp_bias", False)))
        if ids is not None:
            res.notes.append(full_vocab)
    elif engine == "sglang":
        if with_embeddings:
            raise SelfspecError("SGLang replaces an EAGLE draft's embedding with the target's; drop --with-embeddings")
        if cfg.get("mlp_bias"):
            raise SelfspecError("SGLang's EAGLE layer has no MLP biases; this head has them")
        if "fc.bias" not in state:
            state["fc.bias"] = torch.zeros(head.hidden_size)
            res.notes.append("SGLang always builds fc with a bias; the head has none, so zeros are written")
        if mt == "qwen2":
            _check_plain_head_dim(cfg, engine)
            arch = "Qwen2ForCausalLMEagle"
            if not has_qkv or has_o:
                raise SelfspecError("SGLang's Qwen2 EAGLE layer has q/k/v biases and no o bias; this head differs")
        else:
            arch = "LlamaForCausalLMEagle"
            if has_qkv != has_o:
                raise SelfspecError("SGLang's Llama EAGLE layer has q/k/v/o biases all or none; this head differs")
        cfg.update(architectures=[arch], bias=False, attention_bias=has_o, tie_word_embeddings=False)
        if ids is not None:
            extra[TOKEN_MAP_FILE] = ids.tolist()
            res.notes.append(f"SGLang's EAGLE-2 draft holds the reduced vocabulary ({ids.numel()} tokens) only as a "
                             f"token map: serve with --speculative-token-map {Path(out) / TOKEN_MAP_FILE}")
    else:  # eagle
        if cfg.get("mlp_bias") or has_o:
            raise SelfspecError("EAGLE's cnets1.py builds o_proj and the MLP without biases; this head has them")
        _check_plain_head_dim(cfg, engine)
        scaling = cfg["rope_scaling"]
        if scaling is not None:
            kind = scaling.get("rope_type")
            if kind not in ("linear", "dynamic"):
                raise SelfspecError(f"EAGLE's cnets1.py supports linear and dynamic RoPE scaling only, this target "
                                    f"uses {kind}")
            cfg["rope_scaling"] = {"type": kind, "factor": float(scaling["factor"])}
        cfg.update(bias="fc.bias" in state, qkv_bias=has_qkv,
                   architectures=["Qwen2ForCausalLM" if mt == "qwen2" else "LlamaForCausalLM"])
        if with_embeddings:
            state[EMBED] = target.get_input_embeddings().weight.detach().cpu()
        if ids is not None:
            res.notes.append(full_vocab)
    out = res.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in (TOKEN_MAP_FILE, "pytorch_model.bin"):  # a previous export into the same directory
        (out / stale).unlink(missing_ok=True)
    save_file({k: v.to(tdtype).contiguous() for k, v in sorted(state.items())}, str(out / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    res.files = [WEIGHTS_FILE, "config.json"]
    for name, obj in extra.items():
        torch.save(obj, out / name)
        res.files.append(name)
    return res


# -- EAGLE-3 heads --------------------------------------------------------------------------------

EAGLE3_ENGINES = ("vllm", "sglang")
EAGLE3_ARCH = "LlamaForCausalLMEagle3"  # vLLM registry -> Eagle3LlamaForCausalLM; SGLang EntryClass
AUX_IDS = "eagle_aux_hidden_state_layer_ids"


def export_eagle3(head_dir: Path | str, target: torch.nn.Module, engine: str, out: Path | str, dtype: str = "fp16",
                  with_embeddings: bool = False) -> Export:
    """Write an EAGLE-3 head into ``out`` as ``engine`` (vllm or sglang) loads an EAGLE-3 draft
    (``llama_eagle3.py``; module docstring): the layout's tensors in the serving dtype (``d2t``
    int64, zeros for a full-vocabulary head; ``t2d`` bool) and a config that builds that tree.

    Raises:
        SelfspecError: an engine or option that cannot hold the head (one line).
    """
    if engine not in EAGLE3_ENGINES:
        raise SelfspecError(f"EAGLE-3 heads export to {' and '.join(EAGLE3_ENGINES)} (llama_eagle3.py); SafeAILab "
                            "EAGLE's EAGLE-3 loader runs its own forked target code and is not written: use --engine "
                            "vllm or sglang")
    if dtype not in DTYPES:
        raise SelfspecError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if with_embeddings:
        raise SelfspecError(f"{engine}'s EAGLE-3 draft shares the target's embedding; drop --with-embeddings")
    head, meta = load_eagle3_head(head_dir, target)
    tdtype = DTYPES[dtype]
    res = Export(Path(out), engine, str(tdtype).removeprefix("torch."), layout="eagle3")
    cfg = _base_config(head, meta, tdtype, engine)  # head.config: the midlayer's LlamaConfig
    if cfg.get("hidden_act", "silu") != "silu":
        raise SelfspecError(f"{engine}'s EAGLE-3 layer supports silu MLPs only, this head has {cfg['hidden_act']}")
    for k in ("layer_types", "eagle_feature_layers", "use_sliding_window", "sliding_window", "max_window_layers",
              AUX_IDS):
        cfg.pop(k, None)
    n, vocab = head.lm_head.out_features, head.draft_vocab
    cfg.update(architectures=[EAGLE3_ARCH], model_type="llama", num_hidden_layers=1, head_dim=_head_dim(cfg),
               bias=False, attention_bias=False, mlp_bias=False, tie_word_embeddings=False, draft_vocab_size=n,
               target_hidden_size=head.fc.in_features // 3, norm_before_residual=False,
               eagle_config={"use_aux_hidden_state": True, AUX_IDS: [i - 1 for i in head.feature_layers]})
    if engine == "vllm":  # vLLM's convention: the input of target layer i (llama.py's aux_hidden_state_layers)
        cfg[AUX_IDS] = list(head.feature_layers)
    state = {k: v.detach().cpu().to(tdtype).contiguous() for k, v in head.state_dict().items()}
    state["d2t"] = vocab.d2t() if vocab is not None else torch.zeros(n, dtype=torch.long)
    state["t2d"] = vocab.t2d() if vocab is not None else torch.ones(n, dtype=torch.bool)
    default = default_feature_layers(int(target.config.num_hidden_layers))
    if head.feature_layers != default:
        res.notes.append(f"the head reads target layers {list(head.feature_layers)}, not EAGLE-3's default "
                         f"{list(default)}: the config names them; serve with an engine version that reads {AUX_IDS}")
    out = res.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in (TOKEN_MAP_FILE, "pytorch_model.bin"):
        (out / stale).unlink(missing_ok=True)
    save_file(dict(sorted(state.items())), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    res.files = [WEIGHTS_FILE, "config.json"]
    return res


def import_eagle3(path: Path | str, target: torch.nn.Module) -> Eagle3Head:
    """Load an EAGLE-3 checkpoint in safetensors (an :func:`export_eagle3` output or an official
    EAGLE-3 head: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``) as a head for ``target``.
    The feature layers come from ``eagle_config`` (layer outputs: + 1), else a top-level
    ``eagle_aux_hidden_state_layer_ids`` (vLLM's: layer inputs), else EAGLE-3's default; an
    all-zero ``d2t`` over the whole vocabulary is the full vocabulary."""
    path = Path(path)
    f = path / WEIGHTS_FILE
    if not f.is_file():
        raise SelfspecError(f"{path} has no {WEIGHTS_FILE} (only safetensors checkpoints are read)")
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    state = {k: v for k, v in load_file(str(f)).items() if k not in (EMBED, "t2d")}
    nested = (cfg.get("eagle_config") or {}).get(AUX_IDS)
    layers = [i + 1 for i in nested] if nested else cfg.get(AUX_IDS)
    hid = int(target.config.hidden_size)
    if cfg.get("target_hidden_size", hid) != hid or cfg.get("hidden_size", hid) != hid:
        raise SelfspecError(f"EAGLE-3 head {path} is for hidden size {cfg.get('target_hidden_size')} / "
                            f"{cfg.get('hidden_size')}, the target has {hid}")
    vsize = int(target.config.vocab_size)
    d2t = state.pop("d2t", None)
    vocab = None if d2t is None or (d2t.numel() == vsize and not bool(d2t.any())) else DraftVocab.from_d2t(d2t, vsize)
    head = Eagle3Head(target, layers, vocab)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SelfspecError(f"EAGLE-3 head {path} does not fit this target (missing {missing[:2]}, "
                            f"unexpected {unexpected[:2]})")
    return head.eval()


def exported_draft_ids(path: Path | str) -> torch.Tensor | None:
    """The reduced draft vocabulary (target token ids) an export carries: SGLang's token map or an
    EAGLE-3 ``d2t``; None when it drafts over the full vocabulary."""
    path = Path(path)
    if (path / TOKEN_MAP_FILE).is_file():
        return torch.tensor(torch.load(path / TOKEN_MAP_FILE, weights_only=True), dtype=torch.long)
    state = load_file(str(path / WEIGHTS_FILE)) if (path / WEIGHTS_FILE).is_file() else {}
    return torch.arange(state["d2t"].numel()) + state["d2t"].long() if "d2t" in state else None


def import_eagle(path: Path | str, target: torch.nn.Module) -> EagleHead:
    """Load an EAGLE-1/2 checkpoint in safetensors (an export of any engine above, or an official
    EAGLE-1/2 head) as a head for ``target``. ``embed_tokens`` / ``lm_head`` / ``d2t`` / ``t2d`` are
    not part of the head (the target's are used); a vLLM export's folded fc bias is unfolded."""
    path = Path(path)
    f = path / WEIGHTS_FILE
    if not f.is_file():
        raise SelfspecError(f"{path} has no {WEIGHTS_FILE} (only safetensors checkpoints are read)")
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    skip = (EMBED, "lm_head.weight") + VOCAB_KEYS
    state = {k: v for k, v in load_file(str(f)).items() if k not in skip}
    probe = EagleHead(target, bias=False)
    if cfg.get("hidden_size", probe.hidden_size) != probe.hidden_size:
        raise SelfspecError(f"EAGLE head {path} has hidden size {cfg['hidden_size']}, the target {probe.hidden_size}")
    own = {k for k in probe.state_dict() if k.startswith(ATTN) and k.endswith(".bias")}
    if "fc.bias" not in state and f"{ATTN}o_proj.bias" in state and f"{ATTN}o_proj.bias" not in own:
        b = state.pop(f"{ATTN}o_proj.bias").double()  # vLLM export: fc bias folded into q/k/v/o biases
        state["fc.bias"] = b.to(state["fc.weight"].dtype)
        for p in ("q", "k", "v"):
            key = f"{ATTN}{p}_proj.bias"
            fold = state[f"{ATTN}{p}_proj.weight"].double() @ b
            rest = state.pop(key).double() - fold if key in state else -fold
            if key in own:
                state[key] = rest
            elif rest.abs().max() > 1e-2 * (fold.abs().max() + 1e-6):
                raise SelfspecError(f"EAGLE head {path}: {key} is not a folded fc bias, and this target's layer "
                                    "has no such bias")
    if "fc.bias" in state and not bool(state["fc.bias"].any()):  # SGLang's stand-in for no bias
        del state["fc.bias"]
    head = EagleHead(target, bias="fc.bias" in state)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SelfspecError(f"EAGLE head {path} does not fit this target (missing {missing[:2]}, "
                            f"unexpected {unexpected[:2]})")
    return head.eval()


def default_dtype(target_dir: Path | str | None) -> str:
    """``fp16`` or ``bf16``: the dtype the target's checkpoint declares when it is one of them, else fp16."""
    f = Path(target_dir) / "config.json" if target_dir else None
    cfg = json.loads(f.read_text()) if f is not None and f.is_file() else {}
    return "bf16" if (cfg.get("torch_dtype") or cfg.get("dtype")) == "bfloat16" else "fp16"


def serve_hint(res: Export, target_ref: str, target_dir: Path | str | None = None) -> list[str]:
    """The command that serves ``res`` with its target (``target_ref``: the path or hub id the
    engine loads), and what the engine needs from the target side, one line each."""
    out, dtype = res.out, res.dtype
    if res.layout == "eagle3":
        if res.engine == "vllm":
            spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": 5})
            return [f"serve: vllm serve {target_ref} --dtype {dtype} --speculative-config '{spec}'"]
        return [f"serve: python -m sglang.launch_server --model-path {target_ref} --dtype {dtype} "
                f"--speculative-algorithm EAGLE3 --speculative-draft-model-path {out} --speculative-num-steps 5 "
                f"--speculative-eagle-topk 8 --speculative-num-draft-tokens 64"]
    if res.engine == "vllm":
        spec = json.dumps({"method": "eagle", "model": str(out), "num_speculative_tokens": 5})
        return [f"serve: vllm serve {target_ref} --dtype {dtype} --speculative-config '{spec}'"]
    if res.engine == "sglang":
        tok = f" --speculative-token-map {out / TOKEN_MAP_FILE}" if TOKEN_MAP_FILE in res.files else ""
        return [f"serve: python -m sglang.launch_server --model-path {target_ref} --dtype {dtype} "
                f"--speculative-algorithm EAGLE --speculative-draft-model-path {out} --speculative-num-steps 5 "
                f"--speculative-eagle-topk 8 --speculative-num-draft-tokens 64{tok}"]
    lines = [f"serve: python -c \"import torch; from eagle.model.ea_model import EaModel; "
             f"m = EaModel.from_pretrained(use_eagle3=False, base_model_path='{target_ref}', ea_model_path='{out}', "
             f"torch_dtype=torch.{dtype}, device_map='auto', total_token=60, depth=5, top_k=10)\""]
    d = Path(target_dir) if target_dir else None
    if d is not None and d.is_dir() and not any((d / n).is_file() for n in (
            "model.safetensors.index.json", "pytorch_model.bin.index.json")):
        lines.append(f"note: EAGLE's cnets1.py reads the target's embedding through a shard index "
                     f"(model.safetensors.index.json), which {d} lacks: re-save the target with "
                     "save_pretrained(DIR, max_shard_size='100MB') and pass DIR")
    return lines
