"""Draft length from the measured verify cost profile and the acceptance seen so far.

For a chain of k drafts, each accepted with probability alpha (the online estimate), the
expected tokens per step are ``(1 - alpha^(k+1)) / (1 - alpha)`` and the cost is
``T(k+1) + k * c`` in units of T(1), where ``c`` is the measured cost of drafting one token.
The budget picks the k with the best tokens per unit cost.
"""

from __future__ import annotations

from ..core.cost import CostProfile


class ChainBudget:
    """Chooses the draft length k for chain drafters.

    Args:
        profile: the target's verify cost profile, or None to use ``k`` as a fixed length.
        k: fixed draft length when ``profile`` is None; otherwise the largest k considered.
        prior_alpha: acceptance assumed before anything was observed.
        decay: weight of old observations per step (exponential forgetting).
        probe_every: draft at least one token every this many steps even when k = 0 looks best,
            so the acceptance estimate can recover.
    """

    def __init__(self, profile: CostProfile | None, k: int, prior_alpha: float = 0.6,
                 decay: float = 0.95, probe_every: int = 8) -> None:
        self.profile = profile
        self.k = k
        self.decay = decay
        self.probe_every = probe_every
        # pseudo-counts of accepted drafts and rejections (a geometric model's sufficient stats)
        self.accepted = 2.0 * prior_alpha
        self.rejected = 2.0 * (1.0 - prior_alpha)
        self.draft_cost = 0.0  # seconds per drafted token, running estimate
        self._since_probe = 0

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, room: int) -> int:
        """Draft length for the next step, at most ``room``."""
        if self.profile is None:
            return min(self.k, room)
        a = min(self.alpha, 0.999)
        c = self.draft_cost / self.profile.t1 if self.profile.t1 > 0 else 0.0
        best_k, best = 0, 1.0
        for k in range(1, min(self.k, room) + 1):
            gain = (1 - a ** (k + 1)) / (1 - a) / (self.profile.ratio(k + 1) + k * c)
            if gain > best:
                best_k, best = k, gain
        if best_k == 0 and room > 0:
            self._since_probe += 1
            if self._since_probe >= self.probe_every:
                self._since_probe = 0
                return 1
        return best_k

    def update(self, proposed: int, accepted: int, draft_seconds: float | None = None) -> None:
        """Record one verified chain: ``accepted`` of ``proposed`` drafts kept."""
        if proposed <= 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1 if accepted < proposed else 0)
        if draft_seconds is not None:
            per_tok = draft_seconds / proposed
            self.draft_cost = per_tok if self.draft_cost == 0 else 0.8 * self.draft_cost + 0.2 * per_tok
