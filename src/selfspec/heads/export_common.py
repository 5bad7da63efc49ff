"""What the head exports share: the :class:`Export` record, the serving dtypes, the config every
engine starts from (the head layer's own, RoPE in both transformers conventions), the family and
head-dim checks, the output directory check and the command that serves an export."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SelfspecError
from ..paths import check_output_dir
from .checkpoints import TOKEN_MAP_FILE
from .eagle import WEIGHTS_FILE, EagleHead
from .eagle3 import Eagle3Head

ENGINES = ("vllm", "sglang", "eagle")
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LLAMA_LIKE = ("llama", "mistral")
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


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """RoPE base and non-default scaling of a config dict (transformers 5 ``rope_parameters`` or 4's
    ``rope_theta`` / ``rope_scaling``)."""
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta"))
    if theta is None:
        raise SelfspecError("the target's config has no RoPE base (rope_theta / rope_parameters)")
    scaling: dict | None
    scaling = {k: v for k, v in params.items() if k != "rope_theta"} if params else dict(cfg.get("rope_scaling") or {})
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


def base_config(head: EagleHead | Eagle3Head, meta: dict, dtype: torch.dtype, engine: str) -> dict:
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


def check_family(cfg: dict, engine: str) -> str:
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


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def check_plain_head_dim(cfg: dict, engine: str) -> None:
    if head_dim(cfg) * cfg["num_attention_heads"] != cfg["hidden_size"]:
        raise SelfspecError(f"{engine}'s EAGLE layer computes head_dim = hidden_size / heads, this target has "
                            f"head_dim {head_dim(cfg)}; it cannot hold this head")


def check_export_dir(out: Path | str, force: bool = False) -> Path:
    """``out`` as an export directory: new, empty, or holding an earlier export only, which is
    replaced with ``force`` (else a one-line error, so an export is never overwritten unasked).
    Anything else there (a bench folder, a model) would mix with the draft and make the directory
    unloadable, so it is a one-line error; checked before a model loads."""
    d = check_output_dir(out)
    if d.is_dir():
        names = sorted(p.name for p in d.iterdir())
        export = (WEIGHTS_FILE, "config.json", TOKEN_MAP_FILE, "pytorch_model.bin")
        other = [n for n in names if n not in export]
        if other:
            raise SelfspecError(f"--out {out} is not empty ({len(other)} other entries, e.g. {other[0]}); an export "
                                "there would not load as a draft model: pass a new or empty directory")
        if names and not force:
            raise SelfspecError(f"--out {out} holds an earlier export; pass --force to replace it, or a new directory")
    return d


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
