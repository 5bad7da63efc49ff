"""Export a head to the EAGLE checkpoint layout that vLLM and SGLang load for EAGLE(-2) drafts.

Tensor names (ours -> EAGLE layout, as in SafeAILab/EAGLE checkpoints and the ``llama_eagle``
models of vLLM / SGLang):

==========================================  ==========================================
selfspec head (``model.safetensors``)       EAGLE layout (``model.safetensors``)
==========================================  ==========================================
``fc.weight`` ``[H, 2H]``, ``fc.bias``      ``fc.weight``, ``fc.bias`` (input order [embedding; feature])
``layers.0.self_attn.{q,k,v,o}_proj.*``     same names
``layers.0.mlp.{gate,up,down}_proj.*``      same names
``layers.0.post_attention_layernorm.weight`` same name
(no input norm: identity)                   (none: layer 0 skips ``input_layernorm``)
(target's embedding, shared)                ``embed_tokens.weight`` only with ``with_embeddings``
==========================================  ==========================================

``config.json`` is the target's config with ``num_hidden_layers = 1``, ``bias`` and
``architectures = ["LlamaForCausalLM"]`` for Llama-family targets (EAGLE's convention); the
serving engine takes the LM head (and, without ``embed_tokens``, the embedding) from the target.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import SelfspecError
from .eagle import WEIGHTS_FILE, EagleHead, load_head

EMBED = "embed_tokens.weight"


def export_eagle(head_dir: Path | str, target: torch.nn.Module, out: Path | str, with_embeddings: bool = False
                 ) -> Path:
    """Write ``head_dir``'s head into ``out`` in the EAGLE layout (see module docstring)."""
    head, meta = load_head(head_dir, target)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if any(k.startswith("layers.0.input_layernorm") for k in state):
        raise SelfspecError("this head has an input norm; the EAGLE layout has none")
    if with_embeddings:
        state[EMBED] = target.get_input_embeddings().weight.detach().contiguous().cpu()
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    cfg = head.config.to_dict()
    cfg.pop("_attn_implementation_autoset", None)
    cfg["num_hidden_layers"] = 1
    cfg["bias"] = head.fc.bias is not None
    cfg["architectures"] = ["LlamaForCausalLM"] if cfg.get("model_type") == "llama" else cfg.get("architectures")
    cfg["selfspec_method"] = meta.get("method")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    return out


def import_eagle(path: Path | str, target: torch.nn.Module) -> EagleHead:
    """Load an EAGLE-layout head (ours exported, or an EAGLE-1/2 checkpoint in safetensors) for
    ``target``; ``embed_tokens`` is ignored (the target's is used)."""
    path = Path(path)
    f = path / WEIGHTS_FILE
    if not f.is_file():
        raise SelfspecError(f"{path} has no {WEIGHTS_FILE} (only safetensors checkpoints are read)")
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    state = {k: v for k, v in load_file(str(f)).items() if k != EMBED}
    head = EagleHead(target, bias="fc.bias" in state)
    if cfg.get("hidden_size", head.hidden_size) != head.hidden_size:
        raise SelfspecError(f"EAGLE head {path} has hidden size {cfg['hidden_size']}, the target {head.hidden_size}")
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SelfspecError(f"EAGLE head {path} does not fit this target (missing {missing[:2]}, "
                            f"unexpected {unexpected[:2]})")
    return head.eval()
