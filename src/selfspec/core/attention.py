"""Which scaled-dot-product-attention kernels our forwards run on.

On CUDA, PyTorch's SDPA may pick cuDNN's attention. cuDNN plans a kernel per input shape, and in
decoding the key length grows by every step's accepted tokens, so each call meets a new shape:
on an H200 (torch 2.11, cuDNN 9, Llama-3.1-8B shape in bf16) a 17-token verify block spent
0.59 ms of host time per attention call in ``_cudnn_attention_forward`` (19 ms a step over 32
layers, doubling the step), and a one-token step 0.08 ms a call
(``experiments/gpu_step_profile.py``). Flash attention, memory-efficient attention and the math
kernel have no per-shape plan, so every forward of the decode loop, the prompt's included, runs
with cuDNN's backend left out. Elsewhere (CPU, MPS) PyTorch's choice stands.

The switch is PyTorch's ``sdpa_kernel`` context: process-wide flags, set for the duration of one
forward and restored after it (another thread's attention in that window sees them too).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def decode_backends(device: torch.device | None) -> list | None:
    """The SDPA backends a decode forward on ``device`` may use, or None to leave PyTorch's choice:
    on CUDA every backend but cuDNN's (flash, memory-efficient, math), elsewhere None."""
    if device is None or device.type != "cuda":
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@contextlib.contextmanager
def decode_attention(device: torch.device | None) -> Iterator[None]:
    """Run the enclosed forward on :func:`decode_backends` (a no-op where that is None)."""
    backends = decode_backends(device)
    if backends is None:
        yield
        return
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends):
        yield
