"""Logit warping (temperature, top-k, top-p), applied identically to draft and target.

Lossless speculative sampling needs ``p`` and ``q`` to be exactly the distributions that plain
sampling would draw from, so every place that turns logits into probabilities goes through
:func:`warp`. Greedy decoding (temperature 0) never builds probabilities: it uses ``argmax``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Warper:
    """Temperature, then top-k, then top-p (nucleus), as in ``transformers`` sampling.

    ``temperature == 0`` means greedy decoding; :meth:`probs` must not be called then.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Warped probabilities, fp32.

        Args:
            logits: ``[..., V]`` raw logits.

        Returns:
            ``[..., V]`` float32 probabilities summing to 1 along the last dim.
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
        return x.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from ``probs`` (``[V]``) with the request's generator."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
