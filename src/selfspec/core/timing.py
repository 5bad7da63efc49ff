"""Wall-clock timing that counts the accelerator's work: the one timer of the package.

CUDA kernels run asynchronously: a clock read right after a forward returns measures the launch,
not the work. Every timer here first waits for the device's queued work (:func:`sync`), so the
decode loop's step breakdown, the verify cost profile, the drafters' draft-cost estimates, the
tuner's objectives and the peers' wall times all measure the same thing. On CPU (and for
``device=None``) nothing is waited for and the timer is ``time.perf_counter``.
"""

from __future__ import annotations

import time

import torch


def sync(device: torch.device | None) -> None:
    """Wait until ``device`` has run everything queued on it (CUDA only; a no-op elsewhere)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def now(device: torch.device | None = None) -> float:
    """``time.perf_counter()`` once ``device``'s queued work has run (see :func:`sync`)."""
    sync(device)
    return time.perf_counter()


class Stopwatch:
    """Seconds since it was started, counting the work queued on ``device`` (see module docstring).

    ``watch = Stopwatch(device)`` starts it; ``watch.elapsed()`` reads it (any number of times).
    As a context manager, ``with Stopwatch(device) as watch: ...`` sets ``watch.seconds`` on exit.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.seconds = 0.0
        self.start = now(device)

    def elapsed(self) -> float:
        return now(self.device) - self.start

    def __enter__(self) -> Stopwatch:
        self.start = now(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = self.elapsed()
