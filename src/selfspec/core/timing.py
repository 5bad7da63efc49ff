"""Wall-clock timing that counts the accelerator's work: the one timer of the package.

CUDA kernels run asynchronously: a clock read right after a forward returns measures the launch,
not the work. Every timer here first waits for the device's queued work (:func:`sync`), so the
decode loop's step breakdown, the verify cost profile, the drafters' draft-cost estimates, the
tuner's objectives and the peers' wall times all measure the same thing. On CPU (and for
``device=None``) nothing is waited for and the timer is ``time.perf_counter``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

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


def interleaved(cases: Mapping[str, Callable[[], object]] | Mapping[int, Callable[[], object]], rounds: int,
                warmup: int = 1, device: torch.device | None = None,
                reset: Callable[[Any], object] | None = None, clock: Callable[[torch.device | None], float] = now,
                on_round: Callable[[int], object] | None = None) -> dict[Any, list[float]]:
    """The one timing harness of the package's measurements (cost profiles, the kernels choice, the
    draft costs of self-spec and of ``selfspec tune``): each case called once per round, the cases
    in turn within a round, so that a change of the machine's load hits every case alike.

    ``torch.utils.benchmark.Timer`` times one statement in a loop of its own, on one thread by
    default, and cannot put other cases between its calls or undo a call's effect (a KV cache
    that grew); hence this loop. The clock is :func:`now` (waits for the device's queued work),
    injected in tests.

    Args:
        cases: what to time, by name: each called with no argument.
        rounds: measured rounds.
        warmup: rounds run first and not kept (compiles, loads, first-touch allocation).
        device: the device whose queued work the clock waits for.
        reset: called with a case's name after each of its calls, untimed (e.g. the KV cache
            truncated back to its prefix).
        clock: ``clock(device) -> seconds``.
        on_round: called with the round's index (warm-up rounds first) after each round.

    Returns:
        ``{name: [seconds of each measured round]}``.
    """
    times: dict[Any, list[float]] = {name: [] for name in cases}
    for r in range(warmup + rounds):
        for name, case in cases.items():
            t0 = clock(device)
            case()
            seconds = clock(device) - t0
            if reset is not None:
                reset(name)
            if r >= warmup:
                times[name].append(seconds)
        if on_round is not None:
            on_round(r)
    return times
