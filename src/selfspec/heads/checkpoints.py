"""Every way a draft head is read: selfspec's own head directories (``selfspec_head.json``: EAGLE-1/2
or EAGLE-3, :func:`load_draft_head`), and EAGLE checkpoints written by other tools - an export of
``selfspec export`` for any engine, or an official EAGLE-1/2 / EAGLE-3 head in safetensors
(:func:`import_eagle`, :func:`import_eagle3`), which ``--head DIR`` loads the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors.torch import load_file
from torch import nn

from ..core.draft_vocab import DraftVocab
from ..errors import SelfspecError
from .eagle import META_FILE, WEIGHTS_FILE, EagleHead, fill_head, load_head, read_meta
from .eagle3 import ARCH_FIELD, HEAD_ARCH, Eagle3Head, load_eagle3_head

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

EMBED = "embed_tokens.weight"
VOCAB_KEYS = ("d2t", "t2d")  # a reduced draft vocabulary, EAGLE-3 style (not part of the EAGLE-1/2 layer)
ATTN = "layers.0.self_attn."
AUX_IDS = "eagle_aux_hidden_state_layer_ids"
TOKEN_MAP_FILE = "hot_token_map.pt"  # SGLang --speculative-token-map (FR-Spec): a list of target token ids


def load_draft_head(path: Path | str, target: nn.Module) -> tuple[EagleHead | Eagle3Head, dict]:
    """A head of any kind for ``target``, and its metadata: a selfspec head directory (EAGLE-1/2 or
    EAGLE-3 from the metadata's ``head_arch``), else an EAGLE checkpoint with a ``config.json``
    (EAGLE-3 when it names an ``Eagle3`` architecture or ``draft_vocab_size``; metadata
    ``{"source": "checkpoint"}``)."""
    path = Path(path)
    if path.is_dir() and not (path / META_FILE).is_file() and (path / "config.json").is_file():
        cfg = json.loads((path / "config.json").read_text())
        eagle3 = any("Eagle3" in a for a in cfg.get("architectures") or []) or "draft_vocab_size" in cfg
        head = import_eagle3(path, target) if eagle3 else import_eagle(path, target)
        return head, {"source": "checkpoint", "head_arch": HEAD_ARCH if eagle3 else "eagle"}
    meta = read_meta(path)
    if meta.get(ARCH_FIELD, "eagle") == HEAD_ARCH:
        return load_eagle3_head(path, target, meta)
    return load_head(path, target)


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
    return fill_head(head, state, path, "EAGLE head")


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
    tcfg = cast("PreTrainedConfig", target.config)
    hid = int(tcfg.hidden_size)
    if cfg.get("target_hidden_size", hid) != hid or cfg.get("hidden_size", hid) != hid:
        raise SelfspecError(f"EAGLE-3 head {path} is for hidden size {cfg.get('target_hidden_size')} / "
                            f"{cfg.get('hidden_size')}, the target has {hid}")
    vsize = int(tcfg.vocab_size)
    d2t = state.pop("d2t", None)
    vocab = None if d2t is None or (d2t.numel() == vsize and not bool(d2t.any())) else DraftVocab.from_d2t(d2t, vsize)
    head = Eagle3Head(target, layers, vocab)
    return fill_head(head, state, path, "EAGLE-3 head")


def exported_draft_ids(path: Path | str) -> torch.Tensor | None:
    """The reduced draft vocabulary (target token ids) an export carries: SGLang's token map or an
    EAGLE-3 ``d2t``; None when it drafts over the full vocabulary."""
    path = Path(path)
    if (path / TOKEN_MAP_FILE).is_file():
        return torch.tensor(torch.load(path / TOKEN_MAP_FILE, weights_only=True), dtype=torch.long)
    state = load_file(str(path / WEIGHTS_FILE)) if (path / WEIGHTS_FILE).is_file() else {}
    return torch.arange(state["d2t"].numel()) + state["d2t"].long() if "d2t" in state else None
