"""Draft length from the measured verify cost profile and the acceptance seen so far.

For a chain of k drafts, each accepted with probability alpha (the online estimate), the
expected tokens per step are ``(1 - alpha^(k+1)) / (1 - alpha)`` and the cost is
``T(k+1) + k * c`` in units of T(1), where ``c`` is the measured cost of drafting one token.
The budget picks the k with the best tokens per unit cost.

:class:`PositionalAcceptance` keeps the acceptance of each draft position separately (the
fine-tuned self-drafting methods, whose position j is a different token - adaptive token or mask
j - with its own accuracy); methods price a loop by overriding ``value``.
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
            so the acceptance estimate can recover; the interval doubles after each probe that
            leaves drafting unprofitable (up to ``max_probe_every``) and resets once it pays, so
            a draft that never pays costs ever less.
        max_probe_every: the longest probe interval.
    """

    def __init__(self, profile: CostProfile | None, k: int, prior_alpha: float = 0.6,
                 decay: float = 0.95, probe_every: int = 8, max_probe_every: int = 64) -> None:
        self.profile = profile
        self.k = k
        self.decay = decay
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self._interval = probe_every
        # pseudo-counts of accepted drafts and rejections (a geometric model's sufficient stats)
        self.accepted = 2.0 * prior_alpha
        self.rejected = 2.0 * (1.0 - prior_alpha)
        self.draft_cost = 0.0  # seconds per drafted token, running estimate
        self._since_probe = 0

    def set_prior(self, alpha: float, draft_seconds: float) -> None:
        """Start from a known acceptance and per-token draft cost (e.g. measured when the draft
        was tuned) instead of the generic prior and a free draft, so a draft that does not pay
        is not tried at length before the estimates catch up."""
        self.accepted, self.rejected = 2.0 * alpha, 2.0 * (1.0 - alpha)
        self.draft_cost = draft_seconds

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self, room: int) -> int:
        """Draft length for the next step, at most ``room``."""
        if self.profile is None:
            return min(self.k, room)
        a = min(self.alpha, 0.999)
        c = self.draft_cost / self.profile.t1 if self.profile.t1 > 0 else 0.0
        gains = {k: (1 - a ** (k + 1)) / (1 - a) / (self.profile.ratio(k + 1) + k * c)
                 for k in range(1, min(self.k, room) + 1)}
        best_k = max(gains, key=gains.get) if gains else 0
        if best_k and gains[best_k] > 1.0:
            self._interval = self.probe_every
            return best_k
        if best_k:  # drafting does not pay at this acceptance: probe now and then, at the best length
            self._since_probe += 1
            if self._since_probe >= self._interval:
                self._since_probe = 0
                self._interval = min(2 * self._interval, self.max_probe_every)
                return best_k
        return 0

    def best_prefix(self, confidences: list[float]) -> int:
        """How many of the drafted tokens to verify, given each one's draft confidence.

        The chance that the first d drafts are all accepted is estimated as the product of their
        confidences (the draft's probability of its own token); the expected tokens of verifying
        d drafts, 1 + sum of those products, are weighed against T(d + 1). Drafting cost is
        already spent, so it does not change the choice. Without a profile all drafts are kept.
        """
        if self.profile is None or not confidences:
            return len(confidences)
        best_d, best, expected, p_all = 0, 1.0, 1.0, 1.0
        for d, conf in enumerate(confidences, start=1):
            p_all *= conf
            expected += p_all
            value = expected / self.profile.ratio(d + 1)
            if value > best:
                best_d, best = d, value
        return best_d

    def update(self, proposed: int, accepted: int, draft_seconds: float | None = None,
               drafted: int | None = None) -> None:
        """Record one step: ``accepted`` of ``proposed`` verified drafts kept; drafting
        ``drafted`` tokens (default ``proposed``) took ``draft_seconds``."""
        if proposed > 0:
            self.accepted = self.accepted * self.decay + accepted
            self.rejected = self.rejected * self.decay + (1 if accepted < proposed else 0)
        drafted = proposed if drafted is None else drafted
        if draft_seconds is not None and drafted > 0:
            per_tok = draft_seconds / drafted
            self.draft_cost = per_tok if self.draft_cost == 0 else 0.8 * self.draft_cost + 0.2 * per_tok


class PositionalAcceptance:
    """Acceptance of draft position j given positions < j were accepted, with exponential
    forgetting; chooses k from a cost profile (see module docstring)."""

    def __init__(self, profile: CostProfile | None, max_k: int, prior: list[float] | None = None,
                 decay: float = 0.97, first_probe: int = 8, max_probe: int = 64) -> None:
        self.profile, self.max_k, self.decay = profile, max_k, decay
        prior = list(prior or [])
        self.hits = [2.0 * (prior[j] if j < len(prior) else 0.3) for j in range(max_k)]
        self.tries = [2.0] * max_k
        self.first_probe, self.max_probe = first_probe, max_probe
        self.probe_every, self.since = first_probe, 0

    def rates(self) -> list[float]:
        return [h / t for h, t in zip(self.hits, self.tries)]

    def value(self, k: int, verify_tokens: int | None = None) -> float:
        """Expected tokens per T(1) of a loop with k adaptive tokens whose verify step runs
        ``verify_tokens`` tokens (default k + 1, a chain); k = 0 (plain steps) is 1."""
        if k == 0 or self.profile is None:
            return 1.0
        expected, p = 2.0, 1.0
        for a in self.rates()[:k]:
            p *= a
            expected += p
        return expected / (self.profile.ratio(k + 1) + self.profile.ratio(verify_tokens or k + 1))

    def choose(self, room: int, tree: tuple[int, int] | None = None) -> int:
        """k for the next loop (0 = a plain step), at most ``room``. ``tree`` = (depth, nodes) of a
        fixed sampling tree: then only k = its depth is considered, verified at its size."""
        if self.profile is None:
            return min(tree[0] if tree else self.max_k, room)
        if tree is not None:
            ks, size = ([tree[0]] if room >= 1 else []), tree[1]
        else:
            ks, size = range(1, min(self.max_k, room) + 1), None
        best = max(ks, key=lambda k: self.value(k, size), default=0)
        if best and self.value(best, size) > 1.0:
            self.probe_every = self.first_probe
            return best
        if best:
            self.since += 1
            if self.since >= self.probe_every:
                self.since = 0
                self.probe_every = min(2 * self.probe_every, self.max_probe)
                return best
        return 0

    def update(self, proposed: int, accepted: int) -> None:
        for j in range(min(proposed, accepted + 1, self.max_k)):
            self.hits[j] = self.hits[j] * self.decay + (1.0 if j < accepted else 0.0)
            self.tries[j] = self.tries[j] * self.decay + 1.0
