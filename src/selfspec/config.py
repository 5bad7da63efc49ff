"""Frozen configuration dataclasses, validated once at the API boundary."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import SelfspecError

log = logging.getLogger(__name__)

SAMPLING_MODES = ("coupled", "rejection")  # see selfspec.core.sampling


def stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of stop strings: a plain string is ONE stop string (as in the OpenAI
    API), not one per character; None is none."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    return tuple(stop)


def seed_arg(value: str) -> int:
    """``argparse`` type of every ``--seed``: an integer in [0, 2^63), else a one-line error."""
    import argparse

    try:
        seed = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seed {value!r}: use an integer >= 0") from None
    if not 0 <= seed < 2**63:
        raise argparse.ArgumentTypeError(f"seed must be an integer in [0, 2^63), not {seed}")
    return seed


def check_threads(threads: object, name: str = "threads") -> int | None:
    """``threads`` (CPU threads of torch) as an int >= 1, or None for torch's choice; else a
    one-line error naming ``name``."""
    if threads is None:
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise SelfspecError(f"{name} must be an integer >= 1 (or left out for torch's choice), not {threads!r}")
    cores = os.cpu_count()
    if cores is not None and threads > cores:
        log.warning("%s=%d is more than this machine's %d cores: the extra threads share cores and usually slow "
                    "decoding down", name, threads, cores)
    return threads


def threads_arg(value: str) -> int:
    """``argparse`` type of every ``--threads``: an integer >= 1 (0 used to be silently ignored)."""
    import argparse

    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid thread count {value!r}: use an integer >= 1") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"the thread count must be at least 1, not {n}; leave --threads out for "
                                         "torch's choice")
    return n


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate. ``temperature == 0`` is greedy decoding.

    Attributes:
        max_new_tokens: generated token ids at most (>= 1).
        temperature: 0 for greedy, > 0 to sample (below 1e-5: greedy, see ``core.sampling.Warper``).
        top_k: keep the k most likely tokens when sampling; 0 = off.
        top_p: nucleus mass in (0, 1]; 1 = off.
        seed: seed of the sampler (>= 0); None draws a fresh one, which the result reports so
            the run can be reproduced.
        stop: stop strings; generation ends after the token that completes one, and the text
            ends before the stop string (as in the OpenAI API) unless ``include_stop``. A plain
            string is one stop string.
        ignore_eos: keep generating past end-of-sequence tokens (benchmarks, tests).
        sampling: ``coupled`` (default: Gumbel-max noise keyed by (seed, position), so a seed
            gives the same text for every method) or ``rejection`` (speculative rejection
            sampling: lossless in distribution, but the text depends on the method's drafts).
            See :mod:`selfspec.core.sampling`.
        include_stop: keep the stop string at the end of the text.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    sampling: str = "coupled"
    include_stop: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise SelfspecError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise SelfspecError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or math.isinf(t) or t < 0:
            raise SelfspecError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SelfspecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise SelfspecError(f"top_p must be in (0, 1] (1 = off), got {p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise SelfspecError(f"seed must be an integer in [0, 2^63) (or None for a fresh random seed), "
                                f"got {self.seed!r}")
        if self.sampling not in SAMPLING_MODES:
            raise SelfspecError(f"sampling must be one of {', '.join(SAMPLING_MODES)}, got {self.sampling!r}")
        object.__setattr__(self, "stop", stop_strings(self.stop))  # frozen: normalised once, here
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SelfspecError("stop strings must be non-empty strings")
