"""Linear-layer backends chosen at load time (``selfspec.load(..., kernels=...)``, ``--kernels``).

- ``stock``: the model as loaded (PyTorch's default kernels).
- ``onednn``: fp32 weights prepacked for oneDNN (CPU); same model, different rounding.
- ``int8``: int8 weights and per-token int8 activations with integer accumulation; changes the
  model (opt-in), exact with respect to the quantised model.
- ``compact``: fp32 products that read each weight as the GGUF block it came from (Q4_1, Q8_0),
  proven bit for bit at load and decompressed in registers; layers that are not such blocks run on
  oneDNN. Same model, different rounding (:mod:`selfspec.kernels.compact`).
- ``compiled``: the ``onednn`` layers (fp32 on the CPU; elsewhere the stock ones), verified
  through a static-shape step compiled by ``torch.compile`` (:mod:`selfspec.models.compiled_step`):
  fp32, a different operation order, so lossless with respect to ``ar`` on the same backend.
  Opt-in: the first use of each block size compiles for minutes on a small CPU (cached on disk for later processes).
- ``auto``: the fastest fp32 backend on this machine, by a quick measurement cached per model.
"""

from __future__ import annotations

import os

from ..errors import SelfspecError
from .backends import install_backend
from .swap import current_backend, release_originals, released

KERNELS = ("auto", "stock", "onednn", "int8", "compiled", "compact")


def default_kernels() -> str:
    """The backend used when none is named: ``$SELFSPEC_KERNELS`` if set, else ``auto``."""
    value = os.environ.get("SELFSPEC_KERNELS", "").strip() or "auto"
    if value not in KERNELS:
        raise SelfspecError(f"SELFSPEC_KERNELS={value!r} is not a kernels backend; use one of: {', '.join(KERNELS)}")
    return value


__all__ = ["KERNELS", "install_backend", "default_kernels", "current_backend", "release_originals", "released"]
