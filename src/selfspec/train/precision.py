"""``--mixed-precision auto`` (the default): bf16 autocast where it trains faster on this machine.

On a GPU with bf16, autocast in bf16 is the usual choice and is taken without measuring. On a CPU
it is measured, because it is no free win: bf16 autocast pays only where the CPU has bf16 matrix
units (``avx512_bf16``, AMX tiles) and the model's matrices are large enough to fill them
(SmolLM2-135M trained at 495 against 254 tokens/s with AMX; a CPU without those units converts
to and from bf16 for nothing). So on a CPU with the units, a few forward and backward passes of
the model on a batch of the training's shape are timed in fp32 and under bf16 autocast,
interleaved, and bf16 is chosen only when it is clearly faster. Elsewhere: fp32, unmeasured.
Weights and optimiser states stay fp32 either way (Accelerate's mixed precision).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

BF16_UNITS = ("avx512_bf16", "amx_bf16")  # CPU flags of the units bf16 autocast can pay on
MIN_HIDDEN = 256  # below this width no product is large enough for the units to pay: not measured
GAIN = 0.9  # bf16 is chosen when it takes at most this fraction of fp32's time
PROBE_TOKENS = 256  # sequence length of the timed batch at most


@dataclass(frozen=True)
class PrecisionChoice:
    """What ``--mixed-precision`` resolved to.

    Attributes:
        precision: Accelerate's ``mixed_precision``: ``no`` (fp32), ``bf16`` or ``fp16``.
        reason: one line for the log: why.
        seconds: the timed fp32 and bf16 passes (seconds each), where they were measured.
    """

    precision: str
    reason: str
    seconds: tuple[float, float] | None = None


def choose(requested: str, device: torch.device, model: torch.nn.Module | None, batch_size: int, max_len: int,
           cpu_flags: frozenset[str], timer: Callable[[], float] = time.perf_counter, reps: int = 2) -> PrecisionChoice:
    """Resolve ``requested`` (``auto``, ``no``, ``bf16`` or ``fp16``) for training ``model`` on
    ``device`` with batches of ``batch_size`` x ``max_len`` tokens; ``auto`` on a CPU with bf16
    units times ``model`` (its parameters and gradients are left as they were)."""
    if requested != "auto":
        return PrecisionChoice(requested, "as asked (--mixed-precision)")
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return PrecisionChoice("bf16", "bf16 autocast: a GPU with bf16")
        return PrecisionChoice("no", "fp32: this GPU has no bf16")
    if device.type != "cpu":
        return PrecisionChoice("no", f"fp32 on {device.type}")
    if not any(f in cpu_flags for f in BF16_UNITS):
        return PrecisionChoice("no", "fp32: this CPU has no bf16 units (avx512_bf16 or AMX), where bf16 autocast "
                                     "would only add conversions")
    if model is None or getattr(model.config, "hidden_size", 0) < MIN_HIDDEN:
        return PrecisionChoice("no", f"fp32: a model under {MIN_HIDDEN} wide has no product large enough for the "
                                     "bf16 units to pay")
    fp32, bf16 = time_passes(model, batch_size, min(max_len, PROBE_TOKENS), timer, reps)
    figures = f"a forward and backward pass took {fp32 * 1e3:.0f} ms in fp32, {bf16 * 1e3:.0f} ms under bf16 autocast"
    if bf16 <= GAIN * fp32:
        return PrecisionChoice("bf16", f"bf16 autocast: {figures}", (fp32, bf16))
    return PrecisionChoice("no", f"fp32: {figures} (bf16 is taken from {GAIN:.0%} of fp32's time)", (fp32, bf16))


def time_passes(model: torch.nn.Module, batch_size: int, length: int, timer: Callable[[], float],
                reps: int) -> tuple[float, float]:
    """The fastest of ``reps`` forward + backward passes of ``model`` on ``[batch_size, length]``
    random token ids, in fp32 and under bf16 autocast, interleaved after one untimed pass each:
    ``(fp32 seconds, bf16 seconds)``. The backward runs to the input embeddings through every
    layer (what a LoRA fine-tune's backward does) with the weights frozen for it, so no weight
    gradient is made; the global RNG is left as it was (dropout draws on a forked one)."""
    frozen = [(p, p.requires_grad) for p in model.parameters()]
    gen = torch.Generator().manual_seed(0)
    lm = cast("PreTrainedModel", model)
    vocab = cast(torch.nn.Embedding, lm.get_input_embeddings()).num_embeddings
    ids = torch.randint(0, vocab, (batch_size, length), generator=gen)
    best = {False: float("inf"), True: float("inf")}
    try:
        for p, _ in frozen:
            p.requires_grad_(False)
        with torch.random.fork_rng(devices=[]):
            for i in range(reps + 1):
                for bf16 in (False, True):
                    t = timer()
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                        embeds = lm.get_input_embeddings()(ids).detach().requires_grad_(True)
                        logits = model(inputs_embeds=embeds).logits
                    logits.float().logsumexp(-1).mean().backward()
                    took = timer() - t
                    if i > 0:
                        best[bf16] = min(best[bf16], took)
    finally:
        for p, flag in frozen:
            p.requires_grad_(flag)
    return best[False], best[True]
