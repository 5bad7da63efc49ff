"""Export an EAGLE-3 head to the EAGLE-3 layout of vLLM's and SGLang's ``llama_eagle3.py``: ``fc``
[H, 3·H_t] without bias, ``midlayer.*`` (2H-input q/k/v, ``hidden_norm``), ``norm``, its own
``lm_head`` [N, H], ``d2t`` / ``t2d``; config ``architectures: [LlamaForCausalLMEagle3]``,
``draft_vocab_size``, ``target_hidden_size``, ``eagle_config``. The feature layers are written in
each engine's convention: vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` as the inputs
of those target layers (``hidden_states`` indices), SGLang (and SpecForge) read
``eagle_config.eagle_aux_hidden_state_layer_ids`` as the outputs of those layers (index - 1).
:func:`selfspec.heads.checkpoints.import_eagle3` reads such a checkpoint back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from ..errors import SelfspecError
from ..paths import save_safetensors
from .checkpoints import AUX_IDS, TOKEN_MAP_FILE
from .eagle import WEIGHTS_FILE
from .eagle3 import default_feature_layers, load_eagle3_head
from .export_common import DTYPES, Export, base_config, head_dim

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

EAGLE3_ENGINES = ("vllm", "sglang")
EAGLE3_ARCH = "LlamaForCausalLMEagle3"  # vLLM registry -> Eagle3LlamaForCausalLM; SGLang EntryClass


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
    cfg = base_config(head, meta, tdtype, engine)  # head.config: the midlayer's LlamaConfig
    if cfg.get("hidden_act", "silu") != "silu":
        raise SelfspecError(f"{engine}'s EAGLE-3 layer supports silu MLPs only, this head has {cfg['hidden_act']}")
    for k in ("layer_types", "eagle_feature_layers", "use_sliding_window", "sliding_window", "max_window_layers",
              AUX_IDS):
        cfg.pop(k, None)
    n, vocab = head.lm_head.out_features, head.draft_vocab
    cfg.update(architectures=[EAGLE3_ARCH], model_type="llama", num_hidden_layers=1, head_dim=head_dim(cfg),
               bias=False, attention_bias=False, mlp_bias=False, tie_word_embeddings=False, draft_vocab_size=n,
               target_hidden_size=head.fc.in_features // 3, norm_before_residual=False,
               eagle_config={"use_aux_hidden_state": True, AUX_IDS: [i - 1 for i in head.feature_layers]})
    if engine == "vllm":  # vLLM's convention: the input of target layer i (llama.py's aux_hidden_state_layers)
        cfg[AUX_IDS] = list(head.feature_layers)
    state = {k: v.detach().cpu().to(tdtype).contiguous() for k, v in head.state_dict().items()}
    state["d2t"] = vocab.d2t() if vocab is not None else torch.zeros(n, dtype=torch.long)
    state["t2d"] = vocab.t2d() if vocab is not None else torch.ones(n, dtype=torch.bool)
    default = default_feature_layers(int(cast("PreTrainedConfig", target.config).num_hidden_layers))
    if head.feature_layers != default:
        res.notes.append(f"the head reads target layers {list(head.feature_layers)}, not EAGLE-3's default "
                         f"{list(default)}: the config names them; serve with an engine version that reads {AUX_IDS}")
    out = res.out
    out.mkdir(parents=True, exist_ok=True)
    for stale in (TOKEN_MAP_FILE, "pytorch_model.bin"):
        (out / stale).unlink(missing_ok=True)
    save_safetensors(dict(sorted(state.items())), out / WEIGHTS_FILE, metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True, default=str) + "\n")
    res.files = [WEIGHTS_FILE, "config.json"]
    return res
