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
because attention weights sum to one (``attn(v + c) = attn(v) + c``);
:func:`selfspec.heads.checkpoints.import_eagle` undoes it.

EAGLE-3 heads (``heads/eagle3.py``) go to the EAGLE-3 layout of vLLM's and SGLang's ``llama_eagle3.py``
(:mod:`.export_eagle3`, chosen by the head's metadata).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ..errors import SelfspecError
from ..paths import save_safetensors
from .checkpoints import ATTN, EMBED, TOKEN_MAP_FILE
from .eagle import WEIGHTS_FILE, load_head, read_meta
from .eagle3 import ARCH_FIELD, HEAD_ARCH
from .export_common import (
    DTYPES,
    ENGINES,
    Export,
    base_config,
    check_export_dir,
    check_family,
    check_plain_head_dim,
    default_dtype,
    head_dim,
    serve_hint,
)
from .export_eagle3 import export_eagle3

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Export", "check_export_dir", "default_dtype", "export_head", "serve_hint"]


def _fold_fc_bias(state: dict[str, torch.Tensor]) -> None:
    """Move ``fc.bias`` into q/k/v/o biases (exact in real arithmetic; computed in float64)."""
    b = state.pop("fc.bias").double()
    for p in ("q", "k", "v"):
        w = state[f"{ATTN}{p}_proj.weight"].double()
        own = state.get(f"{ATTN}{p}_proj.bias")
        state[f"{ATTN}{p}_proj.bias"] = w @ b + (own.double() if own is not None else 0)
    own = state.get(f"{ATTN}o_proj.bias")
    state[f"{ATTN}o_proj.bias"] = b + (own.double() if own is not None else 0)


def export_head(head_dir: Path | str, target: torch.nn.Module, engine: str, out: Path | str, dtype: str = "fp16",
                with_embeddings: bool = False, force: bool = False) -> Export:
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
    check_export_dir(out, force)
    if read_meta(head_dir).get(ARCH_FIELD) == HEAD_ARCH:
        return export_eagle3(head_dir, target, engine, out, dtype, with_embeddings)
    head, meta = load_head(head_dir, target)
    ids = None if head.draft_vocab is None else head.draft_vocab.ids
    tdtype = DTYPES[dtype]
    state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    if any(k.startswith("layers.0.input_layernorm") for k in state):
        raise SelfspecError("this head has an input norm at layer 0; EAGLE-1/2 loaders have none there")
    res = Export(Path(out), engine, str(tdtype).removeprefix("torch."))
    cfg = base_config(head, meta, tdtype, engine)
    mt = check_family(cfg, engine)
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
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"], head_dim=head_dim(cfg),
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
            check_plain_head_dim(cfg, engine)
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
        check_plain_head_dim(cfg, engine)
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
            embeddings = cast("PreTrainedModel", target).get_input_embeddings()
            state[EMBED] = cast(torch.Tensor, embeddings.weight).detach().cpu()
        if ids is not None:
            res.notes.append(full_vocab)
    out = res.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in (TOKEN_MAP_FILE, "pytorch_model.bin"):  # a previous export into the same directory
        (out / stale).unlink(missing_ok=True)
    save_safetensors({k: v.to(tdtype).contiguous() for k, v in sorted(state.items())}, out / WEIGHTS_FILE,
                     metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    res.files = [WEIGHTS_FILE, "config.json"]
    for name, obj in extra.items():
        torch.save(obj, out / name)
        res.files.append(name)
    return res
