"""Frozen configuration dataclasses, validated once at the API boundary."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import SelfspecError


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate. ``temperature == 0`` is greedy decoding.

    Attributes:
        max_new_tokens: generated token ids at most (>= 1).
        temperature: 0 for greedy, > 0 to sample.
        top_k: keep the k most likely tokens when sampling; 0 = off.
        top_p: nucleus mass in (0, 1]; 1 = off.
        seed: seed of the request's own ``torch.Generator`` (sampling only).
        stop: stop strings; generation ends after the token that completes one.
        ignore_eos: keep generating past end-of-sequence tokens (benchmarks, tests).
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

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
        if not isinstance(self.seed, int):
            raise SelfspecError(f"seed must be an integer, got {self.seed!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise SelfspecError("stop strings must be non-empty strings")
