"""Linear-layer backends chosen at load time (``selfspec.load(..., kernels=...)``, ``--kernels``).

- ``stock``: the model as loaded (PyTorch's default kernels).
- ``onednn``: fp32 weights prepacked for oneDNN (CPU); same model, different rounding.
- ``int8``: int8 weights and per-token int8 activations with integer accumulation; changes the
  model (opt-in), exact with respect to the quantised model.
- ``compiled``: the ``onednn`` layers (fp32 on the CPU; elsewhere the stock ones), verified
  through a static-shape step compiled by ``torch.compile`` (:mod:`selfspec.models.compiled_step`):
  fp32, a different operation order, so lossless with respect to ``ar`` on the same backend.
  Opt-in: the first use of each block size compiles for minutes on a small CPU (cached on disk for later processes).
- ``auto``: the fastest fp32 backend on this machine, by a quick measurement cached per model.
"""

from __future__ import annotations

import os

from torch import nn

from ..errors import SelfspecError
from .backends import use_backend
from .swap import KernelState, current_backend, release_originals, released, restore_linears

KERNELS = ("auto", "stock", "onednn", "int8", "compiled")


def default_kernels() -> str:
    """The backend used when none is named: ``$SELFSPEC_KERNELS`` if set, else ``auto``."""
    value = os.environ.get("SELFSPEC_KERNELS", "").strip() or "auto"
    if value not in KERNELS:
        raise SelfspecError(f"SELFSPEC_KERNELS={value!r} is not a kernels backend; use one of: {', '.join(KERNELS)}")
    return value


def apply_kernels(model: nn.Module, kernels: str, model_name: str = "model", keep: bool = False,
                  state: KernelState | None = None) -> str:
    """Put ``model``'s linear layers on backend ``kernels``; returns the backend now in use.

    ``auto`` resolves to a concrete fp32 backend (see :mod:`selfspec.kernels.auto`). With
    ``keep``, converted layers stay cached so switching back is instant (the benchmark does
    this to interleave backends); otherwise layers of other backends are freed. ``state``: the
    model's :class:`KernelState` (``LoadedModel.kernel_state``), where switches are remembered.
    """
    if kernels not in KERNELS:
        raise SelfspecError(f"unknown kernels '{kernels}'; choose one of: {', '.join(KERNELS)}")
    if released(model):
        if kernels == current_backend(model):
            return kernels
        raise SelfspecError(f"{model_name} was loaded for {current_backend(model)} kernels only (its fp32 weights "
                            "were released); load it again to use other kernels")
    if kernels == "auto":
        from .auto import choose

        kernels = choose(model, model_name, state)
    use_backend(model, kernels, keep, state)
    return kernels


__all__ = ["KERNELS", "KernelState", "apply_kernels", "default_kernels", "current_backend", "release_originals",
           "released", "restore_linears"]
