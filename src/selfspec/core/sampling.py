"""Logit warping (temperature, top-k, top-p), applied identically to draft and target, and the
two ways a token is drawn.

Lossless speculative sampling needs ``p`` and ``q`` to be exactly the distributions that plain
sampling would draw from, so every place that turns logits into probabilities goes through
:class:`Warper`. Greedy decoding (temperature 0) never builds probabilities: it uses ``argmax``.

Sampling modes (``GenerationConfig.sampling``):

* ``coupled`` (default): the token at text index ``i`` is ``argmax(warped_logits + g_i)``, where
  ``g_i`` (``[V]``) is Gumbel noise from a counter-based generator keyed by ``(seed, i)``
  (:class:`GumbelNoise`). This is an exact sample from ``softmax(warped_logits)`` (the Gumbel-max
  trick), with independent noise at every position, and it does not depend on how many tokens
  were drafted or verified: the text is a function of (seed, prompt) alone, the same for every
  method. Verification is greedy acceptance on the perturbed logits; drafters perturb their own
  logits with the same ``g_i`` so that they agree with the target as often as possible
  (Daliri, Musco and Suresh, "Coupling without Communication and Drafter-Invariant Speculative
  Decoding", 2024).
* ``rejection``: speculative rejection sampling (:func:`~selfspec.core.acceptance.accept_sampling`)
  with the request's ``torch.Generator``; lossless in distribution, but how much randomness a
  step consumes depends on the draft, so the text depends on the method.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (see Warper)


@dataclass(frozen=True)
class Warper:
    """Temperature, then top-k, then top-p (nucleus), as in ``transformers`` sampling.

    ``temperature == 0`` means greedy decoding; :meth:`probs` must not be called then. So does
    any temperature below :data:`GREEDY_BELOW` (as in vLLM): dividing logits by it overflows fp32
    and would turn the distribution into NaNs, while its limit is the argmax anyway.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped probabilities, fp32.

        Args:
            logits: ``[..., V]`` raw logits.

        Returns:
            ``[..., V]`` float32 probabilities summing to 1 along the last dim.
        """
        return self.logits(logits).softmax(dim=-1)

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped logits, fp32: ``logits / temperature`` with the tokens that top-k / top-p
        remove set to ``-inf``; :meth:`probs` is their softmax.

        Args:
            logits: ``[..., V]`` raw logits.
        """
        if self.greedy:
            raise ValueError("Warper.probs is undefined at temperature 0 (greedy): use argmax")
        x = logits.float() / self.temperature
        v = x.shape[-1]
        if 0 < self.top_k < v:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_x, idx = torch.sort(x, dim=-1, descending=False)
            cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
            # drop the low-probability tail whose mass is <= 1 - top_p; always keep the top token
            drop_sorted = cum <= (1.0 - self.top_p)
            drop_sorted[..., -1] = False
            drop = drop_sorted.scatter(-1, idx, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        return x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class GumbelNoise:
    """Counter-based Gumbel noise: ``at(i, V)`` is the same ``[V]`` float32 vector for the same
    (seed, text index i, V), however often and in whatever order it is asked for.

    Each index gets its own CPU ``torch.Generator`` seeded with ``splitmix64(seed, i)``, so the
    noise is the same on every device and machine; it is moved to the device of the logits.
    Recent vectors are cached (a verify step asks for a few indices, drafters for the same).
    """

    def __init__(self, seed: int, keep: int = 64) -> None:
        self.seed = int(seed)
        self.keep = keep
        self._cache: dict[tuple[int, int, torch.device], torch.Tensor] = {}

    def key(self, index: int) -> int:
        """The generator seed for text index ``index``."""
        return _splitmix64((_splitmix64(self.seed & _MASK64) + index) & _MASK64)

    def at(self, index: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[vocab]`` float32 standard Gumbel noise for the token at text index ``index``."""
        device = torch.device(device)
        k = (index, vocab, device)
        g = self._cache.get(k)
        if g is None:
            gen = torch.Generator().manual_seed(self.key(index))
            u = torch.rand(vocab, generator=gen).clamp_(min=torch.finfo(torch.float32).tiny)
            g = u.log_().neg_().log_().neg_().to(device)  # -log(-log u): standard Gumbel
            if len(self._cache) >= self.keep:
                self._cache.pop(next(iter(self._cache)))
            self._cache[k] = g
        return g

    def rows(self, indices: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[len(indices), vocab]``: the noise of each index."""
        return torch.stack([self.at(i, vocab, device) for i in indices])


def perturbed(logits: torch.Tensor, warper: Warper, noise: GumbelNoise, indices: int | list[int]) -> torch.Tensor:
    """Warped logits plus the Gumbel noise of their text indices; the argmax of row r is an
    exact sample from ``warper.probs(logits[r])``.

    Args:
        logits: ``[V]`` (``indices`` an int) or ``[N, V]`` (``indices`` a list of N ints).
    """
    v = logits.shape[-1]
    if isinstance(indices, int):
        g = noise.at(indices, v, logits.device)
    else:
        g = noise.rows(list(indices), v, logits.device)
    return warper.logits(logits) + g


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from ``probs`` (``[V]``) with the request's generator."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
