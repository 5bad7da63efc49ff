"""Fine-tuned models at inference: the metadata a fine-tune records, and how a model directory
is built from a base model and an adapter.

A fine-tuned model directory (written by ``selfspec train``, or built by ``selfspec models pull``
from a bundled base and the adapter shipped in ``selfspec/data/adapters/NAME``) holds
``selfspec_finetune.json``: the method it was trained for, its new special tokens and their ids,
and the options of the run. The drafters of ``sdsat`` and ``space`` read it with :func:`read_meta`.

:func:`apply_adapter` builds a fine-tuned directory from the base model and ``adapter/`` (LoRA
weights and the new token rows, see :func:`selfspec.train.finetune.save_adapter`); training uses
the same function, so a bundled fine-tune and a trained one cannot drift apart. Nothing here
imports :mod:`selfspec.train`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, cast

import torch

from ..errors import SelfspecError

META_FILE = "selfspec_finetune.json"
ROWS_FILE = "new_tokens.safetensors"


def add_tokens(model: torch.nn.Module, tokenizer, tokens: list[str]) -> list[int]:
    """Add ``tokens`` as special tokens and grow the embedding (and a tied or untied LM head).

    New rows start at the mean of the existing embedding rows (a neutral input, and a logit no
    larger than an average token's). Returns their ids."""
    if not tokens:
        return []
    hf: Any = model  # an HF model (nn.Module types its methods as Tensor | Module)
    tokenizer.add_tokens(tokens, special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    old = hf.get_input_embeddings().weight.shape[0]
    if max(ids) >= old:
        hf.resize_token_embeddings(max(max(ids) + 1, len(tokenizer)), mean_resizing=False)
        with torch.no_grad():
            emb = hf.get_input_embeddings().weight
            emb[old:] = emb[:old].mean(0)
            out = hf.get_output_embeddings()
            if out is not None and out.weight is not emb:
                out.weight[old:] = out.weight[:old].mean(0)
    return list(ids)


def apply_adapter(base_dir: str | Path, adapter_dir: str | Path, out: str | Path, meta: dict) -> Path:
    """Build a fine-tuned model directory: base weights + new tokens + merged LoRA (atomically).

    Args:
        base_dir: the base model's HF directory (safetensors).
        adapter_dir: written by :func:`save_adapter` (with ``selfspec_finetune.json``).
        out: the model directory to write.
        meta: recorded as ``selfspec_finetune.json`` in ``out``.
    """
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir, out = Path(adapter_dir), Path(out)
    info = json.loads((adapter_dir / META_FILE).read_text())
    tok = AutoTokenizer.from_pretrained(str(base_dir))
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, use_safetensors=True)
    ids = add_tokens(model, tok, info["new_tokens"])
    if ids != info["new_ids"]:
        raise SelfspecError(f"{adapter_dir}: its tokens got ids {ids} on this base, not {info['new_ids']}; "
                            "it was trained on another base model")
    rows = load_file(str(adapter_dir / ROWS_FILE))
    with torch.no_grad():
        cast(torch.nn.Embedding, model.get_input_embeddings()).weight[ids] = rows["input"]
        if "output" in rows:
            model.get_output_embeddings().weight[ids] = rows["output"]
    if (adapter_dir / "adapter_model.safetensors").is_file():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    else:  # full fine-tuning: the adapter directory holds the whole model
        model = AutoModelForCausalLM.from_pretrained(str(adapter_dir), dtype=torch.float32, use_safetensors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def read_meta(model_dir: str | Path | None) -> dict | None:
    """``selfspec_finetune.json`` of a fine-tuned model directory, or None."""
    if model_dir is None:
        return None
    p = Path(model_dir) / META_FILE
    return json.loads(p.read_text()) if p.is_file() else None
