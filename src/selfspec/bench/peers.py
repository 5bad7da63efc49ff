"""Peers: what users would otherwise run, measured in the same process on the same prompt ids.

* ``hf``: ``transformers`` ``generate`` (greedy or sampling).
* ``hf-assisted``: its assisted generation with the same draft model, default settings.
* ``hf-pld``: its prompt lookup decoding (``prompt_lookup_num_tokens``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from ..core.timing import Stopwatch
from ..errors import SelfspecError

if TYPE_CHECKING:
    from transformers import GenerationConfig

PEERS = ("hf", "hf-assisted", "hf-pld")


@dataclass(frozen=True)
class PeerOutput:
    token_ids: list[int]
    wall_s: float


def run_peer(peer: str, model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int, temperature: float,
             top_p: float, top_k: int, seed: int | None, draft: torch.nn.Module | None = None,
             pld_tokens: int = 10) -> PeerOutput:
    """One ``generate`` call; returns the generated ids and its wall time."""
    if peer not in PEERS:
        raise SelfspecError(f"unknown peer '{peer}'; choose from {', '.join(PEERS)}")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    kw: dict = dict(max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(ids))
    if temperature > 0:
        kw.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None)
        torch.manual_seed(seed)
    else:
        kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    gc = cast("GenerationConfig", model.generation_config)
    if gc.pad_token_id is None:
        eos = gc.eos_token_id
        kw["pad_token_id"] = eos[0] if isinstance(eos, list) else eos
    if peer == "hf-assisted":
        if draft is None:
            raise SelfspecError("peer hf-assisted needs --draft-model")
        kw["assistant_model"] = draft
    elif peer == "hf-pld":
        kw["prompt_lookup_num_tokens"] = pld_tokens
    with Stopwatch(device) as watch, torch.inference_mode():
        out = cast("Callable[..., torch.Tensor]", model.generate)(ids, **kw)  # transformers' generate: the ids tensor
    return PeerOutput(out[0, len(prompt_ids) :].tolist(), watch.seconds)
