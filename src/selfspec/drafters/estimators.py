"""Acceptance estimators shared by every drafter that sizes its drafts, and their constants:
:class:`DecayedRates` (the acceptance of each draft position or tree-template node, with
exponential forgetting, from a prior) and :class:`ConfidenceCalibration` (the chance that a draft
of a given confidence is accepted, learned online per confidence decile)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

PLAIN_RATE = 1.0
"""Tokens per T(1) of a plain (undrafted) step: a draft size must beat it to be worth verifying."""
FIRST_PROBE = 8
"""Steps between probe drafts once drafting stops paying."""
MAX_PROBE = 64
"""The longest probe interval: it doubles after each probe, up to this."""
PRIOR_WEIGHT = 2.0
"""Pseudo-observations behind a prior acceptance (how fast real observations override it)."""
CHAIN_DECAY = 0.95
"""Weight of past observations per drafting step in :class:`ChainBudget`'s single acceptance rate."""
RATE_DECAY = 0.97
"""Weight of past observations per verified step in per-position / per-node rates
(:class:`PositionalAcceptance`, MSN's template nodes): each sees fewer observations per step."""
COST_EMA = 0.8
"""Weight of the past in the moving estimates of measured seconds (draft cost per token in
:class:`ChainBudget`; tokens and seconds of drafted steps in :class:`Backoff`)."""


class DecayedRates:
    """Acceptance of each of a fixed set of slots (draft positions, tree template nodes): hits per
    try with exponential forgetting, from a prior worth :data:`PRIOR_WEIGHT` observations."""

    def __init__(self, prior: Iterable[float], decay: float = RATE_DECAY) -> None:
        self.decay = decay
        self.hits = [PRIOR_WEIGHT * a for a in prior]
        self.tries = [PRIOR_WEIGHT] * len(self.hits)

    def __len__(self) -> int:
        return len(self.hits)

    def rate(self, j: int) -> float:
        return self.hits[j] / self.tries[j]

    def rates(self) -> list[float]:
        return [h / t for h, t in zip(self.hits, self.tries)]

    def observe(self, j: int, hit: bool) -> None:
        """Slot ``j`` was verified (tried) and accepted or not."""
        self.tries[j] = self.tries[j] * self.decay + 1.0
        self.hits[j] = self.hits[j] * self.decay + (1.0 if hit else 0.0)


class ConfidenceCalibration:
    """The chance that a draft token is accepted given its draft confidence (the draft's own
    probability of the token it proposes), learned online per confidence decile.

    A draft's confidence is a poor acceptance estimate when the draft is a near copy of the
    target: SmolLM2's whole-model int8 draft agrees with the target on 85% of the tokens it
    proposes with confidence 0.2-0.3 (MT-bench). Each decile keeps a ratio, accepted drafts per
    unit of their summed confidence, and a draft of confidence c gets ``c`` times its decile's
    ratio (at most 1; the ratio at most what takes the decile's midpoint to 1). A ratio, not the
    decile's acceptance itself: in an EAGLE tree most candidates have path probabilities far
    below 0.1, and giving each the acceptance measured for the lowest decile (0.04, from the
    candidates near 0.1 that get verified) summed to several phantom tokens and sized 64-node
    trees (3 T(1)) that committed 2. Ratios start at 1 (the identity, worth :data:`PRIOR_WEIGHT`
    drafts at the midpoint) and follow what verification shows, with :data:`RATE_DECAY`
    forgetting. Only the verified prefix up to the first rejection is observed: drafts after a
    rejection were never tested on their own.
    """

    BINS = 10

    def __init__(self, decay: float = RATE_DECAY) -> None:
        self.decay = decay
        mids = [(i + 0.5) / self.BINS for i in range(self.BINS)]
        self.hits = [PRIOR_WEIGHT * m for m in mids]  # decayed accepted drafts per decile
        self.mass = [PRIOR_WEIGHT * m for m in mids]  # decayed summed confidence of its tested drafts
        self.caps = [1.0 / m for m in mids]

    def _bin(self, confidence: float) -> int:
        return min(max(int(confidence * self.BINS), 0), self.BINS - 1)

    def ratio(self, j: int) -> float:
        """Accepted drafts per unit of confidence in decile ``j``."""
        return min(self.hits[j] / self.mass[j], self.caps[j]) if self.mass[j] > 0 else self.caps[j]

    def __call__(self, confidence: float) -> float:
        """The estimated acceptance of a draft of this confidence."""
        return min(1.0, confidence * self.ratio(self._bin(confidence)))

    def table(self) -> list[float]:
        """Each decile's ratio, lowest first (for vectorised lookups: chance = min(1, c * ratio))."""
        return [self.ratio(j) for j in range(self.BINS)]

    def observe_one(self, confidence: float, hit: bool) -> None:
        """One draft of this confidence was tested and accepted or not."""
        j = self._bin(confidence)
        self.mass[j] = self.mass[j] * self.decay + max(confidence, 0.0)
        self.hits[j] = self.hits[j] * self.decay + (1.0 if hit else 0.0)

    def observe(self, confidences: Sequence[float], verified: int, accepted: int) -> None:
        """One verified chain: its first ``verified`` drafts (confidences in draft order) were
        checked and the first ``accepted`` of them kept."""
        for j in range(min(verified, accepted + 1, len(confidences))):
            self.observe_one(confidences[j], j < accepted)
