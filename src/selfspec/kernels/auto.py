"""``--kernels auto``: pick the fastest fp32 backend for this model on this machine.

Quick measurement (a few one-token and four-token forwards per candidate after a warm-up),
cached next to the cost profiles so it happens once per model, dtype, device and machine.
Score = T(1) + T(4): one decoding step plus one typical verify step.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from torch import nn

from ..core import kv_cache
from ..core.cost import profile_key, profile_path
from . import onednn


def candidates(model: nn.Module) -> list[str]:
    """The fp32 (lossless) backends that can run this model here."""
    p = next(model.parameters())
    out = ["stock"]
    if onednn.available(p.device, p.dtype) is None:
        out.append("onednn")
    return out


@torch.inference_mode()
def quick_cost(model: nn.Module, context: int = 128, reps: int = 3) -> float:
    """Median seconds of a one-token plus a four-token forward after a ``context``-token prefix."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    cache = kv_cache.new_cache(model.config)
    model(input_ids=torch.randint(0, vocab, (1, context), generator=g).to(device), past_key_values=cache,
          use_cache=True, logits_to_keep=1)
    times = []
    for r in range(reps + 1):
        total = 0.0
        for q in (1, 4):
            ids = torch.randint(0, vocab, (1, q), generator=g).to(device)
            pos = torch.arange(context, context + q, device=device)[None]
            t0 = time.perf_counter()
            model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            total += time.perf_counter() - t0
            kv_cache.truncate(cache, context)
        if r:
            times.append(total)
    return statistics.median(times)


def choose(model: nn.Module, model_name: str) -> str:
    """The backend with the lowest :func:`quick_cost`; cached per model and machine."""
    cands = candidates(model)
    if len(cands) == 1:
        return cands[0]
    path = profile_path(profile_key(model, model_name, "auto-choice"))
    if path.is_file():
        try:
            choice = json.loads(path.read_text())["backend"]
            if choice in cands:
                return choice
        except (json.JSONDecodeError, KeyError):
            pass
    print(f"selfspec: timing fp32 kernels ({', '.join(cands)}) for {model_name} on this machine (once) ...",
          file=sys.stderr)
    from . import apply_kernels

    costs = {}
    for name in cands:  # each candidate as it would run: its layers and its attention function
        apply_kernels(model, name, model_name)
        costs[name] = quick_cost(model)
    apply_kernels(model, "stock", model_name)
    choice = min(costs, key=costs.get)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"backend": choice, "seconds": costs}, indent=1))
    return choice
