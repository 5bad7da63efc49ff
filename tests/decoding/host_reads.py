"""Counting host reads of device values on a CPU-only machine (issue 34, item 4).

On a GPU every read of a tensor's value on the host (``.item()``, ``.tolist()``, ``float(t)``,
``bool(t)``, ``.cpu()``...) waits for the device: a sync. On a CPU there is no device to wait
for, so a test cannot see them by timing. :class:`HostReads` sees them by provenance: a
``TorchFunctionMode`` marks every tensor that would live on the device (the model's parameters
and buffers, tensors made with an explicit ``device=``, moved there with ``.to(...)``, and
everything computed from those), and counts each read of a marked tensor's value on the host.
Tensors built from Python lists without a device (token ids, tree structure) are host tensors,
and reading them is free.
"""

from __future__ import annotations

import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu", "__complex__"}


class HostReads(TorchFunctionMode):
    """Counts host reads of device-resident values while active (``with HostReads(model) as r``).

    Attributes:
        count: reads so far while not :attr:`paused`.
        where: the name of each counted read, in order.
        paused: while True, reads are not counted (marks still propagate).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self._device: dict[int, weakref.ref] = {}
        for t in list(model.parameters()) + list(model.buffers()):
            self._mark(t)
        self.count = 0
        self.where: list[str] = []
        self.paused = False

    def _mark(self, t: torch.Tensor) -> None:
        self._device[id(t)] = weakref.ref(t)

    def on_device(self, t: object) -> bool:
        """Whether ``t`` is a tensor that would live on the device."""
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._device.get(id(t))
        return ref is not None and ref() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = tree_flatten((args, kwargs))[0]
        device_in = any(self.on_device(a) for a in inputs)
        if name in READS and device_in and not self.paused:
            self.count += 1
            self.where.append(name)
        out = func(*args, **kwargs)
        moved = name == "to" and any(isinstance(a, (torch.device, str)) for a in inputs)
        made_on_device = kwargs.get("device") is not None
        if name != "cpu" and (device_in or moved or made_on_device):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._mark(t)
        return out
